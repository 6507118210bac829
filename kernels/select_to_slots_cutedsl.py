"""CuTeDSL select-to-slots: all-gathered candidates → *this* rank's winners' KV slots, in one kernel.

The reference is :func:`dcp_ref.select_to_slots.select_to_slots` (contract, both orders, the poison rule).
This kernel is the stable top-K of :mod:`dcp_ref.kernels.topk_cutedsl` (one CTA per row, MSB-first radix
select over 64-bit keys ``hi`` = order-preserving score bits, ``lo`` = the bit-inverted tie-break) with a
different front and back end; :class:`SelectToSlotsKernel` subclasses
:class:`~dcp_ref.kernels.topk_cutedsl.StableTopKKernel` and reuses its radix passes and bin scan
(:meth:`~dcp_ref.kernels.topk_cutedsl.StableTopKKernel.radix_pass`,
:meth:`~dcp_ref.kernels.topk_cutedsl.StableTopKKernel.pick_bin`) unchanged.

**Front end** (:meth:`SelectToSlotsKernel.load_keys`): vectorised loads. ``order="rank_local"`` reads 4-byte
scores, four per 16-byte load (``K % 4 == 0``); the key's ``lo`` word is not loaded at all: it is the
candidate's position ``w*K + c`` in the gathered row, known from the thread and item index, so only the
``hi`` words live in registers (the "lean" layout without its shared-memory ``lo`` array).
``order="global_id"`` reads (score, id) pairs, two per 16-byte load (``K`` even), as the stable top-K builds
them. The first radix digit's histogram is counted while loading, as there.

**Back end** (:meth:`SelectToSlotsKernel.commit_owned_fast`, :meth:`SelectToSlotsKernel.commit_owned_general`):
the same threshold, but only this rank's winners are committed: ``(gid // I) % W == rank`` (``global_id``)
or ``rank*K <= position < (rank+1)*K`` (``rank_local``, whose local index is ``own_ids[t, position - rank*K]``,
prefetched into shared memory while the scores load). Each winner's slot is
``block_table[req_of_token[t], local // bs] * bs + local % bs`` (int64, then checked), written compacted
through a shared counter (warp-aggregated, ballot-ordered stores as in the stable top-K); then ``[count, k)``
is filled with ``-1`` and ``counts[t]`` written. Poison rule (the reference's, ``validate=False``): a winner
of this rank whose request id is outside ``[0, B)``, whose local index is negative or whose block is missing
(past the table or negative), or whose slot exceeds int32, gets :data:`~dcp_ref.select_to_slots.SENTINEL_SLOT`.

**Split** (:class:`SelectToSlotsKernel`, ``split=C``): with few rows most SMs idle, so a row may be spread over
a thread-block cluster of ``C`` CTAs whose histograms are summed through distributed shared memory each pass;
:func:`default_split` picks ``C`` from the measured table (a split pays only at <= 16 rows for ``rank_local``,
<= 33 rows for ``global_id``).

**Where the time goes, and what was measured** (H200, CUDA-graph replay, W = 8, K = k = 2048, 32 rows;
``benchmarks/results/exchange.md``). Today's chain (stable top-K 9.6 µs + deinterleave 3.3 µs) is 12.8 µs;
this kernel is 8.4 µs (``rank_local``) and 10.3 µs (``global_id``). Nsight Compute of the first version
(33.8k warp instructions per row, like the stable top-K's 34.0k): the commit was the largest phase (37 %)
because every thread scanned all its items — ``rank_local`` now scans only the chunks in this rank's slice
(warp-uniform skip), 9.9 -> 8.3 µs with the 11-bit first digit. What remains is latency, not work: with no
radix pass at all (every candidate but this rank's NaN) the kernel takes 4.9 µs (launch ~1 µs, the loads, the
commit), and the second radix pass costs ~2 µs of barriers and scans at 32 CTAs. Measured and not kept as
defaults: 12-bit first digits, the cluster split beyond the small row counts above (the cluster barriers and
histogram merges cost more than the 1/C of the work saves). A warp-vote form of the radix passes' per-key loop
(one ``vote.any`` per item, then a branch-free count) measured equal or slower at every shape
(``benchmarks/results/exchange.json``, ``sweep``) and was deleted. ``rank_local`` reads 4 bytes per candidate
(half the wire bytes and a quarter of the load instructions), and both orders replace two launches with one.

``W``, ``K``, ``k``, ``I``, ``bs``, the index dtypes and the CTA shape are compile-time constants
(:class:`SelectToSlotsConfig`, the compile cache key); ``rows``, ``rank``, ``B``, ``M`` and the strides of
``req_of_token`` / ``block_table`` / ``own_ids`` are runtime arguments. The wrapper
(:func:`select_to_slots_cutedsl`) refuses exactly what the reference refuses, with its messages (the shared
:func:`dcp_ref.select_to_slots.check_select_to_slots_inputs`), then with ``out_slots`` / ``out_counts`` given
and ``validate=False`` allocates nothing and reads nothing on the host (CUDA-graph capturable). Compilation
runs under :data:`dcp_ref.kernels._launch.KERNEL_LOCK` (CuTeDSL compiles are not thread-safe).

**Validated call** (``validate=True``): the shape checks, then the values **inside the select kernel itself**
(``check=True``, one CTA per row): each id ``-1``, NaN or an integer in ``[0, 2**24)`` and no id twice in the
row (:meth:`SelectToSlotsKernel.hash_ids`: a shared-memory hash table of the row's ids, ``atom.shared.cas``
— filled only for a row whose ids are not laid out as the indexer packs them, owned by their slice's rank and
strictly ascending before the padding, which rules duplicates out by itself: :meth:`SelectToSlotsKernel.load_keys`),
``own_ids`` (:meth:`SelectToSlotsKernel.check_own`: a block-wide max scan), the request ids and every winner's
block (the poison rule's test) — exactly what the reference refuses, no more — raising the shared per-stream
flag (:func:`~dcp_ref.kernels._util.check_flag`), then one host read of it. Only a raised flag runs the
reference's check (which names the exact culprit) after clearing the flag. Where the kernel cannot check — a
hash table of ``2*W*K`` entries beyond one CTA's shared memory (``global_id`` with ``W*K > 16384``), or a
cluster split the caller forces — a small Triton kernel checks the values instead, before the select
(:func:`select_check_kernel`: the same checks, but the block of *every* candidate of this rank, so a losing
candidate without a block is a false alarm the reference's check then clears). Measured on the H200 before the
in-kernel checks: the second launch cost 37-82 µs of host time per validated call (``profile_validation.py``).

Limits: ``W*K <= 32768`` candidates per row (as the stable top-K: at most 32 keys per thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
import triton
import triton.language as tl
from cutlass import Boolean, Float32, Int32, Int64, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from dcp_ref.contracts import check_bool, check_values_readable, triton_interpreting
from dcp_ref.geometry import DcpGeometry
from dcp_ref.select_to_slots import ORDERS, SENTINEL_SLOT, SelectToSlotsInputs, check_select_to_slots_inputs
from dcp_ref.topk import MAX_EXACT_ID

from ._launch import KERNEL_LOCK
from ._util import cdiv, check_flag, compiled_artifacts, next_pow2, raise_if_flagged
from .topk_cutedsl import (
    FIRST_BITS,
    MASK32,
    MAX_CANDIDATES,
    StableTopKKernel,
    State,
    default_variant,
    digit_schedule,
    launch_per_row,
    lean_config,
    threads_for,
    use_tvm_ffi,
)

__all__ = [
    "SPLITS",
    "H200_SMS",
    "split_threads",
    "default_split",
    "dsmem_load",
    "dsmem_atomic_add",
    "SelectToSlotsConfig",
    "SelectToSlotsKernel",
    "rank_local_schedule",
    "make_config",
    "compile_select_to_slots",
    "compile_to_ptx",
    "compile_artifacts",
    "cubin_resources",
    "select_check_kernel",
    "check_select_to_slots_values",
    "select_to_slots_cutedsl",
]

_INT32_MAX = 2**31 - 1
#: A free entry of the in-kernel check's hash table (ids are below ``2**24``).
EMPTY_ID = 0xFFFFFFFF
#: Shared-state word (beyond :class:`State`'s) raised when a row's ids break the no-duplicates rule that spares the
#: hash table (:meth:`SelectToSlotsKernel.load_keys`): then the row's ids go through it.
HASH_NEEDED = 11
#: CTAs per row of the split form (a thread-block cluster; 8 is the portable maximum).
SPLITS = (1, 2, 4, 8)
#: Streaming multiprocessors of the H200 (the split default fills them when rows are few).
H200_SMS = 132


def split_threads(n: int, split: int, vec: int) -> int:
    """Default CTA size of the split form: 512 threads (measured best on the H200 at 1 and 32 rows, W = 8,
    K = 2048), or 1024 where 512 would leave more than 32 keys per thread."""
    chunks = n // (vec * split)
    return 512 if cdiv(chunks, 512) * vec <= 32 else 1024


def default_split(rows: int, n: int, vec: int, order: str = "rank_local") -> int:
    """CTAs per row when the caller gives none: the largest ``C`` of 8, 4, 2 with at least 512 vector loads per
    CTA (``n / vec / C >= 512``) and at most 66 CTAs in all (``rows * C <= 66``, half the H200's SMs); for
    ``rank_local`` only up to 16 rows. Else 1.

    Measured on the H200 (K = k = 2048, ``--sweep`` of ``benchmarks/bench_exchange.py`` and the split table in
    ``benchmarks/results/exchange.md``): a cluster per row pays only while a few rows leave most SMs idle and
    each CTA keeps enough loads — e.g. ``rank_local`` 1 row W = 8: 7.2 µs (split 8) against 7.9 (1); 16 rows:
    7.4 (4) against 8.2 (1) and 8.9 (8); 32 rows: 8.3 (1) against 9.3 (2); ``global_id`` 32 rows: 9.8 (2)
    against 10.7 (1); from 128 rows a split was 13-27 % slower. The split must divide the ``n / vec`` loads.
    """
    chunks = n // vec
    if order == "rank_local" and rows > 16:
        return 1
    for c in (8, 4, 2):
        if chunks // c >= 512 and rows * c <= H200_SMS // 2 and chunks % c == 0:
            return c
    return 1


def rank_local_schedule(first_bits: int, n: int) -> tuple[tuple[int, int, int], ...]:
    """The radix passes of ``order="rank_local"``: the score word as :func:`digit_schedule`, then only the
    ``LB`` low bits of the tie-break word.

    There the tie-break is the position ``p < n`` itself: ``lo = (2**LB - 1) - p`` with
    ``LB = max(5, bit_length(n - 1))``, so the word's top ``32 - LB`` bits are zero in every key and need no
    pass (a tie at the threshold costs at most two passes over positions instead of four over an id word).
    The ``LB`` bits are cut into as few near-equal digits of 5..9 bits as possible (every digit needs
    ``>= 32`` bins: the scan hands bins to whole warps).
    """
    score = tuple(d for d in digit_schedule(first_bits) if d[0] == 0)
    lb = max(5, (max(n, 1) - 1).bit_length())
    parts = max(1, min(cdiv(lb, 8), lb // 5))
    widths = [lb // parts + (1 if r < lb % parts else 0) for r in range(parts)]
    lo, top = [], lb
    for b in widths:
        top -= b
        lo.append((1, top, b))
    return score + tuple(lo)


@dataclass(frozen=True)
class SelectToSlotsConfig:
    """One compiled configuration of :class:`SelectToSlotsKernel` (the compile cache key).

    Attributes:
        order: ``"global_id"`` (``(score, id)`` pairs) or ``"rank_local"`` (scores only).
        world, kloc, k: ``W`` ranks, ``K`` candidates each, ``k`` global winners.
        interleave, block_size: the geometry's ``I`` and KV block size (``rank`` is a runtime argument).
        vec: candidates per vector load: 1, 2 or 4 (``rank_local``), 1 or 2 (``global_id``); ``K % vec == 0``.
        variant: ``"lean"`` / ``"regs"`` (``global_id``: where the id words live, as in the stable top-K);
            ``rank_local`` is always ``"lean"`` (its tie-break words are computed, never stored).
        has_req: ``req_of_token`` given (else row ``t`` is request ``t``).
        req_int64, bt_int64: ``req_of_token`` / ``block_table`` are int64 (else int32).
        small: every flat offset fits int32 (32-bit address arithmetic).
        threads, min_ctas: CTA size (0: by shape) and ptxas' ``minctasm`` register cap (-1: by shape, 0: none).
        first_bits: width of the first radix digit (:data:`~dcp_ref.kernels.topk_cutedsl.FIRST_BITS`).
        tvm_ffi: compiled for the TVM-FFI call path.
        split: CTAs per row, a thread-block cluster (1, 2, 4 or 8; it must divide the ``W*K/vec`` vector loads
            of a row). See :class:`SelectToSlotsKernel`.
        check: the validated call's value checks inside this kernel (:meth:`SelectToSlotsKernel.hash_ids`,
            :meth:`SelectToSlotsKernel.check_own`, the request ids and every winner's block), raising the
            ``flag`` argument; ``split`` must be 1 (a row's ids meet in one CTA's hash table). See
            :func:`check_fits`.
    """

    order: str
    world: int
    kloc: int
    k: int
    interleave: int = 1
    block_size: int = 1
    vec: int = 1
    variant: str = "lean"
    has_req: bool = True
    req_int64: bool = False
    bt_int64: bool = False
    small: bool = True
    threads: int = 0
    min_ctas: int = -1
    first_bits: int = 8
    tvm_ffi: bool = False
    split: int = 1
    check: bool = False

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        for name in ("world", "kloc", "k", "interleave", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.world * self.kloc > MAX_CANDIDATES:
            raise ValueError(f"world * kloc must be <= {MAX_CANDIDATES}, got {self.world * self.kloc}")
        vecs = (1, 2, 4) if self.order == "rank_local" else (1, 2)
        if self.vec not in vecs or self.kloc % self.vec:
            raise ValueError(f"vec must be one of {vecs} and divide kloc={self.kloc}, got {self.vec}")
        if self.variant not in ("regs", "lean") or (self.order == "rank_local" and self.variant != "lean"):
            raise ValueError(f"variant must be 'lean' or 'regs' ('lean' for rank_local), got {self.variant!r}")
        if self.first_bits not in FIRST_BITS:
            raise ValueError(f"first_bits must be one of {FIRST_BITS}, got {self.first_bits!r}")
        if self.block_size % self.interleave:
            raise ValueError(f"block_size must be a multiple of interleave, got {self.block_size}, {self.interleave}")
        if self.split not in SPLITS or (self.world * self.kloc // self.vec) % self.split:
            raise ValueError(
                f"split must be one of {SPLITS} and divide the {self.world * self.kloc // self.vec} vector loads "
                f"of a row, got {self.split!r}"
            )
        if not isinstance(self.check, bool):
            raise TypeError(f"check must be a bool, got {type(self.check).__name__}")
        if self.check and self.split != 1:
            raise ValueError(f"check needs split=1 (a row's ids meet in one CTA), got split={self.split}")
        if self.threads:
            t = self.threads
            if t < 256 or t > 1024 or t & (t - 1):
                raise ValueError(f"threads must be a power of two in [256, 1024], got {t}")
            per_thread = cdiv(self.world * self.kloc, self.vec * self.split * t) * self.vec
            if per_thread > 32:
                raise ValueError(f"threads={t} leaves {per_thread} keys per thread: at most 32 fit (use more threads)")


def _shared_word_asm(smem_ptr: Any, ptx: str, constraints: str, operands: list, loc: Any, ip: Any) -> Any:
    """One inline-PTX instruction on the 32-bit shared-memory word at ``smem_ptr`` (its 32-bit address is
    operand ``$1``, ``operands`` follow): the ``i32`` result ``$0``, kept in place (side effects)."""
    addr = llvm.ptrtoint(T.i32(), smem_ptr.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    return llvm.inline_asm(
        T.i32(),
        [addr, *operands],
        ptx,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def dsmem_load(smem_ptr: Any, cta_rank: Any, *, loc: Any = None, ip: Any = None) -> Int32:
    """``ld.shared::cluster`` of the 32-bit word at ``smem_ptr`` in the shared memory of cluster CTA ``cta_rank``."""
    ptx = "{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, $1, $2;\n\tld.shared::cluster.u32 $0, [ra];\n\t}"
    return Int32(_shared_word_asm(smem_ptr, ptx, "=r,r,r", [Int32(cta_rank).ir_value(loc=loc, ip=ip)], loc, ip))


@dsl_user_op
def dsmem_atomic_add(smem_ptr: Any, cta_rank: Any, val: Any, *, loc: Any = None, ip: Any = None) -> Int32:
    """``atom.shared::cluster.add`` on the 32-bit word at ``smem_ptr`` of cluster CTA ``cta_rank``; the old value."""
    ptx = (
        "{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, $1, $2;\n\tatom.shared::cluster.add.u32 $0, [ra], $3;\n\t}"
    )
    ops = [Int32(cta_rank).ir_value(loc=loc, ip=ip), Int32(val).ir_value(loc=loc, ip=ip)]
    return Int32(_shared_word_asm(smem_ptr, ptx, "=r,r,r,r", ops, loc, ip))


@dsl_user_op
def smem_cas(smem_ptr: Any, cmp: Any, val: Any, *, loc: Any = None, ip: Any = None) -> Uint32:
    """``atom.shared.cas.b32`` on the 32-bit word at ``smem_ptr`` of this CTA: the old value (``val`` is stored
    where it equalled ``cmp``)."""
    ops = [Uint32(cmp).ir_value(loc=loc, ip=ip), Uint32(val).ir_value(loc=loc, ip=ip)]
    return Uint32(_shared_word_asm(smem_ptr, "atom.shared.cas.b32 $0, [$1], $2, $3;", "=r,r,r,r", ops, loc, ip))


@cute.jit
def cluster_sync() -> None:
    """All threads of every CTA of the cluster: ``barrier.cluster.arrive`` (release) + ``wait`` (acquire)."""
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


class SelectToSlotsKernel(StableTopKKernel):
    """The stable top-K's selection with an owner-local commit straight to slots (module docstring).

    Reused from :class:`~dcp_ref.kernels.topk_cutedsl.StableTopKKernel`: the radix passes
    (:meth:`radix_pass`), the bin scan (:meth:`pick_bin`) and, for ``global_id``, the ``lo`` word storage
    (:meth:`key_lo`). New: the kernel body, the vectorised :meth:`load_keys`, the ``rank_local`` tie-break
    (:meth:`key_lo` computes it), the ownership test and the slot mapping in the two commits, and the split
    form's passes (:meth:`radix_pass_s2s`).

    Register layout: item ``i = ci*vec + s`` of thread ``tid`` is candidate ``p = pbase + vec*(ci*T + tid) + s``
    of the row (``ci < cpt`` vector loads per thread; ``pbase = 0`` unless split).

    **Split** (``split = C > 1``): a cluster of ``C`` CTAs per row, CTA ``c`` holding chunks
    ``[c*NC/C, (c+1)*NC/C)`` (``pbase = vec*c*NC/C``), so that a few rows still occupy ``C`` times as many SMs
    and each CTA's load / histogram / commit work is ``1/C`` of the row's. Each pass counts into a local
    histogram (``hloc``), then after a cluster barrier every CTA sums the ``C`` local histograms through
    distributed shared memory into its own ``hist`` and runs the unchanged bin scan on it: every CTA reaches
    the same threshold, with no broadcast. The output counter (and the tie counter) live in CTA 0's shared
    memory (``atom.shared::cluster``); a last cluster barrier keeps CTA 0 alive until all have read the count.
    """

    def __init__(self, cfg: SelectToSlotsConfig) -> None:
        rank_local = cfg.order == "rank_local"
        n = cfg.world * cfg.kloc
        split = cfg.split
        threads, min_ctas = cfg.threads, cfg.min_ctas
        if not threads:
            if split > 1:
                threads, cap = split_threads(n, split, cfg.vec), 0
            else:
                threads, cap = lean_config(n) if cfg.variant == "lean" else (threads_for(n), 0)
            if min_ctas < 0:
                min_ctas = cap
        elif min_ctas < 0:
            min_ctas = 0
        super().__init__(cfg.world, cfg.kloc, cfg.k, False, cfg.small, cfg.variant, threads, min_ctas, cfg.first_bits)
        self.cfg = cfg
        self.split = split
        self.rank_local = rank_local
        self.vec = cfg.vec
        self.wpl = cfg.vec * (1 if rank_local else 2)  # 32-bit words per vector load
        self.nchunks = n // cfg.vec  # vector loads per row
        self.ncc = self.nchunks // split  # vector loads per CTA (split divides nchunks)
        self.kq = cfg.kloc // cfg.vec  # vector loads per rank's slice
        self.cpt = (self.ncc + self.threads - 1) // self.threads  # vector loads per thread
        self.items = self.cpt * cfg.vec
        # The ownership flags of a thread's items travel as one 32-bit mask through the fast commit.
        assert self.items <= 32, (self.items, self.threads)
        self.lean = cfg.variant == "lean" and not rank_local  # lo words in shared memory (global_id only)
        self.lo_size = self.items * self.threads if self.lean else 1
        self.own_per_thread = (cfg.kloc + self.threads - 1) // self.threads if rank_local else 1
        self.own_size = cfg.kloc if rank_local else 1
        if rank_local:
            self.schedule = rank_local_schedule(cfg.first_bits, n)
            self.lo_bits = max(5, (max(n, 1) - 1).bit_length())
            self.schedule_bins = tuple(1 << b for _, _, b in self.schedule)
            self.max_bins = max(self.schedule_bins)
            assert min(self.schedule_bins) >= 32, self.schedule
            self.hist_stride = self.max_bins + 32
        self.hloc_size = 2 * self.hist_stride if split > 1 else 1
        # check (global_id): a hash table of every valid id of the row, at most half full, so that an insert
        # always finds a free entry (no probe limit, no false alarm from a full table).
        self.check = cfg.check
        self.hash_bits = max(5, (2 * n - 1).bit_length())
        self.hash_size = 1 << self.hash_bits if cfg.check and not rank_local else 1

    def smem_bytes(self) -> int:
        """Shared memory this configuration allocates (each array 16-byte aligned)."""
        words = (2 * self.hist_stride, 32, State.WORDS, self.lo_size, self.own_size, self.hloc_size, self.hash_size)
        return sum(-(-4 * w // 16) * 16 for w in words)

    @cute.jit
    def __call__(
        self,
        cand: cute.Tensor,
        req: cute.Tensor,
        bt: cute.Tensor,
        own: cute.Tensor,
        slots: cute.Tensor,
        counts: cute.Tensor,
        flag: cute.Tensor,
        rows: Int32,
        rank: Int32,
        n_req: Int32,
        n_blocks: Int32,
        req_s: Int64,
        bt_s0: Int64,
        bt_s1: Int64,
        own_s0: Int64,
        own_s1: Int64,
        stream: Any,
    ) -> None:
        args = (
            cand, req, bt, own, slots, counts, flag, rows, rank, n_req, n_blocks, req_s, bt_s0, bt_s1, own_s0, own_s1,
        )  # fmt: skip
        launch_per_row(self.s2s_kernel(*args), rows, self.threads, self.split, self.min_ctas, stream)

    @cute.kernel
    def s2s_kernel(
        self,
        cand: cute.Tensor,
        req: cute.Tensor,
        bt: cute.Tensor,
        own: cute.Tensor,
        slots: cute.Tensor,
        counts: cute.Tensor,
        flag: cute.Tensor,
        rows: Int32,
        rank: Int32,
        n_req: Int32,
        n_blocks: Int32,
        req_s: Int64,
        bt_s0: Int64,
        bt_s1: Int64,
        own_s0: Int64,
        own_s1: Int64,
    ) -> None:
        """One CTA (or one cluster) per row: request + own ids in flight, keys + pass 0, radix passes, owned
        commit, ``-1`` tail and count. ``check``: the values checked on the way, ``flag[0] = 1`` (int64) where the
        reference's value checks refuse the row (written only then)."""
        T = const_expr(self.threads)
        C = const_expr(self.split)
        KSEL = const_expr(self.k)
        KL = const_expr(self.kloc)
        tid, lane, warp, row, crank = self.cta_coords()
        pbase = crank * (self.ncc * self.vec)  # first candidate position of this CTA's chunks

        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(2 * self.hist_stride), byte_alignment=16)
        wsum = smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)
        # The selection's state, as the top-K's (class State names the words); its output counter counts this
        # rank's winners.
        st = smem.allocate_tensor(Int32, cute.make_layout(State.WORDS), byte_alignment=16)
        slo = smem.allocate_tensor(Uint32, cute.make_layout(self.lo_size), byte_alignment=16)
        sown = smem.allocate_tensor(Int32, cute.make_layout(self.own_size), byte_alignment=16)
        # split: this CTA's own histograms (two buffers), read by the whole cluster
        hloc = smem.allocate_tensor(Int32, cute.make_layout(self.hloc_size), byte_alignment=16)
        # check (global_id): the row's valid ids, EMPTY_ID where free
        htab = smem.allocate_tensor(Uint32, cute.make_layout(self.hash_size), byte_alignment=16)
        self.clear_state(st, hist, hloc, tid)
        if const_expr(self.hash_size > 1):
            for x in cutlass.range(tid, self.hash_size, T):
                htab[x] = Uint32(EMPTY_ID)

        # The request of this row and (rank_local) this row's own local indices: loads issued first, so
        # their latency hides behind the score loads; used only by the commit.
        req_row = Int64(row)
        if const_expr(self.cfg.has_req):
            req_row = Int64(req[Int64(row) * req_s])
        req_ok = (req_row >= Int64(0)) & (req_row < Int64(n_req))
        bad = Int32(0)  # check: this thread found a value the reference may refuse
        if const_expr(self.check and self.cfg.has_req):
            bad = Int32(cutlass.select_(req_ok, Int32(0), Int32(1)))
        bt_row = Int64(cutlass.select_(req_ok, req_row, Int64(0))) * bt_s0
        oreg = cute.make_rmem_tensor((self.own_per_thread,), Int32)
        if const_expr(self.rank_local):
            for u in cutlass.range_constexpr(self.own_per_thread):
                c = u * T + tid
                cc = c
                if const_expr((u + 1) * T > KL):
                    cc = Int32(cutlass.select_(c < KL, c, Int32(0)))  # in bounds; never stored below
                oreg[u] = Int32(own[Int64(row) * own_s0 + Int64(cc) * own_s1])
        cute.arch.sync_threads()

        khi = cute.make_rmem_tensor((self.items,), Uint32)
        klo = cute.make_rmem_tensor((self.items if const_expr(not self.lean and not self.rank_local) else 1,), Uint32)
        hashing = const_expr(self.check and not self.rank_local)
        cid = cute.make_rmem_tensor((self.items if hashing else 1,), Uint32)  # check: the items' integer ids
        pend = Uint32(0)  # check: the items whose id goes into the hash table, if the row needs it
        if const_expr(C > 1):
            self.load_keys(cand, rows, row, tid, khi, klo, slo, hloc, cid, crank)
        else:
            found, pend, unordered = self.load_keys(cand, rows, row, tid, khi, klo, slo, hist, cid, crank)
            bad = bad + found
            if const_expr(hashing):
                if unordered != Int32(0):
                    st[HASH_NEEDED] = Int32(1)  # any of the CTA's threads (the same value): read after the barrier
        if const_expr(self.rank_local):
            for u in cutlass.range_constexpr(self.own_per_thread):
                c = u * T + tid
                if c < KL:
                    sown[c] = oreg[u]
        if const_expr(C > 1):
            cluster_sync()  # every CTA's pass-0 histogram is complete
            self.merge(0, hloc, hist, tid)
        cute.arch.sync_threads()
        if const_expr(hashing):
            if st[HASH_NEEDED] != Int32(0):  # the same word for every thread: the CTA takes one branch
                bad = bad + self.hash_ids(cid, pend, htab)
        if const_expr(self.check and self.rank_local):
            bad = bad + self.check_own(khi, sown, wsum, tid, lane, warp, rank * KL)
        if const_expr(self.check):
            if bad != Int32(0):
                flag[0] = Int64(1)

        self.start_selection(st, hist, tid)
        cute.arch.sync_threads()

        for d in cutlass.range_constexpr(len(self.schedule)):
            if const_expr(C > 1):
                self.radix_pass_s2s(d, khi, klo, slo, hist, hloc, wsum, st, tid, lane, warp, pbase)
            else:
                self.radix_pass(d, khi, klo, slo, hist, wsum, st, tid, lane, warp)  # the stable top-K's

        need = st[State.NEED]
        phi = st[State.PREFIX_HI].bitcast(Uint32)
        plo = st[State.PREFIX_LO].bitcast(Uint32)
        hm = st[State.MASK_HI].bitcast(Uint32)
        lm = st[State.MASK_LO].bitcast(Uint32)
        if const_expr(self.small):
            obase = row * KSEL
        else:
            obase = Int64(row) * Int64(KSEL)
        rbase = rank * KL  # rank_local: this rank's slice of the row starts here
        ctx = (req_ok, bt_row, bt, bt_s1, n_blocks, flag)
        if (st[State.DONE] != 0) & (lm == Uint32(0)):
            self.commit_owned_fast(phi, khi, klo, slo, sown, st, slots, obase, tid, lane, warp, rank, rbase, pbase, ctx)
        else:
            self.commit_owned_general(
                need, phi, plo, hm, lm, khi, klo, slo, sown, st, slots, obase, tid, warp, rank, rbase, pbase, ctx
            )
        # The -1 tail after this rank's winners, and the count (emptiness is a count of zero).
        if const_expr(C > 1):
            cluster_sync()  # every CTA's winners are counted in CTA 0's output counter
            count = dsmem_load(st.iterator + State.COUNT, 0)
            cluster_sync()  # CTA 0's shared memory has been read: it may exit
            for j in cutlass.range(count + crank * T + tid, KSEL, C * T):
                slots[obase + j] = Int32(-1)
            if (tid == 0) & (crank == 0):
                counts[row] = count
        else:
            cute.arch.sync_threads()
            count = st[State.COUNT]
            for j in cutlass.range(count + tid, KSEL, T):
                slots[obase + j] = Int32(-1)
            if tid == 0:
                counts[row] = count

    @cute.jit
    def cta_coords(self) -> tuple[Int32, Int32, Int32, Int32, Int32]:
        """``(tid, lane, warp, row, crank)``: this thread, its row (one CTA or one cluster of ``split`` CTAs per
        row) and its CTA's rank in the cluster (0 when not split)."""
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32
        row = bid
        crank = Int32(0)
        if const_expr(self.split > 1):
            row = bid // self.split
            crank = cute.arch.block_idx_in_cluster()
        return tid, lane, warp, row, crank

    @cute.jit
    def clear_state(self, st: cute.Tensor, hist: cute.Tensor, hloc: cute.Tensor, tid: Int32) -> None:
        """Zero the shared state and pass 0's histogram with its dummy bin (``hloc``, the CTA's own, when split;
        the caller's barrier follows)."""
        if tid < State.WORDS:
            st[tid] = Int32(0)
        for x in cutlass.range(tid, self.schedule_bins[0] + 1, self.threads):
            if const_expr(self.split > 1):
                hloc[x] = Int32(0)
            else:
                hist[x] = Int32(0)

    @cute.jit
    def start_selection(self, st: cute.Tensor, hist: cute.Tensor, tid: Int32) -> Int32:
        """After pass 0's (merged) histogram: the valid keys are all but those in its dummy bin; publish how many
        win (``NEED``) and whether every valid key does (``DONE``). Returns that count, ``min(k, valid)``."""
        n_valid = Int32(self.split * self.items * self.threads) - hist[self.schedule_bins[0]]
        take = cutlass.min(n_valid, Int32(self.k))
        if tid == 0:
            st[State.NEED] = take
            st[State.DONE] = Int32(n_valid <= self.k)  # every valid key wins: no selection needed
        return take

    @cute.jit
    def merge(self, d: int, hloc: cute.Tensor, hist: cute.Tensor, tid: Int32) -> None:
        """Split: ``hist`` = the sum over the cluster of every CTA's ``hloc`` for pass ``d`` (its bins and its
        dummy bin), read through distributed shared memory; and this CTA's ``hloc`` buffer of pass ``d+1``
        cleared (every CTA finished reading it in pass ``d-1``, before arriving at this pass's barrier)."""
        NB = const_expr(self.schedule_bins[d])
        NBN = const_expr(self.schedule_bins[d + 1] if d + 1 < len(self.schedule) else 0)
        cur = const_expr((d % 2) * self.hist_stride)
        nxt = const_expr(((d + 1) % 2) * self.hist_stride)
        for x in cutlass.range(tid, NB + 1, self.threads):
            total = Int32(0)
            for c in cutlass.range_constexpr(self.split):
                total = total + dsmem_load(hloc.iterator + (cur + x), c)
            hist[cur + x] = total
        for x in cutlass.range(tid, NBN + 1 if NBN else 0, self.threads):
            hloc[nxt + x] = Int32(0)

    @cute.jit
    def radix_pass_s2s(
        self,
        d: int,
        khi: cute.Tensor,
        klo: cute.Tensor,
        slo: cute.Tensor,
        hist: cute.Tensor,
        hloc: cute.Tensor,
        wsum: cute.Tensor,
        st: cute.Tensor,
        tid: Int32,
        lane: Int32,
        warp: Int32,
        pbase: Int32,
    ) -> None:
        """Pass ``d`` of the split form (``split > 1``, :class:`SelectToSlotsConfig`) as :meth:`radix_pass`: the
        same per-key loop, the same histogram, the same bin scan (:meth:`pick_bin`), but the count goes into this
        CTA's ``hloc``; after a cluster barrier :meth:`merge` sums the cluster's counts into ``hist``. Every CTA
        of the cluster holds the same state, so all take (or skip, once done) the same passes and barriers.
        """
        word = const_expr(self.schedule[d][0])
        sh = const_expr(self.schedule[d][1])
        NB = const_expr(self.schedule_bins[d])
        bits_above = const_expr(sh + self.schedule[d][2])
        before = const_expr((MASK32 << bits_above) & MASK32 if bits_above < 32 else 0)
        cur = const_expr((d % 2) * self.hist_stride)
        target = hist
        if const_expr(self.split > 1):
            target = hloc
        done = st[State.DONE]
        if done == 0:
            need = st[State.NEED]
            phi = st[State.PREFIX_HI].bitcast(Uint32)
            plo = st[State.PREFIX_LO].bitcast(Uint32)
            if const_expr(d > 0):  # pass 0 was counted while loading (and merged)
                for i in cutlass.range_constexpr(self.items):
                    hi = khi[i]
                    if const_expr(word == 0):
                        match = (hi != Uint32(0)) & ((hi & Uint32(before)) == phi)
                        if match:
                            digit = Int32((hi >> Uint32(sh)) & Uint32(NB - 1))
                            cute.arch.atomic_add(target.iterator + cur + digit, Int32(1))
                    else:
                        # Tie-break passes: only keys whose score word equals the threshold.
                        mhi = (hi != Uint32(0)) & (hi == phi)
                        if mhi:
                            lo = self.key_lo_at(klo, slo, i, tid, pbase)
                            mlo = Boolean(True)
                            if const_expr(before != 0):
                                mlo = (lo & Uint32(before)) == plo
                            if mlo:
                                digit = Int32((lo >> Uint32(sh)) & Uint32(NB - 1))
                                cute.arch.atomic_add(target.iterator + cur + digit, Int32(1))
                if const_expr(self.split > 1):
                    cluster_sync()
                    self.merge(d, hloc, hist, tid)
                cute.arch.sync_threads()
            self.pick_bin(d, need, phi, plo, hist, wsum, st, tid, lane, warp)

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
        cid: cute.Tensor,
        crank: Int32,
    ) -> tuple[Int32, Uint32, Int32]:
        """Vector-load this thread's candidates as keys and count pass 0's histogram on the way; with ``check``
        (``global_id``) also check their ids: each ``-1``, NaN or an integer in ``[0, 2**24)`` (``check_candidate_ids``'
        rule), and prepare the no-duplicates check. Returns ``(bad, pend, unordered)``: how many ids the check
        refuses; the items whose integer id (in ``cid``) the hash table would take (:meth:`hash_ids`); how many
        integer ids break the rule that rules duplicates out without it — every integer id owned by its slice's
        rank (``(id // I) % W == w``: the slices of two ranks share no id) and, from the slice's first candidate
        on, above the integer id just before it (so strictly ascending within the slice: no id twice). The
        indexer writes exactly that (its winners by increasing local index, then ``-1`` padding), so a good row
        never fills the table; any other row does, and the table is exact either way. All 0 without ``check``.

        Vector load ``ci`` of thread ``tid`` is chunk ``q = crank*NCC + ci*T + tid`` of the row: ``vec``
        consecutive candidates of one rank's slice (``K % vec == 0``), at word offset
        ``((w*rows + row)*K/vec + cq)*wpl``. A chunk past the CTA's share is loaded from offset 0 (in bounds)
        and masked invalid (``hi = 0``). Keys as in the stable top-K: ``hi`` the order-preserving score bits
        with ``-0.0`` made ``+0.0``, ``0`` when invalid (NaN score, or for ``global_id`` a negative / NaN id);
        ``lo = 0xFFFFFFFF - id`` (``global_id``; stored as the variant says) or computed from the position
        (``rank_local``, :meth:`key_lo`). ``hist`` is the CTA's pass-0 histogram (``hloc`` when split).
        """
        T = const_expr(self.threads)
        NCC = const_expr(self.ncc)
        KQ = const_expr(self.kq)
        VEC = const_expr(self.vec)
        WPL = const_expr(self.wpl)
        SH0 = const_expr(self.schedule[0][1])
        NB0 = const_expr(self.schedule_bins[0])
        # The flat words as [chunks, WPL]: a chunk is one aligned WPL-word vector load.
        words = cute.make_tensor(cand.iterator, cute.make_layout((1 << 30, WPL), stride=(WPL, 1)))
        bad = Int32(0)
        hashing = const_expr(self.check and not self.rank_local)
        pend = Uint32(0)  # check: the items whose id goes into the hash table
        unordered = Int32(0)  # check: integer ids that break the no-duplicates rule (docstring)
        for ci in cutlass.range_constexpr(self.cpt):
            ql = ci * T + tid  # chunk index within this CTA's share
            inb = Boolean(True)
            if const_expr((ci + 1) * T > NCC):
                inb = ql < NCC
            w, cq = self.chunk_coords(ci, tid, crank)
            if const_expr(self.small):
                off = (w * rows + row) * KQ + cq
                if const_expr((ci + 1) * T > NCC):
                    off = Int32(cutlass.select_(inb, off, Int32(0)))
            else:
                off = (Int64(w) * Int64(rows) + Int64(row)) * Int64(KQ) + Int64(cq)
                if const_expr((ci + 1) * T > NCC):
                    off = Int64(cutlass.select_(inb, off, Int64(0)))
            v = words[off, None].load()
            # check: the id before this chunk's first candidate in its slice (the last of chunk cq - 1), if any
            pidf = Float32(-1.0)
            if const_expr(hashing):
                if inb & (cq > 0):
                    pidf = words[off - 1, WPL - 1].bitcast(Float32)
            for s in cutlass.range_constexpr(VEC):
                i = ci * VEC + s
                if const_expr(self.rank_local):
                    sb = v[s].bitcast(Uint32)
                    ok = inb
                else:
                    sb = v[2 * s].bitcast(Uint32)
                    idf = v[2 * s + 1].bitcast(Float32)
                    ok = inb & (idf >= Float32(0.0))
                    if const_expr(hashing):
                        integral = (idf >= Float32(0.0)) & (idf < Float32(MAX_EXACT_ID)) & (Float32(Int32(idf)) == idf)
                        fine = integral | (idf == Float32(-1.0)) | (idf != idf)  # check_candidate_ids' rule
                        bad = bad + Int32(cutlass.select_(inb & ~fine, Int32(1), Int32(0)))
                        cid[i] = Uint32(Int32(idf))
                        pend = pend | Uint32(cutlass.select_(inb & integral, Uint32(1 << i), Uint32(0)))
                        # the no-duplicates rule (docstring): owned by slice w, above the integer id before it
                        owned = (Int32(idf) // self.cfg.interleave) % self.cfg.world == w
                        p_int = (pidf >= Float32(0.0)) & (Float32(Int32(pidf)) == pidf)  # an id < 2**24 before
                        rising = p_int & (pidf < idf)
                        if const_expr(s == 0):
                            rising = rising | (cq == 0)  # the slice's first candidate
                        breaks = inb & integral & ~(owned & rising)
                        unordered = unordered + Int32(cutlass.select_(breaks, Int32(1), Int32(0)))
                        pidf = idf
                # -0.0 -> +0.0 so that the two zeros tie and the tie-break decides.
                sb = Uint32(cutlass.select_(sb == Uint32(0x80000000), Uint32(0), sb))
                # Negative floats: flip all bits; non-negative: set the sign bit.
                flip = Uint32(Int32(sb.bitcast(Int32) >> 31).bitcast(Uint32) | Uint32(0x80000000))
                ok = ok & ((sb & Uint32(0x7FFFFFFF)) <= Uint32(0x7F800000))
                hi = Uint32(cutlass.select_(ok, sb ^ flip, Uint32(0)))
                khi[i] = hi
                if const_expr(not self.rank_local):
                    lo = Uint32(MASK32) - Uint32(Int32(idf))  # garbage when invalid: never read then
                    if const_expr(self.lean):
                        slo[i * T + tid] = lo
                    else:
                        klo[i] = lo
                digit = Int32(cutlass.select_(hi != Uint32(0), (hi >> Uint32(SH0)) & Uint32(NB0 - 1), Uint32(NB0)))
                cute.arch.atomic_add(hist.iterator + digit, Int32(1))
        return bad, pend, unordered

    @cute.jit
    def hash_ids(self, cid: cute.Tensor, pend: Uint32, htab: cute.Tensor) -> Int32:
        """``check``, ``global_id``: insert this thread's integer ids (``cid[i]`` where bit ``i`` of ``pend``) into
        the row's hash table ``htab``; returns how many were there already (a duplicate id in the row).

        Open addressing with linear probing and ``atom.shared.cas``: every copy of an id probes the same entries,
        and the first free one is taken by exactly one of them, so the others find it there (exact: no false
        alarm, no duplicate missed); at most half full, so a free entry always exists. In rounds: each round
        issues the next probe of every pending id back to back, then reads the answers (one shared-memory
        latency per round, not per probe). Measured on the H200 (device time of one row of W*K = 4096 ids, 256
        threads): a probe at a time added 23.0 µs to the unchecked 4.9 µs, rounds 9.6 µs; the check
        configuration now takes the widest CTA (:func:`make_config`), so each thread holds ~4 ids.
        """
        MASK = const_expr(self.hash_size - 1)
        hs = cute.make_rmem_tensor((self.items,), Uint32)
        olds = cute.make_rmem_tensor((self.items,), Uint32)
        for i in cutlass.range_constexpr(self.items):
            hs[i] = (cid[i] * Uint32(0x9E3779B1)) >> Uint32(32 - self.hash_bits)  # Fibonacci hashing
        dup = Int32(0)
        while pend != Uint32(0):
            for i in cutlass.range_constexpr(self.items):
                olds[i] = Uint32(EMPTY_ID)
                if (pend & Uint32(1 << i)) != Uint32(0):
                    olds[i] = smem_cas(htab.iterator + Int32(hs[i]), Uint32(EMPTY_ID), cid[i])
            for i in cutlass.range_constexpr(self.items):
                o = olds[i]
                mine = (pend & Uint32(1 << i)) != Uint32(0)
                found = mine & (o == cid[i])
                dup = dup + Int32(cutlass.select_(found, Int32(1), Int32(0)))
                settled = found | (o == Uint32(EMPTY_ID))  # placed, or a duplicate
                pend = Uint32(cutlass.select_(settled, pend & Uint32(MASK32 ^ (1 << i)), pend))
                hs[i] = Uint32(cutlass.select_(settled, hs[i], (hs[i] + Uint32(1)) & Uint32(MASK)))
        return dup

    @cute.jit
    def check_own(
        self, khi: cute.Tensor, sown: cute.Tensor, wsum: cute.Tensor, tid: Int32, lane: Int32, warp: Int32, rbase: Int32
    ) -> Int32:
        """``check``, ``rank_local`` (``sown`` filled, after a barrier; ``wsum`` free until the next one): how many
        of this thread's entries the reference's ``own_ids`` check refuses — exactly: an entry below ``-1``; a
        valid entry not above every valid entry before it (thread ``t`` takes the contiguous entries
        ``[t*P, (t+1)*P)``; what comes before them is a block-wide exclusive max scan of the threads' maxima);
        ``-1`` under a score (``khi != 0``) of this rank's slice."""
        KL = const_expr(self.kloc)
        P = const_expr(-(-self.kloc // self.threads))
        first = tid * P
        top = Int32(-1)
        for j in cutlass.range_constexpr(P):
            if first + j < KL:
                top = cutlass.max(top, sown[first + j])
        incl = top
        for o in cutlass.range_constexpr(5):  # the warp's inclusive max scan
            other = cute.arch.shuffle_sync_up(incl, 1 << o, mask_and_clamp=0)
            incl = cutlass.max(incl, Int32(cutlass.select_(lane >= (1 << o), other, Int32(-1))))
        if lane == 31:
            wsum[warp] = incl
        cute.arch.sync_threads()
        before = cute.arch.shuffle_sync_up(incl, 1, mask_and_clamp=0)
        run = Int32(cutlass.select_(lane >= 1, before, Int32(-1)))
        for w2 in cutlass.range_constexpr(self.threads // 32):
            if w2 < warp:
                run = cutlass.max(run, wsum[w2])
        bad = Int32(0)
        for j in cutlass.range_constexpr(P):
            if first + j < KL:
                o = sown[first + j]
                wrong = (o < Int32(-1)) | ((o >= Int32(0)) & (o <= run))
                bad = bad + Int32(cutlass.select_(wrong, Int32(1), Int32(0)))
                run = cutlass.max(run, o)
        for i in cutlass.range_constexpr(self.items):
            c = self.position(i, tid, Int32(0)) - rbase
            if (c >= Int32(0)) & (c < Int32(KL)):
                if (khi[i] != Uint32(0)) & (sown[c] == Int32(-1)):
                    bad = bad + Int32(1)
        return bad

    @cute.jit
    def chunk_coords(self, ci: int, tid: Int32, crank: Int32) -> tuple[Int32, Int32]:
        """``(w, cq)``: the rank slice and the chunk within it of this thread's chunk ``ci``.

        When ``T`` divides ``KQ`` (or ``KQ`` divides ``T``) and each CTA's share is whole slices, ``w`` and
        ``cq`` are affine in ``tid`` with compile-time coefficients: no division.
        """
        T = const_expr(self.threads)
        KQ = const_expr(self.kq)
        NCC = const_expr(self.ncc)
        if const_expr(NCC % KQ == 0 and KQ % T == 0):
            w = crank * (NCC // KQ) + const_expr((ci * T) // KQ)
            cq = const_expr((ci * T) % KQ) + tid
        elif const_expr(NCC % KQ == 0 and T % KQ == 0):
            w = crank * (NCC // KQ) + const_expr(ci * (T // KQ)) + tid // KQ
            cq = tid % KQ
        else:
            q = crank * NCC + (ci * T + tid)
            w = q // KQ
            cq = q - w * KQ
        return w, cq

    @cute.jit
    def key_lo(self, klo: cute.Tensor, slo: cute.Tensor, i: int, tid: Int32) -> Uint32:
        """The tie-break word of item ``i`` (not split: ``pbase = 0``); see :meth:`key_lo_at`."""
        return self.key_lo_at(klo, slo, i, tid, Int32(0))

    @cute.jit
    def key_lo_at(self, klo: cute.Tensor, slo: cute.Tensor, i: int, tid: Int32, pbase: Int32) -> Uint32:
        """The tie-break word of item ``i``: ``global_id`` as the stable top-K (a register or shared memory);
        ``rank_local`` computed, ``(2**LB - 1) - p`` for position ``p = pbase + vec*(ci*T + tid) + s``."""
        if const_expr(self.rank_local):
            lo = Uint32((1 << self.lo_bits) - 1) - Uint32(self.position(i, tid, pbase))
        elif const_expr(self.lean):
            lo = slo[i * self.threads + tid]
        else:
            lo = klo[i]
        return lo

    @cute.jit
    def position(self, i: int, tid: Int32, pbase: Int32) -> Int32:
        """Candidate position ``w*K + c`` of item ``i`` in the gathered row."""
        return pbase + tid * self.vec + (self.vec * (i // self.vec) * self.threads + i % self.vec)

    @cute.jit
    def chunk_active(self, ci: int, warp: Int32, rbase: Int32, pbase: Int32) -> Boolean:
        """``rank_local``: whether chunk ``ci`` of some lane of this warp lies in this rank's slice (warp-uniform:
        it depends on the warp, not the lane, so a ballot inside the branch sees the whole warp)."""
        first = pbase + warp * (32 * self.vec) + (self.vec * ci * self.threads) - rbase
        return (first + 32 * self.vec > 0) & (first < self.kloc)

    @cute.jit
    def owned(self, i: int, tid: Int32, lo: Uint32, rank: Int32, rbase: Int32, pbase: Int32) -> Boolean:
        """Whether item ``i`` (a winner) is this rank's: by position (``rank_local``) or by global id."""
        res = Boolean(True)
        if const_expr(self.rank_local):
            c = self.position(i, tid, pbase) - rbase
            res = (c >= 0) & (c < self.kloc)
        elif const_expr(self.world > 1):
            gid = (Uint32(MASK32) - lo).bitcast(Int32)  # 0 <= gid <= 2**31 - 1 for a valid key
            res = ((gid // self.cfg.interleave) % self.world) == rank
        return res

    @cute.jit
    def local_index(self, i: int, tid: Int32, lo: Uint32, rbase: Int32, pbase: Int32, sown: cute.Tensor) -> Int32:
        """This rank's local index of owned item ``i``: ``own_ids[t, p - rank*K]`` or from the global id."""
        loc = Int32(0)
        if const_expr(self.rank_local):
            loc = sown[self.position(i, tid, pbase) - rbase]
        else:
            gid = (Uint32(MASK32) - lo).bitcast(Int32)
            ii = const_expr(self.cfg.interleave)
            loc = (gid // (self.world * ii)) * ii + gid % ii
        return loc

    @cute.jit
    def slot_of(self, loc: Int32, ctx: tuple) -> Int32:
        """``block_table[req, loc // bs] * bs + loc % bs`` in int64, or the sentinel (the poison rule).

        ``ctx = (req_ok, bt_row, bt, bt_s1, n_blocks, flag)``: the row's request check, its block-table row
        offset, the table, its column stride and width, and the check flag (``check``: raised for a poisoned
        winner, exactly the reference's "no block for a selected key" and "slots exceed int32")."""
        req_ok, bt_row, bt, bt_s1, n_blocks, flag = ctx
        BS = const_expr(self.cfg.block_size)
        blk_idx = loc // BS
        ok = req_ok & (loc >= 0) & (blk_idx < n_blocks)
        blk = Int64(-1)
        if ok:
            blk = Int64(bt[bt_row + Int64(blk_idx) * bt_s1])
        s64 = blk * Int64(BS) + Int64(loc % BS)
        good = ok & (blk >= Int64(0)) & (s64 <= Int64(_INT32_MAX))
        if const_expr(self.check):
            if ~good:
                flag[0] = Int64(1)
        return Int32(cutlass.select_(good, Int32(s64), Int32(SENTINEL_SLOT)))

    @cute.jit
    def count_add(self, st: cute.Tensor, idx: int, val: Int32) -> Int32:
        """``atomic_add(st[idx], val)`` on this CTA's counter, or on CTA 0's when split; the old value."""
        old = Int32(0)
        if const_expr(self.split > 1):
            old = dsmem_atomic_add(st.iterator + idx, 0, val)
        else:
            old = cute.arch.atomic_add(st.iterator + idx, val)
        return old

    @cute.jit
    def commit_owned_fast(
        self,
        phi: Uint32,
        khi: cute.Tensor,
        klo: cute.Tensor,
        slo: cute.Tensor,
        sown: cute.Tensor,
        st: cute.Tensor,
        slots: cute.Tensor,
        obase: Int32 | Int64,
        tid: Int32,
        lane: Int32,
        warp: Int32,
        rank: Int32,
        rbase: Int32,
        pbase: Int32,
        ctx: tuple,
    ) -> None:
        """Commit when the selection ended in a score pass (or every valid key wins: ``phi = 0``).

        The winners are the keys with ``hi >= phi``, as in the stable top-K; this rank keeps those it owns.
        One shared atomic per warp for the warp's owned winners, then per item a ballot, so that a warp's
        slots of item ``i`` are consecutive (coalesced stores). The owned flags of a thread's items are kept
        in one 32-bit mask between the two loops. ``rank_local`` looks only at the chunks in this rank's
        slice (a warp-uniform branch per chunk).
        """
        lower = cutlass.max(phi, Uint32(1))
        flags = Uint32(0)
        mine = Int32(0)
        for ci in cutlass.range_constexpr(self.cpt):
            if const_expr(self.rank_local):
                # Only chunks in this rank's slice can be owned: a warp whose chunk ci lies outside it skips
                # the chunk (a warp-uniform branch; most warps skip most chunks).
                if self.chunk_active(ci, warp, rbase, pbase):
                    for sa in cutlass.range_constexpr(self.vec):
                        ia = ci * self.vec + sa
                        wa = (khi[ia] >= lower) & self.owned(ia, tid, Uint32(0), rank, rbase, pbase)
                        flags = flags | Uint32(cutlass.select_(wa, Uint32(1 << ia), Uint32(0)))
                        mine = mine + Int32(cutlass.select_(wa, Int32(1), Int32(0)))
            else:
                for sb in cutlass.range_constexpr(self.vec):
                    ib = ci * self.vec + sb
                    win = khi[ib] >= lower
                    lo = Uint32(0)
                    if const_expr(self.world > 1):
                        if win:
                            lo = self.key_lo_at(klo, slo, ib, tid, pbase)
                    wb = win & self.owned(ib, tid, lo, rank, rbase, pbase)
                    flags = flags | Uint32(cutlass.select_(wb, Uint32(1 << ib), Uint32(0)))
                    mine = mine + Int32(cutlass.select_(wb, Int32(1), Int32(0)))
        total = cute.arch.warp_redux_sync(mine, "add")
        base = Int32(0)
        if lane == 0:
            base = self.count_add(st, State.COUNT, total)
        run = cute.arch.shuffle_sync(base, 0)
        ltmask = cute.arch.lanemask_lt()
        for cj in cutlass.range_constexpr(self.cpt):
            active = Boolean(True)
            if const_expr(self.rank_local):
                active = self.chunk_active(cj, warp, rbase, pbase)
            if active:
                for sc in cutlass.range_constexpr(self.vec):
                    run = self.store_owned(
                        cj * self.vec + sc, flags, run, ltmask, klo, slo, sown, slots, obase, tid, rbase, pbase, ctx
                    )

    @cute.jit
    def store_owned(
        self,
        i: int,
        flags: Uint32,
        run: Int32,
        ltmask: Any,
        klo: cute.Tensor,
        slo: cute.Tensor,
        sown: cute.Tensor,
        slots: cute.Tensor,
        obase: Int32 | Int64,
        tid: Int32,
        rbase: Int32,
        pbase: Int32,
        ctx: tuple,
    ) -> Int32:
        """Item ``i`` of the fast commit's second loop: the warp's owned winners of item ``i`` take consecutive
        slots from ``run`` (ballot + popc); returns ``run`` advanced past them."""
        w = ((flags >> Uint32(i)) & Uint32(1)) != Uint32(0)
        ballot = Uint32(cute.arch.vote_ballot_sync(w))
        if w:
            pos = run + Int32(cute.arch.popc(ballot & Uint32(ltmask)))
            lo = Uint32(0)
            if const_expr(not self.rank_local):
                lo = self.key_lo_at(klo, slo, i, tid, pbase)
            loc = self.local_index(i, tid, lo, rbase, pbase, sown)
            slots[obase + pos] = self.slot_of(loc, ctx)
        return run + Int32(cute.arch.popc(ballot))

    @cute.jit
    def commit_owned_general(
        self,
        need: Int32,
        phi: Uint32,
        plo: Uint32,
        hm: Uint32,
        lm: Uint32,
        khi: cute.Tensor,
        klo: cute.Tensor,
        slo: cute.Tensor,
        sown: cute.Tensor,
        st: cute.Tensor,
        slots: cute.Tensor,
        obase: Int32 | Int64,
        tid: Int32,
        warp: Int32,
        rank: Int32,
        rbase: Int32,
        pbase: Int32,
        ctx: tuple,
    ) -> None:
        """Commit when the selection went into the tie-break word (or ended with surplus duplicates).

        As the stable top-K's general commit — keys above the threshold prefix win, of the keys equal to it
        the first ``need`` to reach the tie counter — then only this rank's winners take an output slot. The
        tie counter counts every rank's tied keys, so the selection is the same on every rank (keys are
        distinct in contract: positions always, global ids by validation). ``rank_local`` looks only at the
        chunks of this rank's slice: with distinct keys the selection ends with the threshold bin holding
        exactly the keys still needed, so every key equal to the threshold wins and no other rank's tie can
        take an owned key's place.
        """
        for ci in cutlass.range_constexpr(self.cpt):
            active = Boolean(True)
            if const_expr(self.rank_local):
                active = self.chunk_active(ci, warp, rbase, pbase)
            if active:
                for s in cutlass.range_constexpr(self.vec):
                    self.commit_item_general(
                        ci * self.vec + s,
                        need,
                        phi,
                        plo,
                        hm,
                        lm,
                        khi,
                        klo,
                        slo,
                        sown,
                        st,
                        slots,
                        obase,
                        tid,
                        rank,
                        rbase,
                        pbase,
                        ctx,
                    )

    @cute.jit
    def commit_item_general(
        self,
        i: int,
        need: Int32,
        phi: Uint32,
        plo: Uint32,
        hm: Uint32,
        lm: Uint32,
        khi: cute.Tensor,
        klo: cute.Tensor,
        slo: cute.Tensor,
        sown: cute.Tensor,
        st: cute.Tensor,
        slots: cute.Tensor,
        obase: Int32 | Int64,
        tid: Int32,
        rank: Int32,
        rbase: Int32,
        pbase: Int32,
        ctx: tuple,
    ) -> None:
        """Item ``i`` of :meth:`commit_owned_general`."""
        hi = khi[i]
        lo = Uint32(0)
        if const_expr(self.lean):
            # Only a key whose score word reaches the threshold can win: read its lo word.
            if (hi != Uint32(0)) & ((hi & hm) >= phi):
                lo = self.key_lo_at(klo, slo, i, tid, pbase)
        else:
            lo = self.key_lo_at(klo, slo, i, tid, pbase)
        mh = hi & hm
        ml = lo & lm
        valid = hi != Uint32(0)
        win = valid & ((mh > phi) | ((mh == phi) & (ml > plo)))
        tie = valid & (mh == phi) & (ml == plo)
        if tie:
            old = self.count_add(st, State.TIES, Int32(1))
            win = old < need
        if win & self.owned(i, tid, lo, rank, rbase, pbase):
            pos = self.count_add(st, State.COUNT, Int32(1))
            loc = self.local_index(i, tid, lo, rbase, pbase, sown)
            slots[obase + pos] = self.slot_of(loc, ctx)


# ---------------------------------------------------------------------------------------------
# Compilation (cached per configuration, under the kernels' lock) and the host wrapper.
# ---------------------------------------------------------------------------------------------


def _fake_args(cfg: SelectToSlotsConfig) -> tuple[Any, ...]:
    """Fake tensors and scalars in :meth:`SelectToSlotsKernel.__call__`'s order (shapes dynamic)."""
    wpl = cfg.vec * (1 if cfg.order == "rank_local" else 2)

    def flat(dtype: Any, align: int) -> Any:
        return cute.runtime.make_fake_compact_tensor(dtype, (cute.sym_int64(),), assumed_align=align)

    return (
        flat(Int32, 4 * wpl),  # gathered, as 32-bit words
        flat(Int64 if cfg.req_int64 else Int32, 8 if cfg.req_int64 else 4),
        flat(Int64 if cfg.bt_int64 else Int32, 8 if cfg.bt_int64 else 4),
        flat(Int32, 4),  # own_ids
        flat(Int32, 4),  # slots
        flat(Int32, 4),  # counts
        flat(Int64, 8) if cfg.check else flat(Int32, 4),  # flag: the int64 check flag (else never read)
        Int32(1),
        Int32(0),
        Int32(1),
        Int32(1),
        Int64(1),
        Int64(1),
        Int64(1),
        Int64(1),
        Int64(1),
    )


_COMPILED: dict[SelectToSlotsConfig, Any] = {}


def compile_select_to_slots(cfg: SelectToSlotsConfig) -> Any:
    """The compiled kernel of one configuration, compiled once (under
    :data:`dcp_ref.kernels._launch.KERNEL_LOCK`: CuTeDSL compiles are not thread-safe). Works without a GPU."""
    fn = _COMPILED.get(cfg)
    if fn is not None:
        return fn
    with KERNEL_LOCK:
        fn = _COMPILED.get(cfg)
        if fn is None:
            stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=cfg.tvm_ffi)
            kern = SelectToSlotsKernel(cfg)
            if cfg.tvm_ffi:
                fn = cute.compile(kern, *_fake_args(cfg), stream, options="--enable-tvm-ffi")
            else:
                fn = cute.compile(kern, *_fake_args(cfg), stream)
            _COMPILED[cfg] = fn
    return fn


def compile_artifacts(cfg: SelectToSlotsConfig, dump_dir: str) -> tuple[str, bytes]:
    """Compile one configuration (uncached) and return ``(PTX text, cubin bytes)`` — the CPU CI check.

    Needs ``CUTE_DSL_ARCH=sm_90a`` (no GPU needed); ``dump_dir`` must exist. See :func:`cubin_resources`.
    """
    with KERNEL_LOCK:
        kern = SelectToSlotsKernel(cfg)
        stream = cutlass.runtime.make_fake_stream()
        fn = cute.compile(kern, *_fake_args(cfg), stream, options=f"--keep-ptx --keep-cubin --dump-dir={dump_dir}")
    return compiled_artifacts(fn)


def compile_to_ptx(cfg: SelectToSlotsConfig, dump_dir: str) -> str:
    """The PTX text of :func:`compile_artifacts`."""
    return compile_artifacts(cfg, dump_dir)[0]


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """``{"registers", "frame_bytes", "stack_bytes"}`` of the (one) kernel in an sm_90 cubin, from its ELF
    ``.nv.info`` attributes (``EIATTR_REGCOUNT`` 0x2f, ``EIATTR_FRAME_SIZE`` 0x11, ``EIATTR_MIN_STACK_SIZE``
    0x12). A frame of 0 bytes means no local memory: no register spills. No CUDA tools needed."""
    import struct

    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_off = secs[shstrndx][4]

    def name(off: int) -> str:
        end = cubin.index(b"\0", names_off + off)
        return cubin[names_off + off : end].decode()

    keys = {0x2F: "registers", 0x11: "frame_bytes", 0x12: "stack_bytes"}
    out: dict[str, int] = {}
    for sec in secs:
        if not name(sec[0]).startswith(".nv.info"):
            continue
        data, i = cubin[sec[4] : sec[4] + sec[5]], 0
        while i + 4 <= len(data):
            fmt, attr, size = data[i], data[i + 1], struct.unpack_from("<H", data, i + 2)[0]
            if fmt != 0x04:  # only "size + payload" entries carry a payload
                i += 4
                continue
            if attr in keys and size >= 8:
                out[keys[attr]] = struct.unpack_from("<I", data, i + 8)[0]  # (function index, value)
            i += 4 + size
    return out


#: Shared memory one CTA may have on the H200 (227 KiB).
SMEM_MAX = 227 * 1024


_FITS: dict[tuple[Any, ...], bool] = {}


def check_fits(cfg: SelectToSlotsConfig) -> bool:
    """Whether configuration ``cfg`` (``check=True``) fits one CTA's shared memory: ``global_id`` needs a hash
    table of ``2 * W*K`` entries beside the selection's arrays (up to ``W*K = 16384`` for the lean variant).
    Cached by the fields that size the arrays (hashing the whole configuration costs µs per validated call)."""
    key = (cfg.order, cfg.world, cfg.kloc, cfg.vec, cfg.variant, cfg.threads, cfg.first_bits)
    fits = _FITS.get(key)
    if fits is None:
        fits = _FITS[key] = SelectToSlotsKernel(cfg).smem_bytes() <= SMEM_MAX
    return fits


def make_config(
    order: str,
    world: int,
    kloc: int,
    k: int,
    geometry: DcpGeometry,
    *,
    data_ptr: int = 0,
    has_req: bool = True,
    req_int64: bool = False,
    bt_int64: bool = False,
    small: bool = True,
    variant: str | None = None,
    config: tuple[int, int] | None = None,
    first_bits: int | None = None,
    vec: int | None = None,
    tvm_ffi: bool = False,
    rows: int = 1 << 20,
    split: int | None = None,
    check: bool = False,
) -> SelectToSlotsConfig:
    """The configuration the wrapper compiles for these shapes (defaults chosen here, in one place).

    ``vec`` (``None``): the widest vector load that divides ``K`` and that ``data_ptr``'s alignment allows
    (16 bytes). ``variant`` (``None``): ``"lean"`` for ``rank_local``; for ``global_id`` the stable top-K's
    :func:`~dcp_ref.kernels.topk_cutedsl.default_variant`. ``config``: ``(threads, min_ctas)``. ``split``
    (``None``): :func:`default_split` for ``rows`` and ``order``. ``first_bits`` (``None``): 8 when split (each pass's
    histograms are summed over the cluster: few bins), else 11 for ``rank_local`` and 8 for ``global_id``.
    ``check``: the validated call's in-kernel value checks (``split`` then 1 when ``None``).
    """
    bpc = 4 if order == "rank_local" else 8  # bytes per candidate
    if vec is None:
        vec = 1
        for v in (4, 2) if order == "rank_local" else (2,):
            if kloc % v == 0 and data_ptr % (bpc * v) == 0:
                vec = v
                break
    if variant is None:
        variant = "lean" if order == "rank_local" else default_variant(world, kloc, k, False)
    threads, min_ctas = (0, -1) if config is None else (int(config[0]), int(config[1]))
    if check and config is None:
        # The hash inserts are latency-bound per thread: the widest CTA (~4 ids per thread), and no register cap
        # (the probe rounds keep three words per item in registers; a cap spills them).
        threads, min_ctas = min(1024, max(256, next_pow2(cdiv(world * kloc, 4)))), 0
    if split is None:
        split = 1 if check else default_split(rows, world * kloc, vec, order)
    if first_bits is None:
        first_bits = 11 if order == "rank_local" and split == 1 else 8
    return SelectToSlotsConfig(
        order=order,
        world=world,
        kloc=kloc,
        k=k,
        interleave=geometry.interleave,
        block_size=geometry.block_size,
        vec=vec,
        variant=variant,
        has_req=has_req,
        req_int64=req_int64,
        bt_int64=bt_int64,
        small=small,
        threads=threads,
        min_ctas=min_ctas,
        # A wider first digit: one score pass fewer for real distributions; measured faster for rank_local at
        # 32 and 1024 rows (H200, W = 8, K = 2048: 9.1 vs 9.8 and 51.3 vs 52.9 us), mixed for global_id.
        first_bits=first_bits,
        tvm_ffi=tvm_ffi,
        split=split,
        check=check,
    )


# ---------------------------------------------------------------------------------------------
# The validated call's value checks: one Triton launch that raises a flag, one host read.
# ---------------------------------------------------------------------------------------------

#: The most entries (int64) of the duplicate-id hash table: 32 MiB. It holds 4 entries per candidate (a load
#: factor of at most 1/4); a call with more candidates runs the check in several launches (row groups), still with
#: one host read.
_HASH_MAX = 1 << 22
#: The smallest hash table.
_HASH_MIN = 1 << 10
#: Probes per id before the check gives up and lets the exact reference check decide (at a load factor of at
#: most 1/4 with double hashing, ``~4**-32`` per id).
_MAX_PROBES = 32
#: A hash entry is ``stamp << 24 | id`` (ids are below ``2**24``); stamps stay below ``_STAMP_LIMIT``, then the
#: table is zeroed and they start again at 1.
_STAMP_LIMIT = 1 << 31


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _block_missing(local, need, b, bt_ptr, n_blocks, bt_s0, bt_s1, BS: tl.constexpr):
    """Where ``need``: the block of local index ``local`` (request ``b``) is past the table, negative, or its slot
    does not fit below ``2**31 - 1`` — a superset of what the reference refuses (it asks only for winners)."""
    blk = local // BS
    past = need & (blk >= n_blocks)
    look = need & (blk < n_blocks)
    e = tl.load(bt_ptr + b * bt_s0 + blk * bt_s1, mask=look, other=0).to(tl.int64)
    slot = e * BS + local % BS
    return past | (look & ((e < 0) | (e >= 2147483648) | (slot >= 2147483647)))


@triton.jit(do_not_specialize=["stamp0"])
def select_check_kernel(
    g_ptr, req_ptr, bt_ptr, own_ptr, hash_ptr, chk_ptr,
    rows, K, nch, row0, rank, n_req, n_blocks, req_st, bt_s0, bt_s1, own_s0, own_s1, stamp0, hash_mask,
    W: tl.constexpr, I: tl.constexpr, BS: tl.constexpr, RANK_LOCAL: tl.constexpr, HAS_REQ: tl.constexpr,
    BLOCK: tl.constexpr, MAX_PROBES: tl.constexpr,
):  # fmt: skip
    """Raise ``chk[0]`` (atomic max to 1) where :func:`dcp_ref.select_to_slots.check_select_to_slots_inputs`
    may refuse row ``t = row0 + program_id(0)``; a good row writes nothing (the flag stays 0).

    ``gathered`` is contiguous: ``[W, rows, K, 2]`` pairs (``global_id``) or ``[W, rows, K]`` scores
    (``rank_local``). Every row: its request id in ``[0, n_req)``. ``global_id`` (program ``(t, w*nch + chunk)``,
    ``BLOCK`` candidates of rank slice ``w``): each id ``-1``, NaN or an integer in ``[0, 2**24)``; no integer id
    twice in the row (inserted into an open-addressing hash table of ``hash_mask + 1`` int64 entries, double
    hashing, ``atomic_cas``; an entry is ``stamp << 24 | id`` with ``stamp = stamp0 + t - row0``, and an entry
    stamped below ``stamp0`` is empty, so the table is never cleared between calls); every selectable candidate
    (integer id, score not NaN) that this rank owns has its block. ``rank_local`` (program ``t``, a loop over
    the row's own slice): ``own_ids`` ``-1`` or ``>= 0``, the valid ones strictly ascending (``own - j``, ``j``
    the index among the valid ones, never decreases), ``-1`` only under a NaN score, and every candidate with a
    score has its block. The block test covers every selectable candidate of this rank, not only the winners:
    a flag raised for a losing candidate without a block (or an id still unplaced after ``MAX_PROBES`` probes) is
    a false alarm that the exact reference check, run only then, clears.
    """
    t = (row0 + tl.program_id(0)).to(tl.int64)
    if HAS_REQ:
        b = tl.load(req_ptr + t * req_st).to(tl.int64)
    else:
        b = t
    req_bad = (b < 0) | (b >= n_req)
    b = tl.where(req_bad, 0, b)
    # A bad request id raises the flag anyway: its row reads no block (a bound of 0, folded in as an int; the
    # interpreter rejects broadcast scalar-bool masks).
    nb = tl.where(req_bad, 0, n_blocks)
    bad = tl.zeros([BLOCK], tl.int32)
    if RANK_LOCAL:
        cmax = tl.full([], -(2**40), tl.int64)
        cnt = tl.zeros([], tl.int64)
        for c0 in range(0, K, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            m = c < K
            o = tl.load(own_ptr + t * own_s0 + c * own_s1, mask=m, other=-1).to(tl.int64)
            s = tl.load(g_ptr + ((rank + 0 * t) * rows + t) * K + c, mask=m, other=float("nan"))  # int64 offsets
            v = m & (o >= 0)
            j = cnt + tl.cumsum(v.to(tl.int64), 0) - 1
            bv = tl.where(v, o - j, -(2**40))
            incl = tl.maximum(tl.associative_scan(bv, 0, _max_combine), cmax)
            scored = m & (s == s)
            wrong = (m & (o < -1)) | (v & (bv < incl)) | (scored & ~v)
            missing = _block_missing(o, v & scored, b, bt_ptr, nb, bt_s0, bt_s1, BS)
            bad = bad | (wrong | missing).to(tl.int32)
            cmax = tl.maximum(cmax, tl.max(bv, 0))
            cnt += tl.sum(v.to(tl.int64), 0)
        flagged = req_bad | (tl.max(bad, 0) != 0)
    else:
        q = tl.program_id(1)
        w = (q // nch).to(tl.int64)
        c = (q % nch) * BLOCK + tl.arange(0, BLOCK)
        m = c < K
        off = ((w * rows + t) * K + c) * 2
        s = tl.load(g_ptr + off, mask=m, other=float("nan"))
        idf = tl.load(g_ptr + off + 1, mask=m, other=-1.0)
        inr = (idf >= 0) & (idf < 16777216.0)
        gid = tl.where(inr, idf, 0.0).to(tl.int32)
        valid = m & inr & (gid.to(tl.float32) == idf)  # an integer id in [0, 2**24) (-0.0 is id 0)
        bad_id = m & ~valid & (idf == idf) & (idf != -1.0)
        owned = valid & (s == s) & ((gid // I) % W == rank)
        local = ((gid // (W * I)) * I + gid % I).to(tl.int64)
        missing = _block_missing(local, owned, b, bt_ptr, nb, bt_s0, bt_s1, BS)
        # Duplicates: insert every valid id of the row into the hash table.
        x = gid.to(tl.uint32) * 0x9E3779B1 + t.to(tl.uint32) * 0x85EBCA77
        x = (x ^ (x >> 16)) * 0x7FEB352D
        x = (x ^ (x >> 15)) * 0x846CA68B
        x = x ^ (x >> 16)
        slot = (x & hash_mask).to(tl.int64)
        step = ((((x >> 7) ^ (x << 3)) & hash_mask) | 1).to(tl.int64)  # odd: visits every entry
        mine = ((stamp0 + t - row0) << 24) | gid.to(tl.int64)
        active = valid
        cur = tl.load(hash_ptr + slot, mask=active, other=0)
        dup = tl.zeros([BLOCK], tl.int32)
        n_act = tl.sum(active.to(tl.int32), 0)
        it = tl.zeros([], tl.int32)
        while (n_act > 0) & (it < MAX_PROBES):
            nxt = (slot + step) & hash_mask
            ahead = tl.load(hash_ptr + nxt, mask=active, other=0)  # the next probe's entry, read beside the CAS
            try_ = active & ((cur >> 24) < stamp0)  # the entry is empty (stamped before this launch)
            old = tl.atomic_cas(hash_ptr + slot, tl.where(try_, cur, -1), mine, sem="relaxed")
            found = active & (old == mine)  # the same id of the same row is already in the table
            dup = dup | found.to(tl.int32)
            active = active & ~(try_ & (old == cur)) & ~found
            # Another id holds the entry: probe the next one (its value as read ahead; a stale read only costs
            # a failed CAS). Else (an empty entry that changed under the read) try the same entry again.
            taken = active & ((old >> 24) >= stamp0)
            slot = tl.where(taken, nxt, slot)
            cur = tl.where(taken, ahead, old)
            n_act = tl.sum(active.to(tl.int32), 0)
            it += 1
        bad = (bad_id | missing).to(tl.int32) | dup
        flagged = req_bad | (tl.max(bad, 0) != 0) | (n_act > 0)
    if flagged:
        tl.atomic_max(chk_ptr, 1)


def _hash_table(dev: torch.device, entries: int) -> list[Any]:
    """``[table, next stamp]``: a zeroed int64 hash table of :func:`select_check_kernel` (``entries``) for one
    validated call, made per call (no module cache: the stamps let one call reuse it over its groups of rows)."""
    return [torch.zeros(entries, dtype=torch.int64, device=dev), 1]


def check_select_to_slots_values(
    gathered: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    *,
    order: str,
    own_ids: torch.Tensor | None,
) -> torch.Tensor:
    """Launch :func:`select_check_kernel` over every row (inputs shape-checked; ``gathered`` contiguous, on CUDA
    or under the interpreter): this call's check flag, 0 when every value is in contract, 1 when the reference's
    value check may refuse them (read it once; when raised, clear it and run the reference's check). No host
    read; ``global_id`` with more than ``_HASH_MAX / 4`` candidates runs one launch per group of rows."""
    w, rows, kloc = gathered.shape[0], gathered.shape[1], gathered.shape[2]
    dev = gathered.device
    chk = check_flag(dev)
    n_req, n_blocks = block_table.shape
    rank_local = order == "rank_local"
    has_req = req_of_token is not None
    req_t = req_of_token if req_of_token is not None else chk
    bt_t = chk if block_table.numel() == 0 else block_table
    own_t = own_ids if rank_local and own_ids is not None else chk
    common = dict(
        W=w, I=geometry.interleave, BS=geometry.block_size, RANK_LOCAL=rank_local, HAS_REQ=has_req,
        MAX_PROBES=_MAX_PROBES, num_warps=4,
    )  # fmt: skip
    strides = (
        req_t.stride(0) if has_req else 0,
        bt_t.stride(0) if bt_t is block_table else 0,
        bt_t.stride(1) if bt_t is block_table else 0,
        own_t.stride(0) if own_t is own_ids else 0,
        own_t.stride(1) if own_t is own_ids else 0,
    )
    if rank_local:
        block = min(max(next_pow2(kloc), 16), 1024)
        select_check_kernel[(rows,)](
            gathered, req_t, bt_t, own_t, chk, chk, rows, kloc, 1, 0, geometry.rank, n_req, n_blocks, *strides, 1, 0,
            BLOCK=block, **common,
        )  # fmt: skip
        return chk
    n = w * kloc
    block = min(max(next_pow2(kloc), 16), 256)
    nch = max(cdiv(kloc, block), 1)
    group = max(1, min(rows, (_HASH_MAX // 4) // max(n, 1)))
    entries = max(next_pow2(4 * group * n), _HASH_MIN)
    state = _hash_table(dev, entries)
    for row0 in range(0, rows, group):
        g_rows = min(group, rows - row0)
        if state[1] + g_rows >= _STAMP_LIMIT:  # ~2**31 rows checked on this table: start the stamps again
            state[0].zero_()
            state[1] = 1
        select_check_kernel[(g_rows, w * nch)](
            gathered, req_t, bt_t, own_t, state[0], chk, rows, kloc, nch, row0, geometry.rank, n_req, n_blocks,
            *strides, state[1], entries - 1, BLOCK=block, **common,
        )  # fmt: skip
        state[1] += g_rows
    return chk


def _validate_values(
    gathered: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    order: str,
    own_ids: torch.Tensor | None,
    defer: bool = False,
) -> torch.Tensor | None:
    """The validated call's value checks (after the shared shape checks, ``rows > 0``): one launch of
    :func:`select_check_kernel` and one host read; only a raised flag runs the reference's exact check, which
    raises its message (or, for a false alarm, returns). Where the kernel would not run (a CPU tensor without the
    interpreter, a non-contiguous ``gathered``, too many candidates: the call fails after this anyway), the
    reference's check runs directly. ``defer``: launch the check and return its flag unread (the caller launches
    the select, which is safe on any input, then reads it with :func:`_finish_validation`: the host never waits
    between the two launches); ``None`` when nothing is left to read."""
    _check_readable(gathered, req_of_token, block_table, own_ids)
    dev = gathered.device
    fast = (
        (dev.type == "cuda" or triton_interpreting())
        and gathered.is_contiguous()
        and geometry.world_size * gathered.shape[2] <= MAX_CANDIDATES
    )
    if fast:
        chk = check_select_to_slots_values(gathered, req_of_token, block_table, geometry, order=order, own_ids=own_ids)
        if defer:
            return chk
        _finish_validation(chk, gathered, req_of_token, block_table, geometry, k, order=order, own_ids=own_ids)
        return None
    check_select_to_slots_inputs(
        gathered, req_of_token, block_table, geometry, k, order=order, own_ids=own_ids, validate=True
    )
    return None


def _finish_validation(
    chk: torch.Tensor,
    gathered: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    order: str,
    own_ids: torch.Tensor | None,
    in_kernel: bool = False,
) -> None:
    """Read the check flag (the one host read of a validated call); when raised, clear it and run the
    reference's exact check, which raises its message. The check kernel over-approximates (a losing candidate
    without a block raises it): there a flag the reference clears is a false alarm; the select kernel's own
    checks (``in_kernel``) are exact, so there it is a kernel bug (``AssertionError``)."""
    raise_if_flagged(
        chk,
        lambda: check_select_to_slots_inputs(
            gathered, req_of_token, block_table, geometry, k, order=order, own_ids=own_ids, validate=True
        ),
        "the select kernel's checks" if in_kernel else "select_check_kernel",
        false_alarms=not in_kernel,
    )


def select_to_slots_cutedsl(
    gathered: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    order: str = "global_id",
    own_ids: torch.Tensor | None = None,
    out_slots: torch.Tensor | None = None,
    out_counts: torch.Tensor | None = None,
    validate: bool = True,
    tvm_ffi: bool | None = None,
    variant: str | None = None,
    config: tuple[int, int] | None = None,
    first_bits: int | None = None,
    vec: int | None = None,
    split: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the select-to-slots kernel (CUDA only); the contract of
    :func:`dcp_ref.select_to_slots.select_to_slots`.

    Arguments as the reference (validation shared: the same inputs raise the same errors; the validated call's
    value checks are one launch of :func:`select_check_kernel` and one host read, the module docstring), then:
    ``gathered``, ``out_slots``, ``out_counts`` must be contiguous CUDA tensors (``gathered`` is read as
    aligned words). The winners' slots come in an unspecified order (compare as sets); ``[count, k)`` is
    ``-1``. With ``out_slots`` / ``out_counts`` and ``validate=False``: no allocation, no host read.

    Tuning (same result): ``tvm_ffi`` (``None``: on when apache-tvm-ffi is importable), ``variant``
    (``global_id``: ``"lean"`` / ``"regs"``), ``config`` ``(threads, min_ctas)``, ``first_bits``, ``vec``,
    ``split`` (CTAs per row; ``None``: by ``rows``, :func:`default_split`) — see :func:`make_config`.
    """
    validate = check_bool(validate, "validate")  # first, as the reference
    spec = check_select_to_slots_inputs(
        gathered,
        req_of_token,
        block_table,
        geometry,
        k,
        order=order,
        own_ids=own_ids,
        out_slots=out_slots,
        out_counts=out_counts,
        validate=False,  # the shape checks only: the values are checked below, in one launch and one read
    )
    pending = flag = None
    checked = False
    if validate and spec.rows:
        dev = gathered.device
        if _checks_in_kernel(gathered, dev, geometry.world_size * spec.kloc, split):
            # The select kernel checks the values itself and raises the flag: no second launch. (No readability
            # check: every tensor is on gathered's CUDA device, so none is a meta tensor.)
            flag = check_flag(dev)
        else:
            # On the GPU the check kernel's flag is read after the select is launched (it is safe on any input):
            # the host does not wait between the two launches.
            pending = _validate_values(
                gathered, req_of_token, block_table, geometry, spec.k, order=order, own_ids=own_ids,
                defer=gathered.device.type == "cuda",
            )  # fmt: skip
    # On a refused call the buffers hold the validate=False answer.
    try:
        *result, checked = _select(
            gathered, req_of_token, block_table, geometry, spec, order=order, own_ids=own_ids, out_slots=out_slots,
            out_counts=out_counts, tvm_ffi=tvm_ffi, variant=variant, config=config, first_bits=first_bits, vec=vec,
            split=split, flag=flag,
        )  # fmt: skip
        if checked:
            pending = flag
        elif flag is not None:  # the configuration's hash table does not fit: the check kernel reads the values
            pending = _validate_values(
                gathered, req_of_token, block_table, geometry, spec.k, order=order, own_ids=own_ids, defer=True
            )
    except BaseException:
        for f in (pending, flag):
            if f is not None:
                f.zero_()  # a call that stops before its read leaves the shared flag clear
        raise
    if pending is not None and (not checked or pending.item()):  # the select's own checks: one read of a clear flag
        _finish_validation(
            pending, gathered, req_of_token, block_table, geometry, spec.k, order=order, own_ids=own_ids,
            in_kernel=checked,
        )  # fmt: skip
    return result[0], result[1]


def _checks_in_kernel(gathered: torch.Tensor, dev: torch.device, n: int, split: int | None) -> bool:
    """Whether the validated call's value checks can run inside the select kernel (``check=True``): on CUDA
    (``dev``, ``gathered``'s device), a contiguous ``gathered`` it can read of ``n = W*K`` candidates per row, one
    CTA per row (``split`` ``None`` or 1). Elsewhere the check kernel runs (or, where the select cannot run at
    all, the reference's check, so that it refuses values first)."""
    return dev.type == "cuda" and split in (None, 1) and 0 < n <= MAX_CANDIDATES and gathered.is_contiguous()


def _check_readable(
    gathered: torch.Tensor, req_of_token: torch.Tensor | None, block_table: torch.Tensor, own_ids: torch.Tensor | None
) -> None:
    """A value check needs real data (the reference's first value check)."""
    check_values_readable(gathered, "gathered")
    check_values_readable(block_table, "block_table")
    if req_of_token is not None:
        check_values_readable(req_of_token, "req_of_token")
    if own_ids is not None:
        check_values_readable(own_ids, "own_ids")


def _select(
    gathered: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    spec: SelectToSlotsInputs,
    *,
    order: str,
    own_ids: torch.Tensor | None,
    out_slots: torch.Tensor | None,
    out_counts: torch.Tensor | None,
    tvm_ffi: bool | None,
    variant: str | None,
    config: tuple[int, int] | None,
    first_bits: int | None,
    vec: int | None,
    split: int | None,
    flag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The select-to-slots launch of :func:`select_to_slots_cutedsl`, after its checks: ``(slots, counts,
    checked)``. ``flag`` (the int64 check flag): compile with the in-kernel value checks, which raise it, where
    they fit (:func:`check_fits`); ``checked`` says whether they ran (``False`` without ``flag``)."""
    w, rows, kloc, k = geometry.world_size, spec.rows, spec.kloc, spec.k
    n_req, n_blocks = spec.n_req, spec.n_blocks
    if w * kloc > MAX_CANDIDATES:
        raise ValueError(
            f"gathered has W*K = {w * kloc} candidates per row: the CuTeDSL select-to-slots supports "
            f"<= {MAX_CANDIDATES}"
        )
    if gathered.device.type != "cuda":
        raise ValueError(f"gathered must be a CUDA tensor for the CuTeDSL kernel, got device {gathered.device}")
    if not gathered.is_contiguous():
        raise ValueError("gathered must be contiguous (the kernel reads it as aligned 32-bit words)")
    dev = gathered.device
    if out_slots is None:
        out_slots = torch.empty((rows, k), dtype=torch.int32, device=dev)
    elif not out_slots.is_contiguous():
        raise ValueError("out_slots must be contiguous (it is written as one flat buffer)")
    if out_counts is None:
        out_counts = torch.empty((rows,), dtype=torch.int32, device=dev)
    elif not out_counts.is_contiguous():
        raise ValueError("out_counts must be contiguous (it is written as one flat buffer)")
    if rows == 0:
        return out_slots, out_counts, False
    if w * kloc == 0:
        out_slots.fill_(-1)
        out_counts.zero_()
        return out_slots, out_counts, False
    if gathered.data_ptr() % 4:
        raise ValueError("gathered must be 4-byte aligned")
    counts_flat = out_counts.view(-1)
    # Tensors the configuration does not read are replaced by a small int32 one (never dereferenced).
    has_req = req_of_token is not None
    req_t = req_of_token if req_of_token is not None and req_of_token.numel() else counts_flat
    empty_table = n_req == 0 or n_blocks == 0
    bt_t = counts_flat if empty_table else block_table
    own_t = own_ids if order == "rank_local" and own_ids is not None else counts_flat
    # Flat views from the storage offset; the strides go in as arguments. An extent of 0 is never read.
    req_flat = _span(req_t)
    bt_flat = _span(bt_t)
    own_flat = _span(own_t)
    small = max(gathered.numel(), rows * k, req_flat.numel(), bt_flat.numel(), own_flat.numel()) < 2**31
    ffi = use_tvm_ffi() if tvm_ffi is None else bool(tvm_ffi)

    def config_for(check: bool) -> SelectToSlotsConfig:
        return make_config(
            order, w, kloc, k, geometry, data_ptr=gathered.data_ptr(), has_req=has_req,
            req_int64=req_t.dtype == torch.int64, bt_int64=bt_t.dtype == torch.int64, small=small, variant=variant,
            config=config, first_bits=first_bits, vec=vec, tvm_ffi=ffi, rows=rows, split=split, check=check,
        )  # fmt: skip

    cfg = config_for(flag is not None)
    if cfg.check and not check_fits(cfg):
        cfg = config_for(False)
    if cfg.vec > 1 and gathered.data_ptr() % (4 * cfg.vec * (1 if order == "rank_local" else 2)):
        raise ValueError(f"gathered must be {4 * cfg.vec} * words-aligned for vec={cfg.vec}")
    fn = compile_select_to_slots(cfg)
    words = gathered.view(torch.int32).view(-1)
    scalars = (
        rows,
        geometry.rank,
        0 if empty_table else n_req,
        0 if empty_table else n_blocks,
        req_t.stride(0) if has_req else 0,
        0 if empty_table else bt_t.stride(0),
        0 if empty_table else bt_t.stride(1),
        own_t.stride(0) if own_t is own_ids else 0,
        own_t.stride(1) if own_t is own_ids else 0,
    )
    flag_t = flag if cfg.check and flag is not None else counts_flat
    tensors = (words, req_flat, bt_flat, own_flat, out_slots.view(-1), counts_flat, flag_t)
    if ffi:
        fn(*tensors, *scalars)
    else:
        import cuda.bindings.driver as cuda  # shipped with nvidia-cutlass-dsl
        from cutlass.cute.runtime import from_dlpack

        wpl_bytes = 4 * cfg.vec * (1 if order == "rank_local" else 2)
        aligns = (wpl_bytes, req_flat.element_size(), bt_flat.element_size(), 4, 4, 4, flag_t.element_size())
        stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        args = [from_dlpack(t, assumed_align=a) for t, a in zip(tensors, aligns)]
        fn(*args, *(Int32(v) for v in scalars[:4]), *(Int64(v) for v in scalars[4:]), stream)
    return out_slots, out_counts, cfg.check


def _span(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the storage ``t`` spans (from its storage offset); indexing it with ``t``'s strides reads
    ``t``'s elements. No copy, no host read."""
    if t.numel() == 0:
        return t.reshape(-1)
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.as_strided((extent,), (1,))
