"""No hand-typed measurement in a chapter's prose: every number the markdown states next to a unit of time
or rate, or next to "measured", is printed by one of the chapter's own code cells (or written in the
source of a cell that prints ``PASS``, i.e. checked against the data).

A number is *stated* when it stands

* right before a unit — ``µs``, ``us``, ``ms``, ``GB/s``, ``TB/s``, ``TFLOP/s``, ``×`` — alone or as part
  of a range or a comparison that ends in the unit (``85–130 µs``, ``61 against 78 µs``, ``72 to 56 µs``); or
* within a few words of ``measured`` / ``measure`` (either side, in the same sentence).

Numbers glued to letters (``H200``, ``sm_90a``, ``fp8``) are names, not quantities. A stated number is
*backed* when the same value (numerically: ``126`` is backed by ``126.0``; ``16,384`` by ``16384``) appears
in a text output of a code cell of that chapter, or in the source of a code cell whose output says ``PASS``.
The checker fails with each unbacked number and its context, so a wrong number typed into the prose (or a
right one that the data no longer supports) is found; :func:`test_a_planted_number_is_flagged` shows it.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

# A number: digits with optional thousands separators (comma, thin or normal space between groups of 3)
# and decimals; not glued to a letter, digit, underscore or dot on either side.
_NUM = r"(?<![\w.])(?:\d{1,3}(?:[,\u2009\u202f ]\d{3})+|\d+)(?:\.\d+)?(?![\w])"
_UNITS = r"(?:µs|μs|us|ms|GB/s|TB/s|TFLOP/s|×)"
# joins inside a run that ends in a unit: a range, a ratio or a comparison of two numbers
_JOIN = r"\s*(?:–|—|-|/|to|and|against|vs\.?|or|,)\s*"
_UNIT_RUN = re.compile(rf"{_NUM}(?:{_JOIN}~?{_NUM})*\s*{_UNITS}(?![A-Za-z])")
_NUM_RE = re.compile(_NUM)
_MEASURED = re.compile(r"\bmeasur(?:ed|e|es|ing|ement|ements)\b", re.I)
_WINDOW_WORDS = 6  # "within a few words" of "measured"
_REFERENCE = re.compile(r"(?:\b(?:chapters?|sections?|PR|issue)\s*|§\s*|#)$", re.I)


def _value(text: str) -> float:
    return float(re.sub(r"[,\u2009\u202f ]", "", text))


def stated_numbers(markdown: str) -> list[tuple[float, str]]:
    """``(value, context)`` of every number the markdown states as a measurement (see the module doc)."""
    found: dict[tuple[int, int], float] = {}
    for run in _UNIT_RUN.finditer(markdown):
        for m in _NUM_RE.finditer(run.group(0)):
            found[(run.start() + m.start(), run.start() + m.end())] = _value(m.group(0))
    for sentence in re.split(r"(?<=[.!?:;])\s+|\n\s*\n", markdown):
        for mm in _MEASURED.finditer(sentence):
            offset = markdown.find(sentence)
            words = list(re.finditer(r"\S+", sentence))
            idx = next(i for i, w in enumerate(words) if w.start() <= mm.start() < w.end() + 1)
            lo = words[max(0, idx - _WINDOW_WORDS)].start()
            hi = words[min(len(words) - 1, idx + _WINDOW_WORDS)].end()
            for m in _NUM_RE.finditer(sentence[lo:hi]):
                if _REFERENCE.search(sentence[: lo + m.start()]):
                    continue  # "chapter 10", "section 3", "#46076": a pointer, not a quantity
                s = offset + lo + m.start()
                found.setdefault((s, s + len(m.group(0))), _value(m.group(0)))
    out = []
    for (s, e), v in sorted(found.items()):
        out.append((v, markdown[max(0, s - 40) : e + 30].replace("\n", " ")))
    return out


def backing_numbers(cells: list[dict]) -> set[float]:
    """Every number printed by a code cell (text outputs), and every number in the source of a code cell
    that printed ``PASS``."""
    vals: set[float] = set()

    def add(text: str) -> None:
        # outputs are machine-printed: plain digits, an optional sign, decimals, exponents
        for m in re.finditer(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", text):
            try:
                vals.add(_value(m.group(0)))
            except ValueError:  # pragma: no cover - the regex only matches numbers
                pass

    for c in cells:
        if c["cell_type"] != "code":
            continue
        texts = []
        for o in c.get("outputs", []):
            if "text" in o:
                texts.append("".join(o["text"]))
            elif "text/plain" in o.get("data", {}) and "image/png" not in o.get("data", {}):
                texts.append("".join(o["data"]["text/plain"]))
        printed = "\n".join(texts)
        add(printed)
        if "PASS" in printed:
            add("".join(c["source"]))
    return vals


def unbacked(nb: dict) -> list[str]:
    """The stated numbers of a notebook that none of its cells backs, with their context."""
    cells = nb["cells"]
    backed = backing_numbers(cells)
    bad = []
    for i, c in enumerate(cells):
        if c["cell_type"] != "markdown":
            continue
        for v, ctx in stated_numbers("".join(c["source"])):
            if v not in backed:
                bad.append(f"cell {i}: {v:g} in '...{ctx}...'")
    return bad


# ---- the checker itself ------------------------------------------------------------------------------
def test_stated_numbers_finds_units_ranges_and_measured() -> None:
    got = [v for v, _ in stated_numbers("one layer is **126 µs** at W = 2; the stages took 85–130 µs each.")]
    assert got == [126.0, 85.0, 130.0]
    got = [v for v, _ in stated_numbers("faster for one row (61 against 78 µs) and 3.6–5.6× over torch")]
    assert got == [61.0, 78.0, 3.6, 5.6]
    got = [v for v, _ in stated_numbers("the copy bandwidth (4.24 TB/s) and 16,384 us, or 1 234 ms")]
    assert got == [4.24, 16384.0, 1234.0]
    # "measured" within a few words, either side; names glued to letters are not quantities
    got = [v for v, _ in stated_numbers("Steps were measured at W ≤ 2 on an H200 with sm_90a.")]
    assert got == [2.0]
    got = [v for v, _ in stated_numbers("We timed 12 steps. Far away from the word, 7 is fine: measured.")]
    assert got == []
    got = [v for v, _ in stated_numbers("the PR (#46076) measured it; chapter 10 measures 3 more")]
    assert got == [3.0]
    assert stated_numbers("W = 8 ranks, 128 heads, top-k 2048 (no unit, nothing timed)") == []


def test_backing_numbers_reads_outputs_and_pass_cells() -> None:
    cells = [
        {
            "cell_type": "code",
            "source": "print(x)",
            "outputs": [{"output_type": "stream", "text": ["graph 162.9 us, 16,384 B\n"]}],
        },
        {
            "cell_type": "code",
            "source": "ok = abs(t - 4.24) < 0.1\nprint('PASS')",
            "outputs": [{"output_type": "stream", "text": ["PASS\n"]}],
        },
        {"cell_type": "code", "source": "y = 999", "outputs": []},
    ]
    got = backing_numbers(cells)
    assert {162.9, 16384.0, 4.24} <= got and 999.0 not in got


def _nb_with(markdown: str, printed: str) -> dict:
    return {
        "cells": [
            {"cell_type": "markdown", "source": markdown},
            {"cell_type": "code", "source": "print(...)", "outputs": [{"output_type": "stream", "text": printed}]},
        ]
    }


def test_the_checker_can_fail_and_pass() -> None:
    assert unbacked(_nb_with("The step takes 162.9 µs (measured).", "W=2 graph 162.9 us")) == []
    bad = unbacked(_nb_with("The step takes 220.0 µs (measured).", "W=2 graph 162.9 us"))
    assert len(bad) == 1 and "220" in bad[0]


@pytest.mark.parametrize("path", CHAPTERS[:1] + CHAPTERS[-1:], ids=lambda p: p.stem)
def test_a_planted_number_is_flagged(path: Path) -> None:
    """A copy of a real chapter with one wrong number typed into its prose fails the check."""
    nb = json.loads(path.read_text())
    assert unbacked(nb) == []
    planted = copy.deepcopy(nb)
    i = next(i for i, c in enumerate(planted["cells"]) if c["cell_type"] == "markdown" and i > 1)
    planted["cells"][i]["source"] = "".join(planted["cells"][i]["source"]) + "\n\nOn the H200 this took 987.6 µs.\n"
    bad = unbacked(planted)
    assert len(bad) == 1 and "987.6" in bad[0], bad


# ---- the chapters ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_stated_number_is_printed_or_checked(path: Path) -> None:
    bad = unbacked(json.loads(path.read_text()))
    assert not bad, f"{path.name}: numbers stated in prose that no cell prints or checks:\n" + "\n".join(bad)
