"""The conformance checkers: one per stage contract, one for the whole step.

Every ``check_*`` takes *your* callable and the conventions it declares, runs it on cases drawn by
:mod:`dcp_ref.testing.strategies` (Hypothesis: random *and* adversarial — ties, ``±0``, NaN,
``±inf``, empty rows and ranks, short sequences, ``I > 1``, up to 16 ranks, non-contiguous inputs,
poisoned output buffers), compares each result with the brute-force oracle
(:mod:`dcp_ref.testing.oracle`) within the tolerance of the dtype, and returns quietly when every
case conforms. Otherwise it raises :class:`ConformanceError` (an ``AssertionError``) with the
**smallest** failing case Hypothesis could shrink to, as Python code you can paste to reproduce
it, and what differed.

Runs are deterministic (``derandomize=True``, no example database) unless you pass ``seed``;
``max_examples`` trades time for coverage (the defaults take seconds on a CPU). After the drawn cases
pass, every checker also runs a few hand-built adversarial cases (``strategies.adversarial_*``: a
``-0.0``/``+0.0`` tie, a tie whose lower id sits on the later rank, ``-inf`` and NaN scores, negative
block entries other than ``-1``, a request id outside the block table, NaN / ``+inf`` / near-``float32``-
maximum LSEs), so those corners are covered whatever ``max_examples`` is. ``shrink_budget=0`` reports
the first failing case as drawn (no shrinking: the fastest run, e.g. for mutation tests).

==============================  ======================================================================
checker                         calls your ``fn`` as
==============================  ======================================================================
:func:`check_indexer`           ``fn(scores, lengths, geometry, k, row_starts=None)`` -> ``[T, k, 2]``
:func:`check_local_topk`        ``fn(scores, k, lengths, row_starts)`` -> int ``[T, k]`` local indices
:func:`check_pack`              ``fn(scores, local_ids, geometry, row_starts)`` -> ``[T, K, 2]``
:func:`check_select`            ``fn(gathered, k)`` -> int32 ``[T, k]``
:func:`check_deinterleave`      ``fn(global_ids, req_of_token, block_table, geometry)`` -> ``(slots, counts)``
:func:`check_attention`         ``fn(q, kv_cache, slots, counts, sm_scale, v_dim)`` -> ``(out, lse)``
:func:`check_correct`             ``fn(partial, all_lse, rank)`` -> ``(corrected, merged_lse)``
:func:`check_step`              a :class:`~dcp_ref.stages.Stages`, a dict of stages, or a whole step
==============================  ======================================================================

These are the signatures of the stage protocol (:mod:`dcp_ref.stages`); wrap a function with
another signature in a ``lambda``. When your function accepts the protocol's output buffers
(``out=`` ...), about half of the cases pass poisoned buffers and check that the result lands in
them (``out_buffers="auto"``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from . import oracle
from . import strategies as S
from .strategies import Case

__all__ = [
    "ConformanceError",
    "DEFAULT_MAX_EXAMPLES",
    "tolerance",
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
]

#: Cases per checker when ``max_examples`` is not given (seconds on a CPU for torch implementations).
DEFAULT_MAX_EXAMPLES = 40
#: After the first failure, at most this many more calls are spent shrinking it.
DEFAULT_SHRINK_BUDGET = 400
_EMPTY_LSE = ("-inf", "+inf", "nan", "any")


class ConformanceError(AssertionError):
    """An implementation disagrees with the stage contract on (at least) one case.

    Attributes:
        stage: the stage checked.  conventions: what was declared (semantics, LSE base, device, ...).
        reproducer: Python code that rebuilds the smallest failing case and calls the implementation.
        differences: what differed, in words (rows, ids, errors).
        case: the :class:`~dcp_ref.testing.strategies.Case` itself.  calls: calls made before giving up.
    """

    def __init__(self, stage: str, conventions: str, reproducer: str, differences: str, case: Case, calls: int) -> None:
        self.stage, self.conventions, self.reproducer, self.differences = stage, conventions, reproducer, differences
        self.case, self.calls = case, calls
        indented = "\n".join("    " + line for line in reproducer.splitlines())
        differences = "\n".join("  " + line.strip() for line in differences.splitlines())
        super().__init__(
            f"{stage} does not conform ({conventions}). Smallest failing case found by hypothesis "
            f"({calls} calls):\n\n{differences}\n\nReproducer:\n\n{indented}\n"
        )


class _Mismatch(Exception):
    def __init__(self, case: Case, message: str) -> None:
        super().__init__(message)
        self.case, self.message = case, message


# ---- tolerances ---------------------------------------------------------------------------------
_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def tolerance(*dtypes: torch.dtype) -> float:
    """Relative tolerance of the coarsest of ``dtypes``: float64 ``1e-12``, float32 ``1e-5``,
    float16 ``2e-3``, bfloat16 ``1.6e-2`` (a few units in the last place of the output)."""
    return max(_TOL.get(d, 1e-5) for d in dtypes)


def _acc_eps(*dtypes: torch.dtype) -> float:
    """Rounding unit of the arithmetic a kernel accumulates in: float64 only if everything is."""
    return 2.0**-52 if all(d == torch.float64 for d in dtypes) else 2.0**-23


# ---- running one checker ------------------------------------------------------------------------
def _fn_ref(fn: Callable) -> tuple[str, str]:
    """How the reproducer names ``fn``: ``(name, import line)``."""
    name = getattr(fn, "__name__", None)
    if not (isinstance(name, str) and name.isidentifier()):
        return "fn", "# fn = <your implementation>"
    mod = getattr(fn, "__module__", None)
    if (
        mod
        and mod != "__main__"
        and getattr(fn, "__qualname__", None) == name
        and getattr(sys.modules.get(mod), name, None) is fn
    ):
        return name, f"from {mod} import {name}"
    return name, ""


def _accepts(fn: Callable, kw: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == kw or p.kind == p.VAR_KEYWORD for p in params)


def _with_out(fn: Callable, out_buffers: bool | str, kw: str = "out") -> bool:
    if out_buffers == "auto":
        return _accepts(fn, kw)
    if not isinstance(out_buffers, bool):
        raise ValueError(f"out_buffers must be True, False or 'auto', got {out_buffers!r}")
    return out_buffers


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-ish equality with NaN == NaN (what "unchanged" means for an input)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool((a == b).all())


@dataclass
class _Call:
    result: Any
    buffers: dict[str, torch.Tensor]
    inputs: dict[str, Any]


def _invoke(
    fn: Callable,
    case: Case,
    device: torch.device,
    extra_kwargs: dict[str, Any] | None = None,
    in_place: tuple[str, ...] = (),
) -> _Call:
    """Call ``fn`` on the case; a raised exception or a modified input becomes a mismatch message (except the
    inputs named in ``in_place``, which the stage writes: read them back from ``_Call.inputs``)."""
    args, kwargs, buffers = case.build(device)
    kwargs.update(extra_kwargs or {})
    snapshot = {
        n: (a.clone() if isinstance(a, torch.Tensor) and n not in in_place else None) for n, a in zip(case.args, args)
    }
    snapshot.update({n: kwargs[n].clone() for n in case.kwargs if isinstance(kwargs.get(n), torch.Tensor)})
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any exception on a valid input is non-conformance
        tb = traceback.extract_tb(e.__traceback__)
        where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
        raise _Mismatch(case, f"raised {type(e).__name__}: {e}{where} on a valid input") from None
    for n, a in list(zip(case.args, args)) + [(n, kwargs[n]) for n in case.kwargs]:
        before = snapshot.get(n)
        if before is not None and not _same(a, before):
            raise _Mismatch(case, f"modified its input `{n}` (inputs must be left unchanged)")
    return _Call(result, buffers, {**dict(zip(case.args, args)), **{n: kwargs[n] for n in case.kwargs}})


def _cpu(x: Any, what: str, case: Case) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise _Mismatch(case, f"returned {type(x).__name__} for {what}, expected a torch.Tensor")
    return x.detach().cpu()


def _tuple2(res: Any, names: tuple[str, str], case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(res, (tuple, list)) and len(res) == 2):
        raise _Mismatch(case, f"returned {type(res).__name__}, expected a pair ({names[0]}, {names[1]})")
    return _cpu(res[0], names[0], case), _cpu(res[1], names[1], case)


def _written(call: _Call, name: str, got: torch.Tensor, case: Case) -> torch.Tensor:
    """With an output buffer offered, the result must be in it: return the buffer's contents."""
    buf = call.buffers.get(name)
    if buf is None:
        return got
    b = buf.detach().cpu()
    if not _same(b, got) and not (b.shape == got.shape and _same(b.to(got.dtype), got)):
        raise _Mismatch(case, f"was given `{name}=` (a poisoned buffer) but did not write its result into it")
    return b


def _run(
    stage: str,
    conventions: str,
    fn: Callable,
    strategy: st.SearchStrategy[Case],
    evaluate: Callable[[Case], None],
    *,
    device: torch.device,
    max_examples: int | None,
    seed: int | None,
    shrink_budget: int,
    expected_code: Callable[[Case], str] | None = None,
    examples: Sequence[Case] = (),
) -> None:
    """Drive Hypothesis; on failure raise :class:`ConformanceError` for the shrunk case.

    ``examples``: hand-built adversarial cases (:mod:`~dcp_ref.testing.strategies`, ``adversarial_*``),
    run after the drawn ones pass, whatever ``max_examples`` is."""
    __tracebackhide__ = True
    n_examples = DEFAULT_MAX_EXAMPLES if max_examples is None else int(max_examples)
    if n_examples < 1:
        raise ValueError(f"max_examples must be >= 1, got {max_examples}")
    if isinstance(shrink_budget, bool) or not isinstance(shrink_budget, int) or shrink_budget < 0:
        raise ValueError(f"shrink_budget must be an int >= 0, got {shrink_budget!r}")
    calls = 0
    first_fail: int | None = None
    failing: set[str] = set()

    def prop(case: Case) -> None:
        nonlocal calls, first_fail
        calls += 1
        key = None
        if first_fail is not None and calls - first_fail > shrink_budget:
            # Shrink budget spent: only replay failures already seen (Hypothesis then keeps the best so far).
            key = repr(case)
            if key not in failing:
                return
        try:
            evaluate(case)
        except _Mismatch:
            if first_fail is None:
                first_fail = calls
            failing.add(key or repr(case))
            raise

    test = settings(
        max_examples=n_examples,
        derandomize=seed is None,
        database=None,
        deadline=None,
        print_blob=False,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        # shrink_budget=0: report the first failing case as drawn (no shrinking at all: fastest).
        phases=(Phase.explicit, Phase.generate) + ((Phase.shrink,) if shrink_budget > 0 else ()),
        verbosity=Verbosity.quiet,
    )(given(strategy)(prop))
    if seed is not None:
        test = hyp_seed(seed)(test)
    try:
        with _no_local_constants():
            test()
    except _Mismatch as e:
        mismatch = e
    except Flaky as e:  # the shrunk case passed when replayed: a non-deterministic implementation
        inner = [x for x in getattr(e, "exceptions", ()) if isinstance(x, _Mismatch)]
        if not inner:
            raise
        mismatch = inner[0]
        mismatch.message += "\n  (note: the same case passed on another call: is the implementation deterministic?)"
    else:
        # The drawn cases conform: the hand-built adversarial ones must too (a safety net for corners the
        # draws may miss at a small max_examples; run after, so that a drawn failure is still shrunk).
        for case in examples:
            calls += 1
            try:
                evaluate(case)
            except _Mismatch as e:
                mismatch = e
                mismatch.message += "\n  (an adversarial case of dcp_ref.testing.strategies, run after the drawn ones)"
                break
        else:
            return
    name, imp = _fn_ref(fn)
    code = mismatch.case.reproducer(name, device, imp)
    if expected_code is not None:
        code += "\n" + expected_code(mismatch.case)
    raise ConformanceError(stage, conventions, code, mismatch.message, mismatch.case, calls) from None


@contextlib.contextmanager
def _no_local_constants() -> Iterator[None]:
    """Keep Hypothesis from mixing literals of the loaded local modules into its draws.

    Hypothesis (6.13x and later) now and then draws a constant found in the source of any non-installed
    module in ``sys.modules``. dcp_ref is such a module in an editable install, so without this a check's
    cases (and the shrunk counterexample a notebook prints) would change whenever a project module is
    edited or merely imported first. The pool is emptied for the run through Hypothesis' internal hook
    (``providers._get_local_constants``); a Hypothesis without that hook has no such pool to empty.
    """
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # pragma: no cover - an older Hypothesis
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if original is None or cache is None:  # pragma: no cover - another Hypothesis layout
        yield
        return
    empty = Constants()
    cache.cache.clear()  # it memoises the allowed constants, local ones included
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.cache.clear()


def _conv(**kw: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in kw.items())


def _dev(device: torch.device | str) -> torch.device:
    return torch.device(device)


# ---- id-set comparisons -------------------------------------------------------------------------
def _row_diff(t: int, got: list[int], exp: list[int], ordered: bool, what: str = "ids") -> str | None:
    """Compare one row: valid entries first (exactly ``len(exp)`` of them), ``-1`` after."""
    n = len(exp)
    head, tail = got[:n], got[n:]
    bad_tail = [x for x in tail if x != -1]
    if ordered:
        ok = head == exp and not bad_tail
    else:
        ok = sorted(head) == sorted(exp) and not bad_tail
    if ok:
        return None
    valid = [x for x in got if x != -1]
    missing = sorted(set(exp) - set(valid))
    extra = sorted(set(valid) - set(exp))
    dup = sorted({x for x in valid if valid.count(x) > 1})
    parts = [
        f"row {t}: got {got}, expected {exp + [-1] * len(tail)}"
        + ("" if ordered else f" ({'any order of the first ' + str(n) if n else 'no valid ' + what}, -1 after)")
    ]
    if missing:
        parts.append(f"missing {what} {missing}")
    if extra:
        parts.append(f"unexpected {what} {extra}")
    if dup:
        parts.append(f"duplicated {what} {dup}")
    if not missing and not extra and not dup:
        parts.append("right set, wrong " + ("order" if ordered else "positions (valid first, -1 after)"))
    return "; ".join(parts)


def _rows_diff(got: torch.Tensor, exp: list[list[int]], ordered: bool, what: str = "ids", limit: int = 3) -> list[str]:
    out = []
    for t, e in enumerate(exp):
        d = _row_diff(t, [int(x) for x in got[t].tolist()], e, ordered, what)
        if d:
            out.append(d)
    return out[:limit]


def _check_shape_dtype(
    got: torch.Tensor, shape: tuple[int, ...], dtypes: Sequence[torch.dtype], what: str, case: Case
) -> None:
    if tuple(got.shape) != tuple(shape):
        raise _Mismatch(case, f"{what} has shape {tuple(got.shape)}, expected {tuple(shape)}")
    if got.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise _Mismatch(case, f"{what} has dtype {str(got.dtype).replace('torch.', '')}, expected {names}")


def _valid_rows(exp: torch.Tensor) -> list[list[int]]:
    return [[int(x) for x in row if int(x) >= 0] for row in exp]


# ---- select -------------------------------------------------------------------------------------
def _tie_hint(case: Case, rows: list[str], got: torch.Tensor, exp: list[list[int]]) -> str:
    """Explain a tie lost to the wrong id, if that is what happened."""
    g = case.values["gathered"]
    score = {}
    for w in range(g.shape[0]):
        for t in range(g.shape[1]):
            for j in range(g.shape[2]):
                score[(t, int(g[w, t, j, 1]))] = float(g[w, t, j, 0]) + 0.0
    for t, e in enumerate(exp):
        valid = [int(x) for x in got[t].tolist() if int(x) != -1]
        for m in sorted(set(e) - set(valid)):
            for x in sorted(set(valid) - set(e)):
                sm, sx = score.get((t, m)), score.get((t, x))
                if sm is not None and sm == sx:
                    return (
                        f"\n  hint: ids {m} and {x} tie at score {sm}; the stable order keeps the LOWER global id "
                        f"({min(m, x)})"
                    )
    return ""


def check_select(
    fn: Callable,
    *,
    sorted: bool = False,  # noqa: A002
    presorted: bool = False,
    device: torch.device | str = "cpu",
    max_world: int = 16,
    max_candidates: int = 6,
    noncontig: bool = True,
    out_buffers: bool | str = "auto",
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = DEFAULT_SHRINK_BUDGET,
) -> None:
    """Check a select stage: ``fn(gathered, k)`` -> int32 ``[T, k]`` stable global top-``k``.

    Args:
        fn: the implementation (:class:`~dcp_ref.stages.SelectStage`).
        sorted: require the key order (score descending, then the lower id); ``False``: the winners as
            a set, valid first, ``-1`` after (the protocol's contract).
        presorted: only feed candidate lists sorted per rank (best first, invalid last), as the indexer
            stage leaves them — for implementations that merge sorted lists.
        device: where the inputs live.  max_world: the largest ``W``.  max_candidates: the largest ``K``.
        noncontig: also pass ``gathered`` as a strided view.  out_buffers: pass ``out=`` (``"auto"``: when
            ``fn`` accepts it).  max_examples, seed, shrink_budget: how hard Hypothesis searches.
    Raises:
        ConformanceError: on the smallest failing case.
    """
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    dev = _dev(device)
    with_out = _with_out(fn, out_buffers)
    strategy = S.select_cases(
        max_world=max_world,
        max_candidates=max_candidates,
        presorted=presorted,
        noncontig=noncontig,
        with_out=with_out,
    )
    examples = S.adversarial_select_cases(max_world=max_world, max_candidates=max_candidates, with_out=with_out)

    def evaluate(case: Case) -> None:
        call = _invoke(fn, case, dev)
        got = _cpu(call.result, "the ids", case)
        T, k = case.values["gathered"].shape[1], case.values["k"]
        _check_shape_dtype(got, (T, k), (torch.int32,), "the result", case)
        got = _written(call, "out", got, case)
        exp = _valid_rows(oracle.select(case.values["gathered"], k))
        rows = _rows_diff(got, exp, sorted)
        if rows:
            raise _Mismatch(case, "  " + "\n  ".join(rows) + _tie_hint(case, rows, got, exp))

    def expected(case: Case) -> str:
        exp = oracle.select(case.values["gathered"], case.values["k"]).tolist()
        return f"expected = {exp}  # {'in this order' if sorted else 'valid ids in any order, then -1'}"

    _run(
        "select",
        _conv(sorted=sorted, presorted=presorted, device=dev),
        fn,
        strategy,
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        expected_code=expected,
        examples=examples,
    )


# ---- local top-K / indexer / pack ---------------------------------------------------------------
def check_local_topk(
    fn: Callable,
    *,
    sorted: bool = False,  # noqa: A002
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    index_dtypes: Sequence[torch.dtype] = (torch.int32, torch.int64),
    noncontig: bool = True,
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = DEFAULT_SHRINK_BUDGET,
) -> None:
    """Check a local top-K: ``fn(scores, k, lengths, row_starts)`` -> int ``[T, k]`` local indices.

    (The order of :func:`dcp_ref.indexer.local_topk`.) Row ``t``'s keys are columns ``row_starts[t] + j``
    for ``j < lengths[t]`` (``row_starts`` may be ``None``); everything else is garbage that would win
    if read. The winners: score descending, ``-0.0 == +0.0``, then the lower ``j``; NaN never; ``-1``
    padding. ``sorted=False`` compares the winners as a set.
    """
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    dev = _dev(device)
    strategy = S.local_topk_cases(dtype=dtype, index_dtypes=index_dtypes, noncontig=noncontig)

    def evaluate(case: Case) -> None:
        got = _cpu(_invoke(fn, case, dev).result, "the local ids", case)
        v = case.values
        _check_shape_dtype(got, (v["scores"].shape[0], v["k"]), (torch.int32, torch.int64), "the result", case)
        exp = _valid_rows(oracle.local_topk(v["scores"], v["k"], v["lengths"], v["row_starts"]))
        rows = _rows_diff(got, exp, sorted, "local ids")
        if rows:
            raise _Mismatch(case, "  " + "\n  ".join(rows))

    def expected(case: Case) -> str:
        v = case.values
        return f"expected = {oracle.local_topk(v['scores'], v['k'], v['lengths'], v['row_starts']).tolist()}"

    _run(
        "local_topk",
        _conv(sorted=sorted, device=dev, dtype=str(dtype).replace("torch.", "")),
        fn,
        strategy,
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        expected_code=expected,
        examples=S.adversarial_local_topk_cases(dtype=dtype, index_dtype=next(iter(index_dtypes))),
    )


def _pairs(packed: torch.Tensor, t: int) -> list[tuple[float, int]]:
    return [
        (float(packed[t, j, 0]), -1 if math.isnan(float(packed[t, j, 1])) else int(packed[t, j, 1]))
        for j in range(packed.shape[1])
    ]


def _fmt_pair(p: tuple[float, int]) -> str:
    return f"({S._num(p[0], True)}, {p[1]})"


def _fmt_pairs(pairs: list[tuple[float, int]]) -> str:
    return "[" + ", ".join(_fmt_pair(p) for p in pairs) + "]"


def _pair_eq(a: tuple[float, int], b: tuple[float, int]) -> bool:
    return a[1] == b[1] and (a[0] == b[0] or (math.isnan(a[0]) and math.isnan(b[0])))


def check_pack(
    fn: Callable,
    *,
    device: torch.device | str = "cpu",
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    max_world: int = 16,
    noncontig: bool = True,
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = DEFAULT_SHRINK_BUDGET,
) -> None:
    """Check a pack: ``fn(scores, local_ids, geometry, row_starts)`` -> float32 ``[T, K, 2]``.

    (The signature of :func:`dcp_ref.topk.pack_candidates`; ``geometry`` a :class:`~dcp_ref.geometry.DcpGeometry`.)
    Position by position: local index ``j`` -> ``(scores[t, row_starts[t] + j] as float32, global id)`` with the
    global id ``(j // I)*(W*I) + rank*I + j % I``; ``-1`` -> ``(-inf, -1)``. NaN scores are packed as NaN.
    ``dtypes``: the score dtypes your pack accepts.
    """
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    dev = _dev(device)
    strategy = S.pack_cases(max_world=max_world, dtypes=dtypes, noncontig=noncontig)

    def evaluate(case: Case) -> None:
        got = _cpu(_invoke(fn, case, dev).result, "the packed candidates", case)
        v = case.values
        T, K = v["local_ids"].shape
        _check_shape_dtype(got, (T, K, 2), (torch.float32,), "the result", case)
        exp = oracle.pack(v["scores"], v["local_ids"], v["geometry"], v["row_starts"])
        diffs = []
        for t in range(T):
            g, e = _pairs(got, t), _pairs(exp, t)
            for j in range(K):
                if not _pair_eq(g[j], e[j]):
                    diffs.append(
                        f"[{t}, {j}] (local id {int(v['local_ids'][t, j])}): got {_fmt_pair(g[j])}, "
                        f"expected {_fmt_pair(e[j])}"
                    )
        if diffs:
            raise _Mismatch(case, "  (score, global id) differs at\n  " + "\n  ".join(diffs[:4]))

    def expected(case: Case) -> str:
        v = case.values
        e = oracle.pack(v["scores"], v["local_ids"], v["geometry"], v["row_starts"])
        return f"expected = {S.tensor_literal(e)}"

    _run(
        "pack",
        _conv(device=dev, dtypes=[str(d).replace("torch.", "") for d in dtypes]),
        fn,
        strategy,
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        expected_code=expected,
    )


def check_indexer(
    fn: Callable,
    *,
    sorted: bool = False,  # noqa: A002
    device: torch.device | str = "cpu",
    max_world: int = 16,
    index_dtypes: Sequence[torch.dtype] = (torch.int32, torch.int64),
    noncontig: bool = True,
    out_buffers: bool | str = "auto",
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = DEFAULT_SHRINK_BUDGET,
) -> None:
    """Check an indexer stage: ``fn(scores, lengths, geometry, k, row_starts=...)`` -> float32 ``[T, k, 2]``.

    The local stable top-``k`` of each row (as :func:`check_local_topk`), packed as ``(score, global id)``
    (as :func:`check_pack`). ``sorted=False`` (the protocol): the winners as a set of pairs in any
    positions, every other entry exactly ``(-inf, -1)``; ``sorted=True``: in the key order, padding last.
    """
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    dev = _dev(device)
    with_out = _with_out(fn, out_buffers)
    strategy = S.indexer_cases(max_world=max_world, index_dtypes=index_dtypes, noncontig=noncontig, with_out=with_out)
    adversarial = (
        S.adversarial_indexer_cases(index_dtype=next(iter(index_dtypes)), with_out=with_out) if max_world >= 2 else []
    )

    def oracle_of(case: Case) -> torch.Tensor:
        v = case.values
        return oracle.indexer(v["scores"], v["lengths"], v["k"], v["geometry"], v.get("row_starts"))

    def evaluate(case: Case) -> None:
        call = _invoke(fn, case, dev)
        got = _cpu(call.result, "the packed candidates", case)
        T, k = case.values["scores"].shape[0], case.values["k"]
        _check_shape_dtype(got, (T, k, 2), (torch.float32,), "the result", case)
        got = _written(call, "out", got, case)
        exp = oracle_of(case)
        diffs = []
        for t in range(T):
            g, e = _pairs(got, t), _pairs(exp, t)
            ev = [p for p in e if p[1] >= 0]
            pad = (-math.inf, -1)
            if sorted:
                ok = all(_pair_eq(a, b) for a, b in zip(g, e))
            else:
                gv = [p for p in g if not _pair_eq(p, pad)]
                ok = (
                    len(gv) == len(ev)
                    and all(any(_pair_eq(a, b) for b in ev) for a in gv)
                    and len({p[1] for p in gv}) == len(gv)
                )
            if not ok:
                diffs.append(
                    f"row {t}: got {_fmt_pairs(g)}, expected {_fmt_pairs(e)}"
                    + ("" if sorted else " (the valid pairs in any positions, every other entry (-inf, -1))")
                )
        if diffs:
            raise _Mismatch(case, "  " + "\n  ".join(diffs[:3]))

    def expected(case: Case) -> str:
        return f"expected = {S.tensor_literal(oracle_of(case))}"

    _run(
        "indexer",
        _conv(sorted=sorted, device=dev),
        fn,
        strategy,
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        expected_code=expected,
        examples=adversarial,
    )


# ---- deinterleave ------------------------------------------------------------------------------
def check_deinterleave(
    fn: Callable,
    *,
    ordered: bool = False,
    compact: bool = True,
    device: torch.device | str = "cpu",
    max_world: int = 16,
    index_dtype: torch.dtype = torch.int32,
    noncontig: bool = True,
    out_buffers: bool | str = "auto",
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = DEFAULT_SHRINK_BUDGET,
) -> None:
    """Check a deinterleave stage: ``fn(global_ids, req_of_token, block_table, geometry)`` -> ``(slots, counts)``.

    Id ``p`` is this rank's when ``(p // I) % W == rank``; its slot is ``block_table[req, l // bs] * bs +
    l % bs`` with ``l = (p // (W*I))*I + p % I``. Out-of-contract metadata is *poisoned* with
    ``2**31 - 1`` (:data:`dcp_ref.testing.oracle.POISON_SLOT`, a slot like any other for the compaction
    and the counts): an id this rank owns whose block index is past the table or whose block entry is
    negative, and every entry of a row whose request id is not a row of the table (never "not here",
    which would look like an honest empty row). ``compact=True``: each row's slots first (``ordered=True``: in id order;
    ``False``: any order), ``-1`` after, ``counts`` = how many — never a slot dropped or duplicated.
    ``compact=False`` (the masked layout; ``fn`` gets ``compact=False``): ``slots[t, j]`` is ``global_ids[t, j]``'s
    slot or ``-1``, ``counts`` still the number of valid ones.
    """
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    dev = _dev(device)
    strategy = S.deinterleave_cases(
        max_world=max_world,
        index_dtype=index_dtype,
        compact=compact,
        noncontig=noncontig,
        with_out=_with_out(fn, out_buffers, "out_slots"),
    )

    def oracle_of(case: Case) -> torch.Tensor:
        v = case.values
        return oracle.deinterleave(v["global_ids"], v["req_of_token"], v["block_table"], v["geometry"])

    def evaluate(case: Case) -> None:
        call = _invoke(fn, case, dev)
        slots, counts = _tuple2(call.result, ("slots", "counts"), case)
        T, K = case.values["global_ids"].shape
        _check_shape_dtype(slots, (T, K), (torch.int32,), "slots", case)
        _check_shape_dtype(counts, (T,), (torch.int32,), "counts", case)
        slots = _written(call, "out_slots", slots, case)
        counts = _written(call, "out_counts", counts, case)
        masked = oracle_of(case)
        diffs = []
        if compact:
            exp = _valid_rows(masked)
            diffs = _rows_diff(slots, exp, ordered, "slots")
        else:
            for t in range(T):
                if slots[t].tolist() != masked[t].tolist():
                    diffs.append(
                        f"row {t}: got {slots[t].tolist()}, expected {masked[t].tolist()} (position by position)"
                    )
        for t in range(T):
            n = int((masked[t] >= 0).sum())
            if int(counts[t]) != n:
                diffs.append(f"counts[{t}] = {int(counts[t])}, expected {n}")
        if diffs:
            raise _Mismatch(case, "  " + "\n  ".join(diffs[:4]))

    def expected(case: Case) -> str:
        m = oracle_of(case)
        if compact:
            return (
                f"expected_slots = {_valid_rows(m)}  # per row, {'in this order' if ordered else 'any order'}, "
                f"then -1\nexpected_counts = {(m >= 0).sum(1).tolist()}"
            )
        return f"expected_slots = {m.tolist()}\nexpected_counts = {(m >= 0).sum(1).tolist()}"

    _run(
        "deinterleave",
        _conv(compact=compact, ordered=ordered, device=dev),
        fn,
        strategy,
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        expected_code=expected,
        examples=S.adversarial_deinterleave_cases(
            max_world=max_world,
            index_dtype=index_dtype,
            compact=compact,
            with_out=_with_out(fn, out_buffers, "out_slots"),
        ),
    )


def check_select_to_slots(
    fn: Callable,
    *,
    order: str = "global_id",
    ordered: bool = False,
    device: torch.device | str = "cpu",
    max_world: int = 8,
    max_candidates: int = 5,
    out_buffers: bool | str = "auto",
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = DEFAULT_SHRINK_BUDGET,
) -> None:
    """Check a select-to-slots stage: ``fn(gathered, own_ids, req_of_token, block_table, geometry, k, order=order)``
    -> ``(slots int32 [T, k], counts int32 [T])`` (:class:`~dcp_ref.stages.SelectToSlotsStage`).

    This rank's winners of the global top-``k`` under ``order`` (:func:`dcp_ref.testing.oracle.select_to_slots`:
    ``global_id`` breaks ties by the lower global id, ``rank_local`` by the lower rank, then the lower local
    index), as slots; out-of-contract metadata of a winner here gives the poison slot ``2**31 - 1``. Each row's
    slots first (``ordered=True``: in selection order; ``False``: any order), ``-1`` after, ``counts`` = how many:
    no winner dropped, none duplicated, none of another rank's. The draws put ties across ranks, empty ranks,
    NaN / ``±inf`` scores and ``k`` past ``W*K`` (:func:`dcp_ref.testing.strategies.select_to_slots_cases`).
    """
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    if order not in ("global_id", "rank_local"):
        raise ValueError(f"order must be 'global_id' or 'rank_local', got {order!r}")
    dev = _dev(device)
    strategy = S.select_to_slots_cases(
        order=order, max_world=max_world, max_candidates=max_candidates,
        with_out=_with_out(fn, out_buffers, "out_slots"),
    )  # fmt: skip

    def oracle_of(case: Case) -> list[list[int]]:
        v = case.values
        return oracle.select_to_slots(
            v["gathered"], v["own_ids"], v["req_of_token"], v["block_table"], v["geometry"], v["k"], order=order
        )

    def evaluate(case: Case) -> None:
        call = _invoke(fn, case, dev)
        slots, counts = _tuple2(call.result, ("slots", "counts"), case)
        T, k = case.values["gathered"].shape[1], case.values["k"]
        _check_shape_dtype(slots, (T, k), (torch.int32,), "slots", case)
        _check_shape_dtype(counts, (T,), (torch.int32,), "counts", case)
        slots = _written(call, "out_slots", slots, case)
        counts = _written(call, "out_counts", counts, case)
        exp = oracle_of(case)
        diffs = _rows_diff(slots, exp, ordered, "slots")
        diffs += [
            f"counts[{t}] = {int(counts[t])}, expected {len(e)}" for t, e in enumerate(exp) if int(counts[t]) != len(e)
        ]
        if diffs:
            raise _Mismatch(case, "  " + "\n  ".join(diffs[:4]))

    def expected(case: Case) -> str:
        e = oracle_of(case)
        return (
            f"expected_slots = {e}  # per row, {'in selection order' if ordered else 'any order'}, then -1\n"
            f"expected_counts = {[len(r) for r in e]}"
        )

    _run(
        "select_to_slots",
        _conv(order=order, ordered=ordered, device=dev),
        fn,
        strategy,
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        expected_code=expected,
        examples=S.adversarial_select_to_slots_cases(order=order, with_out=_with_out(fn, out_buffers, "out_slots")),
    )


def _guard_verdicts(v: dict) -> list[bool]:
    return oracle.guard(v["local_bounds"], v["req_of_token"], v["block_table"], v["geometry"], v["n_cols"],
                        v["row_starts"], num_blocks=v["num_blocks"], next_n=v["next_n"], index_q=v["index_q"],
                        index_weights=v["index_weights"])  # fmt: skip


def check_guard(
    fn: Callable,
    *,
    device: torch.device | str = "cpu",
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = DEFAULT_SHRINK_BUDGET,
) -> None:
    """Check a guard stage (:class:`~dcp_ref.stages.GuardStage`): ``fn(partial [T, H, v], lse [T, H], local_bounds,
    req_of_token, block_table, geometry, n_cols, row_starts=...)`` poisons *in place* exactly the tokens whose
    metadata is out of contract (:func:`dcp_ref.testing.oracle.guard`): NaN over the token's whole partial and
    LSE; every other token left bit for bit as it was; the metadata unchanged. The draws put bad request ids,
    negative or too long bounds and starts, windows past ``n_cols`` and missing blocks (the first, a middle or
    the last one a token needs) beside tokens in contract, and half of them the scoring rows a scoring step
    passes (``num_blocks``, ``next_n``, a non-finite ``index_q`` / ``index_weights``)
    (:func:`dcp_ref.testing.strategies.guard_cases`)."""
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    dev = _dev(device)

    def evaluate(case: Case) -> None:
        v = case.values
        call = _invoke(fn, case, dev, in_place=("partial", "lse"))
        if call.result is not None:
            raise _Mismatch(case, f"returned {type(call.result).__name__}, expected None (the guard works in place)")
        got_p, got_l = _cpu(call.inputs["partial"], "partial", case), _cpu(call.inputs["lse"], "lse", case)
        ok = _guard_verdicts(v)
        diffs = []
        for t, good in enumerate(ok):
            p, lse = got_p[t], got_l[t]
            if good and not (_same(p, v["partial"][t]) and _same(lse, v["lse"][t])):
                diffs.append(f"token {t} is in contract but its partial / LSE changed")
            if not good and not (bool(torch.isnan(p).all()) and bool(torch.isnan(lse).all())):
                diffs.append(f"token {t}'s metadata is out of contract but its partial / LSE are not all NaN")
        if diffs:
            raise _Mismatch(case, "  " + "\n  ".join(diffs[:4]))

    def expected(case: Case) -> str:
        v = case.values
        ok = _guard_verdicts(v)
        return f"in_contract = {ok}  # tokens whose partial and LSE stay; the others must be all NaN"

    _run(
        "guard",
        _conv(device=dev),
        fn,
        S.guard_cases(),
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        expected_code=expected,
    )


#: A scored cell's tolerance, relative to the sum of its terms' magnitudes (float32 accumulation of FP8 products).
_SCORE_RTOL = 2.0**-12


def _scoring_oracle(v: dict[str, Any], n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`oracle.scoring` on a scoring case's values: ``(scores, magnitude)``."""
    return oracle.scoring(v["index_q"], v["weights"], v["index_cache"], v["block_table"], v["req_of_token"],
                          v["local_bounds"], v["geometry"], n_cols, v["row_starts"], v.get("next_n", 1))  # fmt: skip


def check_scoring(
    fn: Callable,
    *,
    device: torch.device | str = "cpu",
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = DEFAULT_SHRINK_BUDGET,
    mtp: bool | str = "auto",
    fp8_nan: bool = True,
) -> None:
    """Check a scoring stage (:class:`~dcp_ref.stages.ScoringStage`): ``fn(index_q, weights, index_cache,
    block_table, req_of_token, local_bounds, geometry, row_starts=..., out=...)`` writes into ``out [T, L]`` what
    :func:`dcp_ref.testing.oracle.scoring` computes in float64 — each local key's ``sum_h w relu(q . k) scale``
    at its column (within ``2**-12`` of the sum of the terms' magnitudes: float32 accumulation of FP8 products),
    ``-inf`` in every other column, NaN exactly where the data is NaN, and a row out of contract all NaN (a NaN
    row is what the layer's guard turns into a poisoned output: a row that came back finite would be
    answered). The draws (:func:`dcp_ref.testing.strategies.scoring_cases`) put missing blocks and blocks past
    the cache, bad requests, bounds, starts and windows, NaN keys, scales, queries and weights, unwritten
    slots, negative dot products. ``mtp``: also pass ``next_n`` (1 or 2; a pair naming two requests is
    poisoned whole) — ``"auto"``: when ``fn`` takes it. ``fp8_nan=False``: no NaN byte in an FP8 value (for a
    Triton kernel run by the CPU interpreter, which decodes it as 480)."""
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    dev = _dev(device)
    if mtp not in ("auto", True, False):
        raise ValueError(f"mtp must be True, False or 'auto', got {mtp!r}")
    if not isinstance(fp8_nan, bool):
        raise TypeError(f"fp8_nan must be a bool, got {type(fp8_nan).__name__}")
    with_mtp = _accepts(fn, "next_n") if mtp == "auto" else bool(mtp)

    def oracle_of(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        return _scoring_oracle(case.values, case.out_buffers["out"][0][1])

    def evaluate(case: Case) -> None:
        call = _invoke(fn, case, dev)
        raw = _written(call, "out", _cpu(call.result, "scores", case), case)
        exp, mag = oracle_of(case)
        _check_shape_dtype(raw, tuple(exp.shape), (torch.float32,), "scores", case)
        got = raw.double()
        fin = torch.isfinite(exp)
        same_special = (torch.isnan(got) == torch.isnan(exp)) & (torch.isneginf(got) == torch.isneginf(exp))
        close = ~fin | ((got - exp).abs() <= mag * _SCORE_RTOL + 1e-30)
        bad = ~(same_special & close)
        if bool(bad.any()):
            diffs = [
                f"scores[{t}, {c}] = {got[t, c].item()!r}, expected {exp[t, c].item()!r}"
                + (" (a row out of contract is all NaN)" if bool(torch.isnan(exp[t]).all()) else "")
                for t, c in bad.nonzero().tolist()[:4]
            ]
            raise _Mismatch(case, "  " + "\n  ".join(diffs))

    def expected(case: Case) -> str:
        exp, _ = oracle_of(case)
        return f"expected = {S.tensor_literal(exp.float())}  # float32 view of the float64 oracle"

    _run(
        "scoring",
        _conv(device=dev),
        fn,
        S.scoring_cases(mtp=with_mtp, fp8_nan=fp8_nan),
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        expected_code=expected,
    )


def _empty_ok(x: float, convention: str) -> bool:
    if convention == "-inf":
        return x == -math.inf
    if convention == "+inf":
        return x == math.inf
    if convention == "nan":
        return math.isnan(x)
    return not math.isfinite(x)


def _close(got: torch.Tensor, exp: torch.Tensor, atol: torch.Tensor | float, rtol: float) -> torch.Tensor:
    """Elementwise "close", NaN only where NaN is expected, infinities exactly."""
    g, e = got.double(), exp.double()
    both_nan = torch.isnan(g) & torch.isnan(e)
    same_inf = torch.isinf(e) & (g == e)
    near = (g - e).abs() <= atol + rtol * e.abs()
    return both_nan | same_inf | (near & torch.isfinite(e) & torch.isfinite(g))


def _worst(ok: torch.Tensor, got: torch.Tensor, exp: torch.Tensor, what: str, limit: int = 3) -> list[str]:
    bad = (~ok).nonzero().tolist()
    out = []
    for idx in bad[:limit]:
        g, e = float(got[tuple(idx)]), float(exp[tuple(idx)])
        out.append(f"{what}{idx}: got {S._num(g, True)}, expected {S._num(e, True)}")
    if len(bad) > limit:
        out.append(f"... {len(bad)} entries of {what} differ in all")
    return out


def check_attention(
    fn: Callable,
    *,
    lse_base: str = "e",
    empty_lse: str = "-inf",
    empty_out: str = "zero",
    layout: str = "compact",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    num_heads: int | Sequence[int] | None = None,
    head_dim: int | None = None,
    v_dim: int | None = None,
    slots_width: int | None = None,
    noncontig: bool = True,
    out_buffers: bool | str = "auto",
    rtol: float | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = DEFAULT_SHRINK_BUDGET,
) -> None:
    """Check an attention stage: ``fn(q, kv_cache, slots, counts, sm_scale, v_dim)`` -> ``(out, lse)``.

    ``out [T, H, v_dim]`` is the softmax-weighted sum of ``kv_cache[slot, :v_dim]`` over the row's
    slots with scores ``sm_scale * <q[t, h], kv_cache[slot]>``; ``lse [T, H]`` the log-sum-exp of the
    scores in ``lse_base`` (``"e"``: the protocol; ``"2"``: ``log2``, what exp2-based kernels return).

    Args:
        empty_lse: the LSE a row with no slot gives: ``"-inf"`` (the protocol), ``"+inf"``, ``"nan"``
            or ``"any"`` (any non-finite value). empty_out: ``"zero"`` (the protocol) or ``"any"``.
        layout: ``"compact"`` (``slots[t, :counts[t]]``; what follows is garbage that must not be read)
            or ``"masked"`` (every ``slots[t, j] >= 0``).
        dtype: of ``q`` and ``kv_cache``.  num_heads / head_dim / v_dim / slots_width: fix the shapes (a
            kernel built for DeepSeek's 576/512, 64 or 128 heads, top-k in tiles of 64); ``None``: drawn small.
        rtol: override the tolerance (default :func:`tolerance` of ``dtype`` and the output dtype, widened
            by the float32 rounding of scores as large as the case's).
    """
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    if lse_base not in ("e", "2"):
        raise ValueError(f"lse_base must be 'e' or '2', got {lse_base!r}")
    if empty_lse not in _EMPTY_LSE:
        raise ValueError(f"empty_lse must be one of {_EMPTY_LSE}, got {empty_lse!r}")
    if empty_out not in ("zero", "any"):
        raise ValueError(f"empty_out must be 'zero' or 'any', got {empty_out!r}")
    if layout not in ("compact", "masked"):
        raise ValueError(f"layout must be 'compact' or 'masked', got {layout!r}")
    dev = _dev(device)
    strategy = S.attention_cases(
        dtype=dtype,
        num_heads=num_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        slots_width=slots_width,
        layout=layout,
        noncontig=noncontig,
        with_out=_with_out(fn, out_buffers),
    )

    def evaluate(case: Case) -> None:
        v = case.values
        call = _invoke(fn, case, dev)
        out, lse = _tuple2(call.result, ("out", "lse"), case)
        T, H, D = v["q"].shape
        _check_shape_dtype(
            out, (T, H, v["v_dim"]), (torch.float16, torch.bfloat16, torch.float32, torch.float64), "out", case
        )
        _check_shape_dtype(lse, (T, H), (torch.float16, torch.bfloat16, torch.float32, torch.float64), "lse", case)
        out = _written(call, "out", out, case)
        lse = _written(call, "out_lse", lse, case)
        counts = v["counts"] if layout == "compact" else None
        e_out, e_lse = oracle.attention(v["q"], v["kv_cache"], v["slots"], counts, v["sm_scale"], v["v_dim"])
        # Tolerance: the output dtype's rounding, plus float32 rounding of scores as large as these.
        used = v["slots"][:, : int(v["counts"].max())] if layout == "compact" else v["slots"]
        rows = sorted({int(s) for s in used.reshape(-1).tolist() if s >= 0} & set(range(v["kv_cache"].shape[0])))
        kv = v["kv_cache"].double()[rows] if rows else torch.zeros(1, D, dtype=torch.float64)
        finite_kv = torch.where(torch.isfinite(kv), kv, 0.0)
        smax = float(v["sm_scale"]) * float((v["q"].double().abs().amax(dim=(0, 1)) * finite_kv.abs().amax(0)).sum())
        vmax = max(1.0, float(finite_kv[:, : v["v_dim"]].abs().max()))
        tol = rtol if rtol is not None else tolerance(dtype, out.dtype)
        eps = _acc_eps(dtype, out.dtype)
        lse_e = lse.double() * (math.log(2.0) if lse_base == "2" else 1.0)
        empty = (v["counts"] == 0) if layout == "compact" else (v["slots"] < 0).all(1)
        diffs = []
        ok_out = _close(out, e_out, vmax * (tol + 8 * eps * smax), tol)
        lse_tol = rtol if rtol is not None else tolerance(lse.dtype if lse.dtype != torch.float64 else dtype)
        ok_lse = _close(lse_e, e_lse, lse_tol + 8 * eps * smax, lse_tol)
        for t in range(T):
            if bool(empty[t]):
                ok_lse[t] = True
                bad = [h for h in range(H) if not _empty_ok(float(lse[t, h]), empty_lse)]
                if bad:
                    diffs.append(
                        f"lse[{t}, {bad[0]}] = {S._num(float(lse[t, bad[0]]), True)} for an empty row "
                        f"(counts[{t}] == 0), expected {empty_lse}"
                    )
                if empty_out == "any":
                    ok_out[t] = True
                elif not bool((out[t] == 0).all()):
                    ok_out[t] = True
                    diffs.append(
                        f"out[{t}] is not exactly 0 for an empty row (got values like "
                        f"{S._num(float(out[t][out[t] != 0].reshape(-1)[0]), True)})"
                    )
        diffs += _worst(ok_out, out, e_out, "out")
        diffs += _worst(
            ok_lse, lse_e if lse_base == "e" else lse, e_lse if lse_base == "e" else e_lse / math.log(2.0), "lse"
        )
        if diffs:
            hint = ""
            ne = ~empty
            if bool(ne.any()) and not bool(ok_lse.all()):
                fin = torch.isfinite(e_lse[ne]) & torch.isfinite(lse[ne].double())
                if bool(fin.any()):
                    g, e = lse[ne].double()[fin], e_lse[ne][fin]
                    if lse_base == "e" and torch.allclose(g * math.log(2.0), e, rtol=1e-3, atol=1e-3):
                        hint = "\n  hint: lse * ln(2) matches: the kernel returns a base-2 LSE; declare lse_base='2'"
                    elif lse_base == "2" and torch.allclose(g, e, rtol=1e-3, atol=1e-3):
                        hint = "\n  hint: the LSE matches in base e: declare lse_base='e'"
            raise _Mismatch(case, "  " + "\n  ".join(diffs[:6]) + hint)

    def expected(case: Case) -> str:
        c = "counts" if layout == "compact" else "None"
        lines = [
            "from dcp_ref.testing import oracle",
            f"expected_out, expected_lse = oracle.attention(q, kv_cache, slots, {c}, sm_scale, v_dim)"
            "  # float64, base e",
        ]
        if lse_base == "2":
            lines.append("expected_lse = expected_lse / 0.6931471805599453  # in base 2, as declared")
        return "\n".join(lines)

    conv = _conv(
        lse_base=lse_base,
        empty_lse=empty_lse,
        empty_out=empty_out,
        layout=layout,
        device=dev,
        dtype=str(dtype).replace("torch.", ""),
    )
    _run(
        "attention",
        conv,
        fn,
        strategy,
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        expected_code=expected,
    )


# ---- correct ------------------------------------------------------------------------------------
def check_correct(
    fn: Callable,
    *,
    lse_base: str = "e",
    form: str = "correct",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_world: int = 16,
    noncontig: bool = True,
    out_buffers: bool | str = "auto",
    rtol: float | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = DEFAULT_SHRINK_BUDGET,
) -> None:
    """Check an LSE merge: ``form="correct"`` (the correct stage): ``fn(partial, all_lse, rank)`` ->
    ``(corrected, merged_lse)``;
    ``form="merge"``: ``fn(outs [W, T, H, v], lses [W, T, H])`` -> ``(merged, merged_lse)``.

    ``corrected = partial * b^(lse[rank] - merged)`` with ``merged = log_b sum_r b^lse[r]`` (``b`` =
    ``lse_base``). A rank with LSE ``-inf`` is empty and contributes *exactly* 0 whatever its partial
    holds (NaN, ``inf``: ``0 * NaN`` is NaN, so select it away); every rank empty -> 0 and ``-inf``; a NaN
    in a partial that has weight propagates. A NaN or ``+inf`` LSE is corrupt data, never "empty": the
    merged LSE of that ``(t, h)`` is NaN and so is every non-empty rank's output there. Finite LSEs near
    the float32 maximum (``3.3e38``) must merge to a finite result (subtract the max first). ``dtype``:
    of the partial outputs (LSEs are float32).
    """
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    if lse_base not in ("e", "2"):
        raise ValueError(f"lse_base must be 'e' or '2', got {lse_base!r}")
    if form not in ("correct", "merge"):
        raise ValueError(f"form must be 'correct' or 'merge', got {form!r}")
    dev = _dev(device)
    with_out = _with_out(fn, out_buffers)
    strategy = S.correct_cases(max_world=max_world, dtype=dtype, form=form, noncontig=noncontig, with_out=with_out)
    examples = S.adversarial_correct_cases(max_world=max_world, dtype=dtype, form=form, with_out=with_out)

    def oracle_of(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        v = case.values
        if form == "merge":
            return oracle.merge(v["outs"], v["lses"], lse_base)
        return oracle.correct(v["partial"], v["all_lse"], v["rank"], lse_base)

    def evaluate(case: Case) -> None:
        v = case.values
        call = _invoke(fn, case, dev)
        out, lse = _tuple2(call.result, ("corrected" if form == "correct" else "merged", "merged_lse"), case)
        parts = v["outs"] if form == "merge" else v["partial"]
        lses = v["lses"] if form == "merge" else v["all_lse"]
        shape = tuple(parts.shape[-3:])
        _check_shape_dtype(
            out, shape, (torch.float16, torch.bfloat16, torch.float32, torch.float64), "the output", case
        )
        _check_shape_dtype(
            lse, shape[:2], (torch.float16, torch.bfloat16, torch.float32, torch.float64), "merged_lse", case
        )
        out = _written(call, "out", out, case)
        lse = _written(call, "out_lse", lse, case)
        e_out, e_lse = oracle_of(case)
        # The rounding of an LSE difference grows with the LSEs' magnitude: a tolerance per (t, h), so
        # that one LSE near the float32 maximum does not loosen the check of every other head.
        l64 = lses.double()
        lmax = torch.where(torch.isfinite(l64), l64.abs(), 0.0).amax(dim=0)  # [T, H]
        pf = parts.double()[torch.isfinite(parts.double())]
        pmax = max(1.0, float(pf.abs().max()) if pf.numel() else 1.0)
        tol = rtol if rtol is not None else tolerance(dtype, out.dtype)
        eps = _acc_eps(dtype, out.dtype)
        ok_out = _close(out, e_out, (pmax * (tol + 8 * eps * (1 + lmax))).unsqueeze(-1), tol)
        lse_tol = rtol if rtol is not None else tolerance(lse.dtype if lse.dtype != torch.float64 else torch.float32)
        ok_lse = _close(lse, e_lse, lse_tol + 8 * eps * (1 + lmax), lse_tol)
        diffs = _worst(ok_out, out, e_out, "out" if form == "merge" else "corrected") + _worst(
            ok_lse, lse, e_lse, "merged_lse"
        )
        if diffs:
            hint = ""
            nan_leak = torch.isnan(out.double()) & ~torch.isnan(e_out)
            if bool(nan_leak.any()):
                hint = (
                    "\n  hint: NaN where the expected value is finite: an empty rank's (lse = -inf) partial was "
                    "multiplied by its zero weight (0 * NaN = NaN); select it away instead"
                )
            raise _Mismatch(case, "  " + "\n  ".join(diffs[:6]) + hint)

    def expected(case: Case) -> str:
        call = (
            "oracle.merge(outs, lses, " if form == "merge" else "oracle.correct(partial, all_lse, rank, "
        ) + f"base={lse_base!r})"
        return f"from dcp_ref.testing import oracle\nexpected_out, expected_lse = {call}  # float64"

    conv = _conv(form=form, lse_base=lse_base, device=dev, dtype=str(dtype).replace("torch.", ""))
    _run(
        "correct",
        conv,
        fn,
        strategy,
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        expected_code=expected,
        examples=examples,
    )


def check_combine(fn: Callable, **kwargs: Any) -> None:
    """Check a combine stage (:class:`~dcp_ref.stages.CombineStage`): ``fn(outs [W, T, H/W, v], lses [W, T, H/W])``
    -> ``(merged, merged_lse)``, the LSE-weighted merge of the ``W`` partials the all-to-all delivered — every
    rank's, an empty one (``-inf``) adding exactly 0, a corrupt LSE (NaN, ``+inf``) giving NaN. The merge's
    contract in one place: :func:`check_correct` with ``form="merge"`` (``kwargs`` as there)."""
    __tracebackhide__ = True
    if "form" in kwargs:
        raise TypeError("check_combine takes no form= (a combine merges all W partials: form='merge')")
    try:
        check_correct(fn, form="merge", **kwargs)
    except ConformanceError as e:  # the same finding, under this stage's name
        raise ConformanceError("combine", e.conventions, e.reproducer, e.differences, e.case, e.calls) from None


# ---- the whole step -----------------------------------------------------------------------------
def _as_stages(impl: Any) -> Any:
    from ..stages import REFERENCE_STAGES, STAGE_NAMES, Stages

    if isinstance(impl, Stages):
        return impl
    if isinstance(impl, dict):
        unknown = set(impl) - set(STAGE_NAMES)
        if unknown:
            raise ValueError(f"unknown stage name(s) {sorted(unknown)}; stages are {STAGE_NAMES}")
        return REFERENCE_STAGES.with_(**impl)
    return None


#: The layer options :func:`check_step` runs a ``Stages`` value under (``options="all"``): each a
#: :class:`~dcp_ref.stages.StepSpec` choice whose answer is the oracle's exactly — the exchange through select +
#: deinterleave or the owner-local select-to-slots, in either total order (``rank_local`` breaks score ties by
#: rank and local index: the oracle's ``order=``), the combine by reduce-scatter or one all-to-all, the query
#: replicated or gathered over heads, the tensor-parallel layout (every rank the whole context, its ``H/W``
#: heads: :func:`~dcp_ref.testing.strategies.unsharded`), and the layer scoring FP8 index keys itself
#: (``"scoring": "fp8"``: the problem gains index keys whose float32 scores are exact,
#: :func:`~dcp_ref.testing.strategies.with_index_keys`, and the step is planned with a
#: :class:`~dcp_ref.stages.ScoringSpec`).
STEP_OPTIONS: tuple[dict[str, Any], ...] = (
    {},
    {"exchange": "owner"},
    {"exchange": "owner", "order": "rank_local"},
    {"combine": "alltoall"},
    {"q_replicate": False},
    {"exchange": "owner", "combine": "alltoall", "q_replicate": False},
    {"layout": "tp"},
    {"scoring": "fp8"},
    {"scoring": "fp8", "exchange": "owner", "order": "rank_local", "combine": "alltoall", "q_replicate": False},
)
#: Index heads of the problems ``{"scoring": "fp8"}`` adds index keys to.
STEP_INDEX_HEADS = 2


def _step_problem_for(problem: S.StepProblem, options: dict[str, Any]) -> S.StepProblem:
    """The problem an option run answers: with index keys when the step scores them (``"scoring": "fp8"``),
    the one the oracle then reads the exact scores of."""
    if options.get("scoring") is None:
        return problem
    if options["scoring"] != "fp8":
        raise ValueError(f"the step option scoring must be 'fp8' (score FP8 index keys), got {options['scoring']!r}")
    return problem if problem.index_caches is not None else S.with_index_keys(problem, index_heads=STEP_INDEX_HEADS)


def run_step_problem(
    problem: S.StepProblem,
    impl: Any,
    device: torch.device | str = "cpu",
    traces: list[dict] | None = None,
    *,
    options: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a step on every rank of a :class:`~dcp_ref.group.SimulatedWorld` and reassemble the heads.

    ``impl``: a :class:`~dcp_ref.stages.Stages` (or a dict ``{stage: callable}`` over the reference),
    run through :func:`dcp_ref.pipeline.dcp_decode_step` — or, with ``options`` (:class:`~dcp_ref.stages.StepSpec`
    fields: ``layout``, ``exchange``, ``order``, ``combine``, ``q_replicate``, and ``"scoring": "fp8"`` for a
    problem with index keys, :func:`~dcp_ref.testing.strategies.with_index_keys`), planned with them and run (the
    query sliced to the rank's heads when the spec gathers it; ``layout="tp"``: every rank holds the
    :func:`~dcp_ref.testing.strategies.unsharded` problem); or a whole step with
    :func:`~dcp_ref.pipeline.dcp_decode_step`'s signature ``fn(group, q, shard, seq_lens, next_n, topk, sm_scale,
    v_dim=...)``. Returns ``(out [T, H, v], lse [T, H])`` on the CPU, heads in order.
    """
    from ..group import SimulatedWorld
    from ..pipeline import RankShard, dcp_decode_step
    from ..stages import ScoringSpec, StepSpec
    from ..step import PlannedStep, decode_metadata

    dev = torch.device(device)
    p = problem
    W = p.world_size
    stages = _as_stages(impl)
    opts = dict(options or {})
    scoring = opts.pop("scoring", None)
    if scoring is not None and (scoring != "fp8" or p.index_caches is None):
        raise ValueError("the step option scoring='fp8' needs a problem with index keys (strategies.with_index_keys)")
    held = S.unsharded(p) if opts.get("layout") == "tp" else p  # tp: every rank holds the whole context
    q = p.q.to(dev)
    seq_lens = p.seq_lens.to(dev)
    next_n = p.next_n.to(dev) if isinstance(p.next_n, torch.Tensor) else p.next_n

    def shard_of(r: int) -> RankShard:
        c = r if held is p else 0
        index = held.index_caches[c].to(dev) if scoring and held.index_caches is not None else None
        return RankShard(held.kv_caches[c].to(dev), held.block_tables[c].to(dev),
                         None if scoring else held.index_scores[c].to(dev), held.geometry(c), index)  # fmt: skip

    shards = [shard_of(r) for r in range(W)]
    trs = traces if traces is not None else [None] * W
    extra: dict[str, Any] = {}  # the spec's scoring, and the layer inputs a run then takes
    inputs: dict[str, torch.Tensor] = {}
    if scoring and p.index_q is not None and p.index_weights is not None:
        bounds = [decode_metadata(p.seq_lens, p.next_n, held.geometry(r)).local_bounds for r in range(held.world_size)]
        max_keys = max([1] + [int(b.max()) for b in bounds if b.numel()])
        extra["scoring"] = ScoringSpec(max_keys, index_heads=int(p.index_weights.shape[1]))
        inputs = {"index_q": p.index_q.to(dev), "index_weights": p.index_weights.to(dev)}

    def one(group: Any, shard: Any, trace: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        if stages is not None and (opts or scoring):
            T, H, D = q.shape
            meta = decode_metadata(seq_lens, next_n, shard.geometry, device=q.device)
            spec = StepSpec(p.geometry(group.rank), max_tokens=max(T, 1), topk=p.topk, num_heads=H, head_dim=D,
                            v_dim=p.v_dim, sm_scale=p.sm_scale, dtype=q.dtype, device=q.device, **opts,
                            **extra)  # fmt: skip
            hs = spec.heads_per_rank
            qr = q if spec.query_heads == H else q[:, group.rank * hs : (group.rank + 1) * hs].contiguous()
            o, l = PlannedStep(group, spec, stages).run(qr, shard, meta, trace=trace, **inputs)
        elif stages is not None:
            o, l = dcp_decode_step(
                group, q, shard, seq_lens, next_n, p.topk, p.sm_scale, v_dim=p.v_dim, stages=stages, trace=trace
            )
        else:
            o, l = impl(group, q, shard, seq_lens, next_n, p.topk, p.sm_scale, v_dim=p.v_dim)
        return o.detach().cpu().clone(), l.detach().cpu().clone()

    results = SimulatedWorld(W).run(one, shards, trs)
    return torch.cat([o for o, _ in results], dim=1), torch.cat([lse for _, lse in results], dim=1)


def check_step(
    impl: Any,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_world: int = 16,
    world_sizes: Sequence[int] | None = None,
    head_dim: int | None = None,
    v_dim: int | None = None,
    heads_per_rank: int | Sequence[int] = (1, 2),
    topk: int | None = None,
    rtol: float | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    shrink_budget: int = 150,
    options: str | Sequence[dict[str, Any]] | None = None,
) -> None:
    """Check a whole decode step on ``W`` simulated ranks against :func:`dcp_ref.testing.oracle.decode`.

    Args:
        impl: a :class:`~dcp_ref.stages.Stages` (e.g. ``REFERENCE_STAGES.with_(select=my_select)``), a dict
            ``{stage name: callable}`` (the rest from the reference), or a whole step with the signature of
            :func:`dcp_ref.pipeline.dcp_decode_step` (``fn(group, q, shard, seq_lens, next_n, topk, sm_scale,
            v_dim=...)`` -> this rank's ``(out [T, H/W, v], lse [T, H/W])``, base e).
        device, dtype: where the problem lives and the dtype of ``q`` and the KV cache.
        max_world / world_sizes: how many ranks (``W`` drawn up to ``max_world``, or from ``world_sizes``).
        head_dim, v_dim, heads_per_rank: fix the head geometry (``H = heads_per_rank * W``).
        topk: fix the top-k (``None``: drawn from 1 to past the longest request).
        options: with a ``Stages`` value, the layer options each case is also planned and run under
            (:class:`~dcp_ref.stages.StepSpec` fields, and ``"scoring": "fp8"`` for the layer scoring FP8 index
            keys): ``"all"`` for :data:`STEP_OPTIONS` (both exchanges, both orders, both combines, the query
            replicated or gathered, the tp layout, the layer scoring), or a list of dicts; ``None``: the default
            step. Under ``order="rank_local"`` the oracle breaks score ties by rank, then local index.
    The output of every head must match the oracle (the LSE too, base e; a token whose scores are all
    NaN selects nothing: output 0, LSE ``-inf``). With a ``Stages`` value, ``trace["impl"]`` must name
    your implementations (``Stages.impls()``).
    """
    __tracebackhide__ = True  # pytest: show the ConformanceError, not the kit's frames
    dev = _dev(device)
    stages = _as_stages(impl)
    if stages is None and not callable(impl):
        raise TypeError(f"impl must be a Stages value, a dict of stages or a step callable, got {type(impl).__name__}")
    strategy = S.step_cases(
        max_world=max_world,
        world_sizes=world_sizes,
        head_dim=head_dim,
        v_dim=v_dim,
        heads_per_rank=heads_per_rank,
        topk=topk,
        dtype=dtype,
    )
    label = stages.name if stages is not None else _fn_ref(impl)[0]
    if options is not None and stages is None:
        raise ValueError("options need a Stages value (a whole step callable plans itself)")
    if isinstance(options, str) and options != "all":
        raise ValueError(f"options must be None, 'all' or a sequence of StepSpec-field dicts, got {options!r}")
    if options is not None and not isinstance(options, str) and not all(isinstance(o, dict) for o in options):
        raise TypeError(f"options must be a sequence of dicts of StepSpec fields, got {options!r}")
    runs: tuple[dict[str, Any], ...] = (
        ({},) if options is None else STEP_OPTIONS if options == "all" else tuple(dict(o) for o in options)  # type: ignore[arg-type]
    )

    def evaluate(case: Case) -> None:
        for opts in runs:
            try:
                evaluate_one(case, opts)
            except _Mismatch as e:
                if opts:
                    e.message = f"with the step options {opts}:\n" + e.message
                raise

    def evaluate_one(case: Case, opts: dict[str, Any]) -> None:
        p: S.StepProblem = _step_problem_for(case.values["problem"], opts)
        traces: list[dict] = [{} for _ in range(p.world_size)]
        try:
            out, lse = run_step_problem(p, impl, dev, traces, options=opts)
        except _Mismatch:
            raise
        except Exception as e:  # noqa: BLE001
            raise _Mismatch(case, f"raised {type(e).__name__}: {e} on a valid input") from None
        ref = oracle.decode(
            p.q,
            p.kv_caches,
            p.block_tables,
            p.index_scores,
            p.seq_lens,
            p.next_n,
            p.topk,
            p.sm_scale,
            block_size=p.block_size,
            interleave=p.interleave,
            v_dim=p.v_dim,
            order=opts.get("order", "global_id"),
        )
        T, H = p.q.shape[:2]
        if tuple(out.shape) != (T, H, p.v_dim) or tuple(lse.shape) != (T, H):
            raise _Mismatch(
                case,
                f"the reassembled heads have shapes {tuple(out.shape)} / {tuple(lse.shape)}, expected "
                f"{(T, H, p.v_dim)} / {(T, H)}",
            )
        tol = rtol if rtol is not None else tolerance(dtype, out.dtype)
        kv = torch.cat([k.double().reshape(-1) for k in p.kv_caches])
        kv = kv[torch.isfinite(kv)]
        vmax = max(1.0, float(kv.abs().max()) if kv.numel() else 1.0)
        smax = p.sm_scale * float(p.q.double().abs().sum(-1).max()) * vmax
        eps = _acc_eps(dtype, out.dtype)
        ok_out = _close(out, ref.out, vmax * (tol + 8 * eps * smax), tol)
        ok_lse = _close(
            lse.double(),
            ref.lse,
            tolerance(lse.dtype if lse.dtype != torch.float64 else dtype) + 8 * eps * smax,
            tolerance(torch.float32),
        )
        diffs = _worst(ok_out, out, ref.out, "out") + _worst(ok_lse, lse, ref.lse, "lse")
        if stages is not None and not diffs:
            want = stages.impls()
            for r, tr in enumerate(traces):
                # The step names the implementation of every stage it ran (which stages run depends on
                # the step's layout and exchange): each must be the one the Stages value holds.
                got = tr.get("impl")
                if not isinstance(got, dict) or not got or any(want.get(k) != v for k, v in got.items()):
                    shown = {k: want.get(k) for k in got} if isinstance(got, dict) and got else want
                    diffs.append(f"rank {r}: trace['impl'] = {got}, expected {shown}")
                    break
        if diffs:
            note = f"\n  the oracle's chosen positions per token: {ref.ids.tolist()}"
            if "global_ids" in traces[0]:
                note += f"\n  your step's global_ids (rank 0's trace): {traces[0]['global_ids'].tolist()}"
            raise _Mismatch(case, "  " + "\n  ".join(diffs[:6]) + note)

    def expected(case: Case) -> str:
        return (
            "from dcp_ref.testing import oracle\n"
            "ref = oracle.decode(problem.q, problem.kv_caches, problem.block_tables, problem.index_scores,\n"
            "                    problem.seq_lens, problem.next_n, problem.topk, problem.sm_scale,\n"
            "                    block_size=problem.block_size, interleave=problem.interleave, v_dim=problem.v_dim)"
        )

    name, imp = _fn_ref(impl) if stages is None else ("stages", "# stages = <your Stages value>")
    conv = _conv(device=dev, dtype=str(dtype).replace("torch.", ""))

    # The reproducer of a step case runs the whole step through the kit's runner.
    def step_code(case: Case) -> str:
        call = f"out, lse = run_step_problem(problem, {name}{'' if dev.type == 'cpu' else f', device={str(dev)!r}'})"
        return "\n".join(
            ["from dcp_ref.testing import run_step_problem", *(l for l in [imp] if l), call, expected(case)]
        )

    _run_step(
        label,
        conv,
        impl,
        strategy,
        evaluate,
        device=dev,
        max_examples=max_examples,
        seed=seed,
        shrink_budget=shrink_budget,
        code=step_code,
    )


def _run_step(
    label: str,
    conv: str,
    impl: Any,
    strategy: st.SearchStrategy[Case],
    evaluate: Callable[[Case], None],
    *,
    device: torch.device,
    max_examples: int | None,
    seed: int | None,
    shrink_budget: int,
    code: Callable[[Case], str],
) -> None:
    """:func:`_run` for the step, whose reproducer builds a problem instead of calling ``impl`` directly."""
    __tracebackhide__ = True
    try:
        _run(
            f"step ({label})",
            conv,
            impl,
            strategy,
            evaluate,
            device=device,
            max_examples=max_examples,
            seed=seed,
            shrink_budget=shrink_budget,
        )
    except ConformanceError as e:
        lines = [line for line in e.case.reproducer("fn").splitlines() if not line.startswith("got = ")]
        rep = "\n".join(lines) + "\n" + code(e.case)
        raise ConformanceError(e.stage, e.conventions, rep, e.differences, e.case, e.calls) from None


def check_stages(
    stages: Any,
    *,
    device: torch.device | str = "cpu",
    step: bool = True,
    max_examples: int | None = None,
    seed: int | None = None,
    **step_kwargs: Any,
) -> None:
    """Every stage of a :class:`~dcp_ref.stages.Stages` value through its checker (scoring,
    indexer, select, deinterleave, select-to-slots in both orders, guard, attention, correct, combine), then the
    whole step.

    Uses the protocol's conventions (set semantics, base-e LSE, ``-inf`` for empty rows, compaction
    unless ``stages.attention_layout == "masked"``). ``step_kwargs`` go to :func:`check_step`.
    """
    __tracebackhide__ = True
    st_ = _as_stages(stages)
    if st_ is None:
        raise TypeError(f"stages must be a Stages value or a dict of stages, got {type(stages).__name__}")
    kw: dict[str, Any] = dict(device=device, max_examples=max_examples, seed=seed)
    check_scoring(st_.scoring, **kw)
    check_indexer(st_.indexer, **kw)
    check_select(st_.select, **kw)
    check_deinterleave(st_.deinterleave, compact=st_.attention_layout == "compact", **kw)
    for order in ("global_id", "rank_local"):
        check_select_to_slots(st_.select_to_slots, order=order, **kw)
    check_guard(st_.guard, **kw)
    check_attention(st_.attention, layout=st_.attention_layout, **kw)
    check_correct(st_.correct, **kw)
    check_combine(st_.combine, **kw)
    if step:
        step_kwargs.setdefault("options", "all")  # both exchanges, both combines, the query replicated or gathered
        check_step(st_, **kw, **step_kwargs)
