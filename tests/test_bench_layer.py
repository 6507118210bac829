"""``benchmarks/bench_layer.py`` refuses to time a layer whose stages fell back to the reference, and a real plan of
the kernel stages on this machine (the CPU: several stages fall back) is such a layer."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench_layer():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("bench_layer")
    finally:
        sys.path.remove(str(BENCH))


def test_a_fallback_is_refused_by_name(bench_layer) -> None:
    kernels = {"scoring": "triton", "indexer": "fused", "select_to_slots": "cutedsl", "attention": "flashmla"}
    bench_layer.check_kernels_ran(kernels, {})  # the kernels' plan: timed
    fell = {**kernels, "select_to_slots": "torch"}
    with pytest.raises(RuntimeError, match=r"fell back to the reference.*select_to_slots.*no cutlass"):
        bench_layer.check_kernels_ran(fell, {"select_to_slots": "no cutlass"})


def test_the_kernel_stages_planned_without_their_kernels_are_refused(bench_layer) -> None:
    """On this CPU the kernel stages' select-to-slots (CuTeDSL) and attention (FlashMLA) fall back: the very plan
    a device run without the bundle's environment made."""
    import torch

    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.kernels.stages import kernel_stages
    from dcp_ref.stages import StepSpec

    spec = StepSpec(DcpGeometry(1, 0, 1, 64), max_tokens=1, topk=2048, num_heads=128, head_dim=576, v_dim=512,
                    sm_scale=0.1, dtype=torch.bfloat16, device="cpu")  # fmt: skip
    st = kernel_stages(spec)
    impls = st.impls()
    assert "torch" in impls.values(), impls
    with pytest.raises(RuntimeError, match="fell back to the reference"):
        bench_layer.check_kernels_ran(impls, dict(st.notes))
