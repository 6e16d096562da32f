"""Numba's runtime module from a file, not compiled in every process.

Numba's on-disk cache holds our kernels, but not its own runtime module (NRT: the reference
counting and allocation helpers every kernel links): every process compiles that on the first
kernel it loads, and the one compile runs LLVM's optimiser and X86 code generator on it, paging
in ~21 MiB of libllvmlite's code that a process whose kernels all come from the cache never
touches otherwise - a third of SmolLM2 Q4_1's memory above llama.cpp's (docs/performance-journal.md,
"Cold start"). `runtime_library` keeps the module's object code beside the kernels, checksummed
and keyed by the Numba and llvmlite versions and the code generator's target (triple, CPU,
features), and loads it as Numba loads a cached kernel (`unserialize_library`: object code plus
the bitcode a newly compiled kernel links against). A missing, damaged or foreign file is
compiled as Numba would (`nrtdynmod.create_nrt_module`, then finalize) and written again.

`install()` routes Numba's `compile_nrt_functions` through it; pyml.core.runtime installs it on
import, which every entry point reaches before its first kernel call (a Numba without that hook
point simply keeps compiling the module itself).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import llvmlite
import numba
from numba.core.codegen import CPUCodeLibrary
from numba.core.runtime import nrtdynmod

MAGIC = b"PYMLNRT1"
HEAD = struct.Struct("<8s32sQQ")  # magic, sha256 of the rest, object code and bitcode lengths
source: str | None = None  # "file" or "compiled", once the first kernel of the process has loaded


def cache_dir() -> Path:
    """PYML_NUMBA_RUNTIME_CACHE, else beside the kernels (NUMBA_CACHE_DIR), else pyml's cache folder."""
    override = os.environ.get("PYML_NUMBA_RUNTIME_CACHE") or numba.config.CACHE_DIR
    if override:
        return Path(override).expanduser()
    return Path(os.environ.get("PYML_CACHE") or "~/.cache/pyml").expanduser() / "numba"


def cache_path(ctx, folder: Path | None = None) -> Path:
    key = repr((numba.__version__, llvmlite.__version__, ctx.codegen().magic_tuple(), numba.config.NRT_STATS))
    return (folder or cache_dir()) / f"pyml-nrt-{hashlib.sha1(key.encode()).hexdigest()[:16]}.bin"


def runtime_library(ctx, folder: Path | None = None):
    """Numba's runtime library for target context `ctx`: loaded from a valid file, else compiled
    and written (a folder that cannot be written: compiled again next time, as Numba would)."""
    global source
    path = cache_path(ctx, folder)
    try:
        raw = path.read_bytes()
        magic, digest, n_object, n_bitcode = HEAD.unpack_from(raw)
        body = raw[HEAD.size:]
        if magic == MAGIC and len(body) == n_object + n_bitcode and hashlib.sha256(body).digest() == digest:
            library = ctx.codegen().unserialize_library(("nrt", "object", (body[:n_object], body[n_object:])))
            source = "file"
            return library
    except (OSError, struct.error):  # none yet, or too short for a header: compiled below
        pass
    ir_module, library = nrtdynmod.create_nrt_module(ctx)  # compile_nrt_functions, object kept
    library.enable_object_caching()
    library.add_ir_module(ir_module)
    library.finalize()
    source = "compiled"
    try:
        _, _, (object_code, bitcode) = library.serialize_using_object_code()
        body = bytes(object_code) + bytes(bitcode)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(HEAD.pack(MAGIC, hashlib.sha256(body).digest(), len(object_code), len(bitcode)) + body)
        os.replace(tmp, path)  # whole or absent: a concurrent process reads one or the other
    except (OSError, ValueError, TypeError):  # a read-only folder, or a Numba that serialises otherwise
        pass
    return library


def _compile_nrt_functions(ctx):
    return runtime_library(ctx)


def install() -> None:
    """Route Numba's runtime compile through runtime_library (idempotent). A Numba whose internals
    differ (no create_nrt_module, no object-code serialisation) keeps compiling it itself."""
    needed = (hasattr(nrtdynmod, "compile_nrt_functions") and hasattr(nrtdynmod, "create_nrt_module")
              and all(hasattr(CPUCodeLibrary, m) for m in ("enable_object_caching", "serialize_using_object_code")))
    if needed:
        nrtdynmod.compile_nrt_functions = _compile_nrt_functions
