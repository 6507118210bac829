"""Every Triton kernel of ``kernels/`` compiles for the H200's target (sm_90a cubin) on the CPU.

The CPU suite runs the Triton kernels in the interpreter, which executes their Python but does not type-check or
lower them. ``tools/triton_sm90.py`` records the launches the tests make and compiles them ahead of time (no GPU).
Here: the recorder and the compiler are checked on a planted kernel the interpreter runs and the compiler refuses;
a few fast tests are recorded live and one launch of every launched kernel is compiled; the record over the whole
kernel suite (``benchmarks/results/triton_sm90.json``) names every launched kernel and compiled without a failure.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools import triton_sm90  # noqa: E402

REPORT = ROOT / "benchmarks" / "results" / "triton_sm90.json"

#: Fast tests whose launches cover every launched kernel (chosen from the whole suite's record by its "test"
#: field); the live record below must still cover them all, so a test that stops launching a kernel fails here.
COVER = [
    "tests/test_flashmla_sparse.py::test_heads_in_groups_read_and_write_as_the_plain_layout[triton-2]",
    "tests/test_deinterleave.py::test_kernel_ids_beyond_block_table_and_negative_blocks",
    "tests/test_bad_inputs.py::test_pack_validate_false_clamps_like_the_kernel",
    "tests/test_bad_inputs.py::test_class4_float64_lses_are_not_rounded_to_float32",
    "tests/test_attention_splitkv.py::test_zero_tokens_and_zero_width",
    "tests/test_attention_splitkv.py::test_default_plan_at_deepseek_dims",
    "tests/test_scoring.py::test_kernel_empty_cases",
    "tests/test_scoring.py::test_kernel_verdict_past_the_first_entries[2-40-True]",
    "tests/test_bad_inputs.py::test_class1_the_kernel_attention_prologues_poison_the_poison_slot",
    "tests/test_bad_inputs.py::test_class6_flashmla_sparse_validates_from_its_prologue",
    "tests/test_indexer_kernel.py::test_prefill_row_starts",
    "tests/test_indexer_kernel.py::test_validate_false_never_reads_outside_the_window[compact]",
    "tests/test_fp8_cache.py::test_finish_outputs_kernel",
    "tests/test_fp8_cache.py::test_prepare_indices_kernel",
    "tests/test_pipeline.py::test_kernels_backend_equals_single_device[1-1-1]",
    "tests/test_bad_inputs_select_to_slots.py::test_kernel_validated_call_is_one_check_launch_and_one_read[req-global_id]",
]

#: Launched kernels that the CPU suite cannot reach, and why (compiled from a hand-written launch instead).
NOT_ON_CPU: dict[str, str] = {}


def launched_kernels() -> set[str]:
    """Every module-level ``@triton.jit`` function of ``kernels/`` whose name ends in ``_kernel`` (the ones the
    wrappers launch; the helpers they call are compiled with them)."""
    out = set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                if any("jit" in ast.unparse(d) for d in node.decorator_list):
                    out.add(f"dcp_ref.kernels.{path.stem}.{node.name}")
    return out


def _compile(records: list[dict], tmp_path: Path, extra_path: str = "") -> dict:
    """Compile ``records`` in a fresh process without the interpreter; the tool's report."""
    src = tmp_path / "records.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(filter(None, (extra_path, str(ROOT))))}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "triton_sm90.py"), "compile", str(src), "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT,
    )  # fmt: skip
    if not out.exists():
        if "ModuleNotFoundError" in proc.stderr or "ImportError" in proc.stderr:
            pytest.skip(f"this Triton cannot compile ahead of time here: {proc.stderr.strip().splitlines()[-1]}")
        raise AssertionError(proc.stderr[-3000:])
    return json.loads(out.read_text())


PLANTED = """
import triton
import triton.language as tl


def plain_helper(v):  # not @triton.jit: the interpreter calls it, the compiler cannot
    return v * 2.0


@triton.jit
def helper_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(x_ptr + offs, plain_helper(x), mask=offs < n)


@triton.jit
def break_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    for i in range(n):
        if i == 2:
            break  # Python runs it; Triton's compiler has no `break`
        x = x + 1.0
    tl.store(x_ptr + offs, x, mask=offs < n)


@triton.jit
def fine_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(x_ptr + offs, x * 2.0, mask=offs < n)
"""


def test_the_tool_catches_what_the_interpreter_lets_through(tmp_path: Path) -> None:
    """Two kernels the interpreter runs correctly and the compiler refuses (a plain Python call, a ``break``) are
    recorded and reported as failed, by name; their correct twin compiles."""
    (tmp_path / "planted_mod.py").write_text(PLANTED)
    rec = tmp_path / "launches.jsonl"
    script = (
        "import torch, planted_mod\n"
        "from tools import triton_sm90\n"
        f"triton_sm90.install_recorder({str(rec)!r})\n"
        "for name in ('helper_kernel', 'break_kernel', 'fine_kernel'):\n"
        "    x = torch.ones(8)\n"
        "    getattr(planted_mod, name)[(1,)](x, 5, BLOCK=8, num_warps=1)\n"
        "    print(x.tolist())\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ran = [json.loads(line) for line in proc.stdout.strip().splitlines()[-3:]]
    assert ran == [[2.0] * 5 + [1.0] * 3, [3.0] * 5 + [1.0] * 3, [2.0] * 5 + [1.0] * 3]  # the interpreter ran all
    records = triton_sm90.load_records(rec)
    assert [r["name"] for r in records] == ["helper_kernel", "break_kernel", "fine_kernel"]
    assert records[0]["signature"] == {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    assert records[0]["constexprs"] == {"BLOCK": 8} and records[0]["options"] == {"num_warps": 1}
    report = _compile(records, tmp_path, extra_path=str(tmp_path))
    ok = {r["kernel"].rsplit(".", 1)[1]: r["ok"] for r in report["launches"]}
    assert ok == {"helper_kernel": False, "break_kernel": False, "fine_kernel": True}, report
    errors = {r["kernel"].rsplit(".", 1)[1]: r.get("error", "") for r in report["launches"]}
    assert "plain_helper" in errors["helper_kernel"] and "Break" in errors["break_kernel"]
    assert report["summary"]["failed"] == 2


def test_recorded_argument_types_are_the_jits() -> None:
    """The recorder types each argument as Triton's JIT would (``mangle_type``), a host TMA descriptor included."""
    import torch
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    keys = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    args = [
        keys,
        torch.zeros(3, dtype=torch.int32),
        torch.zeros(2, dtype=torch.bool),
        TensorDescriptor.from_tensor(keys, [64, 128]),
        True,
        7,
        2**40,
        0.5,
    ]
    assert [triton_sm90._arg_type(a)[0] for a in args] == [mangle_type(a) for a in args]
    with pytest.raises(TypeError, match="unrecorded argument type"):
        triton_sm90._arg_type(object())


def test_the_committed_record_covers_every_launched_kernel_and_compiled() -> None:
    """``benchmarks/results/triton_sm90.json``: every launched kernel of ``kernels/`` was recorded by the CPU suite
    (or is listed in NOT_ON_CPU with its reason), and every recorded launch compiled for sm_90a."""
    rep = json.loads(REPORT.read_text())
    assert rep["summary"]["failed"] == 0 == len(rep["failures"]), rep["failures"][:3]
    assert rep["summary"]["launches"] == sum(k["launches"] for k in rep["kernels"].values()) > 0
    assert all(k["failed"] == 0 and k["launches"] > 0 for k in rep["kernels"].values())
    recorded = set(rep["kernels"])
    missing = launched_kernels() - recorded - set(NOT_ON_CPU)
    assert not missing, f"kernels no CPU test launches (record them, or list them in NOT_ON_CPU): {sorted(missing)}"


def test_a_live_record_of_fast_tests_compiles_for_sm90a(tmp_path: Path) -> None:
    """Record the COVER tests now (the kernels as they are in this tree) and compile one launch per kernel."""
    rec = tmp_path / "launches.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1", triton_sm90.RECORD_ENV: str(rec)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "tools.triton_sm90"]
    proc = subprocess.run([*cmd, *COVER], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    records = triton_sm90.load_records(rec)
    first: dict[str, dict] = {}
    for r in records:
        first.setdefault(f"{r['module']}.{r['name']}", r)
    want = set(json.loads(REPORT.read_text())["kernels"])
    assert set(first) >= want, f"COVER no longer launches {sorted(want - set(first))}"
    report = _compile(list(first.values()), tmp_path)
    bad = [r for r in report["launches"] if not r["ok"]]
    assert not bad, bad[:3]
    assert {r["kernel"] for r in report["launches"]} == set(first)


def test_a_spliced_record_replaces_only_the_modules_it_covers() -> None:
    """``merge --into``: the kernels of the re-recorded modules are replaced, every other kernel kept, the summary
    recounted; reports of other Triton versions are refused."""
    into = {"date_utc": "a", "command": "whole suite", "failures": [{"kernel": "m.b.k", "key": "x"}],
            "summary": {"launches": 5, "kernels": 3, "failed": 1, "triton": ["3.9.0", "3.6.0"], "target": "sm_90a"},
            "kernels": {"m.a.k1": {"launches": 2}, "m.a.k2": {"launches": 1}, "m.b.k": {"launches": 2}}}  # fmt: skip
    merged = {"date_utc": "b", "command": "module a again", "failures": [], "summary": {"triton": ["3.9.0", "3.6.0"]},
              "kernels": {"m.a.k1": {"launches": 4}, "m.a.k3": {"launches": 1}}}  # fmt: skip
    out = triton_sm90.splice_record(into, merged)
    assert out["kernels"] == {"m.a.k1": {"launches": 4}, "m.a.k3": {"launches": 1}, "m.b.k": {"launches": 2}}
    assert out["summary"] == {"launches": 7, "kernels": 3, "failed": 1, "triton": ["3.9.0", "3.6.0"],
                                   "target": "sm_90a"}  # fmt: skip
    assert out["failures"] == into["failures"] and out["command"] == "whole suite; b: module a again"
    with pytest.raises(ValueError, match="same versions"):
        triton_sm90.splice_record(into, {**merged, "summary": {"triton": ["3.9.0"]}})
