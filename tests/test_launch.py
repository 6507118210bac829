"""FastLaunch: the compiled-handle launch gives the JIT's results, and re-specializes when Triton would."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dcp_ref.kernels._launch import FastLaunch, spec_key


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    y = tl.load(y_ptr + offs, mask=m, other=0.0)
    r = a * x + y
    if SQUARE:
        r = r * r
    tl.store(out_ptr + offs, r, mask=m)


def test_the_key_follows_what_triton_specializes_on() -> None:
    t = torch.zeros(8)
    assert spec_key((t, 1), {}) != spec_key((t, 2), {})  # an int equal to 1 is specialized
    assert spec_key((t, 16), {}) != spec_key((t, 17), {})  # divisibility by 16
    assert spec_key((t, 17), {}) == spec_key((t, 33), {})  # otherwise one kernel
    assert spec_key((t, 2**31), {}) != spec_key((t, 2**31 - 15), {})  # i64 against i32
    assert spec_key((t[1:],), {}) != spec_key((t,), {})  # 16-byte pointer alignment
    assert spec_key((t,), {}) != spec_key((t.double(),), {})
    consts = FastLaunch(_axpy)._by_value
    assert {"BLOCK", "SQUARE", "num_warps"} <= consts and "a" not in consts and "n" not in consts
    assert spec_key((), {"BLOCK": 64}, consts) != spec_key((), {"BLOCK": 128}, consts)
    assert spec_key((), {"num_warps": 4}) != spec_key((), {"num_warps": 8})
    assert spec_key((), {"n": 17}, consts) == spec_key((), {"n": 33}, consts)  # a runtime int by name: by kind


def test_under_the_interpreter_every_call_goes_through_the_jit(kernel_device) -> None:
    if kernel_device.type != "cpu":
        pytest.skip("the interpreter path")
    f = FastLaunch(_axpy)
    x, y = torch.arange(10.0), torch.ones(10)
    out = torch.empty(10)
    for _ in range(2):
        f((1,), x, y, out, 2.0, 10, BLOCK=16)
        assert out.tolist() == (2 * x + y).tolist()
    assert f.jit_calls == 2 and f.fast_calls == 0


@pytest.mark.gpu
def test_compiled_launches_equal_the_jit_across_keys(cuda_device, monkeypatch) -> None:
    monkeypatch.setenv("DCP_FAST_LAUNCH", "1")
    f = FastLaunch(_axpy)
    base = torch.randn(4096 + 4, device=cuda_device)
    y = torch.randn(4096 + 4, device=cuda_device)
    for n in (1, 16, 1000, 1000, 4096):  # == 1, % 16, neither (twice: the fast path), % 16
        for off in (0, 1, 0):  # aligned, misaligned (another key), aligned again
            x = base[off : off + n]
            out = torch.full((n,), float("nan"), device=cuda_device)
            ref = torch.full((n,), float("nan"), device=cuda_device)
            f((triton.cdiv(n, 256),), x, y, out, 1.5, n, BLOCK=256, SQUARE=True, num_warps=4)
            _axpy[(triton.cdiv(n, 256),)](x, y, ref, 1.5, n, BLOCK=256, SQUARE=True, num_warps=4)
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert f.fast_calls > 0 and f.jit_calls >= 4
    # a graph captures the compiled launch like any other
    x, out = base[:1000], torch.empty(1000, device=cuda_device)
    g = torch.cuda.CUDAGraph()
    f((4,), x, y, out, 1.5, 1000, BLOCK=256)  # warm (JIT) outside the capture
    with torch.cuda.graph(g):
        f((4,), x, y, out, 1.5, 1000, BLOCK=256)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 1.5 * x + y[:1000])
