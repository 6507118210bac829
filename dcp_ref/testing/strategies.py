"""Hypothesis strategies for the inputs of every DCP stage — public, for your own tests.

Each ``*_cases()`` strategy draws one :class:`Case`: the input tensors of one call of a stage
(CPU, in the declared dtypes), the scalars, which tensors to pass as non-contiguous views, the
output buffers to offer, and the Python code that rebuilds all of it (the reproducer the
conformance checkers print). The draws cover each stage's contract, adversarial corners
included: ties (scores from a few levels), ``±0``, NaN, ``±inf``, empty rows and empty ranks,
rows shorter than ``k``, interleave ``I > 1``, up to ``W = 16`` ranks, ids near ``2**24``,
garbage past every valid bound, poisoned (NaN) KV rows that must not be read. Sizes are drawn
first and small, so Hypothesis shrinks a failure to a case you can read.

Use them directly::

    from hypothesis import given
    from dcp_ref.testing import strategies as dst

    @given(dst.select_cases(max_world=4))
    def test_my_select(case):
        args, kwargs, _ = case.build("cpu")
        got = my_select(*args, **kwargs)
        ...  # compare with dcp_ref.testing.oracle.select(case.values["gathered"], case.values["k"])

Element strategies (:func:`score_values`, :func:`data_values`) and :func:`geometries` are the
building blocks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from hypothesis import strategies as st

from ..geometry import DcpGeometry

__all__ = [
    "Case",
    "noncontiguous",
    "tensor_literal",
    "score_values",
    "data_values",
    "geometries",
    "select_cases",
    "select_to_slots_cases",
    "guard_cases",
    "scoring_cases",
    "adversarial_select_to_slots_cases",
    "local_topk_cases",
    "pack_cases",
    "indexer_cases",
    "deinterleave_cases",
    "attention_cases",
    "correct_cases",
    "step_cases",
    "StepProblem",
    "make_step_problem",
    "with_index_keys",
    "unsharded",
    "adversarial_select_cases",
    "adversarial_local_topk_cases",
    "adversarial_indexer_cases",
    "adversarial_deinterleave_cases",
    "adversarial_correct_cases",
]

NAN, INF = math.nan, math.inf
#: Score levels: ties are common, and every special float is there (shrinks toward ``0.0``).
SCORE_LEVELS = (0.0, 1.0, -1.0, 0.5, -0.0, 2.0, INF, -INF, NAN)
#: What sits past a row's valid bound: values that win if a kernel reads them by mistake.
GARBAGE_LEVELS = (INF, 1e30, 3.0, NAN)
#: Exact in bf16/fp16/fp32: q / KV / partial-output values whose products are exact too.
DYADIC = (0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, 1.5, -1.5, 3.0, -0.75)
_GARBAGE = st.sampled_from(GARBAGE_LEVELS)
#: Above this many elements a tensor is drawn from a seed (``torch.randn``) instead of elementwise.
MAX_LITERAL_ELEMS = 384


# ---- reproducer helpers ------------------------------------------------------------------------
def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a non-contiguous view (every stride doubled).

    The interleaved elements in between hold poison (NaN for floats, ``-7`` for integers), so an
    implementation that ignores strides reads garbage instead of passing by luck.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    poison = NAN if t.is_floating_point() else -7
    base = torch.full((*t.shape, 2), poison, dtype=t.dtype, device=t.device)
    base[..., 0] = t
    return base[..., 0]


def _num(v: float | int, is_float: bool) -> str:
    if not is_float:
        return str(int(v))
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def _nested(x: Any, is_float: bool) -> str:
    if isinstance(x, list):
        return "[" + ", ".join(_nested(e, is_float) for e in x) + "]"
    return _num(x, is_float)


def tensor_literal(t: torch.Tensor) -> str:
    """A Python expression that rebuilds ``t`` exactly (values, shape, dtype; on the CPU).

    Uses the names ``nan`` and ``inf`` for special floats (define ``nan, inf = float("nan"),
    float("inf")``). Every float16/bfloat16/float32 value prints as a float64 literal that rounds
    back to itself.
    """
    dt = str(t.dtype).replace("torch.", "torch.")
    if t.numel() == 0:
        return f"torch.empty({tuple(t.shape)}, dtype={dt})"
    vals = t.detach().cpu()
    is_float = vals.is_floating_point()
    body = _nested((vals.double() if is_float else vals.long()).tolist(), is_float)
    return f"torch.tensor({body}, dtype={dt})"


@dataclass(eq=False)
class Case:
    """One call of a stage: inputs, how to call, and the code that rebuilds it.

    Attributes:
        stage: the stage's name (``"select"``, ``"attention"``, ...).
        values: name -> CPU tensor or scalar (a :class:`~dcp_ref.geometry.DcpGeometry`, an int, a
            float, a bool), in definition order.
        code: name -> Python statements that define that name (``tensor_literal`` or a seeded
            recipe, then any poisoning); scalars use ``repr``.
        args: names passed positionally, in order.  kwargs: names passed by keyword.
        noncontig: names of tensors passed as :func:`noncontiguous` views.
        out_buffers: keyword name -> ``(shape, dtype, poison)`` of an output buffer to pass.
        meta: stage-specific facts for the checker (e.g. the poisoned KV rows).
    """

    stage: str
    values: dict[str, Any]
    code: dict[str, str]
    args: tuple[str, ...]
    kwargs: tuple[str, ...] = ()
    noncontig: frozenset[str] = frozenset()
    out_buffers: dict[str, tuple[tuple[int, ...], torch.dtype, float]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def build(self, device: torch.device | str = "cpu") -> tuple[list[Any], dict[str, Any], dict[str, torch.Tensor]]:
        """``(args, kwargs, buffers)`` on ``device``: fresh tensors (the case's own stay untouched)."""
        dev = torch.device(device)

        def make(name: str) -> Any:
            v = self.values[name]
            if not isinstance(v, torch.Tensor):
                return v
            t = v.to(dev).clone()
            return noncontiguous(t) if name in self.noncontig else t

        buffers = {
            k: torch.full(shape, poison, dtype=dtype, device=dev)
            for k, (shape, dtype, poison) in self.out_buffers.items()
        }
        kwargs = {k: make(k) for k in self.kwargs}
        kwargs.update(buffers)
        return [make(a) for a in self.args], kwargs, buffers

    def reproducer(self, fn_name: str, device: torch.device | str = "cpu", import_line: str = "") -> str:
        """Python source that rebuilds this case and calls ``fn_name`` on it (ready to paste)."""
        dev = torch.device(device)
        lines = ["import torch"]
        if import_line:
            lines.append(import_line)
        if any(isinstance(v, DcpGeometry) for v in self.values.values()):
            lines.append("from dcp_ref.geometry import DcpGeometry")
        if self.noncontig:
            lines.append("from dcp_ref.testing import noncontiguous")
        lines.append('nan, inf = float("nan"), float("inf")')
        if dev.type != "cpu":
            lines.append(f'device = "{dev}"')
        for name, v in self.values.items():
            lines.append(self.code[name])
            if isinstance(v, torch.Tensor):
                moved = f"{name}.to(device)" if dev.type != "cpu" else name
                if name in self.noncontig:
                    lines.append(f"{name} = noncontiguous({moved})  # strided view; the gaps hold poison")
                elif dev.type != "cpu":
                    lines.append(f"{name} = {moved}")
        dv = ", device=device" if dev.type != "cpu" else ""
        for k, (shape, dtype, poison) in self.out_buffers.items():
            lines.append(
                f"{k} = torch.full({tuple(shape)}, {_num(poison, dtype.is_floating_point)}, dtype={dtype}{dv})"
            )
        call = [*self.args, *(f"{k}={k}" for k in self.kwargs), *(f"{k}={k}" for k in self.out_buffers)]
        lines.append(f"got = {fn_name}({', '.join(call)})")
        return "\n".join(lines)

    def __repr__(self) -> str:  # what Hypothesis would print: keep it the code, not tensor reprs
        return f"Case({self.stage!r}):\n{self.reproducer('fn')}"


def _tensor_case_value(values: dict, code: dict, name: str, t: torch.Tensor, recipe: str | None = None) -> None:
    values[name] = t
    code[name] = f"{name} = {recipe if recipe is not None else tensor_literal(t)}"


def _scalar(values: dict, code: dict, name: str, v: Any) -> None:
    values[name] = v
    code[name] = f"{name} = {v!r}"


def _geometry(values: dict, code: dict, g: DcpGeometry) -> None:
    """The case's ``geometry`` value and the line that rebuilds it."""
    values["geometry"] = g
    code["geometry"] = f"geometry = DcpGeometry({g.world_size}, {g.rank}, {g.interleave}, {g.block_size})"


# ---- element strategies -------------------------------------------------------------------------
# Cached: a strategy built once is validated once (building one per drawn element costs more than the draw).
@functools.cache
def score_values(*, specials: bool = True) -> st.SearchStrategy[float]:
    """Index scores: a few levels (ties, ``±0``, ``±inf``, NaN when ``specials``) or any float32."""
    levels = SCORE_LEVELS if specials else tuple(v for v in SCORE_LEVELS if math.isfinite(v))
    return st.one_of(
        st.sampled_from(levels),
        st.floats(width=32, allow_nan=specials, allow_infinity=specials),
    )


@functools.cache
def data_values(*, big: bool = False) -> st.SearchStrategy[float]:
    """q / KV / partial-output values: exact dyadic numbers (``× 16`` when ``big``: scores that overflow
    a float32 ``exp`` unless the softmax subtracts its maximum)."""
    scale = 16.0 if big else 1.0
    return st.sampled_from(tuple(v * scale for v in DYADIC))


def geometries(
    *,
    max_world: int = 16,
    interleaves: Sequence[int] = (1, 2, 3, 4),
    block_multiples: Sequence[int] = (1, 2, 4),
    world_size: int | None = None,
) -> st.SearchStrategy[DcpGeometry]:
    """A :class:`~dcp_ref.geometry.DcpGeometry`: ``W <= max_world`` (or exactly ``world_size``), any rank,
    ``I`` from ``interleaves``, ``block_size = I * m`` for ``m`` in ``block_multiples``."""

    @st.composite
    def build(draw: st.DrawFn) -> DcpGeometry:
        w = world_size if world_size is not None else draw(st.integers(1, max_world))
        r = draw(st.integers(0, w - 1))
        i = draw(st.sampled_from(tuple(interleaves)))
        m = draw(st.sampled_from(tuple(block_multiples)))
        return DcpGeometry(w, r, i, i * m)

    return build()


def _floats_tensor(
    draw: st.DrawFn,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    elements: st.SearchStrategy[float],
    name: str,
    scale_big: bool = False,
) -> tuple[torch.Tensor, str | None]:
    """Elementwise draw for small tensors; a seeded ``randn`` (dyadic-rounded) recipe for big ones."""
    n = math.prod(shape)
    if n <= MAX_LITERAL_ELEMS:
        vals = draw(st.lists(elements, min_size=n, max_size=n))
        return torch.tensor(vals, dtype=torch.float64).reshape(shape).to(dtype), None
    seed = draw(st.integers(0, 2**16))
    scale = 16.0 if scale_big else 1.0
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * 4).round() / 4 * scale
    recipe = (
        f"((torch.randn({shape}, generator=torch.Generator().manual_seed({seed}), dtype=torch.float64) * 4)"
        f".round() / 4 * {scale}).to({dtype})"
    )
    return t.to(dtype), recipe


def _maybe_out(draw: st.DrawFn, with_out: bool, buffers: dict[str, tuple[tuple[int, ...], torch.dtype, float]]) -> dict:
    """Offer the output buffers (poisoned) on about half of the cases when the callable takes them."""
    if with_out and draw(st.booleans()):
        return buffers
    return {}


def _noncontig(draw: st.DrawFn, allowed: bool, names: Sequence[str]) -> frozenset[str]:
    if not allowed:
        return frozenset()
    return frozenset(n for n in names if draw(st.booleans()))


# ---- select ------------------------------------------------------------------------------------
#: True about a quarter of the time, shrinking to False: adversarial choices that shrink away when
#: a failure does not need them (an empty row, an invalid candidate).
_RARE = st.sampled_from((False, False, False, True))
_FEW_LEVELS = st.sampled_from((0.0, -0.0, 1.0))
#: A block-table entry without a block: ``-1`` mostly (shrinks to it), any negative value now and then.
_NO_BLOCK = st.sampled_from((-1, -1, -2, -7, -(2**31)))


def _presort_key(e: tuple[float, int]) -> tuple[int, tuple]:
    from .oracle import selection_key

    key = selection_key(*e)
    return (1, ()) if key is None else (0, key)


@st.composite
def select_cases(
    draw: st.DrawFn,
    *,
    max_world: int = 16,
    max_tokens: int = 3,
    max_candidates: int = 6,
    presorted: bool = False,
    noncontig: bool = True,
    with_out: bool = False,
) -> Case:
    """The select stage: ``gathered`` float32 ``[W, T, K, 2]`` and ``k``.

    Ids are distinct within a row (small, or up to ``2**24 - 1``); a candidate is invalid through id
    ``-1`` (with any score, even ``+inf``) or a NaN score; some ranks are empty; ``k`` runs from 1 to
    past ``W*K``. ``presorted=True`` sorts each rank's list as the indexer stage leaves it (best first,
    invalid last) for implementations that rely on that.
    """
    W = draw(st.integers(1, max_world))
    K = draw(st.integers(1, max_candidates))
    k = draw(st.integers(1, W * K + 1))
    hi = draw(st.sampled_from((2 * W * K + 1, (1 << 24) - 1)))
    empty_ranks = draw(st.sets(st.integers(0, W - 1), max_size=W))

    @st.composite
    def row(draw: st.DrawFn) -> list[list[tuple[float, int]]]:
        ids = draw(st.lists(st.integers(0, hi), min_size=W * K, max_size=W * K, unique=True))
        ranks = []
        for w in range(W):
            entries = []
            for j in range(K):
                invalid = w in empty_ranks or draw(_RARE)
                entries.append((draw(score_values()), -1 if invalid else ids[w * K + j]))
            if presorted:
                entries.sort(key=_presort_key)
            ranks.append(entries)
        return ranks

    rows = draw(st.lists(row(), min_size=1, max_size=max_tokens))
    T = len(rows)
    g = torch.empty((W, T, K, 2), dtype=torch.float32)
    for t, ranks in enumerate(rows):
        for w, entries in enumerate(ranks):
            for j, (s, i) in enumerate(entries):
                g[w, t, j, 0], g[w, t, j, 1] = s, float(i)
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    _tensor_case_value(values, code, "gathered", g)
    _scalar(values, code, "k", k)
    return Case(
        "select",
        values,
        code,
        ("gathered", "k"),
        noncontig=_noncontig(draw, noncontig, ["gathered"]),
        out_buffers=_maybe_out(draw, with_out, {"out": ((T, k), torch.int32, -7)}),
    )


@st.composite
def select_to_slots_cases(
    draw: st.DrawFn,
    *,
    order: str = "global_id",
    max_world: int = 8,
    max_tokens: int = 3,
    max_candidates: int = 5,
    poison: bool = True,
    with_out: bool = False,
) -> Case:
    """The select-to-slots stage, ``fn(gathered, own_ids, req_of_token, block_table, geometry, k, order=order)``.

    Each rank's ``K`` candidates are distinct local indices of its own, ascending, padding after them
    (``global_id``: ``(score, global id)`` pairs, padding ``(-inf, -1)``; ``rank_local``: scores, NaN padding,
    and this rank's local indices in ``own_ids``, ``-1`` padding); scores from a few levels (ties *across*
    ranks, ``±0``, ``±inf``, NaN), some ranks empty, ``k`` from 1 to past ``W*K``, interleave ``I > 1``.
    ``poison``: now and then a request id outside the block table, a missing block (``-1``) or a local index
    past the table — winners there must come back as the poison slot, never a plausible one.
    """
    g = draw(geometries(max_world=max_world, interleaves=(1, 2, 3), block_multiples=(1, 2)))
    W, bs = g.world_size, g.block_size
    K = draw(st.integers(1, max_candidates))
    k = draw(st.integers(1, W * K + 1))
    T = draw(st.integers(1, max_tokens))
    M = draw(st.integers(1, 3))  # block-table columns: local indices below M * bs have a block
    B = T + draw(st.integers(0, 1))
    empty_ranks = draw(st.sets(st.integers(0, W - 1), max_size=W))
    # half the cases score from three levels: ties across ranks at the threshold, where the order decides
    elements = draw(st.sampled_from((score_values(), _FEW_LEVELS)))
    scores = torch.full((W, T, K), math.nan, dtype=torch.float32)
    local = torch.full((W, T, K), -1, dtype=torch.int64)
    for t in range(T):
        for w in range(W):
            if w in empty_ranks:
                continue
            reach = M * bs + (bs if poison and draw(_RARE) else 0)  # past the table: no block
            n = draw(st.integers(0, min(K, reach)))
            locs = sorted(draw(st.lists(st.integers(0, reach - 1), min_size=n, max_size=n, unique=True)))
            for c, loc in enumerate(locs):
                local[w, t, c] = loc
                scores[w, t, c] = draw(elements)
    blocks = draw(st.lists(st.integers(0, 4 * B * M), min_size=B * M, max_size=B * M, unique=True))
    table = torch.tensor(blocks, dtype=torch.int32).view(B, M)
    req = torch.tensor([draw(st.integers(0, B - 1)) for _ in range(T)], dtype=torch.int32)
    if poison and draw(_RARE):
        table[draw(st.integers(0, B - 1)), draw(st.integers(0, M - 1))] = -1
    if poison and draw(_RARE):
        req[draw(st.integers(0, T - 1))] = draw(st.sampled_from((-1, B)))
    out = _maybe_out(draw, with_out, {"out_slots": ((T, k), torch.int32, -7), "out_counts": ((T,), torch.int32, -7)})
    return _select_to_slots_case(order, g, scores, local, table, req, k, out)


def _select_to_slots_case(
    order: str,
    g: DcpGeometry,
    scores: torch.Tensor,
    local: torch.Tensor,
    table: torch.Tensor,
    req: torch.Tensor,
    k: int,
    out_buffers: dict[str, tuple[tuple[int, ...], torch.dtype, float]],
) -> Case:
    """A select-to-slots case from each rank's candidates: ``scores`` float32 ``[W, T, K]`` and ``local`` int
    ``[W, T, K]`` local indices (``-1`` / NaN score: padding), in the wire format of ``order``."""
    W, rank, I = g.world_size, g.rank, g.interleave
    T = scores.shape[1]
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    valid = ~torch.isnan(scores) & (local >= 0)
    if order == "global_id":
        w_idx = torch.arange(W).view(W, 1, 1)
        gid = torch.where(local >= 0, (local // I) * (W * I) + w_idx * I + local % I, -1)
        pairs = torch.stack([torch.where(valid, scores, -math.inf), torch.where(valid, gid, -1).float()], -1)
        _tensor_case_value(values, code, "gathered", pairs.contiguous())
        _scalar(values, code, "own_ids", None)
    elif order == "rank_local":
        own = torch.where(valid[rank], local[rank], -1).to(torch.int32)
        _tensor_case_value(values, code, "gathered", torch.where(valid, scores, math.nan))
        _tensor_case_value(values, code, "own_ids", own)
    else:
        raise ValueError(f"order must be 'global_id' or 'rank_local', got {order!r}")
    _tensor_case_value(values, code, "req_of_token", req)
    _tensor_case_value(values, code, "block_table", table)
    _geometry(values, code, g)
    _scalar(values, code, "k", k)
    _scalar(values, code, "order", order)
    return Case(
        "select_to_slots",
        values,
        code,
        ("gathered", "own_ids", "req_of_token", "block_table", "geometry", "k"),
        kwargs=("order",),
        out_buffers=out_buffers if T else {},
    )


def adversarial_select_to_slots_cases(*, order: str = "global_id", with_out: bool = False) -> list[Case]:
    """Hand-built select-to-slots corners, for both ranks of ``W = 2`` (``I = 1``, block size 2, one request):
    a tie of equal scores across the ranks at the threshold (``k = 1`` and ``3`` of four); ``-0.0`` against
    ``+0.0``; an empty rank; ``k`` past ``W*K``; a winner whose block is missing (the poison slot); a request
    id outside the table (every winner here poisoned)."""
    nan = math.nan
    table = torch.tensor([[4, 7]], dtype=torch.int32)
    bad = torch.tensor([[4, -1]], dtype=torch.int32)
    cases = []
    rows = [  # (scores [W][K], local [W][K], table, req, k)
        ([[1.0, 1.0], [1.0, 1.0]], [[0, 2], [1, 3]], table, 0, 1),
        ([[1.0, 1.0], [1.0, 1.0]], [[0, 2], [1, 3]], table, 0, 3),
        ([[0.0, -1.0], [-0.0, 2.0]], [[0, 1], [0, 3]], table, 0, 2),
        ([[nan, nan], [0.5, -math.inf]], [[-1, -1], [0, 2]], table, 0, 2),
        ([[0.5, 0.25], [1.0, nan]], [[1, 2], [0, -1]], table, 0, 9),
        ([[3.0, 1.0], [2.0, 0.0]], [[0, 3], [1, 2]], bad, 0, 4),
        ([[3.0, 1.0], [2.0, 0.0]], [[0, 3], [1, 2]], table, 5, 4),
    ]
    for sc, loc, bt, b, k in rows:
        scores = torch.tensor(sc, dtype=torch.float32).view(2, 1, 2)
        local = torch.tensor(loc, dtype=torch.int64).view(2, 1, 2)
        req = torch.tensor([b], dtype=torch.int32)
        out: dict[str, tuple[tuple[int, ...], torch.dtype, float]] = (
            {"out_slots": ((1, k), torch.int32, -7.0), "out_counts": ((1,), torch.int32, -7.0)} if with_out else {}
        )
        for rank in (0, 1):
            cases.append(_select_to_slots_case(order, DcpGeometry(2, rank, 1, 2), scores, local, bt, req, k, out))
    return cases


@st.composite
def guard_cases(draw: st.DrawFn, *, max_tokens: int = 4) -> Case:
    """The guard stage: ``partial [T, H, v]``, ``lse [T, H]`` (values to keep or poison), each token's bound, request
    and (half the cases) row start, a block table with holes, the score width ``n_cols``. Most tokens are in
    contract; now and then a request id outside the table, a negative or too long bound or start, a window
    past ``n_cols``, or a missing block among those a token needs (the first, a middle or the last one). Half the
    cases carry the scoring rows (a scoring step's): ``num_blocks`` (block ids at or past it count as missing),
    ``next_n`` 1 or 2 (an MTP pair naming two requests), and an index query and weights with a NaN or an
    infinity now and then."""
    g = draw(geometries(max_world=2, interleaves=(1, 2), block_multiples=(1, 2)))
    bs = g.block_size
    scored = draw(st.booleans())
    next_n = draw(st.sampled_from((1, 2))) if scored else 1
    T, B, M = (
        next_n * draw(st.integers(1, max(1, max_tokens // next_n))),
        draw(st.integers(1, 3)),
        draw(st.integers(0, 3)),
    )
    H, v = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n_cols = draw(st.integers(0, M * bs + bs))
    with_starts = draw(st.booleans())
    table = torch.tensor(
        [[-1 if draw(_RARE) and draw(st.booleans()) else draw(st.integers(0, 50)) for _ in range(M)] for _ in range(B)],
        dtype=torch.int32,
    ).view(B, M)
    req, bounds, starts = [], [], []
    for _ in range(T):
        r = draw(st.sampled_from((-1, B))) if draw(_RARE) and draw(_RARE) else draw(st.integers(0, B - 1))
        s = draw(st.integers(0, n_cols)) if with_starts else 0
        room = n_cols - s
        n = draw(st.integers(-2, room + 2)) if draw(_RARE) else draw(st.integers(0, room))
        if with_starts and draw(_RARE) and draw(_RARE):
            s = draw(st.sampled_from((-1, n_cols + 1)))
        req.append(r)
        bounds.append(n)
        starts.append(s)
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    partial = torch.tensor([[[draw(data_values()) for _ in range(v)] for _ in range(H)] for _ in range(T)])
    lse = torch.tensor([[draw(data_values()) for _ in range(H)] for _ in range(T)])
    _tensor_case_value(values, code, "partial", partial.view(T, H, v).float())
    _tensor_case_value(values, code, "lse", lse.view(T, H).float())
    _ints(values, code, "local_bounds", bounds, torch.int32)
    _ints(values, code, "req_of_token", req, torch.int32)
    _tensor_case_value(values, code, "block_table", table)
    _geometry(values, code, g)
    _scalar(values, code, "n_cols", n_cols)
    if with_starts:
        _ints(values, code, "row_starts", starts, torch.int32)
    else:
        _scalar(values, code, "row_starts", None)
    _scalar(values, code, "num_blocks", draw(st.integers(0, 51)) if scored else None)
    _scalar(values, code, "next_n", next_n)
    if scored:
        hi, d = draw(st.integers(1, 2)), draw(st.integers(1, 3))
        odd = st.sampled_from((math.nan, math.inf, -math.inf))
        iq = [[[draw(odd) if draw(_RARE) and draw(_RARE) else draw(data_values()) for _ in range(d)]
               for _ in range(hi)] for _ in range(T)]  # fmt: skip
        iw = [[draw(odd) if draw(_RARE) and draw(_RARE) else draw(data_values()) for _ in range(hi)] for _ in range(T)]
        _tensor_case_value(values, code, "index_q", torch.tensor(iq).view(T, hi, d).float())
        _tensor_case_value(values, code, "index_weights", torch.tensor(iw).view(T, hi).float())
    else:
        _scalar(values, code, "index_q", None)
        _scalar(values, code, "index_weights", None)
    return Case(
        "guard",
        values,
        code,
        ("partial", "lse", "local_bounds", "req_of_token", "block_table", "geometry", "n_cols"),
        kwargs=("row_starts", "num_blocks", "next_n", "index_q", "index_weights"),
    )


# ---- scoring -------------------------------------------------------------------------------------
#: Index-key scales: powers of two (what the quantizer writes, ``ue8m0``), a few octaves either side of 1.
_KEY_SCALES = st.sampled_from((2.0**-6, 2.0**-3, 0.25, 0.5, 1.0, 2.0))


@st.composite
def scoring_cases(draw: st.DrawFn, *, max_tokens: int = 4, mtp: bool = False, fp8_nan: bool = True) -> Case:
    """The scoring stage: an FP8 index query ``[T, Hi, 128]`` and weights, a paged FP8 index-key cache
    (``uint8 [num_blocks, bs * 132]``: each block's tokens of 128 e4m3 bytes, then their float32 scales; the
    values from a drawn seed), a block table, each token's request, bound and (half the cases) row start, an
    ``out`` of ``L`` columns. Now and then: a needed block that is ``-1`` or past the cache, a request outside the
    table, a negative or too long bound or start, a window past ``L``, a NaN in a key, a scale, the query or a
    weight, an unwritten slot (all bytes ``0xFF``: NaN), keys whose dot products are negative (``relu``);
    with ``mtp`` a ``next_n = 2`` grouping whose pair may name two requests. ``fp8_nan=False``: no NaN *byte* in an
    FP8 value (NaN scales and weights stay) — for Triton's CPU interpreter, which decodes e4m3fn's NaN byte as
    480 (a GPU decodes it as NaN)."""
    g = draw(geometries(max_world=2, interleaves=(1, 2), block_multiples=(1, 2)))
    bs, d = g.block_size, 128
    next_n = draw(st.sampled_from((1, 2))) if mtp else 1
    T = next_n * draw(st.integers(1, max(1, max_tokens // next_n)))
    hi, B = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    M = 0 if draw(_RARE) and draw(_RARE) else draw(st.integers(1, 3))
    nb = draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    keys = (torch.randn(nb * bs, d, generator=gen) * draw(st.sampled_from((0.5, 2.0)))).to(torch.float8_e4m3fn)
    scales = torch.tensor([draw(_KEY_SCALES) for _ in range(nb * bs)], dtype=torch.float32)
    cache = torch.empty(nb, bs * (d + 4), dtype=torch.uint8)
    for blk in range(nb):
        cache[blk, : bs * d] = keys[blk * bs : (blk + 1) * bs].view(torch.uint8).reshape(-1)
        cache[blk, bs * d :] = scales[blk * bs : (blk + 1) * bs].view(torch.uint8)
    if draw(_RARE):  # a NaN value in one key, a NaN scale, an unwritten slot
        which = draw(st.integers(0, 2)) if fp8_nan else draw(st.integers(1, 2))  # (an unwritten slot's scale is NaN)
        blk, off = draw(st.integers(0, nb - 1)), draw(st.integers(0, bs - 1))
        if which == 0:
            cache[blk, off * d + draw(st.integers(0, d - 1))] = 0x7F
        elif which == 1:
            cache[blk, bs * d + 4 * off : bs * d + 4 * off + 4] = torch.tensor([math.nan]).view(torch.uint8)
        elif which == 2:
            cache[blk, off * d : (off + 1) * d] = 0xFF
            cache[blk, bs * d + 4 * off : bs * d + 4 * off + 4] = 0xFF
    table = [[(draw(st.sampled_from((-1, nb, nb + 3))) if draw(_RARE) and draw(_RARE) else draw(st.integers(0, nb - 1)))
              for _ in range(M)] for _ in range(B)]  # fmt: skip
    with_starts = draw(st.booleans())
    # mostly wide enough for every bound the table allows (and a start of up to 2); now and then narrower
    L = draw(st.integers(0, M * bs)) if draw(_RARE) and draw(_RARE) else M * bs + draw(st.integers(0, 2))
    req: list[int] = []
    bounds: list[int] = []
    starts: list[int] = []
    for t in range(T):
        if next_n > 1 and t % next_n:
            r = req[-1] if not (draw(_RARE) and draw(_RARE)) else draw(st.integers(0, B - 1))
        else:
            r = draw(st.sampled_from((-1, B))) if draw(_RARE) and draw(_RARE) else draw(st.integers(0, B - 1))
        st_ = draw(st.integers(0, min(2, L))) if with_starts else 0
        room = max(0, min(L - st_, M * bs))
        n = draw(st.integers(-2, room + 2)) if draw(_RARE) and draw(_RARE) else room - draw(st.integers(0, room))
        if with_starts and draw(_RARE) and draw(_RARE):
            st_ = -1
        req.append(r)
        bounds.append(n)
        starts.append(st_)
    q = torch.randn(T, hi, d, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(T, hi, generator=gen)
    if fp8_nan and draw(_RARE) and draw(_RARE):
        q.view(torch.uint8)[draw(st.integers(0, T - 1)), 0, draw(st.integers(0, d - 1))] = 0x7F
    if draw(_RARE) and draw(_RARE):
        w[draw(st.integers(0, T - 1)), 0] = math.nan
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    _tensor_case_value(values, code, "index_q", q, f"{tensor_literal(q.float())}.to(torch.float8_e4m3fn)")
    _tensor_case_value(values, code, "weights", w)
    _tensor_case_value(values, code, "index_cache", cache)
    _tensor_case_value(values, code, "block_table", torch.tensor(table, dtype=torch.int32).view(B, M))
    _ints(values, code, "req_of_token", req, torch.int32)
    _ints(values, code, "local_bounds", bounds, torch.int32)
    _geometry(values, code, g)
    if with_starts:
        _ints(values, code, "row_starts", starts, torch.int32)
    else:
        _scalar(values, code, "row_starts", None)
    kwargs: tuple[str, ...] = ("row_starts",)
    if mtp:
        _scalar(values, code, "next_n", next_n)
        kwargs += ("next_n",)
    return Case(
        "scoring",
        values,
        code,
        ("index_q", "weights", "index_cache", "block_table", "req_of_token", "local_bounds", "geometry"),
        kwargs=kwargs,
        out_buffers={"out": ((T, L), torch.float32, 7.0)},
    )


# ---- local top-K, pack, indexer ----------------------------------------------------------------
def _score_rows(
    draw: st.DrawFn, max_tokens: int, C: int, use_starts: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Scores ``[T, C]`` with each row's window ``[start, start + length)`` drawn, garbage outside."""

    @st.composite
    def row(draw: st.DrawFn) -> tuple[int, int, list[float]]:
        a = draw(st.integers(0, C)) if use_starts else 0
        n = draw(st.integers(0, C - a))
        vals = [draw(score_values() if a <= c < a + n else _GARBAGE) for c in range(C)]
        return a, n, vals

    rows = draw(st.lists(row(), min_size=1, max_size=max_tokens))
    s = torch.tensor([r[2] for r in rows], dtype=torch.float64).reshape(len(rows), C)
    return s.to(dtype), [r[0] for r in rows], [r[1] for r in rows]


def _distinct(row: list[int]) -> list[int]:
    """Distinct valid entries: a repeat becomes ``-1``."""
    seen: set[int] = set()
    out = []
    for j in row:
        out.append(j if j >= 0 and j not in seen else -1)
        seen.add(j)
    return out


def _ints(values: dict, code: dict, name: str, data: list[int], dtype: torch.dtype) -> None:
    _tensor_case_value(values, code, name, torch.tensor(data, dtype=dtype).reshape(len(data)))


@st.composite
def local_topk_cases(
    draw: st.DrawFn,
    *,
    max_tokens: int = 3,
    max_cols: int = 10,
    dtype: torch.dtype = torch.float32,
    index_dtypes: Sequence[torch.dtype] = (torch.int32, torch.int64),
    noncontig: bool = True,
) -> Case:
    """A local top-K: ``scores [T, C]``, ``k``, ``lengths [T]``, ``row_starts [T]`` or ``None``.

    Called as ``fn(scores, k, lengths, row_starts)`` (:func:`dcp_ref.indexer.local_topk`'s order).
    Columns outside a row's window hold values that would win (``inf``, ``1e30``, NaN).
    """
    C = draw(st.integers(0, max_cols))
    use_starts = draw(st.booleans())
    s, starts, lengths = _score_rows(draw, max_tokens, C, use_starts, dtype)
    idt = draw(st.sampled_from(tuple(index_dtypes)))
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    _tensor_case_value(values, code, "scores", s)
    _scalar(values, code, "k", draw(st.integers(1, C + 2)))
    _ints(values, code, "lengths", lengths, idt)
    if use_starts:
        _ints(values, code, "row_starts", starts, idt)
    else:
        _scalar(values, code, "row_starts", None)
    return Case(
        "local_topk",
        values,
        code,
        ("scores", "k", "lengths", "row_starts"),
        noncontig=_noncontig(draw, noncontig, ["scores", "lengths"]),
    )


@st.composite
def indexer_cases(
    draw: st.DrawFn,
    *,
    max_world: int = 16,
    max_tokens: int = 3,
    max_cols: int = 10,
    dtype: torch.dtype = torch.float32,
    index_dtypes: Sequence[torch.dtype] = (torch.int32, torch.int64),
    noncontig: bool = True,
    with_out: bool = False,
) -> Case:
    """The indexer stage: ``fn(scores, lengths, geometry, k, row_starts=...)`` -> packed ``[T, k, 2]``."""
    geo = draw(geometries(max_world=max_world))
    C = draw(st.integers(0, max_cols))
    use_starts = draw(st.booleans())
    s, starts, lengths = _score_rows(draw, max_tokens, C, use_starts, dtype)
    T = s.shape[0]
    idt = draw(st.sampled_from(tuple(index_dtypes)))
    k = draw(st.integers(1, C + 2))
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    _tensor_case_value(values, code, "scores", s)
    _ints(values, code, "lengths", lengths, idt)
    _scalar(values, code, "geometry", geo)
    _scalar(values, code, "k", k)
    kwargs: tuple[str, ...] = ()
    if use_starts:
        _ints(values, code, "row_starts", starts, idt)
        kwargs = ("row_starts",)
    return Case(
        "indexer",
        values,
        code,
        ("scores", "lengths", "geometry", "k"),
        kwargs,
        noncontig=_noncontig(draw, noncontig, ["scores", "lengths"]),
        out_buffers=_maybe_out(draw, with_out, {"out": ((T, k, 2), torch.float32, NAN)}),
    )


@st.composite
def pack_cases(
    draw: st.DrawFn,
    *,
    max_world: int = 16,
    max_tokens: int = 3,
    max_cols: int = 10,
    max_k: int = 6,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    noncontig: bool = True,
) -> Case:
    """The pack: ``fn(scores, local_ids, geometry, row_starts)`` -> ``[T, K, 2]``.

    ``local_ids`` are distinct indices inside each row's keys, ``-1`` anywhere; scores include NaN,
    ``±0``, ``±inf`` (packed as they are).
    """
    geo = draw(geometries(max_world=max_world))
    C = draw(st.integers(0, max_cols))
    K = draw(st.integers(1, max_k))
    dtype = draw(st.sampled_from(tuple(dtypes)))
    use_starts = draw(st.booleans())

    @st.composite
    def row(draw: st.DrawFn) -> tuple[int, list[float], list[int]]:
        a = draw(st.integers(0, C)) if use_starts else 0
        vals = draw(st.lists(score_values(), min_size=C, max_size=C))
        return a, vals, _distinct(draw(st.lists(st.integers(-1, C - a - 1), min_size=K, max_size=K)))

    rows = draw(st.lists(row(), min_size=1, max_size=max_tokens))
    T = len(rows)
    s = torch.tensor([r[1] for r in rows], dtype=torch.float64).reshape(T, C)
    starts = [r[0] for r in rows]
    ids = [r[2] for r in rows]
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    _tensor_case_value(values, code, "scores", s.to(dtype))
    _tensor_case_value(values, code, "local_ids", torch.tensor(ids, dtype=torch.int64).reshape(T, K))
    _scalar(values, code, "geometry", geo)
    if use_starts:
        _ints(values, code, "row_starts", starts, torch.int64)
    else:
        _scalar(values, code, "row_starts", None)
    return Case(
        "pack",
        values,
        code,
        ("scores", "local_ids", "geometry", "row_starts"),
        noncontig=_noncontig(draw, noncontig, ["scores", "local_ids"]),
    )


# ---- deinterleave -----------------------------------------------------------------------------
@st.composite
def deinterleave_cases(
    draw: st.DrawFn,
    *,
    max_world: int = 16,
    max_tokens: int = 3,
    max_k: int = 8,
    max_requests: int = 3,
    max_blocks: int = 4,
    index_dtype: torch.dtype = torch.int32,
    compact: bool = True,
    noncontig: bool = True,
    with_out: bool = False,
) -> Case:
    """The deinterleave stage: ``fn(global_ids, req_of_token, block_table, geometry[, compact=False])``.

    Ids are distinct per row with ``-1`` anywhere; mostly this rank's keys of the token's request (rows
    where every id is local happen), else any position: other ranks' keys, keys past the block table or
    on a missing block (out of contract: poisoned). Block tables hold shuffled physical blocks and a
    negative entry past each request's end (``-1``, or another negative value: any negative entry means
    "no block"). Now and then a row's request id is not a row of the block table (its whole row is
    poisoned; see :func:`dcp_ref.testing.oracle.deinterleave`).
    """
    geo = draw(geometries(max_world=max_world))
    W, I, bs = geo.world_size, geo.interleave, geo.block_size
    B = draw(st.integers(1, max_requests))
    M = draw(st.integers(1, max_blocks))
    used = [draw(st.integers(0, M)) for _ in range(B)]
    total = sum(used) + draw(st.integers(0, 2))
    phys = draw(st.permutations(list(range(total)))) if total else []
    table = torch.full((B, M), -1, dtype=torch.int64)
    nxt = 0
    for b in range(B):
        for j in range(used[b]):
            table[b, j] = phys[nxt]
            nxt += 1
        for j in range(used[b], M):
            table[b, j] = draw(_NO_BLOCK)
    K = draw(st.integers(1, max_k))
    span = (M + 1) * bs * W  # positions up to one block past the table

    @st.composite
    def row(draw: st.DrawFn) -> tuple[list[int], int]:
        b = draw(st.integers(0, B - 1))
        entries = []
        for _ in range(K):
            # Mostly this rank's keys inside the request's blocks (full rows happen), else any position or none.
            kind = draw(st.sampled_from(("local", "local", "any", "none")))
            if kind == "local" and used[b]:
                j = draw(st.integers(0, used[b] * bs - 1))
                entries.append((j // I) * W * I + geo.rank * I + j % I)
            elif kind == "none":
                entries.append(-1)
            else:
                entries.append(draw(st.integers(0, span - 1)))
        return _distinct(entries), b

    rows = draw(st.lists(row(), min_size=1, max_size=max_tokens))
    T = len(rows)
    ids = [r[0] for r in rows]
    req = [r[1] for r in rows]
    # One case in four gives one row a request id the block table does not have. Decided per case, not
    # per row: a per-row 1/16 left whole default runs (40 cases) without one, depending on the seed.
    if draw(_RARE):
        req[draw(st.integers(0, T - 1))] = draw(st.sampled_from((B, -1, B + 5)))
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    _tensor_case_value(values, code, "global_ids", torch.tensor(ids, dtype=index_dtype).reshape(T, K))
    _ints(values, code, "req_of_token", req, index_dtype)
    _tensor_case_value(values, code, "block_table", table.to(index_dtype))
    _scalar(values, code, "geometry", geo)
    kwargs: tuple[str, ...] = ()
    if not compact:
        _scalar(values, code, "compact", False)
        kwargs = ("compact",)
    return Case(
        "deinterleave",
        values,
        code,
        ("global_ids", "req_of_token", "block_table", "geometry"),
        kwargs,
        noncontig=_noncontig(draw, noncontig, ["global_ids", "block_table"]),
        out_buffers=_maybe_out(
            draw, with_out, {"out_slots": ((T, K), torch.int32, -7), "out_counts": ((T,), torch.int32, -7)}
        ),
    )


# ---- attention ---------------------------------------------------------------------------------
@st.composite
def attention_cases(
    draw: st.DrawFn,
    *,
    dtype: torch.dtype = torch.float32,
    num_heads: int | Sequence[int] | None = None,
    head_dim: int | None = None,
    v_dim: int | None = None,
    max_tokens: int = 3,
    max_k: int = 6,
    max_slots: int = 12,
    slots_width: int | None = None,
    layout: str = "compact",
    noncontig: bool = True,
    with_out: bool = False,
) -> Case:
    """The attention stage: ``fn(q, kv_cache, slots, counts, sm_scale, v_dim)``.

    KV rows no valid slot points at are NaN (a kernel that reads them leaks NaN). ``layout="compact"``:
    ``slots[t, :counts[t]]`` valid, the rest garbage (``-1``, in-range poisoned rows, or far out of
    range) that must not be read. ``layout="masked"``: valid slots anywhere, ``-1`` elsewhere.
    ``slots_width`` fixes ``K`` (e.g. 64 for a kernel that reads slots in tiles of 64).
    Empty rows (``counts = 0``), large scores (an ``exp`` without the max subtracted overflows) and
    NaN in a KV row that is read (it must propagate) are all drawn.
    """
    if num_heads is None:
        H = draw(st.integers(1, 4))
    elif isinstance(num_heads, int):
        H = num_heads
    else:
        H = draw(st.sampled_from(tuple(num_heads)))
    D = head_dim if head_dim is not None else draw(st.integers(1, 8))
    v = v_dim if v_dim is not None else draw(st.integers(1, D))
    S = draw(st.integers(1, max_slots))
    K = slots_width if slots_width is not None else draw(st.integers(1, max_k))
    big = draw(_RARE)
    literal = max_tokens * H * D + S * D <= MAX_LITERAL_ELEMS

    @st.composite
    def row(draw: st.DrawFn) -> tuple[list[float], list[int], int]:
        c = 0 if draw(_RARE) else draw(st.integers(1, min(K, S)))
        chosen = draw(st.lists(st.integers(0, S - 1), min_size=c, max_size=c, unique=True))
        if layout == "masked":
            pos = sorted(draw(st.lists(st.integers(0, K - 1), min_size=c, max_size=c, unique=True)))
            slots_row = [-1] * K
            for p, s_ in zip(pos, chosen):
                slots_row[p] = s_
        else:
            pad_st = st.one_of(st.just(-1), st.integers(0, S - 1), st.just(S + 1000))
            pad = [draw(pad_st) for _ in range(K - c)]
            slots_row = chosen + pad
        qv = draw(st.lists(data_values(big=big), min_size=H * D, max_size=H * D)) if literal else []
        return qv, slots_row, c

    rows = draw(st.lists(row(), min_size=1, max_size=max_tokens))
    T = len(rows)
    slots = [r[1] for r in rows]
    counts = [r[2] for r in rows]
    if literal:
        q = torch.tensor([r[0] for r in rows], dtype=torch.float64).reshape(T, H, D).to(dtype)
        q_recipe = None
    else:
        q, q_recipe = _floats_tensor(draw, (T, H, D), dtype, data_values(big=big), "q", big)
    kv, kv_recipe = _floats_tensor(draw, (S, D), dtype, data_values(big=big), "kv_cache", big)
    used = sorted({s_ for row, c in zip(slots, counts) for s_ in (row[:c] if layout == "compact" else row) if s_ >= 0})
    poisoned = [r for r in range(S) if r not in used]
    kv = kv.clone()
    if poisoned:
        kv[poisoned] = NAN
    nan_row = None
    nan_in_data: bool = draw(_RARE) and draw(_RARE)
    if used and nan_in_data:  # real data: a NaN in a row that is read must propagate
        nan_row = draw(st.sampled_from(used))
        kv[nan_row, draw(st.integers(0, D - 1))] = NAN
    sm_scale = draw(st.sampled_from((0.5, 1.0, 0.125, 0.25)))
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    _tensor_case_value(values, code, "q", q, q_recipe)
    if kv_recipe is None:
        _tensor_case_value(values, code, "kv_cache", kv)
    else:
        extra = f"\nkv_cache[{poisoned}] = nan  # rows no valid slot points at" if poisoned else ""
        if nan_row is not None:
            col = int(torch.isnan(kv[nan_row]).nonzero()[0])
            extra += f"\nkv_cache[{nan_row}, {col}] = nan  # real data: must propagate"
        _tensor_case_value(values, code, "kv_cache", kv, kv_recipe + extra)
    _tensor_case_value(values, code, "slots", torch.tensor(slots, dtype=torch.int32).reshape(T, K))
    _ints(values, code, "counts", counts, torch.int32)
    _scalar(values, code, "sm_scale", sm_scale)
    _scalar(values, code, "v_dim", v)
    return Case(
        "attention",
        values,
        code,
        ("q", "kv_cache", "slots", "counts", "sm_scale", "v_dim"),
        noncontig=_noncontig(draw, noncontig, ["q", "kv_cache", "slots"]),
        out_buffers=_maybe_out(
            draw, with_out, {"out": ((T, H, v), dtype, NAN), "out_lse": ((T, H), torch.float32, NAN)}
        ),
        meta={"layout": layout},
    )


# ---- correct -----------------------------------------------------------------------------------
#: LSE levels: equal values, spreads that overflow a naive ``exp``, and ``-inf`` (an empty rank).
LSE_LEVELS = (0.0, 1.0, -1.0, 2.0, 0.5, 90.0, -90.0, 1000.0, -INF)
#: Rarer LSEs: corrupt data (NaN, ``+inf``: never "empty", they must come out NaN) and finite values near
#: the float32 maximum (their base-2 form overflows float32 unless the max is subtracted first).
LSE_EXTREMES = (NAN, INF, 3.0e38, 3.3e38, -3.3e38)
_LSE_VALUES = st.one_of(st.sampled_from(LSE_LEVELS), st.floats(-100, 100, width=32))
_EMPTY_PARTIAL = st.sampled_from((NAN, INF, 1e30, 0.0))  # what an empty rank's partial may hold


@st.composite
def correct_cases(
    draw: st.DrawFn,
    *,
    max_world: int = 16,
    max_tokens: int = 3,
    max_heads: int = 3,
    max_v: int = 6,
    dtype: torch.dtype = torch.float32,
    form: str = "correct",
    noncontig: bool = True,
    with_out: bool = False,
) -> Case:
    """The correct stage: ``form="correct"``: ``fn(partial [T, H, v], all_lse [W, T, H], rank)`` (the stage);
    ``form="merge"``: ``fn(outs [W, T, H, v], lses [W, T, H])`` (all partials in one place).

    Empty ranks (LSE ``-inf``) hold garbage partials — NaN, ``inf``, ``1e30`` — that must contribute
    exactly 0 (``0 * NaN`` is NaN); rows where every rank is empty; LSE spreads far past ``exp``'s
    range; NaN in a non-empty partial, which must propagate; now and then a NaN or ``+inf`` LSE
    (corrupt: that ``(t, h)`` must come out NaN, never "empty") and finite LSEs near the float32
    maximum (:data:`LSE_EXTREMES`).
    """
    W = draw(st.integers(1, max_world))
    H = draw(st.integers(1, max_heads))
    v = draw(st.integers(1, max_v))
    rank = draw(st.integers(0, W - 1))
    empty_ranks = draw(st.sets(st.integers(0, W - 1), max_size=W))
    ranks = list(range(W)) if form == "merge" else [rank]

    @st.composite
    def token(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.empty((W, H), dtype=torch.float64)
        for w in range(W):
            for h in range(H):
                if w in empty_ranks:
                    lse[w, h] = -INF
                elif draw(_RARE) and draw(_RARE):
                    lse[w, h] = draw(st.sampled_from(LSE_EXTREMES))
                else:
                    lse[w, h] = draw(_LSE_VALUES)
        outs = torch.empty((len(ranks), H, v), dtype=torch.float64)
        for n, w in enumerate(ranks):
            for h in range(H):
                empty = lse[w, h] == -INF
                col = lse[:, h][~torch.isnan(lse[:, h])]
                # the heaviest rank (weight >= 1/W): a NaN in its partial shows
                best = (not empty) and bool(col.numel()) and bool(lse[w, h] == col.max())
                for d in range(v):
                    if empty:
                        outs[n, h, d] = draw(_EMPTY_PARTIAL)
                    elif best and draw(_RARE) and draw(_RARE):
                        outs[n, h, d] = NAN
                    else:
                        outs[n, h, d] = draw(data_values())
        return lse, outs

    toks = draw(st.lists(token(), min_size=1, max_size=max_tokens))
    T = len(toks)
    lse = torch.stack([x[0] for x in toks], dim=1)  # [W, T, H]
    outs = torch.stack([x[1] for x in toks], dim=1)  # [R, T, H, v]
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    if form == "merge":
        _tensor_case_value(values, code, "outs", outs.to(dtype))
        _tensor_case_value(values, code, "lses", lse.to(torch.float32))
        args: tuple[str, ...] = ("outs", "lses")
        bufs = {"out": ((T, H, v), dtype, NAN), "out_lse": ((T, H), torch.float32, NAN)}
    else:
        _tensor_case_value(values, code, "partial", outs[0].to(dtype))
        _tensor_case_value(values, code, "all_lse", lse.to(torch.float32))
        _scalar(values, code, "rank", rank)
        args = ("partial", "all_lse", "rank")
        bufs = {"out": ((T, H, v), dtype, NAN), "out_lse": ((T, H), torch.float32, NAN)}
    return Case(
        "correct",
        values,
        code,
        args,
        noncontig=_noncontig(draw, noncontig, list(args[:2])),
        out_buffers=_maybe_out(draw, with_out, bufs),
        meta={"form": form},
    )


# ---- the whole step ----------------------------------------------------------------------------
@dataclass
class StepProblem:
    """A decode problem as the ranks hold it (see :func:`make_step_problem`).

    Attributes:
        q: float ``[T, H, D]``.  seq_lens: int64 ``[B]``.  next_n: int or int64 ``[B]``.
        kv_caches, block_tables, index_scores: one tensor per rank (paged KV ``[S_r, D]``, int32
            ``[B, M_r]``, float32 ``[T, L_r]`` with NaN past each token's local bound).
        world_size, interleave, block_size, topk, sm_scale, v_dim: the step's parameters.
        index_q, index_weights, index_keys, index_caches: the lightning indexer's inputs when the problem
            has them (:func:`with_index_keys`; ``None`` otherwise): float8_e4m3fn ``[T, Hi, 128]``, float32
            ``[T, Hi]``, per request float32 ``[L_b, 128]``, per rank the FP8 index-key cache paged with
            ``block_tables[r]``; ``index_scores`` are then their exact scores.
    """

    q: torch.Tensor
    seq_lens: torch.Tensor
    next_n: int | torch.Tensor
    kv_caches: list[torch.Tensor]
    block_tables: list[torch.Tensor]
    index_scores: list[torch.Tensor]
    world_size: int
    interleave: int
    block_size: int
    topk: int
    sm_scale: float
    v_dim: int
    index_q: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None
    index_keys: list[torch.Tensor] | None = None
    index_caches: list[torch.Tensor] | None = None

    def geometry(self, rank: int) -> DcpGeometry:
        return DcpGeometry(self.world_size, rank, self.interleave, self.block_size)

    def req_of_token(self) -> torch.Tensor:
        """int64 ``[T]``: the request of each query token."""
        per = self.next_n if isinstance(self.next_n, torch.Tensor) else torch.full_like(self.seq_lens, self.next_n)
        return torch.arange(self.seq_lens.numel()).repeat_interleave(per)


def make_step_problem(
    world_size: int,
    interleave: int,
    block_size: int,
    seq_lens: Sequence[int],
    next_n: int | Sequence[int],
    scores: Sequence[Sequence[float]],
    *,
    num_heads: int,
    head_dim: int,
    v_dim: int | None = None,
    topk: int,
    sm_scale: float = 0.5,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> StepProblem:
    """Shard a decode problem given its global index scores (one row per query token).

    ``scores[t][p]`` is query token ``t``'s index score of global position ``p`` (only ``p`` below the
    token's causal bound matter; the row may be shorter than the longest request, missing = NaN).
    ``q`` and the KV rows are drawn from ``seed`` (multiples of 1/4: exact in every float dtype); each
    rank's physical blocks are handed out in a shuffled order, with one spare block, and its cache
    rows that no token owns are NaN.
    """
    W, I, bs = int(world_size), int(interleave), int(block_size)
    DcpGeometry(W, 0, I, bs)  # validates
    lens = [int(x) for x in seq_lens]
    B = len(lens)
    per = [int(next_n)] * B if isinstance(next_n, int) else [int(x) for x in next_n]
    T = sum(per)
    if len(scores) != T:
        raise ValueError(f"scores must have one row per query token ({T}), got {len(scores)}")
    g = torch.Generator().manual_seed(seed)
    q = ((torch.randn((T, num_heads, head_dim), generator=g, dtype=torch.float64) * 4).round() / 4).to(dtype)
    kv_global = [
        ((torch.randn((L, head_dim), generator=g, dtype=torch.float64) * 4).round() / 4).to(dtype) for L in lens
    ]
    Lmax = max(lens) if lens else 0
    glob = torch.full((T, max(Lmax, 1)), NAN, dtype=torch.float32)
    for t, row in enumerate(scores):
        if len(row):
            glob[t, : len(row)] = torch.tensor([float(x) for x in row], dtype=torch.float32)[: glob.shape[1]]
    req = [b for b in range(B) for _ in range(per[b])]
    kvs, bts, scs = [], [], []
    for r in range(W):
        own = [[p for p in range(L) if (p // I) % W == r] for L in lens]
        nblk = [(len(o) + bs - 1) // bs for o in own]
        total = sum(nblk) + 1
        perm = torch.randperm(total, generator=g).tolist()
        table = torch.full((B, max(max(nblk, default=0), 1)), -1, dtype=torch.int32)
        kv = torch.full((total * bs, head_dim), NAN, dtype=dtype)
        nxt = 0
        for b in range(B):
            for j in range(nblk[b]):
                table[b, j] = perm[nxt]
                nxt += 1
            for p in own[b]:
                loc = (p // (W * I)) * I + p % I
                kv[int(table[b, loc // bs]) * bs + loc % bs] = kv_global[b][p]
        width = max(max((len(o) for o in own), default=0), 1)
        sc = torch.full((T, width), NAN, dtype=torch.float32)
        for t in range(T):
            for p in own[req[t]]:
                sc[t, (p // (W * I)) * I + p % I] = glob[t, p]
        kvs.append(kv)
        bts.append(table)
        scs.append(sc)
    nn: int | torch.Tensor = int(next_n) if isinstance(next_n, int) else torch.tensor(per, dtype=torch.int64)
    return StepProblem(
        q,
        torch.tensor(lens, dtype=torch.int64),
        nn,
        kvs,
        bts,
        scs,
        W,
        I,
        bs,
        int(topk),
        float(sm_scale),
        int(v_dim if v_dim is not None else head_dim),
    )


def _owner_local(p: int, W: int, I: int) -> tuple[int, int]:
    """``(rank, local index)`` of global position ``p`` (the ownership map, written out: the kit's own)."""
    return (p // I) % W, (p // (W * I)) * I + p % I


def with_index_keys(problem: StepProblem, *, index_heads: int = 2, seed: int = 0) -> StepProblem:
    """The same decode problem with the lightning indexer's inputs, its index scores replaced by theirs.

    Index keys and queries are integers in ``[-2, 2]`` (exact in e4m3, and the cache's per-key power-of-two
    scale gives them back exactly), weights multiples of 1/16 below 1/4: every score ``sum_h w[h] *
    relu(q[h] . k)`` is a multiple of 1/16 far below ``2**24`` steps, so a float32 scoring kernel's scores
    equal these float64 ones bit for bit whatever its summation order, and the selection — with many ties —
    must match exactly. Each rank's index-key cache shares its KV block table (as the layer's does).
    """
    from ..index_cache import build_sharded_index_caches  # the write side builds the input, not the answer

    W, I, bs = problem.world_size, problem.interleave, problem.block_size
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in problem.seq_lens.tolist()]
    req = problem.req_of_token().tolist()
    T, dim = len(req), 128
    keys = [torch.randint(-2, 3, (L, dim), generator=g).to(torch.float32) for L in lens]
    q = torch.randint(-2, 3, (T, index_heads, dim), generator=g).to(torch.float32)
    w = torch.randint(0, 4, (T, index_heads), generator=g).to(torch.float32) / 16
    scores = [torch.full_like(sc, NAN) for sc in problem.index_scores]
    for t, b in enumerate(req):
        s = (w[t].double()[:, None] * torch.relu(q[t].double() @ keys[b].double().T)).sum(0)  # [L_b]
        for pos in range(lens[b]):
            r, loc = _owner_local(pos, W, I)
            scores[r][t, loc] = float(s[pos])
    caches = build_sharded_index_caches(
        keys, problem.block_tables, problem.geometry(0), [kv.shape[0] // bs for kv in problem.kv_caches]
    )
    return replace(
        problem,
        index_scores=scores,
        index_q=q.to(torch.float8_e4m3fn),
        index_weights=w,
        index_keys=keys,
        index_caches=caches,
    )


def unsharded(problem: StepProblem, *, seed: int = 0) -> StepProblem:
    """The same decode problem held whole by one rank (``W = 1``): what every rank of the tensor-parallel layout
    holds. The KV rows, index scores (and index keys) of every position are the problem's; the blocks are
    handed out anew in a shuffled order (one spare), unused cache rows NaN."""
    from ..index_cache import build_sharded_index_caches

    W, I, bs = problem.world_size, problem.interleave, problem.block_size
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in problem.seq_lens.tolist()]
    req = problem.req_of_token().tolist()
    B, T, D = len(lens), len(req), problem.kv_caches[0].shape[-1]
    nblk = [-(-L // bs) for L in lens]
    perm = torch.randperm(sum(nblk) + 1, generator=g).tolist()
    table = torch.full((B, max(max(nblk, default=0), 1)), -1, dtype=torch.int32)
    kv = torch.full(((sum(nblk) + 1) * bs, D), NAN, dtype=problem.kv_caches[0].dtype)
    sc = torch.full((T, max(max(lens, default=0), 1)), NAN, dtype=torch.float32)
    for b, L in enumerate(lens):
        table[b, : nblk[b]] = torch.tensor([perm.pop() for _ in range(nblk[b])], dtype=torch.int32)
        for pos in range(L):
            r, loc = _owner_local(pos, W, I)
            src = int(problem.block_tables[r][b, loc // bs]) * bs + loc % bs
            kv[int(table[b, pos // bs]) * bs + pos % bs] = problem.kv_caches[r][src]
    for t, b in enumerate(req):
        for pos in range(lens[b]):
            r, loc = _owner_local(pos, W, I)
            sc[t, pos] = problem.index_scores[r][t, loc]
    caches = None
    if problem.index_keys is not None:
        caches = build_sharded_index_caches(problem.index_keys, [table], DcpGeometry(1, 0, I, bs), kv.shape[0] // bs)
    return replace(problem, kv_caches=[kv], block_tables=[table], index_scores=[sc], world_size=1, index_caches=caches)


#: Index scores of a step: mostly three levels (ties across ranks decide the winners), else any score.
_STEP_SCORES = st.one_of(st.sampled_from((0.0, 1.0, 0.5, -0.0)), score_values())


@st.composite
def step_cases(
    draw: st.DrawFn,
    *,
    max_world: int = 16,
    world_sizes: Sequence[int] | None = None,
    max_requests: int = 2,
    max_len: int = 24,
    max_next_n: int = 2,
    head_dim: int | None = None,
    v_dim: int | None = None,
    heads_per_rank: int | Sequence[int] = (1, 2),
    topk: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """A whole decode step: ``W`` ranks, ``I``, block size, requests (some shorter than ``W``: empty
    ranks), MTP query tokens, top-k from 1 to past the length, index scores with ties, ``±0``, ``±inf``
    and NaN. ``topk`` fixes the top-k (e.g. 64 for a kernel that reads slots in tiles of 64). The case's
    ``values["problem"]`` is a :class:`StepProblem`.
    """
    W = draw(st.sampled_from(tuple(world_sizes))) if world_sizes else draw(st.integers(1, max_world))
    I = draw(st.sampled_from((1, 2, 4)))
    bs = I * draw(st.sampled_from((1, 2)))
    B = draw(st.integers(1, max_requests))
    nn = draw(st.integers(1, max_next_n))
    lens = [draw(st.integers(nn, max_len)) for _ in range(B)]
    hpr = heads_per_rank if isinstance(heads_per_rank, int) else draw(st.sampled_from(tuple(heads_per_rank)))
    D = head_dim if head_dim is not None else draw(st.integers(1, 6))
    v = v_dim if v_dim is not None else draw(st.integers(1, D))
    topk = topk if topk is not None else draw(st.integers(1, max(lens) + 1))
    rows = []
    for b in range(B):
        for j in range(nn):
            n = lens[b] - nn + j + 1
            rows.append(draw(st.lists(_STEP_SCORES, min_size=n, max_size=n)))
    seed = draw(st.integers(0, 3))
    sm_scale = draw(st.sampled_from((0.5, 0.25)))
    problem = make_step_problem(
        W,
        I,
        bs,
        lens,
        nn,
        rows,
        num_heads=hpr * W,
        head_dim=D,
        v_dim=v,
        topk=topk,
        sm_scale=sm_scale,
        seed=seed,
        dtype=dtype,
    )
    rows_code = "[" + ", ".join("[" + ", ".join(_num(x, True) for x in r) + "]" for r in rows) + "]"
    code = (
        f"problem = make_step_problem(world_size={W}, interleave={I}, block_size={bs}, seq_lens={lens}, "
        f"next_n={nn},\n    scores={rows_code},\n    num_heads={hpr * W}, head_dim={D}, v_dim={v}, topk={topk}, "
        f"sm_scale={sm_scale}, seed={seed}, dtype={dtype})"
    )
    return Case(
        "step",
        {"problem": problem},
        {"problem": "from dcp_ref.testing import make_step_problem\n" + code},
        ("problem",),
    )


# ---- adversarial cases every checker runs first ------------------------------------------------
# Hypothesis draws the corners above at random; these hand-built cases put the ones a wrong kernel
# most often gets wrong into every run, whatever ``max_examples`` is: signed zeros that tie, ties
# whose lower id sits in the later position, ``-inf`` scores (valid), NaN scores and ``-1`` ids with a
# high score (invalid), negative block entries other than ``-1``, a request id the block table does
# not have, corrupt (NaN / ``+inf``) and near-float32-maximum LSEs. Each respects the checker's
# parameters (a case that does not fit them is left out).
def _pairs_tensor(ranks: list[list[list[tuple[float, int]]]]) -> torch.Tensor:
    """``[W][T][K]`` of ``(score, id)`` -> float32 ``[W, T, K, 2]``."""
    return torch.tensor([[[[s_, float(i)] for s_, i in row] for row in rank] for rank in ranks], dtype=torch.float32)


def adversarial_select_cases(*, max_world: int = 16, max_candidates: int = 6, with_out: bool = False) -> list[Case]:
    """Select cases: a ``-0.0`` / ``+0.0`` tie won by the lower id (on the ``-0.0`` side), a valid
    ``-inf`` candidate, a NaN score and a ``-1`` id with a high score (both invalid), and a tie whose
    lower id comes from the later rank. Every rank's list is sorted as the indexer leaves it."""
    nan_, inf_ = NAN, INF
    # rank 0: 1.0 (id 9), -0.0 (id 2), NaN (id 3; invalid) | rank 1: +0.0 (id 5), -inf (id 7), 2.0 with id -1
    zeros = [[[(1.0, 9), (-0.0, 2), (nan_, 3)]], [[(0.0, 5), (-inf_, 7), (2.0, -1)]]]
    specs = [
        (zeros, 2),  # the last place goes to the -0.0 / +0.0 tie: the lower id (2, the -0.0) wins
        (zeros, 4),  # every valid candidate, the -inf one included
        ([[[(0.5, 8)]], [[(0.5, 4)]]], 1),  # the same score on both ranks: the lower id (rank 1's) wins
    ]
    out = []
    for ranks, k in specs:
        g = _pairs_tensor(ranks)
        W, T, K, _ = g.shape
        if W > max_world or K > max_candidates:
            continue
        values: dict[str, Any] = {}
        code: dict[str, str] = {}
        _tensor_case_value(values, code, "gathered", g)
        _scalar(values, code, "k", k)
        bufs: dict[str, tuple[tuple[int, ...], torch.dtype, float]] = (
            {"out": ((T, k), torch.int32, -7)} if with_out else {}
        )
        out.append(Case("select", values, code, ("gathered", "k"), out_buffers=bufs))
    return out


def adversarial_local_topk_cases(
    *, dtype: torch.dtype = torch.float32, index_dtype: torch.dtype = torch.int32
) -> list[Case]:
    """Local top-K: ``-0.0`` (key 0) and ``+0.0`` (key 1) tie for the last place (the lower index wins),
    a NaN key (never chosen), a ``-inf`` key (valid), and a value past the row's length that would win;
    then a row whose keys start at column 2 (``row_starts``), with winning garbage before them."""
    cases = []
    for row, k, length, start in (
        ([-0.0, 0.0, 1.0, NAN, -INF, 1e30], 2, 5, None),
        ([9.0, 9.0, 0.5, 2.0, -1.0, 9.0], 1, 3, 2),
    ):
        values: dict[str, Any] = {}
        code: dict[str, str] = {}
        _tensor_case_value(values, code, "scores", torch.tensor([row], dtype=torch.float64).to(dtype))
        _scalar(values, code, "k", k)
        _ints(values, code, "lengths", [length], index_dtype)
        if start is None:
            _scalar(values, code, "row_starts", None)
        else:
            _ints(values, code, "row_starts", [start], index_dtype)
        cases.append(Case("local_topk", values, code, ("scores", "k", "lengths", "row_starts")))
    return cases


def adversarial_indexer_cases(*, index_dtype: torch.dtype = torch.int32, with_out: bool = False) -> list[Case]:
    """The indexer: the local top-K tie of :func:`adversarial_local_topk_cases` on rank 1 of 2 with
    ``I = 2`` (the ids must follow the interleave)."""
    scores = torch.tensor([[-0.0, 0.0, 1.0, NAN, -INF, 1e30]], dtype=torch.float32)
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    _tensor_case_value(values, code, "scores", scores)
    _ints(values, code, "lengths", [5], index_dtype)
    _scalar(values, code, "geometry", DcpGeometry(2, 1, 2, 2))
    _scalar(values, code, "k", 2)
    bufs: dict[str, tuple[tuple[int, ...], torch.dtype, float]] = (
        {"out": ((1, 2, 2), torch.float32, NAN)} if with_out else {}
    )
    return [Case("indexer", values, code, ("scores", "lengths", "geometry", "k"), out_buffers=bufs)]


def adversarial_deinterleave_cases(
    *,
    max_world: int = 16,
    max_k: int = 8,
    index_dtype: torch.dtype = torch.int32,
    compact: bool = True,
    with_out: bool = False,
) -> list[Case]:
    """Deinterleave on rank 1 of ``W = 2``, ``I = 2``, block size 4: a row with a slot, ids of the other
    rank, an id on a block entry ``-3`` and one past the table (both poisoned); a row whose request id
    (3) is not a row of the 2-row table (all poisoned); a row with a ``-1`` block."""
    if max_world < 2 or max_k < 7:
        return []
    geo = DcpGeometry(2, 1, 2, 4)
    table = [[5, -3, 7], [2, -1, -1]]
    ids = [[3, 0, 10, 18, -1, 26, 7], [2, 1, -1, 6, 5, 4, 9], [2, 3, 1, -1, 6, 7, 11]]
    req = [0, 3, 1]
    values: dict[str, Any] = {}
    code: dict[str, str] = {}
    _tensor_case_value(values, code, "global_ids", torch.tensor(ids, dtype=index_dtype))
    _ints(values, code, "req_of_token", req, index_dtype)
    _tensor_case_value(values, code, "block_table", torch.tensor(table, dtype=index_dtype))
    _scalar(values, code, "geometry", geo)
    kwargs: tuple[str, ...] = ()
    if not compact:
        _scalar(values, code, "compact", False)
        kwargs = ("compact",)
    T, K = len(ids), len(ids[0])
    bufs: dict[str, tuple[tuple[int, ...], torch.dtype, float]] = (
        {"out_slots": ((T, K), torch.int32, -7), "out_counts": ((T,), torch.int32, -7)} if with_out else {}
    )
    return [
        Case(
            "deinterleave",
            values,
            code,
            ("global_ids", "req_of_token", "block_table", "geometry"),
            kwargs,
            out_buffers=bufs,
        )
    ]


def adversarial_correct_cases(
    *, max_world: int = 16, dtype: torch.dtype = torch.float32, form: str = "correct", with_out: bool = False
) -> list[Case]:
    """The merge over ``W = 3`` ranks (rank 2 empty, its partial NaN): per ``(t, h)`` an ordinary merge,
    a NaN LSE, a ``+inf`` LSE (both corrupt: NaN out), finite LSEs near the float32 maximum (3.0e38,
    3.3e38), and spreads that overflow a naive ``exp`` (1000 against 990). ``form="correct"``: one case
    for rank 0 and one for the empty rank 2."""
    if max_world < 3:
        return []
    lse = torch.tensor(
        [
            [[0.0, NAN], [INF, 3.0e38], [1000.0, -90.0]],
            [[1.0, 2.0], [-1.0, 3.3e38], [990.0, 90.0]],
            [[-INF, -INF], [-INF, -INF], [-INF, -INF]],
        ],
        dtype=torch.float32,
    )  # [W=3, T=3, H=2]
    W, T, H = lse.shape
    v = 2
    outs = torch.tensor([[0.5, -1.0], [2.0, 0.25]], dtype=torch.float64).expand(W, T, H, v).clone()
    outs[1] *= -2.0
    outs[2] = NAN  # the empty rank's garbage
    bufs = {"out": ((T, H, v), dtype, NAN), "out_lse": ((T, H), torch.float32, NAN)} if with_out else {}
    cases = []
    if form == "merge":
        values: dict[str, Any] = {}
        code: dict[str, str] = {}
        _tensor_case_value(values, code, "outs", outs.to(dtype))
        _tensor_case_value(values, code, "lses", lse)
        cases.append(Case("correct", values, code, ("outs", "lses"), out_buffers=bufs, meta={"form": form}))
        return cases
    for rank in (0, 2):
        values = {}
        code = {}
        _tensor_case_value(values, code, "partial", outs[rank].to(dtype))
        _tensor_case_value(values, code, "all_lse", lse)
        _scalar(values, code, "rank", rank)
        cases.append(
            Case("correct", values, code, ("partial", "all_lse", "rank"), out_buffers=bufs, meta={"form": form})
        )
    return cases
