"""A batched decode step's attention (attention_kernels.attend_decode_batch over a KVPool) against float64
NumPy softmax attention written out in test_attention_kernels (`reference`): rows of different lengths,
sequences in any order of the pool, sliding windows over wrapped rings, each stored type; and its KV
write against KVCache.update's."""

import numpy as np
import pytest

from pyml.nn import attention_kernels
from pyml.nn.kv_cache import KVPool
from tests.nn.test_attention_kernels import BOUND_VS_F32, TYPES, reference

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}


def _run(kv_type, shape, lengths, window=None, seed=0):
    """A pool of len(lengths) + 2 sequences; row b decodes the next position of sequence seqs[b] after
    lengths[b] - 1 cached ones. Returns (got, expect on the stored keys, expect on the float32 keys)."""
    heads, n_kv, hd = shape
    rng = np.random.default_rng(seed)
    B = len(lengths)
    max_len = max(lengths) + 8
    pool = KVPool(B + 2, 1, n_kv, hd, max_len, kv_type, windows=[window])
    seqs = rng.permutation(B + 2)[:B].astype(np.int64)
    ends = np.array(lengths, np.int64)
    exact_k = [rng.standard_normal((n, n_kv, hd), np.float32) for n in lengths]
    exact_v = [rng.standard_normal((n, n_kv, hd), np.float32) for n in lengths]
    for s, n, k, v in zip(seqs, lengths, exact_k, exact_v):
        cache = pool.sequence(s)
        for p in range(0, n - 1, 40):  # turns of 40: a ring wraps as in a chat
            cache.update(0, p, k[p:min(p + 40, n - 1)], v[p:min(p + 40, n - 1)])
    q = rng.standard_normal((B, heads, hd), np.float32)
    k_new = np.stack([k[-1] for k in exact_k])
    v_new = np.stack([v[-1] for v in exact_v])
    got = attention_kernels.attend_decode_batch(q, k_new, v_new, pool.layer(0), seqs, ends, window or 0, 0.125,
                                                np.full((B, heads, hd), np.nan, np.float32))
    expect, exact = np.empty((B, heads, hd)), np.empty((B, heads, hd))
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        start = max(0, n - window) if window else 0
        stored_k, stored_v = (np.zeros((n_kv, n, hd), np.float32) for _ in range(2))
        stored_k[:, start:], stored_v[:, start:] = pool.sequence(s).view(0, n, start)
        qpos = np.array([n - 1])
        expect[b] = reference(q[b][None], stored_k, stored_v, qpos, 0.125, window or 0)[0]
        exact[b] = reference(q[b][None], exact_k[b].transpose(1, 0, 2), exact_v[b].transpose(1, 0, 2), qpos, 0.125,
                             window or 0)[0]
    return got, expect, exact, pool, seqs


@pytest.mark.parametrize("kv_type", TYPES)
@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize("lengths", [[1], [300], [1, 7, 64, 65, 133, 176, 250, 2, 512, 30, 100, 129, 3, 64, 200, 90],
                                     [176] * 16, [513, 5, 70]], ids=["one", "one-long", "ragged16", "even16", "three"])
def test_batch_matches_float64(kv_type, model, lengths):
    got, expect, exact, *_ = _run(kv_type, SHAPES[model], lengths, seed=len(lengths) + lengths[0])
    np.testing.assert_allclose(got, expect, rtol=2e-5, atol=2e-6)
    assert np.abs(got - exact).max() < BOUND_VS_F32[kv_type]


@pytest.mark.parametrize("kv_type", TYPES)
@pytest.mark.parametrize("lengths", [[601], [601, 20, 300, 21, 590]])
def test_batch_sliding_window_over_a_wrapped_ring(kv_type, lengths):
    """Gemma 3's sliding layers in miniature: window 20, a ring of 280 slots that has wrapped twice."""
    got, expect, exact, *_ = _run(kv_type, (4, 1, 64), lengths, window=20, seed=7)
    np.testing.assert_allclose(got, expect, rtol=2e-5, atol=2e-6)
    assert np.abs(got - exact).max() < BOUND_VS_F32[kv_type]


@pytest.mark.parametrize("kv_type", TYPES)
def test_batch_writes_what_update_writes(kv_type):
    """The new positions land in their sequences as KVCache.update stores them (and nowhere else)."""
    lengths = [9, 130, 64]
    got, _, _, pool, seqs = _run(kv_type, SHAPES["smollm2"], lengths, seed=3)
    rng = np.random.default_rng(3)  # the same draws as _run: rebuild the sequences one by one
    ref = KVPool(len(lengths) + 2, 1, 3, 64, max(lengths) + 8, kv_type)
    rng.permutation(len(lengths) + 2)
    exact_k = [rng.standard_normal((n, 3, 64), np.float32) for n in lengths]
    exact_v = [rng.standard_normal((n, 3, 64), np.float32) for n in lengths]
    for s, n, k, v in zip(seqs, lengths, exact_k, exact_v):
        ref.sequence(s).update(0, 0, k, v)
    for a, b in zip(pool.layer(0), ref.layer(0)):
        np.testing.assert_array_equal(a, b)


def batch_and_alone(kv_type, threads, window):
    """(attend_decode_batch's rows, attend_decode's of each row's sequence alone): rows at 5, 129, 300
    and 700 positions, at `threads` threads."""
    import numba
    saved = numba.get_num_threads()
    numba.set_num_threads(min(threads, saved))
    try:
        lengths = [5, 129, 300, 700]
        got, _, _, pool, seqs = _run(kv_type, SHAPES["smollm2"], lengths, window=window, seed=11)
        rng = np.random.default_rng(11)  # _run's query draws, after its permutation and keys/values
        rng.permutation(len(lengths) + 2)
        for m in lengths * 2:
            rng.standard_normal((m, 3, 64), np.float32)
        q = rng.standard_normal((len(lengths), 9, 64), np.float32)
        alone = np.empty_like(got)
        for b, (s, n) in enumerate(zip(seqs, lengths)):
            start = max(0, n - window) if window else 0
            attention_kernels.attend_decode(q[b], *pool.sequence(s).layer(0), start, n, 0.125, alone[b])
    finally:
        numba.set_num_threads(saved)
    return got, alone


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_type", TYPES)
@pytest.mark.parametrize("window", [None, 100])
def test_each_row_has_its_decode_steps_bits(kv_type, threads, window):
    """Each row gets the bits attend_decode gives its sequence alone (the decode step's parts: its span
    cut in two past 128 positions at 2 threads, merged as that step merges) - shallow and deep rows,
    a window: what makes a batch's greedy tokens those of each prompt alone at any depth, in any process
    (core/jit.py: each kernel runs its own copies of what it calls)."""
    got, alone = batch_and_alone(kv_type, threads, window)
    np.testing.assert_array_equal(got, alone)
