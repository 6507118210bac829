"""Input-contract fixes found by the contract probe (``tools/probe_contracts.py``), pinned as table rows.

The probe classifies every bad (or valid edge) input; before these fixes the inputs below came out in its bad
classes: ``silent`` (a plausible answer for bad input), ``crash`` (torch's or Triton's own error from deep inside
the call), ``unnamed`` (a check whose message does not name the argument), ``valid_refused`` / ``valid_wrong``
(a valid input refused or answered wrong). The rows pin, so that none comes back:

* **output buffers**: a self-overlapping (expanded / stride-0) ``out=`` refused by the deinterleave, split-KV
  attention and LSE-merge kernel wrappers and by the reference stages (several elements written to one location
  give a schedule-dependent answer), through the shared ``check_not_self_overlapping``; an ``out=`` aliasing an
  input refused by the fused indexer, the rank-local reference indexer and the Triton pack; a reference stage's
  out buffer of the wrong dtype refused (not cast into), the kernel deinterleave stage naming ``out_slots`` /
  ``out_counts``; ``reference_correct(out=partial)`` (its in-place mode) still accepted and exact;
* **arguments**: the Triton pack's ``block=``; ``device=`` of :func:`dcp_ref.step.decode_metadata` and of the
  split-KV ``splitkv_plan``; ``StepSpec``'s ``dtype``, ``device``, ``scoring.next_n`` against ``max_tokens``
  and its choices (``layout=None`` ...), with a NumPy ``sm_scale`` accepted as a float; the cost model's
  ``scope`` / ``exchange`` and head-divisibility checks; a ragged collective of
  :class:`dcp_ref.group.SimulatedWorld`;
* **integer range**: ``row_starts + local_bounds`` past int64 poisoned by both guard twins and refused by a
  validated :class:`~dcp_ref.step.PlannedStep` (never wrapped into range); a float64 index weight of ``1e300``
  (finite) not poisoned; the ownership maps at ``W * I`` beyond int64 and at int32's last global position;
  ``context_lens + query_lens`` overflowing int32 in ``localize_prefill_chunk``.

1. **The table**: each row starts from a valid call (checked by :func:`test_every_base_call_is_valid`),
   changes one argument and asserts the exception type and a message that starts with (or names) the argument.
   Rows are parametrized by name only: every tensor is built inside the test (collection launches nothing and
   builds no tensor, also with real Triton and no GPU).
2. **Accepted and exact**: the valid edge inputs above, against brute force written here with Python ints.
3. The kernel wrappers' rows and the guard's int64 rows again on the H200 (``gpu``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from dcp_ref.contracts import check_no_aliases, check_not_self_overlapping, check_out
from dcp_ref.geometry import DcpGeometry

I64_MAX = 2**63 - 1
I32_MAX = 2**31 - 1


def _mod(name: str) -> Any:
    """``name`` imported at test time (kernel modules: skipped where Triton is missing)."""
    if name.startswith("dcp_ref.kernels"):
        return pytest.importorskip(name)
    return importlib.import_module(name)


def _fn(path: str) -> Callable[..., Any]:
    """``"module:attr"`` resolved at test time (never at collection)."""
    mod, _, attr = path.partition(":")
    obj: Any = _mod(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _expanded(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A stride-0 view: every row of ``shape`` is one memory row."""
    return torch.empty((1, *shape[1:]), dtype=dtype, device=dev).expand(*shape)


def _view_of(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous ``shape`` view of the first elements of ``t``'s memory (an alias of ``t``)."""
    flat = t.reshape(-1) if dtype is None else t.reshape(-1).view(dtype)
    return flat[: math.prod(shape)].view(shape)


# ---------------------------------------------------------------------------------------------- valid bases
# Each base: ``dev -> kwargs`` of a valid call of ``path`` (built at test time). ``kernel=True``: a kernel
# wrapper, run on ``kernel_device`` (and on CUDA in the ``gpu`` test); else a host function, run on the CPU.
@dataclass(frozen=True)
class Base:
    path: str
    kwargs: Callable[[torch.device], dict[str, Any]]
    kernel: bool = False


def _deinterleave_args(dev: torch.device) -> dict[str, Any]:
    return dict(
        token_ids=torch.tensor([[0, 3, 6, -1], [9, 2, -1, -1], [1, 7, 12, 5]], device=dev),
        req_of_token=torch.tensor([0, 1, 1], dtype=torch.int32, device=dev),
        block_table=torch.tensor([[3, 0, 5], [1, 4, -1]], dtype=torch.int32, device=dev),
        geometry=DcpGeometry(2, 1, 2, 4),
    )


def _stage_deinterleave_args(dev: torch.device) -> dict[str, Any]:
    a = _deinterleave_args(dev)
    return dict(global_ids=a.pop("token_ids"), **a)


def _attention_args(dev: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(2, 2, 8, generator=g, dtype=dtype).to(dev),
        kv_cache=torch.randn(10, 8, generator=g, dtype=dtype).to(dev),
        slots=torch.tensor([[1, 4, 9], [7, -1, -1]], dtype=torch.int32, device=dev),
        counts=torch.tensor([3, 1], dtype=torch.int32, device=dev),
        sm_scale=0.5,
        v_dim=6,
    )


def _partials(dev: torch.device, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``[W=2, T=3, H=2, D=4]`` partial outputs and their ``[2, 3, 2]`` LSEs."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 2, 4, generator=g, dtype=dtype).to(dev), torch.randn(2, 3, 2, generator=g, dtype=dtype).to(
        dev
    )


def _lse_merge_args(dev: torch.device) -> dict[str, Any]:
    outs, lses = _partials(dev)
    return dict(outs=outs, lses=lses)


def _lse_correct_args(dev: torch.device) -> dict[str, Any]:
    outs, lses = _partials(dev)
    return dict(out=outs[0].clone(), all_lses=lses, rank=1)


def _logits(dev: torch.device) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(2)).to(dev)


def _local_ids(dev: torch.device) -> torch.Tensor:
    return torch.tensor([[0, 5, 7, -1], [1, 2, -1, -1], [-1, -1, -1, -1]], device=dev)


def _gathered(dev: torch.device) -> torch.Tensor:
    from dcp_ref.topk import pack_candidates

    logits, ids = _logits(dev), _local_ids(dev)
    return torch.stack([pack_candidates(logits, ids, DcpGeometry(2, r)) for r in range(2)])  # [2, 3, 4, 2]


def _spec_args(dev: torch.device) -> dict[str, Any]:
    return dict(
        geometry=DcpGeometry(2, 0),
        max_tokens=4,
        topk=3,
        num_heads=2,
        head_dim=8,
        v_dim=8,
        sm_scale=0.5,
        dtype=torch.float32,
        device="cpu",
    )


def _world_run(op: str, ragged: bool) -> Callable[[], list]:
    """``SimulatedWorld(2).run`` of one collective; ``ragged``: rank ``r`` passes a tensor of another shape."""
    from dcp_ref.group import SimulatedWorld

    def body(g: Any) -> torch.Tensor:
        n = g.rank + 1 if ragged else 1
        return g.all_gather(torch.zeros(n)) if op == "all_gather" else g.all_to_all(torch.zeros(2, n))

    return SimulatedWorld(2).run(body)


BASES: dict[str, Base] = {
    # ---- kernel wrappers
    "global_ids_to_local_slots_triton": Base(
        "dcp_ref.kernels.deinterleave_triton:global_ids_to_local_slots_triton", _deinterleave_args, kernel=True
    ),
    "deinterleave_masked_triton": Base(
        "dcp_ref.kernels.deinterleave_triton:deinterleave_masked_triton", _deinterleave_args, kernel=True
    ),
    "deinterleave_compact": Base(
        "dcp_ref.kernels.deinterleave_triton:deinterleave_compact", _deinterleave_args, kernel=True
    ),
    "sparse_mla_splitkv": Base(
        "dcp_ref.kernels.attention_splitkv_triton:sparse_mla_splitkv", _attention_args, kernel=True
    ),
    "lse_merge": Base("dcp_ref.kernels.lse_merge_triton:lse_merge", _lse_merge_args, kernel=True),
    "lse_correct": Base("dcp_ref.kernels.lse_merge_triton:lse_correct", _lse_correct_args, kernel=True),
    "indexer_topk_pack": Base(
        "dcp_ref.kernels.indexer_triton:indexer_topk_pack",
        lambda dev: dict(
            scores=torch.randn(2, 8, generator=torch.Generator().manual_seed(3)).to(dev),
            lengths=torch.tensor([8, 5], dtype=torch.int32, device=dev),
            k=2,
            geometry=DcpGeometry(2, 0),
        ),
        kernel=True,
    ),
    "pack_candidates_triton": Base(
        "dcp_ref.kernels.pack_triton:pack_candidates_triton",
        lambda dev: dict(logits=_logits(dev), local_topk=_local_ids(dev), geometry=DcpGeometry(2, 1)),
        kernel=True,
    ),
    "kernel_stage_deinterleave": Base(
        "dcp_ref.kernels.stages:_deinterleave_triton", _stage_deinterleave_args, kernel=True
    ),
    # ---- host functions (CPU)
    "reference_indexer_rank_local": Base(
        "dcp_ref.indexer:reference_indexer_rank_local",
        lambda dev: dict(
            scores=torch.randn(2, 4, generator=torch.Generator().manual_seed(4)),
            lengths=torch.tensor([4, 2]),
            geometry=DcpGeometry(2, 0),
            k=4,
        ),
    ),
    "reference_select": Base("dcp_ref.stages:reference_select", lambda dev: dict(gathered=_gathered(dev), k=3)),
    "reference_deinterleave": Base("dcp_ref.stages:reference_deinterleave", _stage_deinterleave_args),
    "reference_attention": Base(
        "dcp_ref.stages:reference_attention", lambda dev: _attention_args(dev, dtype=torch.float64)
    ),
    "reference_correct": Base(
        "dcp_ref.stages:reference_correct",
        lambda dev: (lambda o, s: dict(partial=o[1].clone(), all_lse=s, rank=1))(*_partials(dev, torch.float64)),
    ),
    "reference_combine": Base(
        "dcp_ref.stages:reference_combine",
        lambda dev: (lambda o, s: dict(outs=o, lses=s))(*_partials(dev, torch.float64)),
    ),
    "reference_indexer": Base(
        "dcp_ref.stages:reference_indexer",
        lambda dev: dict(scores=_logits(dev), lengths=torch.tensor([8, 3, 0]), geometry=DcpGeometry(2, 1), k=4),
    ),
    "StepSpec": Base("dcp_ref.stages:StepSpec", _spec_args),
    "decode_metadata": Base(
        "dcp_ref.step:decode_metadata",
        lambda dev: dict(seq_lens=[5, 9], next_n=1, geometry=DcpGeometry(2, 0), device="cpu"),
    ),
    "splitkv_plan": Base(
        "dcp_ref.kernels.attention_splitkv_triton:splitkv_plan", lambda dev: dict(T=2, H=2, K=3, device="cpu")
    ),
    "q_replication_bytes": Base("dcp_ref.costmodel:q_replication_bytes", lambda dev: dict(world_size=2)),
    "dcp_step_cost": Base("dcp_ref.costmodel:dcp_step_cost", lambda dev: dict(world_size=2, tokens=4, context=4096)),
    "tp_step_cost": Base("dcp_ref.costmodel:tp_step_cost", lambda dev: dict(world_size=2, tokens=4, context=4096)),
    "local_to_global": Base(
        "dcp_ref.ownership:local_to_global", lambda dev: dict(local=3, world_size=2**62, rank=1, interleave=4)
    ),
    "localize_prefill_chunk": Base(
        "dcp_ref.ownership:localize_prefill_chunk",
        lambda dev: dict(
            context_lens=torch.tensor([2**31 - 7], dtype=torch.int32),
            query_lens=torch.tensor([5], dtype=torch.int32),
            world_size=2,
            rank=0,
        ),
    ),
    "SimulatedWorld.all_gather": Base(__name__ + ":_world_run", lambda dev: dict(op="all_gather", ragged=False)),
    "SimulatedWorld.all_to_all": Base(__name__ + ":_world_run", lambda dev: dict(op="all_to_all", ragged=False)),
}


# ---------------------------------------------------------------------------------------------- the table
class Lazy:
    """A bad value built at test time from the base call's arguments and the device: ``fn(kwargs, dev)``."""

    def __init__(self, fn: Callable[[dict[str, Any], torch.device], Any]) -> None:
        self.fn = fn


@dataclass(frozen=True)
class Row:
    base: str
    exc: type
    match: str  #: a regex searched in the message; ``^name ...`` when it must start with the argument's name
    override: dict[str, Any]
    skip_if: Callable[[], str | None] | None = None


ROWS: dict[str, Row] = {}


def bad(base: str, label: str, exc: type, match: str, /, *, skip_if: Callable[[], str | None] | None = None,
        **override: Any) -> None:  # fmt: skip
    """One table row: ``BASES[base]`` with ``override`` raises ``exc`` whose message matches ``match``."""
    name = f"{base}[{label}]"
    assert base in BASES and name not in ROWS, name
    ROWS[name] = Row(base, exc, match, override, skip_if)


SELF = "must not overlap itself"
# 1. self-overlapping (expanded / stride-0) output buffers, in the kernel wrappers
_DEINT_OUT = (3, 4)
for fn in ("global_ids_to_local_slots_triton", "deinterleave_masked_triton", "deinterleave_compact"):
    bad(
        fn,
        "out expanded",
        ValueError,
        f"^out {SELF}",
        out=Lazy(lambda kw, dev: _expanded(_DEINT_OUT, torch.int32, dev)),
    )
for fn in ("deinterleave_masked_triton", "deinterleave_compact"):
    bad(fn, "counts expanded", ValueError, f"^counts {SELF}",
        counts=Lazy(lambda kw, dev: torch.empty(1, dtype=torch.int32, device=dev).expand(3)))  # fmt: skip
bad("sparse_mla_splitkv", "out expanded", ValueError, f"^out {SELF}",
    out=Lazy(lambda kw, dev: _expanded((2, 2, 6), torch.float32, dev)))  # fmt: skip
bad("sparse_mla_splitkv", "out_lse expanded", ValueError, f"^out_lse {SELF}",
    out_lse=Lazy(lambda kw, dev: _expanded((2, 2), torch.float32, dev)))  # fmt: skip
bad("lse_merge", "merged expanded", ValueError, f"^merged {SELF}",
    merged=Lazy(lambda kw, dev: _expanded((3, 2, 4), torch.float32, dev)))  # fmt: skip
bad("lse_merge", "merged_lse expanded", ValueError, f"^merged_lse {SELF}",
    merged_lse=Lazy(lambda kw, dev: _expanded((3, 2), torch.float32, dev)))  # fmt: skip
bad("lse_correct", "corrected expanded", ValueError, f"^corrected {SELF}",
    corrected=Lazy(lambda kw, dev: _expanded((3, 2, 4), torch.float32, dev)))  # fmt: skip
bad("lse_correct", "merged_lse expanded", ValueError, f"^merged_lse {SELF}",
    merged_lse=Lazy(lambda kw, dev: _expanded((3, 2), torch.float32, dev)))  # fmt: skip

# 2. an out= aliasing an input
SHARE = "must not share memory with"
bad("indexer_topk_pack", "out a view of scores", ValueError, f"^out {SHARE} scores",
    out=Lazy(lambda kw, dev: _view_of(kw["scores"], (2, 2, 2))))  # fmt: skip
bad("reference_indexer_rank_local", "out is scores", ValueError, f"^out {SHARE} scores",
    out=Lazy(lambda kw, dev: kw["scores"]))  # fmt: skip
bad("pack_candidates_triton", "out a view of logits", ValueError, f"^out {SHARE} logits",
    out=Lazy(lambda kw, dev: _view_of(kw["logits"], (3, 4, 2))))  # fmt: skip

# 3. pack_candidates_triton(block=...)
bad("pack_candidates_triton", "block=3", ValueError, "^block must be a power of two", block=3)
bad("pack_candidates_triton", "block=0", ValueError, "^block must be a power of two", block=0)
bad("pack_candidates_triton", "block='256'", TypeError, "^block must be a Python int", block="256")
bad("pack_candidates_triton", "block=True", TypeError, "^block must be a Python int, got bool", block=True)

# 4. the reference stages' out buffers: dtype, alias, self-overlap; the kernel deinterleave stage's names
bad("reference_select", "out float32", TypeError, "^out must have dtype", out=Lazy(lambda kw, dev: torch.empty(3, 3)))
bad("reference_select", "out a view of gathered", ValueError, f"^out {SHARE} gathered",
    out=Lazy(lambda kw, dev: _view_of(kw["gathered"], (3, 3), torch.int32)))  # fmt: skip
bad("reference_select", "out expanded", ValueError, f"^out {SELF}",
    out=Lazy(lambda kw, dev: _expanded((3, 3), torch.int32, dev)))  # fmt: skip
bad("reference_deinterleave", "out_slots float32", TypeError, "^out_slots must have dtype",
    out_slots=Lazy(lambda kw, dev: torch.empty(3, 4)))  # fmt: skip
bad("reference_deinterleave", "out_counts int64", TypeError, "^out_counts must have dtype",
    out_counts=Lazy(lambda kw, dev: torch.empty(3, dtype=torch.int64)))  # fmt: skip
bad("reference_deinterleave", "out_slots a view of global_ids", ValueError, f"^out_slots {SHARE} global_ids",
    out_slots=Lazy(lambda kw, dev: _view_of(kw["global_ids"], (3, 4), torch.int32)))  # fmt: skip
bad("reference_deinterleave", "out_counts is req_of_token", ValueError, f"^out_counts {SHARE} req_of_token",
    out_counts=Lazy(lambda kw, dev: kw["req_of_token"]))  # fmt: skip
bad("reference_deinterleave", "out_counts expanded", ValueError, f"^out_counts {SELF}",
    out_counts=Lazy(lambda kw, dev: torch.empty(1, dtype=torch.int32).expand(3)))  # fmt: skip
bad("reference_attention", "out_lse float16", TypeError, "^out_lse must have dtype",
    out_lse=Lazy(lambda kw, dev: torch.empty(2, 2, dtype=torch.float16)))  # fmt: skip
bad("reference_attention", "out int32", TypeError, "^out must have dtype",
    out=Lazy(lambda kw, dev: torch.empty(2, 2, 6, dtype=torch.int32)))  # fmt: skip
bad("reference_attention", "out a view of q", ValueError, f"^out {SHARE} q",
    out=Lazy(lambda kw, dev: _view_of(kw["q"], (2, 2, 6))))  # fmt: skip
bad("reference_attention", "out_lse expanded", ValueError, f"^out_lse {SELF}",
    out_lse=Lazy(lambda kw, dev: _expanded((2, 2), torch.float64, dev)))  # fmt: skip
bad("reference_correct", "out int64", TypeError, "^out must have dtype",
    out=Lazy(lambda kw, dev: torch.empty(3, 2, 4, dtype=torch.int64)))  # fmt: skip
bad("reference_correct", "out_lse float16", TypeError, "^out_lse must have dtype",
    out_lse=Lazy(lambda kw, dev: torch.empty(3, 2, dtype=torch.float16)))  # fmt: skip
bad("reference_correct", "out partial's memory, other strides", ValueError, f"^out {SHARE} partial",
    out=Lazy(lambda kw, dev: kw["partial"].as_strided((3, 2, 4), (8, 1, 2))))  # fmt: skip
bad("reference_correct", "out_lse a view of all_lse", ValueError, f"^out_lse {SHARE} all_lse",
    out_lse=Lazy(lambda kw, dev: kw["all_lse"][1]))  # fmt: skip
bad("reference_correct", "out_lse is partial's memory", ValueError, f"^out_lse {SHARE} partial",
    out_lse=Lazy(lambda kw, dev: kw["partial"][:, :, 0]))  # fmt: skip
bad("reference_correct", "out expanded", ValueError, f"^out {SELF}",
    out=Lazy(lambda kw, dev: _expanded((3, 2, 4), torch.float64, dev)))  # fmt: skip
bad("reference_combine", "out_lse int32", TypeError, "^out_lse must have dtype",
    out_lse=Lazy(lambda kw, dev: torch.empty(3, 2, dtype=torch.int32)))  # fmt: skip
bad("reference_combine", "out_lse a view of lses", ValueError, f"^out_lse {SHARE} lses",
    out_lse=Lazy(lambda kw, dev: kw["lses"][0]))  # fmt: skip
bad("reference_combine", "out is outs[0]", ValueError, f"^out {SHARE} outs",
    out=Lazy(lambda kw, dev: kw["outs"][0]))  # fmt: skip
bad("reference_combine", "out expanded", ValueError, f"^out {SELF}",
    out=Lazy(lambda kw, dev: _expanded((3, 2, 4), torch.float64, dev)))  # fmt: skip
bad("reference_indexer", "out float64", TypeError, "^out must have dtype",
    out=Lazy(lambda kw, dev: torch.empty(3, 4, 2, dtype=torch.float64)))  # fmt: skip
bad("reference_indexer", "out a view of scores", ValueError, f"^out {SHARE} scores",
    out=Lazy(lambda kw, dev: _view_of(kw["scores"], (3, 4, 2))))  # fmt: skip
bad("reference_indexer", "out expanded", ValueError, f"^out {SELF}",
    out=Lazy(lambda kw, dev: _expanded((3, 4, 2), torch.float32, dev)))  # fmt: skip
bad("kernel_stage_deinterleave", "out_slots float32", TypeError, "^out_slots must have dtype",
    out_slots=Lazy(lambda kw, dev: torch.empty(3, 4, device=dev)))  # fmt: skip
bad("kernel_stage_deinterleave", "out_counts int64", TypeError, "^out_counts must have dtype",
    out_counts=Lazy(lambda kw, dev: torch.empty(3, dtype=torch.int64, device=dev)))  # fmt: skip

# 7. StepSpec
for dt in ("int32", "bool", "complex64"):
    bad("StepSpec", f"dtype={dt}", TypeError, "^dtype must be one of", dtype=getattr(torch, dt))


def _cuda_present() -> str | None:
    return "CUDA is available here: device='cuda' is valid" if torch.cuda.is_available() else None


bad("StepSpec", "device='cuda' without CUDA", ValueError, "^device must be one this machine has", device="cuda",
    skip_if=_cuda_present)  # fmt: skip
bad("StepSpec", "device='nope'", ValueError, "^device must name a torch device", device="nope")
bad("StepSpec", "device=3.5", TypeError, "^device must be a torch.device or a str", device=3.5)
bad("StepSpec", "scoring.next_n=3 > max_tokens=2", ValueError, r"^scoring\.next_n=3 must be <= max_tokens=2",
    max_tokens=2, scoring=Lazy(lambda kw, dev: _fn("dcp_ref.stages:ScoringSpec")(16, next_n=3)))  # fmt: skip
for choice in ("layout", "exchange", "order", "combine"):
    bad("StepSpec", f"{choice}=None", TypeError, f"^{choice} must be one of", **{choice: None})

# 8. device arguments
for fn in ("decode_metadata", "splitkv_plan"):
    bad(fn, "device='nope'", ValueError, "^device must name a torch device", device="nope")
    bad(fn, "device=3.5", TypeError, "^device must be a torch.device or a str", device=3.5)

# 9. the cost model
bad("q_replication_bytes", "world_size=3", ValueError, "^world_size must divide num_heads", world_size=3)
for fn in ("dcp_step_cost", "tp_step_cost"):
    bad(fn, "scope=None", TypeError, "^scope must be", scope=None)
    bad(fn, "options=None", TypeError, "^options must be a dcp_ref.options.LayerOptions", options=None)
    bad(fn, "exchange= (no loose options)", TypeError, "unexpected keyword argument 'exchange'", exchange="owner")

# 10. / 11. ownership
bad("local_to_global", "local=4 at W=2**62, I=4 (overflows int64)", ValueError, "^local must be <=", local=4)
bad("localize_prefill_chunk", "int32 context_lens + query_lens overflows", ValueError,
    r"^context_lens \+ query_lens must fit int32",
    context_lens=Lazy(lambda kw, dev: torch.tensor([2**31 - 2], dtype=torch.int32)))  # fmt: skip

# 12. ragged collectives of the simulated world
for op in ("all_gather", "all_to_all"):
    bad(f"SimulatedWorld.{op}", "x of another shape per rank", ValueError,
        "^x must have one shape and dtype on every rank", ragged=True)  # fmt: skip

KERNEL_ROWS = [n for n, r in ROWS.items() if BASES[r.base].kernel]
HOST_ROWS = [n for n, r in ROWS.items() if not BASES[r.base].kernel]


def _build(base: str, dev: torch.device, **override: Any) -> tuple[Callable[..., Any], dict[str, Any]]:
    b = BASES[base]
    fn = _fn(b.path)
    kw = b.kwargs(dev)
    ctx = dict(kw)
    kw.update({k: v.fn(ctx, dev) if isinstance(v, Lazy) else v for k, v in override.items()})
    return fn, kw


def _check_row(name: str, dev: torch.device) -> None:
    row = ROWS[name]
    if row.skip_if is not None and (why := row.skip_if()):
        pytest.skip(why)
    fn, kw = _build(row.base, dev, **row.override)
    with pytest.raises(row.exc, match=row.match) as e:
        fn(**kw)
    assert type(e.value) is row.exc, (name, type(e.value), str(e.value))


@pytest.mark.parametrize("name", KERNEL_ROWS)
def test_kernel_wrapper_refuses(name: str, kernel_device: torch.device) -> None:
    _check_row(name, kernel_device)


@pytest.mark.parametrize("name", HOST_ROWS)
def test_host_function_refuses(name: str) -> None:
    _check_row(name, torch.device("cpu"))


@pytest.mark.parametrize("base", list(BASES))
def test_every_base_call_is_valid(base: str, kernel_device: torch.device) -> None:
    """Every row changes one argument of a call that succeeds."""
    dev = kernel_device if BASES[base].kernel else torch.device("cpu")
    fn, kw = _build(base, dev)
    fn(**kw)


# ---------------------------------------------------------------------------------------------- self-overlap
def test_self_overlap_check_on_views() -> None:
    """:func:`~dcp_ref.contracts.check_not_self_overlapping` (the shared check behind ``check_no_aliases`` and
    ``check_out``): views whose elements are distinct locations pass, stride-0 / overlapping layouts do not."""
    base = torch.empty(6, 8)
    flat = torch.empty(64)
    accepted = {
        "contiguous": base,
        "transposed": base.t(),
        "column slice": base[:, ::2],
        "row slice": base[1:4],
        "permuted 3-D": torch.empty(2, 3, 4).permute(2, 0, 1),
        "size-1 dim with stride 0": torch.empty(1, 8).expand(1, 8),
        "empty": torch.empty(0, 5),
        "as_strided, nested strides": flat.as_strided((2, 3), (1, 2)),
        "as_strided, gaps": flat.as_strided((3, 4), (10, 2)),
    }
    refused = {
        "expanded rows": torch.empty(1, 8).expand(6, 8),
        "expanded columns": torch.empty(6, 1).expand(6, 8),
        "stride 0 scalar": torch.empty(()).expand(5),
        "as_strided, rows overlapping": flat.as_strided((3, 4), (2, 1)),
        "as_strided, stride 0": flat.as_strided((3, 4), (0, 1)),
    }
    # strides that do not nest: refused by the layout rule even where no two elements happen to meet
    conservative = {"as_strided, strides not nesting": flat.as_strided((3, 3), (3, 2))}
    for label, t in accepted.items():
        try:
            check_not_self_overlapping(t, "buf")
            check_no_aliases({"buf": t}, {})
        except ValueError as e:
            pytest.fail(f"{label}: refused ({e})")
    for label, t in (refused | conservative).items():
        with pytest.raises(ValueError, match=f"^buf {SELF}"):
            check_not_self_overlapping(t, "buf")
        with pytest.raises(ValueError, match=f"^buf {SELF}"):
            check_no_aliases({"buf": t}, {})
        with pytest.raises(ValueError, match=f"^buf {SELF}"):
            check_out(t, "buf", tuple(t.shape), t.dtype, t.device)
        assert label  # (the label names the failing view in the traceback)

    # the views themselves, by brute force: accepted ones have one location per element, refused ones fewer
    def locations(t: torch.Tensor) -> int:
        return len({sum(i * s for i, s in zip(idx, t.stride())) for idx in np.ndindex(*t.shape)})

    assert all(locations(t) == t.numel() for t in (*accepted.values(), *conservative.values()))
    assert all(locations(t) < t.numel() for t in refused.values())


# ---------------------------------------------------------------------------------------------- accepted inputs
def test_reference_correct_in_place_is_accepted_and_exact() -> None:
    """``reference_correct(out=partial)``: the documented in-place mode (exactly the same tensor)."""
    from dcp_ref.stages import reference_correct

    outs, lses = _partials(torch.device("cpu"), torch.float64)
    want, want_lse = reference_correct(outs[1].clone(), lses, 1)
    partial = outs[1].clone()
    got, got_lse = reference_correct(partial, lses, 1, out=partial)
    assert got is partial
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)
    buf = torch.empty_like(want_lse)
    _, got_lse2 = reference_correct(outs[1].clone(), lses, 1, out_lse=buf)
    assert got_lse2 is buf and torch.equal(buf, want_lse)


def test_step_spec_takes_a_numpy_scale_as_a_float() -> None:
    from dcp_ref.stages import StepSpec

    spec = StepSpec(**{**_spec_args(torch.device("cpu")), "sm_scale": np.float32(0.5)})
    assert type(spec.sm_scale) is float and spec.sm_scale == 0.5


# ---------------------------------------------------------------------------------------------- ownership
def _bf_local(p: int, W: int, I: int) -> int:
    return (p // (W * I)) * I + p % I


def _bf_global(loc: int, W: int, r: int, I: int) -> int:
    return (loc // I) * (W * I) + r * I + loc % I


def test_global_to_local_with_a_stripe_beyond_int64() -> None:
    from dcp_ref.ownership import global_to_local

    W, I = 2**62, 4
    positions = [0, 3, 5, 2**62 + 3, I64_MAX - 1, I64_MAX]
    for p in positions:
        assert global_to_local(p, W, I) == _bf_local(p, W, I), p
    got = global_to_local(torch.tensor(positions, dtype=torch.int64), W, I)
    assert got.dtype == torch.int64
    assert got.tolist() == [_bf_local(p, W, I) for p in positions]


def test_local_to_global_with_a_stripe_beyond_int64() -> None:
    from dcp_ref.ownership import local_to_global

    assert local_to_global(0, 2**62, 1, 4) == 4 == _bf_global(0, 2**62, 1, 4)
    assert local_to_global(3, 2**62, 1, 4) == 7 == _bf_global(3, 2**62, 1, 4)
    got = local_to_global(torch.tensor([0, 1, 2, 3]), 2**62, 1, 4)
    assert got.tolist() == [4, 5, 6, 7]
    # local 4 is stripe 1: global 2**64 + 4, beyond int64 (the table's row checks the refusal)
    assert _bf_global(4, 2**62, 1, 4) > I64_MAX


def _bf_max_local(limit: int, W: int, r: int, I: int) -> int:
    """The largest local index whose global position is ``<= limit`` (binary search with Python ints over the
    brute-force map, which is increasing in the local index)."""
    lo, hi = -1, limit + 1  # _bf_global(lo) <= limit < _bf_global(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _bf_global(mid, W, r, I) <= limit:
            lo = mid
        else:
            hi = mid
    return lo


@pytest.mark.parametrize("W,I", [(2, 1), (2, 4), (3, 1), (3, 4)], ids=lambda v: str(v))
def test_local_to_global_int32_boundary_is_exact(W: int, I: int) -> None:
    """int32 locals: the largest local whose global position fits int32 is accepted (and mapped exactly), the
    next one refused, on every rank."""
    from dcp_ref.ownership import local_to_global

    for r in range(W):
        top = _bf_max_local(I32_MAX, W, r, I)
        assert _bf_global(top, W, r, I) <= I32_MAX < _bf_global(top + 1, W, r, I)
        got = local_to_global(torch.tensor([0, top], dtype=torch.int32), W, r, I)
        assert got.dtype == torch.int32
        assert got.tolist() == [_bf_global(0, W, r, I), _bf_global(top, W, r, I)], (W, I, r)
        with pytest.raises(ValueError, match=r"^local must be <="):
            local_to_global(torch.tensor([top + 1], dtype=torch.int32), W, r, I)
        # as int64 the same local is fine (and exact)
        assert local_to_global(torch.tensor([top + 1]), W, r, I).tolist() == [_bf_global(top + 1, W, r, I)]


# ---------------------------------------------------------------------------------------------- guard
_GT, _GH, _GV = 3, 2, 5
_GUARD_GEO = DcpGeometry(2, 0, 1, 4)


Guarded = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _guard_call(fn: Callable, dev: torch.device, *, bounds: list[int], starts: list[int] | None = None,
                weights: torch.Tensor | None = None) -> Guarded:  # fmt: skip
    """One guard call on 3 tokens (the valid base of ``test_bad_inputs_guard``, int64 metadata): returns the
    poisoned ``partial`` / ``lse`` and what they held before (random, finite)."""
    g = torch.Generator().manual_seed(5)
    fill = torch.randn(_GT, _GH, _GV, generator=g)
    partial, lse = fill.clone().to(dev), fill[:, :, 0].clone().to(dev)
    scored: dict[str, Any] = {}
    if weights is not None:
        scored = dict(index_q=torch.zeros(_GT, 4, 8, device=dev).to(torch.float8_e4m3fn), index_weights=weights.to(dev))
    fn(
        partial, lse,
        torch.tensor(bounds, dtype=torch.int64, device=dev),
        torch.tensor([0, 1, 1], dtype=torch.int32, device=dev),
        torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32, device=dev),
        _GUARD_GEO, 16,
        row_starts=None if starts is None else torch.tensor(starts, dtype=torch.int64, device=dev),
        **scored,
    )  # fmt: skip
    return partial.cpu(), lse.cpu(), fill, fill[:, :, 0]


def _guard_twins() -> list[Callable]:
    from dcp_ref.guard import reference_guard

    return [reference_guard, _fn("dcp_ref.kernels.guard_triton:guard_triton")]


def _check_guard(dev: torch.device) -> None:
    twins = _guard_twins()
    wrap_cases = {
        "row_start 2**63-1, bound 1": dict(bounds=[1, 12, 3], starts=[I64_MAX, 0, 0]),
        "bound 2**63-1, row_start 1": dict(bounds=[I64_MAX, 12, 3], starts=[1, 0, 0]),
    }
    w_big = torch.ones(_GT, 4, dtype=torch.float64)
    w_big[0, 1] = 1e300  # finite in float64 (inf once cast to float32)
    w_nan = torch.ones(_GT, 4, dtype=torch.float64)
    w_nan[0, 2] = math.nan
    weight_cases = {
        "float64 weight 1e300": (dict(bounds=[8, 12, 3], weights=w_big), []),
        "NaN weight": (dict(bounds=[8, 12, 3], weights=w_nan), [0]),
    }
    cases = {k: (v, [0]) for k, v in wrap_cases.items()} | weight_cases
    for label, (kw, poisoned) in cases.items():
        answers = []
        for fn in twins:
            p, lse, p0, lse0 = _guard_call(fn, dev, **kw)
            bad = torch.zeros(_GT, dtype=torch.bool)
            bad[poisoned] = True
            assert torch.isnan(p[bad]).all() and torch.isnan(lse[bad]).all(), (label, fn.__module__, "not poisoned")
            assert torch.equal(p[~bad], p0[~bad]) and torch.equal(lse[~bad], lse0[~bad]), (label, fn.__module__)
            answers.append((p, lse))
        (p_ref, l_ref), (p_ker, l_ker) = answers
        assert torch.equal(p_ref.isnan(), p_ker.isnan()) and torch.equal(l_ref.isnan(), l_ker.isnan()), label


def test_guard_poisons_a_wrapping_window_and_reads_float64_weights(kernel_device: torch.device) -> None:
    """``row_starts + local_bounds`` beyond int64 is out of contract (poisoned, never wrapped into range); a
    float64 index weight of ``1e300`` is finite (not poisoned), a NaN one is; both twins agree."""
    _check_guard(kernel_device)


# ---------------------------------------------------------------------------------------------- planned step
def test_planned_step_refuses_a_window_wrapping_int64() -> None:
    """``validate=True``: ``row_starts + local_bounds`` past int64 is refused with the exact (Python int) column,
    never wrapped into range."""
    from dcp_ref.group import SingleGroup
    from dcp_ref.pipeline import make_dcp_problem
    from dcp_ref.stages import StepSpec
    from dcp_ref.step import PlannedStep, StepMetadata

    p = make_dcp_problem(1, 1, seq_lens=[20, 7], next_n=1, num_heads=2, head_dim=8, block_size=4, seed=0)
    spec = StepSpec(DcpGeometry(1, 0, 1, 4), max_tokens=4, topk=3, num_heads=2, head_dim=8, v_dim=8, sm_scale=0.5,
                    dtype=torch.float64, device="cpu")  # fmt: skip
    step = PlannedStep(SingleGroup(), spec, validate=True)
    shard = p.shards[0]
    good = p.metadata(0)
    step.run(p.q, shard, good)  # the base run is valid
    req = good.req_of_token
    for bounds, starts in (([1, 7], [I64_MAX, 0]), ([I64_MAX, 7], [1, 0]), ([10, 7], [I64_MAX - 5, 0])):
        meta = StepMetadata(torch.tensor(bounds), req, torch.tensor(starts))
        need = bounds[0] + starts[0]  # Python ints: past int64
        assert need > I64_MAX
        with pytest.raises(ValueError, match=f"keys reach column {need}$"):
            step.run(p.q, shard, meta)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_kernel_rows_and_guard_on_gpu(cuda_device: torch.device) -> None:
    """On the H200 (compiled kernels): every kernel wrapper's row refuses the same way, and the guard's int64 and
    float64 rows poison exactly as on the CPU."""
    for name in KERNEL_ROWS:
        _check_row(name, cuda_device)
    _check_guard(cuda_device)
    torch.cuda.synchronize()
