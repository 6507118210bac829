"""The guard's twins accept and refuse the same inputs, with the same message, and read every view right.

1. **The table**: bad arguments to :func:`dcp_ref.guard.reference_guard` and to the kernel
   (:func:`dcp_ref.kernels.guard_triton.guard_triton`): each starts from a valid call and changes one argument;
   both twins raise the same type with the same message, which starts with the argument's name. (Before: the
   reference checked nothing — a float bound was taken, a 1-D table crashed inside ``unpack``.)
2. **Any view, the right rows**: expanded (stride-0) and transposed block tables, strided metadata, strided
   ``partial`` / ``lse``: both twins poison exactly the tokens an independent per-token rule (plain Python, from
   :mod:`dcp_ref.guard`'s docstring) refuses and leave every other element as it was. (Before: the kernel read
   the metadata at unit stride and the table's rows at ``max(stride(0), 1)``: an expanded table poisoned a valid
   token and read past its storage.)
3. The same on the H200 (``gpu``), where the kernel is compiled, not interpreted.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dcp_ref.geometry import DcpGeometry
from dcp_ref.guard import reference_guard

gt = pytest.importorskip("dcp_ref.kernels.guard_triton")

BS = 4
GEO = DcpGeometry(2, 0, 1, BS)
T, H, V = 3, 2, 5


def base(dev: torch.device) -> dict:
    """A valid call: 3 tokens, 2 requests, a 16-column score width."""
    return dict(
        partial=torch.zeros(T, H, V, device=dev),
        lse=torch.zeros(T, H, device=dev),
        local_bounds=torch.tensor([8, 12, 3], device=dev),
        req_of_token=torch.tensor([0, 1, 1], dtype=torch.int32, device=dev),
        block_table=torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32, device=dev),
        geometry=GEO,
        n_cols=16,
        row_starts=None,
        index_q=torch.zeros(T, 4, 8, device=dev).to(torch.float8_e4m3fn),
        index_weights=torch.ones(T, 4, device=dev),
    )


SCORED = ("num_blocks", "next_n", "index_q", "index_weights")  # the scoring rows' keywords


def _call(fn: Callable, a: dict) -> None:
    scored = {k: a[k] for k in SCORED if k in a}
    fn(a["partial"], a["lse"], a["local_bounds"], a["req_of_token"], a["block_table"], a["geometry"], a["n_cols"],
       row_starts=a["row_starts"], **scored)  # fmt: skip


def _bad_cases(dev: torch.device) -> list[tuple[str, str, object, type]]:
    """``(label, argument, bad value, exception type)``."""
    expanded_partial = torch.zeros(1, H, V, device=dev).expand(T, H, V)
    overlap = torch.zeros(T, H, V, device=dev)
    return [
        ("partial not a tensor", "partial", [[0.0]], TypeError),
        ("partial 2-D", "partial", torch.zeros(T, H, device=dev), ValueError),
        ("partial integer", "partial", torch.zeros(T, H, V, dtype=torch.int32, device=dev), TypeError),
        ("partial expanded", "partial", expanded_partial, ValueError),
        ("lse wrong shape", "lse", torch.zeros(T, H + 1, device=dev), ValueError),
        ("lse integer", "lse", torch.zeros(T, H, dtype=torch.int64, device=dev), TypeError),
        ("lse inside partial", "lse", overlap[:, :, 0], ValueError),
        ("local_bounds float", "local_bounds", torch.tensor([8.0, 12.0, 3.0], device=dev), TypeError),
        ("local_bounds short", "local_bounds", torch.tensor([8, 12], device=dev), ValueError),
        ("local_bounds 2-D", "local_bounds", torch.tensor([[8, 12, 3]], device=dev), ValueError),
        ("req_of_token missing", "req_of_token", None, TypeError),
        ("req_of_token long", "req_of_token", torch.tensor([0, 1, 1, 0], device=dev), ValueError),
        ("row_starts float", "row_starts", torch.zeros(T, device=dev), TypeError),
        ("row_starts short", "row_starts", torch.zeros(T - 1, dtype=torch.int64, device=dev), ValueError),
        ("block_table 1-D", "block_table", torch.tensor([0, 1, 2, 3], device=dev), ValueError),
        ("block_table float", "block_table", torch.zeros(2, 4, device=dev), TypeError),
        ("geometry", "geometry", (2, 0, 1, BS), TypeError),
        ("n_cols negative", "n_cols", -1, ValueError),
        ("n_cols float", "n_cols", 16.0, TypeError),
        ("num_blocks negative", "num_blocks", -1, ValueError),
        ("num_blocks float", "num_blocks", 8.0, TypeError),
        ("next_n zero", "next_n", 0, ValueError),
        ("next_n not dividing T", "next_n", 2, ValueError),
        ("next_n bool", "next_n", True, TypeError),
        ("index_q without index_weights", "index_weights", None, ValueError),
        ("index_q integer", "index_q", torch.zeros(T, 4, 8, dtype=torch.int32, device=dev), TypeError),
        ("index_q 2-D", "index_q", torch.zeros(T, 4, device=dev), ValueError),
        ("index_weights of other heads", "index_weights", torch.zeros(T, 3, device=dev), ValueError),
        ("index_weights integer", "index_weights", torch.zeros(T, 4, dtype=torch.int64, device=dev), TypeError),
    ]


def _raised(fn: Callable, a: dict) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as e:
        _call(fn, a)
    return type(e.value), str(e.value)


def _check_twins_refuse(dev: torch.device, lse_alias_of_partial: bool = True) -> None:
    for label, name, value, exc in _bad_cases(dev):
        a = base(dev)
        a[name] = value
        if label == "lse inside partial":
            a["partial"] = value._base  # type: ignore[union-attr]  (the tensor lse is a column of)
        ref = _raised(reference_guard, a)
        ker = _raised(gt.guard_triton, a)
        assert ref == ker, (label, ref, ker)
        assert ref[0] is exc, (label, ref)
        assert ref[1].startswith(name), (label, ref)


def test_the_twins_refuse_the_same_inputs_with_the_same_message(kernel_device) -> None:
    _check_twins_refuse(kernel_device)


def test_every_base_call_is_valid(kernel_device) -> None:
    for fn in (reference_guard, gt.guard_triton):
        a = base(kernel_device)
        _call(fn, a)
        assert not torch.isnan(a["lse"]).any() and not torch.isnan(a["partial"]).any()


# ---------------------------------------------------------------------------------------------- any view
def oracle_bad(bounds: list[int], req: list[int], table: list[list[int]], n_cols: int, starts: list[int] | None,
               bs: int, num_blocks: int | None = None, next_n: int = 1,
               finite: list[bool] | None = None) -> list[bool]:  # fmt: skip
    """Per token, written from :mod:`dcp_ref.guard`'s rule: out of contract? (``finite``: whether each token's
    index query and weights are all finite.)"""
    B = len(table)
    M = len(table[0]) if B else 0
    bad = []
    for t, (n, b) in enumerate(zip(bounds, req, strict=True)):
        s = starts[t] if starts is not None else 0
        group = req[t // next_n * next_n : (t // next_n + 1) * next_n]
        if not 0 <= b < B or n < 0 or s < 0 or s + n > n_cols or len(set(group)) > 1:
            bad.append(True)
            continue
        if finite is not None and not finite[t]:
            bad.append(True)
            continue
        need = -(-n // bs)
        lim = num_blocks if num_blocks is not None else float("inf")
        bad.append(need > M or any(not 0 <= table[b][j] < lim for j in range(need)))
    return bad


def _views(dev: torch.device, seed: int) -> dict:
    """A random valid-or-not call whose tensors are views: an expanded or transposed table, strided metadata,
    ``partial`` a slice of a wider buffer with a permuted layout, ``lse`` transposed."""
    g = torch.Generator().manual_seed(seed)
    t_, h, v, m = 5, 3, 4, 4
    bounds = torch.randint(-2, 18, (t_,), generator=g)
    req = torch.randint(-1, 4, (t_,), generator=g)
    starts = torch.randint(-1, 6, (t_,), generator=g) if seed % 2 else None
    kind = seed % 3
    if kind == 0:  # expanded: every request has the same row
        table = torch.randint(-1, 9, (1, m), generator=g).to(dev).expand(3, m)
    elif kind == 1:  # transposed storage: column stride 3
        table = torch.randint(-1, 9, (m, 3), generator=g).to(dev).t()
    else:  # rows at stride 2 * m (every other row of a taller table)
        table = torch.randint(-1, 9, (6, m), generator=g).to(dev)[::2]
    meta = torch.stack([bounds, req, starts if starts is not None else bounds], 1).to(dev)  # [T, 3]: stride 3
    req_view = meta[:, 1]
    if seed % 4 == 0:  # int32 request ids, still a strided view
        req_view = meta.to(torch.int32)[:, 1]
    scored: dict = {}
    finite = None
    if seed % 5 in (1, 3):  # the scoring rows: a short index cache, MTP pairs (T = 6), a non-finite index query
        hi, d = 2, 3
        q = torch.randn(t_, hi, d, generator=g)
        w = torch.randn(t_, hi, generator=g)
        which = torch.randint(0, 6, (t_,), generator=g)
        q[which == 0, 1, 2] = float("nan")
        w[which == 1, 0] = float("inf") if seed % 2 else float("-inf")
        if seed % 10 == 3:  # float8 e4m3fn (its NaN byte; no infinity), in a strided view of a wider buffer
            q8 = torch.zeros(t_, hi, d + 2, dtype=torch.uint8)
            q8[:, :, :d] = q.nan_to_num(0.0).to(torch.float8_e4m3fn).view(torch.uint8)
            q8[:, :, :d][q.isnan()] = 0xFF
            index_q = q8.to(dev)[:, :, :d].view(torch.float8_e4m3fn)
        else:
            index_q = q.to(dev).transpose(1, 2).contiguous().transpose(1, 2)  # [T, Hi, D] with D strided
        finite = [bool(torch.isfinite(q[t]).all() and torch.isfinite(w[t]).all()) for t in range(t_)]
        scored = dict(num_blocks=int(torch.randint(3, 10, (), generator=g)), index_q=index_q, index_weights=w.to(dev))
    wide = torch.zeros(v + 2, t_, h, device=dev)  # partial [T, H, V] as a permuted slice: strides (h, 1, T*h)
    partial = wide.permute(1, 2, 0)[:, :, 1 : v + 1]
    lse = torch.zeros(h, t_, device=dev).t()
    fill = torch.randn(t_, h, v, generator=g)
    partial.copy_(fill.to(dev))
    lse.copy_(fill[:, :, 0].to(dev))
    return dict(
        partial=partial,
        lse=lse,
        local_bounds=meta[:, 0],
        req_of_token=req_view,
        block_table=table,
        geometry=DcpGeometry(2, 1, 1, BS),
        n_cols=16,
        row_starts=meta[:, 2] if starts is not None else None,
        **scored,
        expect=oracle_bad(
            bounds.tolist(),
            req.tolist(),
            table.tolist(),
            16,
            starts.tolist() if starts is not None else None,
            BS,
            scored.get("num_blocks"),
            1,
            finite,
        ),
        fill=fill,
    )


def _check_views(dev: torch.device, seeds: range) -> None:
    for fn in (reference_guard, gt.guard_triton):
        for seed in seeds:
            a = _views(dev, seed)
            for name in ("local_bounds", "req_of_token", "row_starts"):  # the metadata really are strided views
                assert a[name] is None or a[name].stride(0) == 3, (name, seed)
            _call(fn, a)
            bad = torch.tensor(a["expect"])
            p, lse = a["partial"].cpu(), a["lse"].cpu()
            assert torch.isnan(p[bad]).all() and torch.isnan(lse[bad]).all(), (fn.__name__, seed)
            assert torch.equal(p[~bad], a["fill"][~bad]), (fn.__name__, seed)
            assert torch.equal(lse[~bad], a["fill"][:, :, 0][~bad]), (fn.__name__, seed)


def test_every_view_is_read_through_its_strides(kernel_device) -> None:
    _check_views(kernel_device, range(24))


def test_the_oracle_sees_both_verdicts() -> None:
    """The draws above reach good and bad tokens, and every reason (so the view test means something)."""
    draws = [_views(torch.device("cpu"), seed) for seed in range(24)]
    verdicts = [v for a in draws for v in a["expect"]]
    assert any(verdicts) and not all(verdicts)
    scored = [a for a in draws if "index_q" in a]
    assert any(a["index_q"].dtype == torch.float8_e4m3fn for a in scored)
    assert any(not torch.isfinite(a["index_weights"]).all() for a in scored)
    assert oracle_bad([4, 4, -1, 8, 4], [0, 2, 0, 0, 0], [[0, 1], [2, -1]], 8, [0, 0, 0, 0, 5], 4) == [
        False, True, True, False, True
    ]  # fmt: skip
    assert oracle_bad([5, 3], [1, 1], [[0, 1], [2, -1]], 8, None, 4) == [True, False]


def _check_mtp(dev: torch.device) -> None:
    """next_n = 2 and 3 over 6 tokens: a group naming two requests is poisoned whole (every token of it), as the
    scoring stage poisons it; the other groups are untouched."""
    req = [0, 0, 1, 0, 1, 1]
    for next_n, expect in ((2, [False, False, True, True, False, False]), (3, [True] * 3 + [True] * 3),
                           (1, [False] * 6)):  # fmt: skip
        assert oracle_bad([4] * 6, req, [[0, 1], [2, 3]], 8, None, BS, next_n=next_n) == expect
        for fn in (reference_guard, gt.guard_triton):
            partial, lse = torch.zeros(6, 1, 2, device=dev), torch.zeros(6, 1, device=dev)
            fn(partial, lse, torch.full((6,), 4, device=dev), torch.tensor(req, device=dev),
               torch.tensor([[0, 1], [2, 3]], device=dev), GEO, 8, next_n=next_n)  # fmt: skip
            assert lse[:, 0].isnan().cpu().tolist() == expect, (fn.__name__, next_n)


def test_mtp_groups_naming_two_requests_are_poisoned(kernel_device) -> None:
    _check_mtp(kernel_device)


@pytest.mark.gpu
def test_the_twins_agree_on_gpu(cuda_device) -> None:
    """On the H200 (the compiled kernel): the same refusals, and every view read through its strides."""
    _check_twins_refuse(cuda_device)
    _check_views(cuda_device, range(48))
    _check_mtp(cuda_device)
    torch.cuda.synchronize()
