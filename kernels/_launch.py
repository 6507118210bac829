"""Launch a ``@triton.jit`` kernel through its compiled handle: the eager path without the JIT's per-call work.

Calling ``kernel[grid](*args, **kw)`` makes Triton bind the arguments to the signature, compute the
specialization key (dtypes, 16-byte pointer alignment, integers equal to 1 or divisible by 16), look
the compiled kernel up, and only then launch it. On the device host that work is most of an eager
stage's time (tens of microseconds per launch; the GPU time of a decode stage is a few). Inside a
CUDA graph none of it is replayed, but vLLM runs prefill and mixed batches eagerly.

:class:`FastLaunch` does the same lookup once per *key* and then launches the compiled kernel
directly (``CompiledKernel[grid](*args)``), the path Triton's own ``run`` ends in. The key is what
Triton specializes on: each tensor's dtype and whether its data pointer is 16-byte aligned, each
int's type range and whether it equals 1 or is divisible by 16, each float/bool/None's type, and
the constexpr and launch-option values. A call whose key was seen reuses that compiled kernel; a
new key goes through the JIT once. Under the interpreter (``TRITON_INTERPRET=1``), or if the
installed Triton's compiled kernel cannot be launched this way, every call goes through the JIT.

``FastLaunch.jit_calls`` / ``fast_calls`` count the two paths (tests and benchmarks read them).

**Off by default** (``DCP_FAST_LAUNCH=1`` turns it on): the direct path has not yet been run on the H200 —
``tests/test_launch.py``'s GPU test, which compares it with the JIT across specialization keys and inside a
CUDA graph, has to pass there first. Until then every call takes the JIT path, exactly as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from dcp_ref._checks import triton_interpreting

__all__ = ["FastLaunch", "spec_key", "fast_launch_enabled"]

#: Options of a launch that are not kernel parameters (they select the compiled variant).
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")


def _arg_key(a: object) -> object:
    """What Triton specializes one argument on (see the module docstring)."""
    if isinstance(a, torch.Tensor):
        return ("t", a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        rng = 32 if -(2**31) <= a < 2**31 else (64 if -(2**63) <= a < 2**63 else 65)
        return ("i", rng, a == 1, a % 16 == 0)
    if isinstance(a, float):
        return ("f",)
    if a is None:
        return ("n",)
    return ("o", a)  # constexpr-like values (dtypes, strings, tuples): by value


def spec_key(
    args: tuple[Any, ...], kwargs: dict[str, Any], by_value: frozenset[str] = frozenset(_LAUNCH_OPTIONS)
) -> tuple[object, ...]:
    """The specialization key of one call: runtime arguments by what Triton specializes them on, the keywords
    in ``by_value`` (constexprs, launch options) by their value. A positional constexpr is keyed by value too
    (its kind would not tell two tile sizes apart): pass constexprs by name, as the wrappers do."""
    key: list[object] = [_arg_key(a) for a in args]
    for k, v in sorted(kwargs.items()):
        key.append((k, ("v", v) if k in by_value else _arg_key(v)))
    return tuple(key)


def fast_launch_enabled() -> bool:
    """Whether ``DCP_FAST_LAUNCH`` asks for the direct path (read when a :class:`FastLaunch` is made)."""
    return os.environ.get("DCP_FAST_LAUNCH", "0") not in ("", "0")


class FastLaunch:
    """``FastLaunch(kernel)(grid, *args, **kwargs)`` launches like ``kernel[grid](*args, **kwargs)``.

    ``args`` / ``kwargs`` as for the JIT launch: kernel parameters (positional, then by name; constexprs by
    name) and launch options (``num_warps``, ...). The first call of each specialization key compiles and
    launches through the JIT; later calls with that key launch the compiled kernel directly.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        fn = getattr(kernel, "fn", None)  # the wrapped Python function (JITFunction.fn)
        self._names: list[str] = list(getattr(kernel, "arg_names", []))
        self._defaults: dict[str, Any] = {}
        consts: set[str] = set()
        if fn is not None:
            import inspect

            for name, p in inspect.signature(fn).parameters.items():
                if p.default is not inspect.Parameter.empty:
                    self._defaults[name] = p.default
                ann = p.annotation
                # `x: tl.constexpr` (an object, or a string under `from __future__ import annotations`)
                if getattr(ann, "__name__", "") == "constexpr" or (isinstance(ann, str) and ann.endswith("constexpr")):
                    consts.add(name)
        self._by_value = frozenset(consts) | frozenset(_LAUNCH_OPTIONS)
        self._compiled: dict[tuple[object, ...], Any] = {}
        self._direct = bool(self._names) and not triton_interpreting() and fast_launch_enabled()
        self.jit_calls = 0
        self.fast_calls = 0

    def _ordered(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Every kernel parameter's value in signature order (constexprs included: the launcher skips them)."""
        vals = list(args)
        for name in self._names[len(args) :]:
            if name in kwargs:
                vals.append(kwargs[name])
            elif name in self._defaults:
                vals.append(self._defaults[name])
            else:
                raise TypeError(f"missing kernel argument {name!r}")
        return vals

    def __call__(self, grid: tuple[int, ...] | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self._direct or callable(grid):
            self.jit_calls += 1
            return self.kernel[grid](*args, **kwargs)
        key = spec_key(args, kwargs, self._by_value)
        compiled = self._compiled.get(key)
        if compiled is None:
            self.jit_calls += 1
            compiled = self.kernel[grid](*args, **kwargs)
            # Keep the handle only if it can launch on its own (Triton 3.x's CompiledKernel[grid]); otherwise
            # this kernel always goes through the JIT.
            if hasattr(compiled, "__getitem__") and hasattr(compiled, "run"):
                self._compiled[key] = compiled
            else:
                self._direct = False
            return compiled
        self.fast_calls += 1
        params = {k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS}
        g = tuple(grid) + (1,) * (3 - len(grid))
        compiled[g](*self._ordered(args, params))
        return compiled
