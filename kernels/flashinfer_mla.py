"""Sparse MLA decode over compacted KV slots with FlashInfer (Hopper, FA3), LSE made base e.

What this wraps
---------------
After the deinterleave stage each rank has, per query token ``t``, the physical slots of the
chosen tokens it owns compacted to the front of ``slots[t, :]`` (``-1`` after) and their number
``counts[t]``. FlashInfer's ``BatchMLAPagedAttentionWrapper`` wants CSR metadata over *pages*;
with ``page_size = 1`` a page is a slot, so each query token becomes its own CSR "request"::

    qo_indptr  = [0, 1, 2, ..., T]               one query row per request
    kv_indptr  = [0, cumsum(counts)]             compact: no room for the -1 padding
    kv_indices = slots[t, :counts[t]] for t = 0..T-1, concatenated
    kv_len     = counts

The FA3 backend (``backend="fa3"``) runs on SM90; ``lse_mode="base2"`` makes it return the LSE in
the **log2** domain (its softmax uses ``exp2``), which :meth:`FlashInferSparseMLA.run` converts to
base e (``× ln 2``) unless asked for the raw base-2 value (the Triton merge in
:mod:`dcp_ref.kernels.lse_merge_triton` accepts ``base="2"`` directly, which skips the conversion).

``plan()`` syncs the host
-------------------------
``plan()`` copies ``kv_indptr``/``kv_len`` to the host to build FA3's work schedule (which CTA
takes which rows / splits): one device→host copy and a stream synchronisation per call. Under
DSA the chosen tokens differ per *layer*, so ``counts`` (and hence the plan) change per layer:
a sync per layer per decode step. That stalls the CPU's kernel launching until the GPU drains,
and it makes the step impossible to capture in a CUDA graph. Measured on the H200 (FlashInfer
0.7.0, T = 32 or 128, K = 2048, H = 128; ``benchmarks/results/attention_flashinfer.json`` and
``lse_floor.json``): ``run()`` 55 µs (T = 32) / 148 µs (T = 128), but ``plan()`` 0.6–1.1 ms of
host time (FlashInfer's own ``plan`` ≈ 0.7 ms of it, building the CSR ≈ 0.25 ms) — over 10× the
attention at T = 32, i.e. tens of ms per step for a 61-layer model if planned per layer. Avoiding it needs a kernel
whose schedule is independent of the per-row lengths (e.g. fixed top-K capacity per row, as
FlashMLA's sparse decode and the trtllm-gen path do).

Blackwell
---------
On SM100/SM103 FlashInfer's trtllm-gen kernel takes the ``[T, K]`` slots with ``-1`` padding
directly (``trtllm_batch_decode_with_kv_cache_mla(sparse_mla_top_k=K)``), no plan, no CSR.
:func:`sparse_mla_trtllm_blackwell` offers it behind a capability check. **It is untested**:
the project's only GPU is an H200 (SM90).

``flashinfer`` is imported lazily, so this module imports without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dcp_ref.lse import LN2

__all__ = [
    "CompactCSR",
    "build_compact_csr",
    "FlashInferSparseMLA",
    "sparse_mla_flashinfer",
    "sparse_mla_trtllm_blackwell",
]

_INT = (torch.int32, torch.int64)


def _flashinfer() -> Any:
    try:
        import flashinfer  # noqa: F401
        import flashinfer.mla as fmla
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "FlashInfer is needed for dcp_ref.kernels.flashinfer_mla (pip install flashinfer-python>=0.7, "
            "or on the device: source .gpu/flashinfer/env.sh)"
        ) from e
    return fmla


def _check_slots_counts(slots: object, counts: object) -> tuple[int, int]:
    if not isinstance(slots, torch.Tensor):
        raise TypeError(f"slots must be a torch.Tensor, got {type(slots).__name__}")
    if not isinstance(counts, torch.Tensor):
        raise TypeError(f"counts must be a torch.Tensor, got {type(counts).__name__}")
    if slots.dtype not in _INT:
        raise TypeError(f"slots must be int32 or int64, got {slots.dtype}")
    if counts.dtype not in _INT:
        raise TypeError(f"counts must be int32 or int64, got {counts.dtype}")
    if slots.ndim != 2:
        raise ValueError(f"slots must be 2-D [T, K], got shape {tuple(slots.shape)}")
    T, K = slots.shape
    if tuple(counts.shape) != (T,):
        raise ValueError(f"counts must be [T={T}], got shape {tuple(counts.shape)}")
    if counts.device != slots.device:
        raise ValueError(f"counts must be on the device of slots ({slots.device}), got {counts.device}")
    return T, K


def _check_values(slots: torch.Tensor, counts: torch.Tensor, num_slots: int | None) -> None:
    """The reference's value checks (:func:`dcp_ref.attention.check_attention_slots`: one device
    reduction, one host read), same messages."""
    from dcp_ref.attention import check_attention_slots

    check_attention_slots(slots, counts, num_slots)


@dataclass(frozen=True)
class CompactCSR:
    """FlashInfer CSR metadata for page_size 1 (all int32, on the device of the slots).

    Attributes:
        qo_indptr: ``[T+1]`` = ``arange(T+1)`` (one query row per request).
        kv_indptr: ``[T+1]`` = ``[0, cumsum(counts)]``.
        kv_indices: ``[T*K]`` capacity buffer; only ``kv_indices[:kv_indptr[-1]]`` is meaningful.
        kv_len: ``[T]`` = ``counts``.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len: torch.Tensor


def build_compact_csr(slots: torch.Tensor, counts: torch.Tensor) -> CompactCSR:
    """Compact CSR from ``[T, K]`` slots (valid prefix of length ``counts[t]``) — no host sync.

    Row ``t``'s valid slots are scattered to ``kv_indices[kv_indptr[t] + j]``; padding entries are
    all sent to one extra trash element past the end (so no boolean indexing, which would need
    the total on the host). Values are not validated (that would sync: :meth:`FlashInferSparseMLA.plan`
    does, as the reference :func:`dcp_ref.attention.sparse_mla_attention`); ``counts`` is clamped
    to ``[0, K]`` on the device instead, so the CSR never claims entries that do not exist.

    Args: ``slots`` int32/int64 ``[T, K]``, ``counts`` int32/int64 ``[T]`` with ``0 <= counts <= K``.
    Returns: :class:`CompactCSR`.
    """
    T, K = _check_slots_counts(slots, counts)
    dev = slots.device
    cnt = counts.clamp(min=0, max=K).to(torch.int32)
    kv_indptr = torch.zeros(T + 1, dtype=torch.int32, device=dev)
    torch.cumsum(cnt, 0, out=kv_indptr[1:])
    j = torch.arange(K, device=dev, dtype=torch.int64)
    valid = j.unsqueeze(0) < cnt.unsqueeze(1).to(torch.int64)  # [T, K]
    trash = T * K
    dest = torch.where(valid, kv_indptr[:-1].to(torch.int64).unsqueeze(1) + j, trash)
    buf = torch.zeros(T * K + 1, dtype=torch.int32, device=dev)
    buf.scatter_(0, dest.reshape(-1), slots.to(torch.int32).reshape(-1))
    qo_indptr = torch.arange(T + 1, dtype=torch.int32, device=dev)
    return CompactCSR(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=buf[: T * K], kv_len=cnt.contiguous())


class FlashInferSparseMLA:
    """FlashInfer FA3 MLA over compacted slots (page_size 1), planned per step (or per layer).

    Usage::

        attn = FlashInferSparseMLA(num_heads=128, sm_scale=192 ** -0.5, device="cuda")
        attn.plan(slots, counts)                 # host sync (see the module docstring)
        out, lse = attn.run(q, kv_cache)         # lse base e; lse_base="2" for FlashInfer's raw LSE

    Shapes: ``q`` ``[T, H, 576]`` bf16, ``kv_cache`` ``[num_slots, 576]`` or ``[num_slots, 1, 576]``
    bf16, ``out`` ``[T, H, 512]`` bf16, ``lse`` ``[T, H]`` fp32. An empty row (``counts[t] == 0``)
    gives output 0 and LSE ``-inf``.
    """

    def __init__(
        self,
        num_heads: int,
        sm_scale: float,
        *,
        device: torch.device | str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        head_dim_ckv: int = 512,
        head_dim_kpe: int = 64,
        workspace_bytes: int = 128 * 1024 * 1024,
        backend: str = "fa3",
    ) -> None:
        from dcp_ref.attention import check_sm_scale
        from dcp_ref.contracts import check_int_scalar

        num_heads = check_int_scalar(num_heads, "num_heads", min_value=1)
        sm_scale = check_sm_scale(sm_scale)  # the reference's check and messages
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {dev}")
        # "cuda" and "cuda:0" are different torch.device values: pin the index so checks compare.
        self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        fmla = _flashinfer()
        self._fmla = fmla
        self.num_heads = num_heads
        self.sm_scale = float(sm_scale)
        self.dtype = dtype
        self.head_dim_ckv = head_dim_ckv
        self.head_dim_kpe = head_dim_kpe
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrapper = fmla.BatchMLAPagedAttentionWrapper(self._workspace, backend=backend)
        self._planned_T: int | None = None
        #: False once FlashInfer's run() refused caller buffers (then results are copied into them).
        self.accepts_out_buffers = True

    def plan(self, slots: torch.Tensor, counts: torch.Tensor, *, validate: bool = True) -> None:
        """Plan for this step's ``[T, K]`` slots / ``[T]`` counts. **Synchronises the host.**

        ``validate``: the reference's value checks (``0 <= counts <= K``, used slots ``>= 0``;
        the upper bound ``num_slots`` is checked by :meth:`run`), raising its ``ValueError``.
        ``False``: counts are clamped to ``[0, K]``, and :meth:`run` clamps the slots and poisons
        a row whose used slots leave the cache with NaN (no read out of bounds).
        """
        from dcp_ref.contracts import check_bool

        validate = check_bool(validate, "validate")
        T, K = _check_slots_counts(slots, counts)
        if slots.device != self.device:
            raise ValueError(f"slots must be on {self.device}, got {slots.device}")
        if validate:
            _check_values(slots, counts, None)
        csr = build_compact_csr(slots, counts)
        # Per-row range of the used slots, for run()'s bound check against the cache (on the device).
        used = torch.arange(K, device=slots.device).unsqueeze(0) < csr.kv_len.unsqueeze(1).long()
        s64 = slots.long()
        self._row_lo = torch.where(used, s64, torch.iinfo(torch.int64).max).amin(1) if K else s64.new_zeros(T)
        self._row_hi = torch.where(used, s64, -1).amax(1) if K else s64.new_full((T,), -1)
        # plan() reads the lengths on the host anyway; reading the total here costs nothing extra
        # and hands FlashInfer an exactly-sized (compact) index array.
        total = int(csr.kv_indptr[-1])
        meta = self._fmla.MLAPlanMetadata.csr(csr.qo_indptr, csr.kv_indptr, csr.kv_indices[:total], csr.kv_len)
        self._wrapper.plan(
            metadata=meta,
            num_heads=self.num_heads,
            head_dim_ckv=self.head_dim_ckv,
            head_dim_kpe=self.head_dim_kpe,
            page_size=1,
            causal=False,
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            lse_mode="base2",
        )
        self._csr = csr  # keep the metadata alive as long as the plan may reference it
        self._planned_T = T

    def run(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        lse_base: str = "e",
        validate: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention for the planned rows. Returns ``(out [T, H, 512], lse [T, H] fp32 in lse_base)``.

        ``out``/``lse`` may be caller-provided buffers (no allocation; sharing no memory with ``q``,
        ``kv_cache`` or each other). ``validate``: check that
        the planned slots lie in ``[0, num_slots)`` (one host read; the reference's ``ValueError``).
        ``False``: no host sync; out-of-range slots are clamped on the device (never read out
        of bounds) and their rows' output and LSE are NaN. Emptiness is the count: an empty row
        gives 0 / ``-inf``; a non-empty row never gives ``-inf`` (NaN instead), so the merge
        never mistakes corrupt data for an empty rank.
        """
        from dcp_ref.contracts import check_bool

        validate = check_bool(validate, "validate")
        if self._planned_T is None:
            raise ValueError("call plan(slots, counts) before run()")
        if lse_base not in ("e", "2"):
            raise ValueError(f"lse_base must be 'e' or '2', got {lse_base!r}")
        T, H, dqk = self._planned_T, self.num_heads, self.head_dim_ckv + self.head_dim_kpe
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (T, H, dqk):
            raise ValueError(
                f"q must be a tensor of shape (T={T}, H={H}, {dqk}), got {getattr(q, 'shape', type(q).__name__)}"
            )
        if q.dtype != self.dtype:
            raise TypeError(f"q must have dtype {self.dtype}, got {q.dtype}")
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype != self.dtype:
            raise TypeError(
                f"kv_cache must be a {self.dtype} tensor, got {getattr(kv_cache, 'dtype', type(kv_cache).__name__)}"
            )
        if kv_cache.ndim == 2 and kv_cache.shape[1] == dqk:
            kv_cache = kv_cache.unsqueeze(1)  # page_size 1: [num_slots, 1, 576]
        if kv_cache.ndim != 3 or kv_cache.shape[1:] != (1, dqk):
            raise ValueError(
                f"kv_cache must be [num_slots, {dqk}] or [num_slots, 1, {dqk}], got {tuple(kv_cache.shape)}"
            )
        for name, t in (("q", q), ("kv_cache", kv_cache)):
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device}, got {t.device}")
        num_slots = kv_cache.shape[0]
        lens = self._csr.kv_len
        bad_row = (self._row_lo < 0) | (self._row_hi >= num_slots)  # [T] on the device
        if validate:
            if T and bool(bad_row.any()):
                lo, hi = int(self._row_lo.min()), int(self._row_hi.max())
                raise ValueError(f"slots[t, :counts[t]] must lie in [0, num_slots={num_slots}), got min {lo}, max {hi}")
        elif num_slots == 0:
            raise ValueError("kv_cache must hold at least one slot (num_slots=0): nothing could be read")
        else:
            self._csr.kv_indices.clamp_(min=0, max=num_slots - 1)  # FlashInfer reads these at run time
        if out is None:
            out = torch.empty((T, H, self.head_dim_ckv), dtype=self.dtype, device=self.device)
        elif tuple(out.shape) != (T, H, self.head_dim_ckv) or out.dtype != self.dtype or out.device != self.device:
            raise ValueError(f"out must be a {self.dtype} tensor of shape {(T, H, self.head_dim_ckv)} on {self.device}")
        if lse is None:
            lse = torch.empty((T, H), dtype=torch.float32, device=self.device)
        elif tuple(lse.shape) != (T, H) or lse.dtype != torch.float32 or lse.device != self.device:
            raise ValueError(f"lse must be a float32 tensor of shape {(T, H)} on {self.device}")
        from dcp_ref.contracts import check_no_alias

        check_no_alias(out, "out", q=q, kv_cache=kv_cache)
        check_no_alias(lse, "lse", q=q, kv_cache=kv_cache, out=out)
        if self.accepts_out_buffers:
            try:
                o, l2 = self._wrapper.run(query=q, kv_cache=kv_cache, out=out, lse=lse, return_lse=True)
            except (TypeError, ValueError, RuntimeError):
                # A version whose run() rejects our buffers: remember, and fall back to copying.
                self.accepts_out_buffers = False
        if not self.accepts_out_buffers:
            o, l2 = self._wrapper.run(query=q, kv_cache=kv_cache, return_lse=True)
        # Some versions return their own tensors even when given buffers: copy back if so.
        if o.data_ptr() != out.data_ptr():
            out.copy_(o)
        if l2.data_ptr() != lse.data_ptr():
            from dcp_ref.lse import normalize_lse_shape

            lse.copy_(normalize_lse_shape(l2, T, H))
        if lse_base == "e":
            lse.mul_(LN2)  # log2-domain -> natural log; -inf stays -inf
        # Emptiness is the count: -inf exactly for empty rows (output 0), NaN for a non-empty row
        # that came out -inf (corrupt data) or read out-of-range slots (validate=False).
        empty = (lens == 0).unsqueeze(1)
        poison = bad_row.unsqueeze(1) | (~empty & (lse == float("-inf")))
        lse.masked_fill_(empty, float("-inf")).masked_fill_(poison, float("nan"))
        out.masked_fill_(empty.unsqueeze(-1), 0.0).masked_fill_(poison.unsqueeze(-1), float("nan"))
        return out, lse


def sparse_mla_flashinfer(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    sm_scale: float,
    lse_base: str = "e",
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot plan + run (allocates a wrapper; for tests and notebooks, not the hot path).

    Same contract as :func:`dcp_ref.attention.sparse_mla_attention` (``validate`` too) but in
    bf16/fp16 on a GPU: returns ``(out [T, H, 512] q.dtype, lse [T, H] fp32 in lse_base)``.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.ndim != 3 or q.shape[2] <= 512:
        raise ValueError(f"q must be a 3-D tensor [T, H, 512 + rope dims], got shape {tuple(q.shape)}")
    attn = FlashInferSparseMLA(q.shape[1], sm_scale, device=q.device, dtype=q.dtype, head_dim_kpe=q.shape[2] - 512)
    attn.plan(slots, counts, validate=validate)
    return attn.run(q, kv_cache, lse_base=lse_base, validate=validate)


def sparse_mla_trtllm_blackwell(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    sm_scale: float,
    workspace: torch.Tensor,
    *,
    qk_nope_head_dim: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """**UNTESTED** — Blackwell (SM100/SM103) trtllm-gen sparse MLA over ``[T, K]`` slots.

    No plan and no CSR: the kernel reads ``slots`` (token-level indices into the flattened paged
    cache, ``-1`` padding) and ``counts`` directly, so it needs no host sync. This has never run:
    the project's GPU is an H200 (SM90), so the call raises there. The LSE base it returns has not
    been checked here either; verify it (as ``tests/test_attention.py`` does for FA3) before use.

    Args:
        q: ``[T, H, 576]`` bf16. kv_cache: ``[num_pages, page_size, 576]`` bf16.
        slots: int32 ``[T, K]``. counts: int32 ``[T]``. workspace: uint8 buffer (zeroed, 128 MiB).
    Returns: ``(out [T, H, 512], lse)`` as FlashInfer returns them.
    """
    if not torch.cuda.is_available() or q.device.type != "cuda":
        raise RuntimeError("sparse_mla_trtllm_blackwell needs a CUDA device")
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 10:
        raise RuntimeError(
            f"sparse_mla_trtllm_blackwell needs SM100/SM103 (Blackwell), this device is SM{major}{minor}; "
            "use FlashInferSparseMLA (FA3) on Hopper"
        )
    _, K = _check_slots_counts(slots, counts)
    _flashinfer()
    from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

    return trtllm_batch_decode_with_kv_cache_mla(
        query=q.unsqueeze(1),
        kv_cache=kv_cache.unsqueeze(1),
        workspace_buffer=workspace,
        qk_nope_head_dim=qk_nope_head_dim,
        kv_lora_rank=512,
        qk_rope_head_dim=q.shape[-1] - 512,
        block_tables=slots.to(torch.int32).unsqueeze(1),
        seq_lens=counts.to(torch.int32),
        max_seq_len=K,
        sparse_mla_top_k=K,
        bmm1_scale=float(sm_scale),
        bmm2_scale=1.0,
        return_lse=True,
    )
