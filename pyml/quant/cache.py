"""Keep Numba's on-disk kernel cache honest for this package.

Numba stamps a cached function with its own source file only. Our kernels inline intrinsics
and helpers from sibling modules (simd.py, activation.py), so after an edit there Numba would
go on loading old machine code - and in a shared working tree, a process started before the
edit writes old code back into the cache after any clean-up. So the package's cache entries
are stamped with a fingerprint of all the kernel source files as this process read them at
import: an entry written from other sources is treated as absent and recompiled.

The stamp holds in every place Numba may keep the cache (a NUMBA_CACHE_DIR, as CI sets, too:
a CI cache kept across runs once served kernels compiled before a NaN fix in simd.py).
This goes through Numba's cache-locator hook (the same one NUMBA_CACHE_LOCATOR_CLASSES
uses); if that internal API is missing, stale entries are instead deleted whenever the
sources change.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


_HERE = Path(__file__).resolve().parent
# the modules whose code ends up inside compiled kernels (not the dispatch or the docs)
_KERNEL_SOURCES = ("activation.py", "bench.py", "floats.py", "kquants.py", "legacy.py", "packed.py", "quantize.py", "simd.py")
_FINGERPRINT = hashlib.sha1(b"".join((_HERE / name).read_bytes() for name in _KERNEL_SOURCES)).hexdigest()


def install() -> None:
    """Register the fingerprint-stamped locators; call before any kernel module is imported."""
    from numba.core import caching
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


def _stamped(base: type) -> type:
    """`base`, restricted to this package's kernels and stamped with the package fingerprint."""

    class PackageStampedLocator(base):
        _pyml_stamped = True

        @classmethod
        def from_function(cls, py_func, py_file):
            if Path(py_file).resolve().parent != _HERE:
                return None  # not ours: Numba's own locators
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return _FINGERPRINT

    PackageStampedLocator.__qualname__ = f"PackageStamped{base.__name__}"
    return PackageStampedLocator


def _drop_stale_kernels() -> None:
    """Fallback: delete the package's cached kernels when its sources changed since they were written."""
    cache = _HERE / "__pycache__"
    stamp = cache / "numba-kernels.sha1"
    try:
        if stamp.read_text() == _FINGERPRINT:
            return
    except OSError:  # no stamp yet
        pass
    try:
        for f in cache.glob("*.nb[ic]"):
            f.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(_FINGERPRINT)
    except OSError:  # a read-only install: nothing of ours to drop
        pass
