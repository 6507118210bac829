"""The stage protocol: what each stage of one decode layer takes and returns.

One layer on rank ``r`` of ``W`` (names, not numbers; which stages run depends on the
:class:`StepSpec`: its ``layout``, ``exchange``, ``combine``, and whether the step scores the index
keys itself)::

    ownership    global lengths -> this rank's local causal bound per query token      (the step's metadata)
    -- query gather: all-gather q over heads, [T, H/W, D] -> [T, H, D]  (dcp, unless the query is replicated)
    scoring      FP8 index query x this rank's FP8 index keys -> index scores [T, L]    (or precomputed scores)
    indexer      local stable top-K of the scores -> candidates
    -- all-gather of the candidates (W > 1)
    exchange "allgather":  select (stable global top-k ids) then deinterleave (ids -> this rank's slots)
    exchange "owner":      select_to_slots (the gathered candidates -> this rank's winners' slots, one stage)
    attention    sparse MLA over (slots, counts): partial output + LSE (base e, -inf when empty)
    guard        tokens whose metadata is out of contract -> NaN output and LSE (:mod:`dcp_ref.guard`)
    combine "reduce_scatter": all-gather LSEs, correct (this rank's partial by them), reduce-scatter over heads
    combine "alltoall":       partials of rank j's heads + their LSEs to rank j, combine the W partials

The ``"tp"`` layout is the same machinery with the whole context on every rank and ``H/W`` heads:
no query gather, no exchange across ranks (``W = 1`` for the cache), no combine.

The pieces live in one module each, by kind, all re-exported here: what a step is planned for
(:mod:`dcp_ref.spec`: :class:`StepSpec`, :class:`ScoringSpec`; its option axes :mod:`dcp_ref.options`), what
each stage takes and returns (:mod:`dcp_ref.protocols`), the plain-PyTorch reference of each
(:mod:`dcp_ref.reference_stages`), where each lives in the project (:mod:`dcp_ref.stage_map`); this module is
the registry: :class:`Stages`, :data:`REFERENCE_STAGES`, :func:`register_stages`, :func:`resolve_stages`.

A :class:`Stages` value names one implementation per stage. :data:`REFERENCE_STAGES` is the
plain-PyTorch reference (this module, built on the oracle functions of :mod:`dcp_ref`); the GPU
kernels register theirs in :mod:`dcp_ref.kernels.stages` (``dcp_ref`` never imports kernels: a
caller hands the step the ``Stages`` it wants). Replace any stage with your own callable::

    mine = REFERENCE_STAGES.with_(select=my_select)        # a function with select's signature
    step = PlannedStep(group, spec, mine)                  # dcp_ref.step

Every stage accepts caller-provided output buffers (``out=`` ...) and must write its result
there when given, so that the planned step allocates nothing while it runs. Each stage's
contract (shapes, dtypes, what an empty row produces) is in its ``Protocol`` below; the
conformance kit :mod:`dcp_ref.testing` checks an implementation against it.

**Out-of-contract metadata** (a ``validate=False`` run): the guard stage poisons the affected tokens
(NaN output and LSE on every rank), so no stage needs to raise on the device; stages that meet such a
row themselves clamp their reads and, where they can tell (a request id outside the block table, a
selected key without a block), emit the poison slot ``2**31 - 1``, which the attention turns into NaN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .options import COMBINES, EXCHANGES, LAYOUTS, ORDERS
from .protocols import (
    AttentionStage,
    CombineStage,
    CorrectStage,
    DeinterleaveStage,
    GuardStage,
    IndexerStage,
    ScoringStage,
    SelectStage,
    SelectToSlotsStage,
)
from .reference_stages import (
    FLOAT_OUT,
    compose_indexer,
    impl_name,
    named_impl,
    reference_attention,
    reference_attention_fp8,
    reference_combine,
    reference_correct,
    reference_deinterleave,
    reference_guard,
    reference_indexer,
    reference_scoring,
    reference_select,
    reference_select_to_slots,
    write_into,
    write_outs,
)
from .spec import ATTENTION_LAYOUTS, KV_FORMATS, ScoringSpec, StepSpec, kv_format_of
from .stage_map import AWAITING_DEVICE, STAGE_MAP, StageInfo

__all__ = [
    "STAGE_NAMES",
    "StageInfo",
    "STAGE_MAP",
    "AWAITING_DEVICE",
    "ATTENTION_LAYOUTS",
    "LAYOUTS",
    "EXCHANGES",
    "ORDERS",
    "COMBINES",
    "ScoringSpec",
    "StepSpec",
    "Stages",
    "REFERENCE_STAGES",
    "IndexerStage",
    "SelectStage",
    "DeinterleaveStage",
    "AttentionStage",
    "CorrectStage",
    "ScoringStage",
    "SelectToSlotsStage",
    "GuardStage",
    "CombineStage",
    "reference_scoring",
    "reference_indexer",
    "reference_select",
    "reference_deinterleave",
    "reference_attention",
    "reference_correct",
    "reference_select_to_slots",
    "reference_guard",
    "reference_combine",
    "compose_indexer",
    "impl_name",
    "named_impl",
    "FLOAT_OUT",
    "write_into",
    "write_outs",
    "STAGE_PROVIDERS",
    "register_stages",
    "resolve_stages",
    "KV_FORMATS",
    "kv_format_of",
    "reference_attention_fp8",
    "FP8_REFERENCE_STAGES",
]

#: The stages a :class:`Stages` value implements, in step order (a run uses the ones its spec needs).
STAGE_NAMES = (
    "scoring",
    "indexer",
    "select",
    "deinterleave",
    "select_to_slots",
    "attention",
    "guard",
    "correct",
    "combine",
)


@dataclass(frozen=True)
class Stages:
    """One implementation per stage (see the module docstring and each stage's ``Protocol``).

    Attributes:
        scoring, indexer, select, deinterleave, select_to_slots, attention, guard, correct, combine:
            the stage callables (:data:`STAGE_NAMES`); a step calls the ones its :class:`StepSpec` needs.
        attention_layout: ``"compact"`` or ``"masked"`` (see :data:`ATTENTION_LAYOUTS`): what the
            attention stage reads, hence whether the step asks the deinterleave stage to compact.
        partial_dtype: the dtype of the attention stage's output buffer for a query dtype (a kernel
            writes bf16 for bf16 queries; the reference keeps the query dtype).
        prepare: optional hook ``prepare(spec, stages)`` run once per planned step (compile and warm kernels,
            choose a kernel per shape, build the workspaces the step's stages keep); ``stages`` is the value being
            planned (a :meth:`with_` copy keeps the hook, so the hook sees the caller's replacements and keeps
            them). The step calls it under :data:`dcp_ref.step.PLAN_LOCK` (CuTeDSL compilation is not
            thread-safe). It may return a :class:`Stages` to plan with instead (e.g. the faster attention for
            this shape, bound to its buffers), or ``None``.
        name: a label for the set.
        notes: why each stage runs what it runs (e.g. a kernel's fallback reason), for the trace.

    Every stage field is checked when the value is built (a callable); :meth:`with_` checks the rest.
    """

    scoring: ScoringStage = reference_scoring
    indexer: IndexerStage = reference_indexer
    select: SelectStage = reference_select
    deinterleave: DeinterleaveStage = reference_deinterleave
    select_to_slots: SelectToSlotsStage = reference_select_to_slots
    attention: AttentionStage = reference_attention
    guard: GuardStage = reference_guard
    correct: CorrectStage = reference_correct
    combine: CombineStage = reference_combine
    attention_layout: str = "compact"
    partial_dtype: Callable[[torch.dtype], torch.dtype] = field(default=lambda d: d)
    prepare: Callable[[StepSpec, Stages], Stages | None] | None = None
    name: str = "reference"
    notes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for stage in STAGE_NAMES:
            if not callable(getattr(self, stage)):
                raise TypeError(f"{stage} must be callable, got {type(getattr(self, stage)).__name__}")
        if self.attention_layout not in ATTENTION_LAYOUTS:
            raise ValueError(f"attention_layout must be one of {ATTENTION_LAYOUTS}, got {self.attention_layout!r}")
        if not callable(self.partial_dtype):
            raise TypeError(f"partial_dtype must be callable, got {type(self.partial_dtype).__name__}")
        if self.prepare is not None and not callable(self.prepare):
            raise TypeError(f"prepare must be callable or None, got {type(self.prepare).__name__}")
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        if not isinstance(self.notes, tuple) or not all(
            isinstance(n, tuple) and len(n) == 2 and all(isinstance(x, str) for x in n) for n in self.notes
        ):
            raise TypeError("notes must be a tuple of (stage, reason) string pairs")

    def with_(self, **stages: Any) -> Stages:
        """A copy with some stages (or ``attention_layout``, ``partial_dtype``, ``prepare``, ``name``) replaced.

        Every value is checked here, when the copy is built (a stage that is not callable, an unknown
        layout), not when the step first calls it."""
        unknown = set(stages) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown stage(s) {sorted(unknown)}; stages are {STAGE_NAMES}")
        if "name" not in stages and set(stages) & set(STAGE_NAMES):
            stages["name"] = f"{self.name}+custom"
        return dataclasses.replace(self, **stages)

    def impls(self, names: tuple[str, ...] = STAGE_NAMES) -> dict[str, str]:
        """``{stage: implementation name}`` for ``names`` (default: every stage), in step order."""
        return {stage: impl_name(getattr(self, stage)) for stage in names}


#: The plain-PyTorch reference of every stage (float64 attention over a native-format cache).
REFERENCE_STAGES = Stages()
#: The reference over an FP8 (``fp8_ds_mla``) cache: the attention dequantizes exactly as FlashMLA's FP8
#: decode and reads the uncompacted slots (``attention_layout="masked"``), so no compaction runs.
FP8_REFERENCE_STAGES = Stages(attention=reference_attention_fp8, attention_layout="masked", name="reference-fp8")


#: Named sets of stages that live outside :mod:`dcp_ref` (it never imports them itself): name ->
#: ``"module:factory"``, loaded on first use. A factory takes the :class:`StepSpec` and returns a :class:`Stages`.
#: :mod:`dcp_ref.kernels.stages` provides ``"kernels"``; register your own
#: with :func:`register_stages`.
STAGE_PROVIDERS: dict[str, str] = {"kernels": "dcp_ref.kernels.stages:kernel_stages"}


def register_stages(name: str, factory: str | Callable[..., Stages]) -> None:
    """Make ``resolve_stages(name, ...)`` build stages with ``factory`` (a callable or ``"module:function"``)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if name == "reference":
        raise ValueError("name 'reference' is reserved for REFERENCE_STAGES")
    _FACTORIES.pop(name, None)
    if callable(factory):
        _FACTORIES[name] = factory
        STAGE_PROVIDERS[name] = f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', '?')}"
    elif isinstance(factory, str) and ":" in factory:
        STAGE_PROVIDERS[name] = factory
    else:
        raise TypeError(f"factory must be a callable or 'module:function', got {factory!r}")


_FACTORIES: dict[str, Callable[..., Stages]] = {}


def resolve_stages(stages: Stages | str, spec: StepSpec) -> Stages:
    """The :class:`Stages` that ``stages`` names for a step planned for ``spec``.

    ``stages``: a :class:`Stages` (returned as is), ``"reference"`` (:data:`FP8_REFERENCE_STAGES` for an
    ``fp8_ds_mla`` cache, else :data:`REFERENCE_STAGES`), or a name in :data:`STAGE_PROVIDERS` (e.g.
    ``"kernels"``: each stage on its kernel where it can run on ``spec.device``, the reference otherwise, with
    the reason logged once and kept in ``Stages.notes``). A provider's factory is called as ``factory(spec)``:
    the spec holds everything a choice of kernels may depend on (device, dtype, dims, heads, top-k, the cache's
    format), so nothing is said twice.
    """
    if not isinstance(spec, StepSpec):
        raise TypeError(f"spec must be a dcp_ref.stages.StepSpec, got {type(spec).__name__}")
    if isinstance(stages, Stages):
        return stages
    if not isinstance(stages, str):
        raise TypeError(f"stages must be a Stages value or a name, got {type(stages).__name__}")
    if stages == "reference":
        return FP8_REFERENCE_STAGES if spec.kv_format == "fp8_ds_mla" else REFERENCE_STAGES
    if stages not in STAGE_PROVIDERS:
        raise ValueError(
            f"stages must be 'reference', one of {sorted(STAGE_PROVIDERS)} or a Stages value, got {stages!r}"
        )
    factory = _FACTORIES.get(stages)
    if factory is None:
        import importlib

        mod, _, fn = STAGE_PROVIDERS[stages].partition(":")
        factory = getattr(importlib.import_module(mod), fn)
        _FACTORIES[stages] = factory
    result = factory(spec)
    if not isinstance(result, Stages):
        raise TypeError(f"the {stages!r} stage provider returned {type(result).__name__}, not Stages")
    return result
