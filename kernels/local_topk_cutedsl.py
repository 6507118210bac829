"""CuTeDSL kernel: the indexer stage's local stable top-K + pack, every score read from HBM once.

The GPU twin of ``pack_candidates(scores, local_topk(scores, k, lengths, row_starts), geometry,
row_starts)`` (:mod:`dcp_ref.indexer`, :mod:`dcp_ref.topk`), with the layout of
:func:`dcp_ref.kernels.indexer_triton.indexer_topk_pack`: ``order="global_id"`` writes ``(score, global id)``
pairs, the winners by increasing local index, then ``(-inf, -1)``; ``order="rank_local"`` writes the winners'
scores (exact float32 bits) by increasing local index with NaN padding, and their local indices (``-1``).

**One read.** A row lives in registers, spread over a CTA — or, for rows longer than one CTA holds (32 keys a
thread, 1024 threads), over a thread-block **cluster** of ``C`` CTAs (2, 4 or 8): every CTA loads its share
once, with 16-byte vector loads (``vec`` = 4 keys; 2 or 1 where the scores are not aligned for it), and every
radix pass runs on the registers. A cluster's CTAs count each pass into their own shared-memory histogram and
sum the ``C`` histograms through distributed shared memory (``ld.shared::cluster``), so that every CTA finds
the same threshold with no broadcast (the passes, the histogram merge and the bin scan are those of
:class:`~dcp_ref.kernels.select_to_slots_cutedsl.SelectToSlotsKernel`, which are those of the stable top-K).

**Keys.** ``hi`` = the score's order-preserving bits (``-0.0`` made ``+0.0``; NaN and columns outside the row's
window ``[start, start + length)`` give ``0``: invalid). The index is not in the key: the radix passes fix the
32 score bits (8-bit digits; ``first_bits`` 11 or 12 widens the first), and a threshold value shared by more
keys than are still needed is resolved by **position** in the commit.

**Commit in index order.** With the threshold found, a key wins when it is above it, or equal to it and among
the first ``need`` such keys by local index. Item ``s`` of vector load ``ci`` of thread ``tid`` of cluster CTA
``c`` is key ``pos = ((c*cpt + ci)*T + tid)*vec + s`` of the row, so index order is (CTA, load, thread, item).
Each winner's output slot is the number of winners (and of tied keys) before it, plus the totals of the
cluster's lower CTAs; the winners come out in increasing local index as the contract says. Two commits
(:data:`COMMITS`; the plan picks one per shape, :func:`commit_for`):

- ``"scan"`` (:meth:`LocalTopKKernel.commit`): one exclusive scan per vector load over the block (a warp scan,
  then a scan of the warp totals) gives every key its count — no atomics, but ~58 instructions a key (sm_90a
  SASS, 32 keys a thread) and a register spill at 1024 threads.
- ``"bitmap"`` (:meth:`LocalTopKKernel.commit_bitmap`): every winner and tie sets its position's bit in a
  shared-memory bitmap (``atom.shared.or``; ~9 instructions a key, most of them two compares); one block scan
  over the words' popcounts gives each word its first slot, and each word's bits are written lowest first, their
  scores re-read. Faster where winners are sparse (``benchmarks/results/local_topk_commit_ab.json``).

**Staged writes** (the scan commit). A CTA's winners fill one contiguous range of output slots (its keys all
come after the lower CTAs' keys), so the commit puts each winner's key and column into shared memory at its slot
in that range (:meth:`LocalTopKKernel.commit`), and after one barrier the CTA's threads write the range out, one slot a
thread (:meth:`LocalTopKKernel.write_staged`): the global id's division and the 8-byte store run once per winner,
coalesced, instead of once per key position under a branch that some lane of nearly every warp takes (~6 % of
keys win at ``k = 2048``, ``L = 32K``: a warp's 32 lanes hold a winner at ~87 % of positions). ``k`` above
:data:`STAGE_MAX_K` (the staging would take more than 64 KiB of shared memory) writes directly.

Measured and not kept: a shared-memory list of pass 0's threshold bin for the later passes, with a 12-bit first
digit and the scan commit, was slower at every swept shape (``benchmarks/results/local_topk_sweep.json``); with
the bitmap commit (the list filled in pass 1, counted from pass 2), slower than the bitmap alone at all 19 rows
(``local_topk_commit_ab.json``).

Limits (checked by :func:`plan_for`, which returns ``None`` outside them: the Triton kernel takes the row):
``cols <= 8 * 32768`` keys per row, ``k <= 32768``, float32 scores with unit column stride.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32, Uint64, const_expr

from dcp_ref.contracts import check_int_scalar, check_tensor

from ._launch import KERNEL_LOCK
from ._util import cdiv, compiled_artifacts, nearest_shapes
from .select_to_slots_cutedsl import H200_SMS, SelectToSlotsKernel, cluster_sync, dsmem_load
from .topk_cutedsl import (
    FIRST_BITS,
    MASK32,
    State,
    digit_schedule,
    launch_per_row,
    use_tvm_ffi,
    warp_inclusive_scan,
)

__all__ = [
    "CLUSTERS",
    "COMMITS",
    "commit_for",
    "LocalTopKConfig",
    "LocalTopKKernel",
    "MAX_KEYS_PER_THREAD",
    "plan_for",
    "compile_local_topk",
    "compile_artifacts",
    "local_topk_pack_cutedsl",
]

#: CTAs per row (a thread-block cluster above 1; 8 is the portable maximum).
CLUSTERS = (1, 2, 4, 8)
#: The commits: ``"bitmap"`` (:meth:`LocalTopKKernel.commit_bitmap`: winners marked in a shared-memory bitmap by
#: position, one scan over its words) and ``"scan"`` (:meth:`LocalTopKKernel.commit`: a block scan per vector load).
COMMITS = ("bitmap", "scan")
#: Keys a thread holds in registers at most.
MAX_KEYS_PER_THREAD = 32
#: Keys a thread holds with (nearly) no register spill (ptxas, sm_90a, 1024 threads = 64 registers: 32 keys
#: spill 152 bytes a thread, 16 keys 24-40; 512 threads of 16 keys: none): the plan's first choice.
SPILL_FREE_KEYS = 16
#: Shared-state words of this kernel beyond :class:`State`'s (its words 9-15 are free).
CTA_ABOVE = 9  #: this CTA's winners above the threshold (read by the cluster's higher CTAs)
CTA_TIES = 10  #: this CTA's keys equal to the threshold
#: The least keys per CTA when the plan spreads a row over a cluster.
SPREAD_MIN_KEYS = 8192
#: The largest ``k`` whose winners are staged in shared memory (8 bytes each: 64 KiB) before they are written.
STAGE_MAX_K = 8192
NEG_INF_BITS = 0xFF800000
NEG_ONE_BITS = 0xBF800000  # float32 -1.0
NAN_BITS = 0x7FC00000
SIGN = 0x80000000


@dataclass(frozen=True)
class LocalTopKConfig:
    """One compiled configuration (the compile cache key; ``rows``, ``cols``, strides and geometry are dynamic).

    Attributes:
        k: winners per row.
        cluster: CTAs per row (:data:`CLUSTERS`).
        threads: threads per CTA (256, 512 or 1024).
        cpt: vector loads per thread; a row holds ``cluster * threads * cpt * vec`` keys at most.
        vec: keys per vector load (4, 2 or 1; the scores' alignment decides).
        order: ``"global_id"`` or ``"rank_local"``.
        len_bits, start_bits: 0 (no tensor), 32 or 64 (its dtype) for ``lengths`` / ``row_starts``.
        check: the in-kernel window check of a validated call (raises the flag).
        first_bits: width of the first radix digit (:data:`~dcp_ref.kernels.topk_cutedsl.FIRST_BITS`).
        min_ctas: ptxas ``minctasm`` (CTAs per SM the registers must allow; 0: no cap).
        tvm_ffi: compiled for the TVM-FFI call path.
        commit: how the winners find their slots (:data:`COMMITS`).
    """

    k: int
    cluster: int = 1
    threads: int = 1024
    cpt: int = 8
    vec: int = 4
    order: str = "global_id"
    len_bits: int = 32
    start_bits: int = 0
    check: bool = False
    first_bits: int = 8
    min_ctas: int = 0
    tvm_ffi: bool = False
    commit: str = "bitmap"

    def __post_init__(self) -> None:
        if self.commit not in COMMITS:
            raise ValueError(f"commit must be one of {COMMITS}, got {self.commit!r}")
        if self.cluster not in CLUSTERS:
            raise ValueError(f"cluster must be one of {CLUSTERS}, got {self.cluster!r}")
        if self.threads not in (256, 512, 1024):
            raise ValueError(f"threads must be 256, 512 or 1024, got {self.threads!r}")
        if self.vec not in (1, 2, 4):
            raise ValueError(f"vec must be 1, 2 or 4, got {self.vec!r}")
        if not 1 <= self.cpt * self.vec <= MAX_KEYS_PER_THREAD:
            raise ValueError(
                f"cpt * vec must be in [1, {MAX_KEYS_PER_THREAD}] keys per thread, got {self.cpt * self.vec}"
            )
        if self.order not in ("global_id", "rank_local"):
            raise ValueError(f"order must be 'global_id' or 'rank_local', got {self.order!r}")
        if self.len_bits not in (0, 32, 64) or self.start_bits not in (0, 32, 64):
            raise ValueError("len_bits and start_bits must be 0, 32 or 64")
        if self.first_bits not in FIRST_BITS:
            raise ValueError(f"first_bits must be one of {FIRST_BITS}, got {self.first_bits!r}")
        if not 1 <= self.k <= 32768:
            raise ValueError(f"k must be in [1, 32768], got {self.k!r}")

    @property
    def capacity(self) -> int:
        """Keys per row the configuration holds."""
        return self.cluster * self.threads * self.cpt * self.vec


def score_schedule(first_bits: int) -> tuple[tuple[int, int, int], ...]:
    """The radix passes over the 32 score bits, most significant first, as ``(word, shift, bits)`` (word 0)."""
    return tuple(p for p in digit_schedule(first_bits) if p[0] == 0)


class LocalTopKKernel(SelectToSlotsKernel):
    """One compiled :class:`LocalTopKConfig` (module docstring).

    Reused: :meth:`radix_pass_s2s` and :meth:`merge` (the passes, the cluster's histogram sum) from
    :class:`~dcp_ref.kernels.select_to_slots_cutedsl.SelectToSlotsKernel`, and :meth:`pick_bin` (the bin scan)
    from :class:`~dcp_ref.kernels.topk_cutedsl.StableTopKKernel`. Only their score-word passes run here. New: the
    kernel body, the windowed vector loads (:meth:`load_row`), the index-order commit (:meth:`load_counts`,
    :meth:`chunk_base`, :meth:`commit`) and the padding.
    """

    def __init__(self, cfg: LocalTopKConfig) -> None:  # the parents' attributes, set for this kernel's passes
        self.lcfg = cfg
        self.k = cfg.k
        self.split = cfg.cluster
        self.threads = cfg.threads
        self.warps = cfg.threads // 32
        self.min_ctas = cfg.min_ctas
        self.vec = cfg.vec
        self.cpt = cfg.cpt
        self.items = cfg.cpt * cfg.vec
        self.lpc = cfg.cpt * cfg.threads  # vector loads per CTA
        self.n = self.items * cfg.threads  # keys per CTA
        self.world, self.kloc = 1, self.n
        self.sorted_ = False
        self.small = False
        self.lean = False
        self.rank_local = False  # (the parent's tie-break mode: not used by score passes)
        self.schedule = score_schedule(cfg.first_bits)
        self.schedule_bins = tuple(1 << b for _, _, b in self.schedule)
        self.max_bins = max(self.schedule_bins)
        self.hist_stride = self.max_bins + 32
        self.hloc_size = 2 * self.hist_stride if cfg.cluster > 1 else 1
        self.sort_size = self.lo_size = 1
        # One 32-bit scan word per vector load holds both counts when they fit in 16 bits each.
        self.packed = cfg.capacity < (1 << 16) and cfg.k < (1 << 16)
        # The winners are staged in shared memory (module docstring) when k's slots fit in it.
        self.bitmap = cfg.commit == "bitmap"
        self.staged = cfg.k <= STAGE_MAX_K and not self.bitmap
        self.stage_size = cfg.k if self.staged else 1
        # bitmap: one bit per key position of the CTA, above-threshold words then tie words (items * threads is a
        # multiple of 256: whole words; at most one word a thread).
        self.nwords = self.n // 32
        self.bm_size = 2 * self.nwords if self.bitmap else 1

    @cute.jit
    def __call__(
        self,
        sc: cute.Tensor,
        lens: cute.Tensor,
        starts: cute.Tensor,
        out64: cute.Tensor,
        out32: cute.Tensor,
        outid: cute.Tensor,
        flag: cute.Tensor,
        rows: Int32,
        cols: Int32,
        rstride: Int64,
        rank_i: Int32,
        stripe: Int32,
        inter: Int32,
        stream: Any,
    ) -> None:
        args = (sc, lens, starts, out64, out32, outid, flag, rows, cols, rstride, rank_i, stripe, inter)
        launch_per_row(self.topk_kernel(*args), rows, self.threads, self.split, self.min_ctas, stream)

    @cute.kernel
    def topk_kernel(
        self,
        sc: cute.Tensor,
        lens: cute.Tensor,
        starts: cute.Tensor,
        out64: cute.Tensor,
        out32: cute.Tensor,
        outid: cute.Tensor,
        flag: cute.Tensor,
        rows: Int32,
        cols: Int32,
        rstride: Int64,
        rank_i: Int32,
        stripe: Int32,
        inter: Int32,
    ) -> None:
        """One CTA (or cluster) per row: window, loads + pass 0, radix passes, padding, index-order commit."""
        C = const_expr(self.split)
        tid, lane, warp, row, crank = self.cta_coords()

        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(2 * self.hist_stride), byte_alignment=16)
        wsum = smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)
        st = smem.allocate_tensor(Int32, cute.make_layout(State.WORDS), byte_alignment=16)
        hloc = smem.allocate_tensor(Int32, cute.make_layout(self.hloc_size), byte_alignment=16)
        tab = smem.allocate_tensor(
            Int32, cute.make_layout(2 * self.cpt * 32), byte_alignment=16
        )  # warp totals per load
        # The staged winners of this CTA by output slot (from the CTA's first): key bits and column.
        shi = smem.allocate_tensor(Uint32, cute.make_layout(self.stage_size), byte_alignment=16)
        scol = smem.allocate_tensor(Int32, cute.make_layout(self.stage_size), byte_alignment=16)
        bm = smem.allocate_tensor(Uint32, cute.make_layout(self.bm_size), byte_alignment=16)
        self.clear_state(st, hist, hloc, tid)
        if const_expr(self.bitmap):
            for x in cutlass.range(tid, 2 * self.nwords, self.threads):
                bm[x] = Uint32(0)

        start, end = self.row_window(lens, starts, flag, row, cols, tid, crank)
        cute.arch.sync_threads()

        khi = cute.make_rmem_tensor((self.items,), Uint32)
        if const_expr(C > 1):
            self.load_row(sc, row, rstride, start, end, tid, lane, crank, khi, hloc)
            cluster_sync()  # every CTA's pass-0 histogram is complete
            self.merge(0, hloc, hist, tid)
        else:
            self.load_row(sc, row, rstride, start, end, tid, lane, crank, khi, hist)
        cute.arch.sync_threads()

        take = self.start_selection(st, hist, tid)
        obase = Int64(row) * Int64(self.k)
        self.write_padding(out64, out32, outid, obase, take, tid, crank)
        cute.arch.sync_threads()

        for d in cutlass.range_constexpr(len(self.schedule)):
            self.radix_pass_s2s(d, khi, khi, khi, hist, hloc, wsum, st, tid, lane, warp, Int32(0))

        if const_expr(self.bitmap):
            self.commit_bitmap(sc, row, rstride, start, khi, st, tab, bm, out64, out32, outid, obase, tid, lane,
                               warp, crank, rank_i, stripe, inter)  # fmt: skip
        else:
            self.commit(sc, row, rstride, start, khi, st, tab, shi, scol, out64, out32, outid, obase, tid, lane,
                        warp, crank, rank_i, stripe, inter)  # fmt: skip

    @cute.jit
    def row_window(
        self, lens: cute.Tensor, starts: cute.Tensor, flag: cute.Tensor, row: Int32, cols: Int32, tid: Int32,
        crank: Int32,
    ) -> tuple[Int32, Int32]:  # fmt: skip
        """``(start, end)`` columns of the row's keys, clamped to ``[0, cols]`` (never a read outside the scores).

        A validated call (``check``) raises ``flag`` for a window the reference refuses: a negative or too large
        start or length, or ``start + length > cols`` (compared without the sum: no overflow)."""
        c64 = Int64(cols)
        s_raw = Int64(0)
        if const_expr(self.lcfg.start_bits > 0):
            s_raw = Int64(starts[row])
        s64 = cutlass.min(cutlass.max(s_raw, Int64(0)), c64)
        l_raw = c64 - s64
        if const_expr(self.lcfg.len_bits > 0):
            l_raw = Int64(lens[row])
        l64 = cutlass.min(cutlass.max(l_raw, Int64(0)), c64 - s64)
        if const_expr(self.lcfg.check):
            bad = (s_raw < Int64(0)) | (s_raw > c64) | (l_raw < Int64(0)) | (l_raw > c64 - s64)
            if bad & (tid == 0) & (crank == 0):
                flag[0] = Int64(1)
        start = Int32(s64)
        return start, Int32(s64 + l64)

    @cute.jit
    def load_row(
        self,
        sc: cute.Tensor,
        row: Int32,
        rstride: Int64,
        start: Int32,
        end: Int32,
        tid: Int32,
        lane: Int32,
        crank: Int32,
        khi: cute.Tensor,
        hist: cute.Tensor,
    ) -> None:
        """This thread's keys of the row, by vector loads, with pass 0's histogram counted on the way.

        Vector load ``ci`` covers columns ``c0 + g*vec ... + vec - 1``, ``g = (crank*cpt + ci)*T + tid``, from the
        aligned column ``c0 = start - start % vec``; a load wholly past the window's end reads the row's first
        vector instead (nothing past the window is read; all loads are issued before any is used). Keys outside
        ``[start, end)`` and NaN are invalid (``hi = 0``): not counted in a bin;
        this thread's count of them goes into the dummy bin ``NB0`` with one atomic per warp (``n_valid``)."""
        T = const_expr(self.threads)
        VEC = const_expr(self.vec)
        SH0 = const_expr(self.schedule[0][1])
        NB0 = const_expr(self.schedule_bins[0])
        c0 = start - start % VEC
        vrow = Int64(row) * rstride // Int64(VEC)  # the row's column 0 (rstride % vec == 0): always in bounds
        vbase = vrow + Int64(c0 // VEC)
        words = cute.make_tensor(sc.iterator, cute.make_layout((1 << 30, VEC), stride=(VEC, 1)))
        # Every load first, none under a branch: a load wholly past the window reads the row's column 0 instead
        # (in bounds, cached, masked below), so the cpt loads are in flight together rather than one latency each.
        for ci in cutlass.range_constexpr(self.cpt):
            g = (crank * self.cpt + ci) * T + tid
            off = Int64(cutlass.select_(c0 + g * VEC < end, vbase + Int64(g), vrow))
            v = words[off, None].load()
            for s in cutlass.range_constexpr(VEC):
                khi[ci * VEC + s] = v[s].bitcast(Uint32)
        invalid = Int32(0)
        for ci in cutlass.range_constexpr(self.cpt):
            col0 = c0 + ((crank * self.cpt + ci) * T + tid) * VEC
            for s in cutlass.range_constexpr(VEC):
                col = col0 + s
                sb = khi[ci * VEC + s]
                sb = Uint32(cutlass.select_(sb == Uint32(SIGN), Uint32(0), sb))  # -0.0 ties +0.0
                flip = Uint32(Int32(sb.bitcast(Int32) >> 31).bitcast(Uint32) | Uint32(SIGN))
                ok = (col >= start) & (col < end) & ((sb & Uint32(0x7FFFFFFF)) <= Uint32(0x7F800000))
                hi = Uint32(cutlass.select_(ok, sb ^ flip, Uint32(0)))
                khi[ci * VEC + s] = hi
                if ok:
                    cute.arch.atomic_add(hist.iterator + Int32((hi >> Uint32(SH0)) & Uint32(NB0 - 1)), Int32(1))
                else:
                    invalid = invalid + Int32(1)
        total = cute.arch.warp_redux_sync(invalid, "add")
        if (lane == 0) & (total > 0):
            cute.arch.atomic_add(hist.iterator + NB0, total)

    @cute.jit
    def write_padding(
        self, out64: cute.Tensor, out32: cute.Tensor, outid: cute.Tensor, obase: Int64, take: Int32, tid: Int32,
        crank: Int32,
    ) -> None:  # fmt: skip
        """Slots ``[take, k)``: ``(-inf, -1)`` pairs, or NaN scores and ``-1`` ids (``rank_local``). No winner is
        ever written there, so the fill cannot race with the commit."""
        T = const_expr(self.threads)
        C = const_expr(self.split)
        for j in cutlass.range(take + crank * T + tid, self.k, C * T):
            if const_expr(self.lcfg.order == "rank_local"):
                out32[obase + Int64(j)] = Int32(Uint32(NAN_BITS).bitcast(Int32))
                outid[obase + Int64(j)] = Int32(-1)
            else:
                out64[obase + Int64(j)] = Int64((Uint64(NEG_ONE_BITS) << Uint64(32)) | Uint64(NEG_INF_BITS))

    @cute.jit
    def load_counts(self, khi: cute.Tensor, ci: int, lower: Uint32, tv: Uint32) -> tuple[Int32, Int32]:
        """``(above, ties)`` of vector load ``ci``'s keys: how many are above the threshold, how many equal it."""
        a = Int32(0)
        t = Int32(0)
        for s in cutlass.range_constexpr(self.vec):
            hi = khi[ci * self.vec + s]
            a = a + cutlass.select_(hi >= lower, Int32(1), Int32(0))
            t = t + cutlass.select_((hi == tv) & (hi != Uint32(0)), Int32(1), Int32(0))
        return a, t

    @cute.jit
    def chunk_base(self, tab: cute.Tensor, ci: int, lane: Int32, warp: Int32) -> tuple[Int32, Int32]:
        """``(before, total)`` of load ``ci`` from its warp totals in ``tab``: the counts of the warps before this
        one, and of the whole CTA."""
        v = Int32(0)
        if lane < self.warps:
            v = tab[ci * 32 + lane]
        vi = warp_inclusive_scan(v, lane)
        return cute.arch.shuffle_sync(vi - v, warp), cute.arch.shuffle_sync(vi, 31)

    @cute.jit
    def commit(
        self,
        sc: cute.Tensor,
        row: Int32,
        rstride: Int64,
        start: Int32,
        khi: cute.Tensor,
        st: cute.Tensor,
        tab: cute.Tensor,
        shi: cute.Tensor,
        scol: cute.Tensor,
        out64: cute.Tensor,
        out32: cute.Tensor,
        outid: cute.Tensor,
        obase: Int64,
        tid: Int32,
        lane: Int32,
        warp: Int32,
        crank: Int32,
        rank_i: Int32,
        stripe: Int32,
        inter: Int32,
    ) -> None:
        """Write the winners in index order (module docstring).

        The threshold: once done, the winners are exactly the keys ``hi >= phi`` (``phi``: the found prefix, its
        low bits zero; ``0`` when every valid key wins); otherwise all 32 score bits are fixed at ``phi`` and the
        winners are the keys above it plus the first ``need`` keys equal to it, by local index.

        Counts per vector load (above, ties: one word when both fit in 16 bits, ``packed``) are scanned twice
        rather than kept: a first warp scan per load leaves the warp totals in ``tab``; after one barrier (and,
        in a cluster, the lower CTAs' totals) each load's exclusive prefix is the loads before it, the warps
        before this one (a scan of ``tab``) and the lanes before this one (the warp scan again). No per-load
        registers are held, so 32 keys a thread fit 1024 threads' 64 registers. ``staged``: each winner goes to
        ``shi`` / ``scol`` at its slot less the CTA's first slot, and :meth:`write_staged` writes them out."""
        T = const_expr(self.threads)
        C = const_expr(self.split)
        VEC = const_expr(self.vec)
        CPT = const_expr(self.cpt)
        TIES0 = const_expr(CPT)  # tab rows of the tie counts (unpacked)
        need, lower, tv = self.threshold(st)
        for ci in cutlass.range_constexpr(CPT):
            a, t = self.load_counts(khi, ci, lower, tv)
            if const_expr(self.packed):
                inc = warp_inclusive_scan(a + (t << 16), lane)
                if lane == 31:
                    tab[ci * 32 + warp] = inc
            else:
                inc_a = warp_inclusive_scan(a, lane)
                inc_t = warp_inclusive_scan(t, lane)
                if lane == 31:
                    tab[ci * 32 + warp] = inc_a
                    tab[(TIES0 + ci) * 32 + warp] = inc_t
        cute.arch.sync_threads()
        run_a = Int32(0)
        run_t = Int32(0)
        if const_expr(C > 1):
            # The cluster's lower CTAs hold the keys before this CTA's: their totals, from their shared memory.
            tot_a = Int32(0)
            tot_t = Int32(0)
            if lane < self.warps:
                for ci in cutlass.range_constexpr(CPT):
                    tot_a = tot_a + tab[ci * 32 + lane]
                    if const_expr(not self.packed):
                        tot_t = tot_t + tab[(TIES0 + ci) * 32 + lane]
            tot_a = cute.arch.warp_redux_sync(tot_a, "add")
            tot_t = cute.arch.warp_redux_sync(tot_t, "add")
            run_a, run_t = self.lower_ctas(st, tot_a, tot_t, tid, crank, not self.packed)
        first = self.slot_at(run_a, run_t, need)  # this CTA's first output slot
        c0 = start - start % VEC
        for ci in cutlass.range_constexpr(CPT):
            a, t = self.load_counts(khi, ci, lower, tv)
            a0 = Int32(0)
            t0 = Int32(0)
            if const_expr(self.packed):
                before, total = self.chunk_base(tab, ci, lane, warp)
                x = a + (t << 16)
                pre = run_a + before + warp_inclusive_scan(x, lane) - x
                run_a = run_a + total
                t0 = Int32(Uint32(pre.bitcast(Uint32) >> Uint32(16)).bitcast(Int32))
                a0 = pre & Int32(0xFFFF)
            else:
                before_a, total_a = self.chunk_base(tab, ci, lane, warp)
                before_t, total_t = self.chunk_base(tab, TIES0 + ci, lane, warp)
                a0 = run_a + before_a + warp_inclusive_scan(a, lane) - a
                t0 = run_t + before_t + warp_inclusive_scan(t, lane) - t
                run_a = run_a + total_a
                run_t = run_t + total_t
            g = (crank * CPT + ci) * T + tid
            for s in cutlass.range_constexpr(VEC):
                hi = khi[ci * VEC + s]
                is_a = hi >= lower
                is_t = (hi == tv) & (hi != Uint32(0))
                if is_a | (is_t & (t0 < need)):
                    col = c0 + g * VEC + s
                    slot = a0 + cutlass.min(t0, need)
                    if const_expr(self.staged):
                        shi[slot - first] = hi
                        scol[slot - first] = col
                    else:
                        self.write_winner(sc, row, rstride, col, col - start, hi, slot, out64, out32, outid, obase,
                                          rank_i, stripe, inter)  # fmt: skip
                a0 = a0 + cutlass.select_(is_a, Int32(1), Int32(0))
                t0 = t0 + cutlass.select_(is_t, Int32(1), Int32(0))
        if const_expr(self.staged):
            cute.arch.sync_threads()
            self.write_staged(sc, row, rstride, start, shi, scol, first, self.slot_at(run_a, run_t, need), out64,
                              out32, outid, obase, tid, rank_i, stripe, inter)  # fmt: skip
        if const_expr(C > 1):
            cluster_sync()  # the lower CTAs' totals have been read: their shared memory may go

    @cute.jit
    def threshold(self, st: cute.Tensor) -> tuple[Int32, Uint32, Uint32]:
        """``(need, lower, tv)`` after the passes: the winners are the keys ``hi >= lower`` and, while fewer than
        ``need`` came before, those ``== tv``. Once done (the bin held exactly the keys needed, or every valid key
        wins) ``lower = max(phi, 1)`` and ``tv = 0``, which no valid key is: no ties."""
        done = st[State.DONE] != 0
        need = st[State.NEED]
        phi = st[State.PREFIX_HI].bitcast(Uint32)
        lower = Uint32(cutlass.select_(done, cutlass.max(phi, Uint32(1)), phi + Uint32(1)))
        tv = Uint32(cutlass.select_(done, Uint32(0), phi))
        return need, lower, tv

    @cute.jit
    def lower_ctas(
        self, st: cute.Tensor, tot_a: Int32, tot_t: Int32, tid: Int32, crank: Int32, ties: bool
    ) -> tuple[Int32, Int32]:
        """A cluster: publish this CTA's totals (keys above, tied), and return the sums of the lower CTAs', read
        from their shared memory (``ties=False``: the ties are packed in ``tot_a``). One cluster barrier; the
        caller's last one keeps the words alive until every CTA has read them."""
        if tid == 0:
            st[CTA_ABOVE] = tot_a
            st[CTA_TIES] = tot_t
        cluster_sync()
        run_a = Int32(0)
        run_t = Int32(0)
        for c in cutlass.range_constexpr(self.split - 1):
            if c < crank:
                run_a = run_a + dsmem_load(st.iterator + CTA_ABOVE, c)
                if const_expr(ties):
                    run_t = run_t + dsmem_load(st.iterator + CTA_TIES, c)
        return run_a, run_t

    @cute.jit
    def commit_bitmap(
        self,
        sc: cute.Tensor,
        row: Int32,
        rstride: Int64,
        start: Int32,
        khi: cute.Tensor,
        st: cute.Tensor,
        tab: cute.Tensor,
        bm: cute.Tensor,
        out64: cute.Tensor,
        out32: cute.Tensor,
        outid: cute.Tensor,
        obase: Int64,
        tid: Int32,
        lane: Int32,
        warp: Int32,
        crank: Int32,
        rank_i: Int32,
        stripe: Int32,
        inter: Int32,
    ) -> None:
        """Write the winners in index order through a bitmap of the CTA's key positions (the threshold as in
        :meth:`commit`).

        Why: the per-load block scans of :meth:`commit` cost ~58 instructions a key (sm_90a SASS, 32 keys a
        thread); here a key costs two compares and, for the ~2 % that win or tie, one shared ``atom.or``
        (:meth:`mark`). Position ``q = (ci*T + tid)*vec + s`` of the CTA is bit ``q % 32`` of word ``q // 32`` —
        word order is index order. Thread ``w`` then takes word ``w`` (:attr:`nwords` <= threads): one block scan
        of the words' counts (above, ties; packed in one word when both fit in 16 bits), plus the cluster's lower
        CTAs' totals, gives the word's first slot, and its set bits are written lowest first (:meth:`emit_word`),
        each winner's score re-read from the row (exact bits: ``-0.0`` stays ``-0.0``)."""
        C = const_expr(self.split)
        NW = const_expr(self.nwords)
        need, lower, tv = self.threshold(st)
        self.mark(khi, bm, lower, tv, tid)
        cute.arch.sync_threads()
        ma = Uint32(0)
        mt = Uint32(0)
        if tid < NW:
            ma = bm[tid]
            mt = bm[NW + tid]
        ca = Int32(cute.arch.popc(ma))
        ct = Int32(cute.arch.popc(mt))
        pre_a, pre_t, tot_a, tot_t = self.block_scan2(ca, ct, tab, lane, warp)
        run_a = Int32(0)
        run_t = Int32(0)
        if const_expr(C > 1):
            # The cluster's lower CTAs hold the keys before this CTA's: their totals, from their shared memory.
            run_a, run_t = self.lower_ctas(st, tot_a, tot_t, tid, crank, True)
        if tid < NW:
            c0 = start - start % self.vec
            col0 = c0 + crank * Int32(self.n) + tid * 32
            self.emit_word(sc, row, rstride, start, col0, ma, mt, run_a + pre_a, run_t + pre_t, need, out64, out32,
                           outid, obase, rank_i, stripe, inter)  # fmt: skip
        if const_expr(C > 1):
            cluster_sync()  # the lower CTAs' totals have been read: their shared memory may go

    @cute.jit
    def mark(self, khi: cute.Tensor, bm: cute.Tensor, lower: Uint32, tv: Uint32, tid: Int32) -> None:
        """Set the bit of every key above the threshold (``bm[0:nwords]``) or equal to it (``bm[nwords:]``)."""
        T = const_expr(self.threads)
        VEC = const_expr(self.vec)
        for ci in cutlass.range_constexpr(self.cpt):
            for s in cutlass.range_constexpr(VEC):
                hi = khi[ci * VEC + s]
                is_a = hi >= lower
                is_t = (hi == tv) & (hi != Uint32(0))
                if is_a | is_t:
                    q = (Int32(ci * T) + tid) * VEC + s
                    w = (q >> 5) + cutlass.select_(is_t, Int32(self.nwords), Int32(0))
                    cute.arch.atomic_or(bm.iterator + w, Uint32(1) << Uint32(q & 31))

    @cute.jit
    def block_scan2(
        self, a: Int32, t: Int32, tab: cute.Tensor, lane: Int32, warp: Int32
    ) -> tuple[Int32, Int32, Int32, Int32]:
        """Exclusive prefix sums over the CTA's threads of ``a`` and ``t`` and their totals: ``(pre_a, pre_t,
        tot_a, tot_t)``. One warp scan, the warp totals through ``tab``, one barrier (both counts in one word
        when ``packed``)."""
        if const_expr(self.packed):
            x = a + (t << 16)
            inc = warp_inclusive_scan(x, lane)
            if lane == 31:
                tab[warp] = inc
            cute.arch.sync_threads()
            before, total = self.chunk_base(tab, 0, lane, warp)
            pre = before + inc - x
            pre_a = pre & Int32(0xFFFF)
            pre_t = Int32(Uint32(pre.bitcast(Uint32) >> Uint32(16)).bitcast(Int32))
            tot_a = total & Int32(0xFFFF)
            tot_t = Int32(Uint32(total.bitcast(Uint32) >> Uint32(16)).bitcast(Int32))
        else:
            inc_a = warp_inclusive_scan(a, lane)
            inc_t = warp_inclusive_scan(t, lane)
            if lane == 31:
                tab[warp] = inc_a
                tab[32 + warp] = inc_t
            cute.arch.sync_threads()
            before_a, tot_a = self.chunk_base(tab, 0, lane, warp)
            before_t, tot_t = self.chunk_base(tab, 1, lane, warp)
            pre_a = before_a + inc_a - a
            pre_t = before_t + inc_t - t
        return pre_a, pre_t, tot_a, tot_t

    @cute.jit
    def emit_word(
        self,
        sc: cute.Tensor,
        row: Int32,
        rstride: Int64,
        start: Int32,
        col0: Int32,
        ma: Uint32,
        mt: Uint32,
        a0: Int32,
        t0: Int32,
        need: Int32,
        out64: cute.Tensor,
        out32: cute.Tensor,
        outid: cute.Tensor,
        obase: Int64,
        rank_i: Int32,
        stripe: Int32,
        inter: Int32,
    ) -> None:
        """The winners of one bitmap word (columns ``col0 + b``), lowest bit first: a key above the threshold
        takes slot ``a0 + min(t0, need)``, a tie the same while ``t0 < need`` (``a0`` / ``t0``: the keys above /
        equal before it in the row)."""
        m = ma | mt
        while m != Uint32(0):
            low = m & (Uint32(0) - m)
            m = m ^ low
            b = Int32(Uint32(31) - cute.arch.clz(low))
            tie = (mt & low) != Uint32(0)
            if (~tie) | (t0 < need):
                col = col0 + b
                sb = sc[Int64(row) * rstride + Int64(col)].bitcast(Uint32)
                self.write_bits(col - start, sb, a0 + cutlass.min(t0, need), out64, out32, outid, obase, rank_i,
                                stripe, inter)  # fmt: skip
            a0 = a0 + cutlass.select_(tie, Int32(0), Int32(1))
            t0 = t0 + cutlass.select_(tie, Int32(1), Int32(0))

    @cute.jit
    def slot_at(self, run_a: Int32, run_t: Int32, need: Int32) -> Int32:
        """The output slot of the next winner after ``run_a`` keys above the threshold and ``run_t`` equal to it
        (both packed in ``run_a`` when ``packed``): the ties count up to ``need``."""
        a = run_a
        t = run_t
        if const_expr(self.packed):
            a = run_a & Int32(0xFFFF)
            t = Int32(Uint32(run_a.bitcast(Uint32) >> Uint32(16)).bitcast(Int32))
        return a + cutlass.min(t, need)

    @cute.jit
    def write_staged(
        self,
        sc: cute.Tensor,
        row: Int32,
        rstride: Int64,
        start: Int32,
        shi: cute.Tensor,
        scol: cute.Tensor,
        first: Int32,
        end: Int32,
        out64: cute.Tensor,
        out32: cute.Tensor,
        outid: cute.Tensor,
        obase: Int64,
        tid: Int32,
        rank_i: Int32,
        stripe: Int32,
        inter: Int32,
    ) -> None:
        """This CTA's staged winners, slots ``[first, end)``, written out one slot a thread (coalesced)."""
        for j in cutlass.range(tid, end - first, self.threads):
            col = scol[j]
            self.write_winner(sc, row, rstride, col, col - start, shi[j], first + j, out64, out32, outid, obase,
                              rank_i, stripe, inter)  # fmt: skip

    @cute.jit
    def write_winner(
        self,
        sc: cute.Tensor,
        row: Int32,
        rstride: Int64,
        col: Int32,
        j: Int32,
        hi: Uint32,
        slot: Int32,
        out64: cute.Tensor,
        out32: cute.Tensor,
        outid: cute.Tensor,
        obase: Int64,
        rank_i: Int32,
        stripe: Int32,
        inter: Int32,
    ) -> None:
        """One winner into its slot: its exact score bits (from the key; a zero is re-read, for its sign) and its
        global id ``(j // I) * W*I + rank*I + j % I`` as float32, or its local index ``j`` (``rank_local``)."""
        sb = Uint32(cutlass.select_((hi & Uint32(SIGN)) != Uint32(0), hi ^ Uint32(SIGN), hi ^ Uint32(MASK32)))
        if hi == Uint32(SIGN):
            sb = sc[Int64(row) * rstride + Int64(col)].bitcast(Uint32)
        self.write_bits(j, sb, slot, out64, out32, outid, obase, rank_i, stripe, inter)

    @cute.jit
    def write_bits(
        self,
        j: Int32,
        sb: Uint32,
        slot: Int32,
        out64: cute.Tensor,
        out32: cute.Tensor,
        outid: cute.Tensor,
        obase: Int64,
        rank_i: Int32,
        stripe: Int32,
        inter: Int32,
    ) -> None:
        """Local index ``j``, score bits ``sb`` into ``slot``: the pair ``(score, global id (j // I) * W*I +
        rank*I + j % I as float32)``, or the score and ``j`` (``rank_local``)."""
        dst = obase + Int64(slot)
        if const_expr(self.lcfg.order == "rank_local"):
            out32[dst] = sb.bitcast(Int32)
            outid[dst] = j
        else:
            q = j // inter
            gid = q * stripe + rank_i + (j - q * inter)
            gb = Float32(gid).bitcast(Uint32)
            out64[dst] = Int64((Uint64(gb) << Uint64(32)) | Uint64(sb))


def _fake_args(cfg: LocalTopKConfig) -> tuple[Any, ...]:
    """Fake tensors and scalars in :meth:`LocalTopKKernel.__call__`'s order (shapes dynamic)."""

    def flat(dtype: Any, align: int) -> Any:
        return cute.runtime.make_fake_compact_tensor(dtype, (cute.sym_int64(),), assumed_align=align)

    def idx(bits: int) -> Any:
        return flat(Int64 if bits == 64 else Int32, 8 if bits == 64 else 4)

    return (
        flat(Int32, 4 * cfg.vec),  # scores, as 32-bit words
        idx(cfg.len_bits),
        idx(cfg.start_bits),
        flat(Int64, 8),  # pairs (global_id)
        flat(Int32, 4),  # scores (rank_local)
        flat(Int32, 4),  # local indices (rank_local)
        flat(Int64, 8),  # the check flag
        Int32(1),
        Int32(1),
        Int64(1),
        Int32(0),
        Int32(1),
        Int32(1),
    )


@functools.lru_cache(maxsize=128)
def compile_local_topk(cfg: LocalTopKConfig) -> Any:
    """The compiled kernel of one configuration (cached; CuTeDSL compiles are serialised). Works without a GPU."""
    with KERNEL_LOCK:
        stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=cfg.tvm_ffi)
        kern = LocalTopKKernel(cfg)
        if cfg.tvm_ffi:
            return cute.compile(kern, *_fake_args(cfg), stream, options="--enable-tvm-ffi")
        return cute.compile(kern, *_fake_args(cfg), stream)


def compile_artifacts(cfg: LocalTopKConfig, dump_dir: str) -> tuple[str, bytes]:
    """Compile one configuration (uncached) and return ``(PTX text, cubin bytes)`` — the CPU CI check.

    Needs ``CUTE_DSL_ARCH=sm_90a`` (no GPU needed); ``dump_dir`` must exist."""
    with KERNEL_LOCK:
        kern = LocalTopKKernel(cfg)
        stream = cutlass.runtime.make_fake_stream()
        fn = cute.compile(kern, *_fake_args(cfg), stream, options=f"--keep-ptx --keep-cubin --dump-dir={dump_dir}")
    return compiled_artifacts(fn)


def vec_for(scores: torch.Tensor) -> int:
    """Keys per vector load the scores' layout allows: 4 (16-byte loads), 2 or 1; 0 when the kernel cannot
    read them (not float32, or a column stride other than 1)."""
    check_tensor(scores, "scores", ndim=2)
    if scores.dtype != torch.float32 or (scores.shape[1] > 1 and scores.stride(1) != 1):
        return 0
    rows, cols = scores.shape
    rs = scores.stride(0) if rows > 1 else cols
    if rows * rs + cols >= 1 << 30:  # the kernel's vector offsets: < 2**30 vectors of 4 keys (int32 words: 2**31)
        return 0
    for v in (4, 2):
        if cols % v == 0 and rs % v == 0 and scores.data_ptr() % (4 * v) == 0:
            return v
    return 1


#: The measured plans: ``(T, L) -> (cluster, threads, first_bits)``, the fastest configuration of each shape in the
#: committed H200 sweep (:data:`PLANS_SOURCE`, CUDA-graph replay, k = 2048, standard normal scores; 99
#: configurations: clusters 1-8, 256-1024 threads at 8 / 16 / 32 keys a thread, first digits of 8, 11, 12 bits).
#: What it says: few rows want 8 keys a thread (latency: T = 1, L = 32768 on 8 CTAs of 512 threads, 9.3 µs, against
#: 24.7 on one CTA); many rows want the fewest CTAs (T = 1024, L = 32768 on one CTA of 32 keys a thread, 200.1 µs,
#: against 257.2 on two); 11 and 12-bit first digits won only by noise (<= 4 %, two shapes: kept as measured).
#: ``tests/test_local_topk_plans.py`` checks the table against the file.
PLANS: dict[tuple[int, int], tuple[int, int, int]] = {
    (1, 4096): (1, 512, 8), (1, 8192): (2, 512, 8), (1, 32768): (8, 512, 8), (1, 131072): (8, 1024, 8),
    (32, 4096): (1, 512, 8), (32, 8192): (1, 512, 8), (32, 32768): (2, 1024, 11), (32, 131072): (8, 1024, 8),
    (128, 32768): (1, 1024, 11), (128, 131072): (4, 1024, 8),
    (1024, 4096): (1, 512, 8), (1024, 8192): (1, 512, 11), (1024, 32768): (1, 1024, 11), (1024, 131072): (4, 1024, 8),
}  # fmt: skip
PLANS_SOURCE = "benchmarks/results/local_topk_sweep.json"


def _measured(rows: int, cols: int) -> list[tuple[int, int, int]]:
    """The measured plans nearest to ``(rows, cols)`` first (log2 distance, the columns weighted double: they
    decide what fits)."""
    return [PLANS[key] for key in nearest_shapes(PLANS, rows, cols, col_weight=2.0)]


@functools.lru_cache(maxsize=1024, typed=True)  # pure in its ints; asked on every call of the indexer stage
def plan_for(
    rows: int,
    cols: int,
    k: int,
    vec: int,
    *,
    cluster: int | None = None,
    threads: int | None = None,
    first_bits: int | None = None,
) -> tuple[int, int, int, int, str] | None:
    """``(cluster, threads, cpt, first_bits, commit)`` for a ``[rows, cols]`` problem, or ``None`` when the kernel
    cannot take it (the Triton kernel does). ``commit``: :func:`commit_for`'s.

    The default is measured (:data:`PLANS`): the nearest measured shape's plan that holds this row at <= 32 keys
    a thread, its CTAs and threads as measured (a shorter row than measured takes the same CTAs, fewer keys
    each). With no measured plan that fits (or any argument given, the
    benchmark's sweeps), the rule: the fewest CTAs per row (a cluster) that hold the row at <=
    :data:`SPILL_FREE_KEYS` keys a thread (else 32), each the smallest CTA that does; when the rows are few, more
    CTAs per row (see below)."""
    for name, value in (("rows", rows), ("cols", cols), ("k", k), ("vec", vec)):
        check_int_scalar(value, name)
    for name, knob in (("cluster", cluster), ("threads", threads), ("first_bits", first_bits)):
        if knob is not None:
            check_int_scalar(knob, name)
    if vec < 1 or not 1 <= k <= 32768 or cols < 1:
        return None
    if cluster is None and threads is None and first_bits is None:
        for c, t, fb in _measured(rows, cols):
            if cdiv(cols, c * t) <= MAX_KEYS_PER_THREAD:
                return c, t, cdiv(cdiv(cols, c * t), vec), fb, commit_for(rows, cols, k)
    fb = 8 if first_bits is None else first_bits
    if cluster is None:
        # The fewest CTAs that hold the row spill-free (<= SPILL_FREE_KEYS a thread), else at <= 32 a thread.
        c = next(
            (c for lim in (SPILL_FREE_KEYS, MAX_KEYS_PER_THREAD) for c in CLUSTERS if _fit(cols, c, threads, lim)), 0
        )
        if not c:
            return None
        # Few rows leave SMs idle: spread a long row over more CTAs while the grid stays within half the SMs
        # and every CTA keeps >= SPREAD_MIN_KEYS keys.
        while c < CLUSTERS[-1] and rows * 2 * c <= H200_SMS // 2 and cdiv(cols, 2 * c) >= SPREAD_MIN_KEYS:
            c *= 2
    else:
        c = cluster
    fit = _fit(cols, c, threads, SPILL_FREE_KEYS) or _fit(cols, c, threads, MAX_KEYS_PER_THREAD)
    if fit is None:
        return None
    return c, fit[0], cdiv(fit[1], vec), fb, commit_for(rows, cols, k)


#: The A/B of the two commits (CUDA-graph replay, both beside vLLM's top-K + pack in one process, k = 2048, the 16
#: shapes and 3 ties rows of ``bench_local_topk.py``): :func:`commit_for`'s source.
COMMITS_SOURCE = "benchmarks/results/local_topk_commit_ab.json"


def commit_for(rows: int, cols: int, k: int) -> str:
    """The commit for a ``[rows, cols]`` problem (:data:`COMMITS_SOURCE`): ``"bitmap"`` where the winners are sparse
    — a row of at least ``64 k`` keys, or of ``16 k`` with at least 32 rows — else ``"scan"``.

    Why: the bitmap commit costs ~9 instructions a key against the scan's ~58 (sm_90a SASS), but adds a barrier,
    a cleared bitmap and, per winner, a dependent re-read of its score. Sparse winners (k = 2048: L >= 32768)
    make that up (H100, T = 1024, L = 131072: 602.9 µs against 920.5; T = 128: 93.0 against 138.1); dense ones
    do not (T = 1024, L = 4096: 42.9 against 21.3), nor a lone row at 16 k, which is latency-bound (T = 1,
    L = 32768: 11.3 against 9.9). ``tests/test_local_topk_plans.py`` checks the rule against the file."""
    for name, value in (("rows", rows), ("cols", cols), ("k", k)):
        check_int_scalar(value, name, min_value=1)
    return "bitmap" if cols >= 64 * k or (cols >= 16 * k and rows >= 32) else "scan"


def _fit(cols: int, cluster: int, threads: int | None, limit: int) -> tuple[int, int] | None:
    """``(threads, keys per thread)`` of the smallest CTA (or the ``threads`` given) that holds a ``cluster``-th
    of a row at <= ``limit`` keys a thread."""
    share = cdiv(cols, cluster)
    for t in (256, 512, 1024) if threads is None else (threads,):
        if cdiv(share, t) <= limit:
            return t, cdiv(share, t)
    return None


def local_topk_pack_cutedsl(
    scores: torch.Tensor,
    lengths: torch.Tensor | None,
    k: int,
    rank_i: int,
    stripe: int,
    interleave: int,
    row_starts: torch.Tensor | None,
    out: torch.Tensor,
    out_ids: torch.Tensor | None,
    flag: torch.Tensor | None,
    plan: tuple[int, int, int, int, str],
    vec: int,
    order: str = "global_id",
    tvm_ffi: bool | None = None,
    min_ctas: int = 0,
) -> None:
    """Launch the kernel on checked arguments (the caller, ``indexer_topk_pack``, checked every one of them and
    made the plan with :func:`plan_for`): no host synchronisation, no allocation (CUDA-graph capturable).

    ``out``: float32 ``[T, k, 2]`` pairs (``global_id``) or ``[T, k]`` scores (``rank_local``, with ``out_ids``
    int32 ``[T, k]``), contiguous. ``flag``: the validated call's check flag (int64 ``[1]``) or ``None``."""
    rows, cols = scores.shape
    cluster, threads, cpt, first_bits, commit = plan
    ffi = use_tvm_ffi() if tvm_ffi is None else bool(tvm_ffi)

    def bits(t: torch.Tensor | None) -> int:
        return 0 if t is None else (64 if t.dtype == torch.int64 else 32)

    cfg = LocalTopKConfig(
        k, cluster, threads, cpt, vec, order, bits(lengths), bits(row_starts), flag is not None, first_bits,
        min_ctas, ffi, commit,
    )  # fmt: skip
    fn = compile_local_topk(cfg)
    dev = scores.device
    dummy32 = out.view(-1).view(torch.int32)
    rstride = scores.stride(0) if rows > 1 else cols
    # The scores as one run of 32-bit words from the first row's start: the kernel addresses row*rstride + column
    # (a row-strided view reads its rows in the base storage, never past the last row's columns).
    words = torch.as_strided(scores.view(torch.int32), (rstride * (rows - 1) + cols,), (1,))
    lens = lengths.contiguous() if lengths is not None else dummy32
    starts = row_starts.contiguous() if row_starts is not None else dummy32
    if order == "rank_local":
        # never written nor read (rank-local writes out32 / outid): any int64 word, the flag when there is one
        # (no allocation on the hot path: the front of the scores' out buffer, read as one int64 word, when it can)
        front = out.view(-1)
        spare = front[:2].view(torch.int64) if front.numel() >= 2 and front.data_ptr() % 8 == 0 else None
        out64 = flag if flag is not None else (spare if spare is not None else torch.empty((1,), dtype=torch.int64,
                                                                                          device=dev))  # fmt: skip
        out32 = out.view(-1).view(torch.int32)
        outid = out_ids.view(-1) if out_ids is not None else dummy32
    else:
        out64 = out.view(-1).view(torch.int64)
        out32 = outid = dummy32
    flg = flag if flag is not None else out64
    args = (words, lens, starts, out64, out32, outid, flg, rows, cols, rstride, rank_i, stripe, interleave)
    if ffi:
        fn(*args)
    else:
        import cuda.bindings.driver as cuda  # shipped with nvidia-cutlass-dsl
        from cutlass.cute.runtime import from_dlpack

        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        tens = [from_dlpack(a, assumed_align=(4 * vec if i == 0 else a.element_size())) for i, a in enumerate(args[:7])]
        fn(*tens, Int32(rows), Int32(cols), Int64(rstride), Int32(rank_i), Int32(stripe), Int32(interleave), stream)
