"""float32 -> stored weights: Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks bit for bit as ggml's reference
quantizers, and the float types. Every quantizer is `quantize(x [R, n] f32, out) -> out`.

The arithmetic follows quantize_row_*_ref in ggml-quants.c (and gguf-py's NumPy port) in
float32, operation by operation: no fastmath here, so nothing is fused or reassociated.

    Q8_0  d = amax / 127,  q = round(x / d) half away from zero (as x * (1/d))
    Q4_0  d = max / -8 (max: the value of largest |x|, first on ties),
          q = min(15, trunc(x * (1/d) + 8.5))
    Q4_1  d = (max - min) / 15, m = min,  q = min(15, trunc((x - min) * (1/d) + 0.5))
    Q5_0  d = max / -16, q = min(31, trunc(x * (1/d) + 16.5)); the 5th bits in a u32 qh
    Q5_1  d = (max - min) / 31, m = min,  q = trunc((x - min) * (1/d) + 0.5); 5th bits in qh
The 256-value K-quant blocks are in kquantizers.py.
d (and m) are stored as fp16 (round to nearest even); 1/d is taken from the float32 d.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from pyml.core.simd import f32_to_half


@numba.njit
def put_half(out, o, v):  # fp16 little-endian at byte o
    h = f32_to_half(v)
    out[o] = np.uint8(h & 0xFF)
    out[o + 1] = np.uint8(h >> 8)


@numba.njit
def _round_away(v):  # round half away from zero, exactly (gguf's np_roundf)
    a = abs(v)
    f = np.float32(math.floor(a))
    r = f + np.float32(math.floor(np.float32(2.0) * (a - f)))
    return -r if v < 0 else r


@numba.njit
def _signed_max(x, r, o):  # the value of largest |x| in x[r, o:o+32], the first on ties
    amax, vmax = np.float32(0.0), np.float32(0.0)
    for j in range(32):
        if amax < abs(x[r, o + j]):
            amax, vmax = abs(x[r, o + j]), x[r, o + j]
    return vmax


@numba.njit
def _min_max(x, r, o):  # (min, max) of x[r, o:o+32]
    vmin, vmax = x[r, o], x[r, o]
    for j in range(1, 32):
        vmin = min(vmin, x[r, o + j])
        vmax = max(vmax, x[r, o + j])
    return vmin, vmax


@numba.njit(cache=True)
def quantize_q8_0(x, out):  # x [R, n] f32 -> out [R, n/32*34] u8
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(x[r, 32 * b + j]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            o = 34 * b
            put_half(out[r], o, d)
            for j in range(32):
                out[r, o + 2 + j] = np.uint8(np.int8(_round_away(x[r, 32 * b + j] * inv)) & 0xFF)
    return out


@numba.njit(cache=True)
def quantize_q4_0(x, out):  # x [R, n] f32 -> out [R, n/32*18] u8
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            d = _signed_max(x, r, 32 * b) / np.float32(-8.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            o = 18 * b
            put_half(out[r], o, d)
            for j in range(16):
                lo = min(15, np.int32(x[r, 32 * b + j] * inv + np.float32(8.5)))
                hi = min(15, np.int32(x[r, 32 * b + 16 + j] * inv + np.float32(8.5)))
                out[r, o + 2 + j] = np.uint8(lo | (hi << 4))
    return out


@numba.njit(cache=True)
def quantize_q4_1(x, out):  # x [R, n] f32 -> out [R, n/32*20] u8
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            vmin, vmax = _min_max(x, r, 32 * b)
            d = (vmax - vmin) / np.float32(15.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            o = 20 * b
            put_half(out[r], o, d)
            put_half(out[r], o + 2, vmin)
            for j in range(16):
                lo = min(15, np.int32((x[r, 32 * b + j] - vmin) * inv + np.float32(0.5)))
                hi = min(15, np.int32((x[r, 32 * b + 16 + j] - vmin) * inv + np.float32(0.5)))
                out[r, o + 4 + j] = np.uint8(lo | (hi << 4))
    return out


@numba.njit
def _put_u32(out, o, v):  # uint32 little-endian at byte o
    for k in range(4):
        out[o + k] = np.uint8((v >> (8 * k)) & 0xFF)


@numba.njit
def _pack_q5(xi0, xi1, out, qs, qh, j):  # nibbles at qs + j, 5th bits into qh (bit j, bit j + 16)
    out[qs + j] = np.uint8((xi0 & 0x0F) | ((xi1 & 0x0F) << 4))
    return qh | (((xi0 & 0x10) >> 4) << j) | (((xi1 & 0x10) >> 4) << (j + 16))


@numba.njit(cache=True)
def quantize_q5_0(x, out):  # x [R, n] f32 -> out [R, n/32*22] u8: d fp16, qh u32, qs[16]
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            d = _signed_max(x, r, 32 * b) / np.float32(-16.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            o = 22 * b
            put_half(out[r], o, d)
            qh = np.uint32(0)
            for j in range(16):
                xi0 = min(31, np.int32(x[r, 32 * b + j] * inv + np.float32(16.5)))
                xi1 = min(31, np.int32(x[r, 32 * b + 16 + j] * inv + np.float32(16.5)))
                qh = np.uint32(_pack_q5(xi0, xi1, out[r], o + 6, qh, j))
            _put_u32(out[r], o + 2, qh)
    return out


@numba.njit(cache=True)
def quantize_q5_1(x, out):  # x [R, n] f32 -> out [R, n/32*24] u8: d, m fp16, qh u32, qs[16]
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            vmin, vmax = _min_max(x, r, 32 * b)
            d = (vmax - vmin) / np.float32(31.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            o = 24 * b
            put_half(out[r], o, d)
            put_half(out[r], o + 2, vmin)
            qh = np.uint32(0)
            for j in range(16):
                xi0 = np.int32((x[r, 32 * b + j] - vmin) * inv + np.float32(0.5)) & 0xFF
                xi1 = np.int32((x[r, 32 * b + 16 + j] - vmin) * inv + np.float32(0.5)) & 0xFF
                qh = np.uint32(_pack_q5(xi0, xi1, out[r], o + 8, qh, j))
            _put_u32(out[r], o + 4, qh)
    return out


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16): round to nearest even, NaNs kept quiet (ggml_compute_fp32_to_bf16)."""
    n = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    n = np.where((n & 0x7FFFFFFF) > 0x7F800000, (n & np.uint32(0xFFFF0000)) | np.uint32(64 << 16), n)
    return ((n.astype(np.uint64) + (0x7FFF + ((n >> 16) & 1))) >> 16).astype(np.uint16)


def cast(x, out):  # F32, F16: NumPy's conversion (round to nearest even)
    out[...] = x
    return out


def to_bf16(x, out):  # BF16 as uint16 bits
    out[...] = to_bf16_bits(x)
    return out
