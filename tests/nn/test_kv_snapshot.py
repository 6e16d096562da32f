"""KVCache.snapshot / restore: a ring layer that was written past the snapshot holds, after restore,
exactly what it held before (the benchmark repeats work at one depth this way)."""

import numpy as np

from pyml.nn.kv_cache import KVCache


def test_restore_undoes_writes_that_wrapped_a_ring():
    cache = KVCache(2, 1, 32, 600, "f16", windows=[4, None])
    assert cache.is_ring(0) and not cache.is_ring(1)
    rng = np.random.default_rng(0)
    kv = [rng.standard_normal((300, 1, 32)).astype(np.float32) for _ in range(2)]
    for layer in (0, 1):
        cache.update(layer, 0, *kv)
    cache.length = 300
    keep = cache.slots[0]
    before = [cache.view(0, 300, 300 - keep), cache.view(1, 300)]
    snap = cache.snapshot()
    more = [rng.standard_normal((200, 1, 32)).astype(np.float32) for _ in range(2)]
    for layer in (0, 1):
        cache.update(layer, 300, *more)  # the ring wraps: positions < 300 are overwritten in layer 0
    cache.length = 500
    assert not np.array_equal(cache.k[0], snap[2][0][0])  # positions 36..235 are gone from the ring
    cache.restore(snap)
    assert cache.length == 300 and cache.resumable(300)
    for got, want in zip((cache.view(0, 300, 300 - keep), cache.view(1, 300)), before):
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert cache.bytes_per_position(1) == 2 * 32 * 2  # f16 keys and values of one head
