"""Packaging promises: `import dcp_ref` needs only torch and numpy; dcp_ref.kernels maps to kernels/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dcp_ref


def test_import_pulls_in_no_kernel_stack() -> None:
    code = (
        "import sys, dcp_ref\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'triton', 'cutlass', 'flashinfer', 'tvm_ffi', 'matplotlib', 'ipywidgets'})\n"
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
