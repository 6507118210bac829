"""Progress bars for the benchmarks' long sweeps (tqdm on stderr; a silent stand-in without tqdm).

The benchmarks run as scripts (``python3 benchmarks/bench_x.py``), so their folder is on ``sys.path``
and they import this module as ``from _progress import progress``.
"""

from __future__ import annotations

import sys

try:  # a progress bar over the long sweeps (tqdm is optional: without it, e.g. on the H200 image, no bar)
    from tqdm import tqdm as _tqdm
except ImportError:
    _tqdm = None


class _NoBar:
    """What ``progress`` returns without tqdm: iterates like the sweep, shows nothing."""

    def __init__(self, iterable=None):  # noqa: ANN001
        self.iterable = iterable

    def __iter__(self):  # noqa: ANN204
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress(iterable=None, total: int | None = None, desc: str = ""):  # noqa: ANN001, ANN201
    """A tqdm bar on stderr (stdout keeps the per-shape lines), or a silent stand-in without tqdm."""
    if _tqdm is None:
        return _NoBar(iterable)
    return _tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
