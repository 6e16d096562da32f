"""The SIMD vocabulary against NumPy, and its portable (non-AVX2) forms against the AVX2 ones."""

import numba
import numpy as np

from pyml.core import simd, simd512, simd_int
from pyml.core.simd import (hsum, lane, load_fp16, load_i16x16, load_i8x32, load_nibbles16, load_u8x32, store_f32x8,
                            to_f32)
from pyml.core.simd_int import abs_u8, bits_to_u8, kscales, sign_i8, sum_pairs


@numba.njit(cache=True)
def _dots(a, b, c, out):  # out [6, 8]: every integer dot form: a (u8), b (i8) 32 lanes, c (i16) 16 lanes
    ua, sa, sb = load_u8x32(a, 0), load_i8x32(a, 0), load_i8x32(b, 0)
    store_f32x8(out[0], 0, to_f32(sum_pairs(simd_int.maddubs(ua, sb))))
    store_f32x8(out[1], 0, to_f32(simd_int.sum_pairs_generic(simd_int.maddubs_generic(ua, sb))))
    store_f32x8(out[2], 0, to_f32(sum_pairs(simd_int.dot_i8(sa, sb))))
    store_f32x8(out[3], 0, to_f32(simd_int.sum_pairs_generic(simd_int.dot_i8_generic(sa, sb))))
    i16 = load_i16x16(c, 0)
    store_f32x8(out[4], 0, to_f32(simd_int.madd(i16, i16)))
    store_f32x8(out[5], 0, to_f32(simd_int.madd_generic(i16, i16)))
    return out


def test_integer_dots_match_numpy_and_generic_forms(rng):
    for trial in range(20):
        a = rng.integers(0, 64 if trial % 2 else 128, 32).astype(np.uint8)
        b = rng.integers(-127, 128, 32).astype(np.int8)
        if trial == 0:
            a[:], b[:] = 63, -127  # the largest magnitudes the kernels feed in
        c = rng.integers(-2000, 2000, 16).astype(np.int16)  # products stay exact in float32
        out = _dots(a, b.view(np.uint8), c, np.zeros((6, 8), np.float32))
        prod_u = (a.astype(np.int64) * b).reshape(8, 4).sum(axis=1)
        prod_s = (a.view(np.int8).astype(np.int64) * b).reshape(8, 4).sum(axis=1)
        prod_16 = (c.astype(np.int64) ** 2).reshape(8, 2).sum(axis=1)
        np.testing.assert_array_equal(out[0], prod_u)
        np.testing.assert_array_equal(out[1], prod_u)
        np.testing.assert_array_equal(out[2], prod_s)
        np.testing.assert_array_equal(out[3], prod_s)
        np.testing.assert_array_equal(out[4], prod_16)
        np.testing.assert_array_equal(out[5], prod_16)


@numba.njit(cache=True)
def _bytes(a, bits, out):  # decoded byte vectors, each summed in lane pairs of 4 bytes
    ones = load_i8x32(np.ones(32, np.int8), 0)
    store_f32x8(out[0], 0, to_f32(sum_pairs(simd_int.maddubs(load_nibbles16(a, 0), ones))))
    store_f32x8(out[1], 0, to_f32(sum_pairs(simd_int.maddubs(bits_to_u8(bits, 16), ones))))
    store_f32x8(out[2], 0, to_f32(sum_pairs(simd_int.maddubs(abs_u8(load_i8x32(a, 0)), ones))))
    store_f32x8(out[3], 0, to_f32(sum_pairs(simd_int.dot_i8(sign_i8(load_i8x32(a, 0), load_i8x32(a, 32)), ones))))
    return out


def test_byte_decoders(rng):
    a = rng.integers(0, 256, 64).astype(np.uint8)
    a[32:36] = 0
    bits = np.uint32(rng.integers(0, 2**32))
    out = _bytes(a, bits, np.zeros((4, 8), np.float32))
    nib = np.concatenate([a[:16] & 15, a[:16] >> 4]).astype(np.int64)
    np.testing.assert_array_equal(out[0], nib.reshape(8, 4).sum(1))
    bitv = ((int(bits) >> np.arange(32)) & 1) * 16
    np.testing.assert_array_equal(out[1], bitv.reshape(8, 4).sum(1))
    s = a[:32].view(np.int8).astype(np.int64)
    np.testing.assert_array_equal(out[2], np.abs(s).reshape(8, 4).sum(1))
    np.testing.assert_array_equal(out[3], (s * np.sign(a[32:].view(np.int8))).reshape(8, 4).sum(1))


@numba.njit(cache=True)
def _scales(raw, out):
    sc, mn = kscales(raw, 0)
    store_f32x8(out[0], 0, sc)
    store_f32x8(out[1], 0, mn)
    store_f32x8(out[2], 0, lane(sc, 5))
    out[3, 0] = hsum(sc)
    out[3, 1] = load_fp16(raw, 2)
    return out


def test_kscales_unpack_like_gguf(rng):
    import gguf
    raw = rng.integers(0, 256, 16).astype(np.uint8)
    raw[2:4] = np.array([1.5], np.float16).view(np.uint8)
    out = _scales(raw, np.zeros((4, 8), np.float32))
    sc, mn = gguf.quants.Q4_K.get_scale_min(raw[None, :12])
    np.testing.assert_array_equal(out[0], sc[0])
    np.testing.assert_array_equal(out[1], mn[0])
    np.testing.assert_array_equal(out[2], np.full(8, sc[0, 5]))
    assert out[3, 0] == sc.sum() and out[3, 1] == 1.5


@numba.njit  # not cache=True: a test helper's cache would be stamped by Numba's own locator only
def _dpbusd(a, b, out):  # out [2, 8]: vpdpbusd (where the ISA path has VNNI) and its portable IR
    ua, sb = load_u8x32(a, 0), load_i8x32(b, 0)
    base = simd.zeros_i32x8()
    store_f32x8(out[0], 0, to_f32(simd_int.dpbusd(simd_int.dpbusd(base, ua, sb), ua, sb)))
    store_f32x8(out[1], 0, to_f32(simd_int.dpbusd_generic(simd_int.dpbusd_generic(base, ua, sb), ua, sb)))
    return out


def test_dpbusd_sums_four_products_exactly_on_every_path(rng):
    """Accumulated twice from zero: 2 * sum of 4 u8 x i8 products per lane, at the largest magnitudes
    too (4 * 255 * 127 * 2 needs 32 bits: no 16-bit saturation as in vpmaddubsw)."""
    from pyml.core import isa
    print(f"ISA path {isa.ISA} (host supports {', '.join(isa.supported(isa.HOST_FEATURES))})")
    for trial in range(20):
        a = rng.integers(0, 256, 32).astype(np.uint8)
        b = rng.integers(-128, 128, 32).astype(np.int8)
        if trial == 0:
            a[:], b[:] = 255, -128
        out = _dpbusd(a, b.view(np.uint8), np.zeros((2, 8), np.float32))
        expected = 2 * (a.astype(np.int64) * b).reshape(8, 4).sum(axis=1)
        np.testing.assert_array_equal(out[0], expected)
        np.testing.assert_array_equal(out[1], expected)


@numba.njit
def _dpbusd16(a, b, out):  # out [2, 16]: vpdpbusd on zmm (the avx512_vnni path) and its portable IR
    ua = simd512.load_u8x32_pair(a, a, 0)
    sb = simd512.as_i8x64(simd512.load_u8x32_pair(b, b[32:], 0))
    base = simd512.zeros_i32x16()
    simd512.store_f32x16(out[0], 0, simd512.to_f32x16(simd512.dpbusd16(simd512.dpbusd16(base, ua, sb), ua, sb)))
    simd512.store_f32x16(out[1], 0, simd512.to_f32x16(
        simd512.dpbusd16_generic(simd512.dpbusd16_generic(base, ua, sb), ua, sb)))
    return out


def test_dpbusd16_sums_four_products_exactly_on_every_path(rng):
    """The 512-bit form: lanes 0-7 from the first 32 bytes of each operand's pair, 8-15 from the second."""
    from pyml.core import isa
    print(f"512-bit vpdpbusd {'in use' if isa.ZMM else 'not used on this path'} (ISA path {isa.ISA})")
    for trial in range(10):
        a = rng.integers(0, 256, 32).astype(np.uint8)
        b = rng.integers(-128, 128, 64).astype(np.int8)
        if trial == 0:
            a[:], b[:] = 255, -128
        out = _dpbusd16(a, b.view(np.uint8), np.zeros((2, 16), np.float32))
        a64 = np.concatenate([a, a]).astype(np.int64)
        expected = 2 * (a64 * b).reshape(16, 4).sum(axis=1)
        np.testing.assert_array_equal(out[0], expected)
        np.testing.assert_array_equal(out[1], expected)


@numba.njit(cache=True)
def _transposed(src, s0, s_stride, dst, d0, n):
    if n == 8:
        simd.transpose_u32(src, s0, s_stride, dst, d0, 8)
    else:
        simd.transpose_u32(src, s0, s_stride, dst, d0, 16)
    return dst


def test_transpose_u32_moves_every_word_and_nothing_else(rng):
    for n in (8, 16):
        src = rng.integers(0, 256, 4096, dtype=np.uint8)
        dst = np.zeros(1200, np.uint8)
        _transposed(src, 5, 150, dst, 3, n)  # unaligned starts, rows 150 bytes apart
        words = np.stack([src[5 + 150 * r:5 + 150 * r + 4 * n].view(np.uint32) for r in range(n)])
        np.testing.assert_array_equal(dst[3:3 + 4 * n * n].view(np.uint32).reshape(n, n), words.T)
        assert not dst[:3].any() and not dst[3 + 4 * n * n:].any()
