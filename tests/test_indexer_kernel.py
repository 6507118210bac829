"""The fused indexer kernel (kernels/indexer_triton.py) against local_topk + pack_candidates.

The oracle is the plain-PyTorch reference of the indexer stage, ``pack_candidates(scores,
local_topk(scores, k, lengths, row_starts), rank, W, I, row_starts)``, itself tested against a
brute force in test_indexer.py; a pure-Python brute force checks a few rows directly here too.
Results are compared per row as *sets of bit patterns* of the ``(score, id)`` pairs (so ``-0.0``
vs ``+0.0`` counts, and so does the padding), and the kernel's documented order (winners by
increasing id, then padding) is checked separately. CPU runs go through the Triton interpreter
(small shapes); ``-m gpu`` runs the compiled kernel on ≥ 10 000 adversarial rows.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ref.indexer import local_topk
from dcp_ref.ownership import local_to_global
from dcp_ref.topk import pack_candidates

ix = pytest.importorskip("dcp_ref.kernels.indexer_triton")


def reference(scores, lengths, k, rank, w, i, row_starts=None) -> torch.Tensor:
    """The indexer stage in plain PyTorch: local stable top-k, then pack."""
    return pack_candidates(scores, local_topk(scores, k, lengths, row_starts), rank, w, i, row_starts)


def pair_bits(packed: torch.Tensor) -> torch.Tensor:
    """int64 ``[T, k]``: each float32 (score, id) pair as one bit pattern (exact comparison)."""
    return packed.contiguous().view(torch.int64).squeeze(-1)


def same_sets(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """bool ``[T]``: row r holds the same multiset of (score, id) bit patterns in both."""
    g = torch.sort(pair_bits(got), 1).values
    h = torch.sort(pair_bits(want), 1).values
    return (g == h).all(1)


def assert_kernel_order(got: torch.Tensor) -> None:
    """The kernel's documented layout: valid pairs by increasing id, then ``(-inf, -1)`` padding."""
    ids = got[..., 1]
    valid = ids >= 0
    n = valid.sum(1, keepdim=True)
    pos = torch.arange(ids.shape[1], device=ids.device)
    assert bool((valid == (pos < n)).all()), "padding must follow every valid pair"
    inc = (ids[:, 1:] > ids[:, :-1]) | ~valid[:, 1:]
    assert bool(inc.all()), "valid ids must increase along the row"
    pad = got[~valid]
    assert bool((pad[:, 0] == float("-inf")).all()) and bool((pad[:, 1] == -1).all())


def check(scores, lengths, k, rank, w, i, row_starts=None, **kw) -> torch.Tensor:
    got = ix.indexer_topk_pack(scores, lengths, k, rank, w, i, row_starts, **kw)
    want = reference(scores, lengths, k, rank, w, i, row_starts)
    bad = (~same_sets(got, want)).nonzero().flatten().tolist()
    assert not bad, f"rows {bad}: got {got[bad[0]].tolist()} want {want[bad[0]].tolist()}"
    assert_kernel_order(got)
    return got


def brute_packed(row: list[float], k: int, start: int, length: int, rank: int, w: int, i: int) -> list[tuple]:
    """Pure Python: the top-k (score, global id) of one row, by (score desc, j asc), NaN skipped."""
    cand = [(row[start + j] + 0.0, j) for j in range(length) if not math.isnan(row[start + j])]
    cand.sort(key=lambda c: (-c[0], c[1]))
    pairs = [(row[start + j], float(local_to_global(j, rank, w, i))) for _, j in cand[:k]]
    return sorted(pairs) + [(-math.inf, -1.0)] * (k - len(pairs))


# ---------------------------------------------------------------------------------------------
# Adversarial inputs (shared with the GPU differential test and benchmarks/sanitize_indexer.py)
# ---------------------------------------------------------------------------------------------

FLAVOURS = ("normal", "ties", "zeros", "nan_inf", "short", "invalid", "ascending", "constant")


def make_cases(rows: int, cols: int, seed: int, device: torch.device | str = "cpu", with_starts: bool = False):
    """``(scores [rows, cols] float32, lengths [rows] int32, row_starts [rows] int32 or None)``.

    Row ``r`` gets flavour ``FLAVOURS[r % 8]``: normal scores; 3 distinct values (heavy ties);
    ±0.0 and ±subnormals only; normal with 5 % NaN, 5 % -inf, 2 % +inf; a short row (length < 64); all NaN;
    ascending scores; one constant. Lengths are random in ``[0, cols]`` (``cols`` for half the
    rows); with ``with_starts`` each row's window starts at a random column.
    """
    gen = torch.Generator().manual_seed(seed)
    f = torch.arange(rows) % len(FLAVOURS)
    col = lambda m: m.unsqueeze(1)  # noqa: E731
    s = torch.randn(rows, cols, generator=gen)
    s = torch.where(col(f == 1), torch.randint(0, 3, (rows, cols), generator=gen).float() - 1.0, s)
    sign = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0)
    # ±0.0 and ±subnormals (a compare that flushed subnormals to zero would tie them with 0)
    tiny = torch.tensor([0.0, 0.0, 1e-45, 1e-40])[torch.randint(0, 4, (rows, cols), generator=gen)]
    s = torch.where(col(f == 2), tiny * sign, s)
    u = torch.rand(rows, cols, generator=gen)
    s = torch.where(col(f == 3) & (u < 0.05), float("nan"), s)
    s = torch.where(col(f == 3) & (u >= 0.05) & (u < 0.10), float("-inf"), s)
    s = torch.where(col(f == 3) & (u >= 0.10) & (u < 0.12), float("inf"), s)
    s = torch.where(col(f == 5), float("nan"), s)
    s = torch.where(col(f == 6), torch.arange(cols, dtype=torch.float32).expand(rows, cols) / 7.0, s)
    s = torch.where(col(f == 7), 0.5, s)
    starts = torch.randint(0, cols + 1, (rows,), generator=gen) if with_starts else torch.zeros(rows, dtype=torch.int64)
    room = cols - starts
    full = torch.rand(rows, generator=gen) < 0.5
    lengths = torch.where(full, room, (torch.rand(rows, generator=gen) * (room + 1)).long().clamp(max=room))
    lengths = torch.where(f == 4, torch.minimum(lengths, torch.randint(0, 64, (rows,), generator=gen)), lengths)
    return (s.to(device), lengths.to(torch.int32).to(device),
            starts.to(torch.int32).to(device) if with_starts else None)


# ---------------------------------------------------------------------------------------------
# CPU (interpreter) tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tile,split", [(None, 1), (64, 1), (None, 3), (64, 2)])
def test_adversarial_rows_match_reference(kernel_device, tile, split):
    """Every flavour, with the row in registers (one tile), streamed (tile 64), and split rows."""
    s, lengths, starts = make_cases(8, 100, 1, kernel_device, with_starts=True)
    for k in ((1, 17, 64, 200) if (tile, split) == (None, 1) else (5, 64)):
        check(s, lengths, k, 1, 3, 2, starts, tile=tile, split=split)


def test_against_pure_python_brute_force(kernel_device):
    s, lengths, starts = make_cases(8, 40, 2, "cpu", with_starts=True)
    k, rank, w, i = 9, 2, 3, 4
    got = ix.indexer_topk_pack(s.to(kernel_device), lengths.to(kernel_device), k, rank, w, i, starts.to(kernel_device))
    for r in range(8):
        want = brute_packed(s[r].tolist(), k, int(starts[r]), int(lengths[r]), rank, w, i)
        row = got[r].cpu().tolist()
        valid = sorted(tuple(p) for p in row if p[1] >= 0)
        assert [tuple(p) for p in row[len(valid):]] == want[len(valid):]
        assert valid == want[: len(valid)], r


def test_ties_go_to_the_lower_index(kernel_device):
    """All-equal scores (and ±0 mixed): the winners are exactly local keys 0..k-1."""
    zeros = torch.tensor([0.0, -0.0] * 50).reshape(1, 100)
    for row in (torch.full((1, 100), 3.25), zeros, torch.full((1, 100), float("-inf"))):
        for tile, split in ((None, 1), (32, 1), (None, 4)):
            got = ix.indexer_topk_pack(row.to(kernel_device), None, 10, 0, 1, 1, tile=tile, split=split).cpu()
            assert got[0, :, 1].tolist() == [float(j) for j in range(10)]
            # the scores are packed bit for bit: -0.0 stays -0.0
            assert torch.equal(pair_bits(got), pair_bits(reference(row, None, 10, 0, 1, 1)).sort(1).values)
    # a tie straddling the threshold: 5.0 x 6 at local keys 2, 3, 5, 8, 9, 11; k = 4 takes 9.0 and 2, 3, 5
    row = torch.tensor([[1.0, 9.0, 5.0, 5.0, 0.0, 5.0, 1.0, 1.0, 5.0, 5.0, 0.0, 5.0]])
    got = ix.indexer_topk_pack(row.to(kernel_device), None, 4, 0, 2, 1).cpu()
    assert got[0].tolist() == [[9.0, 2.0], [5.0, 4.0], [5.0, 6.0], [5.0, 10.0]]


def test_short_rows_and_k_larger_than_row(kernel_device):
    s = torch.randn(3, 20)
    for k in (19, 20, 21, 300):
        got = check(s.to(kernel_device), torch.tensor([20, 3, 0], dtype=torch.int32, device=kernel_device), k, 0, 2, 1)
        assert (got[:, :, 1] >= 0).sum(1).tolist() == [min(k, 20), min(k, 3), 0]
    # no columns at all, and no rows
    check(torch.empty(2, 0, device=kernel_device), None, 5, 0, 1, 1)
    assert ix.indexer_topk_pack(torch.empty(0, 7, device=kernel_device), None, 5, 0, 1, 1).shape == (0, 5, 2)


def test_poisoned_out_is_fully_overwritten(kernel_device):
    s, lengths, _ = make_cases(8, 90, 3, kernel_device)
    for split in (1, 2):
        out = torch.full((8, 50, 2), float("nan"), device=kernel_device)
        out.view(torch.int32)[..., 1] = 0x7FC00123  # a NaN payload no kernel writes
        ws = torch.full((8, 2, 50, 2), 12345.0, device=kernel_device)
        got = ix.indexer_topk_pack(s, lengths, 50, 0, 2, 1, out=out, split=split, workspace=ws if split > 1 else None)
        assert got.data_ptr() == out.data_ptr()
        assert bool(same_sets(out, reference(s, lengths, 50, 0, 2, 1)).all())


def test_strided_and_low_precision_scores(kernel_device):
    base = torch.randn(6, 2 * 70, device=kernel_device)
    check(base[:, ::2], None, 16, 1, 2, 3)  # column stride 2
    check(base.t().contiguous().t()[:, :70], None, 16, 1, 2, 3)  # column-major
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        check(base[:, :70].to(dt), None, 16, 0, 4, 1)


def test_prefill_row_starts(kernel_device):
    # two requests side by side: columns 0-2 are request 0's keys, 3-6 request 1's
    s = torch.tensor([[9.0, 8.0, 7.0, 1.0, 5.0, 5.0, 3.0]] * 2, device=kernel_device)
    starts = torch.tensor([0, 3], device=kernel_device)
    got = check(s, torch.tensor([2, 4], device=kernel_device), 3, 1, 2, 1, starts)
    # row 1: local keys 1, 2 (the tie 5.0, 5.0) and 3 on rank 1 of W=2 -> global 3, 5, 7
    assert got[1].tolist() == [[5.0, 3.0], [5.0, 5.0], [3.0, 7.0]]


def test_validate_false_never_reads_outside_the_window(kernel_device):
    """Bad lengths / row_starts with validate=False: the kernel clamps the window on the device.

    The scores are a view into a larger buffer whose other columns hold +inf: any read outside
    the view would make +inf a winner.
    """
    big = torch.full((4, 60), float("inf"), device=kernel_device)
    big[:, 10:50] = torch.randn(4, 40, device=kernel_device)
    s = big[:, 10:50]
    lengths = torch.tensor([100, -5, 40, 2**40], device=kernel_device)
    starts = torch.tensor([30, 0, -7, 45], device=kernel_device)
    got = ix.indexer_topk_pack(s, lengths, 8, 0, 1, 1, starts, validate=False)
    cs = starts.clamp(0, 40)
    cl = torch.minimum(lengths.clamp(min=0), 40 - cs)
    assert bool(same_sets(got, reference(s, cl, 8, 0, 1, 1, cs)).all())
    assert not bool(torch.isinf(got[..., 0]).logical_and(got[..., 0] > 0).any())
    with pytest.raises(ValueError, match="row_starts"):
        ix.indexer_topk_pack(s, lengths, 8, 0, 1, 1, starts)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), rows=st.integers(1, 3), cols=st.integers(0, 130), k=st.integers(1, 70),
       w=st.integers(1, 4), i=st.sampled_from([1, 2, 3, 8]), ties=st.booleans(), use_starts=st.booleans(),
       use_lengths=st.booleans(), tile=st.sampled_from([None, 32, 64]), split=st.sampled_from([1, 1, 2, 3]))
def test_property_matches_reference(kernel_device, data, rows, cols, k, w, i, ties, use_starts, use_lengths, tile,
                                    split):
    rank = data.draw(st.integers(0, w - 1))
    if ties:
        pool = [0.0, -0.0, 1.0, -1.0, float("nan"), float("-inf"), float("inf"), 2.5]
        vals = [data.draw(st.sampled_from(pool)) for _ in range(rows * cols)]
    else:
        vals = [data.draw(st.floats(-3, 3, width=32)) for _ in range(rows * cols)]
    s = torch.tensor(vals, dtype=torch.float32).reshape(rows, cols)
    starts = [data.draw(st.integers(0, cols)) if use_starts else 0 for _ in range(rows)]
    lengths = [data.draw(st.integers(0, cols - st0)) for st0 in starts]
    dev = kernel_device
    check(s.to(dev), torch.tensor(lengths, device=dev) if use_lengths else None, k, rank, w, i,
          torch.tensor(starts, device=dev) if use_starts else None, tile=tile, split=split)


def test_radix_digit_widths(kernel_device):
    s, lengths, _ = make_cases(8, 120, 4, kernel_device)
    for bits in (5, 6, 7, 8, 10, 13):
        check(s, lengths, 33, 0, 2, 1, radix_bits=bits)


@pytest.mark.parametrize("bits", [5, 6, 8, 11])
def test_radix_keys_with_zero_top_digits(kernel_device, bits):
    """-inf and huge negative scores have keys below 2**24 (a first digit of 0 at <= 8 bits), the same
    first digit as an invalid key (NaN, outside the row): the select must still count and choose them
    apart from the invalid ones, tie-break the -inf run by index and never emit a NaN."""
    ninf, huge = float("-inf"), -3.0e38
    rows = [
        [ninf] * 6 + [float("nan")] * 4 + [huge, -2.0e38, 1.0, ninf],
        [float("nan"), ninf, huge, ninf, float("nan"), huge, ninf, ninf, -1.0e38, ninf, ninf, ninf, ninf, ninf],
        [huge] * 14,
    ]
    s = torch.tensor(rows, dtype=torch.float32, device=kernel_device)
    for k in (1, 3, 5, 9, 13):
        check(s, None, k, 1, 2, 1, radix_bits=bits)
        check(s, torch.tensor([12, 9, 7], device=kernel_device), k, 0, 3, 2, radix_bits=bits)


def test_launch_plan_from_shapes_only():
    cpu = torch.device("cpu")
    assert ix.launch_plan(32, 8192, 2048, cpu)[:4] == (8192, True, 16, 1)
    assert ix.launch_plan(1, 100, 10, cpu)[:4] == (256, True, 4, 1)
    p = ix.launch_plan(1, 131072, 2048, cpu)
    assert not p.one_chunk and p.split == 1 and p.levels == ()  # never split under the interpreter / on the CPU
    p = ix.launch_plan(1, 131072, 2048, cpu, split=16)
    # 16 segments of 8192 keys -> 32768 candidates -> 4 segments -> 8192 candidates -> the last launch
    assert p.split == 16 and p.one_chunk and p.tile == 8192 and p.levels == (16, 4)


def test_multi_level_split(kernel_device):
    """Candidates of the segments split again (small tiles make the levels appear on small rows)."""
    s, lengths, starts = make_cases(4, 400, 12, kernel_device, with_starts=True)
    p = ix.launch_plan(4, 400, 4, kernel_device, split=12, tile=32)
    assert p.levels == (12, 2)  # 12 segments -> 48 candidates -> 2 segments -> 8 candidates
    ws = ix.workspace_for(s, 4, split=12, tile=32)
    assert ws.shape == (4, 14, 4, 2)
    ws.fill_(7.0)
    check(s, lengths, 4, 1, 2, 2, starts, split=12, tile=32, workspace=ws)
    assert ix.workspace_for(s, 4) is None  # no split: no workspace


BAD_INPUTS = [
    # (description, kwargs changed, exception, message fragment)
    ("scores not a tensor", dict(scores=[[1.0]]), TypeError, "scores"),
    ("scores int", dict(scores=torch.ones(2, 5, dtype=torch.int32)), TypeError, "scores"),
    ("scores 1-D", dict(scores=torch.ones(5)), ValueError, "scores"),
    ("lengths float", dict(lengths=torch.ones(2)), TypeError, "lengths"),
    ("lengths shape", dict(lengths=torch.ones(3, dtype=torch.int32)), ValueError, "lengths"),
    ("lengths negative", dict(lengths=torch.tensor([1, -1])), ValueError, "lengths"),
    ("lengths too long", dict(lengths=torch.tensor([1, 6])), ValueError, "lengths"),
    ("row_starts float", dict(row_starts=torch.zeros(2)), TypeError, "row_starts"),
    ("row_starts shape", dict(row_starts=torch.zeros(1, dtype=torch.int64)), ValueError, "row_starts"),
    ("row_starts past the end", dict(row_starts=torch.tensor([0, 6])), ValueError, "row_starts"),
    ("row_starts + lengths", dict(row_starts=torch.tensor([0, 4]), lengths=torch.tensor([2, 2])), ValueError,
     "lengths"),
    ("k = 0", dict(k=0), ValueError, "k"),
    ("k float", dict(k=2.0), TypeError, "k"),
    ("rank out of range", dict(rank=2), ValueError, "rank"),
    ("world_size 0", dict(world_size=0), ValueError, "world_size"),
    ("interleave 0", dict(interleave=0), ValueError, "interleave"),
    ("out shape", dict(out=torch.empty(2, 3, 2)), ValueError, "out"),
    ("out dtype", dict(out=torch.empty(2, 4, 2, dtype=torch.float64)), TypeError, "out"),
    ("out not contiguous", dict(out=torch.empty(2, 2, 4).transpose(1, 2)), ValueError, "out"),
    ("out misaligned", dict(out=torch.empty(17)[1:].view(2, 4, 2)), ValueError, "out"),
    ("workspace shape", dict(split=2, workspace=torch.empty(2, 3, 4, 2)), ValueError, "workspace"),
    ("radix_bits 4", dict(radix_bits=4), ValueError, "radix_bits"),
    ("radix_bits 16", dict(radix_bits=16), ValueError, "radix_bits"),
    ("tile not a power of two", dict(tile=100), ValueError, "tile"),
    ("num_warps 3", dict(num_warps=3), ValueError, "num_warps"),
    ("split 0", dict(split=0), ValueError, "split"),
]


@pytest.mark.parametrize("desc,change,exc,frag", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_naming_the_argument(kernel_device, desc, change, exc, frag):
    args = dict(scores=torch.randn(2, 5), lengths=torch.tensor([5, 3]), k=4, rank=1, world_size=2, interleave=1,
                row_starts=None)
    args.update(change)
    args = {n: (v.to(kernel_device) if isinstance(v, torch.Tensor) and n != "out" else v) for n, v in args.items()}
    with pytest.raises(exc, match=frag):
        ix.indexer_topk_pack(**args)


def test_ids_beyond_float32_exact_range_raise_even_without_validate():
    # W = 8: local key 2**21 of rank 1 is global id 2**24 + 1, not exact in float32.
    s = torch.zeros(1, 2**21 + 1)
    for validate in (True, False):
        with pytest.raises(ValueError, match="2\\*\\*24"):
            ix.indexer_topk_pack(s, None, 4, 1, 8, 1, validate=validate)
    with pytest.raises(ValueError, match="2\\*\\*24"):
        ix.indexer_topk_pack(s, torch.tensor([2**21 + 1]), 4, 1, 8, 1)


COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dcp_ref.kernels.indexer_triton import DEFAULT_RADIX_BITS
from dcp_ref.kernels.indexer_triton import indexer_topk_pack_kernel as kern

report = []
for tile, one, warps, packed, k1 in json.loads(sys.argv[1]):
    sig = {"scores_ptr": "*fp32", "lengths_ptr": "*i32", "starts_ptr": "*i64", "out_ptr": "*i64", "n_cols": "i32",
           "seg_len": "i32", "stride_r": "i32", "stride_c": "i32" if packed else "constexpr",
           "out_stride_r": "constexpr" if k1 else "i32", "k": "constexpr" if k1 else "i32", "rank": "i32"}
    cst = {"HAS_LENGTHS": not packed, "HAS_STARTS": not packed, "WORLD": 2, "INTERLEAVE": 4, "PACKED_INPUT": packed,
           "NAN_PAD": packed, "RADIX_BITS": DEFAULT_RADIX_BITS, "TILE": tile, "ONE_CHUNK": one,
           "PAD_BLOCK": 1 if k1 else 1024}
    cst.update({} if packed else {"stride_c": 1})
    cst.update({"k": 1, "out_stride_r": 1} if k1 else {})
    sig.update({name: "constexpr" for name in cst})
    src = ASTSource(kern, signature=sig, constexprs=cst)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    report.append({"ptx_target": "sm_90a" in c.asm["ptx"], "cubin": len(c.asm["cubin"]) > 0,
                   "shared": c.metadata.shared})
print(json.dumps(report))
"""


def test_compiles_for_sm90a_on_the_cpu():
    """The interpreter does not type-check like the compiler: compile the kernel's main variants
    to sm_90a PTX and cubin (no GPU needed), in a fresh process without TRITON_INTERPRET."""
    import json
    import os
    import subprocess
    import sys

    # (tile, one_chunk, warps, packed input, k = 1): the decode row in registers, a streamed row,
    # a split row's last launch with k specialised to 1
    configs = [(8192, True, 32, False, False), (4096, False, 16, False, False), (256, True, 4, True, True)]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, json.dumps(configs)], capture_output=True, text=True,
                          env=env, timeout=300)
    if proc.returncode and ("ModuleNotFoundError" in proc.stderr or "ImportError" in proc.stderr):
        pytest.skip(f"this Triton cannot compile ahead of time here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == len(configs)
    for r in report:
        assert r["ptx_target"] and r["cubin"] and r["shared"] <= 64 * 1024, r


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

#: (rows, cols, k, W, I, rank, starts, split): ≥ 10 000 rows in all.
GPU_CONFIGS = [
    (1000, 1, 1, 1, 1, 0, False, None),
    (1000, 37, 5, 2, 1, 1, True, None),
    (1000, 300, 64, 3, 2, 2, False, None),
    (1000, 2048, 2048, 2, 1, 0, False, None),
    (1000, 4096, 2048, 4, 8, 3, True, None),
    (1000, 8192, 2048, 2, 1, 1, False, None),
    (800, 8192, 1, 8, 64, 5, False, None),
    (800, 5000, 4096, 2, 1, 0, False, None),
    (600, 9000, 2048, 2, 1, 1, True, None),
    (400, 32768, 2048, 2, 1, 0, False, None),
    (300, 32768, 2048, 2, 4, 1, False, 4),
    (200, 20000, 777, 3, 1, 2, True, 3),
    (64, 131072, 2048, 1, 1, 0, False, None),
    (32, 131072, 2048, 1, 1, 0, False, 16),
    (16, 131072, 4096, 2, 2, 1, True, 8),
    (300, 16384, 512, 2, 1, 0, False, 2),
    (600, 1024, 128, 4, 2, 3, True, None),  # brings the total past 10 000 rows (it was 9 512)
]


@pytest.mark.gpu
def test_gpu_differential_10k_adversarial_rows(cuda_device):
    total, failures = 0, []
    for c, (rows, cols, k, w, i, rank, with_starts, split) in enumerate(GPU_CONFIGS):
        s, lengths, starts = make_cases(rows, cols, 100 + c, cuda_device, with_starts)
        want = reference(s, lengths, k, rank, w, i, starts)
        out = torch.full((rows, k, 2), float("nan"), device=cuda_device)  # poison
        got = ix.indexer_topk_pack(s, lengths, k, rank, w, i, starts, out=out, split=split)
        bad = ~same_sets(got, want)
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            failures.append(f"config {c} {(rows, cols, k, w, i, split)}: {int(bad.sum())} rows differ, first {r} "
                            f"({FLAVOURS[r % len(FLAVOURS)]})")
        assert_kernel_order(got)
        total += rows
    assert not failures, failures
    assert total >= 10_000


@pytest.mark.gpu
def test_gpu_spot_check_against_brute_force(cuda_device):
    s, lengths, starts = make_cases(16, 300, 5, "cpu", with_starts=True)
    k, rank, w, i = 20, 1, 2, 2
    got = ix.indexer_topk_pack(s.to(cuda_device), lengths.to(cuda_device), k, rank, w, i, starts.to(cuda_device)).cpu()
    for r in range(16):
        row = got[r].tolist()
        n = sum(p[1] >= 0 for p in row)
        assert sorted(tuple(p) for p in row[:n]) + [tuple(p) for p in row[n:]] == brute_packed(
            s[r].tolist(), k, int(starts[r]), int(lengths[r]), rank, w, i)


@pytest.mark.gpu
@pytest.mark.parametrize("cols,split", [(8192, 1), (32768, 1), (131072, 16)])
def test_gpu_cuda_graph_capture_and_replay(cuda_device, cols, split):
    """Captured once with out= (and workspace=); replayed on new scores and lengths in place."""
    rows, k = 32, 2048
    s, lengths, _ = make_cases(rows, cols, 7, cuda_device)
    out = torch.empty((rows, k, 2), device=cuda_device)
    ws = ix.workspace_for(s, k, split=split)
    call = lambda: ix.indexer_topk_pack(s, lengths, k, 1, 2, 1, out=out, validate=False,  # noqa: E731
                                        split=split, workspace=ws)
    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (8, 9, 10):
        s2, l2, _ = make_cases(rows, cols, seed, cuda_device)
        s.copy_(s2)
        lengths.copy_(l2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert bool(same_sets(out, reference(s, lengths, k, 1, 2, 1)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 4])
def test_gpu_validate_false_makes_no_host_sync(cuda_device, split):
    """validate=False with out= and workspace=: no synchronising CUDA call (sync debug mode raises)."""
    rows, cols, k = 8, 40000, 512
    s, lengths, starts = make_cases(rows, cols, 11, cuda_device, with_starts=True)
    out = torch.empty((rows, k, 2), device=cuda_device)
    ws = ix.workspace_for(s, k, split=split)
    call = lambda: ix.indexer_topk_pack(s, lengths, k, 0, 2, 1, starts, out=out, validate=False,  # noqa: E731
                                        split=split, workspace=ws)
    call()  # compile first (compilation itself may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(same_sets(out, reference(s, lengths, k, 0, 2, 1, starts)).all())
