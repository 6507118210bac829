"""The contract probe (``tools/probe_contracts.py``) classifies outcomes correctly.

The probe is a measurement, not a gate: these tests check its machinery on fake entry points whose behaviour is
known (silent, named, unnamed, crash, poisoned, clamped, valid, refused, skipped), and run a small real subset
through ``main`` (``--only``, ``--json``, ``--max-bad``). They never assert the project's current counts.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dcp_ref.contracts import check_int_scalar, check_tensor

TOOL = Path(__file__).resolve().parents[1] / "tools" / "probe_contracts.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("probe_contracts", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["probe_contracts"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


probe = _load()
Case = probe.Case


def outcome(case: object) -> str:
    return probe.classify(case).outcome


def _named_check(x: object) -> int:
    return check_int_scalar(x, "x", min_value=1)  # raises from dcp_ref/contracts.py: an argument check


def _index_error() -> object:
    return [][1]


def _deep_type_error() -> object:
    return torch.zeros(2, dtype="float")  # type: ignore[call-overload]  # a TypeError from torch, not a check


def _skip() -> object:
    raise probe.Skip("needs CUDA")


# ---- bad inputs: what the entry point did -------------------------------------------------------------------
def test_a_silent_entry_point_is_silent() -> None:
    assert outcome(Case("fake", "returns for bad input", lambda: torch.zeros(2), "raise", ("x",))) == "silent"


def test_an_argument_check_naming_the_argument_is_named() -> None:
    assert outcome(Case("fake", "x=0", lambda: _named_check(0), "raise", ("x",))) == "named"


def test_an_argument_check_naming_another_argument_is_unnamed() -> None:
    assert outcome(Case("fake", "x=0", lambda: _named_check(0), "raise", ("y",))) == "unnamed"


def test_names_match_whole_words_only() -> None:
    assert not probe._names_in("block_table has no block", ("k",))
    assert probe._names_in("k must be >= 1, got 0", ("k",))
    assert probe._names_in("meta.req_of_token must lie in [0, 2)", ("meta.req_of_token",))
    assert not probe._names_in("outs must be 4-D", ("out",))


def _assertion() -> object:
    raise AssertionError("x")


def test_other_exceptions_are_crashes() -> None:
    assert outcome(Case("fake", "index error", _index_error, "raise", ("x",))) == "crash"
    assert outcome(Case("fake", "assertion", _assertion, "raise", ("x",))) == "crash"
    assert outcome(Case("fake", "a named check", lambda: check_tensor(None, "x"), "raise", ("x",))) == "named"


def test_a_value_or_type_error_from_inside_torch_is_a_crash() -> None:
    r = probe.classify(Case("fake", "torch's own TypeError", _deep_type_error, "raise", ("dtype",)))
    assert r.outcome == "crash" and "not by an argument check" in r.detail


def test_a_contract_type_mismatch_is_noted_not_reclassified() -> None:
    r = probe.classify(Case("fake", "x=True", lambda: _named_check(True), "raise", ("x",), exc=ValueError))
    assert r.outcome == "named" and "contract says ValueError" in r.detail


# ---- validate=False: poisoned / clamped / silent ---------------------------------------------------------------
def test_poison_cases() -> None:
    nan_row = torch.tensor([[1.0, 2.0], [math.nan, math.nan]])
    check = lambda r: probe.rows_nan(r, [1])  # noqa: E731
    assert outcome(Case("fake", "poisoned", lambda: nan_row, "poison", check=check)) == "poisoned"
    assert outcome(Case("fake", "plausible", lambda: torch.zeros(2, 2), "poison", check=check)) == "silent"
    assert outcome(Case("fake", "refused", lambda: _named_check(0), "poison", ("x",), check=check)) == "named"


def test_clamp_and_either_cases() -> None:
    want = probe.expect_equal(torch.tensor([0, 3]))
    assert outcome(Case("fake", "clamped", lambda: torch.tensor([0, 3]), "clamp", check=want)) == "clamped"
    assert outcome(Case("fake", "not the clamp", lambda: torch.tensor([0, 2]), "clamp", check=want)) == "silent"
    assert outcome(Case("fake", "either: right", lambda: torch.tensor([0, 3]), "either", ("x",), check=want)) == "ok"
    wrong = Case("fake", "either: wrong", lambda: torch.tensor([1, 3]), "either", ("x",), check=want)
    assert outcome(wrong) == "silent"
    assert outcome(Case("fake", "either: refused", lambda: _named_check(0), "either", ("x",), check=want)) == "named"


# ---- valid edge inputs ---------------------------------------------------------------------------------------
def test_valid_cases() -> None:
    want = probe.expect_equal(torch.tensor([1.0, math.nan]))
    assert outcome(Case("fake", "ok", lambda: torch.tensor([1.0, math.nan]), "valid", check=want)) == "ok"
    assert outcome(Case("fake", "wrong", lambda: torch.tensor([1.0, 0.0]), "valid", check=want)) == "valid_wrong"
    assert outcome(Case("fake", "refused", lambda: _named_check(0), "valid", check=want)) == "valid_refused"
    assert outcome(Case("fake", "crash", _index_error, "valid", check=want)) == "crash"
    assert outcome(Case("fake", "skipped", _skip, "valid", check=want)) == "skipped"


def test_diff_is_nan_aware_and_shape_strict() -> None:
    assert probe.diff(torch.tensor([math.nan, -math.inf]), torch.tensor([math.nan, -math.inf])) is None
    assert probe.diff(torch.tensor([0.0, -math.inf]), torch.tensor([math.nan, -math.inf])) is not None
    assert probe.diff(torch.zeros(2, 1), torch.zeros(2)) is not None
    assert probe.diff((torch.ones(1), 3), (torch.ones(1), 3)) is None
    assert probe.diff(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7]), rtol=1e-6) is None


def test_report_lists_the_bad_outcomes_and_counts_every_case() -> None:
    cases = [
        Case("fake_silent", "returns for bad input", lambda: 1, "raise", ("x",)),
        Case("fake_named", "x=0", lambda: _named_check(0), "raise", ("x",)),
        Case("fake_valid", "ok", lambda: 1, "valid", check=lambda r: None),
    ]
    results = probe.run_cases(cases)
    text = probe.report(results)
    assert [r.outcome for r in results] == ["silent", "named", "ok"]
    assert "== silent (1)" in text and "fake_silent: returns for bad input" in text
    assert "fake_named: x=0" not in text  # named cases are counted, not listed
    assert probe.run_cases(cases, only="fake_named")[0].entry == "fake_named"


# ---- a small real subset through main ---------------------------------------------------------------------------
def test_main_on_a_subset_writes_json_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "probe.json"
    assert probe.main(["--only", "owner_rank", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["total"] == len(data["cases"]) > 10
    assert all("owner_rank" in c["entry"] or "owner_rank" in c["desc"] for c in data["cases"])
    assert sum(data["counts"].values()) == data["total"]
    assert set(data["counts"]) == set(probe.OUTCOMES)
    assert all(c["outcome"] in probe.OUTCOMES for c in data["cases"])
    assert "entry point" in capsys.readouterr().out


def test_max_bad_turns_the_measurement_into_a_gate() -> None:
    assert probe.main(["--only", "owner_rank", "--max-bad", "100000"]) == 0
    assert probe.main(["--only", "owner_rank", "--max-bad", "-1"]) == 1  # 0 silent + crash > -1


def test_every_generic_base_call_is_valid() -> None:
    """The generic bad-input rows each change one argument of a base call: every base must itself succeed."""
    cases = [c for c in probe.all_cases() if "base call" in c.desc]
    assert cases
    for c in cases[:8]:
        assert probe.classify(c).outcome == "ok", c.entry


# ---- the project against the whole probe ------------------------------------------------------------------------
def test_the_whole_probe_finds_no_silent_answer_crash_or_refused_valid_input() -> None:
    """Every case of the probe (~2,200 bad inputs and valid edges over every public entry point that runs on the
    CPU) ends named, poisoned, clamped, right or skipped: none silent, crashed, unnamed, wrong or refused. The
    expectations are the contracts' (the probe's docstring), written apart from the code they probe."""
    results = probe.run_cases(probe.all_cases())
    assert len(results) > 2000
    bad = [f"{r.outcome}: {r.entry}: {r.desc} -- {r.detail}" for r in results if r.outcome in probe.LISTED]
    assert not bad, "\n".join(bad)
