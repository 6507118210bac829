"""``python -m dcp_ref.testing MODULE:FUNCTION --stage STAGE [options]`` — check one implementation.

Examples::

    python -m dcp_ref.testing dcp_ref.topk:stable_topk --stage select --sorted
    python -m dcp_ref.testing my_kernels:topk --stage select --device cuda --max-examples 200
    python -m dcp_ref.testing my_kernels:attention --stage attention --lse-base 2 --dtype bfloat16
    python -m dcp_ref.testing my_kernels:STAGES --stage stages          # a dcp_ref.stages.Stages value

Exit status 0 with a ``PASS`` line when every case conforms; 1 with the smallest failing case (as code)
when one does not; 2 on bad arguments. On the CPU, Triton kernels run through the interpreter:
``TRITON_INTERPRET=1`` is set (unless already set) before ``MODULE`` is imported.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

STAGES = (
    "scoring", "indexer", "local_topk", "pack", "select", "deinterleave", "select_to_slots",
    "guard", "attention", "correct", "combine", "step", "stages",
)  # fmt: skip
_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dcp_ref.testing",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", help="MODULE:NAME of the callable (or Stages value), e.g. my_kernels:topk")
    p.add_argument("--stage", required=True, choices=STAGES, help="which contract to check")
    p.add_argument("--device", default="cpu", help="where the inputs live (default cpu)")
    p.add_argument(
        "--dtype",
        choices=_DTYPES,
        help="input dtype (attention: q/KV; correct: partials; step: q/KV; pack: the scores)",
    )
    p.add_argument("--sorted", action="store_true", help="select / indexer / local_topk: require the key order")
    p.add_argument("--presorted", action="store_true", help="select: feed per-rank lists sorted best first")
    p.add_argument(
        "--ordered",
        action="store_true",
        help="deinterleave: valid slots in id order; select_to_slots: in selection order",
    )
    p.add_argument(
        "--order", choices=("global_id", "rank_local"), default="global_id", help="select_to_slots: the total order"
    )
    p.add_argument("--masked", action="store_true", help="deinterleave / attention: the masked layout (no compaction)")
    p.add_argument("--lse-base", choices=("e", "2"), default="e", help="attention / correct / combine: the LSE's base")
    p.add_argument(
        "--empty-lse",
        choices=("-inf", "+inf", "nan", "any"),
        default="-inf",
        help="attention: the LSE of a row with no slot",
    )
    p.add_argument(
        "--form",
        choices=("correct", "merge"),
        default="correct",
        help="correct: one rank's correction or all partials at once",
    )
    p.add_argument("--head-dim", type=int, help="attention / step: fix Dqk (e.g. 576)")
    p.add_argument("--v-dim", type=int, help="attention / step: fix the value width (e.g. 512)")
    p.add_argument("--num-heads", type=int, help="attention: fix H")
    p.add_argument("--contiguous", action="store_true", help="never pass strided (non-contiguous) inputs")
    p.add_argument("--max-examples", type=int, help="cases to try (default: the checker's)")
    p.add_argument("--seed", type=int, help="a Hypothesis seed instead of the derandomized default")
    return p


def _resolve(target: str) -> Any:
    if ":" not in target:
        raise SystemExit(f"error: target must be MODULE:NAME, got {target!r}")
    mod_name, _, attr = target.partition(":")
    sys.path.insert(0, os.getcwd())  # like `python -m`, find modules in the current directory
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _kwargs(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    kw: dict[str, Any] = {"device": a.device, "max_examples": a.max_examples, "seed": a.seed}
    dtype = getattr(torch, a.dtype) if a.dtype else None
    nc = {"noncontig": False} if a.contiguous else {}
    s = a.stage
    if s in ("select", "indexer", "local_topk"):
        kw["sorted"] = a.sorted
        kw.update(nc)
    if s == "select":
        kw["presorted"] = a.presorted
    if s == "local_topk" and dtype is not None:
        kw["dtype"] = dtype
    if s == "pack":
        kw.update(nc)
        if dtype is not None:
            kw["dtypes"] = (dtype,)
    if s == "deinterleave":
        kw.update(ordered=a.ordered, compact=not a.masked, **nc)
    if s == "attention":
        kw.update(
            lse_base=a.lse_base,
            empty_lse=a.empty_lse,
            layout="masked" if a.masked else "compact",
            head_dim=a.head_dim,
            v_dim=a.v_dim,
            num_heads=a.num_heads,
            **nc,
        )
        if dtype is not None:
            kw["dtype"] = dtype
    if s == "correct":
        kw.update(lse_base=a.lse_base, form=a.form, **nc)
        if dtype is not None:
            kw["dtype"] = dtype
    if s == "select_to_slots":
        kw.update(order=a.order, ordered=a.ordered)
    if s == "scoring" and a.device == "cpu":
        kw["fp8_nan"] = False  # Triton's CPU interpreter decodes e4m3fn's NaN byte as 480 (a GPU: NaN)
    if s == "combine":
        kw.update(lse_base=a.lse_base, **nc)
        if dtype is not None:
            kw["dtype"] = dtype
    if s == "step":
        kw.update(head_dim=a.head_dim, v_dim=a.v_dim)
        if dtype is not None:
            kw["dtype"] = dtype
    return kw


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a Triton kernel module is imported
    obj = _resolve(a.target)
    from . import checks

    kw = _kwargs(a)
    try:
        getattr(checks, f"check_{a.stage}")(obj, **kw)
    except checks.ConformanceError as e:
        print(e)
        return 1
    n = kw["max_examples"] or checks.DEFAULT_MAX_EXAMPLES
    print(f"PASS: {a.target} conforms to the {a.stage} contract (up to {n} cases per check, device {a.device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
