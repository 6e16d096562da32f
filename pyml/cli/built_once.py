"""Files and folders built once into the cache (requantized models, random-weight stand-ins).

Two processes may build the same one at once: two pyml-bench runs, or two workers of the test
suite on a fresh machine. Each builds under a private name beside the target and renames it into
place when it is whole, so neither writes into the other's file and no reader meets half of one.
A folder carries a `.complete` marker: one without it was left by an interrupted build.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

COMPLETE = ".complete"


def built_once(out: Path, build, stale: bool = False) -> Path:
    """`out`, made by build(path) unless it is there and whole (and not `stale`)."""
    if _whole(out) and not stale:
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        build(tmp)
        if tmp.is_dir():
            (tmp / COMPLETE).touch()
            if out.is_dir() and not _whole(out):
                shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)  # a file replaces atomically; a folder only where none is
        except OSError:
            if not _whole(out):  # not another process's finished folder: a real failure
                raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return out


def _whole(path: Path) -> bool:
    return (path / COMPLETE).exists() if path.is_dir() else path.exists()
