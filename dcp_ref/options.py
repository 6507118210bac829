"""The layer's options as one value: how a decode layer lays out, exchanges, orders and combines (torch-free).

One :class:`LayerOptions` value is what :class:`~dcp_ref.stages.StepSpec` plans for, what the cost model
(:mod:`dcp_ref.costmodel`) prices, what the data-flow drawings (:mod:`dcp_ref.viz.dataflow`) draw and what the
benchmarks label their rows with — one set of defaults, checked in one place (:meth:`LayerOptions.__post_init__`).

Every axis, and what it changes in a layer on rank ``r`` of ``W``:

- ``layout``: ``"dcp"`` (the KV cache and the FP8 index keys sharded by token over the W ranks, every head on
  every rank) or ``"tp"`` (tensor parallelism, the layout DCP is compared with: every rank holds the whole
  context and ``H/W`` heads; no collective inside attention).
- ``q_replicate`` (dcp): ``True``, the caller passes all ``H`` query heads (the query projection replicated on
  every rank: more weight memory, no collective); ``False``, ``q`` arrives as this rank's ``H/W`` heads and the
  step all-gathers it over heads.
- ``exchange``: ``"allgather"`` (every rank selects the whole global top-k, then maps the ids it owns to
  slots: select + deinterleave) or ``"owner"`` (one select_to_slots stage emits only this rank's winners).
- ``order``: the total order of the global selection, both exact: ``"global_id"`` (score descending, then lower
  global id: vLLM's; candidates travel as (score, id) pairs, 8 bytes) or ``"rank_local"`` (score descending,
  then lower rank, then lower local index; scores only, 4 bytes; needs ``exchange="owner"``).
- ``combine``: ``"reduce_scatter"`` (all-gather the LSEs, correct, reduce-scatter: two collectives) or
  ``"alltoall"`` (one all-to-all of partials + LSEs, then a merge of W partials over ``H/W`` heads).

:data:`PLANNED` is the layer the project recommends (owner-local exchange of scores only, one all-to-all, the
query arriving as ``H/W`` heads: what vLLM's DCP receives).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .contracts import check_choice

__all__ = ["LAYOUTS", "EXCHANGES", "ORDERS", "COMBINES", "LayerOptions", "DEFAULT", "PLANNED"]

#: ``layout`` choices (module docstring).
LAYOUTS = ("dcp", "tp")
#: ``exchange`` choices.
EXCHANGES = ("allgather", "owner")
#: ``order`` choices.
ORDERS = ("global_id", "rank_local")
#: ``combine`` choices.
COMBINES = ("reduce_scatter", "alltoall")

_SHORT = {"q_replicate": "replicate", "exchange": "exchange", "order": "order", "combine": "combine"}


@dataclass(frozen=True, kw_only=True)
class LayerOptions:
    """One choice per option axis of the layer (module docstring); every field keyword-only, checked here.

    Attributes:
        layout: ``"dcp"`` or ``"tp"`` (:data:`LAYOUTS`).
        exchange: ``"allgather"`` or ``"owner"`` (:data:`EXCHANGES`).
        order: ``"global_id"`` or ``"rank_local"`` (:data:`ORDERS`; ``"rank_local"`` needs ``exchange="owner"``).
        combine: ``"reduce_scatter"`` or ``"alltoall"`` (:data:`COMBINES`).
        q_replicate: dcp only: the query arrives with all ``H`` heads (``True``) or as ``H/W`` (``False``).
    """

    layout: str = "dcp"
    exchange: str = "allgather"
    order: str = "global_id"
    combine: str = "reduce_scatter"
    q_replicate: bool = True

    def __post_init__(self) -> None:
        check_choice(self.layout, "layout", LAYOUTS)
        check_choice(self.exchange, "exchange", EXCHANGES)
        check_choice(self.order, "order", ORDERS)
        check_choice(self.combine, "combine", COMBINES)
        if self.order == "rank_local" and self.exchange != "owner":
            raise ValueError(
                "order='rank_local' needs exchange='owner' (ids do not travel, so only owners can map them)"
            )
        if not isinstance(self.q_replicate, bool):
            raise TypeError(f"q_replicate must be a bool, got {type(self.q_replicate).__name__}")

    def replace(self, **changes: Any) -> LayerOptions:
        """A copy with some axes changed (checked again)."""
        return LayerOptions(**{**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        """The five axes by name (the keywords :class:`~dcp_ref.stages.StepSpec` takes)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def label(self) -> str:
        """A short, stable label for tables and benchmark rows: the axes that differ from :data:`DEFAULT`,
        e.g. ``"dcp"``, ``"tp"``, ``"dcp exchange=owner order=rank_local combine=alltoall replicate=False"``."""
        parts = [self.layout]
        for name, short in _SHORT.items():
            value = getattr(self, name)
            if value != getattr(DEFAULT, name):
                parts.append(f"{short}={value}")
        return " ".join(parts)

    @classmethod
    def from_label(cls, label: str) -> LayerOptions:
        """The options a :attr:`label` names (its inverse)."""
        if not isinstance(label, str) or not label.split():
            raise ValueError(f"label must be a layout followed by name=value axes, got {label!r}")
        layout, *rest = label.split()
        kw: dict[str, Any] = {"layout": layout}
        names = {short: name for name, short in _SHORT.items()}
        for part in rest:
            short, sep, value = part.partition("=")
            if not sep or short not in names:
                raise ValueError(f"label has an unknown axis {part!r}; known: {sorted(names)}")
            name = names[short]
            if name == "q_replicate":
                if value not in ("True", "False"):
                    raise ValueError(f"label's replicate must be True or False, got {value!r}")
                kw[name] = value == "True"
            else:
                kw[name] = value
        return cls(**kw)


#: The defaults (what ``StepSpec`` plans when no axis is given).
DEFAULT = LayerOptions()
#: The layer this project recommends (module docstring): what chapters 07 and 10 run and price, and the
#: benchmarks' layer rows plan at W > 1.
PLANNED = LayerOptions(exchange="owner", order="rank_local", combine="alltoall", q_replicate=False)
