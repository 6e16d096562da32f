"""Kernel cache entries are stamped with the fingerprint of all kernel sources (pyml/quant/cache.py)."""

import numba

from pyml.quant import cache, kquants, legacy


def test_kernels_use_the_package_stamped_cache():
    if numba.config.CACHE_DIR:  # a user-chosen cache directory keeps Numba's own locators
        return
    for kernel in (legacy.gemv, kquants.gemm, legacy.dequant_rows):
        locator = kernel._cache._impl.locator
        assert type(locator).__name__ == "PackageStampedLocator"
        assert locator.get_source_stamp() == cache._FINGERPRINT
