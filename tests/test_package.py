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


# ---- kernels/ as a package: its import graph, its private names, no module-level buffer caches -----------------
KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def _kernel_modules() -> dict[str, Path]:
    """``{dotted name: path}`` of every module of kernels/ (installed as ``dcp_ref.kernels``)."""
    out = {}
    for p in sorted(KERNELS.rglob("*.py")):
        parts = list(p.relative_to(KERNELS).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["dcp_ref.kernels", *parts])] = p
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int, list[str]]]:
    """Every import of one module, at any depth of its code (inside functions too): ``(module of kernels/ it
    imports, line, names taken from it)``, relative and absolute ``dcp_ref.kernels.*`` spellings alike."""
    import ast

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                t = a.name
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t:
                    found.append((t, node.lineno, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            taken: dict[str, list[str]] = {}
            for a in node.names:
                t = f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base  # a submodule, or a name of base
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t:
                    taken.setdefault(t, []).extend([] if t == f"{base}.{a.name}" else [a.name])
            found.extend((t, node.lineno, names) for t, names in taken.items())
    return found


def test_kernels_import_graph_has_no_cycle() -> None:
    """Statically (every import, inside functions too): the modules of kernels/ import one another without a
    cycle. The shared helpers live in leaf modules (``_launch``, ``_util``), never in ``stages``, which imports
    every kernel module."""
    mods = _kernel_modules()
    graph = {m: {t for t, _, _ in _imports(m, p, mods) if t != m} for m, p in mods.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append([*stack[stack.index(t) :], t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert "dcp_ref.kernels._launch" in graph["dcp_ref.kernels.stages"]  # the graph is read, not empty
    assert cycles == [], "import cycles in kernels/: " + "; ".join(" -> ".join(c) for c in cycles)


def test_kernels_import_no_private_name_of_another_kernel_module() -> None:
    """No module of kernels/ imports an underscore-prefixed name from another module of kernels/ (modules named
    ``_util``, ``_launch`` are fine: it is the names that matter); a shared helper has a public name at home."""
    mods = _kernel_modules()
    offenders = [
        f"{p.relative_to(KERNELS.parent)}:{line} imports {n} from {t}"
        for m, p in mods.items()
        for t, line, names in _imports(m, p, mods)
        if t != m
        for n in names
        if n.startswith("_")
    ]
    assert offenders == []


def test_kernels_keep_no_module_level_buffer_cache() -> None:
    """The plan owns every buffer a stage keeps (``Stages.prepare`` binds them per planned step): no module of
    kernels/ makes a ``threading.local()`` anywhere, keeps a module-level dict or list that code fills (a tensor
    cache), or brings back the removed caches by name (module-level, imported or defined). Module-level caches of
    no tensors (compiled kernels, shape facts) are named in ``ALLOWED``."""
    import ast

    ALLOWED = {"select_to_slots_cutedsl.py": {"_COMPILED", "_FITS"}}  # compiled kernels; bools
    REMOVED = ("per_thread", "_CHECK_FLAGS", "_SCRATCH", "_WORKSPACES", "_INDEXER_WORKSPACES", "_FP8_DECODERS",
               "_FI_WRAPPERS", "_HASH_TABLES")  # fmt: skip
    offenders = []
    for path in sorted(KERNELS.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "local"
                and getattr(node.value, "id", "") == "threading"
            ):
                offenders.append(f"{path.name}:{node.lineno} threading.local")
            named = [node.name] if isinstance(node, ast.FunctionDef) else []
            named += [a.asname or a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            named += [node.attr] if isinstance(node, ast.Attribute) else []
            offenders += [f"{path.name}:{node.lineno} {n}" for n in named if n in REMOVED]
        containers = set()
        for node in tree.body:  # module level: a name bound to a mutable container (or one of the removed caches)
            targets: list[ast.expr] = []
            value = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
                isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("dict", "list", "set", "defaultdict")
            )
            if mutable:
                containers |= {t.id for t in targets if isinstance(t, ast.Name)}
            offenders += [f"{path.name}:{node.lineno} {t.id}" for t in targets if getattr(t, "id", "") in REMOVED]
        containers -= ALLOWED.get(path.name, set())
        for node in ast.walk(tree):  # ... that code fills: a subscript store, or a filling method call
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                hit = getattr(node.value, "id", None)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                filling = ("append", "extend", "setdefault", "update", "add", "insert")
                hit = getattr(node.func.value, "id", None) if node.func.attr in filling else None
            else:
                hit = None
            if hit in containers:
                offenders.append(f"{path.name}:{node.lineno} fills module-level {hit}")
    assert offenders == []


def test_no_private_name_crosses_a_module_in_dcp_ref_or_kernels() -> None:
    """No module of ``dcp_ref/`` (its kit included) or ``kernels/`` imports an underscore-prefixed *name* from
    another module (a private helper another module needs gets a public name at home). Modules named
    ``_util``, ``_launch`` are fine; it is the names that matter."""
    import ast

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for pkg in ("dcp_ref", "kernels"):
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            offenders.append(f"{path.relative_to(root)}:{node.lineno} {alias.name} from {node.module}")
    assert offenders == []
