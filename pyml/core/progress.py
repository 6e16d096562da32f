"""Progress bars for long work (fetching a model, compiling kernels, quantizing, sweeps).

One look everywhere: tqdm on stderr, drawn only at a terminal (a log file gets no bar
redraws), erased when done, and - with `delay` - shown only if the work turns out long,
so a warm cache stays silent.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: int | None = None, desc: str = "", unit: str = "it", quiet: bool = False, delay: float = 0.0,
        **options):
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, delay=delay,
                disable=quiet or not sys.stderr.isatty(), **options)
