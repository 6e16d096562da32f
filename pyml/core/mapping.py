"""Giving back the pages of a memory-mapped tensor that has been copied elsewhere.

Weights are read-only views of a file mapping. A page of it that has been read stays in the
process's resident set while the mapping lives, even when nothing will read it again - as
after Linear.fuse copies the Q, K and V matrices into one array: without this the file's
pages and the fused copy would both count, about twice the file in RSS. madvise(DONTNEED) on a
read-only file mapping only drops the process's page-table entries: the data stays in the
page cache, and a later read faults it back in from the file, so it is always safe.
"""

from __future__ import annotations

import mmap

import numpy as np

PAGE = mmap.PAGESIZE


def _mapping_of(array: np.ndarray):
    """The mmap object under `array` (through numpy's base chain), or None."""
    a = array
    while a is not None:
        mm = getattr(a, "_mmap", None)
        if isinstance(mm, mmap.mmap):
            return mm
        if isinstance(a, mmap.mmap):
            return a
        a = getattr(a, "base", None)
    return None


def release_pages(array: np.ndarray) -> int:
    """Drop the whole pages `array` occupies from the resident set, if it is a view of a file
    mapping; returns the bytes released (0 for ordinary arrays, or where madvise is missing)."""
    mm = _mapping_of(array)
    if mm is None or mm.closed or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    start = array.__array_interface__["data"][0] - np.frombuffer(mm, np.uint8).__array_interface__["data"][0]
    if start < 0 or start + array.nbytes > len(mm):
        return 0
    first = -(-start // PAGE) * PAGE                   # whole pages only: neighbours stay
    last = (start + array.nbytes) // PAGE * PAGE
    if last <= first:
        return 0
    mm.madvise(mmap.MADV_DONTNEED, first, last - first)
    return last - first
