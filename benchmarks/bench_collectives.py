"""The layer's collectives on several GPUs, one transport against another (the exchanges side by side).

    python -m torch.distributed.run --nproc_per_node W benchmarks/bench_collectives.py --out DIR
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_collectives.py --cpu --out DIR   # smoke (gloo)

For each shape (T query tokens, H = 128 heads, top-k 2048, W ranks) and each transport — ``nccl``
(:class:`dcp_ref.group.TorchDistributedGroup`) and ``symm`` (:class:`dcp_ref.group.SymmetricMemoryGroup`,
PyTorch symmetric memory with NCCL as its fallback) — it times, as CUDA-graph replays, every collective a
decode layer can call: the query all-gather over heads, the candidates' all-gather (8-byte pairs or 4-byte
scores), the LSE all-gather, the output reduce-scatter, and the combine's one all-to-all; and the two
combines whole (``allgather+reduce_scatter`` against ``alltoall``). Rank 0 writes ``exchange_W{W}.json``:
rows ``{"W", "transport", "collective", "T", "bytes_per_rank", "us"}`` (``us``: median of replays, each
graph holding ``--calls`` back-to-back calls), with device, versions and date. ``--cpu`` runs the same code
eagerly on gloo (timings meaningless; it checks the script).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any

import _timing  # the benchmarks' folder is on sys.path (run as a script)
import torch
import torch.distributed as dist

H, DQK, DV, TOPK = 128, 576, 512, 2048


def _shapes(T: int, W: int) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    hs = H // W
    return {
        "query_allgather": ("all_gather", (T, hs, DQK), torch.bfloat16),
        "candidates_allgather_pairs": ("all_gather", (T, TOPK, 2), torch.float32),
        "candidates_allgather_scores": ("all_gather", (T, TOPK), torch.float32),
        "lse_allgather": ("all_gather", (T, H), torch.float32),
        "output_reduce_scatter": ("reduce_scatter", (W * T, hs, DV), torch.bfloat16),
        "combine_alltoall": ("all_to_all", (W, T * hs * DV * 2 + T * hs * 4), torch.uint8),
    }


def _time(fn: Any, cpu: bool, calls: int) -> float:
    """Median µs per call (``_timing``): graph replays of ``calls`` back-to-back calls (eager wall time on the CPU).
    The rule's fixed counts keep every rank's collectives in step."""
    if cpu:
        return _timing.host(fn, device="cpu").median_us
    return _timing.graph(fn, calls=calls).median_us


def bench(group: Any, transport: str, T: int, dev: torch.device, cpu: bool, calls: int) -> list[dict[str, Any]]:
    W = group.world_size
    rows = []
    bufs: dict[str, tuple[torch.Tensor, torch.Tensor, str]] = {}
    for name, (kind, shape, dtype) in _shapes(T, W).items():
        x = torch.ones(shape, dtype=dtype, device=dev)
        if kind == "all_gather":
            out = torch.empty((W, *shape), dtype=dtype, device=dev)
        elif kind == "reduce_scatter":
            out = torch.empty((shape[0] // W, *shape[1:]), dtype=dtype, device=dev)
        else:
            out = torch.empty_like(x)
        bufs[name] = (x, out, kind)

    def call(name: str) -> None:
        x, out, kind = bufs[name]
        if kind == "all_gather":
            group.all_gather(x, out=out)
        elif kind == "reduce_scatter":
            group.reduce_scatter(x, 0, out=out)
        else:
            group.all_to_all(x, out=out)

    for name in bufs:
        x = bufs[name][0]
        us = _time(lambda n=name: call(n), cpu, calls)
        rows.append({"W": W, "transport": transport, "collective": name, "T": T,
                     "bytes_per_rank": x.numel() * x.element_size(), "us": us})  # fmt: skip
    # the two combines whole: LSE all-gather + reduce-scatter, against one all-to-all
    us = _time(lambda: (call("lse_allgather"), call("output_reduce_scatter")), cpu, calls)
    rows.append({"W": W, "transport": transport, "collective": "combine=allgather+reduce_scatter", "T": T,
                 "bytes_per_rank": None, "us": us})  # fmt: skip
    us = _time(lambda: call("combine_alltoall"), cpu, calls)
    rows.append({"W": W, "transport": transport, "collective": "combine=alltoall", "T": T, "bytes_per_rank": None,
                 "us": us})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--T", default="1,32,128")
    ap.add_argument("--transports", default="nccl,symm")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU, eager: a smoke test of the script")
    args = ap.parse_args()
    from dcp_ref.group import SymmetricMemoryGroup, TorchDistributedGroup

    rank = int(os.environ.get("RANK", "0"))
    if args.cpu:
        dist.init_process_group("gloo")
        dev = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", device_id=dev)
    base = TorchDistributedGroup()
    rows: list[dict[str, Any]] = []
    notes: dict[str, str] = {}
    for transport in args.transports.split(","):
        group: Any = base
        if transport == "symm":
            group = SymmetricMemoryGroup(base, capacity_bytes=64 << 20)
            notes["symm"] = group.transport + (f" ({group.why_fallback})" if group.why_fallback else "")
        for T in (int(t) for t in args.T.split(",")):
            rows += bench(group, transport, T, dev, args.cpu, args.calls)
    dist.barrier()
    if rank == 0:
        import importlib.metadata as md

        doc = {
            "device": "cpu (gloo smoke test)" if args.cpu else torch.cuda.get_device_name(dev),
            "versions": {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "triton": md.version("triton") if _has("triton") else None,
            },
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "how": __doc__.split("\n\n")[1] if __doc__ else "",
            "transport_notes": notes,
            "rows": rows,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"exchange_W{base.world_size}.json").write_text(json.dumps(doc, indent=1))
        print(f"wrote {out / f'exchange_W{base.world_size}.json'}: {len(rows)} rows", flush=True)
    if args.cpu:
        dist.destroy_process_group()
    else:
        os._exit(0)  # NCCL teardown after captured collectives hung on these machines (CONTRIBUTING)


def _has(name: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
