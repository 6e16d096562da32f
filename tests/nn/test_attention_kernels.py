"""Attention over the KV cache (quant/attention_kernels.py) against float64 NumPy attention written out
here: the stored codes against the gguf package's Q8_0 quantizer and NumPy's float16; decode and
tiled prefill against softmax(q K^T s + mask) V on the same stored keys (float32 tolerance), and
against the float32 keys within each type's documented bound; the prefill's bf16 path (vdpbf16ps,
where the CPU has AVX-512 BF16) against the same float64 reference within bf16's bound."""

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from pyml.core import isa
from pyml.nn.kv_cache import KVCache
from pyml.nn import attention_kernels, attention_prefill

TYPES = ["f32", "f16", "q8_0"]
# max |error| of a context vector (unit-normal keys, values and queries, scale 1/8) against float32
# keys and values: f16 rounds each to 11 bits, q8_0 to 1/254 of its 32-value block's max
BOUND_VS_F32 = {"f32": 2e-5, "f16": 3e-3, "q8_0": 6e-2}
# the bf16 prefill rounds q (scaled), keys, values and the probabilities to 8 significant bits (RNE,
# relative error <= 2^-9 each); scores, softmax and sums stay float32. max |error| of a context
# vector against float64 on the stored keys, the same unit-normal inputs (measured: <= 2.2e-2, T = 1..512)
BOUND_BF16 = 3e-2
needs_bf16 = pytest.mark.skipif(not attention_prefill.HAVE_BF16, reason=f"no avx512_bf16 on ISA path {isa.ISA}: "
                                "the bf16 prefill attention cannot run (the float32 path is tested)")


def reference(q, keys, values, qpos, scale, window=0):
    """float64 softmax(q K^T * scale) V: q [T, H, hd] at positions qpos [T]; keys, values [Hkv, S, hd]
    holding positions 0 .. S-1; causal, and with a window, keys at distance >= window masked."""
    T, H, hd = q.shape
    Hkv, S = keys.shape[:2]
    group = H // Hkv
    k_pos = np.arange(S)[None, :]
    masked = k_pos > qpos[:, None]
    if window:
        masked |= qpos[:, None] - k_pos >= window
    out = np.empty((T, H, hd))
    for h in range(H):
        s = q[:, h].astype(np.float64) @ keys[h // group].astype(np.float64).T * scale  # [T, S]
        s[masked] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = p @ values[h // group].astype(np.float64) / p.sum(axis=1, keepdims=True)
    return out


def filled(kv_type, n_kv, hd, n, rng, max_len=None, window=None):
    k = rng.standard_normal((n, n_kv, hd), np.float32)
    v = rng.standard_normal((n, n_kv, hd), np.float32)
    cache = KVCache(1, n_kv, hd, max_len or n, kv_type, windows=[window])
    cache.update(0, 0, k, v)
    return cache, k.transpose(1, 0, 2), v.transpose(1, 0, 2)


def test_q8_0_codes_and_scales_are_ggml_s():
    rng = np.random.default_rng(0)
    cache, k, v = filled("q8_0", 2, 64, 20, rng)
    for ours, theirs in ((cache.view(0, 20)[0], k), (cache.view(0, 20)[1], v)):
        blocks = quants.quantize(theirs.reshape(-1, 64), GGMLQuantizationType.Q8_0)
        expect = quants.dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(theirs.shape)
        np.testing.assert_array_equal(ours, expect)


def test_f16_is_numpys_float16():
    rng = np.random.default_rng(1)
    cache, k, v = filled("f16", 3, 32, 17, rng)
    keys, values = cache.view(0, 17)
    np.testing.assert_array_equal(keys, k.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(values, v.astype(np.float16).astype(np.float32))


# hd 48 and 16: an odd number of 16-lane slices, the 512-bit P.V loop's last one alone (float caches
# only: q8_0's blocks are 32 values of head_dim)
@pytest.mark.parametrize("kv_type,heads,kv_heads,hd",
                         [(t, *shape) for t in TYPES for shape in [(9, 3, 64), (4, 1, 256), (4, 4, 32), (8, 2, 64)]]
                         + [(t, *shape) for t in ("f32", "f16") for shape in [(6, 2, 48), (2, 1, 16)]])
@pytest.mark.parametrize("start,end", [(0, 1), (0, 7), (0, 64), (0, 65), (3, 133), (63, 300), (250, 257)])
def test_decode_matches_float64(kv_type, heads, kv_heads, hd, start, end):
    rng = np.random.default_rng(heads * 1000 + end)
    cache, k, v = filled(kv_type, kv_heads, hd, end, rng, max_len=end + 40)
    q = rng.standard_normal((heads, hd), np.float32)
    qpos = np.array([end - 1])
    got = attention_kernels.attend_decode(q, *cache.layer(0), start, end, 0.125, np.empty_like(q))
    window = end - start
    stored_k, stored_v = cache.view(0, end)
    expect = reference(q[None], stored_k, stored_v, qpos, 0.125, window)[0]
    np.testing.assert_allclose(got, expect, rtol=2e-5, atol=2e-6)
    exact = reference(q[None], k, v, qpos, 0.125, window)[0]
    assert np.abs(got - exact).max() < BOUND_VS_F32[kv_type]


def test_decode_never_reads_past_the_end():
    """NaN in the slots after the last position (the same key tile) changes nothing."""
    rng = np.random.default_rng(2)
    cache, k, v = filled("f32", 1, 64, 13, rng, max_len=40)
    nan = np.full((27, 1, 64), np.nan, np.float32)
    cache.update(0, 13, nan, nan)
    q = rng.standard_normal((2, 64), np.float32)
    got = attention_kernels.attend_decode(q, *cache.layer(0), 0, 13, 0.125, np.empty_like(q))
    np.testing.assert_allclose(got, reference(q[None], k, v, np.array([12]), 0.125)[0], rtol=2e-5, atol=2e-6)


def test_large_scores_stay_finite():
    """Scores of a few hundred: every chunk subtracts the running max before exponentiating."""
    rng = np.random.default_rng(3)
    k = 20 * rng.standard_normal((300, 1, 16 * 2), np.float32)
    v = rng.standard_normal((300, 1, 32), np.float32)
    cache = KVCache(1, 1, 32, 300, "f32")
    cache.update(0, 0, k, v)
    q = 20 * rng.standard_normal((2, 32), np.float32)
    got = attention_kernels.attend_decode(q, *cache.layer(0), 0, 300, 1.0, np.empty_like(q))
    assert np.isfinite(got).all()
    expect = reference(q[None], k.transpose(1, 0, 2), v.transpose(1, 0, 2), np.array([299]), 1.0)[0]
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_type", TYPES)
@pytest.mark.parametrize("T", [1, 2, 7, 8, 9, 63, 64, 65, 130])
@pytest.mark.parametrize("heads,kv_heads,hd,window", [(9, 3, 64, 0), (4, 1, 256, 0), (4, 2, 32, 20)])
def test_tiled_matches_the_reference(kv_type, T, heads, kv_heads, hd, window):
    rng = np.random.default_rng(T * 7 + heads)
    cache, k, v = filled(kv_type, kv_heads, hd, T, rng)
    q = rng.standard_normal((T, heads, hd), np.float32)
    got = attention_prefill.attend_tiled(q, 0, *cache.layer(0), 0.125, window, use_bf16=False)
    stored_k, stored_v = cache.view(0, T)
    qpos = np.arange(T)
    np.testing.assert_allclose(got, reference(q, stored_k, stored_v, qpos, 0.125, window), rtol=2e-5, atol=2e-6)
    assert np.abs(got - reference(q, k, v, qpos, 0.125, window)).max() < BOUND_VS_F32[kv_type]


@pytest.mark.parametrize("pos,T,window", [(100, 9, 0), (64, 64, 0), (37, 30, 16), (200, 65, 48)])
def test_tiled_on_top_of_a_cached_context(pos, T, window):
    """A prompt at positions pos .. pos+T-1 after pos cached ones (a chat turn, pp512@d4096)."""
    rng = np.random.default_rng(pos + T)
    cache, k, v = filled("f32", 2, 64, pos + T, rng)
    q = rng.standard_normal((T, 6, 64), np.float32)
    got = attention_prefill.attend_tiled(q, pos, *cache.layer(0), 0.125, window, use_bf16=False)
    expect = reference(q, k, v, np.arange(pos, pos + T), 0.125, window)
    np.testing.assert_allclose(got, expect, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("use_bf16", [False, pytest.param(True, marks=needs_bf16)], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_type", TYPES)
def test_a_ring_that_wraps_inside_a_chunk(kv_type, use_bf16):
    """A sliding window's ring of 280 slots (window 20 + 256, to a multiple of 8; not a multiple of
    the 64-position chunk): after 601 positions it has wrapped twice, and the last positions' span
    crosses its end inside a chunk. Prefill and decode against float64."""
    rng = np.random.default_rng(5)
    window, n, pos = 20, 601, 560
    k = rng.standard_normal((n, 2, 64), np.float32)
    v = rng.standard_normal((n, 2, 64), np.float32)
    cache = KVCache(1, 2, 64, n, kv_type, windows=[window])
    assert cache.slots[0] == 280
    for p in range(0, n, 40):  # a chat's turns: the ring keeps the last 280 positions
        cache.update(0, p, k[p:p + 40], v[p:p + 40])
    stored_k, stored_v = cache.view(0, n, n - 280)
    kt, vt = np.zeros((2, n, 64), np.float32), np.zeros((2, n, 64), np.float32)
    kt[:, n - 280:], vt[:, n - 280:] = stored_k, stored_v
    q = rng.standard_normal((n - pos, 6, 64), np.float32)
    got = attention_prefill.attend_tiled(q, pos, *cache.layer(0), 0.125, window, use_bf16=use_bf16)
    expect = reference(q, kt, vt, np.arange(pos, n), 0.125, window)
    if use_bf16:
        assert np.abs(got - expect).max() < BOUND_BF16
    else:
        np.testing.assert_allclose(got, expect, rtol=2e-5, atol=2e-6)
    got = attention_kernels.attend_decode(q[-1], *cache.layer(0), n - window, n, 0.125, np.empty_like(q[-1]), window)
    np.testing.assert_allclose(got, expect[-1], rtol=2e-5, atol=2e-6)


@needs_bf16
@pytest.mark.parametrize("T", [1, 2, 9, 64, 65, 130])
@pytest.mark.parametrize("kv_type,heads,kv_heads,hd,window",
                         [(t, *shape) for t in TYPES for shape in [(9, 3, 64, 0), (4, 1, 256, 0), (4, 2, 32, 20)]]
                         + [(t, 3, 1, 48, 0) for t in ("f32", "f16")])  # q8_0 needs hd % 32 == 0
def test_tiled_bf16_matches_the_reference(kv_type, T, heads, kv_heads, hd, window):
    """Tiny shapes and remainders: rows not a multiple of the 8-row tile, hd not of its 32 lanes."""
    rng = np.random.default_rng(T * 7 + heads)
    cache, k, v = filled(kv_type, kv_heads, hd, T, rng)
    q = rng.standard_normal((T, heads, hd), np.float32)
    got = attention_prefill.attend_tiled(q, 0, *cache.layer(0), 0.125, window, use_bf16=True)
    stored_k, stored_v = cache.view(0, T)
    assert np.abs(got - reference(q, stored_k, stored_v, np.arange(T), 0.125, window)).max() < BOUND_BF16


@needs_bf16
@pytest.mark.parametrize("pos,T,window", [(100, 9, 0), (64, 64, 0), (37, 30, 16), (200, 65, 48), (500, 257, 512)])
def test_tiled_bf16_on_top_of_a_cached_context(pos, T, window):
    """After pos cached positions, and a sliding window's ring (Gemma 3: 512 + 256 slots)."""
    rng = np.random.default_rng(pos + T)
    cache, k, v = filled("f16", 1, 256, pos + T, rng, window=window or None)
    q = rng.standard_normal((T, 4, 256), np.float32)
    got = attention_prefill.attend_tiled(q, pos, *cache.layer(0), 1 / 16, window, use_bf16=True)
    stored_k = k.astype(np.float16).astype(np.float32)  # as the f16 cache holds them
    stored_v = v.astype(np.float16).astype(np.float32)
    expect = reference(q, stored_k, stored_v, np.arange(pos, pos + T), 1 / 16, window)
    assert np.abs(got - expect).max() < BOUND_BF16


@pytest.mark.parametrize("kv_type", TYPES)
def test_decode_writes_the_new_position_in_the_same_call(kv_type):
    """attend_decode(k=, v=): the KV write and the attention as one call (what a fused layer makes)."""
    rng = np.random.default_rng(4)
    whole, _, _ = filled(kv_type, 2, 64, 150, rng)
    part = KVCache(1, 2, 64, 150, kv_type)
    keys, values = whole.view(0, 150)
    part.update(0, 0, keys[:, :149].transpose(1, 0, 2), values[:, :149].transpose(1, 0, 2))
    q = rng.standard_normal((6, 64), np.float32)
    got = attention_kernels.attend_decode(q, *part.layer(0), 0, 150, 0.125, np.empty_like(q),
                                      k=keys[:, 149], v=values[:, 149])
    for a, b in zip(part.layer(0), whole.layer(0)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got, attention_kernels.attend_decode(q, *whole.layer(0), 0, 150, 0.125, np.empty_like(q)))


def queries_and_decode_steps(kv_type, pos, T, window, threads):
    """(attend_queries' T outputs, attend_decode's of each query alone) on the test's random cache."""
    rng = np.random.default_rng(pos * 10 + T)
    n = pos + T
    cache, _, _ = filled(kv_type, 3, 64, n, rng, max_len=n + 40)
    q = rng.standard_normal((T, 9, 64), np.float32)
    saved = numba.get_num_threads()
    numba.set_num_threads(min(threads, saved))
    try:
        got = attention_kernels.attend_queries(q, *cache.layer(0), pos, window, 0.125, np.empty_like(q))
        alone = np.empty_like(got)
        for t in range(T):
            end = pos + t + 1
            start = max(0, end - window) if window else 0
            attention_kernels.attend_decode(q[t], *cache.layer(0), start, end, 0.125, alone[t])
    finally:
        numba.set_num_threads(saved)
    return got, alone


@pytest.mark.parametrize("kv_type", TYPES)
@pytest.mark.parametrize("pos,T,window", [(0, 2, 0), (40, 8, 0), (120, 5, 0), (300, 8, 0), (700, 3, 0),
                                          (300, 8, 100), (127, 2, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_queries_have_their_decode_steps_bits(kv_type, pos, T, window, threads):
    """A verify pass's attention (attend_queries: T queries of one sequence in one call) gives each
    query the bits attend_decode gives it alone, whatever the span's parts (decode_plan cuts spans
    past 128 positions at 2 threads), in any process - whichever kernels it compiled or loaded first
    (core/jit.py: each kernel runs its own copies of what it calls) - and matches the float64
    reference on the stored keys."""
    got, alone = queries_and_decode_steps(kv_type, pos, T, window, threads)
    np.testing.assert_array_equal(got, alone)
    rng = np.random.default_rng(pos * 10 + T)
    n = pos + T
    cache, _, _ = filled(kv_type, 3, 64, n, rng, max_len=n + 40)
    q = rng.standard_normal((T, 9, 64), np.float32)
    stored_k, stored_v = cache.view(0, n)
    expect = reference(q, stored_k, stored_v, np.arange(pos, n), 0.125, window)
    np.testing.assert_allclose(got, expect, rtol=2e-5, atol=2e-6)
