"""An independent adversarial probe of dcp-ref's input contracts (a measurement, not a gate).

Run on the CPU (Triton kernels through the interpreter)::

    TRITON_INTERPRET=1 python tools/probe_contracts.py [--json OUT] [--only SUBSTR] [--max-bad N]

Every case calls one public entry point with one bad input (or a valid edge input) and is classified:

``named``
    raised ``ValueError`` / ``TypeError`` (or a subclass) from an argument check whose message names the
    offending argument;
``unnamed``
    raised ``ValueError`` / ``TypeError`` from an argument check that does not name it;
``poisoned``
    (``validate=False``, or a stage that poisons by contract) returned, with the out-of-contract rows NaN
    (or the documented poison slot ``2**31 - 1``) — acceptable;
``clamped``
    (``validate=False``) returned exactly the answer of a device-side clamp the contract documents
    (CONTRIBUTING: "row starts / lengths / counts are clamped") — acceptable, listed for the record;
``silent``
    returned a plausible answer for bad input: unflagged, or wrong against what a correct implementation
    must do (a row not poisoned, a key dropped, an aliased buffer accepted);
``crash``
    any other exception (``IndexError``, ``RuntimeError``, ``AssertionError``, ...), or a ``ValueError`` /
    ``TypeError`` raised from inside torch / triton rather than by an argument check (the innermost frame is
    not a ``raise`` statement of this repository);
``ok`` / ``valid_wrong`` / ``valid_refused``
    for valid edge inputs: the answer matches (or not) an independent brute force written here in plain
    torch / Python, or the input was refused;
``skipped``
    the entry point needs what this machine lacks (CuTeDSL, FlashMLA, FlashInfer, a CUDA device).

The expected behaviour of every case comes from the contracts (docstrings, CONTRIBUTING.md "Contracts"),
never from what the code does today. Nothing here imports the tests' case tables.

Exit code 0 always, unless ``--max-bad N`` is given: then 1 when ``silent + crash > N``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # the probe runs the Triton kernels on the CPU
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OUTCOMES = (
    "named",
    "unnamed",
    "poisoned",
    "clamped",
    "silent",
    "crash",
    "ok",
    "valid_wrong",
    "valid_refused",
    "skipped",
)
#: The outcomes the report lists one by one (the project's to fix).
LISTED = ("silent", "crash", "unnamed", "valid_wrong", "valid_refused")
#: What a case expects: ``raise`` (a named error), ``poison`` (validate=False: NaN / poison slot), ``clamp``
#: (validate=False: the documented clamp), ``valid`` (a correct answer), ``either`` (a named refusal or the
#: correct answer: inputs whose acceptance the contract leaves open, e.g. a strided view).
EXPECTS = ("raise", "poison", "clamp", "valid", "either")

NAN, INF = float("nan"), float("inf")
POISON = 2**31 - 1  # the poison slot, written here from CONTRIBUTING.md (not imported)
META = "meta"


class Skip(Exception):
    """Raised by a case whose entry point cannot run on this machine."""


@dataclass
class Case:
    """One probe: ``call()`` runs the entry point; ``check(result)`` returns ``None`` when the result is what the
    contract asks (for ``poison`` / ``clamp`` / ``valid`` / ``either``, and optionally for ``raise``: a poisoned
    answer instead of an error) or a one-line discrepancy."""

    entry: str
    desc: str
    call: Callable[[], Any]
    expect: str = "raise"
    names: tuple[str, ...] = ()
    check: Callable[[Any], str | None] | None = None
    exc: type | None = None  #: the exception type the contract names (a mismatch is noted, not reclassified)

    def __post_init__(self) -> None:
        if self.expect not in EXPECTS:
            raise ValueError(f"expect must be one of {EXPECTS}, got {self.expect!r}")
        if isinstance(self.names, str):
            self.names = (self.names,)


@dataclass
class Result:
    entry: str
    desc: str
    expect: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    names: list[str] = field(default_factory=list)


# ---- classification ---------------------------------------------------------------------------------
_OPTIONAL = ("cutlass", "flash_mla", "flashinfer", "cuda")


def _names_in(msg: str, names: Sequence[str]) -> bool:
    for n in names:
        if not re.search(r"[A-Za-z0-9_]", n[-1:]) or "." in n or "[" in n:
            if n in msg:
                return True
        elif re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", msg):
            return True
    return False


def _raised_by_check(e: BaseException) -> tuple[bool, str]:
    """Whether ``e`` comes from an argument check of this repository: the innermost frame is a ``raise``
    statement in ``dcp_ref/`` or ``kernels/`` (a torch / triton / numpy error surfaces elsewhere)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return False, "?"
    last = frames[-1]
    where = f"{Path(last.filename).name}:{last.lineno}"
    path = Path(last.filename).resolve()
    if path == Path(__file__).resolve() and isinstance(e, TypeError):
        return True, where  # Python refused the call itself (a keyword-only argument passed by position)
    ours = REPO / "dcp_ref" in path.parents or REPO / "kernels" in path.parents
    return ours and (last.line or "").lstrip().startswith("raise"), where


def _short(x: object, n: int = 160) -> str:
    s = " ".join(str(x).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def classify(case: Case) -> Result:
    """Run one case in isolation and classify its outcome (never raises)."""
    t0 = time.perf_counter()

    def done(outcome: str, detail: str = "") -> Result:
        return Result(case.entry, case.desc, case.expect, outcome, detail, time.perf_counter() - t0, list(case.names))

    try:
        res = case.call()
    except Skip as e:
        return done("skipped", _short(e))
    except ImportError as e:
        if any(m in str(e) for m in _OPTIONAL):
            return done("skipped", f"ImportError: {_short(e)}")
        return done("crash", f"ImportError: {_short(e)}")
    except (ValueError, TypeError) as e:
        ours, where = _raised_by_check(e)
        msg = f"{type(e).__name__}: {_short(e)}"
        if not ours:
            return done("crash", f"{msg} (raised at {where}, not by an argument check)")
        if case.expect == "valid":
            return done("valid_refused", msg)
        if case.exc is not None and not isinstance(e, case.exc):
            msg = f"[contract says {case.exc.__name__}] {msg}"
        if not case.names or _names_in(str(e), case.names):
            return done("named", msg)
        return done("unnamed", f"{msg} (expected a name from {list(case.names)})")
    except Exception as e:  # noqa: BLE001 - every other exception is the finding
        _, where = _raised_by_check(e)
        return done("crash", f"{type(e).__name__}: {_short(e)} (at {where})")
    try:
        verdict = case.check(res) if case.check is not None else "returned without an error"
    except Exception as e:  # noqa: BLE001 - a result the checker cannot even read is wrong
        verdict = f"unreadable result ({type(e).__name__}: {_short(e)})"
    if case.expect == "raise":
        if case.check is not None and verdict is None:
            return done("poisoned", "returned the poisoned answer instead of raising")
        return done("silent", verdict or "returned without an error")
    if case.expect == "poison":
        return done("poisoned" if verdict is None else "silent", verdict or "")
    if case.expect == "clamp":
        return done("clamped" if verdict is None else "silent", verdict or "")
    if case.expect == "valid":
        return done("ok" if verdict is None else "valid_wrong", verdict or "")
    return done("ok" if verdict is None else "silent", verdict or "")  # "either"


def run_cases(cases: Iterable[Case], only: str | None = None, progress: bool = False) -> list[Result]:
    results = []
    for c in cases:
        if only and only not in c.entry and only not in c.desc:
            continue
        r = classify(c)
        results.append(r)
        if progress:
            print(f"  [{r.outcome:>13}] {r.entry}: {r.desc} ({r.seconds:.2f}s)", file=sys.stderr, flush=True)
    return results


def summary_table(results: Sequence[Result]) -> str:
    counts: dict[str, Counter] = {}
    for r in results:
        counts.setdefault(r.entry, Counter())[r.outcome] += 1
    cols = [o for o in OUTCOMES if any(c[o] for c in counts.values())]
    width = max([len("entry point"), *(len(e) for e in counts)])
    head = f"{'entry point':<{width}} " + " ".join(f"{c:>8.8}" for c in cols) + "    total"
    lines = [head, "-" * len(head)]
    for e in sorted(counts):
        c = counts[e]
        lines.append(f"{e:<{width}} " + " ".join(f"{c[o] or '':>8}" for o in cols) + f" {sum(c.values()):>8}")
    tot = Counter(r.outcome for r in results)
    lines.append("-" * len(head))
    lines.append(f"{'total':<{width}} " + " ".join(f"{tot[o]:>8}" for o in cols) + f" {len(results):>8}")
    return "\n".join(lines)


def report(results: Sequence[Result]) -> str:
    out = [summary_table(results), ""]
    for outcome in LISTED:
        rows = [r for r in results if r.outcome == outcome]
        if not rows:
            continue
        out.append(f"== {outcome} ({len(rows)})")
        out += [f"  {r.entry}: {r.desc} -- {r.detail}" for r in rows]
        out.append("")
    return "\n".join(out)


# ---- small tensors and result checks --------------------------------------------------------------------
def i32(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def i64(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def f32(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def f64(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=META)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a non-contiguous view (every other element of a wider buffer)."""
    if t.ndim == 0:
        return t
    buf = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
    buf[..., ::2] = t
    return buf[..., ::2]


def transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values as 2-D+ ``t``, stored transposed (column-major view)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _as_tensor(x: object) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def diff(got: object, want: object, *, atol: float = 0.0, rtol: float = 0.0, what: str = "result") -> str | None:
    """``None`` when ``got`` equals ``want`` (NaN == NaN, same shape; floats within tolerance), else why not."""
    if isinstance(want, (tuple, list)) and not isinstance(want, torch.Tensor):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"{what}: expected a {len(want)}-tuple, got {type(got).__name__}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = diff(g, w, atol=atol, rtol=rtol, what=f"{what}[{i}]")
            if d:
                return d
        return None
    if want is None:
        return None if got is None else f"{what}: expected None"
    if isinstance(want, (int, float)) and not isinstance(want, bool) and not isinstance(got, torch.Tensor):
        if isinstance(got, bool) or not isinstance(got, (int, float, np.integer, np.floating)):
            return f"{what}: expected a number, got {type(got).__name__}"
        if math.isnan(want) and math.isnan(float(got)):
            return None
        return None if abs(float(got) - want) <= atol + rtol * abs(want) else f"{what}: {got!r} != {want!r}"
    g, w = _as_tensor(got), _as_tensor(want)
    if g.is_meta or w.is_meta:
        return None if tuple(g.shape) == tuple(w.shape) else f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)}"
    if tuple(g.shape) != tuple(w.shape):
        return f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)}"
    if not g.numel():
        return None
    if g.dtype.is_floating_point or w.dtype.is_floating_point:
        g64, w64 = g.detach().to(torch.float64).cpu(), w.detach().to(torch.float64).cpu()
        nan_g, nan_w = torch.isnan(g64), torch.isnan(w64)
        if not torch.equal(nan_g, nan_w):
            i = int((nan_g != nan_w).reshape(-1).nonzero()[0, 0])
            got_i, want_i = g64.reshape(-1)[i].item(), w64.reshape(-1)[i].item()
            return f"{what}: NaN pattern differs at flat {i} (got {got_i}, want {want_i})"
        ok = ~nan_w
        gg, ww = g64[ok], w64[ok]
        inf = torch.isinf(ww)
        if not torch.equal(gg[inf], ww[inf]):
            return f"{what}: infinities differ"
        err = (gg[~inf] - ww[~inf]).abs()
        lim = atol + rtol * ww[~inf].abs()
        if err.numel() and bool((err > lim).any()):
            i = int((err - lim).argmax())
            return f"{what}: off by {err[i].item():.3g} (got {gg[~inf][i].item():.6g}, want {ww[~inf][i].item():.6g})"
        return None
    if not torch.equal(g.cpu().long(), w.cpu().long()):
        bad = (g.cpu().long() != w.cpu().long()).reshape(-1).nonzero()
        i = int(bad[0, 0])
        return f"{what}: differs at flat {i} (got {g.reshape(-1)[i].item()}, want {w.reshape(-1)[i].item()})"
    return None


def expect_equal(want: object, **tol: float) -> Callable[[Any], str | None]:
    return lambda got: diff(got, want, **tol)  # type: ignore[arg-type]


def sums_to(want: torch.Tensor) -> Callable[[Any], str | None]:
    """The check that a [T, W] result (one column a rank) sums over its ranks to want."""
    return lambda r: diff(r.sum(-1), want)


def rows_nan(t: torch.Tensor, rows: Sequence[int], what: str = "output") -> str | None:
    """Every element of ``t[rows]`` is NaN."""
    for r in rows:
        x = t[r]
        if not bool(torch.isnan(x.to(torch.float64)).all()):
            return f"{what}[{r}] is not NaN-poisoned (got {_short(x.tolist(), 80)})"
    return None


def rows_finite(t: torch.Tensor, rows: Sequence[int], what: str = "output") -> str | None:
    for r in rows:
        if not bool(torch.isfinite(t[r].to(torch.float64)).all()):
            return f"{what}[{r}] should be untouched/finite (got {_short(t[r].tolist(), 80)})"
    return None


def first(*checks: str | None) -> str | None:
    return next((c for c in checks if c), None)


def mk(
    out: list[Case],
    entry: str,
    desc: str,
    call: Callable[[], Any],
    expect: str = "raise",
    names: str | tuple[str, ...] = (),
    check: Callable[[Any], str | None] | None = None,
    exc: type | None = None,
) -> None:
    out.append(Case(entry, desc, call, expect, (names,) if isinstance(names, str) else tuple(names), check, exc))


def call_with(fn: Callable[..., Any], base: Callable[[], dict[str, Any]], /, **override: Any) -> Callable[[], Any]:
    """A thunk: ``fn(**{**base(), **override})`` (override values may be callables of the base kwargs, marked
    by wrapping them in :class:`From`)."""

    def thunk() -> Any:
        kw = base()
        for k, v in override.items():
            kw[k] = v.fn(kw) if isinstance(v, From) else v
        return fn(**kw)

    return thunk


@dataclass
class From:
    """An override computed from the base kwargs (so that each case builds fresh tensors)."""

    fn: Callable[[dict[str, Any]], Any]


#: The valid base call behind every generic bad-input row: ``(entry, id(base)) -> (entry, fn, base)``; each one is
#: itself run as a case ("valid: the base call ...") so that no bad row passes by refusing a broken base.
_BASES: dict[tuple[str, int], tuple[str, Callable[..., Any], Callable[[], dict[str, Any]]]] = {}


def _register(entry: str, fn: Callable[..., Any], base: Callable[[], dict[str, Any]]) -> None:
    _BASES.setdefault((entry, id(base)), (entry, fn, base))


def int_scalar_variants(min_value: int, *, none_ok: bool = False) -> list[tuple[str, object, type]]:
    v = [
        ("bool True", True, TypeError),
        ("float 2.0", 2.0, TypeError),
        ("str '2'", "2", TypeError),
        ("list [2]", [2], TypeError),
        (f"{min_value - 1} (below min {min_value})", min_value - 1, ValueError),
        ("-7", -7, ValueError),
        ("0-d float tensor", torch.tensor(2.0), TypeError),
        ("1-d int tensor", i64([2]), TypeError),
    ]
    if not none_ok:
        v.append(("None", None, TypeError))
    return v


def scalar_cases(
    out: list[Case],
    entry: str,
    fn: Callable[..., Any],
    base: Callable[[], dict[str, Any]],
    arg: str,
    min_value: int,
    *,
    none_ok: bool = False,
    extra: Sequence[tuple[str, object, type]] = (),
) -> None:
    _register(entry, fn, base)
    for label, v, exc in [*int_scalar_variants(min_value, none_ok=none_ok), *extra]:
        if label.startswith("-7") and min_value - 1 == -7:
            continue
        mk(out, entry, f"{arg}={label}", call_with(fn, base, **{arg: v}), "raise", arg, exc=exc)


def flag_cases(
    out: list[Case], entry: str, fn: Callable[..., Any], base: Callable[[], dict[str, Any]], arg: str
) -> None:
    _register(entry, fn, base)
    for label, v in (("int 1", 1), ("str 'no'", "no"), ("None", None), ("np.int64(0)", np.int64(0))):
        mk(out, entry, f"{arg}={label}", call_with(fn, base, **{arg: v}), "raise", arg, exc=TypeError)


def tensor_cases(
    out: list[Case],
    entry: str,
    fn: Callable[..., Any],
    base: Callable[[], dict[str, Any]],
    arg: str,
    *,
    kind: str,
    optional: bool = False,
    meta: bool = True,
    wrong_len: bool = True,
    ndim_change: bool = True,
    names: tuple[str, ...] | None = None,
) -> None:
    """The generic bad tensors for one argument: wrong dtype, a list, None, wrong rank, wrong length, meta.

    A device mismatch involves two arguments: the meta case accepts a message naming any tensor argument."""
    _register(entry, fn, base)
    nm = names or (arg,)
    peers = tuple(k for k, v in base().items() if isinstance(v, torch.Tensor))
    if kind == "int":
        dts = [("float32", torch.float32), ("bool", torch.bool), ("int16", torch.int16), ("uint8", torch.uint8)]
    else:
        dts = [("int64", torch.int64), ("bool", torch.bool), ("complex64", torch.complex64)]
    for label, dt in dts:
        mk(
            out,
            entry,
            f"{arg} dtype {label}",
            call_with(fn, base, **{arg: From(lambda kw, dt=dt: kw[arg].to(dt))}),
            "raise",
            nm,
            exc=TypeError,
        )
    mk(
        out,
        entry,
        f"{arg} as a list",
        call_with(fn, base, **{arg: From(lambda kw: kw[arg].tolist())}),
        "raise",
        nm,
        exc=TypeError,
    )
    if not optional:
        mk(out, entry, f"{arg}=None", call_with(fn, base, **{arg: None}), "raise", nm, exc=TypeError)
    if ndim_change:
        mk(
            out,
            entry,
            f"{arg} with an extra leading dim",
            call_with(fn, base, **{arg: From(lambda kw: kw[arg].unsqueeze(0))}),
            "raise",
            nm,
            exc=ValueError,
        )
    if wrong_len:
        mk(
            out,
            entry,
            f"{arg} one row short",
            call_with(fn, base, **{arg: From(lambda kw: kw[arg][:-1])}),
            "raise",
            nm + peers,
            exc=ValueError,
        )
    if meta:
        mk(
            out,
            entry,
            f"{arg} on the meta device (others on CPU)",
            call_with(fn, base, **{arg: From(lambda kw: meta_like(kw[arg]))}),
            "raise",
            nm + peers,
            exc=ValueError,
        )


# ---- independent brute force --------------------------------------------------------------------------
def bf_owner(p: int, W: int, I: int) -> int:
    return (p // I) % W


def bf_local(p: int, W: int, I: int) -> int:
    return (p // (W * I)) * I + p % I


def bf_global(loc: int, W: int, r: int, I: int) -> int:
    return (loc // I) * (W * I) + r * I + loc % I


def bf_local_len(n: int, W: int, r: int, I: int) -> int:
    return sum(1 for p in range(max(n, 0)) if bf_owner(p, W, I) == r)


# ============================================================================================================
# 1. ownership
# ============================================================================================================
def ownership_cases() -> list[Case]:
    from dcp_ref import (
        DcpGeometry,
        decode_metadata,
        expand_decode_bounds,
        global_to_local,
        local_seq_lens,
        local_to_global,
        localize_decode_bounds,
        localize_prefill_chunk,
        owner_rank,
        prefill_metadata,
    )
    from dcp_ref.geometry import local_count

    out: list[Case] = []
    W, I = 3, 2
    pos = list(range(20))

    def b_owner() -> dict[str, Any]:
        return dict(pos=i64(pos), world_size=W, interleave=I)

    for name, fn, bf in (("owner_rank", owner_rank, bf_owner), ("global_to_local", global_to_local, bf_local)):
        base = b_owner
        mk(
            out,
            name,
            "valid: brute force W=3 I=2",
            call_with(fn, base),
            "valid",
            check=expect_equal(i64([bf(p, W, I) for p in pos])),
        )
        mk(
            out,
            name,
            "valid: python int in, int out",
            call_with(fn, base, pos=7),
            "valid",
            check=expect_equal(bf(7, W, I)),
        )
        mk(
            out,
            name,
            "valid: numpy int64 world_size",
            call_with(fn, base, world_size=np.int64(W)),
            "valid",
            check=expect_equal(i64([bf(p, W, I) for p in pos])),
        )
        big = 2**31 - 1
        mk(
            out,
            name,
            "valid: int32 at 2**31-1 (never wraps)",
            call_with(fn, base, pos=i32([big, big - 5])),
            "valid",
            check=expect_equal(i32([bf(big, W, I), bf(big - 5, W, I)])),
        )
        mk(out, name, "valid: empty tensor", call_with(fn, base, pos=i64([])), "valid", check=expect_equal(i64([])))
        mk(out, name, "pos negative tensor", call_with(fn, base, pos=i64([3, -1])), "raise", "pos", exc=ValueError)
        mk(out, name, "pos negative int", call_with(fn, base, pos=-4), "raise", "pos", exc=ValueError)
        mk(out, name, "pos float tensor", call_with(fn, base, pos=f32([1.0])), "raise", "pos", exc=TypeError)
        mk(out, name, "pos float", call_with(fn, base, pos=3.0), "raise", "pos", exc=TypeError)
        mk(out, name, "pos bool", call_with(fn, base, pos=True), "raise", "pos", exc=TypeError)
        mk(out, name, "pos str", call_with(fn, base, pos="3"), "raise", "pos", exc=TypeError)
        mk(out, name, "pos meta tensor", call_with(fn, base, pos=meta_like(i64([1, 2]))), "raise", "pos")
        for arg, lo in (("world_size", 1), ("interleave", 1)):
            scalar_cases(out, name, fn, base, arg, lo)

    def b_l2g() -> dict[str, Any]:
        return dict(local=i64(list(range(12))), world_size=W, rank=2, interleave=I)

    mk(
        out,
        "local_to_global",
        "valid: brute force",
        call_with(local_to_global, b_l2g),
        "valid",
        check=expect_equal(i64([bf_global(x, W, 2, I) for x in range(12)])),
    )
    mk(
        out,
        "local_to_global",
        "valid: round trip through owner_rank/global_to_local (W=3 I=2)",
        lambda: [(owner_rank(p, W, I), global_to_local(p, W, I)) for p in (local_to_global(5, W, 1, I),)],
        "valid",
        check=expect_equal([(1, 5)]),
    )
    mk(
        out,
        "local_to_global",
        "int32 local whose global id overflows int32",
        call_with(local_to_global, b_l2g, local=i32([2**31 - 10])),
        "raise",
        "local",
    )
    mk(out, "local_to_global", "rank=None", call_with(local_to_global, b_l2g, rank=None), "raise", "rank")
    mk(out, "local_to_global", "rank=W", call_with(local_to_global, b_l2g, rank=W), "raise", "rank", exc=ValueError)
    mk(
        out,
        "local_to_global",
        "old argument order (local, rank, world_size)",
        lambda: local_to_global(i64([1]), 1, 3),
        "raise",
        "rank",
    )
    scalar_cases(out, "local_to_global", local_to_global, b_l2g, "rank", 0)
    mk(out, "local_to_global", "local negative", call_with(local_to_global, b_l2g, local=i64([-1])), "raise", "local")

    def b_lsl() -> dict[str, Any]:
        return dict(seq_lens=i64([0, 1, 5, 13]), world_size=W, rank=1, interleave=I)

    for desc, kw, check in (
        ("valid: brute force", {}, expect_equal(i64([bf_local_len(n, W, 1, I) for n in (0, 1, 5, 13)]))),
        ("valid: rank=None sums to seq_lens", dict(rank=None), sums_to(i64([0, 1, 5, 13]))),
    ):
        mk(out, "local_seq_lens", desc, call_with(local_seq_lens, b_lsl, **kw), "valid", check=check)
    mk(
        out,
        "local_seq_lens",
        "seq_lens negative",
        call_with(local_seq_lens, b_lsl, seq_lens=i64([3, -2])),
        "raise",
        "seq_lens",
    )
    mk(out, "local_seq_lens", "rank=-1", call_with(local_seq_lens, b_lsl, rank=-1), "raise", "rank")
    mk(out, "local_seq_lens", "rank=W", call_with(local_seq_lens, b_lsl, rank=W), "raise", "rank")
    mk(
        out,
        "local_seq_lens",
        "seq_lens list of floats",
        call_with(local_seq_lens, b_lsl, seq_lens=[1.0, 2.0]),
        "raise",
        "seq_lens",
    )

    mk(
        out,
        "local_count",
        "valid: brute force, negative n counts 0",
        lambda: local_count(i64([-3, 0, 7, 12]), W, 2, I),
        "valid",
        check=expect_equal(i64([0, 0, bf_local_len(7, W, 2, I), bf_local_len(12, W, 2, I)])),
    )
    mk(out, "local_count", "n float tensor", lambda: local_count(f32([3.0]), W, 0, I), "raise", "n")
    mk(out, "local_count", "rank=None", lambda: local_count(i64([3]), W, None, I), "raise", "rank")  # type: ignore[arg-type]
    mk(out, "local_count", "rank=W", lambda: local_count(i64([3]), W, W, I), "raise", "rank")

    # ---- expand / localize decode bounds
    def b_exp() -> dict[str, Any]:
        return dict(seq_lens=i64([5, 9, 2]), query_lens=2)

    mk(
        out,
        "expand_decode_bounds",
        "valid: next_n=2 brute force",
        call_with(expand_decode_bounds, b_exp),
        "valid",
        check=expect_equal(i64([[4, 5], [8, 9], [1, 2]])),
    )
    mk(
        out,
        "expand_decode_bounds",
        "valid: per-request counts with a zero",
        call_with(expand_decode_bounds, b_exp, query_lens=i64([0, 3, 1])),
        "valid",
        check=expect_equal(i64([7, 8, 9, 2])),
    )
    mk(
        out,
        "expand_decode_bounds",
        "valid: validate=False, counts with num_tokens",
        call_with(expand_decode_bounds, b_exp, query_lens=i64([1, 1, 2]), num_tokens=4, validate=False),
        "valid",
        check=expect_equal(i64([5, 9, 1, 2])),
    )
    mk(
        out,
        "expand_decode_bounds",
        "seq_lens < next_n",
        call_with(expand_decode_bounds, b_exp, query_lens=3),
        "raise",
        ("seq_lens", "query_lens"),
    )
    mk(
        out,
        "expand_decode_bounds",
        "next_n=0",
        call_with(expand_decode_bounds, b_exp, query_lens=0),
        "raise",
        "query_lens",
    )
    mk(
        out,
        "expand_decode_bounds",
        "next_n=True",
        call_with(expand_decode_bounds, b_exp, query_lens=True),
        "raise",
        "query_lens",
    )
    mk(
        out,
        "expand_decode_bounds",
        "next_n=2.0",
        call_with(expand_decode_bounds, b_exp, query_lens=2.0),
        "raise",
        "query_lens",
    )
    mk(
        out,
        "expand_decode_bounds",
        "query_lens negative entry",
        call_with(expand_decode_bounds, b_exp, query_lens=i64([1, -1, 1])),
        "raise",
        "query_lens",
    )
    mk(
        out,
        "expand_decode_bounds",
        "query_lens wrong length",
        call_with(expand_decode_bounds, b_exp, query_lens=i64([1, 1])),
        "raise",
        "query_lens",
    )
    mk(
        out,
        "expand_decode_bounds",
        "num_tokens mismatch (int next_n)",
        call_with(expand_decode_bounds, b_exp, num_tokens=5),
        "raise",
        ("query_lens", "num_tokens"),
    )
    mk(
        out,
        "expand_decode_bounds",
        "num_tokens mismatch (per-request)",
        call_with(expand_decode_bounds, b_exp, query_lens=i64([1, 1, 1]), num_tokens=4),
        "raise",
        ("query_lens", "num_tokens"),
    )
    mk(
        out,
        "expand_decode_bounds",
        "validate=False, tensor query_lens without num_tokens",
        call_with(expand_decode_bounds, b_exp, query_lens=i64([1, 1, 1]), validate=False),
        "raise",
        "num_tokens",
    )
    mk(
        out,
        "expand_decode_bounds",
        "seq_lens 2-D",
        call_with(expand_decode_bounds, b_exp, seq_lens=i64([[5, 9]])),
        "raise",
        "seq_lens",
    )
    mk(
        out,
        "expand_decode_bounds",
        "seq_lens negative",
        call_with(expand_decode_bounds, b_exp, seq_lens=i64([5, -1, 3])),
        "raise",
        "seq_lens",
    )
    mk(
        out,
        "expand_decode_bounds",
        "seq_lens float",
        call_with(expand_decode_bounds, b_exp, seq_lens=f32([5.0])),
        "raise",
        "seq_lens",
    )
    mk(
        out,
        "expand_decode_bounds",
        "seq_lens scalar int",
        call_with(expand_decode_bounds, b_exp, seq_lens=5),
        "raise",
        "seq_lens",
    )
    mk(
        out,
        "expand_decode_bounds",
        "num_tokens=-1",
        call_with(expand_decode_bounds, b_exp, num_tokens=-1),
        "raise",
        "num_tokens",
    )
    flag_cases(out, "expand_decode_bounds", expand_decode_bounds, b_exp, "validate")
    mk(
        out,
        "expand_decode_bounds",
        "validate=False, negative seq_len (documented clamp to >= 0)",
        call_with(expand_decode_bounds, b_exp, seq_lens=i64([5, -3, 2]), validate=False),
        "clamp",
        check=expect_equal(i64([[4, 5], [0, 0], [1, 2]])),
    )

    def b_loc() -> dict[str, Any]:
        return dict(seq_lens=i64([10, 3]), query_lens=i64([3, 1]), world_size=2, rank=1, interleave=1)

    for desc, kw, check in (
        ("valid: docstring example (8,9,10 -> 4,4,5)", {}, expect_equal(i64([4, 4, 5, 1]))),
        ("valid: rank=None gives [T, W] summing to the global bound", dict(rank=None), sums_to(i64([8, 9, 10, 3]))),
    ):
        mk(out, "localize_decode_bounds", desc, call_with(localize_decode_bounds, b_loc, **kw), "valid", check=check)
    mk(
        out,
        "localize_decode_bounds",
        "valid: W=3 I=2 brute force, next_n=2",
        call_with(
            localize_decode_bounds, b_loc, seq_lens=i64([13, 4]), query_lens=2, world_size=3, rank=2, interleave=2
        ),
        "valid",
        check=expect_equal(
            i64(
                [
                    [bf_local_len(12, 3, 2, 2), bf_local_len(13, 3, 2, 2)],
                    [bf_local_len(3, 3, 2, 2), bf_local_len(4, 3, 2, 2)],
                ]
            )
        ),
    )
    mk(
        out,
        "localize_decode_bounds",
        "rank=2 of W=2",
        call_with(localize_decode_bounds, b_loc, rank=2),
        "raise",
        "rank",
    )
    mk(
        out,
        "localize_decode_bounds",
        "interleave=0",
        call_with(localize_decode_bounds, b_loc, interleave=0),
        "raise",
        "interleave",
    )
    mk(
        out,
        "localize_decode_bounds",
        "world_size='2'",
        call_with(localize_decode_bounds, b_loc, world_size="2"),
        "raise",
        "world_size",
    )
    mk(
        out,
        "localize_decode_bounds",
        "validate=False, negative query count (documented clamp)",
        call_with(localize_decode_bounds, b_loc, query_lens=i64([-1, 1]), num_tokens=1, validate=False),
        "clamp",
        check=expect_equal(i64([bf_local_len(3, 2, 1, 1)])),
    )

    def b_pre() -> dict[str, Any]:
        return dict(context_lens=i64([3, 0]), query_lens=i64([2, 3]), world_size=2, rank=1, interleave=1)

    def bf_prefill(ctx: list[int], ql: list[int], W: int, r: int, I: int) -> list[tuple[int, int]]:
        res, base_k = [], 0
        for c, q in zip(ctx, ql):
            for j in range(q):
                res.append((base_k, base_k + bf_local_len(c + j + 1, W, r, I)))
            base_k += bf_local_len(c + q, W, r, I)
        return res

    want = bf_prefill([3, 0], [2, 3], 2, 1, 1)
    mk(
        out,
        "localize_prefill_chunk",
        "valid: brute force token_ks/token_ke",
        call_with(localize_prefill_chunk, b_pre),
        "valid",
        check=lambda m: diff((m.token_ks, m.token_ke), (i64([a for a, _ in want]), i64([b for _, b in want]))),
    )
    want2 = bf_prefill([5, 1], [0, 4], 3, 2, 2)
    mk(
        out,
        "localize_prefill_chunk",
        "valid: W=3 I=2, a request with no query token",
        call_with(
            localize_prefill_chunk,
            b_pre,
            context_lens=i64([5, 1]),
            query_lens=i64([0, 4]),
            world_size=3,
            rank=2,
            interleave=2,
        ),
        "valid",
        check=lambda m: diff((m.token_ks, m.token_ke), (i64([a for a, _ in want2]), i64([b for _, b in want2]))),
    )
    mk(
        out,
        "localize_prefill_chunk",
        "valid: empty chunk (B=0)",
        call_with(localize_prefill_chunk, b_pre, context_lens=i64([]), query_lens=i64([])),
        "valid",
        check=lambda m: diff(m.token_ks, i64([])),
    )
    mk(
        out,
        "localize_prefill_chunk",
        "context_lens negative",
        call_with(localize_prefill_chunk, b_pre, context_lens=i64([-1, 0])),
        "raise",
        "context_lens",
    )
    mk(
        out,
        "localize_prefill_chunk",
        "query_lens negative",
        call_with(localize_prefill_chunk, b_pre, query_lens=i64([1, -2])),
        "raise",
        "query_lens",
    )
    mk(
        out,
        "localize_prefill_chunk",
        "query_lens shape mismatch",
        call_with(localize_prefill_chunk, b_pre, query_lens=i64([1])),
        "raise",
        "query_lens",
    )
    mk(out, "localize_prefill_chunk", "rank=None", call_with(localize_prefill_chunk, b_pre, rank=None), "raise", "rank")
    mk(
        out,
        "localize_prefill_chunk",
        "context_lens 2-D",
        call_with(localize_prefill_chunk, b_pre, context_lens=i64([[3, 0]]), query_lens=i64([[2, 3]])),
        "raise",
        "context_lens",
    )
    mk(
        out,
        "localize_prefill_chunk",
        "int32 context + query overflows int32",
        call_with(localize_prefill_chunk, b_pre, context_lens=i32([2**31 - 3, 0]), query_lens=i32([5, 1])),
        "raise",
        ("context_lens", "query_lens"),
    )
    mk(
        out,
        "localize_prefill_chunk",
        "query_lens float list",
        call_with(localize_prefill_chunk, b_pre, query_lens=[1.0, 2.0]),
        "raise",
        "query_lens",
    )

    # ---- the step metadata (the ownership stage of the planned step)
    geo = DcpGeometry(2, 1, 1, 4)
    mk(
        out,
        "decode_metadata",
        "valid: brute force bounds and request ids",
        lambda: decode_metadata(i64([10, 3]), 2, geo),
        "valid",
        check=lambda m: diff(
            (m.local_bounds, m.req_of_token),
            (
                i32(
                    [
                        bf_local_len(9, 2, 1, 1),
                        bf_local_len(10, 2, 1, 1),
                        bf_local_len(2, 2, 1, 1),
                        bf_local_len(3, 2, 1, 1),
                    ]
                ),
                i32([0, 0, 1, 1]),
            ),
        ),
    )
    mk(
        out,
        "decode_metadata",
        "valid: per-request next_n list with a zero",
        lambda: decode_metadata(i64([10, 3, 4]), i64([1, 0, 2]), geo),
        "valid",
        check=lambda m: diff(m.req_of_token, i32([0, 2, 2])),
    )
    mk(out, "decode_metadata", "geometry a tuple", lambda: decode_metadata(i64([4]), 1, (2, 1)), "raise", "geometry")  # type: ignore[arg-type]
    mk(out, "decode_metadata", "next_n=0", lambda: decode_metadata(i64([4]), 0, geo), "raise", ("next_n", "query_lens"))
    mk(
        out,
        "decode_metadata",
        "next_n=True",
        lambda: decode_metadata(i64([4]), True, geo),
        "raise",
        ("next_n", "query_lens"),
    )
    mk(out, "decode_metadata", "seq_lens negative", lambda: decode_metadata(i64([4, -1]), 1, geo), "raise", "seq_lens")
    mk(
        out,
        "decode_metadata",
        "next_n list longer than seq_lens",
        lambda: decode_metadata(i64([4, 4]), [1, 1, 1], geo),
        "raise",
        ("next_n", "query_lens"),
    )
    mk(
        out,
        "decode_metadata",
        "next_n float list",
        lambda: decode_metadata(i64([4, 4]), [1.0, 1.0], geo),
        "raise",
        ("next_n", "query_lens"),
    )
    mk(
        out,
        "decode_metadata",
        "seq_lens < next_n",
        lambda: decode_metadata(i64([1]), 2, geo),
        "raise",
        ("seq_lens", "next_n", "query_lens"),
    )
    mk(
        out,
        "decode_metadata",
        "device='nope'",
        lambda: decode_metadata(i64([4]), 1, geo, device="nope"),
        "raise",
        "device",
    )
    mk(
        out,
        "prefill_metadata",
        "valid: brute force row starts and bounds",
        lambda: prefill_metadata(i64([3, 0]), i64([2, 3]), DcpGeometry(2, 1, 1, 2)),
        "valid",
        check=lambda m: diff(
            (m.row_starts, m.local_bounds), (i32([a for a, _ in want]), i32([b - a for a, b in want]))
        ),
    )
    mk(
        out,
        "prefill_metadata",
        "geometry None",
        lambda: prefill_metadata(i64([3]), i64([1]), None),
        "raise",
        "geometry",
    )  # type: ignore[arg-type]
    mk(
        out,
        "prefill_metadata",
        "query_lens negative",
        lambda: prefill_metadata(i64([3]), i64([-1]), DcpGeometry(2, 0)),
        "raise",
        "query_lens",
    )

    # ---- the geometry itself
    for label, kw, names in (
        ("world_size=0", dict(world_size=0, rank=0), "world_size"),
        ("rank=W", dict(world_size=2, rank=2), "rank"),
        ("rank=-1", dict(world_size=2, rank=-1), "rank"),
        ("rank=True", dict(world_size=2, rank=True), "rank"),
        ("world_size=2.0", dict(world_size=2.0, rank=0), "world_size"),
        ("interleave=0", dict(world_size=2, rank=0, interleave=0), "interleave"),
        ("block_size=0", dict(world_size=2, rank=0, block_size=0), "block_size"),
        (
            "block_size not a multiple of interleave",
            dict(world_size=2, rank=0, interleave=2, block_size=3),
            "block_size",
        ),
        ("block_size='4'", dict(world_size=2, rank=0, block_size="4"), "block_size"),
        ("rank None", dict(world_size=2, rank=None), "rank"),
    ):
        mk(out, "DcpGeometry", label, lambda kw=kw: DcpGeometry(**kw), "raise", names)
    mk(
        out,
        "DcpGeometry",
        "valid: numpy / 0-d tensor fields become ints",
        lambda: DcpGeometry(np.int64(2), torch.tensor(1), 2, 4),
        "valid",
        check=lambda g: None if (g.world_size, g.rank, type(g.rank)) == (2, 1, int) else f"got {g!r}",
    )
    return out


# ============================================================================================================
# 2. indexer (local top-K) and pack, reference and Triton
# ============================================================================================================
def _f32(x: float) -> float:
    return float(np.float32(x))


def bf_local_topk(
    logits: torch.Tensor, k: int, lengths: Sequence[int] | None = None, starts: Sequence[int] | None = None
) -> list[list[int]]:
    """Per row: local indices by (float32 score descending, -0 == +0, then lower index), NaN never chosen."""
    rows, cols = logits.shape
    res = []
    for r in range(rows):
        s = 0 if starts is None else starts[r]
        n = cols - s if lengths is None else lengths[r]
        cand = []
        for j in range(n):
            v = _f32(float(logits[r, s + j]))
            if math.isnan(v):
                continue
            cand.append((-(v + 0.0), j))
        cand.sort()
        ids = [j for _, j in cand[:k]]
        res.append(ids + [-1] * (k - len(ids)))
    return res


def bf_pack(
    logits: torch.Tensor,
    ids: Sequence[Sequence[int]],
    W: int,
    r: int,
    I: int,
    starts: Sequence[int] | None = None,
) -> torch.Tensor:
    rows = len(ids)
    K = len(ids[0]) if rows else 0
    outp = torch.empty(rows, K, 2, dtype=torch.float32)
    for t in range(rows):
        s = 0 if starts is None else starts[t]
        for c, j in enumerate(ids[t]):
            if j < 0:
                outp[t, c] = f32([-INF, -1.0])
            else:
                outp[t, c, 0] = float(logits[t, s + j])
                outp[t, c, 1] = float(bf_global(j, W, r, I))
    return outp


def as_pair_set(p: torch.Tensor) -> list[list[tuple[float, float]]]:
    """Each row's (score, id) pairs as a sorted list (a kernel may write them in any order)."""
    rows = []
    for t in range(p.shape[0]):
        pairs = [(float(p[t, c, 1]), float(p[t, c, 0])) for c in range(p.shape[1])]
        rows.append(sorted(pairs, key=lambda x: (x[0], str(x[1]))))
    return rows


def same_pair_sets(want: torch.Tensor) -> Callable[[Any], str | None]:
    def check(got: Any) -> str | None:
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            return f"expected pairs of shape {tuple(want.shape)}, got {getattr(got, 'shape', type(got).__name__)}"
        g, w = as_pair_set(got), as_pair_set(want)
        for t, (a, b) in enumerate(zip(g, w)):
            for (ia, sa), (ib, sb) in zip(a, b):
                if ia != ib or not (sa == sb or (math.isnan(sa) and math.isnan(sb))):
                    return f"row {t}: pairs {_short(a, 70)} != {_short(b, 70)}"
        return None

    return check


def indexer_cases() -> list[Case]:
    from dcp_ref import DcpGeometry, local_topk, pack_candidates
    from dcp_ref.indexer import local_topk_rank_local, reference_indexer_rank_local

    kt = _kernel("indexer_triton")
    pt = _kernel("pack_triton")
    out: list[Case] = []
    G = gen(1)
    L = torch.randn(3, 10, generator=G)
    L[0, 2] = L[0, 5]  # a tie: lower index first
    L[1, 3], L[1, 4] = -0.0, 0.0  # -0.0 == +0.0: lower index first
    L[1, 6] = NAN  # masked
    L[2, 1] = -INF  # valid, selectable
    lens, k = [10, 8, 4], 4

    def b_lt() -> dict[str, Any]:
        return dict(logits=L.clone(), k=k, lengths=i64(lens))

    mk(
        out,
        "local_topk",
        "valid: ties, -0.0/+0.0, NaN, -inf, brute force",
        call_with(local_topk, b_lt),
        "valid",
        check=expect_equal(i64(bf_local_topk(L, k, lens))),
    )
    mk(
        out,
        "local_topk",
        "valid: k > valid keys pads -1",
        call_with(local_topk, b_lt, k=12),
        "valid",
        check=expect_equal(i64(bf_local_topk(L, 12, lens))),
    )
    mk(
        out,
        "local_topk",
        "valid: length-0 row is all -1",
        call_with(local_topk, b_lt, lengths=i64([0, 8, 4])),
        "valid",
        check=expect_equal(i64(bf_local_topk(L, k, [0, 8, 4]))),
    )
    mk(
        out,
        "local_topk",
        "valid: row_starts (prefill windows)",
        call_with(local_topk, b_lt, lengths=i64([3, 2, 0]), row_starts=i32([0, 5, 10])),
        "valid",
        check=expect_equal(i64(bf_local_topk(L, k, [3, 2, 0], [0, 5, 10]))),
    )
    mk(
        out,
        "local_topk",
        "valid: rows=0",
        call_with(local_topk, b_lt, logits=torch.zeros(0, 5), lengths=i64([])),
        "valid",
        check=expect_equal(torch.zeros(0, k, dtype=torch.int64)),
    )
    mk(
        out,
        "local_topk",
        "valid: cols=0",
        call_with(local_topk, b_lt, logits=torch.zeros(3, 0), lengths=i64([0, 0, 0])),
        "valid",
        check=expect_equal(torch.full((3, k), -1, dtype=torch.int64)),
    )
    d = f64([[1.0 + 1e-12, 1.0, 0.5]])
    mk(
        out,
        "local_topk",
        "valid: float64 scores equal as float32 tie by index",
        lambda: local_topk(d, 1),
        "valid",
        check=expect_equal(i64([[0]])),
    )
    mk(
        out,
        "local_topk",
        "valid: strided logits view",
        call_with(local_topk, b_lt, logits=strided(L)),
        "valid",
        check=expect_equal(i64(bf_local_topk(L, k, lens))),
    )
    mk(
        out,
        "local_topk",
        "valid: meta tensors with validate=False (shapes only)",
        lambda: local_topk(meta_like(L), k, meta_like(i64(lens)), validate=False),
        "valid",
        check=lambda r: diff(r, torch.empty(3, k, device=META)),
    )
    tensor_cases(out, "local_topk", local_topk, b_lt, "logits", kind="float", wrong_len=False)
    tensor_cases(out, "local_topk", local_topk, b_lt, "lengths", kind="int", optional=True)
    scalar_cases(out, "local_topk", local_topk, b_lt, "k", 1)
    flag_cases(out, "local_topk", local_topk, b_lt, "validate")
    mk(out, "local_topk", "lengths > cols", call_with(local_topk, b_lt, lengths=i64([11, 8, 4])), "raise", "lengths")
    mk(out, "local_topk", "lengths negative", call_with(local_topk, b_lt, lengths=i64([3, -1, 4])), "raise", "lengths")
    mk(
        out,
        "local_topk",
        "row_starts > cols",
        call_with(local_topk, b_lt, row_starts=i64([0, 11, 0]), lengths=i64([1, 0, 1])),
        "raise",
        "row_starts",
    )
    mk(
        out,
        "local_topk",
        "row_starts + lengths > cols",
        call_with(local_topk, b_lt, row_starts=i64([0, 8, 0]), lengths=i64([1, 3, 1])),
        "raise",
        ("row_starts", "lengths"),
    )
    mk(
        out,
        "local_topk",
        "row_starts negative",
        call_with(local_topk, b_lt, row_starts=i64([0, -1, 0])),
        "raise",
        "row_starts",
    )
    mk(
        out,
        "local_topk",
        "row_starts float",
        call_with(local_topk, b_lt, row_starts=f32([0, 0, 0])),
        "raise",
        "row_starts",
    )
    mk(
        out,
        "local_topk",
        "row_starts wrong length",
        call_with(local_topk, b_lt, row_starts=i64([0, 0])),
        "raise",
        "row_starts",
    )
    mk(
        out,
        "local_topk",
        "lengths meta tensor, validate=True",
        lambda: local_topk(meta_like(L), 2, meta_like(i64(lens))),
        "raise",
        ("lengths", "logits"),
    )
    mk(
        out,
        "local_topk",
        "validate=False, lengths > cols (documented clamp to cols)",
        call_with(local_topk, b_lt, lengths=i64([40, 8, 4]), validate=False),
        "clamp",
        check=expect_equal(i64(bf_local_topk(L, k, [10, 8, 4]))),
    )
    mk(
        out,
        "local_topk",
        "validate=False, negative length (documented clamp to 0)",
        call_with(local_topk, b_lt, lengths=i64([10, -5, 4]), validate=False),
        "clamp",
        check=expect_equal(i64(bf_local_topk(L, k, [10, 0, 4]))),
    )

    mk(
        out,
        "local_topk_rank_local",
        "valid: ascending local index, NaN padding",
        lambda: local_topk_rank_local(L.clone(), 3, i64(lens)),
        "valid",
        check=lambda r: diff(
            r[1],
            i32(
                [
                    sorted(x) + [-1] * (3 - len(x))
                    for x in ([j for j in row if j >= 0] for row in bf_local_topk(L, 3, lens))
                ]
            ),
        ),
    )
    mk(
        out,
        "local_topk_rank_local",
        "valid: -0.0 keeps its sign bit",
        lambda: local_topk_rank_local(f32([[-0.0, -1.0]]), 1),
        "valid",
        check=lambda r: None if math.copysign(1.0, float(r[0][0, 0])) < 0 else "sign of -0.0 lost",
    )
    mk(out, "local_topk_rank_local", "k=0", lambda: local_topk_rank_local(L, 0, i64(lens)), "raise", "k")
    mk(
        out,
        "reference_indexer_rank_local",
        "geometry an int",
        lambda: reference_indexer_rank_local(L, i64(lens), 2, 3),
        "raise",
        "geometry",
    )  # type: ignore[arg-type]
    mk(
        out,
        "reference_indexer_rank_local",
        "out float64 buffer",
        lambda: reference_indexer_rank_local(
            L, i64(lens), DcpGeometry(2, 0), 3, out=torch.empty(3, 3, dtype=torch.float64)
        ),
        "raise",
        "out",
    )
    mk(
        out,
        "reference_indexer_rank_local",
        "out_ids int64 buffer",
        lambda: reference_indexer_rank_local(
            L, i64(lens), DcpGeometry(2, 0), 3, out_ids=torch.empty(3, 3, dtype=torch.int64)
        ),
        "raise",
        "out_ids",
    )
    mk(
        out,
        "reference_indexer_rank_local",
        "out aliases scores",
        lambda: (lambda s: reference_indexer_rank_local(s, i64(lens), DcpGeometry(2, 0), 3, out=s[:, :3]))(L.clone()),
        "raise",
        "out",
    )

    # ---- the fused Triton indexer (local top-K + pack)
    geo = DcpGeometry(2, 1, 2, 4)

    def b_kt() -> dict[str, Any]:
        return dict(scores=L.clone(), lengths=i64(lens), k=k, geometry=geo)

    want = bf_pack(L, bf_local_topk(L, k, lens), 2, 1, 2)
    if kt is None:
        mk(out, "indexer_topk_pack", "module unavailable", _skip("dcp_ref.kernels.indexer_triton"), "valid")
    else:
        f = fk = kt.indexer_topk_pack
        mk(
            out,
            "indexer_topk_pack",
            "valid: same pair sets as the brute force",
            call_with(f, b_kt),
            "valid",
            check=same_pair_sets(want),
        )
        mk(
            out,
            "indexer_topk_pack",
            "valid: k > cols",
            call_with(f, b_kt, k=12),
            "valid",
            check=same_pair_sets(bf_pack(L, bf_local_topk(L, 12, lens), 2, 1, 2)),
        )
        mk(
            out,
            "indexer_topk_pack",
            "valid: row_starts + lengths",
            call_with(f, b_kt, lengths=i64([3, 2, 0]), row_starts=i32([0, 5, 10])),
            "valid",
            check=same_pair_sets(bf_pack(L, bf_local_topk(L, k, [3, 2, 0], [0, 5, 10]), 2, 1, 2, [0, 5, 10])),
        )
        mk(
            out,
            "indexer_topk_pack",
            "valid: lengths None",
            call_with(f, b_kt, lengths=None),
            "valid",
            check=same_pair_sets(bf_pack(L, bf_local_topk(L, k), 2, 1, 2)),
        )
        mk(
            out,
            "indexer_topk_pack",
            "valid: transposed scores view",
            call_with(f, b_kt, scores=transposed(L)),
            "valid",
            check=same_pair_sets(want),
        )
        mk(
            out,
            "indexer_topk_pack",
            "valid: strided lengths view",
            call_with(f, b_kt, lengths=strided(i64(lens))),
            "valid",
            check=same_pair_sets(want),
        )
        mk(
            out,
            "indexer_topk_pack",
            "valid: rank_local order",
            call_with(f, b_kt, order="rank_local", k=3),
            "valid",
            check=lambda r: diff(
                r[1],
                i32(
                    [
                        sorted(j for j in row if j >= 0) + [-1] * (3 - sum(j >= 0 for j in row))
                        for row in bf_local_topk(L, 3, lens)
                    ]
                ),
            ),
        )
        mk(
            out,
            "indexer_topk_pack",
            "valid: rows=0",
            call_with(f, b_kt, scores=torch.zeros(0, 4), lengths=i64([])),
            "valid",
            check=lambda r: diff(r, torch.zeros(0, k, 2)),
        )
        tensor_cases(out, "indexer_topk_pack", f, b_kt, "scores", kind="float", wrong_len=False)
        tensor_cases(out, "indexer_topk_pack", f, b_kt, "lengths", kind="int", optional=True)
        scalar_cases(out, "indexer_topk_pack", f, b_kt, "k", 1)
        flag_cases(out, "indexer_topk_pack", f, b_kt, "validate")
        mk(out, "indexer_topk_pack", "geometry a tuple", call_with(f, b_kt, geometry=(2, 1)), "raise", "geometry")
        mk(out, "indexer_topk_pack", "lengths > cols", call_with(f, b_kt, lengths=i64([11, 8, 4])), "raise", "lengths")
        mk(
            out,
            "indexer_topk_pack",
            "lengths negative",
            call_with(f, b_kt, lengths=i64([1, -1, 4])),
            "raise",
            "lengths",
        )
        mk(
            out,
            "indexer_topk_pack",
            "row_starts + lengths > cols",
            call_with(f, b_kt, row_starts=i64([0, 8, 0]), lengths=i64([1, 3, 1])),
            "raise",
            ("row_starts", "lengths"),
        )
        mk(out, "indexer_topk_pack", "order='x'", call_with(f, b_kt, order="x"), "raise", "order")
        mk(
            out,
            "indexer_topk_pack",
            "out_ids with order='global_id'",
            call_with(f, b_kt, out_ids=torch.empty(3, k, dtype=torch.int32)),
            "raise",
            "out_ids",
        )
        mk(
            out,
            "indexer_topk_pack",
            "out wrong shape",
            call_with(f, b_kt, out=torch.empty(3, k + 1, 2)),
            "raise",
            "out",
        )
        mk(
            out,
            "indexer_topk_pack",
            "out non-contiguous",
            call_with(f, b_kt, out=torch.empty(3, 2, k).transpose(1, 2)),
            "raise",
            "out",
        )
        mk(
            out,
            "indexer_topk_pack",
            "out aliases scores",
            lambda: (lambda s: fk(s, i64(lens), 2, geo, out=s.view(-1)[:12].view(3, 2, 2)))(torch.randn(3, 10)),
            "raise",
            "out",
        )

        def plan_of(dk: int = 0, **knobs: Any) -> From:
            """``plan=``: launch_plan for the base call's shape (``k + dk``), with ``knobs``."""
            return From(lambda kw: kt.launch_plan(*kw["scores"].shape, kw["k"] + dk, kw["scores"].device, **knobs))

        # the launch decisions are launch_plan's arguments (the call takes the plan they make, checked there)
        for label, knobs, nm in (
            ("radix_bits=4", dict(radix_bits=4), "radix_bits"),
            ("tile=24", dict(tile=24), "tile"),
            ("num_warps=3", dict(num_warps=3), "num_warps"),
            ("select='x'", dict(select="x"), "select"),
            ("sample=8", dict(sample=8), "sample"),
            ("pivots=2", dict(pivots=2), "pivots"),
            ("split=0", dict(split=0), "split"),
            ("compact='yes'", dict(compact="yes"), "compact"),
            ("engine='cuda'", dict(engine="cuda"), "engine"),
        ):
            mk(out, "launch_plan", label, lambda knobs=knobs: kt.launch_plan(*L.shape, k, L.device, **knobs), "raise",
               nm)  # fmt: skip
        for label, kw, nm in (
            (
                "workspace wrong dtype",
                dict(plan=plan_of(split=2), workspace=torch.zeros(3, 2, k, 2, dtype=torch.float64)),
                "workspace",
            ),
            ("plan not a LaunchPlan", dict(plan=(256, True, 4, 1)), "plan"),
            ("plan made for another k", dict(plan=plan_of(dk=1)), "plan"),
        ):
            mk(out, "indexer_topk_pack", label, call_with(f, b_kt, **kw), "raise", nm)
        mk(
            out,
            "indexer_topk_pack",
            "validate=False, lengths > cols (documented clamp)",
            call_with(f, b_kt, lengths=i64([40, 8, 4]), validate=False),
            "clamp",
            check=same_pair_sets(want),
        )
        mk(
            out,
            "indexer_topk_pack",
            "validate=False, int64 length 2**32+2 (documented clamp to cols)",
            call_with(f, b_kt, lengths=i64([2**32 + 2, 8, 4]), validate=False),
            "clamp",
            check=same_pair_sets(want),
        )
        mk(
            out,
            "indexer_topk_pack",
            "validate=False, int64 row_start 2**32 (documented clamp to cols: empty row)",
            call_with(f, b_kt, lengths=None, row_starts=i64([2**32, 0, 0]), validate=False),
            "clamp",
            check=same_pair_sets(bf_pack(L, [[-1] * k, *bf_local_topk(L, k)[1:]], 2, 1, 2)),
        )
        mk(
            out,
            "indexer_topk_pack",
            "validate=True, int64 length 2**32+2",
            call_with(f, b_kt, lengths=i64([2**32 + 2, 8, 4])),
            "raise",
            "lengths",
        )

    # ---- pack (reference and Triton)
    ids = [[0, 5, 7, -1], [1, 2, -1, -1], [-1, -1, -1, -1]]

    def b_pack() -> dict[str, Any]:
        return dict(logits=L.clone(), local_topk=i64(ids), geometry=geo)

    for name, fn in (
        ("pack_candidates", pack_candidates),
        ("pack_candidates_triton", pt and pt.pack_candidates_triton),
    ):
        if fn is None:
            mk(out, name, "module unavailable", _skip("dcp_ref.kernels.pack_triton"), "valid")
            continue
        mk(
            out,
            name,
            "valid: brute force (W=2 r=1 I=2)",
            call_with(fn, b_pack),
            "valid",
            check=expect_equal(bf_pack(L, ids, 2, 1, 2)),
        )
        mk(
            out,
            name,
            "valid: row_starts",
            call_with(fn, b_pack, local_topk=i64([[0, 1], [2, -1], [-1, -1]]), row_starts=i32([0, 5, 8])),
            "valid",
            check=expect_equal(bf_pack(L, [[0, 1], [2, -1], [-1, -1]], 2, 1, 2, [0, 5, 8])),
        )
        mk(
            out,
            name,
            "valid: K=0",
            call_with(fn, b_pack, local_topk=torch.zeros(3, 0, dtype=torch.int64)),
            "valid",
            check=expect_equal(torch.zeros(3, 0, 2)),
        )
        mk(
            out,
            name,
            "valid: cols=0 (rank owns no key yet)",
            call_with(fn, b_pack, logits=torch.zeros(3, 0), local_topk=torch.full((3, 2), -1)),
            "valid",
            check=expect_equal(bf_pack(torch.zeros(3, 0), [[-1, -1]] * 3, 2, 1, 2)),
        )
        mk(
            out,
            name,
            "valid: strided local_topk",
            call_with(fn, b_pack, local_topk=strided(i64(ids))),
            "valid",
            check=expect_equal(bf_pack(L, ids, 2, 1, 2)),
        )
        mk(
            out,
            name,
            "valid: NaN score packed as is",
            call_with(fn, b_pack, logits=From(lambda kw: kw["logits"].index_fill(1, i64([5]), NAN))),
            "valid",
            check=lambda r: (
                None
                if math.isnan(float(r[0, 1, 0])) and float(r[0, 1, 1]) == bf_global(5, 2, 1, 2)
                else f"got {r[0, 1].tolist()}"
            ),
        )
        tensor_cases(out, name, fn, b_pack, "logits", kind="float", wrong_len=False)
        tensor_cases(out, name, fn, b_pack, "local_topk", kind="int")
        flag_cases(out, name, fn, b_pack, "validate")
        mk(out, name, "geometry None", call_with(fn, b_pack, geometry=None), "raise", "geometry")
        mk(out, name, "geometry (W, r) tuple", call_with(fn, b_pack, geometry=(2, 1)), "raise", "geometry")
        mk(
            out,
            name,
            "local_topk entry -2",
            call_with(fn, b_pack, local_topk=i64([[0, -2, 1, 1], [0] * 4, [0] * 4])),
            "raise",
            "local_topk",
        )
        mk(
            out,
            name,
            "local_topk entry == cols",
            call_with(fn, b_pack, local_topk=i64([[10, -1, -1, -1]] * 3)),
            "raise",
            "local_topk",
        )
        mk(out, name, "row_starts > cols", call_with(fn, b_pack, row_starts=i64([0, 11, 0])), "raise", "row_starts")
        mk(
            out,
            name,
            "row_starts + index past cols",
            call_with(fn, b_pack, row_starts=i64([6, 0, 0])),
            "raise",
            ("row_starts", "local_topk"),
        )
        mk(out, name, "row_starts float", call_with(fn, b_pack, row_starts=f32([0, 0, 0])), "raise", "row_starts")
        mk(
            out,
            name,
            "global id >= 2**24 (validated: by value)",
            lambda fn=fn: fn(torch.zeros(1, 2**23 + 4), i64([[2**23 + 1]]), DcpGeometry(2, 1)),
            "raise",
            "local_topk",
        )
        mk(
            out,
            name,
            "global id may reach 2**24 (validate=False: from the shape)",
            lambda fn=fn: fn(torch.zeros(1, 2**23 + 4), i64([[0]]), DcpGeometry(2, 1), validate=False),
            "raise",
            "logits",
        )
        mk(
            out,
            name,
            "validate=False, entry past the row (documented: packed invalid)",
            call_with(fn, b_pack, local_topk=i64([[0, 10, 99, -5]] * 3), validate=False),
            "clamp",
            check=expect_equal(bf_pack(L, [[0, -1, -1, -1]] * 3, 2, 1, 2)),
        )
        mk(
            out,
            name,
            "validate=False, int64 entry 2**32+1 (documented: packed invalid)",
            call_with(fn, b_pack, local_topk=i64([[2**32 + 1, 0, -1, -1]] * 3), validate=False),
            "clamp",
            check=expect_equal(bf_pack(L, [[-1, 0, -1, -1]] * 3, 2, 1, 2)),
        )
        mk(
            out,
            name,
            "validate=False, row_start 2**32 (documented clamp to cols: all invalid)",
            call_with(fn, b_pack, row_starts=i64([2**32, 0, 0]), validate=False),
            "clamp",
            check=expect_equal(bf_pack(L, [[-1] * 4, *ids[1:]], 2, 1, 2, [10, 0, 0])),
        )
    if pt is not None:
        f = fp = pt.pack_candidates_triton
        mk(
            out,
            "pack_candidates_triton",
            "out aliases logits",
            lambda: (lambda lg: fp(lg, i64(ids), geo, out=lg.view(-1)[:24].view(3, 4, 2)))(torch.randn(3, 10)),
            "raise",
            "out",
        )
        mk(
            out,
            "pack_candidates_triton",
            "out float64",
            call_with(f, b_pack, out=torch.empty(3, 4, 2, dtype=torch.float64)),
            "raise",
            "out",
        )
        mk(
            out,
            "pack_candidates_triton",
            "out non-contiguous",
            call_with(f, b_pack, out=torch.empty(3, 2, 4).transpose(1, 2)),
            "raise",
            "out",
        )
        for label, v in (("block=3", 3), ("block=0", 0), ("block='256'", "256"), ("block=True", True)):
            mk(out, "pack_candidates_triton", label, call_with(f, b_pack, block=v), "raise", "block")
    return out


def _kernel(name: str) -> Any:
    try:
        import importlib

        return importlib.import_module(f"dcp_ref.kernels.{name}")
    except ImportError:
        return None


def _skip(why: str) -> Callable[[], Any]:
    def thunk() -> Any:
        raise Skip(why)

    return thunk


# ============================================================================================================
# 3. exchange: stable global top-k (select) and merge_topk_global
# ============================================================================================================
def bf_stable_topk(gathered: torch.Tensor, k: int) -> list[list[int]]:
    g = gathered if gathered.ndim == 3 else gathered.permute(1, 0, 2, 3).reshape(gathered.shape[1], -1, 2)
    res = []
    for t in range(g.shape[0]):
        cand = []
        for c in range(g.shape[1]):
            s, i = float(g[t, c, 0]), float(g[t, c, 1])
            if math.isnan(s) or math.isnan(i) or i < 0:
                continue
            cand.append((-(_f32(s) + 0.0), int(i)))
        cand.sort()
        ids = [i for _, i in cand[:k]]
        res.append(ids + [-1] * (k - len(ids)))
    return res


def _gathered() -> torch.Tensor:
    """[W=2, T=3, K=3, 2]: ties, -0.0/+0.0, NaN score, NaN id, -1 id, -inf valid."""
    g = torch.empty(2, 3, 3, 2)
    g[0, 0] = f32([[0.5, 0], [0.5, 6], [0.1, 2]])
    g[1, 0] = f32([[0.5, 3], [0.9, 1], [-INF, 5]])
    g[0, 1] = f32([[-0.0, 4], [NAN, 8], [0.2, -1]])
    g[1, 1] = f32([[0.0, 1], [0.3, NAN], [-INF, 7]])
    g[0, 2] = f32([[NAN, 0], [-INF, -1], [-INF, -1]])
    g[1, 2] = f32([[-INF, -1], [-INF, -1], [-INF, -1]])
    return g


def select_cases() -> list[Case]:
    from dcp_ref import SimulatedWorld, merge_topk_global, pack_candidates, stable_key, stable_topk

    out: list[Case] = []
    G = _gathered()

    def b_st() -> dict[str, Any]:
        return dict(gathered=G.clone(), k=4)

    mk(
        out,
        "stable_topk",
        "valid: ties, -0/+0, NaN score/id, -1, -inf (brute force)",
        call_with(stable_topk, b_st),
        "valid",
        check=expect_equal(i32(bf_stable_topk(G, 4))),
    )
    mk(
        out,
        "stable_topk",
        "valid: k > W*K",
        call_with(stable_topk, b_st, k=9),
        "valid",
        check=expect_equal(i32(bf_stable_topk(G, 9))),
    )
    mk(
        out,
        "stable_topk",
        "valid: [rows, N, 2] form",
        lambda: stable_topk(G.permute(1, 0, 2, 3).reshape(3, 6, 2), 2),
        "valid",
        check=expect_equal(i32(bf_stable_topk(G, 2))),
    )
    mk(
        out,
        "stable_topk",
        "valid: rows=0",
        lambda: stable_topk(torch.zeros(2, 0, 3, 2), 2),
        "valid",
        check=expect_equal(torch.zeros(0, 2, dtype=torch.int32)),
    )
    mk(
        out,
        "stable_topk",
        "valid: K=0 (no candidate)",
        lambda: stable_topk(torch.zeros(2, 3, 0, 2), 2),
        "valid",
        check=expect_equal(torch.full((3, 2), -1, dtype=torch.int32)),
    )
    mk(
        out,
        "stable_topk",
        "valid: sorted=True gives key order",
        call_with(stable_topk, b_st, sorted=True),
        "valid",
        check=expect_equal(i32(bf_stable_topk(G, 4))),
    )
    mk(
        out,
        "stable_topk",
        "valid: W=1",
        lambda: stable_topk(G[:1].clone(), 2),
        "valid",
        check=expect_equal(i32(bf_stable_topk(G[:1], 2))),
    )
    mk(
        out,
        "stable_topk",
        "valid: transposed gathered view",
        lambda: stable_topk(G.transpose(0, 1).contiguous().transpose(0, 1), 4),
        "valid",
        check=expect_equal(i32(bf_stable_topk(G, 4))),
    )
    tensor_cases(out, "stable_topk", stable_topk, b_st, "gathered", kind="float", wrong_len=False, meta=False)
    scalar_cases(out, "stable_topk", stable_topk, b_st, "k", 1)
    flag_cases(out, "stable_topk", stable_topk, b_st, "validate")
    flag_cases(out, "stable_topk", stable_topk, b_st, "sorted")
    mk(
        out,
        "stable_topk",
        "gathered float64",
        call_with(stable_topk, b_st, gathered=From(lambda kw: kw["gathered"].double())),
        "raise",
        "gathered",
    )
    mk(out, "stable_topk", "last dim 3", lambda: stable_topk(torch.zeros(2, 3, 3, 3), 2), "raise", "gathered")
    mk(
        out,
        "stable_topk",
        "id 1.5",
        call_with(
            stable_topk,
            b_st,
            gathered=From(lambda kw: kw["gathered"].index_put_((i64([0]), i64([0]), i64([0]), i64([1])), f32([1.5]))),
        ),
        "raise",
        "gathered",
    )
    mk(
        out,
        "stable_topk",
        "id 2**24",
        call_with(
            stable_topk,
            b_st,
            gathered=From(
                lambda kw: kw["gathered"].index_put_((i64([0]), i64([0]), i64([0]), i64([1])), f32([2.0**24]))
            ),
        ),
        "raise",
        "gathered",
    )
    mk(
        out,
        "stable_topk",
        "id -2",
        call_with(
            stable_topk,
            b_st,
            gathered=From(lambda kw: kw["gathered"].index_put_((i64([0]), i64([0]), i64([0]), i64([1])), f32([-2.0]))),
        ),
        "raise",
        "gathered",
    )
    mk(
        out,
        "stable_topk",
        "duplicate id across ranks",
        call_with(
            stable_topk,
            b_st,
            gathered=From(lambda kw: kw["gathered"].index_put_((i64([1]), i64([0]), i64([0]), i64([1])), f32([6.0]))),
        ),
        "raise",
        "gathered",
    )
    mk(out, "stable_topk", "meta gathered, validate=True", lambda: stable_topk(meta_like(G), 2), "raise", "gathered")
    mk(
        out,
        "stable_topk",
        "valid: meta gathered, validate=False",
        lambda: stable_topk(meta_like(G), 2, validate=False),
        "valid",
        check=lambda r: diff(r, torch.empty(3, 2, device=META)),
    )

    mk(
        out,
        "stable_key",
        "valid: -0.0 and +0.0 give one key",
        lambda: stable_key(f32([-0.0, 0.0]), i64([3, 3])),
        "valid",
        check=lambda r: None if int(r[0]) == int(r[1]) else "different keys",
    )
    mk(
        out,
        "stable_key",
        "valid: order is score desc then id asc",
        lambda: stable_key(f32([1.0, 1.0, 2.0, -1.0, -INF]), i64([5, 2, 9, 0, 1])),
        "valid",
        check=lambda r: (
            None
            if torch.argsort(r, descending=True).tolist() == [2, 1, 0, 3, 4]
            else f"order {torch.argsort(r, descending=True).tolist()}"
        ),
    )
    mk(out, "stable_key", "ids shape mismatch", lambda: stable_key(f32([1.0, 2.0]), i64([1])), "raise", "ids")
    mk(out, "stable_key", "scores int", lambda: stable_key(i64([1, 2]), i64([1, 2])), "raise", "scores")
    mk(out, "stable_key", "ids bool", lambda: stable_key(f32([1.0]), torch.tensor([True])), "raise", "ids")
    mk(
        out,
        "stable_key",
        "ids on meta",
        lambda: stable_key(f32([1.0]), meta_like(i64([1]))),
        "raise",
        ("ids", "scores"),
    )

    # merge_topk_global over W=2 simulated ranks: the union of local top-K, selected as on one device.
    W, I = 2, 1
    full = torch.randn(2, 12, generator=gen(3))
    full[0, 4] = full[0, 7]  # a tie across ranks

    def rank_inputs(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        cols = [p for p in range(12) if bf_owner(p, W, I) == r]
        lg = full[:, cols].contiguous()
        return lg, i64(bf_local_topk(lg, 3))

    def bf_global_topk(k: int) -> list[list[int]]:
        res = []
        for t in range(2):
            cand = sorted((-(_f32(float(full[t, p])) + 0.0), p) for p in range(12))
            res.append([p for _, p in cand[:k]])
        return res

    def run_merge(k: int = 3, mutate: Callable[[int, dict[str, Any]], None] | None = None, group: Any = "world") -> Any:
        def body(g: Any, r: int) -> torch.Tensor:
            lg, lt = rank_inputs(r)
            kw: dict[str, Any] = dict(group=g if group == "world" else group, logits=lg, local_topk=lt, k=k)
            if mutate is not None:
                mutate(r, kw)
            return merge_topk_global(**kw)

        return SimulatedWorld(W, timeout_s=30).run(body, [0, 1])

    mk(
        out,
        "merge_topk_global",
        "valid: W=2 equals the single-device top-k",
        lambda: run_merge(),
        "valid",
        check=lambda rs: first(*(diff(r, i32(bf_global_topk(3))) for r in rs)),
    )
    mk(
        out,
        "merge_topk_global",
        "valid: W=1 (group=None) runs the same checks: NaN-first row",
        lambda: merge_topk_global(None, f32([[NAN, 0.5, 0.7]]), i64([[0, 2, 1]]), 2),
        "valid",
        check=expect_equal(i32([[2, 1]])),
    )
    mk(
        out,
        "merge_topk_global",
        "W=1 still checks ids (entry past cols)",
        lambda: merge_topk_global(None, f32([[0.5, 0.7]]), i64([[0, 5]]), 2),
        "raise",
        "local_topk",
    )
    mk(
        out,
        "merge_topk_global",
        "group not a Group",
        lambda: merge_topk_global("g", full, i64([[0]] * 2), 1),
        "raise",
        "group",
    )  # type: ignore[arg-type]
    mk(out, "merge_topk_global", "k=0", lambda: run_merge(k=0), "raise", "k")
    mk(
        out,
        "merge_topk_global",
        "interleave=0",
        lambda: run_merge(mutate=lambda r, kw: kw.update(interleave=0)),
        "raise",
        "interleave",
    )
    mk(
        out,
        "merge_topk_global",
        "a rank repeats a local index",
        lambda: run_merge(mutate=lambda r, kw: kw.update(local_topk=i64([[0, 0, 1], [0, 1, 2]]))),
        "raise",
        "local_topk",
    )
    mk(
        out,
        "merge_topk_global",
        "ranks disagree on K (collective shape mismatch)",
        lambda: run_merge(mutate=lambda r, kw: kw.update(local_topk=kw["local_topk"][:, : 2 + r])),
        "raise",
        ("local_topk", "x"),
    )
    mk(
        out,
        "merge_topk_global",
        "sorted='yes'",
        lambda: run_merge(mutate=lambda r, kw: kw.update(sorted="yes")),
        "raise",
        "sorted",
    )
    mk(
        out,
        "merge_topk_global",
        "validate=False still never selects NaN",
        lambda: merge_topk_global(None, f32([[NAN, 0.5]]), i64([[0, 1]]), 2, validate=False),
        "valid",
        check=expect_equal(i32([[1, -1]])),
    )
    _ = pack_candidates
    return out


# ============================================================================================================
# 4. deinterleave + compaction (reference and Triton)
# ============================================================================================================
def bf_deinterleave(
    ids: torch.Tensor,
    req: Sequence[int] | None,
    table: torch.Tensor,
    W: int,
    r: int,
    I: int,
    bs: int,
) -> list[list[int]]:
    B, M = table.shape
    res = []
    for t in range(ids.shape[0]):
        b = t if req is None else req[t]
        row = []
        for x in ids[t].tolist():
            if not 0 <= b < B:
                row.append(POISON)
                continue
            if x < 0 or bf_owner(x, W, I) != r:
                row.append(-1)
                continue
            loc = bf_local(x, W, I)
            blk = loc // bs
            if blk >= M or int(table[b, blk]) < 0:
                row.append(POISON)
                continue
            slot = int(table[b, blk]) * bs + loc % bs
            row.append(slot if slot < POISON else POISON)
        res.append(row)
    return res


def bf_compact(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    K = len(rows[0]) if rows else 0
    slots = [[x for x in r if x >= 0] for r in rows]
    return (
        torch.tensor([s + [-1] * (K - len(s)) for s in slots], dtype=torch.int32).reshape(len(rows), K),
        torch.tensor([len(s) for s in slots], dtype=torch.int32),
    )


def sorted_rows(t: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each row's first ``counts`` entries sorted (the set), -1 after: to compare unordered compaction."""
    res = torch.full_like(t, -1)
    for i in range(t.shape[0]):
        c = int(counts[i])
        res[i, :c] = torch.sort(t[i, :c]).values
    return res


def deinterleave_cases() -> list[Case]:
    from dcp_ref import (
        DcpGeometry,
        canonicalize,
        compact_to_front,
        deinterleave_and_compact,
        deinterleave_masked,
        global_ids_to_local_slots,
    )

    dt = _kernel("deinterleave_triton")
    out: list[Case] = []
    W, I, bs = 2, 2, 4
    ids = i64([[0, 3, 6, -1, 9], [9, 2, -1, -1, 1], [1, 7, 12, 5, 13]])
    table = i32([[3, 0, 5], [1, 4, -1]])
    req = [0, 1, 1]

    def bf(
        r: int, ids_: torch.Tensor = ids, req_: Sequence[int] | None = req, tab: torch.Tensor = table
    ) -> list[list[int]]:
        return bf_deinterleave(ids_, req_, tab, W, r, I, bs)

    def b(r: int = 0) -> Callable[[], dict[str, Any]]:
        return lambda: dict(
            token_ids=ids.clone(), req_of_token=i32(req), block_table=table.clone(), geometry=DcpGeometry(W, r, I, bs)
        )

    impls: list[tuple[str, Callable[..., Any] | None, str]] = [
        ("global_ids_to_local_slots", global_ids_to_local_slots, "slots"),
        ("deinterleave_masked", deinterleave_masked, "masked"),
        ("deinterleave_and_compact", deinterleave_and_compact, "compact"),
        ("global_ids_to_local_slots_triton", dt and dt.global_ids_to_local_slots_triton, "slots"),
        ("deinterleave_masked_triton", dt and dt.deinterleave_masked_triton, "masked"),
        ("deinterleave_compact", dt and dt.deinterleave_compact, "compact"),
    ]

    def want_of(kind: str, rows: list[list[int]], K: int = 5) -> Any:
        t = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), len(rows[0]) if rows else K)
        if kind == "slots":
            return t
        if kind == "masked":
            return t, (t >= 0).sum(1, dtype=torch.int32)
        if not rows:
            return t, torch.zeros(0, dtype=torch.int32)
        return bf_compact(rows)

    def poison_rows(
        kind: str, rows: list[int], entries: dict[int, list[int]] | None = None
    ) -> Callable[[Any], str | None]:
        """The rows hold the poison slot (every entry for a bad request, or the given entries), counted."""

        def check(res: Any) -> str | None:
            s = res if kind == "slots" else res[0]
            for t in rows:
                got = s[t].tolist()
                cols = entries.get(t) if entries else None
                if cols is None:
                    if kind == "compact":
                        c = int(res[1][t])
                        if c != s.shape[1] or any(x != POISON for x in got):
                            return f"row {t} not fully poisoned: {got} (count {c})"
                    elif any(x != POISON for x in got):
                        return f"row {t} not fully poisoned: {got}"
                elif kind == "compact":
                    if got.count(POISON) < len(cols):
                        return f"row {t}: {got} holds {got.count(POISON)} poison slots, want {len(cols)}"
                elif any(got[c] != POISON for c in cols):
                    return f"row {t}: entries {cols} of {got} not the poison slot"
            return None

        return check

    for name, fn, kind in impls:
        if fn is None:
            mk(out, name, "module unavailable", _skip("dcp_ref.kernels.deinterleave_triton"), "valid")
            continue
        for r in (0, 1):
            mk(
                out,
                name,
                f"valid: brute force W=2 I=2 bs=4 rank {r}",
                call_with(fn, b(r)),
                "valid",
                check=expect_equal(want_of(kind, bf(r))),
            )
        base = b(1)
        mk(
            out,
            name,
            "valid: req_of_token=None (row t is request t)",
            call_with(fn, base, token_ids=ids[:2].clone(), req_of_token=None),
            "valid",
            check=expect_equal(want_of(kind, bf(1, ids[:2], None))),
        )
        mk(
            out,
            name,
            "valid: T=0",
            call_with(fn, base, token_ids=torch.zeros(0, 5, dtype=torch.int64), req_of_token=i32([])),
            "valid",
            check=expect_equal(want_of(kind, [])),
        )
        mk(
            out,
            name,
            "valid: a table with 0 columns, no id owned here",
            call_with(
                fn,
                base,
                token_ids=i64([[0, 1, -1]]),
                req_of_token=i32([0]),
                block_table=torch.zeros(1, 0, dtype=torch.int32),
            ),
            "valid",
            check=expect_equal(want_of(kind, [[-1, -1, -1]])),
        )
        mk(
            out,
            name,
            "valid: int64 ids and int64 table",
            call_with(fn, base, block_table=table.long()),
            "valid",
            check=expect_equal(want_of(kind, bf(1))),
        )
        mk(
            out,
            name,
            "valid: transposed block_table view",
            call_with(fn, base, block_table=transposed(table)),
            "either",
            names=("block_table",),
            check=expect_equal(want_of(kind, bf(1))),
        )
        mk(
            out,
            name,
            "valid: expanded (stride-0) block_table rows",
            call_with(fn, base, block_table=table[:1].expand(2, 3), req_of_token=i32([0, 1, 1])),
            "either",
            names=("block_table",),
            check=expect_equal(want_of(kind, bf(1, tab=table[:1].expand(2, 3).contiguous()))),
        )
        mk(
            out,
            name,
            "valid: strided token_ids",
            call_with(fn, base, token_ids=strided(ids)),
            "either",
            names=("token_ids",),
            check=expect_equal(want_of(kind, bf(1))),
        )
        tensor_cases(out, name, fn, base, "token_ids", kind="int", wrong_len=False)
        tensor_cases(out, name, fn, base, "req_of_token", kind="int", optional=True)
        tensor_cases(out, name, fn, base, "block_table", kind="int", wrong_len=False)
        flag_cases(out, name, fn, base, "validate")
        mk(out, name, "geometry a tuple", call_with(fn, base, geometry=(2, 1, 2, 4)), "raise", "geometry")
        mk(
            out,
            name,
            "req_of_token out of range",
            call_with(fn, base, req_of_token=i32([0, 2, 1])),
            "raise",
            "req_of_token",
        )
        mk(
            out,
            name,
            "req_of_token negative",
            call_with(fn, base, req_of_token=i32([0, -1, 1])),
            "raise",
            "req_of_token",
        )
        mk(
            out,
            name,
            "req_of_token=None with T > B",
            call_with(fn, base, req_of_token=None),
            "raise",
            ("req_of_token", "block_table"),
        )
        mk(
            out,
            name,
            "owned id whose block entry is -1",
            call_with(fn, base, token_ids=i64([[18, -1, -1, -1, -1]] * 3)),
            "raise",
            "block_table",
        )
        mk(
            out,
            name,
            "owned id past the table",
            call_with(fn, base, token_ids=i64([[30, -1, -1, -1, -1]] * 3)),
            "raise",
            "block_table",
        )
        mk(
            out,
            name,
            "block id whose slot exceeds int32",
            call_with(fn, base, block_table=i64([[3, 0, 5], [2**29, 4, -1]])),
            "raise",
            "block_table",
        )
        mk(
            out,
            name,
            "meta token_ids, validate=True",
            lambda fn=fn: fn(meta_like(ids), meta_like(i32(req)), meta_like(table), DcpGeometry(W, 1, I, bs)),
            "raise",
            ("token_ids", "req_of_token", "block_table"),
        )
        # validate=False: out-of-contract metadata is poisoned (CONTRIBUTING: the poison slot, counted)
        mk(
            out,
            name,
            "validate=False, request id out of range -> whole row poisoned",
            call_with(fn, base, req_of_token=i32([0, 2, 1]), validate=False),
            "poison",
            check=poison_rows(kind, [1]),
        )
        mk(
            out,
            name,
            "validate=False, int64 request id 2**32 -> whole row poisoned",
            call_with(fn, base, req_of_token=i64([0, 2**32, 1]), validate=False),
            "poison",
            check=poison_rows(kind, [1]),
        )
        mk(
            out,
            name,
            "validate=False, negative request id -> whole row poisoned",
            call_with(fn, base, req_of_token=i64([-1, 1, 1]), validate=False),
            "poison",
            check=poison_rows(kind, [0]),
        )
        mk(
            out,
            name,
            "validate=False, owned id with a -1 block -> poison slot",
            call_with(fn, base, token_ids=i64([[18, -1, -1, -1, -1], [2, 18, -1, -1, -1], [-1] * 5]), validate=False),
            "poison",
            check=poison_rows(kind, [1], {1: [1]}),
        )
        mk(
            out,
            name,
            "validate=False, owned id past the table -> poison slot",
            call_with(fn, base, token_ids=i64([[30, -1, -1, -1, -1]] * 3), validate=False),
            "poison",
            check=poison_rows(kind, [0, 1, 2], {0: [0], 1: [0], 2: [0]}),
        )
        mk(
            out,
            name,
            "validate=False, int64 owned id 2**32+3 (past the table) -> poison slot",
            call_with(fn, base, token_ids=i64([[2**32 + 3, -1, -1, -1, -1]] * 3), validate=False),
            "poison",
            check=poison_rows(kind, [0, 1, 2], {0: [0], 1: [0], 2: [0]}),
        )
        mk(
            out,
            name,
            "validate=False, int64 block id 2**32 -> poison slot",
            call_with(
                fn,
                base,
                block_table=i64([[3, 0, 5], [2**32, 4, -1]]),
                token_ids=i64([[2, -1, -1, -1, -1]] * 3),
                validate=False,
            ),
            "poison",
            check=poison_rows(kind, [1, 2], {1: [0], 2: [0]}),
        )
        mk(
            out,
            name,
            "validate=False, block id 2**29 (slot > int32) -> poison slot",
            call_with(
                fn,
                base,
                block_table=i64([[3, 0, 5], [2**29, 4, -1]]),
                token_ids=i64([[2, -1, -1, -1, -1]] * 3),
                validate=False,
            ),
            "poison",
            check=poison_rows(kind, [1, 2], {1: [0], 2: [0]}),
        )

    if dt is not None:
        for name, fn, kind in impls[3:]:
            assert fn is not None
            base = b(1)
            if kind == "slots":
                bufs = ("out",)
            else:
                bufs = ("out", "counts")
            mk(
                out,
                name,
                "out aliases token_ids (int32 view)",
                lambda fn=fn: (lambda t: fn(t, i32(req), table, DcpGeometry(W, 1, I, bs), out=t))(ids.int()),
                "raise",
                "out",
            )
            mk(out, name, "out int64", call_with(fn, base, out=torch.empty(3, 5, dtype=torch.int64)), "raise", "out")
            mk(
                out,
                name,
                "out wrong shape",
                call_with(fn, base, out=torch.empty(3, 4, dtype=torch.int32)),
                "raise",
                "out",
            )
            mk(
                out,
                name,
                "out expanded (stride-0) view",
                call_with(fn, base, out=torch.empty(1, 5, dtype=torch.int32).expand(3, 5)),
                "either",
                "out",
                check=expect_equal(want_of(kind, bf(1))),
            )
            mk(
                out,
                name,
                "valid: transposed out buffer",
                call_with(fn, base, out=torch.empty(5, 3, dtype=torch.int32).t()),
                "either",
                "out",
                check=expect_equal(want_of(kind, bf(1))),
            )
            if "counts" in bufs:
                mk(
                    out,
                    name,
                    "counts aliases out",
                    lambda fn=fn: (lambda o: fn(ids, i32(req), table, DcpGeometry(W, 1, I, bs), out=o, counts=o[:, 0]))(
                        torch.empty(3, 5, dtype=torch.int32)
                    ),
                    "raise",
                    ("counts", "out"),
                )
                mk(
                    out,
                    name,
                    "counts aliases req_of_token",
                    lambda fn=fn: (lambda q: fn(ids, q, table, DcpGeometry(W, 1, I, bs), counts=q))(i32(req)),
                    "raise",
                    ("counts", "req_of_token"),
                )
                mk(out, name, "counts float", call_with(fn, base, counts=torch.empty(3)), "raise", "counts")
            for label, kw, nm in (
                ("block=3", dict(block=3), "block"),
                ("block=0", dict(block=0), "block"),
                ("num_warps=3", dict(num_warps=3), "num_warps"),
                ("num_warps=True", dict(num_warps=True), "num_warps"),
            ):
                mk(out, name, label, call_with(fn, base, **kw), "raise", nm)
        fn = dt.deinterleave_compact
        base = b(1)
        for method in ("rowscan", "twopass"):
            mk(
                out,
                "deinterleave_compact",
                f"valid: method={method} brute force",
                call_with(fn, base, method=method),
                "valid",
                check=expect_equal(bf_compact(bf(1))),
            )
        mk(
            out,
            "deinterleave_compact",
            "valid: unordered atomic (compare as sets)",
            call_with(fn, base, method="atomic", ordered=False),
            "valid",
            check=lambda r: diff((sorted_rows(*r), r[1]), (sorted_rows(*bf_compact(bf(1))), bf_compact(bf(1))[1])),
        )
        mk(out, "deinterleave_compact", "method='x'", call_with(fn, base, method="x"), "raise", "method")
        mk(
            out,
            "deinterleave_compact",
            "method='atomic' with ordered=True",
            call_with(fn, base, method="atomic"),
            "raise",
            ("method", "ordered"),
        )
        mk(out, "deinterleave_compact", "ordered='yes'", call_with(fn, base, ordered="yes"), "raise", "ordered")
        mk(
            out,
            "deinterleave_compact",
            "workspace too small (twopass)",
            call_with(fn, base, method="twopass", workspace=torch.zeros(1, dtype=torch.int64)),
            "raise",
            "workspace",
        )
        mk(
            out,
            "deinterleave_compact",
            "workspace float",
            call_with(fn, base, method="twopass", workspace=torch.zeros(64)),
            "raise",
            "workspace",
        )
        mk(
            out,
            "deinterleave_compact",
            "workspace aliases out",
            lambda: (
                lambda ws: fn(
                    ids,
                    i32(req),
                    table,
                    DcpGeometry(W, 1, I, bs),
                    method="twopass",
                    workspace=ws,
                    out=ws[:15].view(torch.int32).view(3, 10)[:, :5],
                )
            )(torch.zeros(4096, dtype=torch.int64)),
            "raise",
            ("workspace", "out"),
        )

    # compact_to_front / canonicalize
    sl = i32([[5, -1, 2, -1, 9], [-1, -1, -1, -1, -1], [POISON, 0, -1, 7, 1]])
    mk(
        out,
        "compact_to_front",
        "valid: ordered brute force (poison slot kept)",
        lambda: compact_to_front(sl),
        "valid",
        check=expect_equal(bf_compact(sl.tolist())),
    )
    mk(
        out,
        "compact_to_front",
        "valid: unordered gives the canonical set",
        lambda: compact_to_front(sl, ordered=False),
        "valid",
        check=lambda r: diff(r, (sorted_rows(*bf_compact(sl.tolist())), bf_compact(sl.tolist())[1])),
    )
    mk(
        out,
        "compact_to_front",
        "valid: K=0",
        lambda: compact_to_front(torch.zeros(2, 0, dtype=torch.int32)),
        "valid",
        check=expect_equal((torch.zeros(2, 0, dtype=torch.int32), i32([0, 0]))),
    )
    mk(
        out,
        "compact_to_front",
        "int64 slot above int32",
        lambda: compact_to_front(i64([[2**31 + 5, 1]])),
        "raise",
        "slots",
    )
    mk(
        out,
        "compact_to_front",
        "validate=False, int64 slot above int32 saturates to the poison slot",
        lambda: compact_to_front(i64([[2**31 + 5, 1]]), validate=False),
        "poison",
        check=expect_equal((i32([[POISON, 1]]), i32([2]))),
    )
    mk(out, "compact_to_front", "slots float", lambda: compact_to_front(f32([[1.0]])), "raise", "slots")
    mk(out, "compact_to_front", "slots 1-D", lambda: compact_to_front(i32([1, 2])), "raise", "slots")
    mk(out, "compact_to_front", "ordered=1", lambda: compact_to_front(sl, ordered=1), "raise", "ordered")  # type: ignore[arg-type]
    mk(
        out,
        "compact_to_front",
        "ordered positional (keyword-only)",
        lambda: compact_to_front(sl, True),
        "raise",
        ("ordered", "positional"),
    )  # type: ignore[misc]
    mk(
        out,
        "canonicalize",
        "valid: sorted valid prefix",
        lambda: canonicalize(i32([[9, 2, -1], [4, -1, -1]]), i32([2, 1])),
        "valid",
        check=expect_equal(i32([[2, 9, -1], [4, -1, -1]])),
    )
    mk(
        out,
        "canonicalize",
        "counts wrong length",
        lambda: canonicalize(i32([[9, 2, -1]]), i32([2, 1])),
        "raise",
        "counts",
    )
    mk(out, "canonicalize", "counts > K", lambda: canonicalize(i32([[9, 2, -1]]), i32([4])), "raise", "counts")
    mk(out, "canonicalize", "counts negative", lambda: canonicalize(i32([[9, 2, -1]]), i32([-1])), "raise", "counts")
    mk(out, "canonicalize", "counts float", lambda: canonicalize(i32([[9, 2, -1]]), f32([1.0])), "raise", "counts")
    return out


# ============================================================================================================
# 5. select_to_slots (the owner-local exchange)
# ============================================================================================================
def bf_select_to_slots(
    gathered: torch.Tensor,
    own_ids: torch.Tensor | None,
    req: Sequence[int] | None,
    table: torch.Tensor,
    W: int,
    r: int,
    I: int,
    bs: int,
    k: int,
    order: str = "global_id",
) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = gathered.shape[1], gathered.shape[2]
    B, M = table.shape
    slots = torch.full((T, k), -1, dtype=torch.int32)
    counts = torch.zeros(T, dtype=torch.int32)
    for t in range(T):
        cand = []
        for w in range(W):
            for c in range(K):
                if order == "global_id":
                    s, i = float(gathered[w, t, c, 0]), float(gathered[w, t, c, 1])
                    if math.isnan(s) or math.isnan(i) or i < 0:
                        continue
                    cand.append((-(_f32(s) + 0.0), int(i), w, c))
                else:
                    s = float(gathered[w, t, c])
                    if math.isnan(s):
                        continue
                    cand.append((-(_f32(s) + 0.0), w * K + c, w, c))
        cand.sort()
        mine = []
        for _, tie, w, c in cand[:k]:
            if order == "global_id":
                if bf_owner(tie, W, I) != r:
                    continue
                loc = bf_local(tie, W, I)
            else:
                if w != r:
                    continue
                assert own_ids is not None
                loc = int(own_ids[t, c])
            b = t if req is None else req[t]
            if not 0 <= b < B or loc < 0 or loc // bs >= M or int(table[b, loc // bs]) < 0:
                mine.append(POISON)
                continue
            slot = int(table[b, loc // bs]) * bs + loc % bs
            mine.append(min(slot, POISON))
        slots[t, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        counts[t] = len(mine)
    return slots, counts


def select_to_slots_cases() -> list[Case]:
    from dcp_ref import DcpGeometry, select_to_slots
    from dcp_ref.stages import reference_select_to_slots

    out: list[Case] = []
    W, I, bs, k = 2, 1, 2, 3
    G = _gathered()  # ids 0..8 over W=2, I=1: even ids on rank 0
    # ids must be owned by the rank that packed them: rewrite rank 1's ids to odd, rank 0's to even
    G[0, 0, :, 1] = f32([0, 6, 2])
    G[1, 0, :, 1] = f32([3, 1, 5])
    G[0, 1, :, 1] = f32([4, 8, -1])
    G[1, 1, :, 1] = f32([1, NAN, 7])
    table = i32([[0, 3, 1, 4, 2], [5, 9, 6, 7, 8]])
    req = [0, 1, 1]

    def b(r: int, order: str = "global_id") -> Callable[[], dict[str, Any]]:
        def base() -> dict[str, Any]:
            kw: dict[str, Any] = dict(
                gathered=G.clone(),
                req_of_token=i32(req),
                block_table=table.clone(),
                geometry=DcpGeometry(W, r, I, bs),
                k=k,
            )
            if order == "rank_local":
                kw.update(gathered=RL.clone(), order="rank_local", own_ids=OWN[r].clone())
            return kw

        return base

    # the rank-local form of the same problem: scores in ascending local index per rank, own ids alongside
    RL = torch.full((2, 3, 3), NAN)
    OWN = [torch.full((3, 3), -1, dtype=torch.int32) for _ in range(2)]
    for t in range(3):
        for w in range(2):
            pairs = sorted(
                (bf_local(int(G[w, t, c, 1]), W, I), float(G[w, t, c, 0]))
                for c in range(3)
                if not math.isnan(float(G[w, t, c, 1])) and G[w, t, c, 1] >= 0 and not math.isnan(float(G[w, t, c, 0]))
            )
            for c, (loc, s) in enumerate(pairs):
                RL[w, t, c] = s
                OWN[w][t, c] = loc

    for r in (0, 1):
        mk(
            out,
            "select_to_slots",
            f"valid: global_id brute force rank {r}",
            call_with(select_to_slots, b(r)),
            "valid",
            check=expect_equal(bf_select_to_slots(G, None, req, table, W, r, I, bs, k)),
        )
        mk(
            out,
            "select_to_slots",
            f"valid: rank_local brute force rank {r}",
            call_with(select_to_slots, b(r, "rank_local")),
            "valid",
            check=expect_equal(bf_select_to_slots(RL, OWN[r], req, table, W, r, I, bs, k, "rank_local")),
        )
    mk(
        out,
        "select_to_slots",
        "valid: union over ranks is the global top-k, nothing twice",
        lambda: [select_to_slots(**b(r)()) for r in (0, 1)],
        "valid",
        check=lambda rs: first(
            *(diff(x, bf_select_to_slots(G, None, req, table, W, r, I, bs, k)) for r, x in enumerate(rs))
        ),
    )
    base = b(1)
    mk(
        out,
        "select_to_slots",
        "valid: k > W*K",
        call_with(select_to_slots, base, k=8),
        "valid",
        check=expect_equal(bf_select_to_slots(G, None, req, table, W, 1, I, bs, 8)),
    )
    mk(
        out,
        "select_to_slots",
        "valid: req_of_token=None",
        call_with(select_to_slots, base, gathered=G[:, :2].clone(), req_of_token=None),
        "valid",
        check=expect_equal(bf_select_to_slots(G[:, :2], None, None, table, W, 1, I, bs, k)),
    )
    mk(
        out,
        "select_to_slots",
        "valid: T=0",
        call_with(select_to_slots, base, gathered=torch.zeros(2, 0, 3, 2), req_of_token=i32([])),
        "valid",
        check=expect_equal((torch.zeros(0, k, dtype=torch.int32), i32([]))),
    )
    mk(
        out,
        "select_to_slots",
        "valid: out buffers written and returned",
        call_with(
            select_to_slots,
            base,
            out_slots=torch.full((3, k), 7, dtype=torch.int32),
            out_counts=torch.full((3,), 9, dtype=torch.int32),
        ),
        "valid",
        check=expect_equal(bf_select_to_slots(G, None, req, table, W, 1, I, bs, k)),
    )
    tensor_cases(out, "select_to_slots", select_to_slots, base, "gathered", kind="float", wrong_len=False, meta=False)
    tensor_cases(out, "select_to_slots", select_to_slots, base, "req_of_token", kind="int", optional=True)
    tensor_cases(out, "select_to_slots", select_to_slots, base, "block_table", kind="int", wrong_len=False)
    scalar_cases(out, "select_to_slots", select_to_slots, base, "k", 1)
    flag_cases(out, "select_to_slots", select_to_slots, base, "validate")
    for label, kw, nm in (
        ("order='x'", dict(order="x"), "order"),
        ("order=None", dict(order=None), "order"),
        ("geometry a tuple", dict(geometry=(2, 1)), "geometry"),
        (
            "geometry W=3 (gathered holds 2 ranks)",
            dict(geometry=DcpGeometry(3, 1, I, bs)),
            ("gathered", "geometry", "world_size"),
        ),
        ("own_ids given with order='global_id'", dict(own_ids=OWN[1]), "own_ids"),
        ("last dim 3", dict(gathered=torch.zeros(2, 3, 3, 3)), "gathered"),
        ("gathered 3-D for global_id", dict(gathered=RL.clone()), "gathered"),
        (
            "id 2.5",
            dict(
                gathered=From(
                    lambda kw: kw["gathered"].index_put_((i64([1]), i64([0]), i64([0]), i64([1])), f32([2.5]))
                )
            ),
            "gathered",
        ),
        (
            "duplicate id across ranks",
            dict(
                gathered=From(
                    lambda kw: kw["gathered"].index_put_((i64([1]), i64([0]), i64([0]), i64([1])), f32([6.0]))
                )
            ),
            "gathered",
        ),
        ("request id out of range", dict(req_of_token=i32([0, 2, 1])), "req_of_token"),
        ("request id negative", dict(req_of_token=i32([-1, 1, 1])), "req_of_token"),
        (
            "a winner of this rank has a -1 block",
            dict(block_table=i32([[0, 3, 1, 4, 2], [5, -1, 6, 7, 8]])),
            "block_table",
        ),
        ("a winner of this rank is past the table", dict(block_table=i32([[0], [5]])), "block_table"),
        (
            "block id with slots beyond int32",
            dict(block_table=i64([[2**30, 3, 1, 4, 2], [5, 6, 6, 7, 8]])),
            "block_table",
        ),
        ("out_slots int64", dict(out_slots=torch.empty(3, k, dtype=torch.int64)), "out_slots"),
        ("out_slots wrong shape", dict(out_slots=torch.empty(3, k + 1, dtype=torch.int32)), "out_slots"),
        ("out_counts wrong shape", dict(out_counts=torch.empty(4, dtype=torch.int32)), "out_counts"),
        ("out_counts float", dict(out_counts=torch.empty(3)), "out_counts"),
    ):
        mk(out, "select_to_slots", label, call_with(select_to_slots, base, **kw), "raise", nm)
    mk(
        out,
        "select_to_slots",
        "out_counts aliases out_slots",
        lambda: (lambda o: select_to_slots(**{**b(1)(), "out_slots": o[:, :k], "out_counts": o[:, 1]}))(
            torch.empty(3, k + 1, dtype=torch.int32)
        ),
        "raise",
        ("out_counts", "out_slots"),
    )
    mk(
        out,
        "select_to_slots",
        "out_slots aliases block_table",
        lambda: (lambda tb: select_to_slots(**{**b(1)(), "block_table": tb, "out_slots": tb.view(-1)[:9].view(3, 3)}))(
            torch.arange(100, dtype=torch.int32).view(2, 50)
        ),
        "raise",
        ("out_slots", "block_table"),
    )
    rl = b(1, "rank_local")
    for label, kw, nm in (
        ("own_ids missing", dict(own_ids=None), "own_ids"),
        ("own_ids int64", dict(own_ids=From(lambda kw: kw["own_ids"].long())), "own_ids"),
        ("own_ids wrong shape", dict(own_ids=From(lambda kw: kw["own_ids"][:, :2])), "own_ids"),
        ("own_ids not ascending", dict(own_ids=From(lambda kw: kw["own_ids"].flip(1).contiguous())), "own_ids"),
        (
            "own_ids -1 under a real score",
            dict(own_ids=From(lambda kw: kw["own_ids"].index_fill(1, i64([0]), -1))),
            "own_ids",
        ),
        (
            "own_ids entry -2",
            dict(own_ids=From(lambda kw: kw["own_ids"].masked_fill(kw["own_ids"] < 0, -2))),
            "own_ids",
        ),
        ("gathered 4-D for rank_local", dict(gathered=G.clone()), "gathered"),
        ("own_ids on meta", dict(own_ids=From(lambda kw: meta_like(kw["own_ids"]))), ("own_ids", "gathered")),
    ):
        mk(out, "select_to_slots", f"rank_local: {label}", call_with(select_to_slots, rl, **kw), "raise", nm)
    # validate=False: winners owned here with out-of-contract metadata get the poison slot, counted
    for label, kw, args in (
        ("request id out of range", dict(req_of_token=i32([0, 2, 1])), dict(req=[0, 2, 1])),
        ("int64 request id 2**32", dict(req_of_token=i64([0, 2**32, 1])), dict(req=[0, 2**32, 1])),
        (
            "a winner's block is -1",
            dict(block_table=i32([[0, 3, 1, 4, 2], [5, -1, 6, 7, 8]])),
            dict(table=i32([[0, 3, 1, 4, 2], [5, -1, 6, 7, 8]])),
        ),
        ("a winner past the table", dict(block_table=i32([[0], [5]])), dict(table=i32([[0], [5]]))),
        (
            "int64 block id 2**31 (slot beyond int32)",
            dict(block_table=i64([[2**31, 3, 1, 4, 2], [2**31, 6, 6, 7, 8]])),
            dict(table=i64([[2**31, 3, 1, 4, 2], [2**31, 6, 6, 7, 8]])),
        ),
    ):
        want = bf_select_to_slots(G, None, args.get("req", req), args.get("table", table), W, 1, I, bs, k)
        mk(
            out,
            "select_to_slots",
            f"validate=False, {label} -> poison slot",
            call_with(select_to_slots, base, validate=False, **kw),
            "poison",
            check=expect_equal(want),
        )
    bad_own = OWN[1].index_fill(1, i64([0]), -1)
    mk(
        out,
        "select_to_slots",
        "validate=False, rank_local own_ids -1 under a winner -> poison slot",
        call_with(select_to_slots, rl, own_ids=bad_own.clone(), validate=False),
        "poison",
        check=expect_equal(bf_select_to_slots(RL, bad_own, req, table, W, 1, I, bs, k, "rank_local")),
    )
    mk(
        out,
        "reference_select_to_slots",
        "valid: the stage form (validate=False) on good inputs",
        lambda: reference_select_to_slots(G.clone(), None, i32(req), table, DcpGeometry(W, 1, I, bs), k),
        "valid",
        check=expect_equal(bf_select_to_slots(G, None, req, table, W, 1, I, bs, k)),
    )
    mk(
        out,
        "reference_select_to_slots",
        "request id out of range -> poison slot",
        lambda: reference_select_to_slots(G.clone(), None, i32([0, 5, 1]), table, DcpGeometry(W, 1, I, bs), k),
        "poison",
        check=expect_equal(bf_select_to_slots(G, None, [0, 5, 1], table, W, 1, I, bs, k)),
    )
    mk(
        out,
        "reference_select_to_slots",
        "order='x'",
        lambda: reference_select_to_slots(G, None, i32(req), table, DcpGeometry(W, 1, I, bs), k, order="x"),
        "raise",
        "order",
    )
    mk(out, "select_to_slots_cutedsl", "CuTeDSL kernel", _skip("needs nvidia-cutlass-dsl and CUDA"), "valid")
    return out


# ============================================================================================================
# 6. scoring (the lightning indexer's FP8 index scores) and the index-key cache / quantizers
# ============================================================================================================
SC_BS, SC_NB, SC_H, SC_D = 4, 6, 4, 128


def sc_cache(unwritten: Sequence[int] = (9,)) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, float]]]:
    """A uint8 ``[6, 4 * 132]`` index-key cache written byte by byte here (values then scales per block); slot
    ``s`` holds small-integer e4m3 values and a power-of-two scale; ``unwritten`` slots keep 0xFF (NaN)."""
    cache = torch.full((SC_NB, SC_BS * 132), 0xFF, dtype=torch.uint8)
    keys = {}
    g = gen(11)
    for s in range(SC_NB * SC_BS):
        if s in unwritten:
            continue
        b, o = divmod(s, SC_BS)
        vals = torch.randint(-4, 5, (SC_D,), generator=g).to(torch.float32)
        scale = 2.0 ** int(torch.randint(-2, 3, (1,), generator=g))
        cache[b, o * SC_D : (o + 1) * SC_D] = vals.to(torch.float8_e4m3fn).view(torch.uint8)
        cache[b, SC_BS * SC_D + 4 * o : SC_BS * SC_D + 4 * o + 4] = f32([scale]).view(torch.uint8)
        keys[s] = (vals.double(), scale)
    return cache, keys


def sc_inputs(T: int = 3) -> dict[str, Any]:
    from dcp_ref import DcpGeometry

    g = gen(12)
    cache, _ = sc_cache()
    q = torch.randint(-3, 4, (T, SC_H, SC_D), generator=g).to(torch.float32)
    return dict(
        index_q=q.to(torch.float8_e4m3fn),
        weights=torch.randn(T, SC_H, generator=g),
        index_cache=cache,
        block_table=i32([[3, 0, -1], [5, 1, 2]]),
        req_of_token=i32([0, 1, 1][:T]),
        local_bounds=i64([6, 9, 0][:T]),
        geometry=DcpGeometry(2, 1, 2, SC_BS),
    )


def sc_group(rows: slice, req: list[int], bounds: list[int]) -> dict[str, Any]:
    """Overrides of sc_inputs: two of its tokens (rows) as one next_n=2 group, out 2 x 16."""
    return dict(
        index_q=From(lambda kw: kw["index_q"][rows]),
        weights=From(lambda kw: kw["weights"][rows]),
        req_of_token=i32(req),
        local_bounds=i64(bounds),
        out=torch.empty(2, 16),
        next_n=2,
    )


def bf_scores(kw: dict[str, Any], L: int, unwritten: Sequence[int] = (9,)) -> torch.Tensor:
    """The scoring contract in float64: the formula inside each row's window, -inf outside, NaN for a row out of
    contract (module docstring of dcp_ref.scoring)."""
    _, keys = sc_cache(unwritten)
    q = kw["index_q"].to(torch.float64)
    w = kw["weights"].to(torch.float64)
    table = kw["block_table"]
    B, M = table.shape
    T = q.shape[0]
    starts = kw.get("row_starts")
    nn = kw.get("next_n", 1)
    res = torch.full((T, L), -INF, dtype=torch.float64)
    req = [int(x) for x in kw["req_of_token"]]
    for t in range(T):
        b, n = req[t], int(kw["local_bounds"][t])
        s = 0 if starts is None else int(starts[t])
        grp = req[(t // nn) * nn : (t // nn) * nn + nn]
        bad = not 0 <= b < B or n < 0 or s < 0 or s + n > L or -(-n // SC_BS) > M or len(set(grp)) > 1
        if not bad:
            bad = any(int(table[b, j]) < 0 or int(table[b, j]) >= SC_NB for j in range(-(-n // SC_BS)))
        if bad:
            res[t] = NAN
            continue
        for j in range(n):
            slot = int(table[b, j // SC_BS]) * SC_BS + j % SC_BS
            if slot not in keys:
                res[t, s + j] = NAN
                continue
            vals, scale = keys[slot]
            dots = q[t] @ vals
            relu = torch.where(dots < 0, 0.0, dots)
            res[t, s + j] = float((w[t] * relu).sum()) * scale
    return res.to(torch.float32)


def scoring_cases() -> list[Case]:
    from dcp_ref import DcpGeometry
    from dcp_ref.scoring import index_scores, reference_scoring

    st = _kernel("scoring_triton")
    out: list[Case] = []
    tol = dict(rtol=2e-5, atol=1e-3)
    impls: list[tuple[str, Any, bool]] = [
        ("index_scores", index_scores, True),
        ("reference_scoring", reference_scoring, False),
        ("index_scores_triton", st and st.index_scores_triton, True),
    ]
    for name, fn, has_validate in impls:
        if fn is None:
            mk(out, name, "module unavailable", _skip("dcp_ref.kernels.scoring_triton"), "valid")
            continue
        val = dict(validate=False) if has_validate else {}
        L = 12  # M * bs: the width of a decode call without out

        def base(fn: Any = fn) -> dict[str, Any]:
            return dict(sc_inputs(), out=torch.empty(3, 16))

        def want(**kw: Any) -> torch.Tensor:
            return bf_scores({**base(), **kw}, kw.pop("L", 16) if "L" in kw else 16)

        mk(
            out,
            name,
            "valid: brute force (decode, out 16 wide)",
            call_with(fn, base),
            "valid",
            check=expect_equal(bf_scores(base(), 16), **tol),
        )
        if has_validate:
            mk(
                out,
                name,
                "valid: width from the values without out (validated)",
                call_with(fn, base, out=None),
                "valid",
                check=expect_equal(bf_scores(base(), 9), **tol),
            )
            mk(
                out,
                name,
                "valid: validate=False without out is M*bs wide",
                call_with(fn, base, out=None, validate=False),
                "valid",
                check=expect_equal(bf_scores(base(), L), **tol),
            )
        nw = base()["weights"].clone()
        nw[0, 1] = NAN
        for desc, kw in (
            ("valid: prefill row_starts", dict(row_starts=i64([0, 6, 2]))),
            ("valid: an unwritten slot scores NaN in its column only", dict(local_bounds=i64([6, 10, 0]))),
            ("valid: a NaN weight makes that token's scores NaN (data propagates)", dict(weights=nw)),
        ):
            mk(
                out,
                name,
                desc,
                call_with(fn, base, **kw),
                "valid",
                check=expect_equal(bf_scores({**base(), **kw}, 16), **tol),
            )
        mk(
            out,
            name,
            "valid: next_n=2 groups of one request",
            call_with(fn, base, **sc_group(slice(1, None), [1, 1], [8, 9])),
            "valid",
            check=expect_equal(
                bf_scores(
                    {
                        **sc_inputs(),
                        "index_q": sc_inputs()["index_q"][1:],
                        "weights": sc_inputs()["weights"][1:],
                        "req_of_token": i32([1, 1]),
                        "local_bounds": i64([8, 9]),
                        "next_n": 2,
                    },
                    16,
                ),
                **tol,
            ),
        )
        mk(
            out,
            name,
            "valid: T=0",
            call_with(
                fn,
                base,
                index_q=From(lambda kw: kw["index_q"][:0]),
                weights=From(lambda kw: kw["weights"][:0]),
                req_of_token=i32([]),
                local_bounds=i64([]),
                out=torch.empty(0, 16),
            ),
            "valid",
            check=expect_equal(torch.empty(0, 16)),
        )
        for desc, kw, expect, nm in (
            (
                "valid: index cache as vLLM's [nb, bs, 132] view",
                dict(index_cache=From(lambda kw: kw["index_cache"].view(SC_NB, SC_BS, 132))),
                "valid",
                (),
            ),
            ("valid: strided weights view", dict(weights=From(lambda kw: strided(kw["weights"]))), "either", "weights"),
            (
                "valid: transposed block_table view",
                dict(block_table=From(lambda kw: transposed(kw["block_table"]))),
                "either",
                "block_table",
            ),
        ):
            mk(out, name, desc, call_with(fn, base, **kw), expect, nm, check=expect_equal(bf_scores(base(), 16), **tol))
        # ---- bad arguments (always checked)
        tensor_cases(out, name, fn, base, "index_q", kind="float", wrong_len=False)
        tensor_cases(out, name, fn, base, "weights", kind="float")
        tensor_cases(out, name, fn, base, "block_table", kind="int", wrong_len=False)
        tensor_cases(out, name, fn, base, "req_of_token", kind="int")
        tensor_cases(out, name, fn, base, "local_bounds", kind="int")
        for label, kw, nm in (
            ("geometry a tuple", dict(geometry=(2, 1, 2, 4)), "geometry"),
            (
                "geometry block_size 8 (cache is 4)",
                dict(geometry=DcpGeometry(2, 1, 2, 8)),
                ("index_cache", "geometry", "block_size"),
            ),
            ("index_q head dim 64", dict(index_q=From(lambda kw: kw["index_q"][..., :64])), "index_q"),
            (
                "index_q with 0 heads",
                dict(index_q=From(lambda kw: kw["index_q"][:, :0]), weights=From(lambda kw: kw["weights"][:, :0])),
                "index_q",
            ),
            ("weights float64", dict(weights=From(lambda kw: kw["weights"].double())), "weights"),
            ("weights one head short", dict(weights=From(lambda kw: kw["weights"][:, :3])), "weights"),
            ("index_cache int8", dict(index_cache=From(lambda kw: kw["index_cache"].view(torch.int8))), "index_cache"),
            (
                "index_cache one byte short per block",
                dict(index_cache=From(lambda kw: kw["index_cache"][:, :-1].contiguous())),
                "index_cache",
            ),
            (
                "index_cache non-contiguous",
                dict(index_cache=From(lambda kw: strided(kw["index_cache"]))),
                "index_cache",
            ),
            ("index_cache 1-D", dict(index_cache=From(lambda kw: kw["index_cache"].reshape(-1))), "index_cache"),
            ("row_starts float", dict(row_starts=f32([0, 0, 0])), "row_starts"),
            ("row_starts wrong length", dict(row_starts=i64([0, 0])), "row_starts"),
            ("out float64", dict(out=torch.empty(3, 16, dtype=torch.float64)), "out"),
            ("out wrong rows", dict(out=torch.empty(4, 16)), "out"),
            ("out non-contiguous", dict(out=torch.empty(16, 3).t()), "out"),
            ("out 1-D", dict(out=torch.empty(48)), "out"),
            ("next_n=0", dict(next_n=0), "next_n"),
            ("next_n=2 does not divide T=3", dict(next_n=2), "next_n"),
            ("next_n=True", dict(next_n=True), "next_n"),
            ("next_n=1.0", dict(next_n=1.0), "next_n"),
        ):
            mk(out, name, label, call_with(fn, base, **kw), "raise", nm)
        mk(
            out,
            name,
            "out aliases weights",
            lambda fn=fn: (lambda buf: fn(**{**sc_inputs(), "weights": buf[:, :SC_H], "out": buf}))(torch.randn(3, 16)),
            "raise",
            ("out", "weights"),
        )
        mk(
            out,
            name,
            "out aliases index_q (same bytes)",
            lambda fn=fn: (
                lambda a: fn(
                    **{
                        **a,
                        "out": a["index_q"].view(torch.uint8).view(-1)[: 3 * 16 * 4].view(torch.float32).view(3, 16),
                    }
                )
            )(sc_inputs()),
            "raise",
            ("out", "index_q"),
        )
        if has_validate:
            flag_cases(out, name, fn, base, "validate")
            for label, kw, nm in (
                ("request id out of range", dict(req_of_token=i32([0, 2, 1])), "req_of_token"),
                ("negative bound", dict(local_bounds=i64([6, -1, 0])), "local_bounds"),
                ("negative row start", dict(row_starts=i64([0, -1, 0])), "row_starts"),
                (
                    "bound needs more blocks than the table",
                    dict(local_bounds=i64([13, 0, 0])),
                    ("local_bounds", "block_table"),
                ),
                ("a needed block is -1", dict(local_bounds=i64([9, 0, 0])), "block_table"),
                (
                    "a needed block is past the cache",
                    dict(block_table=i32([[3, 6, -1], [5, 1, 2]])),
                    ("block_table", "index_cache"),
                ),
                (
                    "row reaches past out",
                    dict(local_bounds=i64([6, 9, 0]), row_starts=i64([0, 8, 0])),
                    ("out", "row_starts", "local_bounds"),
                ),
                (
                    "MTP group names two requests",
                    sc_group(slice(None, 2), [0, 1], [1, 1]),
                    "req_of_token",
                ),
                (
                    "row_starts=2**63-1 with bound 1 (wraps)",
                    dict(row_starts=i64([2**63 - 1, 0, 0]), local_bounds=i64([1, 9, 0])),
                    ("row_starts", "out"),
                ),
                (
                    "meta metadata, validate=True",
                    dict(
                        req_of_token=meta_like(i32([0, 1, 1])),
                        local_bounds=meta_like(i64([0, 0, 0])),
                        block_table=meta_like(i32([[0]])),
                        index_q=From(lambda kw: meta_like(kw["index_q"])),
                        weights=From(lambda kw: meta_like(kw["weights"])),
                        index_cache=From(lambda kw: meta_like(kw["index_cache"])),
                        out=torch.empty(3, 16, device=META),
                    ),
                    ("req_of_token", "local_bounds", "block_table", "meta"),
                ),
                (
                    "validate=False, row_starts given, no out",
                    dict(row_starts=i64([0, 6, 2]), out=None, validate=False),
                    "out",
                ),
            ):
                mk(out, name, label, call_with(fn, base, **kw), "raise", nm)
        # ---- validate=False (the hot path): an out-of-contract row is NaN, every column
        for label, kw, rows in (
            ("request id out of range", dict(req_of_token=i32([0, 2, 1])), [1]),
            ("int64 request id 2**32", dict(req_of_token=i64([0, 2**32, 1])), [1]),
            ("negative bound", dict(local_bounds=i64([6, -1, 0])), [1]),
            ("negative row start", dict(row_starts=i64([0, -3, 0])), [1]),
            ("bound past the table", dict(local_bounds=i64([13, 9, 0])), [0]),
            ("int64 bound 2**62", dict(local_bounds=i64([2**62, 9, 0])), [0]),
            ("a needed block is -1", dict(local_bounds=i64([9, 9, 0])), [0]),
            ("a needed block past the cache", dict(block_table=i32([[3, 6, -1], [5, 1, 2]])), [0]),
            ("int64 block id 2**32 + 1", dict(block_table=i64([[3, 2**32 + 1, -1], [5, 1, 2]])), [0]),
            ("row reaches past out", dict(row_starts=i64([0, 8, 0])), [1]),
            (
                "row_starts 2**63-1, bound 1 (the sum wraps)",
                dict(row_starts=i64([2**63 - 1, 0, 0]), local_bounds=i64([1, 9, 0])),
                [0],
            ),
        ):
            if name == "reference_scoring" and "row_start" in label and "out" not in kw:
                pass
            mk(
                out,
                name,
                f"validate=False, {label} -> NaN row",
                call_with(fn, base, **kw, **val),
                "poison",
                check=lambda r, rows=rows: first(
                    rows_nan(r, rows, "scores"),
                    rows_finite(torch.nan_to_num(r, neginf=0.0), [t for t in range(3) if t not in rows], "scores"),
                ),
            )
        mk(
            out,
            name,
            "validate=False, an MTP group naming two requests -> both rows NaN",
            call_with(fn, base, **sc_group(slice(None, 2), [0, 1], [1, 1]), **val),
            "poison",
            check=lambda r: rows_nan(r, [0, 1], "scores"),
        )
    if st is not None:
        f = st.index_scores_triton

        def kbase() -> dict[str, Any]:
            return dict(sc_inputs(), out=torch.empty(3, 16))

        cpu = torch.device("cpu")
        plan16 = st.scoring_plan(3, 16, cpu, block_size=SC_BS, block_n=16, tiles=1)  # covers 16 columns
        for label, kw, nm in (
            ("index_q float64 (reference only)", dict(index_q=From(lambda kw: kw["index_q"].double())), "index_q"),
            ("plan=a tuple of its fields", dict(plan=tuple(plan16)), "plan"),
            ("plan='default'", dict(plan="default"), "plan"),
            ("plan made for next_n=2", dict(plan=plan16._replace(group=2)), "plan"),
            ("plan covering 16 of 40 columns", dict(plan=plan16, out=torch.empty(3, 40)), "plan"),
            ("plan with tma=True on 4-key blocks", dict(plan=plan16._replace(tma=True)), "plan"),
            ("plan with pair_dot=True at next_n=1", dict(plan=plan16._replace(pair_dot=True)), "plan"),
            ("plan with block_n=24", dict(plan=plan16._replace(block_n=24)), "plan.block_n"),
            ("plan with programs=0", dict(plan=plan16._replace(programs=0)), "plan.programs"),
        ):
            mk(out, "index_scores_triton", label, call_with(f, kbase, **kw), "raise", nm)
        # the tuning of index_scores_triton: only through its plan (scoring_plan names a bad value)
        for label, kw, nm in (
            ("block_n=24", dict(block_n=24), "block_n"),
            ("block_n=8", dict(block_n=8), "block_n"),
            ("tiles=0", dict(tiles=0), "tiles"),
            ("num_warps=3", dict(num_warps=3), "num_warps"),
            ("num_stages=0", dict(num_stages=0), "num_stages"),
            ("tma=True where a tile is not one block", dict(tma=True), "tma"),
            ("tma='yes'", dict(tma="yes"), "tma"),
            ("pair_dot=1", dict(pair_dot=1), "pair_dot"),
        ):
            mk(out, "scoring_plan", label, lambda kw=kw: st.scoring_plan(3, 16, cpu, block_size=SC_BS, **kw), "raise",
               nm)  # fmt: skip
        mk(
            out,
            "index_scores_triton",
            "valid: a plan made for the call (block_n=16, tiles=1)",
            call_with(f, kbase, plan=plan16),
            "valid",
            check=expect_equal(bf_scores(kbase(), 16), **tol),
        )
        mk(
            out,
            "index_scores_triton",
            "valid: float32 index_q (teaching dtype)",
            call_with(f, kbase, index_q=From(lambda kw: kw["index_q"].float())),
            "valid",
            check=expect_equal(bf_scores(kbase(), 16), **tol),
        )
    return out


def index_cache_cases() -> list[Case]:
    from dcp_ref import DcpGeometry
    from dcp_ref.index_cache import (
        dequantize_index_keys,
        index_cache_blocks,
        make_index_cache,
        quantize_index_keys,
        quantize_index_queries,
        read_index_keys,
        write_index_keys,
        write_index_tokens,
    )

    out: list[Case] = []
    G = gen(21)
    keys = torch.randn(5, 128, generator=G) * 3

    def bf_scale(x: torch.Tensor) -> torch.Tensor:
        """vLLM's rule from the module docstring: max(amax, 1e-4) / 448 in float32, rounded up to a power of two."""
        res = []
        for row in x.to(torch.float32):
            if not bool(torch.isfinite(row).all()):
                res.append(NAN)
                continue
            s = float(np.float32(max(np.float32(row.abs().max()), np.float32(1e-4)) / np.float32(448.0)))
            m, e = math.frexp(s)
            res.append(2.0 ** (e - 1) if m == 0.5 else 2.0**e)
        return f32(res)

    def b_q() -> dict[str, Any]:
        return dict(keys=keys.clone())

    mk(
        out,
        "quantize_index_keys",
        "valid: power-of-two scales, values = e4m3(x / scale)",
        call_with(quantize_index_keys, b_q),
        "valid",
        check=lambda r: first(
            diff(r[1], bf_scale(keys)),
            diff(
                r[0].view(torch.float8_e4m3fn).float(), (keys / bf_scale(keys)[:, None]).to(torch.float8_e4m3fn).float()
            ),
        ),
    )
    mk(
        out,
        "quantize_index_keys",
        "valid: an all-zero key gets the floor scale",
        lambda: quantize_index_keys(torch.zeros(1, 128)),
        "valid",
        check=lambda r: diff(r[1], bf_scale(torch.zeros(1, 128))),
    )
    mk(
        out,
        "quantize_index_keys",
        "valid: N=0",
        lambda: quantize_index_keys(torch.zeros(0, 128)),
        "valid",
        check=lambda r: diff(r[1], torch.zeros(0)),
    )
    mk(
        out,
        "quantize_index_keys",
        "valid: bf16 keys",
        lambda: quantize_index_keys(keys.bfloat16()),
        "valid",
        check=lambda r: diff(r[1], bf_scale(keys.bfloat16())),
    )
    tensor_cases(
        out, "quantize_index_keys", quantize_index_keys, b_q, "keys", kind="float", wrong_len=False, meta=False
    )
    flag_cases(out, "quantize_index_keys", quantize_index_keys, b_q, "validate")
    nan_keys = keys.clone()
    nan_keys[2, 7] = NAN
    mk(out, "quantize_index_keys", "keys width 64", lambda: quantize_index_keys(keys[:, :64]), "raise", "keys")
    mk(out, "quantize_index_keys", "a NaN key (validated)", lambda: quantize_index_keys(nan_keys), "raise", "keys")
    mk(
        out,
        "quantize_index_keys",
        "a float64 key that overflows float32",
        lambda: quantize_index_keys(keys.double() * 1e39),
        "raise",
        "keys",
    )
    mk(
        out,
        "quantize_index_keys",
        "validate=False, NaN key -> NaN scale (visible)",
        lambda: quantize_index_keys(nan_keys, validate=False),
        "poison",
        check=lambda r: (
            None
            if math.isnan(float(r[1][2])) and bool(torch.isfinite(r[1][[0, 1, 3, 4]]).all())
            else f"scales {r[1].tolist()}"
        ),
    )
    inf_keys = keys.clone()
    inf_keys[1, 0] = INF
    mk(
        out,
        "quantize_index_keys",
        "validate=False, +inf key -> NaN scale (never a finite 448)",
        lambda: quantize_index_keys(inf_keys, validate=False),
        "poison",
        check=lambda r: None if math.isnan(float(r[1][1])) else f"scale {float(r[1][1])}",
    )
    mk(
        out,
        "quantize_index_keys",
        "keys on meta, validate=True",
        lambda: quantize_index_keys(meta_like(keys)),
        "raise",
        "keys",
    )

    v, s = quantize_index_keys(keys)
    mk(
        out,
        "dequantize_index_keys",
        "valid: values * scale exactly",
        lambda: dequantize_index_keys(v, s),
        "valid",
        check=expect_equal(v.view(torch.float8_e4m3fn).double() * s.double()[:, None]),
    )
    mk(out, "dequantize_index_keys", "scales wrong length", lambda: dequantize_index_keys(v, s[:3]), "raise", "scales")
    mk(out, "dequantize_index_keys", "scales float64", lambda: dequantize_index_keys(v, s.double()), "raise", "scales")
    mk(out, "dequantize_index_keys", "values int32", lambda: dequantize_index_keys(v.int(), s), "raise", "values")
    mk(out, "dequantize_index_keys", "values 1-D", lambda: dequantize_index_keys(v[0], s[:1]), "raise", "values")
    mk(out, "dequantize_index_keys", "dtype int32", lambda: dequantize_index_keys(v, s, torch.int32), "raise", "dtype")
    mk(
        out,
        "dequantize_index_keys",
        "scales on meta",
        lambda: dequantize_index_keys(v, meta_like(s)),
        "raise",
        "scales",
    )

    q = torch.randn(3, 4, 128, generator=G)
    w = torch.randn(3, 4, generator=G)

    def b_iq() -> dict[str, Any]:
        return dict(q=q.clone(), weights=w.clone())

    def bf_iq(qq: torch.Tensor, ww: torch.Tensor, sm: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        _, H, D = qq.shape
        sm = D**-0.5 if sm is None else sm
        amax = qq.float().abs().amax(-1).clamp_min(1e-10) / 448.0
        m, e = torch.frexp(amax)
        scale = torch.ldexp(torch.ones_like(amax), e - (m == 0.5).int())
        qf = (qq.float() / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return qf, ww.float() * scale * sm * H**-0.5

    mk(
        out,
        "quantize_index_queries",
        "valid: per-(token, head) power-of-two scale folded into the weights",
        call_with(quantize_index_queries, b_iq),
        "valid",
        check=lambda r: first(diff(r[0].float(), bf_iq(q, w)[0].float()), diff(r[1], bf_iq(q, w)[1], rtol=1e-6)),
    )
    mk(
        out,
        "quantize_index_queries",
        "valid: softmax_scale=0.5",
        call_with(quantize_index_queries, b_iq, softmax_scale=0.5),
        "valid",
        check=lambda r: diff(r[1], bf_iq(q, w, 0.5)[1], rtol=1e-6),
    )
    mk(
        out,
        "quantize_index_queries",
        "valid: T=0",
        lambda: quantize_index_queries(q[:0], w[:0]),
        "valid",
        check=lambda r: diff(r[1], torch.zeros(0, 4)),
    )
    tensor_cases(out, "quantize_index_queries", quantize_index_queries, b_iq, "q", kind="float", wrong_len=False)
    tensor_cases(out, "quantize_index_queries", quantize_index_queries, b_iq, "weights", kind="float")
    flag_cases(out, "quantize_index_queries", quantize_index_queries, b_iq, "validate")
    for label, v_, exc in (
        ("0.0", 0.0, ValueError),
        ("-1", -1.0, ValueError),
        ("nan", NAN, ValueError),
        ("inf", INF, ValueError),
        ("'0.1'", "0.1", TypeError),
        ("True", True, TypeError),
        ("0-d tensor", torch.tensor(0.1), TypeError),
    ):
        mk(
            out,
            "quantize_index_queries",
            f"softmax_scale={label}",
            call_with(quantize_index_queries, b_iq, softmax_scale=v_),
            "raise",
            "softmax_scale",
            exc=exc,
        )
    nq = q.clone()
    nq[1, 2, 5] = NAN
    mk(
        out,
        "quantize_index_queries",
        "a NaN query (validated)",
        call_with(quantize_index_queries, b_iq, q=nq),
        "raise",
        "q",
    )
    nw = w.clone()
    nw[0, 0] = INF
    mk(
        out,
        "quantize_index_queries",
        "an inf weight (validated)",
        call_with(quantize_index_queries, b_iq, weights=nw),
        "raise",
        "weights",
    )
    mk(
        out,
        "quantize_index_queries",
        "validate=False, NaN query row -> NaN weight for that (token, head)",
        call_with(quantize_index_queries, b_iq, q=nq, validate=False),
        "poison",
        check=lambda r: (
            None if math.isnan(float(r[1][1, 2])) and int(torch.isnan(r[1]).sum()) == 1 else f"weights {r[1].tolist()}"
        ),
    )
    iq = q.clone()
    iq[0, 1, 0] = -INF
    mk(
        out,
        "quantize_index_queries",
        "validate=False, -inf query row -> NaN weight (never a clamped 448)",
        call_with(quantize_index_queries, b_iq, q=iq, validate=False),
        "poison",
        check=lambda r: None if math.isnan(float(r[1][0, 1])) else f"weight {float(r[1][0, 1])}",
    )

    for label, args, nm in (
        ("num_blocks=-1", (-1, 4), "num_blocks"),
        ("block_size=0", (3, 0), "block_size"),
        ("num_blocks=2.0", (2.0, 4), "num_blocks"),
        ("block_size=True", (3, True), "block_size"),
    ):
        mk(out, "make_index_cache", label, lambda a=args: make_index_cache(*a), "raise", nm)
    mk(
        out,
        "make_index_cache",
        "valid: every byte 0xFF (NaN value and scale)",
        lambda: make_index_cache(2, 4),
        "valid",
        check=lambda c: None if c.shape == (2, 528) and bool((c == 0xFF).all()) else f"shape {tuple(c.shape)}",
    )
    mk(
        out,
        "make_index_cache",
        "valid: num_blocks=0",
        lambda: make_index_cache(0, 4),
        "valid",
        check=lambda c: None if c.shape == (0, 528) else f"shape {tuple(c.shape)}",
    )

    cache = make_index_cache(3, 4)
    for label, c, nm in (
        ("wrong block bytes", torch.zeros(3, 527, dtype=torch.uint8), "index_cache"),
        ("float32 cache", torch.zeros(3, 132), "index_cache"),
        ("[nb, bs, 1, 132] with bs=2", torch.zeros(3, 2, 1, 132, dtype=torch.uint8), "index_cache"),
        ("non-contiguous", torch.zeros(3, 1056, dtype=torch.uint8)[:, ::2], "index_cache"),
        ("5-D", torch.zeros(3, 4, 1, 1, 132, dtype=torch.uint8), "index_cache"),
    ):
        mk(out, "index_cache_blocks", label, lambda c=c: index_cache_blocks(c, 4), "raise", nm)
    mk(out, "index_cache_blocks", "block_size=0", lambda: index_cache_blocks(cache, 0), "raise", "block_size")
    mk(
        out,
        "index_cache_blocks",
        "valid: DeepGEMM's [nb, bs, 1, 132] is the same bytes",
        lambda: index_cache_blocks(cache.view(3, 4, 1, 132), 4),
        "valid",
        check=expect_equal(cache),
    )

    def fresh() -> torch.Tensor:
        return make_index_cache(3, 4)

    mk(
        out,
        "write_index_keys",
        "valid: round trip through read_index_keys",
        lambda: (
            lambda c: (write_index_keys(c, i64([5, -1, 11]), keys[:3], 4), read_index_keys(c, i64([5, 11]), 4))[1]
        )(fresh()),
        "valid",
        check=lambda r: diff(r[1], quantize_index_keys(keys[[0, 2]])[1]),
    )
    for label, kw, nm in (
        ("slot past the cache", dict(slots=i64([12, -1, 0])), "slots"),
        ("slot -2", dict(slots=i64([-2, 1, 0])), "slots"),
        ("repeated slot", dict(slots=i64([3, 3, 0])), "slots"),
        ("keys one row short", dict(keys=keys[:2]), "keys"),
        ("keys int", dict(keys=keys[:3].long()), "keys"),
        ("slots float", dict(slots=f32([1, 2, 3])), "slots"),
        ("keys on meta", dict(keys=meta_like(keys[:3])), "keys"),
        ("a NaN key", dict(keys=nan_keys[:3]), "keys"),
        ("block_size=5 (cache is 4)", dict(block_size=5), ("block_size", "index_cache")),
    ):
        mk(
            out,
            "write_index_keys",
            label,
            lambda kw=kw: write_index_keys(
                **{**dict(index_cache=fresh(), slots=i64([3, -1, 7]), keys=keys[:3], block_size=4), **kw}
            ),
            "raise",
            nm,
        )
    mk(
        out,
        "write_index_keys",
        "keys alias the cache bytes",
        lambda: (lambda c: write_index_keys(c, i64([0]), c.view(-1)[:512].view(torch.float32).view(1, 128), 4))(
            fresh()
        ),
        "raise",
        ("keys", "index_cache"),
    )
    mk(
        out,
        "read_index_keys",
        "slot -1 (reads need a real slot)",
        lambda: read_index_keys(cache, i64([-1]), 4),
        "raise",
        "slots",
    )
    mk(out, "read_index_keys", "slot past the cache", lambda: read_index_keys(cache, i64([12]), 4), "raise", "slots")
    mk(
        out,
        "read_index_keys",
        "slots on meta",
        lambda: read_index_keys(cache, meta_like(i64([1])), 4),
        "raise",
        "slots",
    )
    geo = DcpGeometry(2, 1, 2, 4)
    mk(
        out,
        "write_index_tokens",
        "valid: owner-only write (other rank's tokens skipped)",
        lambda: write_index_tokens(fresh(), geo, i32([[0, 1], [2, -1]]), i64([0, 0, 1]), i64([1, 2, 3]), keys[:3]),
        "valid",
        check=expect_equal(i64([-1, 0 * 4 + 0, 2 * 4 + 1])),
    )
    mk(
        out,
        "write_index_tokens",
        "owned token without a block",
        lambda: write_index_tokens(fresh(), geo, i32([[0, 1], [-1, -1]]), i64([1]), i64([2]), keys[:1]),
        "raise",
        "block_table",
    )
    mk(
        out,
        "write_index_tokens",
        "request id past the table",
        lambda: write_index_tokens(fresh(), geo, i32([[0, 1]]), i64([3]), i64([2]), keys[:1]),
        "raise",
        "req_ids",
    )
    mk(
        out,
        "write_index_tokens",
        "negative position",
        lambda: write_index_tokens(fresh(), geo, i32([[0, 1]]), i64([0]), i64([-2]), keys[:1]),
        "raise",
        "positions",
    )
    mk(
        out,
        "write_index_tokens",
        "keys count mismatch",
        lambda: write_index_tokens(fresh(), geo, i32([[0, 1]]), i64([0, 0]), i64([2, 3]), keys[:1]),
        "raise",
        "keys",
    )
    return out


# ============================================================================================================
# 7. the guard (tokens with out-of-contract metadata -> NaN output and LSE)
# ============================================================================================================
def guard_cases() -> list[Case]:
    from dcp_ref import DcpGeometry
    from dcp_ref.guard import reference_guard

    gt = _kernel("guard_triton")
    out: list[Case] = []
    T, H, V, bs = 4, 2, 3, 4

    def base() -> dict[str, Any]:
        return dict(
            partial=torch.ones(T, H, V),
            lse=torch.zeros(T, H),
            local_bounds=i64([8, 12, 3, 0]),
            req_of_token=i32([0, 1, 1, 0]),
            block_table=i32([[0, 1, 2, 3], [4, 5, 6, 7]]),
            geometry=DcpGeometry(2, 0, 1, bs),
            n_cols=16,
        )

    def run(fn: Any, **override: Any) -> Callable[[], Any]:
        def thunk() -> Any:
            kw = base()
            for k, v in override.items():
                kw[k] = v.fn(kw) if isinstance(v, From) else v
            fn(**kw)
            return kw["partial"], kw["lse"]

        return thunk

    def poisoned(rows: Sequence[int]) -> Callable[[Any], str | None]:
        def check(r: Any) -> str | None:
            p, lse = r
            keep = [t for t in range(p.shape[0]) if t not in rows]
            return first(
                rows_nan(p, rows, "partial"),
                rows_nan(lse, rows, "lse"),
                diff(p[keep], torch.ones(len(keep), *p.shape[1:]), what="untouched partial"),
                diff(lse[keep], torch.zeros(len(keep), lse.shape[1]), what="untouched lse"),
            )

        return check

    q8 = torch.zeros(T, 4, 8).to(torch.float8_e4m3fn)
    for name, fn in (("reference_guard", reference_guard), ("guard_triton", gt and gt.guard_triton)):
        if fn is None:
            mk(out, name, "module unavailable", _skip("dcp_ref.kernels.guard_triton"), "valid")
            continue
        mk(out, name, "valid: every token in contract is left untouched", run(fn), "valid", check=poisoned([]))
        mk(
            out,
            name,
            "valid: row_starts inside n_cols",
            run(fn, row_starts=i64([0, 4, 12, 16])),
            "valid",
            check=poisoned([]),
        )
        mk(
            out,
            name,
            "valid: next_n=2 groups of one request",
            run(fn, req_of_token=i32([0, 0, 1, 1]), next_n=2),
            "valid",
            check=poisoned([]),
        )
        mk(
            out,
            name,
            "valid: finite fp8 index query",
            run(fn, index_q=q8, index_weights=torch.ones(T, 4)),
            "valid",
            check=poisoned([]),
        )
        mk(
            out,
            name,
            "valid: T=0",
            run(fn, partial=torch.ones(0, H, V), lse=torch.zeros(0, H), local_bounds=i64([]), req_of_token=i32([])),
            "valid",
            check=poisoned([]),
        )
        mk(
            out,
            name,
            "valid: strided partial / lse views",
            run(
                fn,
                partial=From(lambda kw: strided(kw["partial"])),
                lse=From(lambda kw: strided(kw["lse"])),
                req_of_token=i32([0, 5, 1, 0]),
            ),
            "valid",
            check=poisoned([1]),
        )
        mk(
            out,
            name,
            "valid: expanded (stride-0) block_table",
            run(fn, block_table=i32([[0, 1, 2, 3]]).expand(2, 4)),
            "valid",
            check=poisoned([]),
        )
        mk(
            out,
            name,
            "valid: bf16 partial, float32 lse",
            run(fn, partial=torch.ones(T, H, V, dtype=torch.bfloat16), req_of_token=i32([0, 1, 9, 0])),
            "valid",
            check=lambda r: first(rows_nan(r[0], [2]), rows_nan(r[1], [2]), rows_finite(r[0], [0, 1, 3])),
        )
        for label, kw, rows in (
            ("request id == B", dict(req_of_token=i32([0, 2, 1, 0])), [1]),
            ("request id negative", dict(req_of_token=i32([-1, 1, 1, 0])), [0]),
            ("int64 request id 2**32", dict(req_of_token=i64([0, 2**32, 1, 0])), [1]),
            ("int64 request id -2**32", dict(req_of_token=i64([0, 1, -(2**32), 0])), [2]),
            ("negative bound", dict(local_bounds=i64([8, -1, 3, 0])), [1]),
            ("negative row start", dict(row_starts=i64([0, -1, 0, 0])), [1]),
            ("row_start + bound > n_cols", dict(row_starts=i64([0, 5, 0, 0])), [1]),
            ("bound > n_cols", dict(local_bounds=i64([17, 12, 3, 0])), [0]),
            (
                "row_start 2**63-1, bound 1 (the sum wraps)",
                dict(row_starts=i64([2**63 - 1, 0, 0, 0]), local_bounds=i64([1, 12, 3, 0])),
                [0],
            ),
            (
                "bound 2**63-1, row_start 1 (the sum wraps)",
                dict(row_starts=i64([1, 0, 0, 0]), local_bounds=i64([2**63 - 1, 12, 3, 0])),
                [0],
            ),
            ("int64 bound 2**62", dict(local_bounds=i64([2**62, 12, 3, 0])), [0]),
            (
                "bound needs a block past the table",
                dict(local_bounds=i64([8, 12, 3, 0]), block_table=i32([[0, 1], [4, 5]]), n_cols=16),
                [1],
            ),
            ("a needed block is -1", dict(block_table=i32([[0, -1, 2, 3], [4, 5, 6, 7]])), [0]),
            ("a needed block past num_blocks", dict(num_blocks=6), [1]),
            ("an MTP group names two requests", dict(req_of_token=i32([0, 1, 1, 1]), next_n=2), [0, 1]),
            ("NaN fp8 index query", dict(index_q=_nan_fp8_row(q8, 2), index_weights=torch.ones(T, 4)), [2]),
            ("inf index weight", dict(index_q=q8, index_weights=torch.ones(T, 4).index_fill(0, i64([3]), INF)), [3]),
            (
                "-inf float32 index query",
                dict(index_q=torch.zeros(T, 4, 8).index_fill(0, i64([1]), -INF), index_weights=torch.ones(T, 4)),
                [1],
            ),
        ):
            mk(out, name, f"{label} -> NaN token", run(fn, **kw), "poison", check=poisoned(rows))
        for label, kw, nm in (
            ("partial int32", dict(partial=torch.ones(T, H, V, dtype=torch.int32)), "partial"),
            ("partial 2-D", dict(partial=torch.ones(T, H)), "partial"),
            ("lse shape [T, H+1]", dict(lse=torch.zeros(T, H + 1)), "lse"),
            ("lse int", dict(lse=torch.zeros(T, H, dtype=torch.int64)), "lse"),
            ("local_bounds float", dict(local_bounds=f32([8, 12, 3, 0])), "local_bounds"),
            ("local_bounds wrong length", dict(local_bounds=i64([8, 12, 3])), "local_bounds"),
            ("req_of_token a list", dict(req_of_token=[0, 1, 1, 0]), "req_of_token"),
            ("req_of_token bool", dict(req_of_token=torch.zeros(T, dtype=torch.bool)), "req_of_token"),
            ("block_table 1-D", dict(block_table=i32([0, 1, 2, 3])), "block_table"),
            ("block_table float", dict(block_table=torch.zeros(2, 4)), "block_table"),
            ("row_starts float", dict(row_starts=f32([0, 0, 0, 0])), "row_starts"),
            ("geometry a tuple", dict(geometry=(2, 0, 1, 4)), "geometry"),
            ("n_cols=-1", dict(n_cols=-1), "n_cols"),
            ("n_cols=True", dict(n_cols=True), "n_cols"),
            ("n_cols=16.0", dict(n_cols=16.0), "n_cols"),
            ("n_cols=None", dict(n_cols=None), "n_cols"),
            ("num_blocks=-1", dict(num_blocks=-1), "num_blocks"),
            ("num_blocks='6'", dict(num_blocks="6"), "num_blocks"),
            ("next_n=0", dict(next_n=0), "next_n"),
            ("next_n=3 does not divide T=4", dict(next_n=3), "next_n"),
            ("index_q without index_weights", dict(index_q=q8), "index_weights"),
            ("index_weights without index_q", dict(index_weights=torch.ones(T, 4)), "index_q"),
            ("index_weights wrong heads", dict(index_q=q8, index_weights=torch.ones(T, 3)), "index_weights"),
            (
                "index_q int",
                dict(index_q=torch.zeros(T, 4, 8, dtype=torch.int32), index_weights=torch.ones(T, 4)),
                "index_q",
            ),
            ("partial expanded (stride-0)", dict(partial=torch.ones(1, H, V).expand(T, H, V)), "partial"),
            ("lse expanded (stride-0)", dict(lse=torch.zeros(1, H).expand(T, H)), "lse"),
            ("partial on meta", dict(partial=torch.ones(T, H, V, device=META)), ("partial", "lse", "device")),
            ("local_bounds on meta", dict(local_bounds=meta_like(i64([8, 12, 3, 0]))), ("local_bounds", "partial")),
        ):
            mk(out, name, label, run(fn, **kw), "raise", nm)
        mk(
            out,
            name,
            "lse aliases partial",
            lambda fn=fn: (lambda p: fn(**{**base(), "partial": p, "lse": p[:, :, 0]}))(torch.ones(T, H, V)),
            "raise",
            ("lse", "partial"),
        )
        mk(
            out,
            name,
            "partial aliases index_weights",
            lambda fn=fn: (
                lambda p: fn(**{**base(), "partial": p, "index_q": q8, "index_weights": p.view(T, -1)[:, :4]})
            )(torch.ones(T, H, V)),
            "raise",
            ("partial", "index_weights"),
        )
        mk(
            out,
            name,
            "lse aliases local_bounds (same bytes)",
            lambda fn=fn: (lambda b: fn(**{**base(), "local_bounds": b, "lse": b.view(torch.float32).view(T, H)}))(
                i64([8, 12, 3, 0])
            ),
            "raise",
            ("lse", "local_bounds"),
        )
    return out


def _nan_fp8_row(q8: torch.Tensor, t: int) -> torch.Tensor:
    b = q8.view(torch.uint8).clone()
    b[t, 1, 3] = 0x7F  # e4m3fn NaN
    return b.view(torch.float8_e4m3fn)


# ============================================================================================================
# 8. attention: the float64 oracle, the split-KV Triton kernel, the FP8 oracle, FlashMLA's prologues
# ============================================================================================================
def bf_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    counts: Sequence[int] | None,
    sm: float,
    v: int,
    masked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, head): softmax over the read rows (compact: slots[t, :counts[t]]; masked: every entry >= 0);
    empty -> (0, -inf); a read slot outside the cache -> NaN row."""
    T, H, _ = q.shape
    kv = kv.reshape(-1, kv.shape[-1]).to(torch.float64)
    S = kv.shape[0]
    o = torch.zeros(T, H, v, dtype=torch.float64)
    lse = torch.full((T, H), -INF, dtype=torch.float64)
    for t in range(T):
        if masked:
            used = [int(s) for s in slots[t] if int(s) != -1]
        else:
            c = max(0, min(int(counts[t]), slots.shape[1]))  # type: ignore[index]
            used = [int(s) for s in slots[t, :c]]
        if any(not 0 <= s < S for s in used):
            o[t], lse[t] = NAN, NAN
            continue
        if not used:
            continue
        rows = kv[used]
        for h in range(H):
            sc = sm * (rows @ q[t, h].to(torch.float64))
            m = torch.logsumexp(sc, 0)
            lse[t, h] = m if float(m) != -INF else NAN
            o[t, h] = torch.softmax(sc, 0) @ rows[:, :v]
    return o, lse


def attention_cases() -> list[Case]:
    from dcp_ref import sparse_mla_attention
    from dcp_ref.fp8_cache import sparse_mla_attention_fp8

    sk = _kernel("attention_splitkv_triton")
    f8 = _kernel("flashmla_fp8")
    fm = _kernel("flashmla_sparse")
    out: list[Case] = []
    G = gen(31)
    T, H, D, V, S = 3, 2, 16, 8, 10
    Q = torch.randn(T, H, D, generator=G)
    KV = torch.randn(S, D, generator=G)
    SL = i32([[1, 4, 9, -1], [7, -1, -1, -1], [3, 3, 0, 2]])
    CN = i32([3, 1, 0])
    sm = 0.3

    def want(**kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        q, kv = kw.get("q", Q), kw.get("kv_cache", KV)
        sl, cn = kw.get("slots", SL), kw.get("counts", CN)
        return bf_attention(q, kv, sl, [int(c) for c in cn], kw.get("sm_scale", sm), kw.get("v_dim", V))

    def b_ref() -> dict[str, Any]:
        return dict(q=Q.clone(), kv_cache=KV.clone(), slots=SL.clone(), counts=CN.clone(), sm_scale=sm, v_dim=V)

    def b_sk() -> dict[str, Any]:
        return b_ref()

    tol = dict(atol=1e-5, rtol=1e-5)
    impls: list[tuple[str, Any, Callable[[], dict[str, Any]]]] = [
        ("sparse_mla_attention", sparse_mla_attention, b_ref),
        ("sparse_mla_splitkv", sk and sk.sparse_mla_splitkv, b_sk),
    ]
    for name, fn, base in impls:
        if fn is None:
            mk(out, name, "module unavailable", _skip("dcp_ref.kernels.attention_splitkv_triton"), "valid")
            continue
        qn = Q.clone()
        qn[0, 1, 3] = NAN
        kn = KV.clone()
        kn[7, 0] = NAN
        kn[5, 2] = NAN  # never attended
        empty = (torch.zeros(T, H, V), torch.full((T, H), -INF))
        for desc, kw, w in (
            ("valid: brute force (a count-0 row is 0 / -inf, repeated slots allowed)", {}, want()),
            ("valid: v_dim = Dqk", dict(v_dim=D), want(v_dim=D)),
            ("valid: kv [S, 1, D]", dict(kv_cache=KV.clone().unsqueeze(1)), want()),
            (
                "valid: T=0",
                dict(q=Q[:0].clone(), slots=SL[:0].clone(), counts=CN[:0].clone()),
                (torch.zeros(0, H, V), torch.zeros(0, H)),
            ),
            (
                "valid: K=0 (every row empty)",
                dict(slots=torch.zeros(T, 0, dtype=torch.int32), counts=i32([0, 0, 0])),
                empty,
            ),
            ("valid: empty cache, all counts 0", dict(kv_cache=torch.zeros(0, D), counts=i32([0, 0, 0])), empty),
            ("valid: NaN in one query head -> exactly that (token, head) NaN", dict(q=qn), want(q=qn)),
            (
                "valid: NaN in an attended KV row -> that token NaN; an unread NaN row no effect",
                dict(kv_cache=kn),
                want(kv_cache=kn),
            ),
        ):
            mk(out, name, desc, call_with(fn, base, **kw), "valid", check=expect_equal(w, **tol))
        pad = dict(slots=i32([[1, 4, -1, -1], [7, -1, -1, -1], [3, 3, 0, 2]]), counts=i32([2, 1, 0]))
        mk(
            out,
            name,
            "valid: NaN in the cache under a padding entry (-1) leaks nothing",
            call_with(fn, base, kv_cache=From(lambda kw: kw["kv_cache"].index_fill(0, i64([S - 1]), NAN)), **pad),
            "valid",
            check=expect_equal(want(**pad), **tol),
        )
        mk(
            out,
            name,
            "valid: transposed q / strided kv views",
            call_with(
                fn,
                base,
                q=From(lambda kw: kw["q"].transpose(0, 1).contiguous().transpose(0, 1)),
                kv_cache=From(lambda kw: strided(kw["kv_cache"])),
            ),
            "either",
            ("q", "kv_cache"),
            check=expect_equal(want(), **tol),
        )
        tensor_cases(out, name, fn, base, "q", kind="float", wrong_len=False)
        tensor_cases(out, name, fn, base, "slots", kind="int", wrong_len=True)
        tensor_cases(out, name, fn, base, "counts", kind="int", wrong_len=True)
        for label, v, exc in (
            ("0", 0.0, ValueError),
            ("-0.5", -0.5, ValueError),
            ("nan", NAN, ValueError),
            ("inf", INF, ValueError),
            ("'0.3'", "0.3", TypeError),
            ("True", True, TypeError),
            ("None", None, TypeError),
            ("0-d tensor", torch.tensor(0.3), TypeError),
        ):
            mk(out, name, f"sm_scale={label}", call_with(fn, base, sm_scale=v), "raise", "sm_scale", exc=exc)
        mk(
            out,
            name,
            "valid: sm_scale as numpy float32",
            call_with(fn, base, sm_scale=np.float32(sm)),
            "valid",
            check=expect_equal(want(sm_scale=float(np.float32(sm))), **tol),
        )
        scalar_cases(out, name, fn, base, "v_dim", 1, extra=[("Dqk + 1", D + 1, ValueError)])
        flag_cases(out, name, fn, base, "validate")
        for label, kw, nm in (
            ("kv row width != q's", dict(kv_cache=KV[:, :8].clone()), "kv_cache"),
            ("kv int", dict(kv_cache=KV.long()), "kv_cache"),
            (
                "kv [S, 3, D]" if name == "sparse_mla_attention" else "kv [blocks, bs, 2, D]",
                dict(
                    kv_cache=KV.clone()[:9].view(3, 3, D)
                    if name == "sparse_mla_attention"
                    else KV.clone().view(5, 1, 2, D)
                ),
                "kv_cache",
            ),
            ("kv 1-D", dict(kv_cache=KV.reshape(-1)), "kv_cache"),
            ("kv on meta", dict(kv_cache=meta_like(KV)), ("kv_cache", "q", "device")),
            ("counts > K", dict(counts=i32([5, 1, 0])), "counts"),
            ("counts negative", dict(counts=i32([3, -1, 0])), "counts"),
            ("a used slot == S", dict(slots=i32([[1, 4, 10, -1], [7, -1, -1, -1], [3, 3, 0, 2]])), "slots"),
            ("a used slot -1", dict(slots=i32([[1, -1, 9, -1], [7, -1, -1, -1], [3, 3, 0, 2]])), "slots"),
            (
                "the poison slot in a used entry",
                dict(slots=i32([[1, 4, POISON, -1], [7, -1, -1, -1], [3, 3, 0, 2]])),
                "slots",
            ),
            (
                "counts and slots on meta, validate=True",
                dict(counts=meta_like(CN), slots=meta_like(SL), q=meta_like(Q), kv_cache=meta_like(KV)),
                ("counts", "slots", "q", "device"),
            ),
        ):
            mk(out, name, label, call_with(fn, base, **kw), "raise", nm)
        # validate=False: used slots outside the cache poison the row; counts are clamped (documented)
        for label, kw, rows in (
            ("used slot == S", dict(slots=i32([[1, 4, 10, -1], [7, -1, -1, -1], [3, 3, 0, 2]])), [0]),
            ("used slot -1", dict(slots=i32([[1, 4, 9, -1], [-1, -1, -1, -1], [3, 3, 0, 2]])), [1]),
            ("the poison slot 2**31-1", dict(slots=i32([[1, 4, 9, -1], [POISON, -1, -1, -1], [3, 3, 0, 2]])), [1]),
            (
                "int64 slot 2**32+1 (not slot 1)",
                dict(slots=i64([[1, 4, 2**32 + 1, -1], [7, -1, -1, -1], [3, 3, 0, 2]])),
                [0],
            ),
            ("int64 slot -2**32+4", dict(slots=i64([[1, 4, -(2**32) + 4, -1], [7, -1, -1, -1], [3, 3, 0, 2]])), [0]),
        ):
            mk(
                out,
                name,
                f"validate=False, {label} -> NaN row",
                call_with(fn, base, validate=False, **kw),
                "poison",
                check=lambda r, rows=rows: first(
                    rows_nan(r[0], rows),
                    rows_nan(r[1], rows, "lse"),
                    rows_finite(torch.nan_to_num(r[1], neginf=0.0), [t for t in range(T) if t not in rows], "lse"),
                ),
            )
        for label, cn, eff in (
            ("count > K (documented clamp to K)", i32([9, 1, 0]), [4, 1, 0]),
            ("negative count (documented clamp to 0: 0 / -inf)", i32([3, -2, 0]), [3, 0, 0]),
            ("int64 count 2**32+1 (documented clamp to K)", i64([3, 2**32 + 1, 0]), [3, 4, 0]),
        ):
            sl2 = i32([[1, 4, 9, 2], [7, 5, 6, 0], [3, 3, 0, 2]])
            mk(
                out,
                name,
                f"validate=False, {label}",
                call_with(fn, base, slots=sl2, counts=cn, validate=False),
                "clamp",
                check=expect_equal(bf_attention(Q, KV, sl2, eff, sm, V), **tol),
            )
        mk(
            out,
            name,
            "valid: meta tensors with validate=False (shapes only)",
            lambda fn=fn: fn(meta_like(Q), meta_like(KV), meta_like(SL), meta_like(CN), sm, v_dim=V, validate=False),
            "valid",
            check=lambda r: diff(r, (torch.empty(T, H, V, device=META), torch.empty(T, H, device=META))),
        )
    mk(
        out,
        "sparse_mla_attention",
        "valid: lse_base='2'",
        call_with(sparse_mla_attention, b_ref, lse_base="2"),
        "valid",
        check=lambda r: diff(r[1], want()[1] / math.log(2.0), **tol),
    )
    for label, v in (("'10'", "10"), ("2 (int)", 2), ("None", None)):
        mk(
            out,
            "sparse_mla_attention",
            f"lse_base={label}",
            call_with(sparse_mla_attention, b_ref, lse_base=v),
            "raise",
            "lse_base",
        )

    if sk is not None:
        f = sk.sparse_mla_splitkv
        long_slots = torch.randint(0, S, (T, 40), generator=G, dtype=torch.int32)
        long_plan = sk.splitkv_plan(T, H, 40, "cpu", head_dim=D, v_dim=V, num_splits=2, block_n=16)
        LONG = dict(slots=long_slots, counts=i32([40, 17, 0]), plan=long_plan)
        mk(
            out,
            "sparse_mla_splitkv",
            "valid: two real splits (K=40, block_n=16) with a workspace",
            lambda: f(**{**b_sk(), **LONG, "workspace": sk.workspace_for(long_plan, "cpu")}),
            "valid",
            check=expect_equal(want(slots=long_slots, counts=i32([40, 17, 0])), **tol),
        )
        mk(
            out,
            "sparse_mla_splitkv",
            "valid: two real splits, workspace allocated per call",
            call_with(f, b_sk, **LONG),
            "valid",
            check=expect_equal(want(slots=long_slots, counts=i32([40, 17, 0])), **tol),
        )
        mk(
            out,
            "sparse_mla_splitkv",
            "valid: bf16",
            call_with(f, b_sk, q=Q.bfloat16(), kv_cache=KV.bfloat16()),
            "valid",
            check=expect_equal(bf_attention(Q.bfloat16(), KV.bfloat16(), SL, [3, 1, 0], sm, V), atol=2e-2, rtol=2e-2),
        )
        paged = torch.randn(5, 4, D, generator=G)[:, :2]  # [blocks, bs=2, D] with a block stride of 4 rows
        mk(
            out,
            "sparse_mla_splitkv",
            "valid: paged kv [blocks, bs, D] with a gap between blocks",
            call_with(f, b_sk, kv_cache=paged),
            "valid",
            check=expect_equal(want(kv_cache=paged.reshape(S, D)), **tol),
        )
        mk(
            out,
            "sparse_mla_splitkv",
            "valid: out / out_lse buffers (any strides)",
            call_with(f, b_sk, out=torch.empty(V, H, T).permute(2, 1, 0), out_lse=torch.empty(H, T).t()),
            "valid",
            check=expect_equal(want(), **tol),
        )
        for label, kw, nm in (
            ("q float64", dict(q=Q.double(), kv_cache=KV.double()), "q"),
            ("kv dtype != q dtype", dict(kv_cache=KV.bfloat16()), "kv_cache"),
            ("out float64", dict(out=torch.empty(T, H, V, dtype=torch.float64)), "out"),
            ("out wrong shape", dict(out=torch.empty(T, H, V + 1)), "out"),
            ("out_lse float64", dict(out_lse=torch.empty(T, H, dtype=torch.float64)), "out_lse"),
            ("out_lse [T]", dict(out_lse=torch.empty(T)), "out_lse"),
            ("plan a dict", dict(plan={}), "plan"),
            (
                "plan for another shape",
                dict(plan=From(lambda kw: sk.splitkv_plan(T + 1, H, 4, "cpu", head_dim=D, v_dim=V))),
                "plan",
            ),
            (
                "plan for another K (the two-split plan, K=40)",
                dict(plan=long_plan),
                "plan",
            ),
            (
                "plan for the default head_dim / v_dim (576 / 512)",
                dict(plan=From(lambda kw: sk.splitkv_plan(T, H, kw["slots"].shape[1], "cpu"))),
                "plan",
            ),
            (
                "plan for another device (meta)",
                dict(plan=From(lambda kw: sk.splitkv_plan(T, H, kw["slots"].shape[1], "meta", head_dim=D, v_dim=V))),
                "plan",
            ),
            ("workspace too small (two real splits)", dict(**LONG, workspace=torch.empty(1)), "workspace"),
            ("workspace float64", dict(**LONG, workspace=torch.empty(10_000, dtype=torch.float64)), "workspace"),
            ("workspace 2-D", dict(**LONG, workspace=torch.empty(100, 100)), "workspace"),
            (
                "workspace non-contiguous (two real splits)",
                dict(**LONG, workspace=torch.empty(20_000)[::2]),
                "workspace",
            ),
        ):
            mk(out, "sparse_mla_splitkv", label, call_with(f, b_sk, **kw), "raise", nm)
        for label, mkbuf, nm in (
            ("out aliases q", lambda kw: dict(out=kw["q"][..., :V]), ("out", "q")),
            (
                "out aliases kv_cache",
                lambda kw: dict(out=kw["kv_cache"].view(-1)[: T * H * V].view(T, H, V)),
                ("out", "kv_cache"),
            ),
            (
                "out_lse aliases out",
                lambda kw: (lambda o: dict(out=o, out_lse=o[..., 0]))(torch.empty(T, H, V)),
                ("out_lse", "out"),
            ),
            (
                "workspace aliases out",
                lambda kw: (lambda w: dict(**LONG, workspace=w, out=w[: T * H * V].view(T, H, V)))(torch.empty(10_000)),
                ("workspace", "out"),
            ),
            (
                "out_lse aliases counts (same bytes)",
                lambda kw: dict(
                    counts=i32([3, 1, 0, 0, 0, 0]).as_strided((3,), (1,)),
                    out_lse=i32([3, 1, 0, 0, 0, 0]).view(torch.float32)[:6].view(3, 2),
                ),
                None,
            ),
        ):
            if nm is None:
                continue
            mk(
                out,
                "sparse_mla_splitkv",
                label,
                lambda mkbuf=mkbuf: (lambda kw: f(**{**kw, **mkbuf(kw)}))(b_sk()),
                "raise",
                nm,
            )
        mk(
            out,
            "sparse_mla_splitkv",
            "out expanded (stride-0) view",
            call_with(f, b_sk, out=torch.empty(1, H, V).expand(T, H, V)),
            "either",
            "out",
            check=expect_equal(want(), **tol),
        )
        mk(
            out,
            "sparse_mla_splitkv",
            "out_lse expanded (stride-0) view",
            call_with(f, b_sk, out_lse=torch.empty(1, H).expand(T, H)),
            "either",
            "out_lse",
            check=expect_equal(want(), **tol),
        )
        mk(out, "splitkv_plan", "T=-1", lambda: sk.splitkv_plan(-1, 2, 4, "cpu"), "raise", "T")
        mk(out, "splitkv_plan", "H=0", lambda: sk.splitkv_plan(1, 0, 4, "cpu"), "raise", "H")
        mk(
            out,
            "splitkv_plan",
            "v_dim > head_dim",
            lambda: sk.splitkv_plan(1, 2, 4, "cpu", head_dim=8, v_dim=9),
            "raise",
            "v_dim",
        )
        mk(out, "splitkv_plan", "device 'nope'", lambda: sk.splitkv_plan(1, 2, 4, "nope"), "raise", "device")
        # the tuning of sparse_mla_splitkv: only through its plan (splitkv_plan names a bad value)
        for label, kw, nm in (
            ("num_splits=0", dict(num_splits=0), "num_splits"),
            ("num_splits=True", dict(num_splits=True), "num_splits"),
            ("block_h=8", dict(block_h=8), "block_h"),
            ("block_h=24", dict(block_h=24), "block_h"),
            ("block_n=3", dict(block_n=3), "block_n"),
            ("num_warps=5", dict(num_warps=5), "num_warps"),
            ("num_stages=9", dict(num_stages=9), "num_stages"),
            ("num_stages=0", dict(num_stages=0), "num_stages"),
        ):
            mk(out, "splitkv_plan", label, lambda kw=kw: sk.splitkv_plan(T, H, 4, "cpu", head_dim=D, v_dim=V, **kw),
               "raise", nm)  # fmt: skip
        mk(
            out,
            "splitkv_attention",
            "valid: the stage form (validate=False) on good inputs",
            lambda: sk.splitkv_attention(Q.clone(), KV.clone(), SL.clone(), CN.clone(), sm, V),
            "valid",
            check=expect_equal(want(), **tol),
        )

    # ---- the FP8 (fp8_ds_mla) cache: rows written byte by byte here (small e4m3 ints, power-of-two tile scales,
    # small bf16 rope values: every dequantized value is exact)
    Sf, Hf, Tf = 6, 2, 2
    rows = torch.zeros(Sf, 656, dtype=torch.uint8)
    deq = torch.zeros(Sf, 576, dtype=torch.float64)
    g8 = gen(41)
    for s_ in range(Sf):
        nope = torch.randint(-3, 4, (512,), generator=g8).float()
        sc = torch.tensor([2.0 ** int(x) for x in torch.randint(-3, 1, (4,), generator=g8)], dtype=torch.float32)
        rope = torch.randint(-2, 3, (64,), generator=g8).float() / 4
        rows[s_, :512] = nope.to(torch.float8_e4m3fn).view(torch.uint8)
        rows[s_, 512:528] = sc.view(torch.uint8)
        rows[s_, 528:] = rope.bfloat16().view(torch.uint8)
        deq[s_, :512] = (nope.view(4, 128) * sc[:, None]).reshape(-1).double()
        deq[s_, 512:] = rope.double()
    qf = torch.randn(Tf, Hf, 576, generator=g8) * 0.05
    slf = i32([[0, -1, 3, 5], [-1, -1, -1, -1]])

    def b_f8() -> dict[str, Any]:
        return dict(q=qf.clone(), kv_cache=rows.clone(), slots=slf.clone(), counts=None, sm_scale=0.1, v_dim=512)

    mk(
        out,
        "sparse_mla_attention_fp8",
        "valid: masked layout, brute force on exact dequantized rows",
        call_with(sparse_mla_attention_fp8, b_f8),
        "valid",
        check=expect_equal(bf_attention(qf, deq, slf, None, 0.1, 512, masked=True), atol=1e-9, rtol=1e-9),
    )
    mk(
        out,
        "sparse_mla_attention_fp8",
        "valid: compact layout",
        call_with(
            sparse_mla_attention_fp8,
            b_f8,
            slots=i32([[0, 3, 5, -1], [2, -1, -1, -1]]),
            counts=i32([3, 1]),
            attention_layout="compact",
        ),
        "valid",
        check=expect_equal(
            bf_attention(qf, deq, i32([[0, 3, 5, -1], [2, -1, -1, -1]]), [3, 1], 0.1, 512), atol=1e-9, rtol=1e-9
        ),
    )
    mk(
        out,
        "sparse_mla_attention_fp8",
        "valid: float8_e4m3fn view of the cache, [blocks, bs, 1, 656]",
        call_with(sparse_mla_attention_fp8, b_f8, kv_cache=rows.clone().view(torch.float8_e4m3fn).view(3, 2, 1, 656)),
        "valid",
        check=expect_equal(bf_attention(qf, deq, slf, None, 0.1, 512, masked=True), atol=1e-9, rtol=1e-9),
    )
    for label, kw, nm in (
        ("kv_cache rows of 576 bytes", dict(kv_cache=torch.zeros(Sf, 576, dtype=torch.uint8)), "kv_cache"),
        ("kv_cache bf16", dict(kv_cache=torch.zeros(Sf, 656, dtype=torch.bfloat16)), "kv_cache"),
        ("q width 512", dict(q=qf[..., :512].clone()), "q"),
        ("slot -2 (masked)", dict(slots=i32([[0, -2, 3, 5], [-1, -1, -1, -1]])), "slots"),
        ("slot == S (masked)", dict(slots=i32([[0, 6, 3, 5], [-1, -1, -1, -1]])), "slots"),
        ("compact without counts", dict(attention_layout="compact"), "counts"),
        ("attention_layout='dense'", dict(attention_layout="dense"), "attention_layout"),
        ("v_dim=577", dict(v_dim=577), "v_dim"),
        ("out int", dict(out=torch.empty(Tf, Hf, 512, dtype=torch.int32)), "out"),
        ("out_lse wrong shape", dict(out_lse=torch.empty(Tf, Hf + 1)), "out_lse"),
        ("layout not an Fp8CacheLayout", dict(layout="fp8"), "layout"),
        ("sm_scale=0", dict(sm_scale=0.0), "sm_scale"),
    ):
        mk(out, "sparse_mla_attention_fp8", label, call_with(sparse_mla_attention_fp8, b_f8, **kw), "raise", nm)
    mk(
        out,
        "sparse_mla_attention_fp8",
        "out aliases q",
        lambda: (lambda kw: sparse_mla_attention_fp8(**{**kw, "out": kw["q"][..., :512]}))(b_f8()),
        "raise",
        ("out", "q"),
    )
    for label, kw, rws in (
        ("masked slot -2", dict(slots=i32([[0, -2, 3, 5], [-1, -1, -1, -1]])), [0]),
        ("masked poison slot", dict(slots=i32([[0, -1, 3, 5], [POISON, -1, -1, -1]])), [1]),
        ("masked int64 slot 2**32", dict(slots=i64([[0, -1, 2**32, 5], [-1, -1, -1, -1]])), [0]),
    ):
        mk(
            out,
            "sparse_mla_attention_fp8",
            f"validate=False, {label} -> NaN row",
            call_with(sparse_mla_attention_fp8, b_f8, validate=False, **kw),
            "poison",
            check=lambda r, rws=rws: first(rows_nan(r[0], rws), rows_nan(r[1], rws, "lse")),
        )

    if f8 is not None:
        pi = f8.prepare_indices

        def bf_prepare(slots: torch.Tensor, counts: Sequence[int] | None, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            T_, K = slots.shape
            kp = max(64, -(-K // 64) * 64)
            idx = torch.full((T_, 1, kp), -1, dtype=torch.int32)
            state = torch.zeros(T_, dtype=torch.int32)
            for t in range(T_):
                lim = K if counts is None else max(0, min(int(counts[t]), K))
                st_ = 0
                for j in range(K):
                    s_ = int(slots[t, j])
                    inside = 0 <= s_ < n
                    if counts is None:
                        ok, bad = inside, (not inside and s_ != -1)
                    else:
                        ok, bad = j < lim and inside, j < lim and not inside
                    if ok:
                        idx[t, 0, j] = s_
                    st_ = max(st_, 2 if bad else int(ok))
                state[t] = st_
            return idx, state

        s1 = i32([[0, -1, 3, 9], [-1, -1, -1, -1], [5, 5, 1, 0]])
        mk(
            out,
            "prepare_indices",
            "valid: masked layout brute force",
            lambda: pi(s1, None, 6),
            "valid",
            check=expect_equal(bf_prepare(s1, None, 6)),
        )
        mk(
            out,
            "prepare_indices",
            "valid: compact layout brute force",
            lambda: pi(s1, i32([1, 0, 4]), 6),
            "valid",
            check=expect_equal(bf_prepare(s1, [1, 0, 4], 6)),
        )
        mk(
            out,
            "prepare_indices",
            "valid: validated good call",
            lambda: pi(s1[[1, 2]], i32([0, 4]), 6, validate=True),
            "valid",
            check=expect_equal(bf_prepare(s1[[1, 2]], [0, 4], 6)),
        )
        mk(
            out,
            "prepare_indices",
            "valid: K=70 pads to 128",
            lambda: pi(torch.full((1, 70), 2, dtype=torch.int32), None, 6),
            "valid",
            check=expect_equal(bf_prepare(torch.full((1, 70), 2, dtype=torch.int32), None, 6)),
        )
        for label, call, nm in (
            ("validated masked slot -2", lambda: pi(i32([[0, -2]]), None, 6, validate=True), "slots"),
            ("validated masked slot == num_slots", lambda: pi(i32([[0, 6]]), None, 6, validate=True), "slots"),
            ("validated compact count > K", lambda: pi(i32([[0, 1]]), i32([3]), 6, validate=True), "counts"),
            ("validated compact count < 0", lambda: pi(i32([[0, 1]]), i32([-1]), 6, validate=True), "counts"),
            ("slots float", lambda: pi(f32([[0.0]]), None, 6), "slots"),
            ("counts wrong length", lambda: pi(i32([[0, 1]]), i32([1, 1]), 6), "counts"),
            ("num_slots=-1", lambda: pi(i32([[0, 1]]), None, -1), "num_slots"),
            ("num_slots=6.0", lambda: pi(i32([[0, 1]]), None, 6.0), "num_slots"),
            ("out wrong shape", lambda: pi(i32([[0, 1]]), None, 6, out=torch.empty(1, 1, 2, dtype=torch.int32)), "out"),
            (
                "row_state int64",
                lambda: pi(i32([[0, 1]]), None, 6, row_state=torch.empty(1, dtype=torch.int64)),
                "row_state",
            ),
            (
                "out aliases slots",
                lambda: (lambda s_: pi(s_[:, :2], None, 6, out=s_.view(1, 1, 64)))(
                    torch.zeros(1, 64, dtype=torch.int32)
                ),
                ("out", "slots"),
            ),
            (
                "row_state aliases out",
                lambda: (lambda o: pi(i32([[0, 1]]), None, 6, out=o, row_state=o[:, 0, 0]))(
                    torch.empty(1, 1, 64, dtype=torch.int32)
                ),
                ("row_state", "out"),
            ),
            ("validate='yes'", lambda: pi(i32([[0, 1]]), None, 6, validate="yes"), "validate"),
            ("defer_read=1", lambda: pi(i32([[0, 1]]), None, 6, defer_read=1), "defer_read"),
            ("slots on meta, validate=True", lambda: pi(meta_like(i32([[0, 1]])), None, 6, validate=True), "slots"),
        ):
            mk(out, "prepare_indices", label, call, "raise", nm)
        for label, call, want_state in (
            ("masked slot -2 -> poisoned row", lambda: pi(i32([[0, -2]]), None, 6), [2]),
            ("masked int64 slot 2**32+1 -> poisoned row", lambda: pi(i64([[0, 2**32 + 1]]), None, 6), [2]),
            ("compact used slot past the cache -> poisoned row", lambda: pi(i32([[0, 7]]), i32([2]), 6), [2]),
        ):
            mk(
                out,
                "prepare_indices",
                f"validate=False, {label}",
                call,
                "poison",
                check=lambda r, w=want_state: diff(r[1], i32(w), what="row_state"),
            )
        mk(
            out,
            "prepare_indices",
            "validate=False, negative count (documented clamp: empty row)",
            lambda: pi(i32([[0, 1]]), i32([-3]), 6),
            "clamp",
            check=lambda r: diff(r[1], i32([0]), what="row_state"),
        )
        mk(
            out,
            "prepare_indices",
            "validate=False, int64 count 2**32+1 (documented clamp to K)",
            lambda: pi(i32([[0, 1]]), i64([2**32 + 1]), 6),
            "clamp",
            check=expect_equal(bf_prepare(i32([[0, 1]]), [2], 6)),
        )
        mk(out, "FlashMLAFp8Decode", "FlashMLA's FP8 decode", _skip("needs flash_mla and CUDA"), "valid")
    if fm is not None:
        fq = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
        fkv = torch.zeros(4, 576, dtype=torch.bfloat16)

        def b_fm() -> dict[str, Any]:
            return dict(q=fq, kv_cache=fkv, slots=i32([[0, 1]]), counts=i32([2]), sm_scale=0.1)

        for label, kw, nm in (
            ("q float32", dict(q=fq.float()), "q"),
            ("q with 2 heads", dict(q=fq[:, :2]), ("q", "H")),
            ("v_dim=256", dict(v_dim=256), ("v_dim", "q")),
            ("splits=3", dict(splits=3), "splits"),
            ("kv_cache float32", dict(kv_cache=fkv.float()), "kv_cache"),
            ("counts two rows", dict(counts=i32([2, 2])), "counts"),
            ("sm_scale=-1", dict(sm_scale=-1.0), "sm_scale"),
            ("validate=1", dict(validate=1), "validate"),
            ("out aliases q", dict(out=fq[..., :512]), ("out", "q")),
            ("counts > K, validate=True", dict(counts=i32([5]), validate=True), "counts"),
        ):
            mk(out, "sparse_mla_flashmla", label, call_with(fm.sparse_mla_flashmla, b_fm, **kw), "raise", nm)
    mk(out, "sparse_mla_flashinfer", "FlashInfer fa3 / trtllm", _skip("needs flashinfer and CUDA"), "valid")
    return out


# ============================================================================================================
# 9. combine: the LSE merge / correction (reference and Triton), base conversions, the merge collective
# ============================================================================================================
def bf_merge(outs: torch.Tensor, lses: torch.Tensor, base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
    """-inf is empty (weight 0, output selected away); NaN / +inf LSE is corrupt (NaN); all empty -> 0 / -inf."""
    W, T, H, D = outs.shape
    o = torch.zeros(T, H, D, dtype=torch.float64)
    m = torch.full((T, H), -INF, dtype=torch.float64)
    b = 2.0 if base == "2" else math.e
    for t in range(T):
        for h in range(H):
            ls = [float(lses[w, t, h]) for w in range(W)]
            if any(math.isnan(x) or x == INF for x in ls):
                o[t, h], m[t, h] = NAN, NAN
                continue
            live = [w for w in range(W) if ls[w] != -INF]
            if not live:
                continue
            mx = max(ls[w] for w in live)
            tot = sum(b ** (ls[w] - mx) for w in live)
            m[t, h] = mx + math.log(tot, b)
            for w in live:
                o[t, h] += (b ** (ls[w] - mx) / tot) * outs[w, t, h].double()
    return o, m


def lse_kept_f64(r: Any) -> str | None:
    """The merged LSE of 1e300 and 1e300 - 1e284 stays above 1e300 * (1 - 1e-15): no float32 round trip."""
    v = float(r[1][0, 0])
    return None if v > 1e300 * (1 - 1e-15) and math.isfinite(v) else f"lse {v}"


def lse_cases() -> list[Case]:
    from dcp_ref import (
        SimulatedWorld,
        SingleGroup,
        correct_partial,
        dcp_merge_collective,
        lse_base2_to_e,
        lse_e_to_base2,
        merge_partials,
        normalize_lse_shape,
    )

    lt = _kernel("lse_merge_triton")
    out: list[Case] = []
    G = gen(51)
    W, T, H, D = 3, 2, 4, 5
    OUTS = torch.randn(W, T, H, D, generator=G)
    LSES = torch.randn(W, T, H, generator=G)
    LSES[0, 0, 0] = -INF  # one empty rank
    LSES[:, 1, 1] = -INF  # all ranks empty
    OUTS[0, 0, 0] = NAN  # garbage under an empty rank never leaks
    LSES[1, 0, 2] = NAN  # corrupt
    LSES[2, 1, 3] = INF  # corrupt
    tol = dict(atol=1e-5, rtol=1e-5)

    def b_mp() -> dict[str, Any]:
        return dict(outs=OUTS.clone(), lses=LSES.clone())

    mk(
        out,
        "merge_partials",
        "valid: empty / all-empty / NaN / +inf LSEs, brute force",
        call_with(merge_partials, b_mp),
        "valid",
        check=expect_equal(bf_merge(OUTS, LSES), **tol),
    )
    mk(
        out,
        "merge_partials",
        "valid: base 2",
        call_with(merge_partials, b_mp, base="2"),
        "valid",
        check=expect_equal(bf_merge(OUTS, LSES, "2"), **tol),
    )
    big = torch.full((2, 1, 1), 3.0e38)
    big[1] = 3.3e38
    mk(
        out,
        "merge_partials",
        "valid: finite LSEs near the float32 maximum stay finite",
        lambda: merge_partials(torch.ones(2, 1, 1, 2), big),
        "valid",
        check=expect_equal(bf_merge(torch.ones(2, 1, 1, 2), big), **tol),
    )
    l64 = f64([[[1e300]], [[1e300 - 1e284]]])
    mk(
        out,
        "merge_partials",
        "valid: float64 LSEs keep their precision",
        lambda: merge_partials(torch.ones(2, 1, 1, 1, dtype=torch.float64), l64),
        "valid",
        check=lse_kept_f64,
    )
    mk(
        out,
        "merge_partials",
        "valid: W=1",
        lambda: merge_partials(OUTS[:1].clone(), LSES[:1].clone()),
        "valid",
        check=expect_equal(bf_merge(OUTS[:1], LSES[:1]), **tol),
    )
    mk(
        out,
        "merge_partials",
        "valid: T=0",
        lambda: merge_partials(OUTS[:, :0].clone(), LSES[:, :0].clone()),
        "valid",
        check=expect_equal((torch.zeros(0, H, D), torch.zeros(0, H))),
    )
    tensor_cases(out, "merge_partials", merge_partials, b_mp, "outs", kind="float")
    tensor_cases(out, "merge_partials", merge_partials, b_mp, "lses", kind="float")
    mk(out, "merge_partials", "outs with W=0", lambda: merge_partials(OUTS[:0], LSES[:0]), "raise", ("outs", "lses"))
    mk(out, "merge_partials", "base='10'", call_with(merge_partials, b_mp, base="10"), "raise", "base")
    mk(out, "merge_partials", "base=2 (int)", call_with(merge_partials, b_mp, base=2), "raise", "base")
    flag_cases(out, "merge_partials", merge_partials, b_mp, "validate")

    def b_cp() -> dict[str, Any]:
        return dict(out=OUTS[1].clone(), all_lses=LSES.clone(), rank=1)

    def bf_correct(r: int, base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
        one = torch.zeros_like(OUTS)
        one[r] = OUTS[r]
        return bf_merge(one, LSES, base)

    mk(
        out,
        "correct_partial",
        "valid: rank 1's share, brute force",
        call_with(correct_partial, b_cp),
        "valid",
        check=expect_equal(bf_correct(1), **tol),
    )
    mk(
        out,
        "correct_partial",
        "valid: the shares sum to the merge",
        lambda: sum(correct_partial(OUTS[r], LSES, r)[0].nan_to_num(nan=123.0) for r in range(W)),
        "valid",
        check=expect_equal(bf_merge(OUTS, LSES)[0].nan_to_num(nan=123.0 * 3), **tol),
    )
    mk(
        out,
        "correct_partial",
        "valid: numpy rank",
        call_with(correct_partial, b_cp, rank=np.int64(1)),
        "valid",
        check=expect_equal(bf_correct(1), **tol),
    )
    tensor_cases(out, "correct_partial", correct_partial, b_cp, "out", kind="float")
    tensor_cases(out, "correct_partial", correct_partial, b_cp, "all_lses", kind="float", wrong_len=False)
    scalar_cases(out, "correct_partial", correct_partial, b_cp, "rank", 0, extra=[("rank=W", W, ValueError)])
    mk(out, "correct_partial", "base='e2'", call_with(correct_partial, b_cp, base="e2"), "raise", "base")

    for name, fn in (("lse_base2_to_e", lse_base2_to_e), ("lse_e_to_base2", lse_e_to_base2)):
        mk(
            out,
            name,
            "valid: inf / NaN map to themselves",
            lambda fn=fn: fn(f64([-INF, INF, NAN, 1.0])),
            "valid",
            check=lambda r, fn=fn: diff(
                r, f64([-INF, INF, NAN, math.log(2.0) if fn is lse_base2_to_e else 1 / math.log(2.0)]), rtol=1e-12
            ),
        )
        mk(out, name, "lse int", lambda fn=fn: fn(i64([1])), "raise", "lse")
        mk(out, name, "lse a list", lambda fn=fn: fn([1.0]), "raise", "lse")
    for label, args, nm in (
        ("transposed [H, T]", (torch.zeros(4, 3), 3, 4), "lse"),
        ("wrong total size", (torch.zeros(2, 5, 4), 3, 4), "lse"),
        ("num_heads=0", (torch.zeros(3, 4), 3, 0), "num_heads"),
        ("num_tokens=-1", (torch.zeros(3, 4), -1, 4), "num_tokens"),
        ("num_tokens=3.0", (torch.zeros(3, 4), 3.0, 4), "num_tokens"),
        ("int lse", (torch.zeros(3, 4, dtype=torch.int32), 3, 4), "lse"),
    ):
        mk(out, "normalize_lse_shape", label, lambda a=args: normalize_lse_shape(*a), "raise", nm)
    for label, x, want in (
        ("[T, 1, H]", torch.arange(12.0).view(3, 1, 4), torch.arange(12.0).view(3, 4)),
        ("[T, H, 1]", torch.arange(12.0).view(3, 4, 1), torch.arange(12.0).view(3, 4)),
        ("[B, q, H] with B*q = T", torch.arange(24.0).view(2, 3, 4), torch.arange(24.0).view(6, 4)),
    ):
        T_ = want.shape[0]
        mk(
            out,
            "normalize_lse_shape",
            f"valid: {label}",
            lambda x=x, T_=T_: normalize_lse_shape(x, T_, 4),
            "valid",
            check=expect_equal(want),
        )
    mk(
        out,
        "normalize_lse_shape",
        "valid: square [T, H] is taken as is",
        lambda: normalize_lse_shape(torch.eye(3), 3, 3),
        "valid",
        check=expect_equal(torch.eye(3)),
    )

    # dcp_merge_collective over W=2 simulated ranks: reduce-scatter over heads of the merge
    Wc = 2
    o2, l2 = OUTS[:2].clone(), LSES[:2].clone()

    def run_coll(mut: Callable[[int, dict[str, Any]], None] | None = None) -> Any:
        def body(g: Any, r: int) -> Any:
            kw: dict[str, Any] = dict(group=g, out=o2[r].clone(), lse=l2[r].clone())
            if mut is not None:
                mut(r, kw)
            return dcp_merge_collective(**kw)

        return SimulatedWorld(Wc, timeout_s=30).run(body, [0, 1])

    full_o, full_l = bf_merge(o2, l2)
    mk(
        out,
        "dcp_merge_collective",
        "valid: each rank gets its heads of the merge",
        lambda: run_coll(),
        "valid",
        check=lambda rs: first(
            *(diff(rs[r], (full_o[:, 2 * r : 2 * r + 2], full_l[:, 2 * r : 2 * r + 2]), **tol) for r in range(2))
        ),
    )
    mk(
        out,
        "dcp_merge_collective",
        "valid: SingleGroup (W=1)",
        lambda: dcp_merge_collective(SingleGroup(), OUTS[0], LSES[0]),
        "valid",
        check=expect_equal(bf_merge(OUTS[:1], LSES[:1]), **tol),
    )
    mk(
        out,
        "dcp_merge_collective",
        "group=None",
        lambda: dcp_merge_collective(None, OUTS[0], LSES[0]),
        "raise",
        "group",
    )  # type: ignore[arg-type]
    mk(
        out,
        "dcp_merge_collective",
        "H not divisible by W",
        lambda: run_coll(lambda r, kw: kw.update(out=kw["out"][:, :3], lse=kw["lse"][:, :3])),
        "raise",
        ("out", "H"),
    )
    mk(
        out,
        "dcp_merge_collective",
        "lse shape mismatch",
        lambda: run_coll(lambda r, kw: kw.update(lse=kw["lse"][:1])),
        "raise",
        "lse",
    )
    mk(
        out,
        "dcp_merge_collective",
        "out int",
        lambda: run_coll(lambda r, kw: kw.update(out=kw["out"].long())),
        "raise",
        "out",
    )
    mk(out, "dcp_merge_collective", "base='x'", lambda: run_coll(lambda r, kw: kw.update(base="x")), "raise", "base")

    if lt is not None:
        lm, lc = lt.lse_merge, lt.lse_correct
        mk(
            out,
            "lse_merge",
            "valid: brute force (empty, all-empty, NaN, +inf)",
            call_with(lm, b_mp),
            "valid",
            check=lambda r: (
                diff(r, bf_merge(OUTS, LSES)[0], **tol)
                if not isinstance(r, tuple)
                else diff(r[0], bf_merge(OUTS, LSES)[0], **tol)
            ),
        )
        mk(
            out,
            "lse_merge",
            "valid: merged_lse buffer, base 2",
            call_with(lm, b_mp, base="2", merged_lse=torch.empty(T, H)),
            "valid",
            check=expect_equal(bf_merge(OUTS, LSES, "2"), **tol),
        )
        mk(
            out,
            "lse_merge",
            "valid: float64 LSEs into a float64 merged_lse keep their precision",
            lambda: lm(torch.ones(2, 1, 1, 1), l64, merged_lse=torch.empty(1, 1, dtype=torch.float64)),
            "valid",
            check=lse_kept_f64,
        )
        mk(
            out,
            "lse_merge",
            "valid: near the float32 maximum",
            lambda: lm(torch.ones(2, 1, 1, 2), big, merged_lse=torch.empty(1, 1)),
            "valid",
            check=expect_equal(bf_merge(torch.ones(2, 1, 1, 2), big), **tol),
        )
        mk(
            out,
            "lse_merge",
            "valid: transposed outs view (any strides)",
            call_with(
                lm,
                b_mp,
                outs=From(lambda kw: kw["outs"].transpose(1, 2).contiguous().transpose(1, 2)),
                merged_lse=torch.empty(T, H),
            ),
            "valid",
            check=expect_equal(bf_merge(OUTS, LSES), **tol),
        )
        for label, kw, nm in (
            ("outs float64", dict(outs=OUTS.double()), "outs"),
            ("outs 3-D", dict(outs=OUTS[0]), "outs"),
            ("lses float16", dict(lses=LSES.half()), "lses"),
            ("lses wrong T", dict(lses=LSES[:, :1]), "lses"),
            ("merged wrong shape", dict(merged=torch.empty(T, H, D + 1)), "merged"),
            ("merged int", dict(merged=torch.empty(T, H, D, dtype=torch.int32)), "merged"),
            (
                "merged_lse float64 with float32 LSEs",
                dict(merged_lse=torch.empty(T, H, dtype=torch.float64)),
                "merged_lse",
            ),
            ("block_h=3", dict(block_h=3), "block_h"),
            ("block_h=512", dict(block_h=512), "block_h"),
            ("num_warps=0", dict(num_warps=0), "num_warps"),
            ("num_warps=True", dict(num_warps=True), "num_warps"),
            ("base='e '", dict(base="e "), "base"),
            ("validate=None", dict(validate=None), "validate"),
            ("outs on meta", dict(outs=meta_like(OUTS)), ("outs", "device")),
            ("lses a list", dict(lses=LSES.tolist()), "lses"),
        ):
            mk(out, "lse_merge", label, call_with(lm, b_mp, **kw), "raise", nm)
        mk(
            out,
            "lse_merge",
            "merged aliases outs",
            lambda: (lambda o: lm(o, LSES, merged=o[0]))(OUTS.clone()),
            "raise",
            ("merged", "outs"),
        )
        mk(
            out,
            "lse_merge",
            "merged_lse aliases lses",
            lambda: (lambda l_: lm(OUTS, l_, merged_lse=l_[0]))(LSES.clone()),
            "raise",
            ("merged_lse", "lses"),
        )
        mk(
            out,
            "lse_merge",
            "merged_lse aliases merged (same bytes)",
            lambda: (lambda m: lm(OUTS, LSES, merged=m, merged_lse=m.view(-1)[: T * H].view(T, H)))(
                torch.empty(T, H, D)
            ),
            "raise",
            ("merged_lse", "merged"),
        )
        mk(
            out,
            "lse_merge",
            "merged expanded (stride-0) view",
            call_with(lm, b_mp, merged=torch.empty(1, H, D).expand(T, H, D)),
            "either",
            "merged",
            check=lambda r: diff(r[0], bf_merge(OUTS, LSES)[0], **tol),
        )
        mk(
            out,
            "lse_merge",
            "merged_lse expanded (stride-0) view",
            call_with(lm, b_mp, merged_lse=torch.empty(1, H).expand(T, H)),
            "either",
            "merged_lse",
            check=lambda r: diff(r[1], bf_merge(OUTS, LSES)[1], **tol),
        )

        mk(
            out,
            "lse_correct",
            "valid: brute force",
            call_with(lc, b_cp, merged_lse=torch.empty(T, H)),
            "valid",
            check=expect_equal(bf_correct(1), **tol),
        )
        mk(
            out,
            "lse_correct",
            "valid: in place (corrected=out, the same view)",
            lambda: (lambda o: lc(o, LSES, 1, corrected=o))(OUTS[1].clone()),
            "valid",
            check=lambda r: diff(r[0], bf_correct(1)[0], **tol),
        )
        for label, kw, nm in (
            ("rank=W", dict(rank=W), "rank"),
            ("rank=-1", dict(rank=-1), "rank"),
            ("rank=1.0", dict(rank=1.0), "rank"),
            ("rank=None", dict(rank=None), "rank"),
            ("out float64", dict(out=OUTS[1].double()), "out"),
            ("out 4-D", dict(out=OUTS), "out"),
            ("all_lses 2-D", dict(all_lses=LSES[0]), "all_lses"),
            ("all_lses int", dict(all_lses=LSES.long()), "all_lses"),
            ("all_lses wrong H", dict(all_lses=LSES[..., :2]), "all_lses"),
            ("all_lses with W=0", dict(all_lses=LSES[:0], rank=0), ("all_lses", "rank")),
            ("corrected wrong shape", dict(corrected=torch.empty(T, H, D + 1)), "corrected"),
            ("block_h=6", dict(block_h=6), "block_h"),
            ("num_warps=64", dict(num_warps=64), "num_warps"),
            ("base=None", dict(base=None), "base"),
        ):
            mk(out, "lse_correct", label, call_with(lc, b_cp, **kw), "raise", nm)
        mk(
            out,
            "lse_correct",
            "corrected a partial view of out (overlap, not the same view)",
            lambda: (lambda o: lc(o[:, :3], LSES[:, :, :3].contiguous(), 1, corrected=o[:, 1:]))(OUTS[1].clone()),
            "raise",
            ("corrected", "out"),
        )
        mk(
            out,
            "lse_correct",
            "merged_lse aliases all_lses",
            lambda: (lambda l_: lc(OUTS[1], l_, 1, merged_lse=l_[0]))(LSES.clone()),
            "raise",
            ("merged_lse", "all_lses"),
        )
        mk(
            out,
            "lse_correct",
            "merged_lse aliases corrected",
            lambda: (lambda c: lc(OUTS[1], LSES, 1, corrected=c, merged_lse=c[..., 0]))(torch.empty(T, H, D)),
            "raise",
            ("merged_lse", "corrected"),
        )
        mk(
            out,
            "lse_correct",
            "corrected expanded (stride-0) view",
            call_with(lc, b_cp, corrected=torch.empty(1, H, D).expand(T, H, D)),
            "either",
            "corrected",
            check=lambda r: diff(r[0], bf_correct(1)[0], **tol),
        )
    return out


# ============================================================================================================
# 10. collectives: SimulatedWorld, SingleGroup
# ============================================================================================================
def group_cases() -> list[Case]:
    from dcp_ref import SimulatedWorld, SingleGroup

    out: list[Case] = []
    for label, kw, nm in (
        ("world_size=0", dict(world_size=0), "world_size"),
        ("world_size=-2", dict(world_size=-2), "world_size"),
        ("world_size=True", dict(world_size=True), "world_size"),
        ("world_size=2.0", dict(world_size=2.0), "world_size"),
        ("world_size='2'", dict(world_size="2"), "world_size"),
        ("world_size=None", dict(world_size=None), "world_size"),
        ("timeout_s=0", dict(world_size=2, timeout_s=0), "timeout_s"),
        ("timeout_s=-1", dict(world_size=2, timeout_s=-1.0), "timeout_s"),
        ("timeout_s='5'", dict(world_size=2, timeout_s="5"), "timeout_s"),
        ("timeout_s=nan", dict(world_size=2, timeout_s=NAN), "timeout_s"),
    ):
        mk(out, "SimulatedWorld", label, lambda kw=kw: SimulatedWorld(**kw), "raise", nm)
    mk(out, "SimulatedWorld.run", "fn not callable", lambda: SimulatedWorld(2).run(3, [0, 1]), "raise", "fn")  # type: ignore[arg-type]
    mk(
        out,
        "SimulatedWorld.run",
        "per-rank args of the wrong length",
        lambda: SimulatedWorld(2).run(lambda g, x: x, [0]),
        "raise",
        "per_rank_args",
    )

    def reraised() -> str:
        def body(g: Any, r: int) -> Any:
            if r == 0:
                raise KeyError("rank 0 fails")
            return g.all_gather(torch.zeros(2))

        try:
            SimulatedWorld(2, timeout_s=10).run(body, [0, 1])
        except KeyError as e:
            return f"KeyError {e}"
        return "nothing raised"

    mk(
        out,
        "SimulatedWorld.run",
        "valid: a rank's own error is re-raised (not a timeout of the others)",
        reraised,
        "valid",
        check=lambda r: None if r.startswith("KeyError") else r,
    )

    def world(fn: Callable[[Any, int], Any], W: int = 2) -> Callable[[], Any]:
        return lambda: SimulatedWorld(W, timeout_s=20).run(fn, list(range(W)))

    x = [torch.arange(6.0).view(2, 3) + 10 * r for r in range(3)]
    mk(
        out,
        "all_to_all",
        "valid: rank r's out[j] is rank j's x[r] (W=2)",
        world(lambda g, r: g.all_to_all(x[r].clone())),
        "valid",
        check=lambda rs: first(*(diff(rs[r], torch.stack([x[j][r] for j in range(2)])) for r in range(2))),
    )
    mk(
        out,
        "all_to_all",
        "valid: out buffer written and returned",
        world(lambda g, r: g.all_to_all(x[r].clone(), out=torch.empty(2, 3))),
        "valid",
        check=lambda rs: first(*(diff(rs[r], torch.stack([x[j][r] for j in range(2)])) for r in range(2))),
    )
    mk(
        out,
        "all_to_all",
        "valid: a non-contiguous x",
        world(lambda g, r: g.all_to_all(x[r].clone().t().contiguous().t())),
        "valid",
        check=lambda rs: first(*(diff(rs[r], torch.stack([x[j][r] for j in range(2)])) for r in range(2))),
    )
    for label, fn, nm in (
        ("x.shape[0] != W", lambda g, r: g.all_to_all(torch.zeros(3, 2)), "x"),
        ("x 0-d", lambda g, r: g.all_to_all(torch.tensor(1.0)), "x"),
        ("x a list", lambda g, r: g.all_to_all([[1.0], [2.0]]), "x"),
        ("out wrong shape", lambda g, r: g.all_to_all(torch.zeros(2, 3), out=torch.empty(2, 4)), "out"),
        (
            "out wrong dtype",
            lambda g, r: g.all_to_all(torch.zeros(2, 3), out=torch.empty(2, 3, dtype=torch.float64)),
            "out",
        ),
        ("out non-contiguous", lambda g, r: g.all_to_all(torch.zeros(2, 3), out=torch.empty(3, 2).t()), "out"),
        ("out aliases x", lambda g, r: (lambda t: g.all_to_all(t, out=t))(torch.zeros(2, 3)), ("out", "x")),
        ("out on meta", lambda g, r: g.all_to_all(torch.zeros(2, 3), out=torch.empty(2, 3, device=META)), "out"),
        ("ranks pass different shapes", lambda g, r: g.all_to_all(torch.zeros(2, 3 + r)), "x"),
        (
            "ranks pass different dtypes",
            lambda g, r: g.all_to_all(torch.zeros(2, 3, dtype=torch.float32 if r else torch.float64)),
            "x",
        ),
        (
            "ranks call different collectives",
            lambda g, r: g.all_to_all(torch.zeros(2, 3)) if r else g.all_gather(torch.zeros(2, 3)),
            ("x", "collective"),
        ),
    ):
        mk(out, "all_to_all", label, world(fn), "raise", nm)
    mk(
        out,
        "all_gather",
        "valid: W=3 rank order",
        world(lambda g, r: g.all_gather(x[r]), 3),
        "valid",
        check=lambda rs: first(*(diff(v, torch.stack(x)) for v in rs)),
    )
    for label, fn, nm in (
        ("x a float", lambda g, r: g.all_gather(1.0), "x"),
        ("out wrong shape", lambda g, r: g.all_gather(torch.zeros(2), out=torch.empty(2, 3)), "out"),
        ("out aliases x", lambda g, r: (lambda t: g.all_gather(t[0], out=t))(torch.zeros(2, 2)), ("out", "x")),
        ("ranks pass different shapes", lambda g, r: g.all_gather(torch.zeros(2 + r)), "x"),
    ):
        mk(out, "all_gather", label, world(fn), "raise", nm)
    y = [torch.arange(8.0).view(2, 4) * (r + 1) for r in range(2)]
    mk(
        out,
        "reduce_scatter",
        "valid: dim=1 sum in float64",
        world(lambda g, r: g.reduce_scatter(y[r], dim=1)),
        "valid",
        check=lambda rs: first(*(diff(rs[r], (y[0] + y[1])[:, 2 * r : 2 * r + 2]) for r in range(2))),
    )
    mk(
        out,
        "reduce_scatter",
        "valid: dim=-1",
        world(lambda g, r: g.reduce_scatter(y[r], dim=-1)),
        "valid",
        check=lambda rs: first(*(diff(rs[r], (y[0] + y[1])[:, 2 * r : 2 * r + 2]) for r in range(2))),
    )
    for label, fn, nm in (
        ("dim=2 out of range", lambda g, r: g.reduce_scatter(y[r], dim=2), "dim"),
        ("dim=True", lambda g, r: g.reduce_scatter(y[r], dim=True), "dim"),
        ("dim=1.0", lambda g, r: g.reduce_scatter(y[r], dim=1.0), "dim"),
        ("shape not divisible by W", lambda g, r: g.reduce_scatter(torch.zeros(3, 3), dim=0), "x"),
        ("out wrong shape", lambda g, r: g.reduce_scatter(y[r], dim=1, out=torch.empty(2, 4)), "out"),
        (
            "out aliases x",
            lambda g, r: (lambda t: g.reduce_scatter(t, dim=1, out=t[:, :2]))(y[r].clone()),
            ("out", "x"),
        ),
        ("x 0-d", lambda g, r: g.reduce_scatter(torch.tensor(1.0)), ("x", "dim")),
    ):
        mk(out, "reduce_scatter", label, world(fn), "raise", nm)
    sg = SingleGroup()
    mk(
        out,
        "SingleGroup",
        "valid: all_to_all is the identity",
        lambda: sg.all_to_all(torch.ones(1, 3)),
        "valid",
        check=expect_equal(torch.ones(1, 3)),
    )
    mk(out, "SingleGroup", "all_to_all x.shape[0]=2", lambda: sg.all_to_all(torch.ones(2, 3)), "raise", "x")
    mk(
        out,
        "SingleGroup",
        "all_gather out aliases x",
        lambda: (lambda t: sg.all_gather(t[0], out=t))(torch.ones(1, 3)),
        "raise",
        ("out", "x"),
    )
    mk(out, "SingleGroup", "reduce_scatter dim=5", lambda: sg.reduce_scatter(torch.ones(2, 2), dim=5), "raise", "dim")
    return out


# ============================================================================================================
# 11. the planned step: StepSpec / ScoringSpec / Stages options and PlannedStep.run from layer inputs
# ============================================================================================================
@dataclass
class StepProblem:
    """One decode layer on W ranks, built here from global data (no project helper): requests' KV rows and index
    scores over global positions, every rank's paged shard, and the single-device oracle."""

    W: int = 2
    I: int = 2
    bs: int = 4
    H: int = 4
    D: int = 8
    V: int = 4
    k: int = 4
    seq_lens: tuple[int, ...] = (13, 3)
    tok_req: tuple[int, ...] = (0, 1)
    sm: float = 0.5
    seed: int = 7
    scored: bool = False  #: index scores from FP8 index keys (the scoring stage) instead of precomputed ones
    Hi: int = 2  #: index heads when scored
    ties: bool = False  #: many equal index scores (the two total orders then differ)

    def __post_init__(self) -> None:
        g = gen(self.seed)
        self.T = len(self.tok_req)
        self.bound = [self.seq_lens[b] for b in self.tok_req]  # next_n = 1: the last position's causal bound
        self.kv_g = [torch.randn(n, self.D, generator=g) for n in self.seq_lens]
        self.q = torch.randn(self.T, self.H, self.D, generator=g)
        Lg = max(self.seq_lens)
        if self.scored:
            self.ikeys = [torch.randint(-2, 3, (n, 128), generator=g).float() for n in self.seq_lens]
            self.iscale = [
                torch.tensor([2.0 ** int(x) for x in torch.randint(-1, 2, (n,), generator=g)]) for n in self.seq_lens
            ]
            self.index_q = torch.randint(-2, 3, (self.T, self.Hi, 128), generator=g).float().to(torch.float8_e4m3fn)
            self.index_w = torch.randn(self.T, self.Hi, generator=g)
            sc = torch.full((self.T, Lg), NAN, dtype=torch.float64)
            for t, b in enumerate(self.tok_req):
                d = self.index_q[t].double() @ self.ikeys[b].double().t()  # [Hi, n]
                sc[t, : self.seq_lens[b]] = (self.index_w[t].double()[:, None] * d.clamp_min(0)).sum(0) * self.iscale[
                    b
                ].double()
            self.sc_g = sc.float()
        else:
            self.sc_g = torch.randn(self.T, Lg, generator=g)
            if self.ties:
                self.sc_g = (self.sc_g * 2).round() / 2

    # ---- one rank's shard (dcp: its positions; tp: everything, unsharded)
    def shard(self, r: int, layout: str = "dcp") -> tuple[Any, Any, torch.Tensor, torch.Tensor | None]:
        from dcp_ref import DcpGeometry, RankShard, StepMetadata

        Wc, rc = (self.W, r) if layout == "dcp" else (1, 0)
        geo = DcpGeometry(Wc, rc, self.I, self.bs)
        loc_len = [bf_local_len(n, Wc, rc, self.I) for n in self.seq_lens]
        M = max(1, max(-(-n // self.bs) for n in loc_len))
        B = len(self.seq_lens)
        nb = B * M + 1
        table = torch.full((B, M), -1, dtype=torch.int32)
        phys = list(range(nb - 1, 0, -1))  # scrambled physical order; block 0 never used
        g = gen(self.seed + 100 + r)
        kv = torch.randn(nb * self.bs, self.D, generator=g) * 100  # garbage where nothing is written
        icache = torch.full((nb, self.bs * 132), 0xFF, dtype=torch.uint8)
        for b, n in enumerate(loc_len):
            for j in range(-(-n // self.bs)):
                table[b, j] = phys.pop(0)
            for loc in range(n):
                p = bf_global(loc, Wc, rc, self.I)
                blk, off = int(table[b, loc // self.bs]), loc % self.bs
                kv[blk * self.bs + off] = self.kv_g[b][p]
                if self.scored:
                    icache[blk, off * 128 : (off + 1) * 128] = (
                        self.ikeys[b][p].to(torch.float8_e4m3fn).view(torch.uint8)
                    )
                    icache[blk, self.bs * 128 + 4 * off : self.bs * 128 + 4 * off + 4] = f32(
                        [float(self.iscale[b][p])]
                    ).view(torch.uint8)
        bounds = [bf_local_len(self.bound[t], Wc, rc, self.I) for t in range(self.T)]
        L = M * self.bs
        scores = None
        if not self.scored:
            scores = torch.full((self.T, L), 1e3)  # garbage past each bound: a tempting, plausible score
            for t in range(self.T):
                for loc in range(bounds[t]):
                    scores[t, loc] = self.sc_g[t, bf_global(loc, Wc, rc, self.I)]
        shard = RankShard(
            kv_cache=kv,
            block_table=table,
            index_scores=scores,
            geometry=geo,
            index_cache=icache if self.scored else None,
        )
        meta = StepMetadata(i32(bounds), i32(list(self.tok_req)))
        return shard, meta, self.q.clone(), scores

    def max_keys(self, layout: str = "dcp") -> int:
        Wc = self.W if layout == "dcp" else 1
        return (
            max(1, max(-(-bf_local_len(n, Wc, r, self.I) // self.bs) for n in self.seq_lens for r in range(Wc)))
            * self.bs
        )

    # ---- the single-device oracle
    def oracle(
        self,
        order: str = "global_id",
        sc: torch.Tensor | None = None,
        kv: list[torch.Tensor] | None = None,
        q: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sc = self.sc_g if sc is None else sc
        kv = self.kv_g if kv is None else kv
        q = self.q if q is None else q
        out = torch.zeros(self.T, self.H, self.V, dtype=torch.float64)
        lse = torch.full((self.T, self.H), -INF, dtype=torch.float64)
        for t, b in enumerate(self.tok_req):
            cand = []
            for p in range(self.bound[t]):
                s = float(sc[t, p])
                if math.isnan(s):
                    continue
                tie = (p,) if order == "global_id" else (bf_owner(p, self.W, self.I), bf_local(p, self.W, self.I))
                cand.append((-(_f32(s) + 0.0), tie, p))
            cand.sort()
            sel = [p for _, _, p in cand[: self.k]]
            if not sel:
                continue
            rows = kv[b][sel].double()
            for h in range(self.H):
                z = self.sm * (rows @ q[t, h].double())
                lse[t, h] = torch.logsumexp(z, 0)
                out[t, h] = torch.softmax(z, 0) @ rows[:, : self.V]
        return out, lse

    def spec(self, r: int, **kw: Any) -> Any:
        from dcp_ref import DcpGeometry, ScoringSpec, StepSpec

        layout = kw.get("layout", "dcp")
        sc = ScoringSpec(self.max_keys(layout), index_heads=self.Hi) if self.scored else None
        base = dict(
            max_tokens=self.T,
            topk=self.k,
            num_heads=self.H,
            head_dim=self.D,
            v_dim=self.V,
            sm_scale=self.sm,
            dtype=torch.float32,
            device="cpu",
            scoring=sc,
        )
        return StepSpec(DcpGeometry(self.W, r, self.I, self.bs), **{**base, **kw})

    def run(
        self,
        *,
        stages: Any = None,
        validate: bool = False,
        mutate: Callable[[int, dict[str, Any]], None] | None = None,
        **spec_kw: Any,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Plan and run the step on every rank (a SimulatedWorld); ``mutate(r, kw)`` edits rank r's
        ``{spec, shard, meta, q, index_q, index_weights, stages, validate}`` before the plan."""
        from dcp_ref import REFERENCE_STAGES, PlannedStep, SimulatedWorld

        layout = spec_kw.get("layout", "dcp")

        def body(group: Any, r: int) -> tuple[torch.Tensor, torch.Tensor]:
            shard, meta, q, _ = self.shard(r, layout)
            Hs = self.H // self.W
            if layout == "tp" or not spec_kw.get("q_replicate", True):
                q = q[:, r * Hs : (r + 1) * Hs].contiguous()
            kw: dict[str, Any] = dict(
                spec=self.spec(r, **spec_kw),
                shard=shard,
                meta=meta,
                q=q,
                stages=stages or REFERENCE_STAGES,
                validate=validate,
                group=group,
            )
            if self.scored:
                kw.update(index_q=self.index_q.clone(), index_weights=self.index_w.clone())
            if mutate is not None:
                mutate(r, kw)
            step = PlannedStep(kw["group"], kw["spec"], kw["stages"], validate=kw["validate"])
            extra = {n: kw[n] for n in ("index_q", "index_weights") if n in kw}
            o, lse = step.run(kw["q"], kw["shard"], kw["meta"], **extra)
            return o.clone(), lse.clone()

        return SimulatedWorld(self.W, timeout_s=60).run(body, list(range(self.W)))

    def check(
        self, want: tuple[torch.Tensor, torch.Tensor] | None = None, order: str = "global_id", tol: float = 1e-5
    ) -> Callable[[Any], str | None]:
        """Every rank returns its H/W heads of the oracle."""
        w_out, w_lse = self.oracle(order) if want is None else want
        Hs = self.H // self.W

        def check(rs: Any) -> str | None:
            for r, (o, lse) in enumerate(rs):
                d = diff(
                    (o, lse),
                    (w_out[:, r * Hs : (r + 1) * Hs], w_lse[:, r * Hs : (r + 1) * Hs]),
                    atol=tol,
                    rtol=tol,
                    what=f"rank {r}",
                )
                if d:
                    return d
            return None

        return check

    def poisoned(self, tokens: Sequence[int]) -> Callable[[Any], str | None]:
        """The tokens are NaN (output and LSE, every head) on every rank; the others match the oracle."""
        w_out, w_lse = self.oracle()
        Hs = self.H // self.W
        keep = [t for t in range(self.T) if t not in tokens]

        def check(rs: Any) -> str | None:
            for r, (o, lse) in enumerate(rs):
                d = first(
                    rows_nan(o, tokens, f"rank {r} out"),
                    rows_nan(lse, tokens, f"rank {r} lse"),
                    diff(
                        (o[keep], lse[keep]),
                        (w_out[keep, r * Hs : (r + 1) * Hs], w_lse[keep, r * Hs : (r + 1) * Hs]),
                        atol=1e-5,
                        rtol=1e-5,
                        what=f"rank {r} other tokens",
                    ),
                )
                if d:
                    return d
            return None

        return check


def step_cases() -> list[Case]:
    from dcp_ref import (
        REFERENCE_STAGES,
        DcpGeometry,
        PlannedStep,
        RankShard,
        ScoringSpec,
        SingleGroup,
        Stages,
        StepMetadata,
        StepSpec,
    )
    from dcp_ref.stages import resolve_stages

    out: list[Case] = []
    P = StepProblem()

    # ---- valid: every layer option against the single-device oracle
    options: list[tuple[str, dict[str, Any], str]] = [
        ("dcp, allgather, reduce_scatter, replicated q", {}, "global_id"),
        ("dcp, q all-gathered over heads (q_replicate=False)", dict(q_replicate=False), "global_id"),
        ("dcp, combine='alltoall'", dict(combine="alltoall"), "global_id"),
        ("dcp, exchange='owner'", dict(exchange="owner"), "global_id"),
        ("dcp, exchange='owner', order='rank_local'", dict(exchange="owner", order="rank_local"), "rank_local"),
        (
            "dcp, owner + rank_local + alltoall + gathered q",
            dict(exchange="owner", order="rank_local", combine="alltoall", q_replicate=False),
            "rank_local",
        ),
        ("tp layout", dict(layout="tp"), "global_id"),
        ("tp layout, exchange='owner'", dict(layout="tp", exchange="owner"), "global_id"),
    ]
    for label, kw, order in options:
        mk(out, "PlannedStep.run", f"valid: {label}", lambda kw=kw: P.run(**kw), "valid", check=P.check(order=order))
    Pt = StepProblem(ties=True, seed=3)
    for order, kw in (
        ("global_id", dict(exchange="owner")),
        ("rank_local", dict(exchange="owner", order="rank_local")),
    ):
        mk(
            out,
            "PlannedStep.run",
            f"valid: tied index scores, order={order} breaks ties as documented",
            lambda kw=kw: Pt.run(**kw),
            "valid",
            check=Pt.check(order=order),
        )
    Ps = StepProblem(scored=True, seed=5)
    for label, kw in (
        ("scoring from FP8 index keys", {}),
        ("scoring, owner + rank_local", dict(exchange="owner", order="rank_local")),
        ("scoring, tp layout", dict(layout="tp")),
    ):
        mk(
            out,
            "PlannedStep.run",
            f"valid: {label}",
            lambda kw=kw: Ps.run(**kw),
            "valid",
            check=Ps.check(order=kw.get("order", "global_id")),
        )
    Pe = StepProblem(seq_lens=(1, 6), seed=9)  # request 0 has one key, on rank 0 only: rank 1's row is empty
    mk(
        out,
        "PlannedStep.run",
        "valid: a rank with no key for a token (count 0), k > context",
        lambda: Pe.run(),
        "valid",
        check=Pe.check(),
    )
    P1 = StepProblem(W=1, I=1, seq_lens=(5, 2), seed=2)
    mk(out, "PlannedStep.run", "valid: W=1", lambda: P1.run(), "valid", check=P1.check())
    mk(
        out,
        "PlannedStep.run",
        "valid: T=0 gives empty results, no stage runs",
        lambda: P.run(
            mutate=lambda r, kw: kw.update(
                q=kw["q"][:0],
                meta=StepMetadata(i32([]), i32([])),
                shard=RankShard(
                    kw["shard"].kv_cache, kw["shard"].block_table, kw["shard"].index_scores[:0], kw["shard"].geometry
                ),
            )
        ),
        "valid",
        check=lambda rs: first(*(diff(x, (torch.zeros(0, 2, P.V), torch.zeros(0, 2))) for x in rs)),
    )
    Pn = StepProblem(seed=7)
    Pn.sc_g[0, 4] = NAN  # a masked key (NaN index score): never selected
    mk(out, "PlannedStep.run", "valid: a NaN index score is a masked key", lambda: Pn.run(), "valid", check=Pn.check())
    qn = P.q.clone()
    qn[1, 3, 0] = NAN
    mk(
        out,
        "PlannedStep.run",
        "valid: NaN in one query head -> exactly that (token, head) NaN, on its rank",
        lambda: P.run(mutate=lambda r, kw: kw.update(q=qn.clone())),
        "valid",
        check=P.check(P.oracle(q=qn)),
    )
    sel = [p for _, p in sorted((-(_f32(float(P.sc_g[0, p])) + 0.0), p) for p in range(P.bound[0]))[: P.k]]
    kvn = [x.clone() for x in P.kv_g]
    kvn[0][sel[0], 1] = NAN
    Pk = StepProblem()
    Pk.kv_g = kvn
    mk(
        out,
        "PlannedStep.run",
        "valid: NaN in a selected KV row -> that token NaN on every rank",
        lambda: Pk.run(),
        "valid",
        check=Pk.check(Pk.oracle()),
    )
    for desc, Pv in (("valid: validate=True on good inputs", P), ("valid: validate=True, scoring", Ps)):
        mk(out, "PlannedStep.run", desc, lambda Pv=Pv: Pv.run(validate=True), "valid", check=Pv.check())
    mk(
        out,
        "PlannedStep.run",
        "valid: a transposed (non-contiguous) q",
        lambda: P.run(mutate=lambda r, kw: kw.update(q=transposed(kw["q"]))),
        "either",
        "q",
        check=P.check(),
    )
    sk = _kernel("attention_splitkv_triton")
    ks = _kernel("stages")
    if sk is not None and ks is not None:

        def splitkv_stage(
            q: torch.Tensor,
            kv: torch.Tensor,
            slots: torch.Tensor,
            counts: torch.Tensor,
            sm: float,
            v: int,
            *,
            out: torch.Tensor | None = None,
            out_lse: torch.Tensor | None = None,
        ) -> Any:
            with ks.KERNEL_LOCK:  # the interpreter is not thread-safe: SimulatedWorld ranks take this lock
                return sk.splitkv_attention(q, kv, slots, counts, sm, v, out=out, out_lse=out_lse)

        mk(
            out,
            "PlannedStep.run",
            "valid: the split-KV Triton attention as the stage",
            lambda: P.run(stages=REFERENCE_STAGES.with_(attention=splitkv_stage)),
            "valid",
            check=P.check(),
        )
    if _kernel("stages") is not None:

        def kstages() -> Any:
            return resolve_stages("kernels", P.spec(0))

        mk(
            out,
            "PlannedStep.run",
            "valid: stages='kernels' on the CPU (Triton interpreter)",
            lambda: P.run(stages=kstages()),
            "valid",
            check=P.check(),
        )
        mk(
            out,
            "PlannedStep.run",
            "valid: stages='kernels', owner + alltoall",
            lambda: P.run(stages=kstages(), exchange="owner", combine="alltoall"),
            "valid",
            check=P.check(),
        )
        mk(
            out,
            "PlannedStep.run",
            "kernels: request id out of range -> NaN token on every rank",
            lambda: P.run(
                stages=kstages(),
                mutate=lambda r, kw: kw.update(meta=StepMetadata(kw["meta"].local_bounds, i32([2, 1]))),
            ),
            "poison",
            check=P.poisoned([0]),
        )

    # ---- validate=False: out-of-contract metadata comes back NaN (every head, every rank); validate=True refuses
    def meta_edit(**fields: Any) -> Callable[[int, dict[str, Any]], None]:
        def m(r: int, kw: dict[str, Any]) -> None:
            mt = kw["meta"]
            vals = dict(local_bounds=mt.local_bounds, req_of_token=mt.req_of_token, row_starts=mt.row_starts)
            for k_, v_ in fields.items():
                vals[k_] = v_(r, vals) if callable(v_) else v_
            kw["meta"] = StepMetadata(**vals)

        return m

    def table_edit(fn: Callable[[int, torch.Tensor], torch.Tensor]) -> Callable[[int, dict[str, Any]], None]:
        def m(r: int, kw: dict[str, Any]) -> None:
            sh = kw["shard"]
            kw["shard"] = RankShard(
                sh.kv_cache, fn(r, sh.block_table.clone()), sh.index_scores, sh.geometry, sh.index_cache
            )

        return m

    bad_meta: list[tuple[str, Callable[[int, dict[str, Any]], None], list[int], tuple[str, ...], StepProblem]] = [
        ("request id == B", meta_edit(req_of_token=i32([2, 1])), [0], ("meta.req_of_token",), P),
        ("negative request id", meta_edit(req_of_token=i32([0, -1])), [1], ("meta.req_of_token",), P),
        ("int64 request id 2**32", meta_edit(req_of_token=i64([0, 2**32 + 1])), [1], ("meta.req_of_token",), P),
        (
            "negative local bound (rank 1)",
            meta_edit(local_bounds=lambda r, v: i32([-1, int(v["local_bounds"][1])]) if r else v["local_bounds"]),
            [0],
            ("meta.local_bounds",),
            P,
        ),
        (
            "local bound past the index scores",
            meta_edit(local_bounds=lambda r, v: i32([99, int(v["local_bounds"][1])])),
            [0],
            ("meta.local_bounds", "shard.index_scores", "index_scores"),
            P,
        ),
        ("negative row start", meta_edit(row_starts=i32([0, -1])), [1], ("meta.row_starts",), P),
        (
            "row start + bound past the scores",
            meta_edit(row_starts=i32([0, 7])),
            [1],
            ("meta.row_starts", "shard.index_scores", "index_scores"),
            P,
        ),
        (
            "row_starts 2**63-1 with bound 1 (the sum wraps)",
            meta_edit(row_starts=i64([2**63 - 1, 0]), local_bounds=lambda r, v: i32([1, int(v["local_bounds"][1])])),
            [0],
            ("meta.row_starts", "index_scores"),
            P,
        ),
        (
            "int64 bound 2**63-1 with row_start 1 (the sum wraps)",
            meta_edit(row_starts=i64([1, 0]), local_bounds=lambda r, v: i64([2**63 - 1, int(v["local_bounds"][1])])),
            [0],
            ("meta.local_bounds", "meta.row_starts", "index_scores", "block_table"),
            P,
        ),
        (
            "a block under a token's local length is -1 (rank 1 only)",
            table_edit(lambda r, t: t.index_fill(1, i64([0]), -1) if r else t),
            [0, 1],
            ("shard.block_table", "block_table"),
            P,
        ),
        (
            "the table is too short for a local length",
            table_edit(lambda r, t: t[:, :1].contiguous()),
            [0],
            ("shard.block_table", "block_table"),
            P,
        ),
        (
            "a block id past the KV cache (selected keys)",
            table_edit(lambda r, t: t.masked_fill(t >= 0, 10_000) if r else t),
            [0, 1],
            ("shard.block_table", "shard.kv_cache", "kv_cache"),
            P,
        ),
        (
            "a block id whose slots exceed int32",
            table_edit(lambda r, t: t.masked_fill(t >= 0, 2**30) if r else t),
            [0, 1],
            ("shard.block_table", "block_table"),
            P,
        ),
    ]
    for label, mut, toks, names, prob in bad_meta:
        mk(
            out,
            "PlannedStep.run",
            f"validate=False, {label} -> NaN token",
            lambda mut=mut, prob=prob: prob.run(mutate=mut),
            "poison",
            check=prob.poisoned(toks),
        )
        mk(
            out,
            "PlannedStep.run",
            f"validate=True, {label}",
            lambda mut=mut, prob=prob: prob.run(validate=True, mutate=mut),
            "raise",
            names,
        )
    for label, kw in (
        ("owner exchange", dict(exchange="owner")),
        ("rank_local order", dict(exchange="owner", order="rank_local")),
        ("alltoall combine", dict(combine="alltoall")),
        ("tp layout", dict(layout="tp")),
    ):
        mk(
            out,
            "PlannedStep.run",
            f"validate=False, {label}: request id out of range -> NaN token",
            lambda kw=kw: P.run(mutate=meta_edit(req_of_token=i32([0, 7])), **kw),
            "poison",
            check=P.poisoned([1]),
        )
        mk(
            out,
            "PlannedStep.run",
            f"validate=False, {label}: missing block -> NaN token",
            lambda kw=kw: P.run(mutate=table_edit(lambda r, t: t.index_fill(1, i64([0]), -1)), **kw),
            "poison",
            check=P.poisoned([0, 1]),
        )

    def scored_edit(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[int, dict[str, Any]], None]:
        return lambda r, kw: kw.update({name: fn(kw[name].clone())})

    iqn = _nan_fp8_row(Ps.index_q.view(Ps.T, Ps.Hi, 128).clone(), 1)
    for label, mut, toks, names in (
        ("NaN index query", lambda r, kw: kw.update(index_q=iqn.clone()), [1], ("index_q",)),
        (
            "inf index weight",
            scored_edit("index_weights", lambda w: w.index_fill(0, i64([0]), INF)),
            [0],
            ("index_weights",),
        ),
        (
            "the index cache is shorter than the table",
            lambda r, kw: kw.update(
                shard=RankShard(
                    kw["shard"].kv_cache,
                    kw["shard"].block_table,
                    None,
                    kw["shard"].geometry,
                    kw["shard"].index_cache[:2].contiguous(),
                )
            ),
            [0, 1],
            ("shard.index_cache", "index_cache"),
        ),
        ("request id out of range", meta_edit(req_of_token=i32([0, 5])), [1], ("meta.req_of_token",)),
    ):
        mk(
            out,
            "PlannedStep.run",
            f"scoring, validate=False, {label} -> NaN token",
            lambda mut=mut: Ps.run(mutate=mut),
            "poison",
            check=Ps.poisoned(toks),
        )
        mk(
            out,
            "PlannedStep.run",
            f"scoring, validate=True, {label}",
            lambda mut=mut: Ps.run(validate=True, mutate=mut),
            "raise",
            names,
        )
    Pm = StepProblem(scored=True, seed=6, tok_req=(0, 0, 1, 1))
    mk(
        out,
        "PlannedStep.run",
        "scoring next_n=2, validate=False, a group naming two requests -> both NaN",
        lambda: Pm.run(
            scoring=ScoringSpec(Pm.max_keys(), index_heads=Pm.Hi, next_n=2),
            mutate=meta_edit(req_of_token=i32([0, 1, 1, 1])),
        ),
        "poison",
        check=lambda rs: first(*(first(rows_nan(o, [0, 1]), rows_nan(lse, [0, 1])) for o, lse in rs)),
    )
    mk(
        out,
        "PlannedStep.run",
        "scoring next_n=2, validate=True, a group naming two requests",
        lambda: Pm.run(
            validate=True,
            scoring=ScoringSpec(Pm.max_keys(), index_heads=Pm.Hi, next_n=2),
            mutate=meta_edit(req_of_token=i32([0, 1, 1, 1])),
        ),
        "raise",
        ("meta.req_of_token", "next_n"),
    )

    # ---- bad run arguments (always checked)
    def with_shard(**fields: Any) -> Callable[[int, dict[str, Any]], None]:
        def m(r: int, kw: dict[str, Any]) -> None:
            sh = kw["shard"]
            vals = dict(
                kv_cache=sh.kv_cache,
                block_table=sh.block_table,
                index_scores=sh.index_scores,
                geometry=sh.geometry,
                index_cache=sh.index_cache,
            )
            for k_, v_ in fields.items():
                vals[k_] = v_(vals[k_]) if callable(v_) and not isinstance(v_, type) else v_
            kw["shard"] = RankShard(**vals)

        return m

    for label, mut, names in (
        ("q float64", lambda r, kw: kw.update(q=kw["q"].double()), ("q",)),
        ("q with H/W heads though the query is replicated", lambda r, kw: kw.update(q=kw["q"][:, :2]), ("q",)),
        ("q with more tokens than max_tokens", lambda r, kw: kw.update(q=torch.cat([kw["q"], kw["q"]])), ("q",)),
        ("q on meta", lambda r, kw: kw.update(q=meta_like(kw["q"])), ("q",)),
        ("q a list", lambda r, kw: kw.update(q=kw["q"].tolist()), ("q",)),
        ("shard a dict", lambda r, kw: kw.update(shard=vars(kw["shard"])), ("shard",)),
        ("shard.geometry None", with_shard(geometry=None), ("shard.geometry",)),
        (
            "shard.geometry of another interleave",
            with_shard(geometry=lambda g: DcpGeometry(g.world_size, g.rank, 1, g.block_size)),
            ("shard.geometry",),
        ),
        ("shard.geometry of another rank", with_shard(geometry=lambda g: g.with_rank(1 - g.rank)), ("shard.geometry",)),
        ("shard.kv_cache int", with_shard(kv_cache=lambda c: c.long()), ("kv_cache",)),
        ("shard.kv_cache row width != head_dim", with_shard(kv_cache=lambda c: c[:, :6].contiguous()), ("kv_cache",)),
        ("shard.kv_cache 1-D", with_shard(kv_cache=lambda c: c.reshape(-1)), ("kv_cache",)),
        ("shard.block_table float", with_shard(block_table=lambda t: t.float()), ("block_table",)),
        ("shard.block_table 1-D", with_shard(block_table=lambda t: t.reshape(-1)), ("block_table",)),
        ("shard.index_scores float64", with_shard(index_scores=lambda s: s.double()), ("index_scores",)),
        ("shard.index_scores one row short", with_shard(index_scores=lambda s: s[:1]), ("index_scores",)),
        ("shard.index_scores None without a scoring spec", with_shard(index_scores=None), ("index_scores",)),
        ("meta a tuple", lambda r, kw: kw.update(meta=(kw["meta"].local_bounds, kw["meta"].req_of_token)), ("meta",)),
        (
            "meta.local_bounds float",
            meta_edit(local_bounds=lambda r, v: v["local_bounds"].float()),
            ("meta.local_bounds",),
        ),
        (
            "meta.req_of_token one short",
            meta_edit(req_of_token=lambda r, v: v["req_of_token"][:1]),
            ("meta.req_of_token",),
        ),
        ("meta.row_starts 2-D", meta_edit(row_starts=i32([[0, 0]])), ("meta.row_starts",)),
    ):
        mk(out, "PlannedStep.run", label, lambda mut=mut: P.run(mutate=mut), "raise", names)
    for label, mut, names in (
        ("scoring: index_q missing", lambda r, kw: kw.pop("index_q"), ("index_q",)),
        ("scoring: index_q 64 wide", scored_edit("index_q", lambda x: x[..., :64]), ("index_q",)),
        ("scoring: index_weights float64", scored_edit("index_weights", lambda x: x.double()), ("index_weights",)),
        ("scoring: index_weights one head short", scored_edit("index_weights", lambda x: x[:, :1]), ("index_weights",)),
        ("scoring: shard.index_cache None", with_shard(index_cache=None), ("index_cache",)),
        (
            "scoring: shard.index_cache of another block size",
            with_shard(index_cache=lambda c: c.view(-1)[: 5 * 2 * 132].view(5, 264)),
            ("index_cache",),
        ),
    ):
        mk(out, "PlannedStep.run", label, lambda mut=mut: Ps.run(mutate=mut), "raise", names)

    # ---- plan-time refusals: the group, the stages
    mk(
        out,
        "PlannedStep",
        "group of another rank",
        lambda: P.run(mutate=lambda r, kw: kw.update(spec=P.spec(1 - r))),
        "raise",
        "group",
    )
    mk(
        out,
        "PlannedStep",
        "a group object without collectives",
        lambda: PlannedStep(object(), P.spec(0), REFERENCE_STAGES),
        "raise",
        "group",
    )  # type: ignore[arg-type]
    mk(
        out,
        "PlannedStep",
        "SingleGroup for a W=2 spec",
        lambda: PlannedStep(SingleGroup(), P.spec(0)),
        "raise",
        "group",
    )
    mk(out, "PlannedStep", "spec a dict", lambda: PlannedStep(SingleGroup(), {}), "raise", "spec")  # type: ignore[arg-type]
    mk(
        out,
        "PlannedStep",
        "valid: stages named 'reference' (resolved for the spec)",
        lambda: PlannedStep(SingleGroup(), P1.spec(0), "reference"),
        "valid",
        check=lambda step: None if step.stages is REFERENCE_STAGES else f"planned {step.stages.name}",
    )
    mk(
        out,
        "PlannedStep",
        "stages an unknown provider 'fastest'",
        lambda: PlannedStep(SingleGroup(), P1.spec(0), "fastest"),
        "raise",
        "stages",
    )
    mk(out, "PlannedStep", "stages=3", lambda: PlannedStep(SingleGroup(), P1.spec(0), 3), "raise", "stages")  # type: ignore[arg-type]
    mk(
        out,
        "PlannedStep",
        "validate='no'",
        lambda: PlannedStep(SingleGroup(), P1.spec(0), validate="no"),
        "raise",
        "validate",
    )  # type: ignore[arg-type]
    mk(
        out,
        "PlannedStep",
        "a custom select stage without out= (W = 2: one rank's cache selects nothing)",
        lambda: P.run(stages=REFERENCE_STAGES.with_(select=lambda gathered, k: gathered)),
        "raise",
        ("select", "out"),
    )
    mk(
        out,
        "PlannedStep",
        "stages.prepare returns a dict",
        lambda: PlannedStep(SingleGroup(), P1.spec(0), REFERENCE_STAGES.with_(prepare=lambda s, st: {})),
        "raise",
        "prepare",
    )

    def bad_select(gathered: torch.Tensor, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.zeros(gathered.shape[1], k + 1, dtype=torch.int32)

    def bad_attention(*args: Any, out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None) -> Any:
        return out

    mk(
        out,
        "PlannedStep.run",
        "a custom select stage returns the wrong shape (W = 2)",
        lambda: P.run(stages=REFERENCE_STAGES.with_(select=bad_select)),
        "raise",
        "select",
    )
    mk(
        out,
        "PlannedStep.run",
        "a custom attention stage returns one tensor, not a pair",
        lambda: P1.run(stages=REFERENCE_STAGES.with_(attention=bad_attention)),
        "raise",
        "attention",
    )
    mk(out, "Stages", "a stage that is not callable", lambda: Stages(select=3), "raise", "select")  # type: ignore[arg-type]
    mk(out, "Stages", "attention_layout='dense'", lambda: Stages(attention_layout="dense"), "raise", "attention_layout")
    mk(
        out,
        "Stages",
        "with_ an unknown stage",
        lambda: REFERENCE_STAGES.with_(selekt=len),
        "raise",
        ("selekt", "stage"),
    )
    mk(out, "Stages", "notes not pairs", lambda: Stages(notes=("x",)), "raise", "notes")  # type: ignore[arg-type]
    mk(
        out,
        "resolve_stages",
        "unknown provider",
        lambda: resolve_stages("nope", P.spec(0)),
        "raise",
        "stages",
    )
    mk(
        out,
        "resolve_stages",
        "kv_format='fp4'",
        lambda: P.spec(0, kv_format="fp4"),
        "raise",
        "kv_format",
    )
    mk(out, "resolve_stages", "stages=3", lambda: resolve_stages(3, P.spec(0)), "raise", "stages")  # type: ignore[arg-type]
    mk(out, "resolve_stages", "spec='cpu'", lambda: resolve_stages("reference", "cpu"), "raise", "spec")  # type: ignore[arg-type]

    # ---- StepSpec / ScoringSpec: a spec the step cannot run is refused at construction, naming the field
    geo = DcpGeometry(2, 0, 1, 4)
    good = dict(max_tokens=2, topk=4, num_heads=4, head_dim=8, v_dim=4, sm_scale=0.5, dtype=torch.float32, device="cpu")
    for label, kw, nm in (
        ("geometry a tuple", dict(geometry=(2, 0)), "geometry"),
        ("max_tokens=0", dict(max_tokens=0), "max_tokens"),
        ("max_tokens=True", dict(max_tokens=True), "max_tokens"),
        ("max_tokens=2.0", dict(max_tokens=2.0), "max_tokens"),
        ("topk=0", dict(topk=0), "topk"),
        ("topk='4'", dict(topk="4"), "topk"),
        ("num_heads=3 (not divisible by W=2)", dict(num_heads=3), "num_heads"),
        ("num_heads=-4", dict(num_heads=-4), "num_heads"),
        ("head_dim=0", dict(head_dim=0), "head_dim"),
        ("v_dim=0", dict(v_dim=0), "v_dim"),
        ("v_dim > head_dim", dict(v_dim=9), "v_dim"),
        ("v_dim=None", dict(v_dim=None), "v_dim"),
        ("sm_scale=0", dict(sm_scale=0.0), "sm_scale"),
        ("sm_scale=nan", dict(sm_scale=NAN), "sm_scale"),
        ("sm_scale=inf", dict(sm_scale=INF), "sm_scale"),
        ("sm_scale=-1", dict(sm_scale=-1.0), "sm_scale"),
        ("sm_scale='0.5'", dict(sm_scale="0.5"), "sm_scale"),
        ("sm_scale=True", dict(sm_scale=True), "sm_scale"),
        ("sm_scale a 0-d tensor", dict(sm_scale=torch.tensor(0.5)), "sm_scale"),
        ("dtype='float32'", dict(dtype="float32"), "dtype"),
        ("dtype=torch.int32", dict(dtype=torch.int32), "dtype"),
        ("dtype=torch.bool", dict(dtype=torch.bool), "dtype"),
        ("dtype=torch.complex64", dict(dtype=torch.complex64), "dtype"),
        ("device=0 (an int)", dict(device=0), "device"),
        ("device='gpu'", dict(device="gpu"), "device"),
        ("device='cuda' on a machine without CUDA", dict(device="cuda"), "device"),
        ("layout='ep'", dict(layout="ep"), "layout"),
        ("layout=None", dict(layout=None), "layout"),
        ("exchange='p2p'", dict(exchange="p2p"), "exchange"),
        ("order='score'", dict(order="score"), "order"),
        ("order='rank_local' with exchange='allgather'", dict(order="rank_local"), ("order", "exchange")),
        ("combine='allreduce'", dict(combine="allreduce"), "combine"),
        ("q_replicate='no'", dict(q_replicate="no"), "q_replicate"),
        ("q_replicate=0", dict(q_replicate=0), "q_replicate"),
        ("q_replicate=None", dict(q_replicate=None), "q_replicate"),
        ("scoring a dict", dict(scoring={"max_keys": 8}), "scoring"),
        ("scoring=8", dict(scoring=8), "scoring"),
    ):
        mk(out, "StepSpec", label, lambda kw=kw: StepSpec(**{"geometry": geo, **good, **kw}), "raise", nm)
    mk(
        out,
        "StepSpec",
        "geometry positional-only fields passed by keyword order (max_tokens positional)",
        lambda: StepSpec(geo, 2, 4, 4, 8, 4, 0.5, torch.float32, "cpu"),
        "raise",
        ("positional", "max_tokens"),
    )  # type: ignore[misc]
    mk(
        out,
        "StepSpec",
        "valid: sm_scale as numpy float32 ('numpy floats are floats')",
        lambda: StepSpec(geo, **{**good, "sm_scale": np.float32(0.5)}),
        "valid",
        check=lambda s: None if s.sm_scale == 0.5 and type(s.sm_scale) is float else f"sm_scale {s.sm_scale!r}",
    )
    mk(
        out,
        "StepSpec",
        "valid: numpy int fields",
        lambda: StepSpec(geo, **{**good, "topk": np.int64(4), "max_tokens": np.int32(2)}),
        "valid",
        check=lambda s: None if (s.topk, type(s.topk)) == (4, int) else f"topk {s.topk!r}",
    )
    mk(
        out,
        "StepSpec",
        "valid: derived head counts (dcp, q gathered)",
        lambda: StepSpec(geo, **{**good, "q_replicate": False}),
        "valid",
        check=lambda s: None if (s.heads_per_rank, s.attention_heads, s.query_heads) == (2, 4, 2) else "heads",
    )
    mk(
        out,
        "StepSpec",
        "valid: tp cache geometry is one rank",
        lambda: StepSpec(geo, **{**good, "layout": "tp"}),
        "valid",
        check=lambda s: (
            None if s.cache_geometry == DcpGeometry(1, 0, 1, 4) and s.attention_heads == 2 else "tp geometry"
        ),
    )
    mk(
        out,
        "PlannedStep",
        "a spec with scoring.max_keys too small for the table (run time, validate=True)",
        lambda: Ps.run(validate=True, scoring=ScoringSpec(4, index_heads=Ps.Hi)),
        "raise",
        ("max_keys", "spec.scoring"),
    )
    mk(
        out,
        "PlannedStep",
        "a spec with scoring.index_heads != index_q's heads",
        lambda: Ps.run(scoring=ScoringSpec(Ps.max_keys(), index_heads=3)),
        "raise",
        ("index_q", "index_heads"),
    )
    for label, kw, nm in (
        ("max_keys=0", dict(max_keys=0), "max_keys"),
        ("max_keys=-1", dict(max_keys=-1), "max_keys"),
        ("max_keys=8.0", dict(max_keys=8.0), "max_keys"),
        ("index_heads=0", dict(max_keys=8, index_heads=0), "index_heads"),
        ("index_dim=64", dict(max_keys=8, index_dim=64), "index_dim"),
        ("next_n=0", dict(max_keys=8, next_n=0), "next_n"),
        ("next_n=True", dict(max_keys=8, next_n=True), "next_n"),
        ("next_n='2'", dict(max_keys=8, next_n="2"), "next_n"),
        ("max_keys=None", dict(max_keys=None), "max_keys"),
    ):
        mk(out, "ScoringSpec", label, lambda kw=kw: ScoringSpec(**kw), "raise", nm)
    mk(
        out,
        "StepSpec",
        "scoring next_n=3 that cannot divide max_tokens=2",
        lambda: StepSpec(geo, **{**good, "scoring": ScoringSpec(8, next_n=3)}),
        "raise",
        ("next_n", "max_tokens"),
    )
    return out


# ============================================================================================================
# 12. the cost model's layer options
# ============================================================================================================
def costmodel_cases() -> list[Case]:
    from dcp_ref.costmodel import (
        Hardware,
        MlaGeometry,
        QueryProjection,
        dcp_step_cost,
        q_replication_bytes,
        tp_step_cost,
    )
    from dcp_ref.options import LayerOptions

    out: list[Case] = []

    def opts(**axes: Any) -> From:
        """``options=`` built when the case runs (a bad axis raises there, in LayerOptions, as a caller sees it)."""
        return From(lambda _kw: LayerOptions(**axes))

    def b_dcp() -> dict[str, Any]:
        return dict(world_size=4, tokens=8, context=4096)

    for name, fn in (("dcp_step_cost", dcp_step_cost), ("tp_step_cost", tp_step_cost)):
        for arg, lo in (("world_size", 1), ("tokens", 1), ("context", 1)):
            scalar_cases(out, name, fn, b_dcp, arg, lo)
        for label, kw, nm in (
            ("world_size=3 does not divide 128 heads", dict(world_size=3), "world_size"),
            ("geometry None", dict(geometry=None), "geometry"),
            ("geometry a dict", dict(geometry={}), "geometry"),
            ("hardware None", dict(hardware=None), "hardware"),
            ("constants 'fit'", dict(constants="fit"), "constants"),
            ("scope='model'", dict(scope="model"), "scope"),
            ("scope=None", dict(scope=None), "scope"),
            ("graph='yes'", dict(graph="yes"), "graph"),
            ("graph=1", dict(graph=1), "graph"),
            ("options exchange='p2p'", dict(options=opts(exchange="p2p")), "exchange"),
            ("options exchange=None", dict(options=opts(exchange=None)), "exchange"),
            ("options exchange=['owner'] (a list)", dict(options=opts(exchange=["owner"])), "exchange"),
            ("options order='score'", dict(options=opts(order="score")), "order"),
            ("options order='rank_local' with exchange='allgather'", dict(options=opts(order="rank_local")),
             ("order", "exchange")),
            ("options None", dict(options=None), "options"),
            ("options a dict", dict(options={"exchange": "owner"}), "options"),
            ("exchange= (a loose option, no longer taken)", dict(exchange="owner"), ("exchange", "unexpected")),
        ):  # fmt: skip
            mk(
                out,
                name,
                label,
                call_with(fn, b_dcp, **kw),
                "raise",
                nm,
                exc=TypeError if "list" in label or "None" in label or "a dict" in label or "'fit'" in label else None,
            )
    for label, kw, nm in (
        ("options combine='allreduce'", dict(options=opts(combine="allreduce")), "combine"),
        ("options combine=None", dict(options=opts(combine=None)), "combine"),
        ("options q_replicate='no'", dict(options=opts(q_replicate="no")), "q_replicate"),
        ("options q_replicate=1", dict(options=opts(q_replicate=1)), "q_replicate"),
        ("options q_replicate=None", dict(options=opts(q_replicate=None)), "q_replicate"),
    ):
        mk(out, "dcp_step_cost", label, call_with(dcp_step_cost, b_dcp, **kw), "raise", nm)

    # valid: the documented relations
    for ex, order in (("allgather", "global_id"), ("owner", "global_id"), ("owner", "rank_local")):
        mk(
            out,
            "dcp_step_cost",
            f"valid: W=1 equals tp_step_cost at W=1 (exchange={ex}, order={order})",
            lambda ex=ex, order=order: (
                dcp_step_cost(
                    1, 8, 4096, options=LayerOptions(exchange=ex, order=order, combine="alltoall", q_replicate=True)
                ).total_s,
                tp_step_cost(1, 8, 4096, options=LayerOptions(layout="tp", exchange=ex, order=order)).total_s,
            ),
            "valid",
            check=lambda r: diff(r[0], r[1], rtol=1e-12),
        )
    mk(
        out,
        "dcp_step_cost",
        "valid: q_replicate=True drops the query all-gather",
        lambda: dcp_step_cost(4, 8, 4096, options=LayerOptions(q_replicate=True)),
        "valid",
        check=lambda c: (
            None
            if "query_allgather" not in c.stages_s and "query_allgather" not in c.comm
            else f"stages {list(c.stages_s)}"
        ),
    )
    mk(
        out,
        "dcp_step_cost",
        "valid: rank_local moves 4 bytes per candidate (half of global_id)",
        lambda: (
            dcp_step_cost(4, 8, 4096, options=LayerOptions(exchange="owner", order="rank_local"))
            .comm["candidates_allgather"]
            .sent,
            dcp_step_cost(4, 8, 4096, options=LayerOptions(exchange="owner")).comm["candidates_allgather"].sent,
        ),
        "valid",
        check=lambda r: None if r[0] * 2 == r[1] == 8 * 2048 * 8 else f"bytes {r}",
    )
    mk(
        out,
        "dcp_step_cost",
        "valid: combine='alltoall' replaces the LSE all-gather and reduce-scatter",
        lambda: dcp_step_cost(4, 8, 4096, options=LayerOptions(combine="alltoall")),
        "valid",
        check=lambda c: (
            None
            if "combine_alltoall" in c.stages_s
            and "lse_allgather" not in c.stages_s
            and "output_reduce_scatter" not in c.comm
            else f"stages {list(c.stages_s)}"
        ),
    )
    mk(
        out,
        "dcp_step_cost",
        "valid: scope='step' has no query all-gather and no index scoring",
        lambda: dcp_step_cost(4, 8, 4096, scope="step"),
        "valid",
        check=lambda c: (
            None if not {"query_allgather", "index_scoring"} & set(c.stages_s) else f"stages {list(c.stages_s)}"
        ),
    )
    mk(
        out,
        "dcp_step_cost",
        "valid: numpy ints",
        lambda: dcp_step_cost(np.int64(4), np.int32(8), np.int64(4096)).total_s,
        "valid",
        check=lambda t: diff(t, dcp_step_cost(4, 8, 4096).total_s),
    )
    mk(
        out,
        "dcp_step_cost",
        "valid: context shorter than topk",
        lambda: dcp_step_cost(2, 1, 100).attention_flops,
        "valid",
        check=lambda f: None if f > 0 else f"flops {f}",
    )

    per_layer = 1536 * 128 * 192 * (1 + 4 / 128**2) + 128 * 128 * 512 * 2.0
    mk(
        out,
        "q_replication_bytes",
        "valid: (1 - 1/W) of the layers' q_b_proj + W_UK bytes (W=8)",
        lambda: q_replication_bytes(8),
        "valid",
        check=lambda b: diff(b, (1 - 1 / 8) * per_layer * 61, rtol=1e-12),
    )
    mk(
        out,
        "q_replication_bytes",
        "valid: W=1 replicates nothing",
        lambda: q_replication_bytes(1),
        "valid",
        check=lambda b: diff(b, 0.0),
    )
    for label, args, nm in (
        ("world_size=0", (0,), "world_size"),
        ("world_size=True", (True,), "world_size"),
        ("world_size=2.5", (2.5,), "world_size"),
        ("world_size='8'", ("8",), "world_size"),
        ("world_size=3 does not divide 128 heads (dcp_step_cost refuses it)", (3,), "world_size"),
        ("geometry None", (8, None), "geometry"),
        ("projection a dict", (8, MlaGeometry(), {}), "projection"),
    ):
        mk(out, "q_replication_bytes", label, lambda a=args: q_replication_bytes(*a), "raise", nm)
    mk(
        out,
        "QueryProjection",
        "valid: parameters per layer",
        lambda: QueryProjection().params_per_layer(128),
        "valid",
        check=expect_equal((1536 * 128 * 192, 128 * 128 * 512)),
    )
    for label, kw, nm in (
        ("q_lora_rank=0", dict(q_lora_rank=0), "q_lora_rank"),
        ("q_lora_rank=-1", dict(q_lora_rank=-1), "q_lora_rank"),
        ("q_lora_rank=1.5", dict(q_lora_rank=1.5), "q_lora_rank"),
        ("q_lora_rank=True", dict(q_lora_rank=True), "q_lora_rank"),
        ("q_lora_rank='1536'", dict(q_lora_rank="1536"), "q_lora_rank"),
        ("qk_nope_head_dim=0", dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
        ("qk_rope_head_dim=None", dict(qk_rope_head_dim=None), "qk_rope_head_dim"),
        ("kv_lora_rank=-512", dict(kv_lora_rank=-512), "kv_lora_rank"),
        ("q_b_bytes_per_param=0", dict(q_b_bytes_per_param=0.0), "q_b_bytes_per_param"),
        ("q_b_bytes_per_param=nan", dict(q_b_bytes_per_param=NAN), "q_b_bytes_per_param"),
        ("q_b_bytes_per_param=inf", dict(q_b_bytes_per_param=INF), "q_b_bytes_per_param"),
        ("q_b_bytes_per_param='1'", dict(q_b_bytes_per_param="1"), "q_b_bytes_per_param"),
        ("w_uk_bytes_per_param=-2", dict(w_uk_bytes_per_param=-2.0), "w_uk_bytes_per_param"),
        ("w_uk_bytes_per_param=True", dict(w_uk_bytes_per_param=True), "w_uk_bytes_per_param"),
    ):
        mk(out, "QueryProjection", label, lambda kw=kw: QueryProjection(**kw), "raise", nm)
    for label, kw, nm in (
        ("kv_layout='fp16'", dict(kv_layout="fp16"), "kv_layout"),
        ("num_heads=0", dict(num_heads=0), "num_heads"),
        ("topk=0", dict(topk=0), "topk"),
        ("interleave=0", dict(interleave=0), "interleave"),
        ("local_topk=1.0", dict(local_topk=1.0), "local_topk"),
        ("layers=True", dict(layers=True), "layers"),
    ):
        mk(out, "MlaGeometry", label, lambda kw=kw: MlaGeometry(**kw), "raise", nm)
    for label, kw, nm in (
        ("ib_efficiency=1.5", dict(ib_efficiency=1.5), "ib_efficiency"),
        ("gpus_per_host=0", dict(gpus_per_host=0), "gpus_per_host"),
        ("copy_Bps=0", dict(copy_Bps=0.0), "copy_Bps"),
        ("ib_hop_s=-1", dict(ib_hop_s=-1.0), "ib_hop_s"),
    ):
        mk(out, "Hardware", label, lambda kw=kw: Hardware(**kw), "raise", nm)
    return out


# ============================================================================================================
# 13. the FP8 KV cache and the cache writes
# ============================================================================================================
def cache_write_cases() -> list[Case]:
    from dcp_ref import DcpGeometry
    from dcp_ref.cache_write import token_slots, write_cache_rows
    from dcp_ref.fp8_cache import dequantize_kv_fp8, fp8_tile_scales, quantize_kv_fp8

    out: list[Case] = []
    g = gen(61)
    exact = torch.cat(
        [
            torch.randint(-6, 7, (3, 512), generator=g).float() * 0.25,
            torch.randint(-4, 5, (3, 64), generator=g).float() / 8,
        ],
        1,
    )
    mk(
        out,
        "quantize_kv_fp8",
        "valid: exactly representable rows round-trip",
        lambda: dequantize_kv_fp8(quantize_kv_fp8(exact), dtype=torch.float64),
        "valid",
        check=expect_equal(exact.double()),
    )
    mk(
        out,
        "quantize_kv_fp8",
        "valid: 656 bytes per row, leading dims kept",
        lambda: quantize_kv_fp8(exact.view(3, 1, 576)),
        "valid",
        check=lambda r: (
            None if tuple(r.shape) == (3, 1, 656) and r.dtype == torch.uint8 else f"{tuple(r.shape)} {r.dtype}"
        ),
    )
    mk(
        out,
        "fp8_tile_scales",
        "valid: a NaN tile gets a NaN scale",
        lambda: fp8_tile_scales(exact[:1, :512].index_fill(1, i64([200]), NAN)),
        "valid",
        check=lambda s: (
            None if math.isnan(float(s[0, 1])) and bool(torch.isfinite(s[0, [0, 2, 3]]).all()) else f"{s.tolist()}"
        ),
    )
    for label, call, nm in (
        ("kv int", lambda: quantize_kv_fp8(exact.long()), "kv"),
        ("kv width 575", lambda: quantize_kv_fp8(exact[:, :575]), "kv"),
        ("kv 0-d", lambda: quantize_kv_fp8(torch.tensor(1.0)), "kv"),
        ("layout a string", lambda: quantize_kv_fp8(exact, "fp8"), "layout"),
        ("rows width 655", lambda: dequantize_kv_fp8(torch.zeros(2, 655, dtype=torch.uint8)), "rows"),
        ("rows float32", lambda: dequantize_kv_fp8(torch.zeros(2, 656)), "rows"),
        ("dtype int32", lambda: dequantize_kv_fp8(torch.zeros(2, 656, dtype=torch.uint8), dtype=torch.int32), "dtype"),
        ("nope width 500", lambda: fp8_tile_scales(torch.zeros(2, 500)), "nope"),
    ):
        mk(
            out,
            "quantize_kv_fp8"
            if "kv" in label or "layout" in label
            else "dequantize_kv_fp8"
            if "rows" in label or "dtype" in label
            else "fp8_tile_scales",
            label,
            call,
            "raise",
            nm,
        )

    def fresh() -> torch.Tensor:
        return torch.zeros(6, 4)

    mk(
        out,
        "write_cache_rows",
        "valid: rows written, -1 skipped",
        lambda: (lambda c: (write_cache_rows(c, i64([4, -1, 0]), torch.arange(12.0).view(3, 4)), c)[1])(fresh()),
        "valid",
        check=expect_equal(
            torch.tensor([[8.0, 9, 10, 11], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 2, 3], [0, 0, 0, 0]])
        ),
    )
    for label, kw, nm in (
        ("slot past the cache", dict(slots=i64([6])), "slots"),
        ("slot -2", dict(slots=i64([-2])), "slots"),
        ("repeated slot", dict(slots=i64([1, 1]), kv=torch.ones(2, 4)), "slots"),
        ("kv width 3", dict(kv=torch.ones(1, 3)), "kv"),
        ("kv int", dict(kv=torch.ones(1, 4, dtype=torch.int32)), "kv"),
        ("slots float", dict(slots=f32([1.0])), "slots"),
        ("cache 3-D", dict(cache=torch.zeros(2, 3, 4)), "cache"),
        ("FP8 cache 600 wide", dict(cache=torch.zeros(6, 600, dtype=torch.uint8), kv=torch.ones(1, 576)), "cache"),
        ("slots on meta", dict(slots=meta_like(i64([1]))), ("slots", "cache", "kv", "device")),
    ):
        mk(
            out,
            "write_cache_rows",
            label,
            lambda kw=kw: write_cache_rows(**{**dict(cache=fresh(), slots=i64([1]), kv=torch.ones(1, 4)), **kw}),
            "raise",
            nm,
        )
    mk(
        out,
        "write_cache_rows",
        "kv aliases the cache",
        lambda: (lambda c: write_cache_rows(c, i64([0]), c[1:2]))(fresh()),
        "raise",
        ("cache", "kv"),
    )
    geo = DcpGeometry(2, 1, 2, 4)
    tab = i32([[3, 0], [1, -1]])
    pos = list(range(12))

    def bf_slot(b: int, p: int) -> int:
        if bf_owner(p, 2, 2) != 1:
            return -1
        loc = bf_local(p, 2, 2)
        return int(tab[b, loc // 4]) * 4 + loc % 4

    mk(
        out,
        "token_slots",
        "valid: owner-only slots, brute force",
        lambda: token_slots(geo, tab, i64([0] * 12), i64(pos)),
        "valid",
        check=expect_equal(i64([bf_slot(0, p) for p in pos])),
    )
    mk(
        out,
        "token_slots",
        "valid: no token",
        lambda: token_slots(geo, tab, i64([]), i64([])),
        "valid",
        check=expect_equal(i64([])),
    )
    for label, args, nm in (
        ("geometry a tuple", ((2, 1), tab, i64([0]), i64([2])), "geometry"),
        ("req_ids past the table", (geo, tab, i64([2]), i64([2])), "req_ids"),
        ("negative position", (geo, tab, i64([0]), i64([-1])), "positions"),
        ("owned position without a block", (geo, tab, i64([1]), i64([11])), "block_table"),
        ("owned position past the table", (geo, tab, i64([0]), i64([26])), "block_table"),
        ("req_ids / positions length mismatch", (geo, tab, i64([0, 0]), i64([2])), ("req_ids", "positions")),
        ("positions float", (geo, tab, i64([0]), f32([2.0])), "positions"),
        ("block_table 1-D", (geo, tab[0], i64([0]), i64([2])), "block_table"),
    ):
        mk(out, "token_slots", label, lambda a=args: token_slots(*a), "raise", nm)
    return out


# ============================================================================================================
# 14. the stage protocol (dcp_ref.stages): the reference stages and the CPU kernel stages with caller buffers
# ============================================================================================================
def stage_protocol_cases() -> list[Case]:
    from dcp_ref import DcpGeometry, owner_rank
    from dcp_ref.guard import reference_guard
    from dcp_ref.ownership import global_to_local, local_to_global
    from dcp_ref.stages import (
        StepSpec,
        reference_attention,
        reference_combine,
        reference_correct,
        reference_deinterleave,
        reference_indexer,
        reference_select,
        resolve_stages,
    )

    out: list[Case] = []
    G = _gathered()
    geo = DcpGeometry(2, 1, 2, 4)
    ids = i32(bf_stable_topk(G, 4))
    table = i32([[3, 0, 5], [1, 4, -1], [2, 6, 7]])
    req = i32([0, 1, 2])
    g = gen(71)
    q, kv = torch.randn(3, 2, 8, generator=g), torch.randn(10, 8, generator=g)
    sl, cn = i32([[1, 4, 9, -1], [7, -1, -1, -1], [3, 0, 2, 5]]), i32([3, 1, 0])
    outs, lses = torch.randn(2, 3, 2, 4, generator=g), torch.randn(2, 3, 2, generator=g)
    sc = torch.randn(3, 10, generator=g)
    stage_sets: list[tuple[str, Any]] = [("reference", None)]
    if _kernel("stages") is not None:
        spec = StepSpec(DcpGeometry(1, 0, 1, 4), max_tokens=3, topk=4, num_heads=2, head_dim=8, v_dim=4, sm_scale=0.3,
                        dtype=torch.float32, device="cpu")  # fmt: skip
        stage_sets.append(("kernels(cpu)", resolve_stages("kernels", spec)))
    for label, st in stage_sets:
        sel = reference_select if st is None else st.select
        de = reference_deinterleave if st is None else st.deinterleave
        att = reference_attention if st is None else st.attention
        mer = reference_correct if st is None else st.correct
        com = reference_combine if st is None else st.combine
        idx = reference_indexer if st is None else st.indexer
        pre = f"stage {label}"
        want_sel = i32(bf_stable_topk(G, 4))
        mk(
            out,
            f"{pre}.select",
            "valid: out int32 written",
            lambda sel=sel: sel(G.clone(), 4, out=torch.empty(3, 4, dtype=torch.int32)),
            "valid",
            check=lambda r, w=want_sel: diff(torch.sort(r, 1).values, torch.sort(w, 1).values),
        )
        mk(
            out,
            f"{pre}.select",
            "out float32 (the protocol says int32)",
            lambda sel=sel: sel(G.clone(), 4, out=torch.empty(3, 4)),
            "raise",
            "out",
        )
        mk(
            out,
            f"{pre}.select",
            "out int64",
            lambda sel=sel: sel(G.clone(), 4, out=torch.empty(3, 4, dtype=torch.int64)),
            "raise",
            "out",
        )
        mk(
            out,
            f"{pre}.select",
            "out wrong shape",
            lambda sel=sel: sel(G.clone(), 4, out=torch.empty(3, 5, dtype=torch.int32)),
            "raise",
            "out",
        )
        mk(
            out,
            f"{pre}.select",
            "out expanded (stride-0)",
            lambda sel=sel: sel(G.clone(), 4, out=torch.empty(1, 4, dtype=torch.int32).expand(3, 4)),
            "raise",
            "out",
        )
        mk(
            out,
            f"{pre}.select",
            "out aliases gathered (same bytes)",
            lambda sel=sel: (lambda gg: sel(gg, 4, out=gg.view(-1)[:12].view(torch.int32).view(3, 4)))(G.clone()),
            "raise",
            ("out", "gathered"),
        )
        want_de = bf_compact(bf_deinterleave(ids, [0, 1, 2], table, 2, 1, 2, 4))
        mk(
            out,
            f"{pre}.deinterleave",
            "valid: out buffers written",
            lambda de=de: de(
                ids,
                req,
                table,
                geo,
                out_slots=torch.empty(3, 4, dtype=torch.int32),
                out_counts=torch.empty(3, dtype=torch.int32),
            ),
            "valid",
            check=lambda r, w=want_de: diff((sorted_rows(*r), r[1]), (sorted_rows(*w), w[1])),
        )
        mk(
            out,
            f"{pre}.deinterleave",
            "out_slots float32 (a poison slot 2**31-1 is not a float32)",
            lambda de=de: de(ids, i32([0, 7, 2]), table, geo, out_slots=torch.empty(3, 4)),
            "raise",
            "out_slots",
        )
        mk(
            out,
            f"{pre}.deinterleave",
            "out_counts int64",
            lambda de=de: de(ids, req, table, geo, out_counts=torch.empty(3, dtype=torch.int64)),
            "raise",
            "out_counts",
        )
        mk(
            out,
            f"{pre}.deinterleave",
            "out_slots aliases global_ids",
            lambda de=de: (lambda x: de(x, req, table, geo, out_slots=x))(ids.clone()),
            "raise",
            ("out_slots", "global_ids", "token_ids", "out"),
        )
        mk(
            out,
            f"{pre}.deinterleave",
            "out_counts aliases out_slots",
            lambda de=de: (lambda o: de(ids, req, table, geo, out_slots=o, out_counts=o[:, 0]))(
                torch.empty(3, 4, dtype=torch.int32)
            ),
            "raise",
            ("out_counts", "out_slots", "counts", "out"),
        )
        want_att = bf_attention(q, kv, sl, [3, 1, 0], 0.5, 4)
        mk(
            out,
            f"{pre}.attention",
            "valid: out / out_lse written",
            lambda att=att: att(q, kv, sl, cn, 0.5, 4, out=torch.empty(3, 2, 4), out_lse=torch.empty(3, 2)),
            "valid",
            check=expect_equal(want_att, atol=1e-5, rtol=1e-5),
        )
        mk(
            out,
            f"{pre}.attention",
            "out_lse float16 (the protocol says float32)",
            lambda att=att: att(q, kv, sl, cn, 0.5, 4, out_lse=torch.empty(3, 2, dtype=torch.float16)),
            "raise",
            "out_lse",
        )
        mk(
            out,
            f"{pre}.attention",
            "out aliases q",
            lambda att=att: (lambda qq: att(qq, kv, sl, cn, 0.5, 4, out=qq[..., :4]))(q.clone()),
            "raise",
            ("out", "q"),
        )
        mk(
            out,
            f"{pre}.attention",
            "out wrong shape",
            lambda att=att: att(q, kv, sl, cn, 0.5, 4, out=torch.empty(3, 2, 5)),
            "raise",
            "out",
        )
        want_m = bf_merge(torch.stack([outs[1] * (1 if w == 1 else 0) for w in range(2)]), lses)
        mk(
            out,
            f"{pre}.correct",
            "valid: out may be partial itself (documented)",
            lambda mer=mer: (lambda p: mer(p, lses, 1, out=p, out_lse=torch.empty(3, 2)))(outs[1].clone()),
            "valid",
            check=expect_equal(want_m, atol=1e-5, rtol=1e-5),
        )
        mk(
            out,
            f"{pre}.correct",
            "out a partial overlap of partial",
            lambda mer=mer: (lambda p: mer(p[:, :2], lses, 1, out=p[:, 1:]))(torch.randn(3, 3, 4)),  # heads 1 shared
            "raise",
            ("out", "partial", "corrected"),
        )
        mk(
            out,
            f"{pre}.correct",
            "out_lse aliases all_lse",
            lambda mer=mer: (lambda l_: mer(outs[1], l_, 1, out_lse=l_[0]))(lses.clone()),
            "raise",
            ("out_lse", "all_lse", "all_lses", "merged_lse"),
        )
        mk(out, f"{pre}.correct", "rank=2 of W=2", lambda mer=mer: mer(outs[1], lses, 2), "raise", "rank")
        mk(
            out,
            f"{pre}.combine",
            "valid: out / out_lse written",
            lambda com=com: com(outs, lses, out=torch.empty(3, 2, 4), out_lse=torch.empty(3, 2)),
            "valid",
            check=expect_equal(bf_merge(outs, lses), atol=1e-5, rtol=1e-5),
        )
        mk(
            out,
            f"{pre}.combine",
            "out aliases outs",
            lambda com=com: (lambda o: com(o, lses, out=o[0]))(outs.clone()),
            "raise",
            ("out", "outs", "merged"),
        )
        mk(
            out,
            f"{pre}.combine",
            "out_lse int",
            lambda com=com: com(outs, lses, out_lse=torch.empty(3, 2, dtype=torch.int32)),
            "raise",
            ("out_lse", "merged_lse"),
        )
        want_i = bf_pack(sc, bf_local_topk(sc, 3, [10, 4, 0]), 2, 1, 2)
        mk(
            out,
            f"{pre}.indexer",
            "valid: out written",
            lambda idx=idx: idx(sc, i64([10, 4, 0]), geo, 3, out=torch.empty(3, 3, 2)),
            "valid",
            check=same_pair_sets(want_i),
        )
        mk(
            out,
            f"{pre}.indexer",
            "out float64",
            lambda idx=idx: idx(sc, i64([10, 4, 0]), geo, 3, out=torch.empty(3, 3, 2, dtype=torch.float64)),
            "raise",
            "out",
        )
        mk(
            out,
            f"{pre}.indexer",
            "out aliases scores",
            lambda idx=idx: (lambda s_: idx(s_, i64([10, 4, 0]), geo, 3, out=s_.view(-1)[:18].view(3, 3, 2)))(
                sc.clone()
            ),
            "raise",
            ("out", "scores"),
        )
        mk(
            out,
            f"{pre}.indexer",
            "geometry a tuple",
            lambda idx=idx: idx(sc, i64([10, 4, 0]), (2, 1), 3),
            "raise",
            "geometry",
        )
        mk(
            out,
            f"{pre}.indexer",
            "validate=False path, lengths 2**32 (documented clamp to the row)",
            lambda idx=idx: idx(sc, i64([2**32, 4, 0]), geo, 3),
            "clamp",
            check=same_pair_sets(want_i),
        )

    # valid edges of the ownership maps: huge world sizes and interleaves (W*I beyond int64)
    big = 2**62
    for entry, fn, bf, xs, args, what in (
        ("owner_rank", owner_rank, bf_owner, [5, 2**40], (big, 4), "I = 4 (W*I beyond int64)"),
        ("global_to_local", global_to_local, bf_local, [5, 2**40], (big, 4), "I = 4 (W*I beyond int64)"),
        ("local_to_global", local_to_global, bf_global, [0, 3], (big, 1, 4), "rank 1, local 0 -> global 4"),
    ):
        mk(
            out,
            entry,
            f"valid: W = 2**62, {what}",
            lambda fn=fn, xs=xs, args=args: fn(i64(xs), *args),
            "valid",
            check=expect_equal(i64([bf(x, *args) for x in xs])),
        )
    # valid edges of the guard: finite float64 values beyond float32 are finite
    base = dict(
        partial=torch.ones(2, 2, 3),
        lse=torch.zeros(2, 2),
        local_bounds=i64([1, 1]),
        req_of_token=i32([0, 0]),
        block_table=i32([[0]]),
        geometry=DcpGeometry(1, 0, 1, 4),
        n_cols=4,
    )
    gt = _kernel("guard_triton")
    for name, fn in (("reference_guard", reference_guard), ("guard_triton", gt and gt.guard_triton)):
        if fn is None:
            continue
        mk(
            out,
            name,
            "valid: a finite float64 index weight of 1e300 is finite (no poison)",
            lambda fn=fn: (
                lambda kw: (
                    fn(**kw, index_q=torch.zeros(2, 2, 4), index_weights=f64([[1e300, 1.0], [1.0, 1.0]])),
                    kw["partial"],
                )[1]
            )({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in base.items()}),
            "valid",
            check=lambda p: rows_finite(p, [0, 1], "partial"),
        )
    return out


# ============================================================================================================
# the probe
# ============================================================================================================
SECTIONS: tuple[tuple[str, Callable[[], list[Case]]], ...] = (
    ("ownership", ownership_cases),
    ("indexer", indexer_cases),
    ("select", select_cases),
    ("deinterleave", deinterleave_cases),
    ("select_to_slots", select_to_slots_cases),
    ("scoring", scoring_cases),
    ("index_cache", index_cache_cases),
    ("guard", guard_cases),
    ("attention", attention_cases),
    ("lse", lse_cases),
    ("group", group_cases),
    ("step", step_cases),
    ("costmodel", costmodel_cases),
    ("cache_write", cache_write_cases),
    ("stage_protocol", stage_protocol_cases),
)


def all_cases() -> list[Case]:
    _BASES.clear()
    cases: list[Case] = []
    for section, build in SECTIONS:
        try:
            cases += build()
        except Exception as e:  # noqa: BLE001 - a section that cannot even be built is itself a finding
            cases.append(Case(section, "building the section's cases", lambda e=e: _raise(e), "valid"))
    for entry, fn, base in _BASES.values():
        cases.append(Case(entry, "valid: the base call of the generic bad-input rows", call_with(fn, base), "valid",
                          check=lambda r: None))  # fmt: skip
    return cases


def _raise(e: BaseException) -> Any:
    raise e


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", metavar="OUT", help="write every case's outcome as JSON to OUT")
    ap.add_argument(
        "--only", metavar="SUBSTR", help="run only the cases whose entry point or description contains SUBSTR"
    )
    ap.add_argument(
        "--max-bad",
        metavar="N",
        type=int,
        default=None,
        help="exit 1 when silent + crash exceeds N (default: always exit 0)",
    )
    ap.add_argument("--progress", action="store_true", help="print every case as it runs (stderr)")
    args = ap.parse_args(argv)
    import logging
    import warnings

    logging.getLogger("dcp_ref").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    results = run_cases(all_cases(), args.only, args.progress)
    print(report(results))
    counts = Counter(r.outcome for r in results)
    print(
        f"{len(results)} cases in {time.perf_counter() - t0:.1f} s: "
        + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES if counts[o])
    )
    if args.json:
        payload = dict(total=len(results), counts={o: counts[o] for o in OUTCOMES}, cases=[asdict(r) for r in results])
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.max_bad is not None and counts["silent"] + counts["crash"] > args.max_bad:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
