"""How pyml compiles its kernels: the fastmath flags, and an on-disk kernel cache that stays honest.

FASTMATH is every kernel's flag set: fastmath without nnan/ninf, because attention masks and
softmax rely on -inf behaving as -inf.

Numba stamps a cached function with its own source file only. Our kernels inline intrinsics
and helpers from sibling modules (pyml/core/simd.py, activation.py, these flags), so after an
edit there Numba would go on loading old machine code - and in a shared working tree, a
process started before the edit writes old code back into the cache after any clean-up. So
the cache entries of pyml/core, pyml/quant and pyml/nn (the fused decode kernels) are stamped
with a fingerprint of all their kernel source files as this process read them at import: an
entry written from other sources is treated as absent and recompiled.

Because the stamp says which sources an entry came from, the entries are also filed by package
folder (and instruction-set path) rather than by absolute path: a fresh clone of the same sources
(CI's) finds the kernels an earlier clone compiled, and a run with PYML_ISA set leaves the native
path's entries alone. Two different versions run at once share the entries (each recompiles what
the other wrote, correct but slow): give them separate NUMBA_CACHE_DIRs.

The stamp holds in every place Numba may keep the cache (a NUMBA_CACHE_DIR, as CI sets, too:
a CI cache kept across runs once served kernels compiled before a NaN fix in simd.py). This
goes through Numba's cache-locator hook (the one NUMBA_CACHE_LOCATOR_CLASSES uses); if that
internal API is missing, stale entries are instead deleted whenever the sources change.

One kernel is compiled by one process at a time: a process that misses the cache takes a lock
file for that function and signature (flock: released by the kernel if the process dies), looks
in the cache once more and compiles only if it is still missing. Several processes starting on a
cold cache at once - the test suite's workers and the commands its tests start, two pyml-serve
replicas, pyml-batch's Ray workers - each wait for a kernel another is compiling and load it,
instead of compiling it again on a core the others need.

A function's entries share one index file (every signature, and every closure a factory such as
float_kernels makes), which Numba rewrites by read-modify-write. Two processes saving two entries
of one function at once both read the old index: the last writer dropped the other's entry (a
recompile in every later run), and both could pick the same data file number, leaving an index
entry that names the other signature's machine code. So the index is rewritten under a lock file of
its own, held only while it is read, extended and written.

A kernel calls its own copies of the kernels it calls. Numba links a callee's code into each
caller's module as a weak symbol, and the process's dynamic linker binds every weak symbol to the
first definition of that name it loaded: the callee's own library when it was compiled (or loaded)
before the caller, else the caller's copy - which LLVM optimised again inside the caller's module,
so its machine code, and its float results, can differ from the callee's own compile. A kernel's
bits then depended on which kernels the process had compiled or loaded first: a first run (every
callee compiled, so loaded, before its callers) differed from a run on a warm cache by one ulp, and
a half-warm cache mixed the two. After optimisation, the copies linked into a module are renamed
for that module alone (_own_linked_copies), so a kernel runs the same machine code in every process.

A damaged cache file - an index or a kernel's machine code cut short or overwritten (a full disk, a
copy interrupted, two builds sharing one NUMBA_CACHE_DIR) - stopped every run at its first kernel
with "internal error: UnpicklingError: pickle data was truncated" until the user found the folder
and deleted it. A file that does not unpickle is now a cache miss: one warning line names it, the
kernel is compiled again and its entry (or the whole index) written anew.

Importing this module installs the locators and that renaming; every kernel module imports
FASTMATH from here, so both are in place before any kernel is decorated.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pickle
import threading
from pathlib import Path

from numba.core import caching, codegen, dispatcher

from pyml.core import compiles, perf
from pyml.core.isa import ISA

FASTMATH = {"contract", "arcp", "reassoc", "nsz", "afn"}

_PACKAGE = Path(__file__).resolve().parents[1]
_KERNEL_DIRS = (_PACKAGE / "core", _PACKAGE / "quant", _PACKAGE / "nn")  # nn: attention and the decode recipe
# the modules whose code ends up inside compiled kernels (not the dispatch or the docs)
_KERNEL_SOURCES = ("core/atomics.py", "core/clock.py", "core/isa.py", "core/jit.py", "core/ops.py",
                   "core/simd.py", "core/simd512.py", "core/simd_int.py",
                   "quant/activation.py", "quant/bf16_gemm.py", "quant/blocks32.py", "quant/floats.py",
                   "quant/ggml_types.py", "quant/interleaved_gemm.py", "quant/interleaved_gemv.py",
                   "quant/interleaved_pairs.py", "quant/interleaved_rows.py", "quant/interleaved_tiles.py",
                   "quant/interleaved_triples.py", "quant/kernel_set.py", "quant/kquantizers.py", "quant/kquants.py",
                   "quant/lowbit.py", "quant/quantizers.py",
                   "nn/attention_kernels.py", "nn/attention_prefill.py", "nn/decode_kernels.py",
                   "nn/decode_recipe.py")
# the instruction-set path is part of the stamp: kernels compiled for one path (isa.py) are never
# loaded for another on the same CPU (PYML_ISA=avx2 beside the default avx512_vnni)
FINGERPRINT = hashlib.sha1(b"".join((_PACKAGE / name).read_bytes() for name in _KERNEL_SOURCES)
                           + ISA.encode()).hexdigest()


def install() -> None:
    """Register the fingerprint-stamped locators (idempotent)."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)  # renamed in 0.6x
    # Numba's own order: a user-chosen NUMBA_CACHE_DIR, else __pycache__ beside the source,
    # else the user-wide cache. Each gets a stamped twin, so the stamp holds wherever the cache is.
    bases = [getattr(caching, name, None) for name in
             ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")]
    if impl is None or None in bases or not hasattr(impl, "_locator_classes"):
        _drop_stale_kernels()
        return
    if any(getattr(c, "_pyml_stamped", False) for c in impl._locator_classes):
        return
    impl._locator_classes[:0] = [_stamped(base) for base in bases]
    _unique_names_across_processes()
    _compile_once_across_processes()
    _unreadable_files_are_misses()


def _stamped(base: type) -> type:
    """`base`, restricted to pyml's kernel folders and stamped with the fingerprint."""

    class PackageStampedLocator(base):
        _pyml_stamped = True

        @classmethod
        def from_function(cls, py_func, py_file):
            if Path(py_file).resolve().parent not in _KERNEL_DIRS:
                return None  # not ours: Numba's own locators
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return FINGERPRINT

        @classmethod
        def get_suitable_cache_subpath(cls, py_file):
            # Numba names the folder after a hash of the source's absolute path, so every fresh clone
            # (CI's among them) recompiled every kernel, ~8 minutes on 2 cores. The fingerprint
            # already says whether an entry was compiled from these sources, wherever they live.
            # A folder per instruction-set path: a function's entries share one index file, so a
            # run on another path (PYML_ISA=avx2, test_isa's probes) overwrote the native path's
            # index, and the next native run recompiled what it had read (20 min of CI once).
            return f"pyml_{Path(py_file).resolve().parent.name}_{ISA}"

    PackageStampedLocator.__qualname__ = f"PackageStamped{base.__name__}"
    return PackageStampedLocator


_held = threading.local()  # this thread's compile locks, innermost last (a compile types its callees)


def _unique_names_across_processes() -> None:
    """Numba names a compiled function and its environment (the constants it boxes results with) by its
    qualified name, its argument types and a counter that starts at 1 in every process. The closures a
    kernel factory makes for each type (kernel_set's dequant_rows, ...) share the first two, so two
    compiled in different processes could both be "v1"; a process loading both from the cache then
    gave the second the first's environment (Numba keeps one per name): "In 'NRT_adapt_ndarray_to_python',
    'descr' is NULL" on CI, or the other kernel's constants. The counter now starts at a random 40-bit
    offset in each process, so names made in different processes do not meet."""
    import itertools
    import secrets

    from numba.core import bytecode
    bytecode.FunctionIdentity._unique_ids = itertools.count(1 + secrets.randbits(40))


def _compile_once_across_processes() -> None:
    """Wrap Numba's cache look-up and compile so that a miss on one of pyml's kernels takes that
    kernel's lock file (see the module's docstring) until the compile that follows has ended."""
    load, compile_ = caching.Cache.load_overload, dispatcher.Dispatcher.compile
    if getattr(load, "_pyml", False) or not hasattr(fcntl, "flock"):
        return

    def load_overload(self, sig, target_context):
        found = load(self, sig, target_context)
        if (found is not None or not getattr(self._impl.locator, "_pyml_stamped", False)
                or not hasattr(_held, "stack")):  # not one of our kernels, or not through compile()
            return found
        name = f"{self._impl.filename_base}-{hashlib.sha1(repr(sig).encode()).hexdigest()[:16]}.lock"
        try:
            fd = os.open(os.path.join(self._cache_path, name), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # a read-only cache folder: nothing to share, so nothing to wait for
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process compiles this kernel: wait for it, shown as a compile
            with compiles.waiting(f"{self._py_func.__module__.rpartition('.')[2]}.{self._py_func.__name__}"):
                fcntl.flock(fd, fcntl.LOCK_EX)
        _held.stack.append(fd)
        return load(self, sig, target_context)  # it may have compiled it meanwhile

    def compile(self, sig):
        if not hasattr(_held, "stack"):
            _held.stack = []
        depth = len(_held.stack)
        try:
            return compile_(self, sig)
        finally:  # saved to the cache (or failed): the others may go on
            while len(_held.stack) > depth:
                fd = _held.stack.pop()
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    load_overload._pyml = True
    caching.Cache.load_overload, dispatcher.Dispatcher.compile = load_overload, compile
    _save_index_entries_one_process_at_a_time()


def _save_index_entries_one_process_at_a_time() -> None:
    """Wrap Numba's index update (read the index, add an entry, write it) in the index's own lock
    file (see the module's docstring). Never held while waiting for another lock: no deadlock."""
    save = caching.IndexDataCacheFile.save
    if getattr(save, "_pyml", False):
        return

    def locked_save(self, key, data):
        try:
            fd = os.open(self._index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # a read-only cache folder: Numba's own save fails there as it would
            return save(self, key, data)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return save(self, key, data)
        finally:
            os.close(fd)  # releases the lock

    locked_save._pyml = True
    caching.IndexDataCacheFile.save = locked_save


def _unreadable_files_are_misses() -> None:
    """An index or data file that does not unpickle reads as absent (see the module's docstring):
    an index as empty (the next save writes it anew with the entry it saves), a data file as no
    entry (the kernel is compiled and its file overwritten). OSErrors stay Numba's to handle."""
    index, data = caching.IndexDataCacheFile._load_index, caching.IndexDataCacheFile._load_data
    if getattr(index, "_pyml", False):
        return

    def load_index(self):
        try:
            return index(self)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever a damaged pickle raises
            _say_unreadable(self._index_path, e)
            return {}

    def load_data(self, name):
        try:
            return data(self, name)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001
            _say_unreadable(self._data_path(name), e)
            return None

    load_index._pyml = load_data._pyml = True
    caching.IndexDataCacheFile._load_index, caching.IndexDataCacheFile._load_data = load_index, load_data


_said_unreadable: set = set()  # each damaged file is said once (a miss looks the kernel up twice)


def _say_unreadable(path: str, error: Exception) -> None:
    if path in _said_unreadable:
        return
    _said_unreadable.add(path)
    perf.get("pyml.core.jit").logger.warning("kernel cache file %s is unreadable (%s: %s); compiling it again",
                                             path, type(error).__name__, error)


def kernel_cache_folders() -> list[Path]:
    """The folders holding pyml's compiled kernels, wherever Numba put them (the order of
    `install`'s locators): NUMBA_CACHE_DIR's pyml_* folders, the __pycache__ beside the sources,
    Numba's user-wide cache."""
    found = []
    chosen = os.environ.get("NUMBA_CACHE_DIR")
    roots = [Path(chosen)] if chosen else []
    roots += [Path(os.path.expanduser("~")) / ".cache" / "numba"]
    for root in roots:
        found += sorted(p for p in root.glob("pyml_*") if p.is_dir())
    found += [folder / "__pycache__" for folder in _KERNEL_DIRS if (folder / "__pycache__").is_dir()]
    return found


def kernel_cache_entries(folder: Path) -> dict:
    """One folder's kernel files: `files`, `bytes`, and `current`, the functions whose index was
    written from these sources and this instruction-set path (the others are recompiled on use)."""
    files = [f for f in folder.iterdir() if f.suffix in (".nbi", ".nbc")]  # not the compile locks
    current = 0
    for index in (f for f in files if f.suffix == ".nbi"):
        try:
            with open(index, "rb") as fh:
                pickle.load(fh)  # Numba's version
                stamp, _ = pickle.loads(fh.read())
        except Exception:  # noqa: BLE001 - a damaged or foreign index is simply not current
            continue
        current += stamp == FINGERPRINT
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "current": current}


def _drop_stale_kernels() -> None:
    """Fallback: delete pyml's cached kernels when their sources changed since they were written."""
    for folder in _KERNEL_DIRS:
        cache = folder / "__pycache__"
        stamp = cache / "numba-kernels.sha1"
        try:
            if stamp.read_text() == FINGERPRINT:
                continue
        except OSError:  # no stamp yet
            pass
        try:
            for f in cache.glob("*.nb[ic]"):
                f.unlink(missing_ok=True)
            cache.mkdir(exist_ok=True)
            stamp.write_text(FINGERPRINT)
        except OSError:  # a read-only install: nothing of ours to drop
            pass


def _own_linked_copies() -> None:
    """Rename, in every module Numba finalises, the functions linked in from other kernels'
    libraries (linkonce_odr copies of Numba-mangled functions) to names of that module alone:
    its calls then bind to its own copies, never to another library's (module docstring)."""
    finalize = codegen.CPUCodeLibrary._finalize_final_module
    if getattr(finalize, "_pyml", False):
        return

    def finalize_final_module(self):
        module = self._final_module
        copies = [fn for fn in module.functions if not fn.is_declaration and fn.name.startswith("_ZN")
                  and fn.linkage == codegen.ll.Linkage.linkonce_odr]
        if copies:
            own = sorted(fn.name for fn in module.functions
                         if not fn.is_declaration and fn.linkage == codegen.ll.Linkage.external)
            tag = hashlib.sha1("\n".join(own).encode()).hexdigest()[:16]
            for fn in copies:
                fn.name = f"{fn.name}.in.{tag}"
        return finalize(self)

    finalize_final_module._pyml = True
    codegen.CPUCodeLibrary._finalize_final_module = finalize_final_module


install()
_own_linked_copies()
