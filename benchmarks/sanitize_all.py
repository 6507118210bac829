#!/usr/bin/env python3
"""Every GPU kernel on small adversarial inputs, for compute-sanitizer (memcheck, racecheck) on the H200.

    compute-sanitizer --tool memcheck --error-exitcode 9 python benchmarks/sanitize_all.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python benchmarks/sanitize_all.py
    python benchmarks/sanitize_all.py --out benchmarks/results        # + sanitize_all.json
    python benchmarks/sanitize_all.py --only pack,deinterleave          # some families

Kernels: the Triton pack, the Triton deinterleave (conversion; atomic, rowscan and two-pass
compaction), the Triton LSE merge (correct and merge), the CuTeDSL stable top-K, the Triton
indexer (``kernels/indexer_triton.py``), FlashInfer's sparse MLA and FlashMLA's sparse decode
(each family skipped, and said so, when its package or file is missing).

Inputs are small (the sanitizers slow kernels ~100x) and adversarial: the ``validate=False``
hot-path calls with the values only a host check would catch — negative and too-large row
starts, indices past the row, request ids past the block table, block ids whose slot overflows
int32, a counts larger than the row, slots past the cache, fractional / huge / negative ids,
NaN and ``±inf`` LSEs — plus odd sizes, strided views and in-place calls. Kernels documented as
never reading out of bounds must pass memcheck with 0 errors on all of them. Each result is
also compared with the reference (``dcp_ref``) where the contract defines it; the script exits 1
on a mismatch, 2 when a family crashed.

On a CPU-only machine the Triton families run under ``TRITON_INTERPRET=1`` (a smoke test of this
script; no sanitizer there) and the CUDA-only ones are skipped.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dcp_ref import canonicalize, deinterleave_and_compact, deinterleave_masked, global_ids_to_local_slots, local_topk
from dcp_ref.attention import sparse_mla_attention
from dcp_ref.geometry import DcpGeometry
from dcp_ref.lse import correct_partial, merge_partials
from dcp_ref.topk import pack_candidates, stable_topk

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAN, INF = float("nan"), float("inf")


class Family:
    """Launch log of one kernel family: ``check(label, ok)`` after each launch."""

    def __init__(self, name: str) -> None:
        self.name, self.launches, self.mismatches, self.notes = name, 0, [], []

    def check(self, label: str, ok: bool) -> None:
        self.launches += 1
        if DEV.type == "cuda":
            torch.cuda.synchronize()  # an asynchronous fault is attributed to this launch
        if not ok:
            self.mismatches.append(label)
        print(f"  {self.name}: {label}: {'ok' if ok else 'MISMATCH'}", flush=True)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
def fam_pack(f: Family) -> None:
    from dcp_ref.kernels.pack_triton import pack_candidates_triton

    g = gen(1)
    for rows, cols, K, W, I in [(3, 8, 5, 2, 1), (2, 1, 300, 8, 2)]:
        logits = torch.randn(rows, cols, generator=g)
        ids = torch.randint(-3, cols + 5, (rows, K), generator=g)  # < -1 and past the row: invalid
        ids[0, 0] = 2**40  # a huge int64 index
        starts = torch.randint(-cols, 2 * cols + 2, (rows,), generator=g).to(torch.int32)  # clamped to [0, cols]
        for dtype in (torch.int32, torch.int64):
            idx = ids.clamp(min=-(2**31), max=2**31 - 1).to(dtype)
            want = pack_candidates(logits, idx, DcpGeometry(W, W - 1, I, I), starts, validate=False)
            out = torch.full((rows, K, 2), NAN, device=DEV)
            got = pack_candidates_triton(
                logits.to(DEV), idx.to(DEV), DcpGeometry(W, W - 1, I, I), starts.to(DEV), out=out, validate=False
            )
            f.check(f"rows={rows} cols={cols} K={K} W={W} I={I} {dtype} bad starts/ids", torch.equal(got.cpu(), want))
        # a strided logits view, no row starts
        wide = torch.randn(rows, 2 * cols, generator=g)
        ok_ids = torch.randint(-1, cols, (rows, K), generator=g)
        want = pack_candidates(wide[:, ::2], ok_ids, DcpGeometry(W, 0, I, I))
        got = pack_candidates_triton(wide.to(DEV)[:, ::2], ok_ids.to(DEV), DcpGeometry(W, 0, I, I), validate=False)
        f.check(f"strided logits rows={rows} cols={cols}", torch.equal(got.cpu(), want))


def fam_deinterleave(f: Family) -> None:
    from dcp_ref.kernels import deinterleave_triton as dk

    g = gen(2)
    for T, K, W, I, bs, B, M in [(4, 37, 2, 2, 4, 3, 3), (3, 600, 4, 1, 8, 2, 9)]:
        ids = torch.randint(-2, W * I * bs * (M + 2), (T, K), generator=g)
        req = torch.randint(-1, B + 2, (T,), generator=g).to(torch.int32)  # some out of [0, B)
        bt = torch.randint(-1, 50, (B, M), generator=g)
        bt[0, 0] = 2**30  # its slots overflow int32: saturated, never wrapped
        for dt in (torch.int32, torch.int64):
            ids_d, bt_d = ids.to(dt), bt.to(dt)
            want_s = global_ids_to_local_slots(ids_d, req, bt_d, DcpGeometry(W, W - 1, I, bs), validate=False)
            got_s = dk.global_ids_to_local_slots_triton(
                ids_d.to(DEV), req.to(DEV), bt_d.to(DEV), DcpGeometry(W, W - 1, I, bs), validate=False
            )
            f.check(f"convert T={T} K={K} W={W} {dt}", torch.equal(got_s.cpu(), want_s))
            # the masked layout: conversion + counts in one row-scan launch, poisoned buffers
            want_m, want_mn = deinterleave_masked(ids_d, req, bt_d, DcpGeometry(W, W - 1, I, bs), validate=False)
            out = torch.full((T, K), 12345, dtype=torch.int32, device=DEV)
            cnt = torch.full((T,), 777, dtype=torch.int32, device=DEV)
            o, c = dk.deinterleave_masked_triton(
                ids_d.to(DEV),
                req.to(DEV),
                bt_d.to(DEV),
                DcpGeometry(W, W - 1, I, bs),
                out=out,
                counts=cnt,
                block=16,
                validate=False,
            )
            f.check(f"masked T={T} K={K} W={W} {dt}", torch.equal(o.cpu(), want_m) and torch.equal(c.cpu(), want_mn))
            for method in dk.METHODS:
                ordered = method != "atomic"
                want, want_n = deinterleave_and_compact(
                    ids_d, req, bt_d, DcpGeometry(W, W - 1, I, bs), ordered=ordered, validate=False
                )
                out = torch.full((T, K), 12345, dtype=torch.int32, device=DEV)
                cnt = torch.full((T,), 777, dtype=torch.int32, device=DEV)
                ws = torch.zeros(dk.workspace_numel(method, T, K, 16), dtype=torch.int64, device=DEV)
                o, c = dk.deinterleave_compact(
                    ids_d.to(DEV),
                    req.to(DEV),
                    bt_d.to(DEV),
                    DcpGeometry(W, W - 1, I, bs),
                    ordered=ordered,
                    method=method,
                    out=out,
                    counts=cnt,
                    workspace=ws if ws.numel() else None,
                    block=16,
                    validate=False,
                )
                ok = torch.equal(c.cpu(), want_n) and torch.equal(
                    canonicalize(o.cpu(), c.cpu()), canonicalize(want, want_n)
                )
                if ordered:
                    ok &= torch.equal(o.cpu(), want)
                f.check(f"{method} T={T} K={K} W={W} {dt}", ok)
    # Atomic with a workspace that is not zero on entry (caller bug): writes stay inside the row.
    ids = torch.arange(40).view(2, 20)
    bt = torch.arange(20).view(2, 10).to(torch.int32)
    ws = torch.full((2,), 5 | (3 << 21), dtype=torch.int64, device=DEV)
    dk.deinterleave_compact(
        ids.to(DEV),
        None,
        bt.to(DEV),
        DcpGeometry(1, 0, block_size=4),
        ordered=False,
        method="atomic",
        workspace=ws,
        block=16,
        validate=False,
    )
    f.check("atomic, non-zero workspace (counts wrong by contract, memory intact)", True)
    # Strided ids and block table views.
    ids = torch.randint(-1, 64, (6, 30), generator=g)
    bt = torch.randint(0, 40, (3, 8), generator=g).to(torch.int32)
    req = torch.randint(0, 3, (3,), generator=g).to(torch.int32)
    want, want_n = deinterleave_and_compact(ids[::2, ::3], req, bt[:, ::2], DcpGeometry(2, 1, 2, 4))
    o, c = dk.deinterleave_compact(
        ids.to(DEV)[::2, ::3], req.to(DEV), bt.to(DEV)[:, ::2], DcpGeometry(2, 1, 2, 4), validate=False
    )
    f.check("strided ids / block table", torch.equal(o.cpu(), want) and torch.equal(c.cpu(), want_n))


def fam_lse(f: Family) -> None:
    from dcp_ref.kernels.lse_merge_triton import lse_correct, lse_merge

    g = gen(3)
    for W, T, H, D, dtype in [
        (1, 3, 4, 32, torch.float32),
        (3, 4, 5, 24, torch.bfloat16),
        (8, 2, 6, 512, torch.float16),
    ]:
        outs = torch.randn(W, T, H, D, generator=g)
        lses = torch.randn(W, T, H, generator=g) * 4
        kind = torch.randint(0, 6, (W, T, H), generator=g)
        lses[kind == 0] = -INF  # empty
        lses[kind == 1] = NAN  # corrupt: propagates
        lses[kind == 2] = INF
        outs[(kind == 0).unsqueeze(-1).expand_as(outs)] = NAN  # an empty rank's garbage: must not leak
        o = outs.to(dtype)
        want_o, want_l = merge_partials(o.double(), lses.double())
        merged = torch.full((T, H, D), 7.0, dtype=dtype, device=DEV)
        mlse = torch.full((T, H), 7.0, device=DEV)
        lse_merge(o.to(DEV), lses.to(DEV), merged=merged, merged_lse=mlse, block_h=2)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        ok = torch.equal(torch.isnan(merged.cpu()), torch.isnan(want_o)) and torch.allclose(
            merged.double().cpu(), want_o, atol=tol, rtol=tol, equal_nan=True
        )
        ok &= torch.equal(torch.isnan(mlse.cpu()), torch.isnan(want_l))
        f.check(f"merge W={W} T={T} H={H} D={D} {dtype}", ok)
        for r in range(W):
            x = o[r].to(DEV).clone()
            want_c, _ = correct_partial(o[r].double(), lses.double(), r)
            res, _ = lse_correct(x, lses.to(DEV), r, corrected=x if r % 2 else None, merged_lse=mlse)  # odd: in place
            ok = torch.equal(torch.isnan(res.cpu()), torch.isnan(want_c)) and torch.allclose(
                res.double().cpu(), want_c, atol=tol, rtol=tol, equal_nan=True
            )
            f.check(f"correct rank {r} W={W} {'in place' if r % 2 else ''}", ok)
    # Strided partials ([T, W, H, D] storage seen as [W, T, H, D]).
    outs = torch.randn(3, 4, 2, 16, generator=g)
    lses = torch.randn(3, 4, 2, generator=g)
    s = outs.permute(1, 0, 2, 3).contiguous().to(DEV).permute(1, 0, 2, 3)
    merged, _ = lse_merge(s, lses.to(DEV))
    f.check(
        "strided partials",
        torch.allclose(merged.double().cpu(), merge_partials(outs.double(), lses.double())[0], atol=1e-4),
    )


def fam_topk(f: Family) -> None:
    from dcp_ref.kernels.topk_cutedsl import stable_topk_cutedsl

    g = gen(4)
    for W, K, k, rows, sorted_ in [(2, 33, 17, 3, True), (8, 64, 64, 4, False), (4, 1023, 1023, 2, False)]:
        scores = torch.randint(0, 5, (W, rows, K), generator=g).float() / 4
        ids = torch.randperm(W * rows * K, generator=g)[: W * rows * K].view(W, rows, K).float()
        scores[torch.rand(W, rows, K, generator=g) < 0.1] = NAN  # invalid
        ids[torch.rand(W, rows, K, generator=g) < 0.1] = -1.0  # invalid
        gathered = torch.stack([scores, ids], -1)
        want = stable_topk(gathered, k, sorted=True)
        got = stable_topk_cutedsl(gathered.to(DEV), k, sorted=sorted_, validate=False)
        same = torch.equal(got.cpu(), want) if sorted_ else torch.equal(got.cpu().sort(1).values, want.sort(1).values)
        f.check(f"W={W} K={K} k={k} sorted={sorted_} ties/NaN/-1", same)
        # ids the host check would reject (fractional, huge, negative, inf): any result, in bounds
        bad_ids = ids.clone().view(-1)
        bad_ids[::7], bad_ids[1::11], bad_ids[2::13], bad_ids[3::17] = 2.5, 3e9, -7.0, INF
        bad = torch.stack([scores, bad_ids.view(W, rows, K)], -1)
        out = torch.full((rows, k), 99, dtype=torch.int32, device=DEV)
        stable_topk_cutedsl(bad.to(DEV), k, sorted=sorted_, out=out, validate=False)
        f.check(f"W={W} K={K} k={k} bad ids, validate=False", True)


def fam_indexer(f: Family) -> None:
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack

    g = gen(5)
    for rows, cols, k, W, I in [(3, 40, 8, 2, 1), (2, 300, 17, 4, 2)]:
        scores = (torch.randint(0, 6, (rows, cols), generator=g).float() / 5) - 0.5
        scores[torch.rand(rows, cols, generator=g) < 0.1] = NAN
        lengths = torch.randint(-5, cols + 10, (rows,), generator=g)  # negative and past the row: clamped
        starts = torch.randint(-3, cols + 3, (rows,), generator=g).to(torch.int32)
        got = indexer_topk_pack(
            scores.to(DEV), lengths.to(DEV), k, DcpGeometry(W, 1, I, I), starts.to(DEV), validate=False
        )
        want = pack_candidates(
            scores,
            local_topk(scores, k, lengths, starts, validate=False),
            DcpGeometry(W, 1, I, I),
            starts,
            validate=False,
        )

        def as_set(x: torch.Tensor) -> list:
            return [sorted((float(i), float(s)) for s, i in row.tolist() if i >= 0) for row in x]

        f.check(f"rows={rows} cols={cols} k={k} W={W} bad windows", as_set(got.cpu()) == as_set(want))


def _attention_inputs(g: torch.Generator, T: int, H: int, K: int, S: int):
    q = (torch.randn(T, H, 576, generator=g) / 8).to(torch.bfloat16)
    kv = (torch.randn(S, 576, generator=g) / 8).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    counts = torch.randint(0, K + 1, (T,), generator=g).to(torch.int32)
    counts[0] = 0  # an empty row
    slots[torch.arange(K) >= counts.unsqueeze(1)] = -1
    return q, kv, slots, counts


def _same_attention(got: tuple, want: tuple) -> bool:
    """A GPU attention's (out, lse) against the float64 reference: outputs close, the same empty rows."""
    return torch.allclose(got[0].double().cpu(), want[0], atol=3e-2) and torch.equal(
        torch.isneginf(got[1].cpu()), torch.isneginf(want[1])
    )


def _reference(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor) -> tuple:
    """The float64 sparse MLA (values: the first 512 dims) the attention families are checked against."""
    return sparse_mla_attention(q.double(), kv.double(), slots, counts, 0.1, v_dim=512)


def _poisoned_rows(lse: torch.Tensor) -> set[int]:
    """Rows whose every LSE is NaN (the hot path's answer to a value it may not read)."""
    return {r for r in range(lse.shape[0]) if bool(torch.isnan(lse[r].cpu()).all())}


def fam_flashinfer(f: Family) -> None:
    from dcp_ref.kernels.flashinfer_mla import sparse_mla_flashinfer

    g = gen(6)
    q, kv, slots, counts = _attention_inputs(g, 5, 16, 64, 300)
    got = sparse_mla_flashinfer(q.to(DEV), kv.to(DEV), slots.to(DEV), counts.to(DEV), 0.1)
    f.check("valid rows vs reference", _same_attention(got, _reference(q, kv, slots, counts)))
    bad_slots, bad_counts = slots.clone(), counts.clone()
    bad_slots[1, 0] = 10**6  # past the cache
    bad_counts[2] = 500  # more than K
    bad_slots[3, 0] = -5
    _, lse = sparse_mla_flashinfer(q.to(DEV), kv.to(DEV), bad_slots.to(DEV), bad_counts.to(DEV), 0.1, validate=False)
    f.check("validate=False: bad slots / counts poison their rows", {1, 3} <= _poisoned_rows(lse))


def fam_flashmla(f: Family) -> None:
    from dcp_ref.kernels.flashmla_sparse import sparse_mla_flashmla

    g = gen(7)
    # K = 128, and K = 64 (padded to FlashMLA's width multiple of 128 by the stage's prologue kernel)
    for K, S in ((128, 400), (64, 300)):
        q, kv, slots, counts = _attention_inputs(g, 4, 64, K, S)
        got = sparse_mla_flashmla(q.to(DEV), kv.to(DEV), slots.to(DEV), counts.to(DEV), 0.1)
        f.check(f"K = {K}: valid rows vs reference", _same_attention(got, _reference(q, kv, slots, counts)))
    # the hot path's bad values: a used slot past the cache or negative poisons its row; counts past K clamp
    bad_slots, bad_counts = slots.clone().long(), counts.clone()
    bad_counts[1:] = 64
    bad_slots[1, 0] = 2**32 + 3  # int64, past the cache: must not wrap into slot 3
    bad_slots[3, 5] = -5
    bad_counts[2] = 500
    _, lse = sparse_mla_flashmla(q.to(DEV), kv.to(DEV), bad_slots.to(DEV), bad_counts.to(DEV), 0.1)
    f.check("validate=False: bad slots poison their rows", {1, 3} <= _poisoned_rows(lse))


def fam_flashmla_fp8(f: Family) -> None:
    from dcp_ref.fp8_cache import quantize_kv_fp8, sparse_mla_attention_fp8
    from dcp_ref.kernels.flashmla_fp8 import FlashMLAFp8Decode

    g = gen(8)
    q, kv, slots, _ = _attention_inputs(g, 5, 64, 128, 500)
    cache = quantize_kv_fp8(kv)
    masked = slots.clone()
    masked[:, 1::3] = -1  # the masked layout: -1 anywhere in a row
    attn = FlashMLAFp8Decode(DEV, validate=False)
    got = attn.attention(q.to(DEV), cache.to(DEV), masked.to(DEV), None, 0.1)
    want = sparse_mla_attention_fp8(q.double(), cache, masked, None, 0.1)
    f.check("masked rows vs the dequantizing reference", _same_attention(got, want))
    bad = masked.clone().long()
    bad[2, 0] = 10**6  # past the cache
    bad[4, 2] = 2**32 + 1  # int64 past the cache: must not wrap
    _, lse = attn.attention(q.to(DEV), cache.to(DEV), bad.to(DEV), None, 0.1)
    f.check("validate=False: unreadable slots poison their rows, never read", {2, 4} <= _poisoned_rows(lse))


FAMILIES: dict[str, tuple[Callable[[Family], None], str, str]] = {
    # name: (run, what it needs, "triton" families also run interpreted on the CPU)
    "pack": (fam_pack, "triton", "triton"),
    "deinterleave": (fam_deinterleave, "triton", "triton"),
    "lse_merge": (fam_lse, "triton", "triton"),
    "indexer": (fam_indexer, "triton", "triton"),
    "topk_cutedsl": (fam_topk, "cutlass", "cuda"),
    "flashinfer": (fam_flashinfer, "flashinfer", "cuda"),
    "flashmla": (fam_flashmla, "flash_mla", "cuda"),
    "flashmla_fp8": (fam_flashmla_fp8, "flash_mla", "cuda"),
}
_FILES = {"indexer": "kernels/indexer_triton.py", "flashmla": "kernels/flashmla_sparse.py"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument("--out", default=None, help="directory for sanitize_all.json (default: print only)")
    args = ap.parse_args()
    pick = [n for n in args.only.split(",") if n] or list(FAMILIES)
    unknown = set(pick) - set(FAMILIES)
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}; known: {sorted(FAMILIES)}")
    root = Path(__file__).resolve().parents[1]
    report: dict = {
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (TRITON_INTERPRET=1)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "families": {},
    }
    status = 0
    for name in pick:
        run, needs, where = FAMILIES[name]
        skip = ""
        if importlib.util.find_spec(needs) is None:
            skip = f"{needs} is not installed"
        elif name in _FILES and not (root / _FILES[name]).exists():
            skip = f"{_FILES[name]} does not exist"
        elif where == "cuda" and DEV.type != "cuda":
            skip = "needs CUDA"
        if skip:
            print(f"{name}: skipped ({skip})", flush=True)
            report["families"][name] = {"skipped": skip}
            continue
        print(f"{name}:", flush=True)
        fam = Family(name)
        try:
            run(fam)
        except Exception:  # a crash in one family must not hide the others' results
            fam.notes.append(traceback.format_exc(limit=3))
            print(traceback.format_exc(), flush=True)
            status = 2
        if fam.mismatches:
            status = max(status, 1)
        report["families"][name] = {"launches": fam.launches, "mismatches": fam.mismatches, "errors": fam.notes}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sanitize_all.json").write_text(json.dumps(report, indent=1) + "\n")
    total = sum(v.get("launches", 0) for v in report["families"].values())
    bad = sum(len(v.get("mismatches", [])) for v in report["families"].values())
    print(f"{total} checked launches, {bad} mismatching, status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
