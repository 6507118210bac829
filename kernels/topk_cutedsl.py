"""CuTeDSL stable top-K over all-gathered DCP candidates: one CTA per row, MSB-first radix select.

Input: the all-gather output ``[W, rows, K, 2]`` float32 (score, global id) — read in place, as
int64 words (one 8-byte load per candidate), candidate ``j = w*K + c`` of row ``r`` at
``(w*rows + r)*K + c``. Output: int32 ``[rows, k]`` global ids, ``-1`` padded.

Algorithm (per row = per CTA of ``T`` threads):

1. **Keys in registers** (:meth:`StableTopKKernel.load_keys`). Thread ``t`` holds candidates
   ``j = i*T + t`` (coalesced loads) as the unsigned 64-bit key ``hi << 32 | lo``, kept as two
   32-bit words — ``hi`` the order-preserving float bits (``-0.0`` made ``+0.0``),
   ``lo = 0xFFFFFFFF - id``; invalid (id < 0 or NaN score) → ``hi = 0``. This is
   :func:`dcp_ref.topk.stable_key` with the sign bit flipped, so unsigned order = reference order.
   The score passes touch only the ``hi`` words. The first radix pass's histogram is counted in
   the same loop, branch-free: invalid keys go to a dummy bin, whose count gives the number of
   valid keys (``n_valid``) without a separate reduction.
2. If ``n_valid <= k`` every valid key wins: skip to 4.
3. **Radix select** (:meth:`~StableTopKKernel.radix_pass`, :meth:`~StableTopKKernel.pick_bin`),
   MSB first, 8-bit digits by default (:func:`digit_schedule`). Each pass builds a shared-memory
   histogram of the next digit over the keys that still match the prefix found so far; the warps
   that own bins scan it from the top bin down (:func:`warp_inclusive_scan`, then the same scan
   over the warp totals) and the one thread whose bin holds the k-th largest key publishes the
   new prefix and how many keys are still needed from that bin. If the bin holds exactly that
   many, the threshold is found (``done``) — for real scores usually after the second or third
   score digit. Three barriers per pass: the histogram is double buffered (the scan clears the
   next pass's copy).
4. **Commit winners** (:meth:`~StableTopKKernel.commit_fast`,
   :meth:`~StableTopKKernel.commit_general`). Usual case (``done`` in a score pass): the winners
   are exactly the keys with ``hi >= prefix``, one compare each; each warp takes its slots with
   one shared atomic and hands them out per item by ballot + popc, so a warp's stores are
   coalesced. General case (the selection went into the id word, or duplicated (score, id)
   pairs): keys above the threshold prefix, plus as many keys equal to it as still needed, take a
   slot from a shared atomic counter. Unsorted: the id is written straight to ``out``. Sorted:
   the key is written to a shared buffer, which is bitonic-sorted (descending) and then written
   out (:meth:`~StableTopKKernel.sort_winners`). Slots ``[min(k, n_valid), k)`` are pre-filled
   with ``-1`` by disjoint threads (no write-write race between the -1 fill and the winners).

**Variants.** ``"regs"`` is the above. ``"lean"`` keeps only the ``hi`` words in registers and
parks the ``lo`` words in shared memory (``4*N`` bytes), read back only by the id passes and the
commit, for the keys that can win. At <= 16 words per thread the kernel then fits in 32 registers
(ptxas ``minctasm``), so ``2048 / T`` CTAs share an SM and one row's loads overlap another's
histogram passes. :func:`default_variant` picks one by shape; ``variant=`` forces one.

**Where the time went** (H200, rows = 1024, W = 8, K = k = 2048; Nsight Compute): the kernel was
instruction-issue bound (0.75 warp instructions issued per scheduler per cycle), not
memory bound. Per row, 48.3k warp instructions became 34.0k: the commit had been 40 % of them
(now one compare per key instead of masks and an atomic per winner), the scans had run in all 32
warps instead of the 8 that own bins, and the valid-key count was a separate phase. 72 -> 56 µs
(``benchmarks/results/topk.json``, key ``profile``).

Any ``k >= 1`` and any candidate count up to the limit below work (the tail is masked); the sorted
variant needs ``next_pow2(min(k, N)) * 8`` bytes of shared memory. Compiled kernels are
cached per :class:`TopKConfig` (``W``, ``K``, ``k``, sorted, 32-bit offsets, variant, CTA config,
first digit, TVM-FFI); ``rows`` is a runtime argument. The TVM-FFI call path (torch tensors passed
straight in, the current stream taken from the environment) is used when apache-tvm-ffi is
importable: on the H200 it cut the Python-side launch from ~20 µs to ~6 µs
(``benchmarks/results/topk.md``); ``DCP_TOPK_TVM_FFI=0`` turns it off. The launch makes no host
synchronisation and no allocation when ``out`` is given (CUDA-graph capturable).

Limits (both tested on the H200): ``N = W*K <= 32768`` candidates per row (keys live in
registers: 32 per thread at most) and, for ``sorted=True``, ``min(k, N) <= 4096`` winners (their
keys are sorted in 32 KiB of static shared memory). The kernels' select stage (:mod:`dcp_ref.kernels.stages`)
falls back to the reference beyond the first, logged (the stage's selection is unsorted).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Boolean, Float32, Int32, Int64, Uint32, Uint64, const_expr

from dcp_ref.kernels._util import cdiv, next_pow2

__all__ = [
    "StableTopKKernel",
    "use_tvm_ffi",
    "TopKConfig",
    "State",
    "threads_for",
    "compile_stable_topk",
    "stable_topk_cutedsl",
    "MAX_SORTED_WINNERS",
    "MAX_CANDIDATES",
    "compile_to_ptx",
    "VARIANTS",
    "lean_config",
    "default_variant",
    "launch_per_row",
]

#: The sorted variant keeps the winners' keys in shared memory: at most this many (tested size).
MAX_SORTED_WINNERS = 4096
#: Candidates per row (``W*K``): keys live in registers, at most 32 per thread (tested size).
MAX_CANDIDATES = 32768
#: Kernel variants (see :class:`StableTopKKernel`); ``None`` in the wrappers picks by shape.
VARIANTS = ("regs", "lean")
#: Widths of the first radix digit (see :func:`digit_schedule`).
FIRST_BITS = (8, 11, 12)
#: All 32 bits of a key word.
MASK32 = 0xFFFFFFFF


class State:
    """The named words of the kernels' shared state ``st`` (int32 ``[State.WORDS]``, zeroed on entry), as
    CUTLASS's ``SharedStorage`` names its fields: ``st[State.NEED]``, ``st.iterator + State.COUNT``.

    The selection's threshold is a prefix of the 64-bit key, kept as two 32-bit words (``hi``: the score
    word, ``lo``: the id word) with a mask of the bits each word fixes so far. Also used by
    :class:`~dcp_ref.kernels.select_to_slots_cutedsl.SelectToSlotsKernel`.
    """

    NEED = 0  #: keys still needed from the threshold bin (the row's winners ``min(k, valid)`` before any pass)
    DONE = 1  #: 1 once the threshold is found: its bin holds exactly the keys needed (or every valid key wins)
    COUNT = 3  #: output counter: winners given a slot so far (word 2 is unused)
    TIES = 4  #: keys equal to the threshold that reached the tie counter (the general commit takes ``NEED``)
    PREFIX_HI = 5  #: threshold prefix, score word
    PREFIX_LO = 6  #: threshold prefix, id word
    MASK_HI = 7  #: bits of the score word the prefix fixes (0 before any pass)
    MASK_LO = 8  #: bits of the id word the prefix fixes (0 until an id pass)
    WORDS = 16  #: words allocated (a 16-byte multiple), zeroed by the first ``WORDS`` threads


def digit_schedule(first_bits: int = 8) -> tuple[tuple[int, int, int], ...]:
    """The radix passes, most significant first, as ``(word, shift, bits)``; word 0 = score, 1 = id.

    ``first_bits = 8``: eight 8-bit digits (4 per 32-bit word). Wider (11 or 12): each word is
    cut into a ``first_bits`` digit and then as few near-equal digits as fit, e.g. 12 -> 12 + 10 +
    10, 11 -> 11 + 11 + 10.
    A wider first digit spreads real score distributions over more histogram bins (the top byte of
    a float is its sign and 7 exponent bits: ``randn`` scores fall into ~4 of its 256 bins, so
    the shared-memory atomics of the first pass serialise on a few addresses) and the next digit
    usually finds the threshold, so fewer passes run.
    """
    # The rest of the word in as few digits of at most first_bits bits as possible, as equal as
    # possible (12 -> 10 + 10, 11 -> 11 + 10, 8 -> 8 + 8 + 8): a digit needs >= 32 bins, because
    # the scan hands the bins out to whole warps.
    left = 32 - first_bits
    n = cdiv(left, first_bits)
    widths = [first_bits] + [left // n + (1 if r < left % n else 0) for r in range(n)]
    sched = []
    for word in (0, 1):
        top = 32
        for b in widths:
            top -= b
            sched.append((word, top, b))
    return tuple(sched)


def threads_for(n: int) -> int:
    """CTA size for ``n`` candidates per row: ~16 keys per thread, between 256 and 1024 threads.

    At least 256 threads so that one thread owns one histogram bin in the scan.
    """
    t = 256
    while t < 1024 and t * 16 < n:
        t *= 2
    return t


def lean_config(n: int, sorted_: bool = False) -> tuple[int, int]:
    """``(threads, min_ctas)`` of the ``"lean"`` variant for ``n`` candidates per row.

    Same CTA size as :func:`threads_for`; ``min_ctas`` (ptxas ``minctasm``) is the number of CTAs
    per SM the registers must allow. Unsorted with <= 16 score words per thread: ``2048 // T``
    (a full SM, 32 registers per thread; ``ptxas -v`` shows no spill for T = 256, 512, 1024).
    Otherwise 0 = no cap: 32 words per thread, or the sorted variant's bitonic stage, would spill.
    """
    t = threads_for(n)
    items = cdiv(n, t)
    return t, (2048 // t if items <= 16 and not sorted_ else 0)


def default_variant(world: int, kloc: int, k: int, sorted: bool) -> str:  # noqa: A002
    """The variant :func:`stable_topk_cutedsl` uses when none is given (chosen by measurement).

    ``"lean"`` for unsorted selection over ``N <= 16384`` candidates per row: on the H200 it was
    as fast or faster than ``"regs"`` at every measured unsorted shape (CUDA graph, k = K = 2048:
    rows = 1024, W = 2/4/8: 14.4 / 31.7 / 55.6 µs against 14.5 / 32.3 / 71.5;
    ``benchmarks/results/topk.md``). ``"regs"`` for sorted output (the lean kernel's bitonic
    stage does not fit its register cap) and above 16384 candidates (lean has no register cap
    there). Both variants pass the same GPU differential test, so the choice changes speed only.
    """
    n = world * kloc
    return "lean" if not sorted and n <= 16384 else "regs"


class StableTopKKernel:
    """One compiled configuration: ``W`` ranks × ``K`` candidates each, select ``k``.

    Compile-time parameters (the compile cache key, :class:`TopKConfig`): ``world``, ``kloc`` (= K),
    ``k``, ``sorted_``, ``small`` (``W*rows*K < 2**31`` and ``rows*k < 2**31``: 32-bit offset
    arithmetic), ``variant``, the CTA configuration and the tuning knobs below. ``rows`` is
    dynamic. The shared state's words are named by :class:`State`.

    Variants (same semantics, same output):

    * ``"regs"`` — both key words of every candidate in registers (2 registers per key).
    * ``"lean"`` — only the 32-bit score word ``hi`` in registers; the ``lo`` words go to shared
      memory (``4*N`` bytes, written once while loading) and are read back only where needed: by
      the id passes (keys whose ``hi`` equals the threshold, rare) and by the commit (winners).
      Half the key registers lets ptxas fit the kernel under a ``minctasm`` register cap
      (``min_ctas`` CTAs per SM), so the loads of one row overlap the histogram passes of
      another. See :func:`lean_config`.

    Tuning knob (same output): ``first_bits``, the width of the first radix digit (see
    :func:`digit_schedule`).
    """

    def __init__(
        self,
        world: int,
        kloc: int,
        k: int,
        sorted_: bool,
        small: bool = True,
        variant: str = "regs",
        threads: int = 0,
        min_ctas: int = 0,
        first_bits: int = 8,
    ) -> None:
        _check_knobs(variant, threads, first_bits)
        self.world = world
        self.kloc = kloc
        self.n = world * kloc
        self.k = k
        self.sorted_ = sorted_
        self.small = small
        self.lean = variant == "lean"
        self.schedule = digit_schedule(first_bits)
        self.schedule_bins = tuple(1 << b for _, _, b in self.schedule)
        self.max_bins = max(self.schedule_bins)
        # The scan gives bins to whole warps: every digit needs >= 32 bins.
        assert min(self.schedule_bins) >= 32, self.schedule
        if self.lean and not threads:
            threads, min_ctas = lean_config(self.n, sorted_)
        self.threads = threads if threads else threads_for(self.n)
        self.min_ctas = min_ctas
        self.items = cdiv(self.n, self.threads)
        self.warps = self.threads // 32
        self.sort_size = next_pow2(min(k, self.n)) if sorted_ else 1
        self.lo_size = self.items * self.threads if self.lean else 1
        # One histogram buffer: the widest digit's bins, its dummy bin, padded to a warp multiple.
        self.hist_stride = self.max_bins + 32

    @cute.jit
    def __call__(self, cand: cute.Tensor, out: cute.Tensor, rows: Int32, stream: Any) -> None:
        # One CTA per row; the shared memory size comes from the SmemAllocator.
        if const_expr(self.min_ctas > 1):
            # minctasm caps the registers (65536 / (threads * min_ctas)); the carveout is given so
            # that the shared memory of min_ctas CTAs fits (and no device query at compile time).
            self.kernel(cand, out, rows).launch(
                grid=[rows, 1, 1],
                block=[self.threads, 1, 1],
                stream=stream,
                min_blocks_per_mp=self.min_ctas,
                preferred_smem_carveout=100,
            )
        else:
            self.kernel(cand, out, rows).launch(grid=[rows, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, cand: cute.Tensor, out: cute.Tensor, rows: Int32) -> None:
        """One CTA per row: load + pass 0, count the valid keys, radix passes, commit, sort."""
        T = const_expr(self.threads)
        KSEL = const_expr(self.k)
        NB0 = const_expr(self.schedule_bins[0])
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32

        smem = cutlass.memory.SmemAllocator()
        # Two histograms: pass d counts into one while the scan clears the other for pass d+1,
        # which saves a barrier per pass. Bin NB of each (one past the pass's last bin) is a
        # dummy: branch-free passes count the keys that do not take part into it.
        hist = smem.allocate_tensor(Int32, cute.make_layout(2 * self.hist_stride), byte_alignment=16)
        wsum = smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)  # per-warp totals
        # The selection's state: the keys still needed, the done flag, the counters, the threshold prefix
        # and its masks (class State names the words).
        st = smem.allocate_tensor(Int32, cute.make_layout(State.WORDS), byte_alignment=16)
        skeys = smem.allocate_tensor(Uint64, cute.make_layout(self.sort_size), byte_alignment=16)
        # lean: the lo word of item i of thread t at i*T + t (conflict-free).
        slo = smem.allocate_tensor(Uint32, cute.make_layout(self.lo_size), byte_alignment=16)

        if tid < State.WORDS:
            st[tid] = Int32(0)
        for x in cutlass.range(tid, NB0 + 1, T):  # pass 0's histogram and its dummy bin
            hist[x] = Int32(0)
        cute.arch.sync_threads()

        # 1. Keys in registers (khi; klo or slo), fused with pass 0's histogram.
        khi = cute.make_rmem_tensor((self.items,), Uint32)
        klo = cute.make_rmem_tensor((1 if const_expr(self.lean) else self.items,), Uint32)
        self.load_keys(cand, rows, row, tid, khi, klo, slo, hist)
        cute.arch.sync_threads()

        # 2. How many keys are valid: all but those counted into pass 0's dummy bin.
        n_valid = Int32(self.items * T) - hist[NB0]
        take = cutlass.min(n_valid, Int32(KSEL))
        if tid == 0:
            st[State.NEED] = take
            st[State.DONE] = Int32(n_valid <= KSEL)  # every valid key wins: no selection needed
        # -1 fill of the tail [take, k): no winner is ever written there.
        if const_expr(self.small):
            obase = row * KSEL
        else:
            obase = Int64(row) * Int64(KSEL)
        for j in cutlass.range(take + tid, KSEL, T):
            out[obase + j] = Int32(-1)
        cute.arch.sync_threads()

        # 3. Radix select, most significant digit first (self.schedule, see digit_schedule).
        for d in cutlass.range_constexpr(len(self.schedule)):
            self.radix_pass(d, khi, klo, slo, hist, wsum, st, tid, lane, warp)

        # 4. Commit the winners: the threshold and the masks of the digits fixed so far.
        need = st[State.NEED]
        phi = st[State.PREFIX_HI].bitcast(Uint32)
        plo = st[State.PREFIX_LO].bitcast(Uint32)
        hm = st[State.MASK_HI].bitcast(Uint32)  # the digits fixed so far (none when every valid key wins)
        lm = st[State.MASK_LO].bitcast(Uint32)
        if (st[State.DONE] != 0) & (lm == Uint32(0)):
            self.commit_fast(phi, khi, klo, slo, st, skeys, out, obase, tid, lane)
        else:
            self.commit_general(need, phi, plo, hm, lm, khi, klo, slo, st, skeys, out, obase, tid)

        # 5. Sorted output: bitonic sort of the winners' keys in shared memory.
        if const_expr(self.sorted_):
            self.sort_winners(skeys, out, obase, take, tid)

    @cute.jit
    def load_keys(
        self,
        cand: cute.Tensor,
        rows: Int32,
        row: Int32,
        tid: Int32,
        khi: cute.Tensor,
        klo: cute.Tensor,
        slo: cute.Tensor,
        hist: cute.Tensor,
    ) -> None:
        """Load this thread's candidates as keys and count pass 0's histogram on the way.

        Thread ``tid`` takes candidates ``j = i*T + tid`` of the row (coalesced 8-byte loads of
        (score, id)). hi: order-preserving score bits; lo: ``0xFFFFFFFF - id``. Invalid (negative
        id, NaN score, padding past ``N``): hi = 0 (lo is then never read). A valid key always has
        hi != 0 (hi == 0 would need score bits 0xFFFFFFFF, a NaN), so the passes over the score
        bits touch only the hi words. Pass 0 (the top digit of hi) is counted here, branch-free:
        invalid keys go to the dummy bin ``NB0``, whose count then gives the number of valid keys.
        Writes ``khi[i]`` and ``klo[i]`` (``"regs"``) or ``slo[i*T + tid]`` (``"lean"``).
        """
        T = const_expr(self.threads)
        N = const_expr(self.n)
        KL = const_expr(self.kloc)
        SH0 = const_expr(self.schedule[0][1])
        NB0 = const_expr(self.schedule_bins[0])
        for i in cutlass.range_constexpr(self.items):
            j = i * T + tid
            hi = Uint32(0)
            lo = Uint32(0)
            inb = Boolean(True)
            if const_expr((i + 1) * T > N):
                inb = j < N
            if inb:
                # Candidate j = w*K + c of this row is at (w*rows + row)*K + c. When T divides K
                # (or K divides T) w and c are affine in tid with compile-time coefficients, so
                # no division is needed.
                if const_expr(KL % T == 0):
                    w = const_expr((i * T) // KL)
                    c = const_expr((i * T) % KL) + tid
                elif const_expr(T % KL == 0):
                    w = const_expr(i * (T // KL)) + tid // KL
                    c = tid % KL
                else:
                    w = j // KL
                    c = j - w * KL
                if const_expr(self.small):
                    off = (w * rows + row) * KL + c
                else:
                    off = (Int64(w) * Int64(rows) + Int64(row)) * Int64(KL) + Int64(c)
                v = cand[off].bitcast(Uint64)  # one 8-byte load: (score, id) as float32 bits
                sb = Uint32(v & Uint64(MASK32))
                idf = Uint32(v >> Uint64(32)).bitcast(Float32)
                # -0.0 -> +0.0 so that the two zeros tie and the id decides.
                sb = Uint32(cutlass.select_(sb == Uint32(0x80000000), Uint32(0), sb))
                # Negative floats: flip all bits; non-negative: set the sign bit.
                flip = Uint32(Int32(sb.bitcast(Int32) >> 31).bitcast(Uint32) | Uint32(0x80000000))
                ok = (idf >= Float32(0.0)) & ((sb & Uint32(0x7FFFFFFF)) <= Uint32(0x7F800000))
                hi = Uint32(cutlass.select_(ok, sb ^ flip, Uint32(0)))
                lo = Uint32(MASK32) - Uint32(Int32(idf))  # garbage when invalid: never read then
            khi[i] = hi
            if const_expr(self.lean):
                slo[i * T + tid] = lo
            else:
                klo[i] = lo
            digit = Int32(cutlass.select_(hi != Uint32(0), (hi >> Uint32(SH0)) & Uint32(NB0 - 1), Uint32(NB0)))
            cute.arch.atomic_add(hist.iterator + digit, Int32(1))

    @cute.jit
    def key_lo(self, klo: cute.Tensor, slo: cute.Tensor, i: int, tid: Int32) -> Uint32:
        """The lo word (``0xFFFFFFFF - id``) of this thread's item ``i``: a register or shared memory."""
        if const_expr(self.lean):
            lo = slo[i * self.threads + tid]
        else:
            lo = klo[i]
        return lo

    @cute.jit
    def radix_pass(
        self,
        d: int,
        khi: cute.Tensor,
        klo: cute.Tensor,
        slo: cute.Tensor,
        hist: cute.Tensor,
        wsum: cute.Tensor,
        st: cute.Tensor,
        tid: Int32,
        lane: Int32,
        warp: Int32,
    ) -> None:
        """Pass ``d`` of the radix select (skipped once the threshold is found).

        Histogram of digit ``d`` over the keys that match the prefix found so far (pass 0's was
        counted while loading), then :meth:`pick_bin`. Three barriers (two in pass 0); the
        histogram is double buffered, so clearing the next pass's copy costs no barrier.
        """
        word = const_expr(self.schedule[d][0])
        sh = const_expr(self.schedule[d][1])
        NB = const_expr(self.schedule_bins[d])
        bits_above = const_expr(sh + self.schedule[d][2])
        before = const_expr((MASK32 << bits_above) & MASK32 if bits_above < 32 else 0)  # digits fixed before
        cur = const_expr((d % 2) * self.hist_stride)
        done = st[State.DONE]
        if done == 0:
            # Read the state once, before anyone can update it (the update comes after at
            # least one more barrier).
            need = st[State.NEED]
            phi = st[State.PREFIX_HI].bitcast(Uint32)
            plo = st[State.PREFIX_LO].bitcast(Uint32)
            if const_expr(d > 0):  # pass 0 was counted while loading
                for i in cutlass.range_constexpr(self.items):
                    hi = khi[i]
                    # (A branch-free form that counts non-matching keys into the dummy bin
                    # was measured slower here: most keys are off the prefix after pass 0.)
                    if const_expr(word == 0):
                        match = (hi != Uint32(0)) & ((hi & Uint32(before)) == phi)
                        if match:
                            digit = Int32((hi >> Uint32(sh)) & Uint32(NB - 1))
                            cute.arch.atomic_add(hist.iterator + cur + digit, Int32(1))
                    else:
                        # Id passes: only keys whose score word equals the threshold.
                        if (hi != Uint32(0)) & (hi == phi):
                            lo = self.key_lo(klo, slo, i, tid)
                            mlo = Boolean(True)
                            if const_expr(before != 0):
                                mlo = (lo & Uint32(before)) == plo
                            if mlo:
                                digit = Int32((lo >> Uint32(sh)) & Uint32(NB - 1))
                                cute.arch.atomic_add(hist.iterator + cur + digit, Int32(1))
                cute.arch.sync_threads()
            self.pick_bin(d, need, phi, plo, hist, wsum, st, tid, lane, warp)

    @cute.jit
    def pick_bin(
        self,
        d: int,
        need: Int32,
        phi: Uint32,
        plo: Uint32,
        hist: cute.Tensor,
        wsum: cute.Tensor,
        st: cute.Tensor,
        tid: Int32,
        lane: Int32,
        warp: Int32,
    ) -> None:
        """Scan pass ``d``'s histogram from the top bin down and publish the bin of the need-th key.

        Thread ``t < A`` owns ``BPT`` adjacent bins from the top; a warp scan
        (:func:`warp_inclusive_scan`) of the owned counts, then a second one over the warp
        totals, gives every thread the number of keys above its bins. The one thread whose bin
        holds the need-th largest key writes the new prefix, its mask, how many keys are still
        needed from that bin, and ``done`` when the bin holds exactly that many. Two barriers.
        """
        T = const_expr(self.threads)
        word = const_expr(self.schedule[d][0])
        sh = const_expr(self.schedule[d][1])
        NB = const_expr(self.schedule_bins[d])
        A = const_expr(min(T, NB))  # threads that scan: BPT adjacent bins each
        BPT = const_expr(NB // A)
        NWA = const_expr(A // 32)
        NBN = const_expr(self.schedule_bins[d + 1] if d + 1 < len(self.schedule) else 0)
        after = const_expr((MASK32 << sh) & MASK32)  # digits fixed after this pass
        cur = const_expr((d % 2) * self.hist_stride)
        nxt = const_expr(((d + 1) % 2) * self.hist_stride)
        # Scan from the top bin down: thread t (< A) owns bins NB-1-t*BPT ... NB-(t+1)*BPT;
        # an inclusive prefix sum over t of the owned counts = keys in those bins or above.
        # Warps >= NWA own no bin and skip the scan (a warp-uniform branch).
        s = Int32(0)
        incl = Int32(0)
        scanning = Boolean(True)
        if const_expr(NWA < self.warps):
            scanning = warp < NWA
        if scanning:
            for q in cutlass.range_constexpr(BPT):
                s = s + hist[cur + NB - 1 - q - tid * BPT]
            incl = warp_inclusive_scan(s, lane)
            if lane == 31:
                wsum[warp] = incl
        # The other buffer (and its dummy bin), for the next pass.
        for x in cutlass.range(tid, NBN + 1 if NBN else 0, T):
            hist[nxt + x] = Int32(0)
        cute.arch.sync_threads()
        if scanning:
            # Totals of the warps before this one: a second warp scan, over wsum.
            wv = Int32(0)
            if lane < NWA:
                wv = wsum[lane]
            wv = warp_inclusive_scan(wv, lane)
            prev = cute.arch.shuffle_sync(wv, cutlass.max(warp - 1, Int32(0)))
            above = cutlass.select_(warp > 0, prev, Int32(0)) + incl - s
            for q in cutlass.range_constexpr(BPT):
                b = Int32(NB - 1 - q) - tid * BPT
                cnt = hist[cur + b]
                # Exactly one bin satisfies this: the one holding the need-th largest key.
                if (above < need) & (need <= above + cnt):
                    newneed = need - above
                    st[State.NEED] = newneed
                    if const_expr(word == 0):
                        st[State.PREFIX_HI] = (phi | (Uint32(b) << Uint32(sh))).bitcast(Int32)
                        st[State.MASK_HI] = Uint32(after).bitcast(Int32)
                    else:
                        st[State.PREFIX_LO] = (plo | (Uint32(b) << Uint32(sh))).bitcast(Int32)
                        st[State.MASK_LO] = Uint32(after).bitcast(Int32)
                    if cnt == newneed:
                        st[State.DONE] = Int32(1)  # the bin holds exactly what is needed: done
                above = above + cnt
        cute.arch.sync_threads()

    @cute.jit
    def store_winner(
        self, skeys: cute.Tensor, out: cute.Tensor, obase: Int32 | Int64, slot: Int32, hi: Uint32, lo: Uint32
    ) -> None:
        """Winner -> output slot: its id into ``out`` (unsorted) or its key into ``skeys`` (sorted)."""
        if const_expr(self.sorted_):
            skeys[slot] = (Uint64(hi) << Uint64(32)) | Uint64(lo)
        else:
            out[obase + slot] = (Uint32(MASK32) - lo).bitcast(Int32)

    @cute.jit
    def commit_fast(
        self,
        phi: Uint32,
        khi: cute.Tensor,
        klo: cute.Tensor,
        slo: cute.Tensor,
        st: cute.Tensor,
        skeys: cute.Tensor,
        out: cute.Tensor,
        obase: Int32 | Int64,
        tid: Int32,
        lane: Int32,
    ) -> None:
        """Commit when the selection ended in a score pass on a bin holding exactly what is needed.

        The usual case (or every valid key wins: ``phi = 0``). The winners are then exactly the
        keys with ``hi >= phi`` (valid ones: ``hi >= 1``), one compare each. Slots: one atomic
        per warp for the warp's total, then per item a ballot, so that a warp's winners of item
        ``i`` take consecutive slots (coalesced stores).
        """
        lower = cutlass.max(phi, Uint32(1))
        mine = Int32(0)
        for i in cutlass.range_constexpr(self.items):
            mine = mine + cutlass.select_(khi[i] >= lower, Int32(1), Int32(0))
        total = cute.arch.warp_redux_sync(mine, "add")
        base = Int32(0)
        if lane == 0:
            base = cute.arch.atomic_add(st.iterator + State.COUNT, total)
        run = cute.arch.shuffle_sync(base, 0)
        ltmask = cute.arch.lanemask_lt()
        for i in cutlass.range_constexpr(self.items):
            hi = khi[i]
            win = hi >= lower
            ballot = Uint32(cute.arch.vote_ballot_sync(win))
            if win:
                slot = run + Int32(cute.arch.popc(ballot & Uint32(ltmask)))
                self.store_winner(skeys, out, obase, slot, hi, self.key_lo(klo, slo, i, tid))
            run = run + Int32(cute.arch.popc(ballot))

    @cute.jit
    def commit_general(
        self,
        need: Int32,
        phi: Uint32,
        plo: Uint32,
        hm: Uint32,
        lm: Uint32,
        khi: cute.Tensor,
        klo: cute.Tensor,
        slo: cute.Tensor,
        st: cute.Tensor,
        skeys: cute.Tensor,
        out: cute.Tensor,
        obase: Int32 | Int64,
        tid: Int32,
    ) -> None:
        """Commit when the selection went into the id word, or ended with surplus ties.

        (Surplus ties: more keys equal to the threshold than needed, i.e. duplicated (score, id)
        pairs.) Keys above the threshold prefix (``hm``/``lm``: the bits it fixes) win; of the
        keys equal to it, the first ``need`` to reach a shared counter win. One slot atomic per
        winner.
        """
        for i in cutlass.range_constexpr(self.items):
            hi = khi[i]
            lo = Uint32(0)
            if const_expr(self.lean):
                # Only a key whose score word reaches the threshold can win: read its lo word.
                if (hi != Uint32(0)) & ((hi & hm) >= phi):
                    lo = self.key_lo(klo, slo, i, tid)
            else:
                lo = self.key_lo(klo, slo, i, tid)
            mh = hi & hm
            ml = lo & lm
            valid = hi != Uint32(0)
            win = valid & ((mh > phi) | ((mh == phi) & (ml > plo)))
            tie = valid & (mh == phi) & (ml == plo)
            if tie:
                # Only ``need`` of the keys equal to the threshold prefix are taken.
                old = cute.arch.atomic_add(st.iterator + State.TIES, Int32(1))
                win = old < need
            if win:
                slot = cute.arch.atomic_add(st.iterator + State.COUNT, Int32(1))
                self.store_winner(skeys, out, obase, slot, hi, lo)

    @cute.jit
    def sort_winners(self, skeys: cute.Tensor, out: cute.Tensor, obase: Int32 | Int64, take: Int32, tid: Int32) -> None:
        """Sorted output: bitonic sort (descending) of the ``take`` winners' keys, then their ids out.

        ``skeys`` holds ``P = next_pow2(min(k, N))`` keys; ``[take, P)`` is padded with the
        smallest key so that the padding sorts last. Every (size, stride) stage is unrolled at
        compile time, one barrier each.
        """
        T = const_expr(self.threads)
        P = const_expr(self.sort_size)
        cute.arch.sync_threads()
        for j in cutlass.range(take + tid, P, T):
            skeys[j] = Uint64(0)
        cute.arch.sync_threads()
        size = 2
        while const_expr(size <= P):
            stride = size // 2
            while const_expr(stride >= 1):
                for p in cutlass.range(tid, P // 2, T):
                    lo_i = 2 * p - (p & (stride - 1))
                    hi_i = lo_i + stride
                    a = skeys[lo_i]
                    bb = skeys[hi_i]
                    desc = (lo_i & size) == 0
                    swap = Boolean(cutlass.select_(desc, a < bb, a > bb))
                    if swap:
                        skeys[lo_i] = bb
                        skeys[hi_i] = a
                cute.arch.sync_threads()
                stride = stride // 2
            size = size * 2
        for j in cutlass.range(tid, take, T):
            key = skeys[j]
            out[obase + j] = (Uint32(MASK32) - Uint32(key & Uint64(MASK32))).bitcast(Int32)


def launch_per_row(kernel: Any, rows: Any, threads: int, split: int, min_ctas: int, stream: Any) -> None:
    """Launch ``kernel`` (a ``@cute.kernel`` call) with one CTA per row — or a cluster of ``split`` CTAs per row — of
    ``threads`` threads; ``min_ctas > 1`` caps the registers so that that many CTAs share an SM (ptxas
    ``minctasm``, with the shared-memory carveout given so that they fit). Shared by the kernels of this package
    that select per row (:class:`~dcp_ref.kernels.select_to_slots_cutedsl.SelectToSlotsKernel`,
    :class:`~dcp_ref.kernels.local_topk_cutedsl.LocalTopKKernel`)."""
    if split > 1:
        kernel.launch(grid=[rows * split, 1, 1], block=[threads, 1, 1], cluster=[split, 1, 1], stream=stream)
    elif min_ctas > 1:
        kernel.launch(
            grid=[rows, 1, 1],
            block=[threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=min_ctas,
            preferred_smem_carveout=100,
        )
    else:
        kernel.launch(grid=[rows, 1, 1], block=[threads, 1, 1], stream=stream)


@cute.jit
def warp_inclusive_scan(x: Int32, lane: Int32) -> Int32:
    """Inclusive prefix sum of ``x`` over the 32 lanes of a warp: five ``shuffle_sync_up`` steps."""
    for o in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(x, 1 << o, mask_and_clamp=0)
        x = x + cutlass.select_(lane >= (1 << o), other, Int32(0))
    return x


def _check_knobs(variant: str, threads: int, first_bits: int) -> None:
    """The kernel's variant, CTA size and first digit width (shared by the kernel and :class:`TopKConfig`)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if first_bits not in FIRST_BITS:
        raise ValueError(f"first_bits must be one of {FIRST_BITS}, got {first_bits!r}")
    if threads and (threads < 256 or threads > 1024 or threads & (threads - 1)):
        raise ValueError(f"threads must be a power of two in [256, 1024], got {threads}")


@dataclass(frozen=True)
class TopKConfig:
    """One compiled configuration of :class:`StableTopKKernel` (the compile cache key; ``rows`` is dynamic).

    Attributes:
        world, kloc, k: ``W`` ranks, ``K`` candidates each, ``k`` winners per row.
        sorted_: winners in key order (the bitonic stage).
        small: 32-bit offset arithmetic (the caller guarantees ``W*rows*K < 2**31`` and ``rows*k < 2**31``).
        variant: ``"regs"`` / ``"lean"`` (:class:`StableTopKKernel`).
        threads, min_ctas: CTA size and ptxas' ``minctasm`` cap (``0, 0``: by shape, :func:`threads_for` /
            :func:`lean_config`).
        first_bits: width of the first radix digit (:data:`FIRST_BITS`).
        tvm_ffi: compiled for the TVM-FFI call path.
    """

    world: int
    kloc: int
    k: int
    sorted_: bool = False
    small: bool = True
    variant: str = "regs"
    threads: int = 0
    min_ctas: int = 0
    first_bits: int = 8
    tvm_ffi: bool = False

    def __post_init__(self) -> None:
        _check_knobs(self.variant, self.threads, self.first_bits)

    def kernel(self) -> StableTopKKernel:
        """The kernel object this configuration compiles."""
        return StableTopKKernel(
            self.world, self.kloc, self.k, self.sorted_, self.small, self.variant, self.threads, self.min_ctas,
            self.first_bits,
        )  # fmt: skip


def _fake_args() -> tuple[Any, Any, Int32]:
    """The compile-time stand-ins of ``(cand, out, rows)``: 1-D int64 / int32 tensors of dynamic length."""
    cand = cute.runtime.make_fake_compact_tensor(Int64, (cute.sym_int64(),), assumed_align=8)
    out = cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int64(),), assumed_align=4)
    return cand, out, Int32(1)


@functools.lru_cache(maxsize=64)
def _compiled(cfg: TopKConfig) -> Any:
    """Compile once per configuration (tracing takes milliseconds; launching microseconds)."""
    kern = cfg.kernel()
    cand, out, rows = _fake_args()
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=cfg.tvm_ffi)
    if cfg.tvm_ffi:
        return cute.compile(kern, cand, out, rows, stream, options="--enable-tvm-ffi")
    return cute.compile(kern, cand, out, rows, stream)


def compile_to_ptx(
    world: int,
    kloc: int,
    k: int,
    sorted: bool,  # noqa: A002
    dump_dir: str,
    small: bool = True,
    variant: str = "regs",
    first_bits: int = 8,
) -> str:
    """Compile one configuration (uncached) and return its PTX text — the CPU CI check.

    Needs ``CUTE_DSL_ARCH=sm_90a`` in the environment (no GPU is needed); ``dump_dir`` must exist.
    """
    kern = TopKConfig(int(world), int(kloc), int(k), bool(sorted), bool(small), variant, first_bits=first_bits).kernel()
    cand, out, rows = _fake_args()
    stream = cutlass.runtime.make_fake_stream()
    fn = cute.compile(kern, cand, out, rows, stream, options=f"--keep-ptx --dump-dir={dump_dir}")
    ptx = fn.__ptx__ or ""
    if ptx and not ptx.lstrip().startswith("//") and os.path.exists(ptx):
        with open(ptx) as fh:  # some versions return the file path instead of the text
            ptx = fh.read()
    return ptx


def compile_stable_topk(
    world: int,
    kloc: int,
    k: int,
    sorted: bool = False,  # noqa: A002
    tvm_ffi: bool = False,
    small: bool = True,
    variant: str | None = None,
    config: tuple[int, int] | None = None,
    first_bits: int = 8,
) -> Any:
    """The compiled kernel for one configuration (cached). Works without a GPU (sm_90a).

    ``small``: the caller guarantees ``W*rows*K < 2**31`` (32-bit offsets). ``variant``:
    ``"regs"`` / ``"lean"`` (``None``: :func:`default_variant`). ``config``: ``(threads,
    min_ctas)`` override (benchmarking; threads a multiple of 32 in [256, 1024]).
    """
    if variant is None:
        variant = default_variant(world, kloc, k, sorted)
    threads, min_ctas = (0, 0) if config is None else (int(config[0]), int(config[1]))
    cfg = TopKConfig(
        int(world), int(kloc), int(k), bool(sorted), bool(small), variant, threads, min_ctas, int(first_bits),
        bool(tvm_ffi),
    )  # fmt: skip
    return _compiled(cfg)


def stable_topk_cutedsl(
    gathered: torch.Tensor,
    k: int,
    sorted: bool = False,  # noqa: A002
    out: torch.Tensor | None = None,
    tvm_ffi: bool | None = None,
    validate: bool = True,
    variant: str | None = None,
    config: tuple[int, int] | None = None,
    first_bits: int | None = None,
) -> torch.Tensor:
    """Launch the stable top-K on the all-gathered candidates (CUDA only).

    Args:
        gathered: float32 CUDA ``[W, rows, K, 2]`` (all-gather output), contiguous; or
            ``[rows, N, 2]`` (treated as ``W = 1``, ``K = N``).
        k: ``k >= 1``.  sorted: return ids in key order.
        out: optional int32 CUDA ``[rows, k]`` contiguous output buffer (CUDA-graph path: no
            allocation, no host synchronisation).
        tvm_ffi: force the TVM-FFI call path on/off (``None``: on when apache-tvm-ffi is there).
        validate: check the id values on the host first (one sync; the reference's ValueError,
            as :func:`dcp_ref.topk.stable_topk` with its default ``validate=True``). Pass
            ``False`` on the hot path (CUDA graphs): shapes/dtypes/devices only, and the kernel
            treats a negative id or a NaN score as invalid; ids are never used as addresses, so
            a bad id cannot make it read or write out of bounds.
        variant: ``"regs"`` or ``"lean"`` (same result; see :class:`StableTopKKernel`);
            ``None``: :func:`default_variant` for the shape.
        config: ``(threads, min_ctas)`` override of the CTA configuration (benchmarking only).
        first_bits: width of the first radix digit, one of :data:`FIRST_BITS` (same result;
            ``None``: 8, the fastest measured; see :func:`digit_schedule`).
    Returns:
        int32 ``[rows, k]`` (``out`` when given).
    """
    from dcp_ref.contracts import check_bool, check_int_scalar, check_out, check_tensor

    check_tensor(gathered, "gathered", dtypes=(torch.float32,), ndim=(3, 4))
    k = check_int_scalar(k, "k", min_value=1)
    sorted = check_bool(sorted, "sorted")  # noqa: A001
    validate = check_bool(validate, "validate")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if gathered.shape[-1] != 2:
        raise ValueError(f"gathered must end in a (score, id) dimension of size 2, got shape {tuple(gathered.shape)}")
    if gathered.ndim == 3:
        world, rows, kloc = 1, gathered.shape[0], gathered.shape[1]
    else:
        world, rows, kloc = gathered.shape[0], gathered.shape[1], gathered.shape[2]
    if world * kloc > MAX_CANDIDATES:
        raise ValueError(f"the CuTeDSL top-K supports W*K <= {MAX_CANDIDATES} candidates per row, got {world * kloc}")
    if sorted and min(k, world * kloc) > MAX_SORTED_WINNERS:
        raise ValueError(
            f"sorted=True supports min(k, W*K) <= {MAX_SORTED_WINNERS} in shared memory, got {min(k, world * kloc)}"
        )
    if gathered.device.type != "cuda":
        raise ValueError(f"gathered must be a CUDA tensor for the CuTeDSL kernel, got device {gathered.device}")
    if not gathered.is_contiguous():
        raise ValueError("gathered must be contiguous (the kernel reads (score, id) pairs as 8-byte words)")
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=gathered.device)
    else:
        check_out(out, "out", (rows, k), torch.int32, gathered.device, contiguous=True)
    if validate:
        from dcp_ref.topk import check_candidate_ids

        check_candidate_ids(gathered[..., 1])
    if rows == 0:
        return out
    if world * kloc == 0:
        return out.fill_(-1)
    if gathered.data_ptr() % 8:
        raise ValueError("gathered must be 8-byte aligned")
    small = world * rows * kloc < 2**31 and rows * k < 2**31
    ffi = use_tvm_ffi() if tvm_ffi is None else bool(tvm_ffi)
    first_bits = 8 if first_bits is None else first_bits  # StableTopKKernel validates it
    fn = compile_stable_topk(world, kloc, k, sorted, ffi, small, variant, config, first_bits)
    words = gathered.view(torch.int64).reshape(-1)
    flat = out.view(-1)
    if ffi:
        fn(words, flat, rows)
    else:
        import cuda.bindings.driver as cuda  # shipped with nvidia-cutlass-dsl
        from cutlass.cute.runtime import from_dlpack

        stream = cuda.CUstream(torch.cuda.current_stream(gathered.device).cuda_stream)
        fn(from_dlpack(words, assumed_align=8), from_dlpack(flat, assumed_align=4), Int32(rows), stream)
    return out


@functools.lru_cache(maxsize=1)
def use_tvm_ffi() -> bool:
    """TVM-FFI call path: on when apache-tvm-ffi is importable, unless ``DCP_TOPK_TVM_FFI=0``."""
    if os.environ.get("DCP_TOPK_TVM_FFI", "1") in ("", "0"):
        return False
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True
