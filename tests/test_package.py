"""Packaging promises: `import dcp_ref` needs only torch and numpy; dcp_ref.kernels maps to kernels/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dcp_ref


def test_import_pulls_in_no_kernel_stack() -> None:
    code = (
        "import sys, dcp_ref\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules}\n"
        "               & {'triton', 'cutlass', 'flashinfer', 'tvm_ffi', 'matplotlib', 'ipywidgets'})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import dcp_ref imported {out}"


def test_kernels_subpackage_is_the_kernels_folder() -> None:
    import dcp_ref.kernels

    assert Path(dcp_ref.kernels.__file__).parent.name == "kernels"


def test_public_names_resolve() -> None:
    for name in dcp_ref.__all__:
        assert getattr(dcp_ref, name) is not None, name


#: The contract types: what a user of the planned step or of the stage protocol needs, from ``dcp_ref``.
CONTRACT = (
    "DcpGeometry",
    "StepSpec",
    "ScoringSpec",
    "Stages",
    "REFERENCE_STAGES",
    "STAGE_MAP",
    "PlannedStep",
    "StepMetadata",
    "RankShard",
    "decode_metadata",
    "prefill_metadata",
    "POISON_SLOT",
    "select_to_slots",
    "index_scores",
)
#: Deliberately wrong teaching examples: they stay in their modules, never at the top level.
TEACHING = ("localize_decode_bounds_wrong_order", "merge_partials_naive_add", "union_counterexample")


def test_contract_types_are_exported_from_the_top_level() -> None:
    import importlib

    homes = {
        "DcpGeometry": "geometry",
        "StepSpec": "stages",
        "ScoringSpec": "stages",
        "Stages": "stages",
        "REFERENCE_STAGES": "stages",
        "STAGE_MAP": "stages",
        "PlannedStep": "step",
        "StepMetadata": "step",
        "RankShard": "step",
        "decode_metadata": "step",
        "prefill_metadata": "step",
        "POISON_SLOT": "deinterleave",
        # The function shadows its module as an attribute of the package (``dcp_ref.select_to_slots`` is the
        # function); ``import dcp_ref.select_to_slots`` / ``importlib`` still give the module.
        "select_to_slots": "select_to_slots",
        "index_scores": "scoring",
    }
    for name in CONTRACT:
        assert name in dcp_ref.__all__, name
        home = importlib.import_module(f"dcp_ref.{homes[name]}")
        assert getattr(dcp_ref, name) is getattr(home, name), name  # the same object, not a copy
    assert dcp_ref.POISON_SLOT == 2**31 - 1


def test_teaching_bugs_stay_in_their_modules() -> None:
    from dcp_ref import lse, ownership, topk

    for name in TEACHING:
        assert name not in dcp_ref.__all__ and not hasattr(dcp_ref, name), name
    assert all(callable(getattr(m, n)) for m, n in zip((ownership, lse, topk), TEACHING))


def test_contract_import_is_light_and_acyclic() -> None:
    """Importing the contract types in a fresh interpreter works (every submodule is imported through
    ``dcp_ref/__init__.py``, so one fresh import finds any cycle) and pulls in neither dcp_ref.kernels nor
    any kernel stack."""
    code = (
        f"from dcp_ref import {', '.join(CONTRACT)}\n"
        "import sys\n"
        "bad = sorted(m for m in sys.modules if m.startswith('dcp_ref.kernels') or m.split('.')[0] in "
        "{'triton', 'cutlass', 'flashinfer', 'flash_mla'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing the contract types imported {out}"


def test_wheel_ships_every_module_under_dcp_ref(tmp_path: Path) -> None:
    """A real (non-editable) build: every module of dcp_ref/ and kernels/ lands under dcp_ref/ in the
    wheel (kernels/ as dcp_ref/kernels/, no top-level ``kernels`` package that could collide with
    the PyPI one), plus the PEP 561 marker. Editable installs can hide a packaging mistake."""
    import shutil
    import zipfile

    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"  # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    for name in ("dcp_ref", "kernels"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("dcp_ref-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"dcp_ref/{p.name}" for p in (root / "dcp_ref").glob("*.py")}
    want |= {f"dcp_ref/kernels/{p.name}" for p in (root / "kernels").glob("*.py")}
    assert want <= names, sorted(want - names)
    assert "dcp_ref/py.typed" in names
    assert not any(n.startswith(("kernels/", "tests/", "notebooks/")) for n in names)
