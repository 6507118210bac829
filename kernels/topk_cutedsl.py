"""CuTeDSL stable top-K over all-gathered DCP candidates: one CTA per row, MSB-first radix select.

Input: the all-gather output ``[W, rows, K, 2]`` float32 (score, global id) — read in place, as
int64 words (one 8-byte load per candidate), candidate ``j = w*K + c`` of row ``r`` at
``(w*rows + r)*K + c``. Output: int32 ``[rows, k]`` global ids, ``-1`` padded.

Algorithm (per row = per CTA of ``T`` threads):

1. **Keys in registers.** Thread ``t`` holds candidates ``j = i*T + t`` (coalesced loads) as the
   unsigned 64-bit key ``hi << 32 | lo``, kept as two 32-bit words — ``hi`` the order-preserving
   float bits (``-0.0`` made ``+0.0``), ``lo = 0xFFFFFFFF - id``; invalid (id < 0 or NaN score)
   → ``0``. This is :func:`dcp_ref.topk.stable_key` with the sign bit flipped, so unsigned order
   = reference order. The score passes touch only the ``hi`` words.
2. **Count valid keys** (block reduction in shared memory). If ``n_valid <= k`` every valid key
   wins; skip to 4.
3. **Radix select**, 8 passes of 8 bits, most significant first. Each pass builds a 256-bin
   shared-memory histogram of the next digit over the keys that still match the prefix found so
   far; 256 threads then scan it from the top bin down (warp ``shuffle_sync_up`` inclusive scan +
   per-warp totals) and the one thread whose bin holds the k-th largest key publishes the new
   prefix and how many keys are still needed from that bin. If the bin holds exactly that many,
   the threshold is found early (``done``). Three barriers per pass: the histogram is double
   buffered (the scan clears the next pass's copy).
4. **Commit winners**: keys whose prefix is above the threshold prefix, plus as many keys equal
   to it as still needed (only duplicated keys = duplicated ids can tie after 8 passes), take a
   slot from a shared-memory atomic counter. Unsorted: the id is written straight to ``out``.
   Sorted: the key is written to a shared buffer, which is bitonic-sorted (descending) and then
   written out. Slots ``[min(k, n_valid), k)`` are pre-filled with ``-1`` by disjoint threads
   (no write-write race between the -1 fill and the winners).

**Variants.** ``"regs"`` is the above. ``"lean"`` keeps only the ``hi`` words in registers and
parks the ``lo`` words in shared memory (``4*N`` bytes), read back only by the id passes 4-7 and
the commit, for the keys whose ``hi`` reaches the threshold. At <= 16 words per thread the kernel
then fits in 32 registers (ptxas ``minctasm``), so ``2048 / T`` CTAs share an SM and one row's
loads overlap another's histogram passes: at rows = 1024, W = 8, K = k = 2048 this took 96 µs
to 70 µs. :func:`default_variant` picks one by shape; ``variant=`` forces one.

Any ``k >= 1`` and any candidate count up to the limit below work (the tail is masked); the sorted
variant needs ``next_pow2(min(k, N)) * 8`` bytes of shared memory. Compiled kernels are
cached per ``(W, K, k, sorted, 32-bit offsets, TVM-FFI, variant, CTA config)``; ``rows`` is a
runtime argument. The TVM-FFI call path (torch tensors passed straight in, the current stream taken from the
environment) is used when apache-tvm-ffi is importable: on the H200 it cut the Python-side
launch from ~20 µs to ~6 µs (``benchmarks/results/topk.md``); ``DCP_TOPK_TVM_FFI=0`` turns it
off. The launch makes no host synchronisation and no allocation when ``out`` is given (CUDA-graph
capturable).

Limits (both tested on the H200): ``N = W*K <= 32768`` candidates per row (keys live in
registers: 32 per thread at most) and, for ``sorted=True``, ``min(k, N) <= 4096`` winners (their
keys are sorted in 32 KiB of static shared memory). :mod:`dcp_ref.topk_backend` falls back to the
reference beyond them, logged.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32, Uint64, const_expr

__all__ = [
    "StableTopKKernel",
    "threads_for",
    "compile_stable_topk",
    "stable_topk_cutedsl",
    "MAX_SORTED_WINNERS",
    "MAX_CANDIDATES",
    "compile_to_ptx",
    "VARIANTS",
    "lean_config",
    "default_variant",
]

RADIX_BITS = 8
NUM_BINS = 1 << RADIX_BITS
NUM_PASSES = 64 // RADIX_BITS
#: The sorted variant keeps the winners' keys in shared memory: at most this many (tested size).
MAX_SORTED_WINNERS = 4096
#: Candidates per row (``W*K``): keys live in registers, at most 32 per thread (tested size).
MAX_CANDIDATES = 32768
#: Kernel variants (see :class:`StableTopKKernel`); ``None`` in the wrappers picks by shape.
VARIANTS = ("regs", "lean")


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
    items = (n + t - 1) // t
    return t, (2048 // t if items <= 16 and not sorted_ else 0)


def default_variant(world: int, kloc: int, k: int, sorted: bool) -> str:  # noqa: A002
    """The variant :func:`stable_topk_cutedsl` uses when none is given (chosen by measurement).

    ``"lean"`` for unsorted selection over ``8192 <= N <= 16384`` candidates per row, where it was
    faster on the H200 (CUDA graph, k = K = 2048, rows = 1024: W = 4 44.5 -> 38.2 µs, W = 8
    96.2 -> 70.0 µs; equal at rows = 128); ``"regs"`` elsewhere: slower at N = 4096 (W = 2:
    18.4 -> 19.1 µs) and no faster sorted (``benchmarks/results/topk.md``). Both variants pass
    the same GPU differential test, so the choice changes speed only.
    """
    n = world * kloc
    return "lean" if not sorted and 8192 <= n <= 16384 else "regs"


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


class StableTopKKernel:
    """One compiled configuration: ``W`` ranks × ``K`` candidates each, select ``k``.

    Compile-time parameters (the compile cache key): ``world``, ``kloc`` (= K), ``k``,
    ``sorted_``, ``small`` (``W*rows*K < 2**31``: 32-bit offset arithmetic), ``variant``. ``rows``
    is dynamic.

    Variants (same semantics, same output):

    * ``"regs"`` — both key words of every candidate in registers (2 registers per key).
    * ``"lean"`` — only the 32-bit score word ``hi`` in registers; the ``lo`` words go to shared
      memory (``4*N`` bytes, written once while loading) and are read back only where needed: by
      the id passes 4-7 (keys whose ``hi`` equals the threshold, rare) and by the commit (keys
      whose ``hi`` reaches the threshold). Half the key registers lets ptxas fit the kernel under
      a ``minctasm`` register cap (``min_ctas`` CTAs per SM), so the loads of one row overlap the
      histogram passes of another. See :func:`lean_config`.
    """

    def __init__(
        self, world: int, kloc: int, k: int, sorted_: bool, small: bool = True, variant: str = "regs",
        threads: int = 0, min_ctas: int = 0,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.world = world
        self.kloc = kloc
        self.n = world * kloc
        self.k = k
        self.sorted_ = sorted_
        self.small = small
        self.lean = variant == "lean"
        if self.lean and not threads:
            threads, min_ctas = lean_config(self.n, sorted_)
        self.threads = threads if threads else threads_for(self.n)
        self.min_ctas = min_ctas
        self.items = (self.n + self.threads - 1) // self.threads
        self.warps = self.threads // 32
        self.sort_size = _next_pow2(min(k, self.n)) if sorted_ else 1
        self.lo_size = self.items * self.threads if self.lean else 1

    @cute.jit
    def __call__(self, cand: cute.Tensor, out: cute.Tensor, rows: Int32, stream: Any) -> None:
        # One CTA per row; the shared memory size comes from the SmemAllocator.
        if const_expr(self.min_ctas > 1):
            # minctasm caps the registers (65536 / (threads * min_ctas)); the carveout is given so
            # that the shared memory of min_ctas CTAs fits (and no device query at compile time).
            self.kernel(cand, out, rows).launch(
                grid=[rows, 1, 1], block=[self.threads, 1, 1], stream=stream,
                min_blocks_per_mp=self.min_ctas, preferred_smem_carveout=100,
            )
        else:
            self.kernel(cand, out, rows).launch(grid=[rows, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, cand: cute.Tensor, out: cute.Tensor, rows: Int32) -> None:
        T = const_expr(self.threads)
        N = const_expr(self.n)
        KL = const_expr(self.kloc)
        KSEL = const_expr(self.k)
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32
        ALL = const_expr(0xFFFFFFFF)

        smem = cutlass.memory.SmemAllocator()
        # Two histograms: pass d counts into one while the scan clears the other for pass d+1,
        # which saves a barrier per pass.
        hist = smem.allocate_tensor(Int32, cute.make_layout(2 * NUM_BINS), byte_alignment=16)
        wsum = smem.allocate_tensor(Int32, cute.make_layout(NUM_BINS // 32), byte_alignment=16)
        # st[0] still-needed R, st[1] done flag, st[2] n_valid, st[3] output counter,
        # st[4] tie counter, st[5]/st[6] threshold prefix (hi/lo word), st[7] last pass (-1: none).
        st = smem.allocate_tensor(Int32, cute.make_layout(8), byte_alignment=16)
        skeys = smem.allocate_tensor(Uint64, cute.make_layout(self.sort_size), byte_alignment=16)
        # lean: the lo word of item i of thread t at i*T + t (conflict-free).
        slo = smem.allocate_tensor(Uint32, cute.make_layout(self.lo_size), byte_alignment=16)

        # ---- 1. keys in registers, as two 32-bit words -------------------------------------
        # hi: order-preserving score bits; lo: 0xFFFFFFFF - id. Invalid: hi = lo = 0. A valid key
        # always has hi != 0 (hi == 0 would need score bits 0xFFFFFFFF, a NaN). Passes over the
        # score bits then touch only the hi words (32-bit ops, half the work of 64-bit keys).
        khi = cute.make_rmem_tensor((self.items,), Uint32)
        klo = cute.make_rmem_tensor((1 if const_expr(self.lean) else self.items,), Uint32)
        nloc = Int32(0)
        for i in cutlass.range_constexpr(self.items):
            j = i * T + tid
            hi = Uint32(0)
            lo = Uint32(0)
            if j < N:
                w = j // KL
                c = j - w * KL
                if const_expr(self.small):
                    off = (w * rows + row) * KL + c
                else:
                    off = (Int64(w) * Int64(rows) + Int64(row)) * Int64(KL) + Int64(c)
                v = cand[off].bitcast(Uint64)  # one 8-byte load: (score, id) as float32 bits
                sb = Uint32(v & Uint64(ALL))
                idf = Uint32(v >> Uint64(32)).bitcast(Float32)
                # -0.0 -> +0.0 so that the two zeros tie and the id decides.
                sb = Uint32(cutlass.select_(sb == Uint32(0x80000000), Uint32(0), sb))
                # Negative floats: flip all bits; non-negative: set the sign bit.
                flip = Uint32(Int32(sb.bitcast(Int32) >> 31).bitcast(Uint32) | Uint32(0x80000000))
                ok = (idf >= Float32(0.0)) & ((sb & Uint32(0x7FFFFFFF)) <= Uint32(0x7F800000))
                idu = Uint32(Int32(Float32(cutlass.select_(ok, idf, Float32(0.0)))))
                hi = Uint32(cutlass.select_(ok, sb ^ flip, Uint32(0)))
                lo = Uint32(cutlass.select_(ok, Uint32(ALL) - idu, Uint32(0)))
            khi[i] = hi
            if const_expr(self.lean):
                slo[i * T + tid] = lo
            else:
                klo[i] = lo
            nloc = nloc + Int32(hi != Uint32(0))

        # ---- 2. count valid keys, reset state --------------------------------------------------
        if tid < 8:
            st[tid] = Int32(0)
        for x in cutlass.range(tid, 2 * NUM_BINS, T):
            hist[x] = Int32(0)
        cute.arch.sync_threads()
        cute.arch.atomic_add(st.iterator + 2, nloc)
        cute.arch.sync_threads()
        n_valid = st[2]
        take = cutlass.min(n_valid, Int32(KSEL))
        if tid == 0:
            st[0] = take
            st[1] = Int32(n_valid <= KSEL)  # every valid key wins: no selection needed
            st[7] = Int32(-1)
        # -1 fill of the tail [take, k): no winner is ever written there.
        obase = Int64(row) * Int64(KSEL)
        for j in cutlass.range(take + tid, KSEL, T):
            out[obase + Int64(j)] = Int32(-1)
        cute.arch.sync_threads()

        # ---- 3. radix select, most significant digit first: 3 barriers per pass -------------
        for d in cutlass.range_constexpr(NUM_PASSES):
            cur = const_expr((d % 2) * NUM_BINS)
            nxt = const_expr(((d + 1) % 2) * NUM_BINS)
            sh = const_expr(24 - RADIX_BITS * (d % 4))
            done = st[1]
            if done == 0:
                # Read the state once, before anyone can update it (the update comes after two
                # more barriers).
                need = st[0]
                phi = st[5].bitcast(Uint32)
                plo = st[6].bitcast(Uint32)
                for i in cutlass.range_constexpr(self.items):
                    hi = khi[i]
                    match = hi != Uint32(0)
                    if const_expr(d < 4):
                        if const_expr(d > 0):
                            hm = const_expr((ALL << (32 - RADIX_BITS * d)) & ALL)
                            match = match & ((hi & Uint32(hm)) == phi)
                        if match:
                            digit = Int32((hi >> Uint32(sh)) & Uint32(NUM_BINS - 1))
                            cute.arch.atomic_add(hist.iterator + cur + digit, Int32(1))
                    elif const_expr(self.lean):
                        # Only keys whose score word equals the threshold read their lo word.
                        match = match & (hi == phi)
                        if match:
                            lo = slo[i * T + tid]
                            mlo = Boolean(True)
                            if const_expr(d > 4):
                                lm = const_expr((ALL << (32 - RADIX_BITS * (d - 4))) & ALL)
                                mlo = (lo & Uint32(lm)) == plo
                            if mlo:
                                digit = Int32((lo >> Uint32(sh)) & Uint32(NUM_BINS - 1))
                                cute.arch.atomic_add(hist.iterator + cur + digit, Int32(1))
                    else:
                        lo = klo[i]
                        match = match & (hi == phi)
                        if const_expr(d > 4):
                            lm = const_expr((ALL << (32 - RADIX_BITS * (d - 4))) & ALL)
                            match = match & ((lo & Uint32(lm)) == plo)
                        if match:
                            digit = Int32((lo >> Uint32(sh)) & Uint32(NUM_BINS - 1))
                            cute.arch.atomic_add(hist.iterator + cur + digit, Int32(1))
                cute.arch.sync_threads()
                if tid < NUM_BINS:
                    # Thread t looks at bin 255-t: an inclusive prefix sum over t counts the
                    # keys in this bin or above. Warp scan with shuffles, then warp totals.
                    cnt = hist[cur + NUM_BINS - 1 - tid]
                    incl = cnt
                    for s in cutlass.range_constexpr(5):
                        other = cute.arch.shuffle_sync_up(incl, 1 << s, mask_and_clamp=0)
                        if lane >= (1 << s):
                            incl = incl + other
                    if lane == 31:
                        wsum[warp] = incl
                    hist[nxt + tid] = Int32(0)  # the other buffer, for the next pass
                cute.arch.sync_threads()
                if tid < NUM_BINS:
                    b = Int32(NUM_BINS - 1) - tid
                    cnt = hist[cur + b]
                    incl = cnt
                    for s in cutlass.range_constexpr(5):
                        other = cute.arch.shuffle_sync_up(incl, 1 << s, mask_and_clamp=0)
                        if lane >= (1 << s):
                            incl = incl + other
                    for ww in cutlass.range_constexpr(NUM_BINS // 32):
                        if ww < warp:
                            incl = incl + wsum[ww]
                    above = incl - cnt
                    # Exactly one bin satisfies this: the one holding the need-th largest key.
                    if above < need and need <= incl:
                        newneed = need - above
                        st[0] = newneed
                        if const_expr(d < 4):
                            st[5] = (phi | (Uint32(b) << Uint32(sh))).bitcast(Int32)
                        else:
                            st[6] = (plo | (Uint32(b) << Uint32(sh))).bitcast(Int32)
                        st[7] = Int32(d)
                        if cnt == newneed:
                            st[1] = Int32(1)  # the bin holds exactly what is needed: done
                cute.arch.sync_threads()

        # ---- 4. commit winners -------------------------------------------------------------
        last = st[7]
        need = st[0]
        phi = st[5].bitcast(Uint32)
        plo = st[6].bitcast(Uint32)
        # Masks of the digits fixed so far (none when every valid key wins: last = -1).
        full = Uint32(ALL)
        hsh = Uint32(cutlass.min(Int32(RADIX_BITS) * (last + 1), Int32(31)))
        hm = Uint32(cutlass.select_(last >= 3, full, ~(full >> hsh)))
        hm = Uint32(cutlass.select_(last < 0, Uint32(0), hm))
        lsh = Uint32(cutlass.max(cutlass.min(Int32(RADIX_BITS) * (last - 3), Int32(31)), Int32(0)))
        lm = Uint32(cutlass.select_(last >= 7, full, ~(full >> lsh)))
        lm = Uint32(cutlass.select_(last < 4, Uint32(0), lm))
        for i in cutlass.range_constexpr(self.items):
            hi = khi[i]
            if const_expr(self.lean):
                # Only a key whose score word reaches the threshold can win: read its lo word.
                lo = Uint32(0)
                if (hi != Uint32(0)) & ((hi & hm) >= phi):
                    lo = slo[i * T + tid]
            else:
                lo = klo[i]
            mh = hi & hm
            ml = lo & lm
            valid = hi != Uint32(0)
            win = valid & ((mh > phi) | ((mh == phi) & (ml > plo)))
            tie = valid & (mh == phi) & (ml == plo)
            if tie:
                # Only ``need`` of the keys equal to the threshold prefix are taken.
                old = cute.arch.atomic_add(st.iterator + 4, Int32(1))
                win = old < need
            if win:
                slot = cute.arch.atomic_add(st.iterator + 3, Int32(1))
                if const_expr(self.sorted_):
                    skeys[slot] = (Uint64(hi) << Uint64(32)) | Uint64(lo)
                else:
                    out[obase + Int64(slot)] = (Uint32(ALL) - lo).bitcast(Int32)

        if const_expr(self.sorted_):
            P = const_expr(self.sort_size)
            cute.arch.sync_threads()
            # Pad [take, P) with the smallest key so that the padding sorts last.
            for j in cutlass.range(take + tid, P, T):
                skeys[j] = Uint64(0)
            cute.arch.sync_threads()
            # Bitonic sort, descending; every (size, stride) stage is unrolled at compile time.
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
                out[obase + Int64(j)] = (Uint32(ALL) - Uint32(key & Uint64(ALL))).bitcast(Int32)


@functools.lru_cache(maxsize=64)
def _compiled(
    world: int, kloc: int, k: int, sorted_: bool, tvm_ffi: bool, small: bool = True, variant: str = "regs",
    threads: int = 0, min_ctas: int = 0,
) -> Any:
    """Compile once per shape configuration (tracing takes milliseconds; launching microseconds)."""
    kern = StableTopKKernel(world, kloc, k, sorted_, small, variant, threads, min_ctas)
    cand = cute.runtime.make_fake_compact_tensor(Int64, (cute.sym_int64(),), assumed_align=8)
    out = cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int64(),), assumed_align=4)
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    opts = "--enable-tvm-ffi" if tvm_ffi else None
    if opts:
        return cute.compile(kern, cand, out, Int32(1), stream, options=opts)
    return cute.compile(kern, cand, out, Int32(1), stream)


def compile_to_ptx(
    world: int, kloc: int, k: int, sorted: bool, dump_dir: str, small: bool = True, variant: str = "regs",  # noqa: A002
) -> str:
    """Compile one configuration (uncached) and return its PTX text — the CPU CI check.

    Needs ``CUTE_DSL_ARCH=sm_90a`` in the environment (no GPU is needed); ``dump_dir`` must exist.
    """
    kern = StableTopKKernel(int(world), int(kloc), int(k), bool(sorted), bool(small), variant)
    cand = cute.runtime.make_fake_compact_tensor(Int64, (cute.sym_int64(),), assumed_align=8)
    out = cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int64(),), assumed_align=4)
    stream = cutlass.runtime.make_fake_stream()
    fn = cute.compile(kern, cand, out, Int32(1), stream, options=f"--keep-ptx --dump-dir={dump_dir}")
    ptx = fn.__ptx__ or ""
    if ptx and not ptx.lstrip().startswith("//") and os.path.exists(ptx):
        with open(ptx) as fh:  # some versions return the file path instead of the text
            ptx = fh.read()
    return ptx


def compile_stable_topk(
    world: int, kloc: int, k: int, sorted: bool = False, tvm_ffi: bool = False, small: bool = True,  # noqa: A002
    variant: str | None = None, config: tuple[int, int] | None = None,
) -> Any:
    """The compiled kernel for one configuration (cached). Works without a GPU (sm_90a).

    ``small``: the caller guarantees ``W*rows*K < 2**31`` (32-bit offsets). ``variant``:
    ``"regs"`` / ``"lean"`` (``None``: :func:`default_variant`). ``config``: ``(threads,
    min_ctas)`` override (benchmarking; threads a multiple of 32 in [256, 1024]).
    """
    if variant is None:
        variant = default_variant(world, kloc, k, sorted)
    threads, min_ctas = (0, 0) if config is None else (int(config[0]), int(config[1]))
    return _compiled(int(world), int(kloc), int(k), bool(sorted), bool(tvm_ffi), bool(small), variant, threads, min_ctas)


def stable_topk_cutedsl(
    gathered: torch.Tensor,
    k: int,
    sorted: bool = False,  # noqa: A002
    out: torch.Tensor | None = None,
    tvm_ffi: bool | None = None,
    validate: bool = False,
    variant: str | None = None,
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Launch the stable top-K on the all-gathered candidates (CUDA only).

    Args:
        gathered: float32 CUDA ``[W, rows, K, 2]`` (all-gather output), contiguous; or
            ``[rows, N, 2]`` (treated as ``W = 1``, ``K = N``).
        k: ``k >= 1``.  sorted: return ids in key order.
        out: optional int32 CUDA ``[rows, k]`` contiguous output buffer (CUDA-graph path: no
            allocation, no host synchronisation).
        tvm_ffi: force the TVM-FFI call path on/off (``None``: on when apache-tvm-ffi is there).
        validate: check the id values on the host first (one sync; ValueError as in the
            reference). Off by default: the hot path checks shapes/dtypes/devices only, and the
            kernel treats a negative id or a NaN score as invalid.
        variant: ``"regs"`` or ``"lean"`` (same result; see :class:`StableTopKKernel`);
            ``None``: :func:`default_variant` for the shape.
        config: ``(threads, min_ctas)`` override of the CTA configuration (benchmarking only).
    Returns:
        int32 ``[rows, k]`` (``out`` when given).
    """
    from dcp_ref._checks import check_int_scalar, check_tensor

    check_tensor(gathered, "gathered", dtypes=(torch.float32,), ndim=(3, 4))
    k = check_int_scalar(k, "k", min_value=1)
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
        raise ValueError(f"sorted=True supports min(k, W*K) <= {MAX_SORTED_WINNERS} in shared memory, got {min(k, world * kloc)}")
    if gathered.device.type != "cuda":
        raise ValueError(f"gathered must be a CUDA tensor for the CuTeDSL kernel, got device {gathered.device}")
    if not gathered.is_contiguous():
        raise ValueError("gathered must be contiguous (the kernel reads (score, id) pairs as 8-byte words)")
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=gathered.device)
    else:
        check_tensor(out, "out", dtypes=(torch.int32,), ndim=2)
        if tuple(out.shape) != (rows, k) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous int32 [{rows}, {k}] tensor, got shape {tuple(out.shape)}")
        if out.device != gathered.device:
            raise ValueError(f"out must be on {gathered.device}, got {out.device}")
    if validate:
        from dcp_ref.topk import check_candidate_ids

        check_candidate_ids(gathered[..., 1])
    if rows == 0:
        return out
    if world * kloc == 0:
        return out.fill_(-1)
    if gathered.data_ptr() % 8:
        raise ValueError("gathered must be 8-byte aligned")
    small = world * rows * kloc < 2**31
    ffi = _use_tvm_ffi() if tvm_ffi is None else bool(tvm_ffi)
    fn = compile_stable_topk(world, kloc, k, sorted, ffi, small, variant, config)
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
def _use_tvm_ffi() -> bool:
    """TVM-FFI call path: on when apache-tvm-ffi is importable, unless ``DCP_TOPK_TVM_FFI=0``."""
    if os.environ.get("DCP_TOPK_TVM_FFI", "1") in ("", "0"):
        return False
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True
