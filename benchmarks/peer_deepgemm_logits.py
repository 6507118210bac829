#!/usr/bin/env python3
"""DeepGEMM's ``fp8_paged_mqa_logits`` on the scoring benchmark's inputs — the peer of ``bench_scoring.py``.

    source .gpu/deepgemm/env.sh && PYTHONPATH=$DCP_DEEPGEMM_SITE python3 benchmarks/peer_deepgemm_logits.py \
        --out $OUT/deepgemm_logits.json [--quick]

Run it in **its own process** (DeepGEMM 0.2.0 and its apache-tvm-ffi 0.1.11 clash with FlashInfer's 0.1.15: see
``../shared/gpu/README.md``), in the same device call as ``bench_scoring.py``, which reads the JSON
(``--deepgemm``). The inputs are the same bytes (``_scoring_inputs.build_inputs``, same seed), converted to
what DeepGEMM takes — conventions read in deepseek-ai/DeepGEMM (``csrc/apis/attention.hpp``,
``tests/test_attention.py``, and the sgl-deep-gemm 0.2.0 wheel's Python wrapper):

* ``q``: float8_e4m3fn ``[B, next_n, 64, 128]`` contiguous — here ``B = T``, ``next_n = 1``;
* ``kv_cache``: uint8 ``[num_blocks, 64, 1, 132]`` (SM90: ``block_kv == 64``), each block's 64 x 128 values then
  its 64 float32 scales — our cache's bytes as they are (``as_deepgemm_kv_cache``);
* ``weights``: float32 ``[B * next_n, 64]`` contiguous;
* ``context_lens``: int32 ``[B, next_n]`` contiguous — **2-D**: ``DG_HOST_ASSERT(context_lens.dim() == 2)`` in
  both ``get_paged_mqa_logits_metadata`` and ``fp8_paged_mqa_logits`` (the first attempt passed ``[B]``);
  entry ``[b, i]`` is token ``(b, i)``'s own context length;
* ``block_table``: int32 ``[B, max_blocks]``, unit column stride;
* ``schedule_meta = get_paged_mqa_logits_metadata(context_lens, 64, get_num_sms())`` (reported separately);
* ``clean_logits=False`` (it asserts ``not is_context_lens_2d`` when cleaning): columns past a token's length
  are left unwritten, so only the valid columns are compared.

The output ``[B * next_n, max_context_len]`` float32 (row stride rounded up) is checked against the float64
reference (``dcp_ref.scoring.index_scores``) on the first rows: relative error over the valid columns. Each
shape is wrapped in try/except and its error text recorded (nobody has run this on the device yet). Timing: a
CUDA graph of back-to-back calls if the call captures, else CUDA events (``do_bench``); the logits call
allocates its output each call (inside the graph: from the graph's pool).

FlashInfer 0.7's ``fp8_paged_mqa_logits`` is an SM100-only CuTeDSL kernel: not a peer on the H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _meta  # this folder
import _scoring_inputs as si  # this folder; it also puts the project on sys.path


def deepgemm_args(inp: dict[str, torch.Tensor], dg: Any) -> dict[str, Any]:
    """Our inputs in DeepGEMM's layout (no copy of the cache: the same bytes)."""
    from dcp_ref.index_cache import as_deepgemm_kv_cache

    t = inp["index_q"].shape[0]
    n = inp["block_table"].shape[1] * si.BLOCK
    context_lens = inp["local_bounds"].to(torch.int32).view(t, 1).contiguous()  # [B, next_n], 2-D
    return {
        "q": inp["index_q"].view(t, 1, si.HEADS, si.DIM).contiguous(),
        "kv_cache": as_deepgemm_kv_cache(inp["index_cache"], si.BLOCK),
        "weights": inp["weights"].contiguous(),
        "context_lens": context_lens,
        "block_table": inp["block_table"].to(torch.int32).contiguous(),
        "max_context_len": n,
    }


def run_shape(t: int, n: int, dg: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"T": t, "L": n}
    try:
        inp = si.build_inputs(t, n)
        a = deepgemm_args(inp, dg)
        num_sms = dg.get_num_sms()
        meta_fn = lambda: dg.get_paged_mqa_logits_metadata(a["context_lens"], si.BLOCK, num_sms)  # noqa: E731
        schedule = meta_fn()
        logits_fn = lambda: dg.fp8_paged_mqa_logits(  # noqa: E731
            a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"], schedule, a["max_context_len"],
            clean_logits=False,
        )  # fmt: skip
        logits = logits_fn()
        torch.cuda.synchronize()
        rec["logits_shape"] = list(logits.shape)
        rec["logits_stride"] = list(logits.stride())
        ref = si.reference_rows(inp)
        rec["max_rel_err"] = si.rel_error(logits, ref)
        rec["ref_rows"] = ref.shape[0]
        rec["logits"] = si.graph_time(logits_fn)
        rec["deepgemm_us"] = rec["logits"]["median_us"]
        rec["metadata"] = si.graph_time(meta_fn)
        rec["metadata_us"] = rec["metadata"]["median_us"]

        def both() -> None:
            s = dg.get_paged_mqa_logits_metadata(a["context_lens"], si.BLOCK, num_sms)
            dg.fp8_paged_mqa_logits(
                a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"], s, a["max_context_len"],
                clean_logits=False,
            )  # fmt: skip

        rec["metadata_plus_logits"] = si.graph_time(both)
    except Exception as e:  # noqa: BLE001 - recorded per shape: the next shape still runs
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["traceback"] = traceback.format_exc()[-3000:]
    torch.cuda.empty_cache()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help=f"only {si.QUICK}")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    data: dict[str, Any] = {"peer": "DeepGEMM fp8_paged_mqa_logits", "date_utc": _meta.now_utc(), "argv": sys.argv[1:]}
    try:
        import deep_gemm as dg

        data["versions"] = _meta.versions(import_missing=False) | {
            "deep_gemm": getattr(dg, "__version__", None),
            "deep_gemm_file": getattr(dg, "__file__", None),
        }
        data["device"] = si.device_info()
        try:
            from importlib.metadata import version

            data["versions"]["sgl_deep_gemm"] = version("sgl-deep-gemm")
            data["versions"]["apache_tvm_ffi"] = version("apache-tvm-ffi")
        except Exception:  # noqa: BLE001 - metadata missing: recorded as such
            pass
    except Exception as e:  # noqa: BLE001 - no DeepGEMM: the JSON says why
        data["error"] = f"import deep_gemm: {type(e).__name__}: {e}"[:2000]
        data["shapes"] = []
        with open(args.out, "w") as fh:
            json.dump(data, fh, indent=1)
        print(data["error"], file=sys.stderr)
        return 2
    data["shapes"] = []
    for t, n in si.QUICK if args.quick else si.SHAPES:
        rec = run_shape(t, n, dg)
        data["shapes"].append(rec)
        with open(args.out, "w") as fh:  # after every shape: a timeout keeps what was measured
            json.dump(data, fh, indent=1)
        print(
            f"deepgemm T={t:4d} L={n:6d} logits={rec.get('deepgemm_us', float('nan')):9.1f} us "
            f"({rec.get('logits', {}).get('timing')}) metadata={rec.get('metadata_us', float('nan')):7.1f} us "
            f"rel_err={rec.get('max_rel_err')} {rec.get('error', '')[:200]}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
