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


def test_claim_layers_is_claim_for_each_layer():
    """A decode step's run claims its layers in one call: the same positions noted written and the
    same refusals as claim() layer by layer (a full cache; a ring that no longer holds the window)."""
    from pyml.core.errors import PymlError
    import pytest
    windows = [4, None, 4, None]
    one, run = (KVCache(4, 1, 32, 600, "f16", windows=windows) for _ in range(2))
    assert one.is_ring(0) and one.is_ring(2)
    for pos in range(3):
        for layer in range(4):
            one.claim(layer, pos)
        run.claim_layers(range(4), pos)
        assert run.written == one.written == [pos + 1] * 4
    run.claim_layers(range(1, 3), 3)
    assert run.written == [3, 4, 4, 3]
    with pytest.raises(PymlError, match="KV cache full: position 601 exceeds its 600 slots"):
        run.claim_layers(range(4), 600)
    for cache in (one, run):  # layer 0's ring went on to position 400: what position 100 attends to is gone
        cache.written[0] = 400
    with pytest.raises(PymlError, match="layer 0's sliding-window ring no longer holds the positions before 100"):
        one.claim(0, 100)
    with pytest.raises(PymlError, match="layer 0's sliding-window ring no longer holds the positions before 100"):
        run.claim_layers(range(4), 100)
    run.claim_layers(range(1, 4), 100)  # layer 2's ring still holds its window
    assert run.written == [400, 101, 101, 101]
