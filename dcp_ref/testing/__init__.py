"""``dcp_ref.testing`` — a conformance kit for anyone's DCP stage implementations.

Check your own kernel for one stage, or your whole step, against the stage contracts of
:mod:`dcp_ref.stages`::

    from dcp_ref.testing import check_select
    check_select(my_topk, sorted=False)          # returns quietly, or raises ConformanceError

Each checker runs your callable on Hypothesis-generated and adversarial cases (ties, ±0, NaN, ±inf,
empty rows and ranks, short sequences, I > 1, up to 16 ranks, non-contiguous inputs, poisoned
output buffers), compares with a brute-force oracle within the tolerance of the dtype, and on a
mismatch raises :class:`ConformanceError` (an ``AssertionError``) holding the *smallest* failing
case as ready-to-paste Python, plus what differed. Deterministic by default.

* :mod:`dcp_ref.testing.checks` — ``check_indexer``, ``check_local_topk``, ``check_pack``,
  ``check_select``, ``check_deinterleave``, ``check_attention``, ``check_correct``, ``check_step``,
  ``check_stages``.
* :mod:`dcp_ref.testing.oracle` — the brute-force oracle of every stage and of a whole decode
  step on *your* tensors (KV caches, block tables, index scores, lengths): :func:`oracle.decode`.
* :mod:`dcp_ref.testing.strategies` — the Hypothesis strategies, public, for your own tests.
* :mod:`dcp_ref.testing.plugin` — a pytest plugin with the ``dcp_conformance`` fixture.
* ``python -m dcp_ref.testing MODULE:FUNCTION --stage select`` — the same from a shell.

Needs ``hypothesis`` (``pip install hypothesis``; ``import dcp_ref`` itself does not). The oracle
module works without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the names load lazily (__getattr__)
    from . import oracle, strategies
    from .checks import (
        ConformanceError,
        check_attention,
        check_combine,
        check_correct,
        check_deinterleave,
        check_guard,
        check_indexer,
        check_local_topk,
        check_pack,
        check_scoring,
        check_select,
        check_select_to_slots,
        check_stages,
        check_step,
        run_step_problem,
        tolerance,
    )
    from .strategies import StepProblem, make_step_problem, noncontiguous

__all__ = [
    "ConformanceError",
    "check_indexer",
    "check_local_topk",
    "check_pack",
    "check_select",
    "check_deinterleave",
    "check_select_to_slots",
    "check_guard",
    "check_scoring",
    "check_attention",
    "check_correct",
    "check_combine",
    "check_step",
    "check_stages",
    "run_step_problem",
    "tolerance",
    "noncontiguous",
    "make_step_problem",
    "StepProblem",
    "oracle",
    "strategies",
]

# Where each lazily loaded name lives (``__getattr__``): derived from ``__all__``, which stays a literal list
# for type checkers and linters.
_STRATEGIES = ("noncontiguous", "make_step_problem", "StepProblem")
_FROM = {n: "strategies" if n in _STRATEGIES else "checks" for n in __all__ if n not in ("oracle", "strategies")}


def __getattr__(name: str) -> Any:
    # Lazy: `dcp_ref.testing.oracle` imports without hypothesis; the checkers need it.
    if name in ("oracle", "strategies", "checks", "plugin"):
        return _load(name)
    if name in _FROM:
        return getattr(_load(_FROM[name]), name)
    raise AttributeError(f"module 'dcp_ref.testing' has no attribute {name!r}")


def _load(module: str) -> Any:
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as e:
        if e.name == "hypothesis":
            raise ModuleNotFoundError(
                "dcp_ref.testing needs hypothesis (pip install hypothesis, or pip install 'dcp-ref[test]')",
                name="hypothesis",
            ) from e
        raise


def __dir__() -> list[str]:
    return sorted(__all__)
