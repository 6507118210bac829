#!/usr/bin/env python3
"""DeepGEMM's ``fp8_paged_mqa_logits`` on the scoring benchmark's inputs — the peer of ``bench_scoring.py``.

On the H200, from the repo root, carrying the source build of DeepGEMM (``.gpu/dgsrc``, made by
``../shared/gpu/deepgemm-src/make-dgsrc``; its README says why the PyPI wheels are no use under torch 2.11):

    run(carry=[".gpu/dgsrc"], command="bash tools/dgsrc_unpack.sh && PYTHONPATH=/tmp/dg DG_JIT_CACHE_DIR=/tmp/dgjit \
        python3 benchmarks/peer_deepgemm_logits.py --out $OUT/deepgemm_logits.json [--quick] [--next-n 1,2] \
        [--shapes 32x32768,64x32768x2]")

``tools/dgsrc_unpack.sh`` does what ``.gpu/dgsrc/build_and_probe.sh`` does before it builds or probes (sources and
the CPU-built ``deep_gemm._C`` into ``/tmp/dg``, the seeded JIT cache into ``/tmp/dgjit``: seconds), without
the build or the 9-shape probe (minutes). ``bench_scoring.py`` reads the JSON (``--deepgemm``): run this
first, in its own process, in the same device call (its header has the whole command). The inputs are the same
bytes (``_scoring_inputs.build_inputs``, same seed; ``.gpu/dgsrc/probe.py`` builds them the same way), in
DeepGEMM's layout — its host asserts (``csrc/apis/attention.hpp``), checked here before the call:

* ``q``: float8_e4m3fn ``[B, next_n, H, 128]`` contiguous, ``H`` 32 or 64 on SM90 — here ``B = T / next_n``,
  ``next_n`` 1 or 2 (``next_n = 2``: MTP, two consecutive tokens of one request), ``H = 64``;
* ``kv_cache``: uint8 ``[num_blocks, 64, 1, 132]`` (SM90: ``block_kv == 64``), each block's 64 x 128 e4m3
  values then its 64 float32 scales — our cache's bytes as they are (``as_deepgemm_kv_cache``, no copy);
* ``weights``: float32 ``[B * next_n, H]`` contiguous;
* ``context_lens``: int32 ``[B, next_n]`` contiguous — **2-D** (``DG_HOST_ASSERT(context_lens.dim() == 2)``):
  each token's own length, ``local_bounds.view(B, next_n)`` (token ``i`` of a request sees ``L - next_n + 1 +
  i`` keys). What SM90 does with it (DeepGEMM 2.6.1 @ 54e22612, ``deep_gemm/include/deep_gemm/scheduler/
  sm90_paged_mqa_logits.cuh`` and ``impls/sm90_fp8_paged_mqa_logits.cuh``): the metadata kernel and the
  scheduler size a request's work by its *last* token's length only (``context_lens[b * next_n + next_n - 1]``,
  in 64-key blocks, so that must be the request's longest); each 64-key block is read once per request and
  scored for all ``next_n`` tokens in one ``[next_n * H, 128] x [128, 64]`` WGMMA, and every token's row is
  written over all those blocks — the columns past an earlier token's own length get a real score, not
  ``-inf`` (``clean_logits`` would mask them, but it asserts 1-D lengths). DeepGEMM's test masks them before
  it compares (``tests/test_attention.py``); so do both references here (NaN / ``-inf`` there, skipped);
* ``block_table``: int32 ``[B, max_blocks]``, unit column stride;
* ``schedule_meta = get_paged_mqa_logits_metadata(context_lens, 64, get_num_sms())`` (timed separately, and
  with the logits call);
* ``clean_logits=False`` (cleaning asserts 1-D context lengths): columns past the request's blocks are not
  written; here they are all valid (``next_n = 1``) or all but the last ``next_n - 1`` columns of the earlier
  tokens (``writes_past_token_length``: whether DeepGEMM wrote finite values there).

The output, float32 ``[B * next_n, max_context_len]`` with its row stride rounded up to 256, is checked against
two references on the same inputs: the float64 oracle (``dcp_ref.scoring.index_scores``) on the first
``REF_ROWS`` rows — ``max_rel_err``, the same measure as ``bench_scoring.py``'s for ours — and DeepGEMM's own
test's ``sum_h w * relu(q . (k * scale))`` in float32 on every row, over each token's own length, computed from
the DeepGEMM-layout tensors (``max_rel_err_fp32_all_rows``). Timing: ``_timing.graph_row``, as
``bench_scoring.py`` times ours (a CUDA graph of back-to-back calls, L2 flushed before each replay, median /
calls; CUDA events when the call does not capture); the logits call allocates its output each call
(inside the graph: from its pool). ``kv_read_TBps``: the keys once per request over the logits time.

Crash isolation: the shapes run in a child process (``--child``), which names its shape and step in a progress
file before each step. A child that dies (a segfault: the device-built ``_C.so`` did, README) or stays in one
step longer than ``--shape-timeout`` has that shape recorded with its step, exit status and stderr tail
(``-X faulthandler``), and a new child takes the remaining shapes; a shape that died in a CUDA-graph step is
retried once with CUDA events only. An exception inside a shape is recorded in that shape's row. The JSON is
rewritten whenever a child moves on, so a timeout of the whole call keeps what was measured; ``--budget``
bounds the whole run, so that ``bench_scoring.py`` keeps its share of the call.

Shapes: ``bench_scoring.py``'s — ``_scoring_inputs.SHAPES`` at ``next_n = 1`` and ``MTP_SHAPES`` at ``next_n =
2`` (``--next-n 1`` or ``2``: one family; ``--quick``: ``QUICK`` / ``QUICK_MTP``), or ``--shapes TxL[xN],...``
(``N`` = next_n, default 1; ``T`` query tokens). Each JSON row carries ``T``, ``B``, ``L`` and ``next_n``;
``bench_scoring.py`` joins them to its rows on ``(T, L, next_n)``. The seeded JIT cache (``.gpu/dgsrc``) holds
the ``next_n = 1`` logits kernel only: the first ``next_n = 2`` shape JIT-compiles its kernel (one nvcc run on the
device, in ``first_call_s``; ``--shape-timeout`` allows for it).

``--device cpu --shapes 2x256,4x256x2`` runs the plumbing on the CPU, with a stand-in ``deep_gemm`` module of your
own on ``PYTHONPATH`` (the same three functions, in torch; host timings mean nothing; ``tests/test_bench_scoring.py``
writes one). FlashInfer 0.7's
``fp8_paged_mqa_logits`` is an SM100-only CuTeDSL kernel: not a peer on the H200.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _meta  # this folder
import _scoring_inputs as si  # this folder; it also puts the project on sys.path
import _timing  # this folder

ROW_ALIGN = 256  # DeepGEMM's output rows: a multiple of split_kv = 256 columns and of 1024 bytes
#: the child's steps that run under CUDA-graph capture or replay: a crash there is retried with events only
GRAPH_STEPS = ("graph_logits", "graph_metadata", "graph_both")


# ---- shapes --------------------------------------------------------------------------------------------
Shape = tuple[int, int, int]  # (T, L, next_n)


def parse_shapes(text: str) -> list[Shape]:
    """``"1x4096,64x32768x2"`` -> ``[(1, 4096, 1), (64, 32768, 2)]`` (``TxL[xN]``: ``N`` = next_n, default 1)."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = [int(v) for v in item.lower().split("x")]
        if len(parts) not in (2, 3):
            raise ValueError(f"shape {item!r}: expected TxL or TxLxN")
        t, n, nn = (*parts, 1) if len(parts) == 2 else parts
        if nn < 1 or t % nn:
            raise ValueError(f"shape {item!r}: T must be a multiple of next_n >= 1")
        out.append((t, n, nn))
    return out


def format_shapes(shapes: list[Shape]) -> str:
    return ",".join(f"{t}x{n}" if nn == 1 else f"{t}x{n}x{nn}" for t, n, nn in shapes)


def default_shapes(quick: bool, next_ns: list[int]) -> list[Shape]:
    """``bench_scoring.py``'s shapes of the families ``next_ns`` (1: ``SHAPES``, 2: ``MTP_SHAPES``)."""
    return [s for s in si.all_shapes(quick) if s[2] in next_ns]


def key_of(r: dict[str, Any]) -> Shape:
    """A JSON row's shape (rows written before ``next_n`` existed are ``next_n = 1``)."""
    return r["T"], r["L"], r.get("next_n", 1)


# ---- DeepGEMM's layout and the references ----------------------------------------------------------------
def deepgemm_args(inp: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Our inputs in DeepGEMM's layout (no copy of the cache: the same bytes), checked against its host asserts."""
    from dcp_ref.index_cache import as_deepgemm_kv_cache

    t, h, d = inp["index_q"].shape
    nn = si.next_n_of(inp)
    b = t // nn
    n = inp["block_table"].shape[1] * si.BLOCK
    # DeepGEMM's rows are (request, token within it): tokens must come in whole requests, in order
    want_req = torch.arange(b, device=inp["req_of_token"].device, dtype=torch.int32).repeat_interleave(nn)
    assert torch.equal(inp["req_of_token"].to(torch.int32), want_req), "tokens are not in consecutive groups"
    a = {
        "q": inp["index_q"].view(b, nn, h, d).contiguous(),
        "kv_cache": as_deepgemm_kv_cache(inp["index_cache"], si.BLOCK),
        "weights": inp["weights"].view(t, h).contiguous(),
        "context_lens": inp["local_bounds"].to(torch.int32).view(b, nn).contiguous(),
        "block_table": inp["block_table"].to(torch.int32).contiguous(),
        "max_context_len": n,
    }
    q, kv, w, lens, bt = (a[k] for k in ("q", "kv_cache", "weights", "context_lens", "block_table"))
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and h in (32, 64) and d == 128, (q.dtype, q.shape)
    assert kv.dtype == torch.uint8 and kv.dim() == 4 and kv.shape[1:] == (64, 1, d + 4), (kv.dtype, kv.shape)
    assert kv.stride(1) == d + 4 and kv.stride(3) == 1 and kv.stride(0) % 4 == 0, kv.stride()
    assert w.dtype == torch.float32 and w.is_contiguous() and w.shape == (b * nn, h), (w.dtype, w.shape)
    assert lens.dtype == torch.int32 and lens.is_contiguous() and lens.shape == (b, nn), (lens.dtype, lens.shape)
    assert bt.dtype == torch.int32 and bt.dim() == 2 and bt.shape[0] == b and bt.stride(1) == 1, (bt.dtype, bt.shape)
    # SM90 sizes a request's work by its last token's length: that must be the request's longest
    assert bool((lens[:, -1:] >= lens).all()), "a request's last token must see the most keys"
    return a


def reference_fp32(a: dict[str, Any]) -> torch.Tensor:
    """DeepGEMM's test's reference from its own inputs, every row: ``sum_h w * relu(q . (k * scale))`` in float32
    (``[B * next_n, max_context_len]``; row ``b * next_n + i`` over token ``i``'s own ``context_lens[b, i]`` keys,
    NaN past them — where DeepGEMM's SM90 kernel still writes a score up to the request's last length)."""
    kv, q, bt, lens = a["kv_cache"], a["q"], a["block_table"], a["context_lens"]
    nb, bs, _, width = kv.shape
    d = width - 4
    flat = kv.reshape(nb, bs * width)
    vals = flat[:, : bs * d].reshape(nb, bs, d)  # uint8: gathered per row, then read as e4m3
    scl = flat[:, bs * d :].contiguous().view(torch.float32).view(nb, bs)
    b_, nn, h, _ = q.shape
    w = a["weights"].view(b_, nn, h)
    out = torch.full((b_ * nn, a["max_context_len"]), float("nan"), dtype=torch.float32, device=q.device)
    lens_host = lens.cpu().tolist()
    for b in range(b_):
        longest = max(lens_host[b])
        blk = bt[b, : -(-longest // bs)].long()
        k = vals[blk].reshape(-1, d).view(torch.float8_e4m3fn).float() * scl[blk].reshape(-1, 1)
        for i in range(nn):
            m = lens_host[b][i]
            s = q[b, i].float() @ k[:m].T  # [H, m]
            out[b * nn + i, :m] = (s.relu() * w[b, i][:, None]).sum(0)
    return out


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's test measure: ``1 - 2 <x, y> / (|x|^2 + |y|^2)`` (0 when equal)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum().clamp_min(1e-300))


# ---- the child: the shapes, one after another -------------------------------------------------------------
def cuda_home() -> str | None:
    """What ``build_and_probe.sh`` exports as ``CUDA_HOME`` (DeepGEMM's JIT reads nvcc's version from it even on a
    cache hit: the version is part of the cache key)."""
    for c in ("/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-13*"))):
        if os.access(os.path.join(c, "bin", "nvcc"), os.X_OK):
            return c
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


def jit_cache_entries() -> int | None:
    folder = os.path.join(os.environ.get("DG_JIT_CACHE_DIR", ""), "cache")
    return len(os.listdir(folder)) if os.environ.get("DG_JIT_CACHE_DIR") and os.path.isdir(folder) else None


def host_time(fn: Callable[[], Any]) -> dict[str, Any]:
    """Host wall-clock median (the CPU plumbing check only: ``_timing.host`` under the SMOKE rule)."""
    return {"median_us": _timing.host(fn, rule=_timing.SMOKE).median_us, "timing": "host"}


Timer = Callable[[Callable[[], Any]], dict[str, Any]]


def measure(
    rec: dict[str, Any], dg: Any, device: str, timer: Timer, sync: Callable[[], None], step: Callable[[str], None]
) -> None:
    """One shape's checks and timings into ``rec`` (its tensors are freed when this returns or raises)."""
    t, n, nn = rec["T"], rec["L"], rec["next_n"]
    t0 = time.time()
    step("inputs")
    inp = si.build_inputs(t, n, device, next_n=nn)
    a = deepgemm_args(inp)
    num_sms = dg.get_num_sms()
    rec["num_sms"] = num_sms
    q, kv, w, lens, bt, m = (
        a[k] for k in ("q", "kv_cache", "weights", "context_lens", "block_table", "max_context_len")
    )
    meta_fn = lambda: dg.get_paged_mqa_logits_metadata(lens, si.BLOCK, num_sms)  # noqa: E731
    step("metadata")
    schedule = meta_fn()
    sync()
    rec["schedule_shape"] = list(schedule.shape)
    logits_fn = lambda: dg.fp8_paged_mqa_logits(q, kv, w, lens, bt, schedule, m, clean_logits=False)  # noqa: E731
    step("logits_first")
    t1 = time.time()
    logits = logits_fn()
    sync()
    rec["first_call_s"] = time.time() - t1
    rec["logits_shape"], rec["logits_stride"] = list(logits.shape), list(logits.stride())
    rec["logits_dtype"] = str(logits.dtype)
    rec["row_stride_as_documented"] = logits.stride() == (-(-m // ROW_ALIGN) * ROW_ALIGN, 1)
    assert tuple(logits.shape) == (t, m), f"logits shape {tuple(logits.shape)}"
    step("logits_repeat")
    again = logits_fn()
    sync()
    rec["bitwise_repeatable"] = bool(torch.equal(logits, again))
    del again
    step("reference")
    got = logits[:, :n]
    bounds = inp["local_bounds"].long()
    inside = torch.arange(n, device=got.device)[None, :] < bounds[:, None]  # each token's own columns
    rec["finite"] = bool(torch.isfinite(got[inside]).all())
    if nn > 1:  # informative: the columns past an earlier token's length, inside its request's blocks
        past = ~inside
        rec["writes_past_token_length"] = bool(torch.isfinite(got[past]).all()) if bool(past.any()) else None
    del inside
    oracle = si.reference_rows(inp)  # float64 inside, first REF_ROWS rows
    rec["ref_rows"] = oracle.shape[0]
    rec["max_rel_err"] = si.rel_error(got, oracle)
    ref32 = reference_fp32(a)
    rec["max_rel_err_fp32_all_rows"] = si.rel_error(got, ref32)
    fin = torch.isfinite(ref32)  # each token's own columns
    rec["calc_diff_fp32"] = calc_diff(got[fin], ref32[fin])
    del fin
    rec["fp32_ref_vs_oracle"] = si.rel_error(ref32, oracle)
    del got, logits, oracle, ref32
    step("graph_logits")
    rec["logits"] = timer(logits_fn)
    rec["deepgemm_us"] = rec["logits"]["median_us"]
    step("graph_metadata")
    rec["metadata"] = timer(meta_fn)
    rec["metadata_us"] = rec["metadata"]["median_us"]

    def both() -> None:
        s = dg.get_paged_mqa_logits_metadata(lens, si.BLOCK, num_sms)
        dg.fp8_paged_mqa_logits(q, kv, w, lens, bt, s, m, clean_logits=False)

    step("graph_both")
    rec["metadata_plus_logits"] = timer(both)
    rec["metadata_plus_logits_us"] = rec["metadata_plus_logits"]["median_us"]
    rec["kv_read_TBps"] = (t // nn) * n * (si.DIM + 4) / (rec["deepgemm_us"] * 1e-6) / 1e12  # once per request
    rec["shape_s"] = time.time() - t0
    step("done")


def run_shape(shape: Shape, dg: Any, device: str, nograph: bool, step: Callable[[str], None]) -> dict[str, Any]:
    t, n, nn = shape
    rec: dict[str, Any] = {"T": t, "B": t // nn, "L": n, "next_n": nn}
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if not cuda:
        timer: Timer = host_time
    elif nograph:  # this shape killed a child in a CUDA-graph step: events only
        timer = lambda fn: (  # noqa: E731
            _timing.eager(fn, flush_l2=True).as_dict() | {"timing": "events", "why": "crashed in a graph step"}
        )
    else:
        timer = lambda fn: _timing.graph_row(fn, flush_l2=True, fallback=True)  # noqa: E731
    try:
        measure(rec, dg, device, timer, sync, step)
    except Exception as e:  # noqa: BLE001 - recorded per shape: the next shape still runs
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["traceback"] = traceback.format_exc()[-3000:]
    try:
        sync()
        if cuda:
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - a sticky CUDA error: the parent gives the next shapes a new child
        rec["cuda_context_lost"] = f"{type(e).__name__}: {e}"[:500]
    return rec


def child(args: argparse.Namespace) -> int:
    def step_of(shape: Shape) -> Callable[[str], None]:
        def step(name: str) -> None:
            if args.progress:
                with open(args.progress, "w") as fh:
                    fh.write(f"{shape[0]} {shape[1]} {shape[2]} {name}\n")

        return step

    data: dict[str, Any] = {"shapes": []}

    def save() -> None:  # whole files only: the parent reads this one while the child runs
        with open(args.out + ".tmp", "w") as fh:
            json.dump(data, fh, indent=1)
        os.replace(args.out + ".tmp", args.out)

    if args.device == "cuda" and not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        home = cuda_home()
        if home:
            os.environ["CUDA_HOME"] = home
    try:
        t0 = time.time()
        import deep_gemm as dg

        data["import_s"] = time.time() - t0
        data["versions"] = _meta.versions(import_missing=False) | {
            "deep_gemm": getattr(dg, "__version__", None),
            "deep_gemm_file": getattr(dg, "__file__", None),
            "deep_gemm_C": getattr(getattr(dg, "_C", None), "__file__", None),
        }
        if args.device == "cuda":
            data["device"] = si.device_info()
    except Exception as e:  # noqa: BLE001 - no DeepGEMM: the JSON says why
        data["error"] = f"import deep_gemm: {type(e).__name__}: {e}"[:2000]
        data["traceback"] = traceback.format_exc()[-3000:]
        save()
        print(data["error"], file=sys.stderr)
        return 2
    data["env"] = {k: os.environ.get(k) for k in ("CUDA_HOME", "DG_JIT_CACHE_DIR", "PYTHONPATH")}
    data["jit_cache_entries_at_start"] = jit_cache_entries()
    save()
    nograph = set(parse_shapes(args.nograph))
    for shape in parse_shapes(args.shapes):
        rec = run_shape(shape, dg, args.device, shape in nograph, step_of(shape))
        data["shapes"].append(rec)
        data["jit_cache_entries_at_end"] = jit_cache_entries()
        save()  # after every shape: the parent keeps what was measured if a later shape kills this process
        print(
            f"deepgemm T={shape[0]:4d} L={shape[1]:6d} next_n={shape[2]} "
            f"logits={rec.get('deepgemm_us', float('nan')):9.2f} us "
            f"({rec.get('logits', {}).get('timing')}) metadata={rec.get('metadata_us', float('nan')):7.2f} us "
            f"rel_err={rec.get('max_rel_err')} (fp32 all rows {rec.get('max_rel_err_fp32_all_rows')}) "
            f"{rec.get('error', '')[:200]}",
            flush=True,
        )
        if "cuda_context_lost" in rec:
            return 3
    return 0


# ---- the parent: children, crash records, the JSON -------------------------------------------------------
def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):  # not written yet, or caught mid-write: the next read has it
        return {"shapes": []}


def read_progress(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def row_of(shape: Shape, error: str | None = None) -> dict[str, Any]:
    """A JSON row's shape keys (and ``error``)."""
    t, n, nn = shape
    return {"T": t, "B": t // nn, "L": n, "next_n": nn} | ({"error": error} if error is not None else {})


def run_child(
    args: argparse.Namespace,
    pending: list[Shape],
    nograph: set[Shape],
    tmp: str,
    attempt: int,
    deadline: float,
    snapshot: Callable[[dict[str, Any]], None],
) -> tuple[int | str, dict[str, Any], str | None, str]:
    """One child over ``pending``: (exit status, ``"timeout"`` or ``"budget"``; its JSON; its last progress line;
    its stderr tail). ``snapshot`` gets the child's JSON whenever its progress moves on."""
    cj, cp, ce = (os.path.join(tmp, f"child{attempt}.{x}") for x in ("json", "progress", "stderr"))
    cmd = [
        sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--child", "--out", cj, "--progress", cp,
        "--shapes", format_shapes(pending), "--nograph", format_shapes(sorted(nograph)), "--device", args.device,
    ]  # fmt: skip
    with open(ce, "w") as fe:
        proc = subprocess.Popen(cmd, stderr=fe)
        last, since = None, time.monotonic()
        rc: int | str | None = None
        try:
            while rc is None:
                try:
                    rc = proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    prog = read_progress(cp)
                    if prog != last:
                        last, since = prog, time.monotonic()
                        snapshot(read_json(cj))
                    now = time.monotonic()
                    if now - since > args.shape_timeout or now > deadline:
                        rc = "timeout" if now - since > args.shape_timeout else "budget"
        finally:
            if proc.poll() is None:  # killed for time, or this process is stopping (SIGTERM, ^C)
                proc.kill()  # the child this call started
                proc.wait()
    with open(ce, errors="replace") as fh:
        err = fh.read()
    return rc, read_json(cj), read_progress(cp), err[-4000:]


def parent(args: argparse.Namespace, shapes: list[Shape]) -> int:
    data: dict[str, Any] = {
        "peer": "DeepGEMM fp8_paged_mqa_logits (built from source: .gpu/dgsrc)",
        "date_utc": _meta.now_utc(),
        "argv": sys.argv[1:],
        "timing": _timing.describe("graph", "`reps`", flush_l2=True) + " (as bench_scoring.py); 'events' when a "
        "call could not be captured or its shape crashed in a graph step",
        "inputs": {"heads": si.HEADS, "dim": si.DIM, "block_size": si.BLOCK, "B": "T / next_n",
                   "next_n": "per row (1, or 2 = MTP)", "context_lens": "local_bounds.view(B, next_n): token i of "
                   "a request sees L - next_n + 1 + i keys", "ref_rows": si.REF_ROWS,
                   "same bytes as": "_scoring_inputs.build_inputs"},
        "shapes": [],
        "crashes": [],
    }  # fmt: skip

    def merge(child_data: dict[str, Any]) -> None:
        for k, v in child_data.items():
            if k == "jit_cache_entries_at_end":
                data[k] = v
            elif k != "shapes":
                data.setdefault(k, v)

    def save(extra: list[dict[str, Any]] | None = None) -> None:
        rows = data["shapes"] + (extra or [])
        out = data | {"shapes": sorted(rows, key=lambda r: shapes.index(key_of(r)))}
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)

    def snapshot(child_data: dict[str, Any]) -> None:  # a timeout of the whole call keeps what was measured
        merge(child_data)
        save(child_data.get("shapes", []))

    pending, nograph = list(shapes), set(parse_shapes(args.nograph))
    deadline = time.monotonic() + args.budget
    tmp = tempfile.mkdtemp(prefix="dgpeer.")
    attempt = 0
    try:
        while pending:
            if time.monotonic() > deadline:
                data["shapes"] += [row_of(s, f"not run: --budget {args.budget:.0f} s spent") for s in pending]
                break
            attempt += 1
            rc, child_data, prog, err = run_child(args, pending, nograph, tmp, attempt, deadline, snapshot)
            merge(child_data)
            done = {key_of(r) for r in child_data.get("shapes", [])}
            data["shapes"] += child_data.get("shapes", [])
            pending = [s for s in pending if s not in done]
            if rc != 0:
                sys.stderr.write(err)
            if rc == 0 or not pending or "error" in child_data:  # finished, or DeepGEMM does not import
                break
            if prog is None:  # died before its first shape (import, device): the next child would too
                data["crashes"].append({"step": "startup", "rc": rc, "stderr_tail": err})
                data["shapes"] += [row_of(s, f"child died at startup ({rc})") for s in pending]
                break
            pt, pn, pnn, pstep = prog.split()
            shape = (int(pt), int(pn), int(pnn))
            if shape not in pending:  # it stopped after that shape's record (a lost CUDA context): go on
                continue
            crash = row_of(shape) | {"step": pstep, "rc": rc, "nograph": shape in nograph, "stderr_tail": err}
            data["crashes"].append(crash)
            print(f"CRASH T={shape[0]} L={shape[1]} next_n={shape[2]} at step {pstep} ({rc}, "
                  f"nograph={shape in nograph})", flush=True)  # fmt: skip
            if pstep in GRAPH_STEPS and shape not in nograph and rc not in ("timeout", "budget"):
                nograph.add(shape)  # retried, timed with events only
            else:
                how = f"killed ({rc})" if rc in ("timeout", "budget") else f"child died (exit {rc})"
                data["shapes"].append(row_of(shape, f"{how} at step {pstep}"))
                pending.remove(shape)
            save()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    save()
    print(f"\nDeepGEMM fp8_paged_mqa_logits -> {args.out}")
    print(f"{'T':>4} {'L':>7} {'N':>2} {'logits us':>10} {'meta us':>8} {'both us':>8} {'rel err':>9} "
          f"{'fp32 all':>9}  timing")  # fmt: skip
    for r in data["shapes"]:
        if "error" in r:
            print(f"{r['T']:>4} {r['L']:>7} {r.get('next_n', 1):>2}  ERROR {r['error'][:150]}")
            continue
        print(f"{r['T']:>4} {r['L']:>7} {r.get('next_n', 1):>2} {r['deepgemm_us']:>10.2f} {r['metadata_us']:>8.2f} "
              f"{r['metadata_plus_logits_us']:>8.2f} {r['max_rel_err']:>9.2e} {r['max_rel_err_fp32_all_rows']:>9.2e}  "
              f"{r['logits'].get('timing')}")  # fmt: skip
    if "error" in data:
        print(data["error"], file=sys.stderr)
        return 2
    return 0 if all("error" not in r for r in data["shapes"]) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help=f"only {si.QUICK} (next_n 1) and {si.QUICK_MTP} (next_n 2)")
    ap.add_argument("--next-n", default="1,2", help="which of bench_scoring's shape families: 1 (SHAPES), "
                    "2 (MTP_SHAPES) or 1,2 (default)")  # fmt: skip
    ap.add_argument("--shapes", default="", help="TxL[xN],... (N = next_n, default 1) instead of bench_scoring's "
                    "shapes (rows join on T, L, next_n)")  # fmt: skip
    ap.add_argument("--shape-timeout", type=float, default=150.0, help="seconds a child may spend in one step of a "
                    "shape before it is killed (a first call JIT-compiles on a cache miss: ~1 min)")  # fmt: skip
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for all shapes (the shapes not reached are "
                    "recorded as not run), so that bench_scoring.py keeps its share of the device call")  # fmt: skip
    ap.add_argument("--nograph", default="", help="TxL[xN],... timed with CUDA events only, no CUDA graph")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a plumbing check with a "
                    "stand-in deep_gemm (host timings)")  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--progress", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the child is killed and the temp folder removed
    next_ns = [int(v) for v in args.next_n.split(",") if v.strip()]
    shapes = parse_shapes(args.shapes) if args.shapes else default_shapes(args.quick, next_ns)
    return parent(args, shapes)


if __name__ == "__main__":
    sys.exit(main())
