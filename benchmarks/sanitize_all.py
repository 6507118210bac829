#!/usr/bin/env python3
"""Every GPU kernel on small adversarial inputs, for compute-sanitizer (memcheck, racecheck) on the H200.

    compute-sanitizer --tool memcheck --error-exitcode 9 python benchmarks/sanitize_all.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python benchmarks/sanitize_all.py
    python benchmarks/sanitize_all.py --out benchmarks/results        # + sanitize_all.json
    python benchmarks/sanitize_all.py --only pack,deinterleave          # some families
    python benchmarks/sanitize_all.py --only guard,scoring,splitkv,select_to_slots,indexer_compact

Kernel families (``--only`` names; each skipped, and said so, when its package or file is missing):

* ``pack`` — the Triton candidate pack (``kernels/pack_triton.py``);
* ``deinterleave`` — the Triton deinterleave: conversion, the masked layout, atomic / rowscan / two-pass
  compaction (``kernels/deinterleave_triton.py``);
* ``lse_merge`` — the Triton LSE correction and merge (``kernels/lse_merge_triton.py``);
* ``indexer`` — the Triton indexer, local top-K + pack (``kernels/indexer_triton.py``);
* ``indexer_compact`` — its compacted path (``compact=True``: sampled bound, candidate lists, the four ways of
  ``finish_filtered`` read back with ``compact_paths``, one and three segments per row, both orders);
* ``guard`` — the Triton guard stage (``kernels/guard_triton.py``; reference ``dcp_ref/guard.py``);
* ``scoring`` — the Triton FP8 index scoring (``kernels/scoring_triton.py``; reference ``dcp_ref/scoring.py``
  over the paged FP8 index-key cache of ``dcp_ref/index_cache.py``);
* ``splitkv`` — the Triton split-KV sparse MLA decode (``kernels/attention_splitkv_triton.py``);
* ``topk_cutedsl`` — the CuTeDSL stable top-K (``kernels/topk_cutedsl.py``);
* ``select_to_slots`` — the CuTeDSL owner-local select-to-slots, both orders, the cluster split
  (``kernels/select_to_slots_cutedsl.py``; reference ``dcp_ref/select_to_slots.py``);
* ``flashinfer``, ``flashmla``, ``flashmla_fp8`` — FlashInfer's sparse MLA, FlashMLA's sparse decode and its
  FP8 decode.

Inputs are small (the sanitizers slow kernels ~100x) and adversarial: the ``validate=False``
hot-path calls with the values only a host check would catch — negative and too-large row
starts, lengths and bounds (``2**40`` in int64), indices past the row, request ids before and past the
block table (``2**40``), missing (``-1``) and foreign block ids, block ids whose slot overflows int32,
counts larger than the row or negative, slots past the cache (``2**32 + 5`` must not wrap), own ids
lost, fractional / huge / negative / NaN ids, NaN data in queries, weights, caches and unwritten
slots, NaN and ``±inf`` LSEs — plus odd sizes, strided views (block tables, queries, caches, scores,
output buffers), poisoned ``out=`` / workspace / scratch buffers and in-place calls. Kernels documented
as never reading out of bounds must pass memcheck with 0 errors on all of them. Each result is also
compared with the reference (``dcp_ref``) where the contract defines it (exactly on dyadic inputs for
the scoring families; poisoned rows NaN, or padding, as each contract says). Every case runs inside
``Family.case``: a crash is recorded for that case (``crashes`` in the JSON record) and the family's other
cases still run. The script exits 1 on a mismatch, 2 when a case crashed.

On a CPU-only machine the Triton families run under ``TRITON_INTERPRET=1`` (a smoke test of this
script, ``tests/test_sanitize_all.py``; no sanitizer there) and the CUDA-only ones are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator
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
    """Launch log of one kernel family: ``check(label, ok)`` after each launch; ``with case(label):`` around a
    group of launches so that a crash in it is recorded (``crashes``) and the family's other cases still run."""

    def __init__(self, name: str) -> None:
        self.name, self.launches, self.mismatches, self.notes, self.crashes = name, 0, [], [], []

    def check(self, label: str, ok: bool) -> None:
        self.launches += 1
        if DEV.type == "cuda":
            torch.cuda.synchronize()  # an asynchronous fault is attributed to this launch
        if not ok:
            self.mismatches.append(label)
        print(f"  {self.name}: {label}: {'ok' if ok else 'MISMATCH'}", flush=True)

    @contextlib.contextmanager
    def case(self, label: str) -> Iterator[None]:
        """Run a block of launches; an exception in it is recorded as a crash of ``label`` (not re-raised)."""
        try:
            yield
        except Exception:  # a crash in one case must not hide the family's other cases
            self.crashes.append(label)
            self.notes.append(f"{label}: {traceback.format_exc(limit=3)}")
            print(f"  {self.name}: {label}: CRASH\n{traceback.format_exc()}", flush=True)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
def fam_pack(f: Family) -> None:
    from dcp_ref.kernels.pack_triton import pack_candidates_triton

    g = gen(1)
    for rows, cols, K, W, I in [(3, 8, 5, 2, 1), (2, 1, 300, 8, 2)]:
        with f.case(f"rows={rows} cols={cols} K={K}"):
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
                f.check(
                    f"rows={rows} cols={cols} K={K} W={W} I={I} {dtype} bad starts/ids", torch.equal(got.cpu(), want)
                )
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
            with f.case(f"T={T} K={K} W={W} {dt}"):
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
                f.check(
                    f"masked T={T} K={K} W={W} {dt}", torch.equal(o.cpu(), want_m) and torch.equal(c.cpu(), want_mn)
                )
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
    with f.case("atomic, non-zero workspace"):
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
    with f.case("strided ids / block table"):
        # Strided ids and block-table views (row and column strides 2 and 3), in contract: ids < 64 on rank 1 of
        # W = 2, I = 2 reach local index 31, i.e. local block 7 of block_size 4, so the table view has 8 columns.
        ids = torch.randint(-1, 64, (6, 30), generator=g)
        bt = torch.randint(0, 40, (6, 16), generator=g).to(torch.int32)
        req = torch.randint(0, 3, (3,), generator=g).to(torch.int32)
        geo = DcpGeometry(2, 1, 2, 4)
        for method in dk.METHODS:
            ordered = method != "atomic"
            want, want_n = deinterleave_and_compact(ids[::2, ::3], req, bt[::2, ::2], geo, ordered=ordered)  # validated
            o, c = dk.deinterleave_compact(
                ids.to(DEV)[::2, ::3], req.to(DEV), bt.to(DEV)[::2, ::2], geo, ordered=ordered, method=method,
                block=16, validate=False,
            )  # fmt: skip
            ok = torch.equal(c.cpu(), want_n) and torch.equal(
                canonicalize(o.cpu(), c.cpu()), canonicalize(want, want_n)
            )
            f.check(f"strided ids / block table, {method}", ok and (not ordered or torch.equal(o.cpu(), want)))


def fam_lse(f: Family) -> None:
    from dcp_ref.kernels.lse_merge_triton import lse_correct, lse_merge

    g = gen(3)
    for W, T, H, D, dtype in [
        (1, 3, 4, 32, torch.float32),
        (3, 4, 5, 24, torch.bfloat16),
        (8, 2, 6, 512, torch.float16),
    ]:
        with f.case(f"W={W} T={T} H={H} D={D} {dtype}"):
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
                res, _ = lse_correct(
                    x, lses.to(DEV), r, corrected=x if r % 2 else None, merged_lse=mlse
                )  # odd: in place
                ok = torch.equal(torch.isnan(res.cpu()), torch.isnan(want_c)) and torch.allclose(
                    res.double().cpu(), want_c, atol=tol, rtol=tol, equal_nan=True
                )
                f.check(f"correct rank {r} W={W} {'in place' if r % 2 else ''}", ok)
    with f.case("strided partials"):
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
        with f.case(f"W={W} K={K} k={k}"):
            scores = torch.randint(0, 5, (W, rows, K), generator=g).float() / 4
            ids = torch.randperm(W * rows * K, generator=g)[: W * rows * K].view(W, rows, K).float()
            scores[torch.rand(W, rows, K, generator=g) < 0.1] = NAN  # invalid
            ids[torch.rand(W, rows, K, generator=g) < 0.1] = -1.0  # invalid
            gathered = torch.stack([scores, ids], -1)
            want = stable_topk(gathered, k, sorted=True)
            got = stable_topk_cutedsl(gathered.to(DEV), k, sorted=sorted_, validate=False)
            same = (
                torch.equal(got.cpu(), want) if sorted_ else torch.equal(got.cpu().sort(1).values, want.sort(1).values)
            )
            f.check(f"W={W} K={K} k={k} sorted={sorted_} ties/NaN/-1", same)
            # ids the host check would reject (fractional, huge, negative, inf): any result, in bounds
            bad_ids = ids.clone().view(-1)
            bad_ids[::7], bad_ids[1::11], bad_ids[2::13], bad_ids[3::17] = 2.5, 3e9, -7.0, INF
            bad = torch.stack([scores, bad_ids.view(W, rows, K)], -1)
            out = torch.full((rows, k), 99, dtype=torch.int32, device=DEV)
            stable_topk_cutedsl(bad.to(DEV), k, sorted=sorted_, out=out, validate=False)
            f.check(f"W={W} K={K} k={k} bad ids, validate=False", True)


def fam_indexer(f: Family) -> None:
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack, launch_plan

    g = gen(5)
    for rows, cols, k, W, I in [(3, 40, 8, 2, 1), (2, 300, 17, 4, 2)]:
        with f.case(f"rows={rows} cols={cols} k={k}"):
            scores = (torch.randint(0, 6, (rows, cols), generator=g).float() / 5) - 0.5
            scores[torch.rand(rows, cols, generator=g) < 0.1] = NAN
            lengths = torch.randint(-5, cols + 10, (rows,), generator=g)  # negative and past the row: clamped
            starts = torch.randint(-3, cols + 3, (rows,), generator=g).to(torch.int32)
            got = indexer_topk_pack(
                scores.to(DEV), lengths.to(DEV), k, DcpGeometry(W, 1, I, I), starts.to(DEV), validate=False,
                plan=launch_plan(rows, cols, k, DEV, engine="triton"),
            )  # fmt: skip
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


def fam_local_topk(f: Family) -> None:
    """The CuTeDSL local top-K (``engine="cutedsl"``): windows outside the scores (clamped), NaN / ±inf, ties, every
    vector width (aligned, 8-byte, unaligned views), one CTA and clusters of 2 / 4 / 8, both orders."""
    from dcp_ref.indexer import local_topk_rank_local
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack, launch_plan, scores_vec

    g = gen(17)
    for rows, cols, k, off, cute in [(3, 40, 8, 0, None), (4, 301, 17, 1, None), (5, 4096, 100, 2, None),
                                     (3, 9000, 2048, 0, (2, 512, None)), (2, 40000, 2048, 0, (8, 256, 11)),
                                     (2, 131072, 2048, 0, None)]:  # fmt: skip
        with f.case(f"rows={rows} cols={cols} k={k} cute={cute}"):
            base = (torch.randint(0, 6, (rows, cols + 8), generator=g).float() / 5) - 0.5
            base[torch.rand(rows, cols + 8, generator=g) < 0.1] = NAN
            base[torch.rand(rows, cols + 8, generator=g) < 0.05] = -INF
            scores = base.to(DEV)[:, off : off + cols]  # a row-strided view (unaligned when off is odd)
            lengths = torch.randint(-5, cols + 10, (rows,), generator=g)
            lengths[0] = 2**40  # huge: clamped
            starts = torch.randint(-3, cols + 3, (rows,), generator=g)
            gm = DcpGeometry(2, 1, 2, 2)
            plan = launch_plan(rows, cols, k, DEV, engine="cutedsl", cute=cute, vec=scores_vec(scores))
            got = indexer_topk_pack(scores, lengths.to(DEV), k, gm, starts.to(DEV), validate=False, plan=plan)
            host = scores.cpu()
            want = pack_candidates(host, local_topk(host, k, lengths, starts, validate=False), gm, starts,
                                   validate=False)  # fmt: skip
            f.check(f"rows={rows} cols={cols} k={k} off={off} cute={cute} bad windows: = reference (sets)",
                    torch.equal(_pair_sets(got.cpu()), _pair_sets(want)))  # fmt: skip
            rs, ri = indexer_topk_pack(scores, lengths.to(DEV), k, gm, starts.to(DEV), validate=False, plan=plan,
                                       order="rank_local")  # fmt: skip
            ws_, wi = local_topk_rank_local(host, k, lengths, starts, validate=False)
            ok = torch.equal(ri.cpu(), wi) and torch.equal(rs.cpu().view(torch.int32), ws_.view(torch.int32))
            f.check(f"rows={rows} cols={cols} k={k} cute={cute} rank_local: = reference exactly", ok)


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
    with f.case("valid rows"):
        got = sparse_mla_flashinfer(q.to(DEV), kv.to(DEV), slots.to(DEV), counts.to(DEV), 0.1)
        f.check("valid rows vs reference", _same_attention(got, _reference(q, kv, slots, counts)))
    with f.case("validate=False bad slots / counts"):
        bad_slots, bad_counts = slots.clone(), counts.clone()
        bad_slots[1, 0] = 10**6  # past the cache
        bad_counts[2] = 500  # more than K
        bad_slots[3, 0] = -5
        _, lse = sparse_mla_flashinfer(
            q.to(DEV), kv.to(DEV), bad_slots.to(DEV), bad_counts.to(DEV), 0.1, validate=False
        )
        f.check("validate=False: bad slots / counts poison their rows", {1, 3} <= _poisoned_rows(lse))


def fam_flashmla(f: Family) -> None:
    from dcp_ref.kernels.flashmla_sparse import sparse_mla_flashmla

    g = gen(7)
    # K = 128, and K = 64 (padded to FlashMLA's width multiple of 128 by the stage's prologue kernel)
    for K, S in ((128, 400), (64, 300)):
        with f.case(f"K = {K}"):
            q, kv, slots, counts = _attention_inputs(g, 4, 64, K, S)
            got = sparse_mla_flashmla(q.to(DEV), kv.to(DEV), slots.to(DEV), counts.to(DEV), 0.1)
            f.check(f"K = {K}: valid rows vs reference", _same_attention(got, _reference(q, kv, slots, counts)))
    # splits: each token's slots cut into kernel rows and merged (K = 300 pads to 4 x 128; later splits empty)
    for splits in (2, 4):
        with f.case(f"splits = {splits}"):
            q, kv, slots, counts = _attention_inputs(g, 4, 64, 300, 500)
            got = sparse_mla_flashmla(q.to(DEV), kv.to(DEV), slots.to(DEV), counts.to(DEV), 0.1, splits=splits)
            f.check(f"splits = {splits}: vs reference", _same_attention(got, _reference(q, kv, slots, counts)))
    q, kv, slots, counts = _attention_inputs(g, 4, 64, 64, 300)
    # the hot path's bad values: a used slot past the cache or negative poisons its row; counts past K clamp
    with f.case("validate=False bad slots"):
        bad_slots, bad_counts = slots.clone().long(), counts.clone()
        bad_counts[1:] = 64
        bad_slots[1, 0] = 2**32 + 3  # int64, past the cache: must not wrap into slot 3
        bad_slots[3, 5] = -5
        bad_counts[2] = 500
        _, lse = sparse_mla_flashmla(q.to(DEV), kv.to(DEV), bad_slots.to(DEV), bad_counts.to(DEV), 0.1)
        f.check("validate=False: bad slots poison their rows", {1, 3} <= _poisoned_rows(lse))
    # the planned step's fusions: the guard in the prologue, the query read and the output written with their heads
    # in 4 groups (the gathered query, the all-to-all's send buffer), the queries repeated per split by one kernel
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.guard import GuardRows

    for splits in (1, 2):
        with f.case(f"guard taken in, heads in groups, splits = {splits}"):
            q, kv, slots, counts = (x.to(DEV) for x in _attention_inputs(g, 4, 64, 300, 500))
            bt = torch.arange(16, device=DEV, dtype=torch.int32).view(2, 8)
            bounds = torch.tensor([30, -1, 20, 64], device=DEV, dtype=torch.int32)  # token 1 out of contract
            req = torch.tensor([0, 1, 1, 0], device=DEV, dtype=torch.int32)
            iq = torch.randn(4, 4, 8, device=DEV).to(torch.float8_e4m3fn)
            iw = torch.randn(4, 4, device=DEV)
            rows = GuardRows(bounds, req, bt, DcpGeometry(1, 0, 1, 8), 64, num_blocks=16, index_q=iq, index_weights=iw)
            send_out = torch.empty(4, 4, 16, 512, dtype=torch.bfloat16, device=DEV)
            send_lse = torch.empty(4, 4, 16, device=DEV)
            grouped = q.view(4, 4, 16, 576).transpose(0, 1).contiguous().transpose(0, 1)
            sparse_mla_flashmla(grouped, kv, slots, counts, 0.1, splits=splits, out=send_out.transpose(0, 1),
                                out_lse=send_lse.transpose(0, 1), guard=rows)  # fmt: skip
            out, lse = send_out.transpose(0, 1).reshape(4, 64, 512), send_lse.transpose(0, 1).reshape(4, 64)
            ref_out, ref_lse = _reference(q.cpu(), kv.cpu(), slots.cpu(), counts.cpu())
            ok = [0, 2, 3]
            f.check("fused: the guard poisons token 1 only", _poisoned_rows(lse) == {1})
            f.check("fused: the other rows vs reference",
                    _same_attention((out[ok], lse[ok]), (ref_out[ok], ref_lse[ok])))  # fmt: skip


def fam_flashmla_fp8(f: Family) -> None:
    from dcp_ref.fp8_cache import quantize_kv_fp8, sparse_mla_attention_fp8
    from dcp_ref.kernels.flashmla_fp8 import FlashMLAFp8Decode

    g = gen(8)
    q, kv, slots, _ = _attention_inputs(g, 5, 64, 128, 500)
    cache = quantize_kv_fp8(kv)
    masked = slots.clone()
    masked[:, 1::3] = -1  # the masked layout: -1 anywhere in a row
    attn = FlashMLAFp8Decode(DEV, validate=False)
    with f.case("masked rows"):
        got = attn.attention(q.to(DEV), cache.to(DEV), masked.to(DEV), None, 0.1)
        want = sparse_mla_attention_fp8(q.double(), cache, masked, None, 0.1)
        f.check("masked rows vs the dequantizing reference", _same_attention(got, want))
    with f.case("validate=False unreadable slots"):
        bad = masked.clone().long()
        bad[2, 0] = 10**6  # past the cache
        bad[4, 2] = 2**32 + 1  # int64 past the cache: must not wrap
        _, lse = attn.attention(q.to(DEV), cache.to(DEV), bad.to(DEV), None, 0.1)
        f.check("validate=False: unreadable slots poison their rows, never read", {2, 4} <= _poisoned_rows(lse))


# ---------------------------------------------------------------------------------------------
def fam_guard(f: Family) -> None:
    from dcp_ref.guard import reference_guard
    from dcp_ref.kernels.guard_triton import guard_triton

    g = gen(9)
    # (T, H, v, B, M, bs, partial dtype, index dtype, row starts); rows 0-5 out of contract, 6-8 inside
    for T, H, V, B, M, bs, dt, it, with_starts in [
        (9, 5, 7, 3, 4, 4, torch.float32, torch.int32, False),  # odd heads / values
        (10, 16, 512, 4, 6, 8, torch.bfloat16, torch.int64, True),  # DeepSeek's value width, prefill starts
    ]:
        with f.case(f"T={T} H={H} v={V} {dt} {it}"):
            n_cols = M * bs + 3 if with_starts else M * bs - 2
            bt = torch.randperm(2 * B * M, generator=g)[: B * M].view(B, M)
            bt[1, M - 1] = -1  # request 1's last block missing
            req = torch.randint(0, B, (T,), generator=g)
            req[7:9] = 1
            bounds = torch.randint(0, n_cols - 3, (T,), generator=g)
            starts = torch.randint(0, 3, (T,), generator=g) if with_starts else None
            req[0] = -1  # before the table
            req[1] = 2**40 if it == torch.int64 else B  # past the table
            bounds[2] = -1
            bounds[3] = (M + 1) * bs  # needs more blocks than the table has
            bounds[6] = 0  # an empty row: inside the contract
            bounds[7] = M * bs - 2 if not with_starts else M * bs  # needs request 1's missing last block
            bounds[8] = (M - 1) * bs  # request 1 without its last block: inside
            if starts is not None:
                starts[4], starts[5], bounds[5] = -2, n_cols - 1, 2  # a negative start; keys past the scores
            else:
                bounds[4] = n_cols + 1  # keys past the scores (inside the table)
                bounds[5] = 2**40 if it == torch.int64 else 2**31 - 1  # a huge bound
            req, bounds = req.to(it), bounds.to(it)
            starts = None if starts is None else starts.to(it)
            # strided buffers (unit last stride) with data NaN in an in-contract row that must stay as it is
            part_full = torch.randn(T, H, V + 3, generator=g).to(dt)
            part_full[6, 0, 1] = NAN
            lse_full = torch.randn(T, 2 * H, generator=g)
            want_p, want_l = part_full[..., :V].clone(), lse_full[:, 1 : H + 1].clone()
            reference_guard(want_p, want_l, bounds, req, bt, DcpGeometry(1, 0, 1, bs), n_cols, row_starts=starts)
            part_d, lse_d = part_full.to(DEV), lse_full.to(DEV)
            # the table as a row-strided view (int32 case) or a column-strided one (int64: read through its strides)
            if it == torch.int32:
                wide = torch.full((B, M + 5), 7, dtype=it)
                wide[:, :M] = bt
                bt_d = wide.to(DEV)[:, :M]
            else:
                wide = torch.full((B, 2 * M), 7, dtype=it)
                wide[:, ::2] = bt
                bt_d = wide.to(DEV)[:, ::2]
            guard_triton(
                part_d[..., :V], lse_d[:, 1 : H + 1], bounds.to(DEV), req.to(DEV), bt_d, DcpGeometry(1, 0, 1, bs),
                n_cols, row_starts=None if starts is None else starts.to(DEV),
            )  # fmt: skip
            ok = _same_nan_and_values(part_d[..., :V], want_p) and _same_nan_and_values(lse_d[:, 1 : H + 1], want_l)
            ok &= torch.equal(part_d[..., V:].cpu(), part_full[..., V:])  # outside the view: untouched
            ok &= torch.equal(lse_d[:, 0].cpu(), lse_full[:, 0]) and torch.equal(
                lse_d[:, H + 1 :].cpu(), lse_full[:, H + 1 :]
            )
            bad_rows = [0, 1, 2, 3, 4, 5, 7]
            ok &= bool(torch.isnan(want_l[bad_rows]).all()) and not bool(torch.isnan(want_l[[6, 8]]).any())
            f.check(f"T={T} H={H} v={V} {dt} {it} starts={with_starts}: bad rows poisoned, others untouched", ok)
    # Degenerate tables: no columns (only empty rows are inside), no rows (nothing is).
    for B, M in ((2, 0), (0, 3)):
        with f.case(f"block table [{B}, {M}]"):
            bt = torch.zeros((B, M), dtype=torch.int32)
            bounds = torch.tensor([0, 1, 0], dtype=torch.int32)
            req = torch.tensor([0, 0, 5], dtype=torch.int32)
            part, lse = torch.randn(3, 4, 6, generator=g), torch.randn(3, 4, generator=g)
            want_p, want_l = part.clone(), lse.clone()
            reference_guard(want_p, want_l, bounds, req, bt, DcpGeometry(1, 0, 1, 4), 4)
            part_d, lse_d = part.to(DEV), lse.to(DEV)
            guard_triton(part_d, lse_d, bounds.to(DEV), req.to(DEV), bt.to(DEV), DcpGeometry(1, 0, 1, 4), 4)
            ok = _same_nan_and_values(part_d, want_p) and _same_nan_and_values(lse_d, want_l)
            f.check(f"block table [{B}, {M}]", ok)
    # Any view (an expanded, stride-0 table; strided metadata) and the scoring rows of a scoring step: a block
    # past the index cache, MTP pairs naming two requests, a NaN in the FP8 index query, an infinite weight.
    with f.case("expanded table, strided metadata, scoring rows"):
        T, H, V, M, bs = 8, 4, 16, 4, 4
        bt = torch.randint(0, 6, (1, M), generator=g, dtype=torch.int32)
        bt[0, 2] = 7  # past num_blocks = 6: a token needing 3+ blocks is poisoned
        meta = torch.stack([torch.randint(0, M * bs + 1, (T,), generator=g), torch.zeros(T, dtype=torch.int64)], 1)
        meta[2:4, 1] = torch.tensor([0, 1])  # the second MTP pair names requests 0 and 1
        meta[5, 0] = 4
        iq = (torch.randn(T, 64, 128, generator=g)).to(torch.float8_e4m3fn)
        iq.view(torch.uint8)[5, 63, 127] = 0x7F  # NaN
        iw = torch.rand(T, 64, generator=g)
        iw[6, 0] = float("inf")
        part, lse = torch.randn(T, H, V, generator=g), torch.randn(T, H, generator=g)
        want_p, want_l = part.clone(), lse.clone()
        kw = dict(num_blocks=6, next_n=2)
        reference_guard(want_p, want_l, meta[:, 0], meta[:, 1], bt.expand(2, M), DcpGeometry(1, 0, 1, bs), M * bs,
                        index_q=iq, index_weights=iw, **kw)  # fmt: skip
        part_d, lse_d, meta_d = part.to(DEV), lse.to(DEV), meta.to(DEV)
        guard_triton(part_d, lse_d, meta_d[:, 0], meta_d[:, 1], bt.to(DEV).expand(2, M), DcpGeometry(1, 0, 1, bs),
                     M * bs, index_q=iq.to(DEV), index_weights=iw.to(DEV), **kw)  # fmt: skip
        ok = _same_nan_and_values(part_d, want_p) and _same_nan_and_values(lse_d, want_l)
        ok &= bool(torch.isnan(want_l[[2, 3, 5, 6]]).all())
        f.check("expanded table, strided metadata, scoring rows: the reference's poison, nothing read past", ok)


def _same_nan_and_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """NaN at the same places, every other value bit-for-bit the same."""
    got = got.cpu()
    return torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def _index_problem(g: torch.Generator, T: int, B: int, bs: int, H: int, lens: tuple[int, ...], q_dtype: torch.dtype):
    """A small scoring problem on *dyadic* values (integer keys of amax 4, so scale 2**-6; integer queries; weights
    in eighths): every float32 score is exact, so the kernels must equal the float64 oracle bit for bit. ``B``
    requests with ``lens`` keys in shuffled blocks (their last block partly unwritten: NaN bytes), two more table
    rows with a missing (-1) and a foreign (10**6) block, one more column than needed. Returns ``(q, w, cache, bt,
    req, bounds, starts, L)``; rows 0-7 are out of contract (module docstring of dcp_ref.scoring) or carry NaN."""
    from dcp_ref.index_cache import make_index_cache, write_index_keys

    nblk = [max(1, -(-n // bs)) for n in lens]
    M = max(nblk) + 1
    NB = sum(nblk) + 2
    perm = torch.randperm(NB, generator=g).tolist()
    bt = torch.full((B + 2, M), -1, dtype=torch.int64)
    cache = make_index_cache(NB, bs)
    pool = torch.randint(-4, 5, (6, 128), generator=g).float()
    pool[:, 0] = torch.tensor([4.0, -4.0, 4.0, -4.0, 4.0, -4.0])  # amax 4 in every key: the scale is 2**-6
    for b, n in enumerate(lens):
        blocks = [perm.pop() for _ in range(nblk[b])]
        bt[b, : nblk[b]] = torch.tensor(blocks)
        slots = torch.tensor([blocks[j // bs] * bs + j % bs for j in range(n)])
        write_index_keys(cache, slots, pool[torch.randint(0, 6, (n,), generator=g)], bs)  # repeated keys: ties
    bt[B, 1:] = bt[0, : M - 1]
    bt[B, 0] = -1  # no block
    bt[B + 1] = bt[0]
    bt[B + 1, 1] = 10**6  # not a block of the cache
    req = torch.randint(0, B, (T,), generator=g)
    cap = torch.tensor([nblk[int(r)] * bs for r in req])  # up to the end of the last block: unwritten slots read NaN
    bounds = (torch.rand(T, generator=g) * (cap + 1)).long().clamp(max=cap)
    starts = torch.randint(0, 5, (T,), generator=g)
    L = M * bs + 5
    q = torch.randint(-3, 4, (T, H, 128), generator=g).float()
    w = torch.randint(-8, 9, (T, H), generator=g).float() / 8
    req[0] = -1  # before the table
    bounds[1] = -3
    starts[2] = -1
    bounds[3] = M * bs + 1  # more keys than the table covers
    starts[4], bounds[4] = L - 1, 2  # past the score width
    req[5], bounds[5] = B, bs + 1  # its first block is missing
    req[6], bounds[6] = B + 1, 2 * bs  # its second block is not in the cache
    w[7, 1], bounds[7] = NAN, cap[7]  # NaN data: the row's keys score NaN
    if q_dtype != torch.float8_e4m3fn:
        q[7, 2, 5] = NAN  # NaN in the query too (the FP8 dot's NaN rules are not this script's business)
    return q.to(q_dtype), w, cache, bt, req, bounds, starts, L


def _dev(*ts: torch.Tensor | None) -> list:
    return [None if t is None else t.to(DEV) for t in ts]


def fam_scoring(f: Family) -> None:
    from dcp_ref.kernels.scoring_triton import index_scores_triton, scoring_plan
    from dcp_ref.scoring import index_scores

    g = gen(10)
    fp8 = torch.float8_e4m3fn
    for T, B, bs, H, lens, it, qdt, block_n, tiles in [
        (9, 3, 4, 5, (10, 7, 13), torch.int32, fp8, 16, 1),  # 5 heads (padded to 16), keys of a tile span blocks
        (10, 3, 8, 64, (40, 3, 21), torch.int64, fp8, 32, 2),  # 64 heads, two tiles per program
        (8, 2, 3, 3, (11, 5), torch.int32, torch.bfloat16, 16, 1),  # block size 3, the teaching dtype, NaN in q
    ]:
        with f.case(f"T={T} bs={bs} H={H} {qdt}"):
            q, w, cache, bt, req, bounds, starts, L = _index_problem(g, T, B, bs, H, lens, qdt)
            if it == torch.int64:
                req[0] = -(2**40)  # a request id far outside the table
            bt, req, bounds, starts = bt.to(it), req.to(it), bounds.to(it), starts.to(it)
            geo = DcpGeometry(1, 0, 1, bs)
            want = index_scores(
                q, w, cache, bt, req, bounds, geo, row_starts=starts, out=torch.empty(T, L), validate=False
            )
            out = torch.full((T, L), 12345.0, device=DEV)  # poisoned: every entry must be written
            # strided views: the query's heads, the weights' heads and the table's columns at stride 2
            qd = torch.zeros((T, 2 * H, 128), dtype=qdt, device=DEV)[:, ::2]
            qd.copy_(q.to(DEV))
            wd = torch.zeros((T, 2 * H), device=DEV)[:, ::2]
            wd.copy_(w.to(DEV))
            btd = torch.full((bt.shape[0], 2 * bt.shape[1]), 10**6, dtype=it, device=DEV)[:, ::2]
            btd.copy_(bt.to(DEV))
            plan = scoring_plan(T, L, DEV, block_size=bs, block_n=block_n, tiles=tiles)
            got = index_scores_triton(
                qd, wd, cache.to(DEV), btd, *_dev(req, bounds), geo, row_starts=starts.to(DEV), out=out,
                validate=False, plan=plan,
            )  # fmt: skip
            ok = got is out and _same_nan_and_values(got, want) and bool(torch.isnan(want[:8]).any(1).all())
            f.check(f"T={T} bs={bs} H={H} {qdt} {it}: bad rows NaN, the rest exact", ok)
            # decode without out (the width from the table) and without row starts
            dec = bounds.clone()
            dec[4] = width = bt.shape[1] * bs  # exactly the table's width: inside
            want = index_scores(q, w, cache, bt, req, dec, geo, validate=False)
            plan = scoring_plan(T, width, DEV, block_size=bs, block_n=block_n)  # (the table's width)
            got = index_scores_triton(*_dev(q, w, cache, bt, req, dec), geo, validate=False, plan=plan)
            f.check(f"T={T} bs={bs} decode, width {width} from the table", _same_nan_and_values(got, want))
    _scoring_mtp_cases(f, g)


def _scoring_mtp_cases(f: Family, g: torch.Generator) -> None:
    """MTP pairs (``next_n = 2``) by one dot and by two, TMA and cp.async, 64-key blocks, with the decode verdict's
    first-entries part made 2 entries (``SCAN`` patched) so that rows of 4 blocks read entries on both sides of
    it: the table rows with a missing and a foreign block (every request's pairs) and a pair of two requests."""
    from dcp_ref.kernels import scoring_triton as st
    from dcp_ref.scoring import index_scores

    lens = (230, 130, 64)
    q, w, cache, bt, _, _, _, L = _index_problem(g, 10, 3, 64, 64, lens, torch.float8_e4m3fn)
    req = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 1])  # rows 3 and 4: the bad table rows; the last pair mixed
    full = [*lens, lens[0], lens[0]]
    bounds = torch.tensor([full[int(r)] - 1 + (i % 2) for i, r in enumerate(req)]).clamp(min=0)
    bounds[9] = 100
    geo = DcpGeometry(1, 0, 1, 64)
    want = index_scores(q, w, cache, bt, req, bounds, geo, out=torch.empty(10, L), validate=False, next_n=2)
    saved, st.SCAN = st.SCAN, 2
    try:
        for pair_dot in (True, False):
            for tma in (True, False):
                with f.case(f"MTP pair_dot={pair_dot} tma={tma}"):
                    out = torch.full((10, L), 12345.0, device=DEV)
                    plan = st.scoring_plan(10, L, DEV, next_n=2, block_size=64, pair_dot=pair_dot,
                                           tma=tma, tiles=2)  # fmt: skip
                    got = st.index_scores_triton(*_dev(q, w, cache, bt, req, bounds), geo, out=out, validate=False,
                                                 next_n=2, plan=plan)  # fmt: skip
                    ok = got is out and _same_nan_and_values(got, want) and bool(torch.isnan(want[6:]).all())
                    f.check(f"MTP pair_dot={pair_dot} tma={tma}: bad pairs NaN, the rest exact", ok)
    finally:
        st.SCAN = saved


def _pair_sets(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[T, k]``: each row's (score, id) float32 pairs as sorted bit patterns (compare rows as sets)."""
    return torch.sort(x.cpu().contiguous().view(torch.int64).squeeze(-1), 1).values


def fam_splitkv(f: Family) -> None:
    from dcp_ref.kernels import attention_splitkv_triton as sk

    g = gen(12)
    with f.case("DeepSeek dims"):
        # DeepSeek's 576 / 512 dims in bf16, one empty row: one split, and the default plan (two splits here)
        q, kv, slots, counts = _attention_inputs(g, 4, 16, 64, 300)
        want = _reference(q, kv, slots, counts)
        for opts in ({}, {"num_splits": 1, "block_n": 32}):  # the default plan splits (3 splits: below)
            plan = sk.splitkv_plan(4, 16, 64, DEV, **opts) if opts else None  # None: the default plan
            got = sk.sparse_mla_splitkv(*_dev(q, kv, slots, counts), 0.1, 512, validate=False, plan=plan)
            f.check(f"valid rows vs reference, {opts or 'default plan'}", _matches_attention(got, want))
    for dt, sdt in ((torch.int32, torch.float16), (torch.int64, torch.bfloat16)):
        with f.case(f"validate=False bad slots / counts, {dt} {sdt}"):
            T, H, K, S, bs = 8, 16, 48, 200, 8
            q = (torch.randn(T, H, 576, generator=g) / 8).to(sdt)
            kv = (torch.randn(S, 576, generator=g) / 8).to(sdt)
            slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)]).to(dt)  # distinct, in range
            counts = torch.full((T,), K, dtype=dt)
            counts[0], counts[1], counts[2] = -3, K + 7, 0  # empty, clamped to K, empty
            slots[3, 40] = S  # one past the cache, in the last split
            slots[4, 0] = 2**32 + 5 if dt == torch.int64 else -(2**31)  # must not wrap into slot 5
            slots[5, 10] = -5  # a negative slot inside the count
            counts[6] = 30
            slots[6, 35] = 10**9 if dt == torch.int64 else -7  # past the count: never read, harmless
            q[7, 3, 100] = NAN  # exactly (7, 3) NaN
            # NaN in a RoPE dim of a cache row that only row 6 attends: exactly row 6 NaN
            others = {int(x) for t in range(T) if t != 6 for x in slots[t, : max(0, min(int(counts[t]), K))]}
            lone = next(x for x in range(S) if x not in others and x not in slots[6].tolist())
            slots[6, 2] = lone
            kv[lone, 570] = NAN
            want = sparse_mla_attention(q.double(), kv.double(), slots, counts, 0.1, v_dim=512, validate=False)
            # a paged cache with padded blocks ([blocks, bs, 1, 576] viewed out of [blocks, bs + 2, 1, 576]),
            # strided q / out / out_lse, a planned workspace poisoned with NaN
            paged = torch.full((S // bs, bs + 2, 1, 576), NAN, dtype=sdt, device=DEV)[:, :bs]
            paged.copy_(kv.view(S // bs, bs, 1, 576).to(DEV))
            qd = torch.full((T, 2 * H, 576), NAN, dtype=sdt, device=DEV)[:, 1::2]
            qd.copy_(q.to(DEV))
            out = torch.full((T, H, 512 + 16), 7.0, dtype=sdt, device=DEV)[..., :512]
            out_lse = torch.full((T, 2 * H), 7.0, device=DEV)[:, ::2]
            for ns in (1, 3):
                plan = sk.splitkv_plan(T, H, K, DEV, num_splits=ns, block_n=16)
                ws = sk.workspace_for(plan, DEV).fill_(NAN)
                got = sk.sparse_mla_splitkv(
                    qd, paged, *_dev(slots, counts), 0.1, 512, out=out, out_lse=out_lse, workspace=ws, validate=False,
                    plan=plan,
                )  # fmt: skip
                ok = got[0] is out and got[1] is out_lse and _matches_attention(got, want)
                ok &= {3, 4, 5, 6} <= _poisoned_rows(got[1]) and _poisoned_rows(got[1]) == _poisoned_rows(want[1])
                f.check(f"{dt} {sdt} splits={ns}: empty / clamped / poisoned rows, paged cache, strided buffers", ok)


def _matches_attention(got: tuple, want: tuple) -> bool:
    """A GPU attention's (out, lse) against the float64 reference: NaN and ``-inf`` at the same places, the rest
    close (bf16 outputs)."""
    o, lse = got[0].double().cpu(), got[1].double().cpu()
    wo, wl = want[0].cpu(), want[1].cpu()
    ok = torch.equal(torch.isnan(lse), torch.isnan(wl)) and torch.equal(torch.isneginf(lse), torch.isneginf(wl))
    ok &= torch.equal(torch.isnan(o), torch.isnan(wo))
    fin = torch.isfinite(wl)
    ok &= torch.allclose(lse[fin], wl[fin], atol=1e-2) and torch.allclose(o, wo, atol=3e-2, equal_nan=True)
    return bool(ok)


def fam_select_to_slots(f: Family) -> None:
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl
    from dcp_ref.select_to_slots import SENTINEL_SLOT, select_to_slots

    g = gen(13)
    # (W, K, k, I, bs, rows, int64 indices, tuning)
    for W, K, k, I, bs, rows, i64, tune in [
        (2, 64, 32, 1, 16, 24, False, {}),
        (3, 7, 5, 1, 4, 24, True, {}),  # odd K: scalar loads
        (4, 128, 300, 2, 8, 16, False, {}),  # k > W*K
        (4, 128, 100, 2, 8, 12, True, {"split": 2}),  # a cluster of two CTAs per row (distributed shared memory)
    ]:
        for order in ("global_id", "rank_local"):
            with f.case(f"{order} W={W} K={K} k={k} {tune}"):
                pairs, scores, own, req, table = _select_case(g, W, K, rows, I, bs)
                if i64:
                    req, table = req.long(), table.long()
                    req[3] = 2**40  # far past the table
                    table[int(req[7]), 0] = 2**30  # its slots overflow int32: the sentinel, never wrapped
                gathered = pairs if order == "global_id" else scores
                for r in (0, W - 1):
                    geo = DcpGeometry(W, r, I, bs)
                    own_r = None if order == "global_id" else own[r].contiguous()
                    want = select_to_slots(gathered, req, table, geo, k, order=order, own_ids=own_r, validate=False)
                    out_s = torch.full((rows, k), 12345, dtype=torch.int32, device=DEV)
                    out_n = torch.full((rows,), 777, dtype=torch.int32, device=DEV)
                    # the request ids and the table as strided views
                    req_d = torch.stack([req, req], 1).to(DEV)[:, 0]
                    wide = torch.full((table.shape[0], 2 * table.shape[1] + 1), 5, dtype=table.dtype, device=DEV)
                    wide[:, 1::2] = table.to(DEV)
                    got = select_to_slots_cutedsl(
                        gathered.to(DEV), req_d, wide[:, 1::2], geo, k, order=order,
                        own_ids=None if own_r is None else own_r.to(DEV), out_slots=out_s, out_counts=out_n,
                        validate=False, **tune,
                    )  # fmt: skip
                    s, n = got[0].cpu(), got[1].cpu()
                    tail = torch.arange(k) >= n.unsqueeze(1).long()
                    ok = torch.equal(n, want[1]) and bool((s[tail] == -1).all())
                    ok &= torch.equal(canonicalize(s, n), canonicalize(*want))
                    f.check(f"{order} W={W} K={K} k={k} rank {r} {tune}: = reference (sets)", ok)
                    # validated (the select kernel's own checks where it has one CTA per row): the reference's refusal
                    want_msg = _refusal(select_to_slots, gathered, req, table, geo, k, order=order, own_ids=own_r)
                    got_msg = _refusal(
                        select_to_slots_cutedsl, *_dev(gathered, req), table.to(DEV), geo, k, order=order,
                        own_ids=_dev(own_r)[0], **tune,
                    )  # fmt: skip
                    f.check(
                        f"{order} W={W} K={K} rank {r} {tune} validated: refuses as the reference", want_msg == got_msg
                    )
                    poisoned = bool((want[0] == SENTINEL_SLOT).any())
                    if order == "global_id" and r == 0:
                        # ids the contract leaves unspecified (fractional, >= 2**24, negative, NaN): memory-safe
                        bad = pairs.clone().view(-1, 2)
                        bad[::7, 1], bad[1::11, 1], bad[2::13, 1], bad[3::17, 1] = 2.5, 3e9, -7.0, NAN
                        bad = bad.view_as(pairs)
                        select_to_slots_cutedsl(
                            bad.to(DEV), req.to(DEV), table.to(DEV), geo, k, order=order,
                            out_slots=out_s, out_counts=out_n, validate=False, **tune,
                        )  # fmt: skip
                        f.check(f"{order} W={W} K={K} bad ids (any answer, in bounds; poisoned rows {poisoned})", True)
                        want_msg = _refusal(select_to_slots, bad, req, table, geo, k)
                        got_msg = _refusal(select_to_slots_cutedsl, bad.to(DEV), req.to(DEV), table.to(DEV), geo, k)
                        f.check(f"{order} W={W} K={K} bad ids validated: refuses as the reference", want_msg == got_msg)


def _refusal(fn: Callable[..., object], *args: object, **kw: object) -> str | None:
    """The ``ValueError`` message of ``fn(*args, **kw)``, or ``None`` when it returns."""
    try:
        fn(*args, **kw)
    except ValueError as e:
        return str(e)
    return None


def _select_case(g: torch.Generator, W: int, K: int, rows: int, I: int, bs: int):
    """Candidates of both wire formats for ``rows >= 9`` rows: random / tied / ±0 / NaN and -inf scores, padding
    (row 5 all padding), and out-of-contract metadata: request ids -1 and B (rows 1, 2), a hole in the table (row
    4), local indices past it (row 8), real scores without their own ids (row 6, rank_local).
    Returns ``(pairs [W,T,K,2], scores [W,T,K], own [W,T,K] int32, req int32 [T], table int32 [B,M])``."""
    flav = torch.arange(rows) % 6
    loc = torch.cumsum(torch.randint(1, 3, (W, rows, K), generator=g), -1) - 1  # distinct, ascending
    pad = torch.rand(W, rows, K, generator=g) < torch.tensor([0.05, 0.1, 0.0, 0.5, 0.1, 1.0])[flav].view(1, rows, 1)
    loc[:, 8] += 4 * K  # row 8's local indices lie past the table (its winners here have no block)
    loc = torch.where(pad, -1, loc)
    sc = torch.randn(W, rows, K, generator=g)
    sc = torch.where((flav == 1).view(1, rows, 1), torch.randint(0, 3, (W, rows, K), generator=g).float(), sc)
    zeros = torch.where(torch.rand(W, rows, K, generator=g) < 0.5, -0.0, 0.0)
    sc = torch.where((flav == 2).view(1, rows, 1), zeros, sc)
    u = torch.rand(W, rows, K, generator=g)
    sc = torch.where((flav == 4).view(1, rows, 1) & (u < 0.1), NAN, sc)
    sc = torch.where((flav == 4).view(1, rows, 1) & (u > 0.9), -INF, sc)
    gid = torch.where(loc >= 0, (loc // I) * (W * I) + torch.arange(W).view(W, 1, 1) * I + loc % I, -1)
    pairs = torch.stack([torch.where(loc >= 0, sc, -INF), gid.float()], -1)
    scores = torch.where(loc >= 0, sc, NAN)
    own = loc.to(torch.int32)
    B = rows + 2
    n_blocks = (2 * K + 1) // bs + 1  # covers every local index (< 2K) but row 8's
    table = torch.randperm(3 * B * n_blocks, generator=g)[: B * n_blocks].view(B, n_blocks).to(torch.int32)
    req = torch.randperm(B, generator=g)[:rows].to(torch.int32)
    req[1], req[2] = -1, B  # outside the table
    table[int(req[4]), 0] = -1  # a hole
    own[:, 6] = torch.where(torch.rand(W, K, generator=g) < 0.1, -1, own[:, 6])  # real scores, lost own ids
    return pairs, scores, own, req, table


def fam_indexer_compact(f: Family) -> None:
    from dcp_ref.indexer import local_topk_rank_local
    from dcp_ref.kernels import indexer_triton as ix

    g = gen(14)
    geo = DcpGeometry(2, 1, 2, 2)
    with f.case("the four ways"):
        # Rows that send the compacted path down each of its four ways (kernels.indexer_triton.finish_filtered):
        # the list; ties at the sampled bound; the keys above the bound listed again; the sample missed.
        n = 400
        sampled = (torch.arange(16) * n) // 16  # the keys a 16-key sample of a 400-key row looks at
        const = torch.full((1, n), 2.5)
        missed = torch.ones(1, n)
        missed[0, sampled] = 0.0
        above = torch.ones(1, n)
        above[0, sampled[:10] + 1] = 5.0
        g0 = gen(0)  # the normal row whose sample bound holds every winner (tests/test_indexer_kernel.py's)
        normal = torch.randn(1, n, generator=g0)
        ties = torch.randint(0, 4, (1, n), generator=g0).float()
        s = torch.cat([normal, const, missed, ties, above])
        seen: set[int] = set()
        for split in (1, 3):
            kw = dict(plan=ix.launch_plan(5, n, 5, DEV, compact=True, split=split, tile=64, sample=16))
            ws = ix.workspace_for(s.to(DEV), 5, **kw)
            out = torch.full((5, 5, 2), NAN, device=DEV)
            got = ix.indexer_topk_pack(s.to(DEV), None, 5, geo, out=out, workspace=ws, validate=False, **kw)
            want = pack_candidates(s, local_topk(s, 5), geo)
            paths = ix.compact_paths(ws).tolist()
            seen.update(paths)
            ok = got is out and torch.equal(_pair_sets(got), _pair_sets(want)) and not bool(ws[:, -2].any().cpu())
            f.check(f"split={split}: ways {paths}, = reference, arrival counters back at 0", ok)
            rs, ri = ix.indexer_topk_pack(
                s.to(DEV), None, 5, geo, order="rank_local", workspace=ws, validate=False, **kw
            )
            ws_, wi = local_topk_rank_local(s, 5)
            ok = torch.equal(ri.cpu(), wi) and torch.equal(rs.cpu().view(torch.int32), ws_.view(torch.int32))
            f.check(f"split={split} rank_local: = reference exactly", ok)
        f.check(f"every way taken ({sorted(seen)})", seen == {1, 2, 3, 4})
    for split, k, it in ((2, 8, torch.int64), (1, 30, torch.int32)):
        with f.case(f"bad windows split={split} k={k}"):
            # validate=False: lengths negative / past the row / huge, starts negative / past the row, on a view
            # inside a buffer whose other columns are 3e38 (a read outside the view would make 3e38 a winner);
            # rows of NaN / -inf / +inf / subnormal / constant scores.
            T, cols, outside = 8, 120, 3e38
            big = torch.full((T, cols + 20), outside)
            view = torch.randn(T, cols, generator=g)
            view[1] = torch.randint(0, 3, (cols,), generator=g).float()  # ties
            view[2, ::5], view[2, 1::7], view[2, 2::11] = NAN, -INF, INF
            view[3] = NAN
            view[4] = torch.tensor([0.0, -0.0, 1e-45, -1e-40])[torch.randint(0, 4, (cols,), generator=g)]
            view[5] = 0.5
            big[:, 10 : 10 + cols] = view
            lengths = torch.tensor([cols + 50, -5, cols, 2**40 if it == torch.int64 else 2**31 - 1, 60, 7, 0, cols])
            starts = torch.tensor([30, 0, -7, 45, cols + 3, 3, 5, 0])
            lengths, starts = lengths.to(it), starts.to(it)
            cs = starts.long().clamp(0, cols)
            cl = torch.minimum(lengths.long().clamp(min=0), cols - cs)
            want = pack_candidates(view, local_topk(view, k, cl, cs), geo, cs)
            kw = dict(plan=ix.launch_plan(T, cols, k, DEV, compact=True, split=split, tile=64, sample=16))
            ws = ix.workspace_for(view.to(DEV), k, **kw)
            ws[:, :-2] = -1  # poisoned lists and list counts (only the arrival counters must start at 0)
            out = torch.full((T, k, 2), NAN, device=DEV)
            s_d = big.to(DEV)[:, 10 : 10 + cols]
            got = ix.indexer_topk_pack(
                s_d, *_dev(lengths), k, geo, starts.to(DEV), out=out, workspace=ws, validate=False, **kw
            )
            ok = torch.equal(_pair_sets(got), _pair_sets(want)) and not bool((got[..., 0] == outside).any().cpu())
            f.check(f"split={split} k={k} {it}: clamped windows = reference, nothing outside read", ok)
            rs, ri = ix.indexer_topk_pack(
                s_d.t().contiguous().t(),
                *_dev(lengths),
                k,
                geo,
                starts.to(DEV),
                order="rank_local",
                out=torch.full((T, k), 7.0, device=DEV),
                out_ids=torch.full((T, k), 7, dtype=torch.int32, device=DEV),
                workspace=ws,
                validate=False,
                **kw,
            )  # fmt: skip  (a column-major view)
            ws_, wi = local_topk_rank_local(view, k, cl, cs)
            ok = torch.equal(ri.cpu(), wi) and torch.equal(rs.cpu().view(torch.int32), ws_.view(torch.int32))
            f.check(f"split={split} k={k} rank_local, column-major view: = reference exactly", ok)


FAMILIES: dict[str, tuple[Callable[[Family], None], str, str]] = {
    # name: (run, what it needs, "triton" families also run interpreted on the CPU)
    "pack": (fam_pack, "triton", "triton"),
    "deinterleave": (fam_deinterleave, "triton", "triton"),
    "lse_merge": (fam_lse, "triton", "triton"),
    "indexer": (fam_indexer, "triton", "triton"),
    "indexer_compact": (fam_indexer_compact, "triton", "triton"),
    "guard": (fam_guard, "triton", "triton"),
    "scoring": (fam_scoring, "triton", "triton"),
    "splitkv": (fam_splitkv, "triton", "triton"),
    "topk_cutedsl": (fam_topk, "cutlass", "cuda"),
    "select_to_slots": (fam_select_to_slots, "cutlass", "cuda"),
    "local_topk": (fam_local_topk, "cutlass", "cuda"),
    "flashinfer": (fam_flashinfer, "flashinfer", "cuda"),
    "flashmla": (fam_flashmla, "flash_mla", "cuda"),
    "flashmla_fp8": (fam_flashmla_fp8, "flash_mla", "cuda"),
}
_FILES = {
    "indexer": "kernels/indexer_triton.py",
    "indexer_compact": "kernels/indexer_triton.py",
    "guard": "kernels/guard_triton.py",
    "scoring": "kernels/scoring_triton.py",
    "splitkv": "kernels/attention_splitkv_triton.py",
    "select_to_slots": "kernels/select_to_slots_cutedsl.py",
    "local_topk": "kernels/local_topk_cutedsl.py",
    "flashmla": "kernels/flashmla_sparse.py",
}


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
        t0 = time.perf_counter()
        try:
            run(fam)
        except Exception:  # a crash outside the family's cases must not hide the other families' results
            fam.crashes.append("(family)")
            fam.notes.append(traceback.format_exc(limit=3))
            print(traceback.format_exc(), flush=True)
        seconds = round(time.perf_counter() - t0, 2)
        if fam.crashes:
            status = 2
        elif fam.mismatches:
            status = max(status, 1)
        print(f"{name}: {fam.launches} launches, {len(fam.mismatches)} mismatching, {len(fam.crashes)} crashed cases, "
              f"{seconds} s", flush=True)  # fmt: skip
        report["families"][name] = {
            "launches": fam.launches,
            "mismatches": fam.mismatches,
            "crashes": fam.crashes,
            "errors": fam.notes,
            "seconds": seconds,
        }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sanitize_all.json").write_text(json.dumps(report, indent=1) + "\n")
    total = sum(v.get("launches", 0) for v in report["families"].values())
    bad = sum(len(v.get("mismatches", [])) for v in report["families"].values())
    print(f"{total} checked launches, {bad} mismatching, status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
