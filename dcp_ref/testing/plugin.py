"""pytest plugin: the ``dcp_conformance`` fixture, so your test suite can check your kernels.

Enable it with ``-p dcp_ref.testing.plugin`` (or ``pytest_plugins = ["dcp_ref.testing.plugin"]`` in
your root ``conftest.py``); an installed dcp-ref registers it through a ``pytest11`` entry point
named after this module, so that those two spellings stay harmless when it is installed::

    def test_my_select(dcp_conformance):
        dcp_conformance.select(my_topk, sorted=False)

    def test_my_attention(dcp_conformance):
        dcp_conformance.attention(my_attention, lse_base="2", dtype=torch.bfloat16, device="cuda")

Each method is the checker of :mod:`dcp_ref.testing.checks` of the same name (``select`` is
:func:`~dcp_ref.testing.checks.check_select`, ...) with the session's defaults filled in; a failure
is a :class:`~dcp_ref.testing.checks.ConformanceError` whose message holds the smallest failing case
as code. Command-line options (when the plugin is loaded with ``-p`` or the entry point):
``--dcp-max-examples N``, ``--dcp-device DEVICE``, ``--dcp-seed N``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["DcpConformance", "dcp_conformance", "pytest_addoption"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dcp-ref", "dcp-ref conformance kit (dcp_ref.testing)")
    group.addoption(
        "--dcp-max-examples",
        type=int,
        default=None,
        dest="dcp_max_examples",
        help="cases per conformance check (default: dcp_ref.testing.checks.DEFAULT_MAX_EXAMPLES)",
    )
    group.addoption(
        "--dcp-device",
        default=None,
        dest="dcp_device",
        help="device of the conformance checks' inputs when a test does not say (default: cpu)",
    )
    group.addoption(
        "--dcp-seed",
        type=int,
        default=None,
        dest="dcp_seed",
        help="a Hypothesis seed instead of the derandomized default",
    )


class DcpConformance:
    """The conformance checkers with session defaults (``device``, ``max_examples``, ``seed``).

    Methods: :meth:`indexer`, :meth:`local_topk`, :meth:`pack`, :meth:`select`, :meth:`deinterleave`,
    :meth:`attention`, :meth:`correct`, :meth:`step`, :meth:`stages` — each forwards to ``check_<name>``;
    an argument given in the call wins over the default.
    """

    def __init__(self, *, device: str | None = None, max_examples: int | None = None, seed: int | None = None) -> None:
        self.defaults: dict[str, Any] = {
            k: v for k, v in (("device", device), ("max_examples", max_examples), ("seed", seed)) if v is not None
        }

    def _check(self, name: str, impl: Any, kwargs: dict[str, Any]) -> None:
        __tracebackhide__ = True
        from . import checks

        fn: Callable[..., None] = getattr(checks, f"check_{name}")
        fn(impl, **{**self.defaults, **kwargs})

    def indexer(self, fn: Callable, **kwargs: Any) -> None:
        __tracebackhide__ = True
        self._check("indexer", fn, kwargs)

    def local_topk(self, fn: Callable, **kwargs: Any) -> None:
        __tracebackhide__ = True
        self._check("local_topk", fn, kwargs)

    def pack(self, fn: Callable, **kwargs: Any) -> None:
        __tracebackhide__ = True
        self._check("pack", fn, kwargs)

    def select(self, fn: Callable, **kwargs: Any) -> None:
        __tracebackhide__ = True
        self._check("select", fn, kwargs)

    def deinterleave(self, fn: Callable, **kwargs: Any) -> None:
        __tracebackhide__ = True
        self._check("deinterleave", fn, kwargs)

    def attention(self, fn: Callable, **kwargs: Any) -> None:
        __tracebackhide__ = True
        self._check("attention", fn, kwargs)

    def correct(self, fn: Callable, **kwargs: Any) -> None:
        __tracebackhide__ = True
        self._check("correct", fn, kwargs)

    def step(self, impl: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        self._check("step", impl, kwargs)

    def stages(self, stages: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        self._check("stages", stages, kwargs)


@pytest.fixture
def dcp_conformance(request: pytest.FixtureRequest) -> DcpConformance:
    """The conformance checkers (:class:`DcpConformance`), defaults from ``--dcp-*`` options."""
    cfg = request.config
    return DcpConformance(
        device=cfg.getoption("dcp_device", None),
        max_examples=cfg.getoption("dcp_max_examples", None),
        seed=cfg.getoption("dcp_seed", None),
    )
