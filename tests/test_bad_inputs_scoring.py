"""Bad input to the scoring stage never gives a silent wrong answer (the style of test_bad_inputs.py).

1. **The table**: bad inputs to every public function of :mod:`dcp_ref.index_cache`,
   :mod:`dcp_ref.scoring` and the kernel wrapper (:mod:`dcp_ref.kernels.scoring_triton`). Each starts from a
   *valid* call (checked by :func:`test_every_base_call_is_valid`) and changes one argument; the exception type
   is checked, and that the message **starts with** the argument's name.
2. **Reference and kernels agree**: the same bad input raises the same type with the same message on
   ``index_scores`` and on ``index_scores_triton``.
3. **validate=False** reads nothing on the host (meta tensors have no values to read).
"""

from __future__ import annotations

import math

import pytest
import torch

from dcp_ref.geometry import DcpGeometry
from dcp_ref.index_cache import (
    build_sharded_index_caches,
    dequantize_index_keys,
    index_cache_blocks,
    make_index_cache,
    quantize_index_keys,
    quantize_index_queries,
    read_index_keys,
    write_index_keys,
    write_index_tokens,
)
from dcp_ref.scoring import index_scores, reference_scoring

st_kernel = pytest.importorskip("dcp_ref.kernels.scoring_triton")

NAN = float("nan")
META = "meta"


def i64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# Valid base calls
# ----------------------------------------------------------------------------------------------
G = torch.Generator().manual_seed(0)
BS = 4
GEO = DcpGeometry(2, 1, 2, BS)
KEYS = torch.randn(5, 128, generator=G)
VALS, SCALES = quantize_index_keys(KEYS)
CACHE = make_index_cache(6, BS)
BT = i32([[3, 0, -1], [5, 1, 2]])
write_index_keys(CACHE, i64([12, 13, 14, 15, 0, 1, 2, 20, 21, 22, 23, 4, 5]), torch.randn(13, 128, generator=G), BS)
T, H = 3, 4
Q8 = (torch.randn(T, H, 128, generator=G) * 3).to(torch.float8_e4m3fn)
W = torch.randn(T, H, generator=G)
REQ = i32([0, 1, 1])
BOUNDS = i64([6, 9, 0])
RS = i64([0, 6, 2])
OUT = torch.empty(T, 16)
W_BUF = torch.cat([W, torch.zeros(T, 16 - H)], 1)  # weights as the first columns of a [T, 16] buffer
WCACHE = make_index_cache(6, BS)  # what the write cases scribble on
WT = i32([[3, 0, -1], [5, 1, 2]])

SCORE_ARGS = dict(
    index_q=Q8, weights=W, index_cache=CACHE, block_table=BT, req_of_token=REQ, local_bounds=BOUNDS, geometry=GEO
)
BASES = {
    "quantize_index_keys": (quantize_index_keys, dict(keys=KEYS)),
    "dequantize_index_keys": (dequantize_index_keys, dict(values=VALS, scales=SCALES)),
    "quantize_index_queries": (quantize_index_queries, dict(q=Q8.float(), weights=W)),
    "make_index_cache": (make_index_cache, dict(num_blocks=3, block_size=4)),
    "index_cache_blocks": (index_cache_blocks, dict(index_cache=CACHE, block_size=BS)),
    "read_index_keys": (read_index_keys, dict(index_cache=CACHE, slots=i64([0, 23]), block_size=BS)),
    "write_index_keys": (
        write_index_keys,
        dict(index_cache=WCACHE, slots=i64([3, -1, 7]), keys=KEYS[:3], block_size=BS),
    ),
    "write_index_tokens": (
        write_index_tokens,
        dict(
            index_cache=WCACHE, geometry=GEO, block_table=WT, req_ids=i64([0, 1]), positions=i64([2, 3]), keys=KEYS[:2]
        ),
    ),
    "build_sharded_index_caches": (
        build_sharded_index_caches,
        dict(keys_global=[KEYS, KEYS[:2]], block_tables=[WT, WT], geometry=GEO, num_blocks=6),
    ),
    "index_scores": (index_scores, dict(SCORE_ARGS)),
    "index_scores_rs": (index_scores, dict(SCORE_ARGS, row_starts=RS, out=OUT)),
    "reference_scoring": (reference_scoring, dict(SCORE_ARGS, out=OUT)),
    "index_scores_triton": (st_kernel.index_scores_triton, dict(SCORE_ARGS, row_starts=RS, out=OUT)),
    "scoring_plan": (st_kernel.scoring_plan, dict(rows=T, n_cols=16, device=torch.device("cpu"), block_size=BS)),
}
CASES: list = []


def bad(which: str, exc: type, names: str | tuple[str, ...], label: str, /, **override) -> None:
    fn, kwargs = BASES[which]
    kw = {**kwargs, **override}
    names = (names,) if isinstance(names, str) else names
    CASES.append(pytest.param(fn, kw, exc, names, id=f"{which}[{label}]"))


def int_tensor_cases(base: str, arg: str, *, ndim: int) -> None:
    t = BASES[base][1][arg]
    bad(base, TypeError, arg, f"{arg}=float tensor", **{arg: t.float()})
    bad(base, TypeError, arg, f"{arg}=bool tensor", **{arg: t != 0})
    bad(base, TypeError, arg, f"{arg}=list", **{arg: t.tolist()})
    bad(base, TypeError, arg, f"{arg}=none", **{arg: None})
    bad(base, ValueError, arg, f"{arg}=wrong ndim", **{arg: t.reshape(-1) if ndim != 1 else t.reshape(1, -1)})


def flag_cases(base: str, arg: str) -> None:
    for label, v in [("int", 1), ("str", "yes"), ("none", None)]:
        bad(base, TypeError, arg, f"{arg}={label}", **{arg: v})


def scalar_int_cases(base: str, arg: str, *, min_value: int) -> None:
    for label, v, exc in [
        ("bool", True, TypeError),
        ("float", 2.0, TypeError),
        ("str", "2", TypeError),
        ("list", [2], TypeError),
        ("below min", min_value - 1, ValueError),
    ]:
        bad(base, exc, arg, f"{arg}={label}", **{arg: v})


# ---- the cache and the quantizers ---------------------------------------------------------------
b = "quantize_index_keys"
bad(b, TypeError, "keys", "int keys", keys=KEYS.long())
bad(b, TypeError, "keys", "list", keys=KEYS.tolist())
bad(b, ValueError, "keys", "1-D", keys=KEYS[0])
bad(b, ValueError, "keys", "width 64", keys=KEYS[:, :64])
bad(b, ValueError, "keys", "NaN", keys=KEYS.masked_fill(KEYS > 1.5, NAN))
bad(b, ValueError, "keys", "inf as float32", keys=KEYS.double() * 1e39)
bad(b, ValueError, "keys", "meta", keys=KEYS.to(META))
flag_cases(b, "validate")
b = "dequantize_index_keys"
bad(b, TypeError, "values", "float values", values=VALS.float())
bad(b, ValueError, "values", "1-D", values=VALS[0])
bad(b, TypeError, "scales", "float64 scales", scales=SCALES.double())
bad(b, ValueError, "scales", "wrong length", scales=SCALES[:2])
bad(b, ValueError, "scales", "other device", scales=SCALES.to(META))
bad(b, TypeError, "dtype", "int dtype", dtype=torch.int32)
b = "quantize_index_queries"
bad(b, TypeError, "q", "int q", q=Q8.float().long())
bad(b, ValueError, "q", "2-D", q=Q8.float()[0])
bad(b, ValueError, "q", "NaN", q=Q8.float().masked_fill(Q8.float() > 1, NAN))
bad(b, ValueError, "weights", "shape", weights=W[:, :2])
bad(b, TypeError, "weights", "int", weights=W.long())
bad(b, ValueError, "weights", "NaN", weights=W.masked_fill(W > 0.5, NAN))
bad(b, TypeError, "softmax_scale", "bool", softmax_scale=True)
bad(b, TypeError, "softmax_scale", "str", softmax_scale="0.1")
bad(b, ValueError, "softmax_scale", "negative", softmax_scale=-0.1)
bad(b, ValueError, "softmax_scale", "inf", softmax_scale=math.inf)
flag_cases(b, "validate")
scalar_int_cases("make_index_cache", "num_blocks", min_value=0)
scalar_int_cases("make_index_cache", "block_size", min_value=1)
b = "index_cache_blocks"
bad(b, TypeError, "index_cache", "float cache", index_cache=CACHE.float())
bad(b, TypeError, "index_cache", "fp8 view", index_cache=CACHE.view(torch.float8_e4m3fn))
bad(b, ValueError, "index_cache", "1-D", index_cache=CACHE.reshape(-1))
bad(b, ValueError, "index_cache", "5-D", index_cache=CACHE.view(6, 1, BS, 1, 132))
bad(b, ValueError, "index_cache", "row width", index_cache=CACHE[:, :-4])
bad(b, ValueError, "index_cache", "3-D other block size", index_cache=CACHE.view(12, 2, 132))
bad(b, ValueError, "index_cache", "4-D heads", index_cache=CACHE.view(6, 2, 2, 132))
bad(b, ValueError, "index_cache", "not contiguous", index_cache=make_index_cache(6, 8)[:, ::2])
bad(b, TypeError, "index_cache", "list", index_cache=[1, 2])
b = "read_index_keys"
bad(b, ValueError, "slots", "slot past the cache", slots=i64([0, 24]))
bad(b, ValueError, "slots", "-1 (a read needs a slot)", slots=i64([-1]))
bad(b, TypeError, "slots", "float slots", slots=torch.tensor([1.0]))
bad(b, ValueError, "slots", "2-D", slots=i64([[1]]))
bad(b, ValueError, "slots", "meta", slots=i64([1]).to(META))
bad(b, ValueError, "block_size", "block_size 0", block_size=0)
bad(b, ValueError, "index_cache", "block_size 8 for a 4-block cache", block_size=8)
b = "write_index_keys"
bad(b, ValueError, "slots", "repeated slot", slots=i64([3, 3, -1]))
bad(b, ValueError, "slots", "below -1", slots=i64([3, -2, 1]))
bad(b, ValueError, "slots", "past the cache", slots=i64([3, 24, 1]))
bad(b, ValueError, "keys", "one key short", keys=KEYS[:2])
bad(b, ValueError, "keys", "width", keys=KEYS[:3, :100])
bad(b, TypeError, "keys", "int keys", keys=KEYS[:3].long())
bad(b, ValueError, "keys", "NaN key written", keys=KEYS[:3].masked_fill(KEYS[:3] > 1, NAN))
bad(b, ValueError, "keys", "other device", keys=KEYS[:3].to(META))
b = "write_index_tokens"
bad(b, TypeError, "geometry", "tuple geometry", geometry=(2, 1, 2, BS))
bad(b, ValueError, "req_ids", "request past the table", req_ids=i64([0, 2]))
bad(b, ValueError, "positions", "negative position", positions=i64([2, -3]))
bad(b, ValueError, "keys", "keys per token", keys=KEYS[:3])
bad(b, ValueError, "block_table", "block not allocated", positions=i64([18, 3]))
b = "build_sharded_index_caches"
bad(b, ValueError, "block_tables", "one table", block_tables=[WT])
bad(b, ValueError, "num_blocks", "one size", num_blocks=[6])
bad(b, ValueError, "num_blocks", "negative", num_blocks=-1)
bad(b, ValueError, "keys_global", "no request", keys_global=[])
bad(b, TypeError, "keys_global[1]", "int keys", keys_global=[KEYS, KEYS.long()])
bad(b, ValueError, "prefill", "negative prefill", prefill=-1)
bad(b, TypeError, "geometry", "geometry None", geometry=None)

# ---- the scoring stage ------------------------------------------------------------------------
SCORING_BASES = ("index_scores", "index_scores_rs", "reference_scoring", "index_scores_triton")
for b in SCORING_BASES:
    bad(b, TypeError, "geometry", "geometry tuple", geometry=(2, 1, 2, BS))
    bad(b, TypeError, "geometry", "geometry None", geometry=None)
    bad(b, TypeError, "index_q", "int q", index_q=Q8.view(torch.uint8).long())
    bad(b, TypeError, "index_q", "uint8 q", index_q=Q8.view(torch.uint8))
    bad(b, TypeError, "index_q", "list q", index_q=[[1.0]])
    bad(b, ValueError, "index_q", "2-D q", index_q=Q8[0])
    bad(b, ValueError, "index_q", "head dim 64", index_q=Q8[:, :, :64])
    bad(b, ValueError, "index_q", "no heads", index_q=Q8[:, :0], weights=W[:, :0])
    bad(b, TypeError, "weights", "float64 weights", weights=W.double())
    bad(b, TypeError, "weights", "bf16 weights", weights=W.bfloat16())
    bad(b, ValueError, "weights", "one head short", weights=W[:, :3])
    bad(b, ValueError, "weights", "1-D", weights=W[:, 0])
    bad(b, ValueError, "weights", "other device", weights=W.to(META))
    bad(b, TypeError, "index_cache", "float cache", index_cache=CACHE.float())
    bad(b, ValueError, "index_cache", "cache of block size 2", index_cache=CACHE.view(12, 2 * 132))
    bad(b, ValueError, "index_cache", "other device", index_cache=CACHE.to(META))
    int_tensor_cases(b, "block_table", ndim=2)
    bad(b, ValueError, "block_table", "other device", block_table=BT.to(META))
    for arg in ("req_of_token", "local_bounds"):
        int_tensor_cases(b, arg, ndim=1)
        bad(b, ValueError, arg, f"{arg} one short", **{arg: BASES[b][1][arg][:2]})
        bad(b, ValueError, arg, f"{arg} other device", **{arg: BASES[b][1][arg].to(META)})
    bad(b, TypeError, "row_starts", "float row_starts", row_starts=RS.float())
    bad(b, ValueError, "row_starts", "row_starts one short", row_starts=RS[:2])
    if b == "reference_scoring":
        continue  # validate=False inside: no flag, no value checks
    flag_cases(b, "validate")
    bad(b, ValueError, "req_of_token", "request past the table", req_of_token=i32([0, 2, 1]))
    bad(b, ValueError, "req_of_token", "negative request", req_of_token=i32([0, -1, 1]))
    bad(b, ValueError, "local_bounds", "negative bound", local_bounds=i64([6, -1, 0]))
    bad(b, ValueError, "local_bounds", "bound past the table", local_bounds=i64([13, 9, 0]))
    bad(b, ValueError, "row_starts", "negative start", row_starts=i64([0, -2, 0]))
    bad(b, ValueError, "block_table", "needed block -1", local_bounds=i64([9, 9, 0]))
    bad(b, ValueError, "block_table", "block past the cache", block_table=i32([[3, 0, -1], [5, 9, 2]]))
    meta = {k: v.to(META) for k, v in SCORE_ARGS.items() if isinstance(v, torch.Tensor)}
    if b == "index_scores":
        bad(b, ValueError, "req_of_token", "all meta, validated", **meta)
for b in ("index_scores_rs", "reference_scoring", "index_scores_triton"):
    bad(b, TypeError, "out", "float64 out", out=OUT.double())
    bad(b, TypeError, "out", "list out", out=OUT.tolist())
    bad(b, ValueError, "out", "1-D out", out=OUT[0])
    bad(b, ValueError, "out", "one row short", out=OUT[:2])
    bad(b, ValueError, "out", "not contiguous", out=torch.empty(T, 32)[:, ::2])
    bad(b, ValueError, "out", "other device", out=OUT.to(META))
    if b != "reference_scoring":
        bad(b, ValueError, "out", "too narrow for start + bound", out=torch.empty(T, 14))
    bad(b, ValueError, "out", "the index cache viewed as float32", out=CACHE.view(-1).view(torch.float32)[: T * 16]
        .view(T, 16))  # fmt: skip
    bad(b, ValueError, "out", "the weights' buffer", weights=W_BUF[:, :H], out=W_BUF.view(-1)[: T * 16].view(T, 16))
bad("index_scores", ValueError, "out", "unvalidated prefill without out", row_starts=RS, validate=False)
b = "index_scores_triton"
bad(b, TypeError, "index_q", "float64 q (the reference's only)", index_q=Q8.double())
# the kernel's tuning: only through its plan (scoring_plan names a bad value; the wrapper a plan that misses the call)
# (tma=True: refused at 4-key blocks, where a tile cannot be one block of whole 128-byte rows)
for arg, v, exc in [("block_n", 24, ValueError), ("block_n", 8, ValueError), ("block_n", 1024, ValueError),
                    ("block_n", 2.0, TypeError), ("tiles", 0, ValueError), ("num_warps", 3, ValueError),
                    ("num_warps", 64, ValueError), ("num_stages", 0, ValueError), ("pair_dot", "yes", TypeError),
                    ("tma", 1, TypeError), ("tma", True, ValueError)]:  # fmt: skip
    bad("scoring_plan", exc, arg, f"{arg}={v}", **{arg: v})
PLAN16 = st_kernel.scoring_plan(T, 16, torch.device("cpu"), block_size=BS, block_n=16, tiles=1)  # 16 columns
for label, plan, exc, extra in [
    ("a tuple of its fields", tuple(PLAN16), TypeError, {}),
    ("its fields as a dict", PLAN16._asdict(), TypeError, {}),
    ("'default'", "default", TypeError, {}),
    ("groups of 2 at next_n=1", PLAN16._replace(group=2), ValueError, {}),
    ("16 of 40 columns", PLAN16, ValueError, dict(out=torch.empty(T, 40))),
    ("16 columns, validated without out (the values give a width of 24)", PLAN16, ValueError,
     dict(out=None, row_starts=i64([0, 15, 2]))),
    ("tma=True on 4-key blocks", PLAN16._replace(tma=True), ValueError, {}),
    ("pair_dot=True at next_n=1", PLAN16._replace(pair_dot=True), ValueError, {}),
    ("block_n=24", PLAN16._replace(block_n=24), ValueError, {}),
    ("tiles=2.0", PLAN16._replace(tiles=2.0), TypeError, {}),
]:  # fmt: skip
    bad(b, exc, "plan", f"plan={label}", plan=plan, **extra)


@pytest.mark.parametrize("fn, kwargs, exc, names", CASES)
def test_bad_input_raises_naming_the_argument(fn, kwargs, exc, names) -> None:
    with pytest.raises(exc) as info:
        fn(**kwargs)
    msg = str(info.value)
    assert any(msg.startswith(n) for n in names), f"{type(info.value).__name__}: {msg!r} starts with none of {names}"


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 290, len(CASES)


@pytest.mark.parametrize("name", sorted(BASES))
def test_every_base_call_is_valid(name: str) -> None:
    fn, kwargs = BASES[name]
    fn(**kwargs)


# ----------------------------------------------------------------------------------------------
# Reference and kernels: the same bad input, the same exception and the same message.
# ----------------------------------------------------------------------------------------------
def _twin_cases():
    """index_scores / index_scores_rs cases, run on the reference and on the kernel wrapper."""
    out = []
    for c in CASES:
        fn, kwargs, exc, _ = c.values
        if fn is not index_scores:
            continue
        out.append(pytest.param(kwargs, exc, id=c.id))
    return out


TWIN_CASES = _twin_cases()


@pytest.mark.parametrize("kwargs, exc", TWIN_CASES)
def test_kernels_reject_like_the_reference(kwargs, exc) -> None:
    with pytest.raises(exc) as ref:
        index_scores(**kwargs)
    with pytest.raises(exc) as ker:
        st_kernel.index_scores_triton(**kwargs)
    assert str(ker.value) == str(ref.value)


def test_twin_table_is_not_empty() -> None:
    assert len(TWIN_CASES) >= 80, len(TWIN_CASES)


def test_kernels_need_cuda_or_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"^index_q must be a CUDA tensor"):
        st_kernel.index_scores_triton(**SCORE_ARGS)


# ----------------------------------------------------------------------------------------------
# validate=False: nothing read on the host (meta tensors have no values)
# ----------------------------------------------------------------------------------------------
def _meta(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=META)


M_ARGS = dict(
    index_q=_meta(5, 64, 128, dtype=torch.float8_e4m3fn),
    weights=_meta(5, 64),
    index_cache=_meta(7, 8 * 132, dtype=torch.uint8),
    block_table=_meta(3, 4, dtype=torch.int32),
    req_of_token=_meta(5, dtype=torch.int32),
    local_bounds=_meta(5, dtype=torch.int64),
    geometry=DcpGeometry(2, 0, 1, 8),
)
NO_HOST_READ = {
    "index_scores": lambda: index_scores(**M_ARGS, validate=False),
    "index_scores(row_starts, out)": lambda: index_scores(
        **M_ARGS, row_starts=_meta(5, dtype=torch.int64), out=_meta(5, 40), validate=False
    ),
    "reference_scoring": lambda: reference_scoring(**M_ARGS, out=_meta(5, 32)),
    "quantize_index_keys": lambda: quantize_index_keys(_meta(6, 128), validate=False),
    "quantize_index_queries": lambda: quantize_index_queries(_meta(5, 64, 128), _meta(5, 64), validate=False),
    "dequantize_index_keys": lambda: dequantize_index_keys(_meta(6, 128, dtype=torch.uint8), _meta(6)),
}


@pytest.mark.parametrize("name", sorted(NO_HOST_READ))
def test_validate_false_reads_nothing_on_the_host(name: str) -> None:
    res = NO_HOST_READ[name]()
    for t in res if isinstance(res, tuple) else (res,):
        assert t.device.type == "meta"


def test_unvalidated_shapes_without_out() -> None:
    """validate=False without out: decode width from the table (M * block_size), from shapes alone."""
    assert index_scores(**M_ARGS, validate=False).shape == (5, 4 * 8)


@pytest.mark.gpu
def test_kernels_reject_like_the_reference_on_gpu(cuda_device) -> None:
    """The twin rows on the H200 (meta rows aside), tensors moved with their memory relations kept
    (``tests/devmove.py``: an ``out`` over the index cache stays over it): the compiled kernel and the reference
    raise the same type and message."""
    from devmove import to_device

    ran = 0
    for case in TWIN_CASES:
        kwargs, exc = case.values
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in kwargs.values()):
            continue
        kwargs = to_device(kwargs, cuda_device)
        with pytest.raises(exc) as ref:
            index_scores(**kwargs)
        with pytest.raises(exc) as ker:
            st_kernel.index_scores_triton(**kwargs)
        assert str(ker.value) == str(ref.value), case.id
        ran += 1
    assert ran >= 70, ran
