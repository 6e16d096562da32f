"""The x8 layout's GEMM without VNNI (AVX2, portable): three groups share each activation quad.

across a tile of 4 tokens, and each token's quads are broadcast against them. Compiled for AVX2
alone (16 registers) it issued ~165 instructions per 32 vpmaddubsw. Here the roles turn round: the activation, offset by 128, is vpmaddubsw's
unsigned operand (a quad broadcast once per token and block, into a register), and the codes
are its signed operand, loaded straight from a staging buffer as the instruction's memory
operand; so one broadcast serves three groups (24 rows), and the loop issues ~88 instructions
per 24 vpmaddubsw.

The codes go in recentred, c - o_s (o_s = 8 for the 4-bit codes of Q4_0, 16 for Q5_0 and
Q5_1, 0 for Q4_1 and Q4_K), and each 16-bit lane starts from -128 x the sum of its 16 codes
(made once per call, like the codes): sum (y + 128)(c - o_s) - 128 sum (c - o_s) = sum y (c - o_s).
Each vpmaddubsw pair sum stays within 2 x 255 x 16 = 8160, so none saturates; the 16-bit adds
wrap, but modulo 2^16, and the lane's final value is within |16 x 127 x 16| = 32512 (Q4_1's
o_s = 0: 16 x 127 x 15 = 30480), so it comes out exact. The integers are those of _dot less
the code offset (Q5_1, whose values carry no offset: plus 16 sum y), and the float ops are
_block's and _block_dot_k's for every token: the same bits as every other path (tests/core/test_isa.py).

Memory: the staging holds, per block and group, 256 bytes of codes, 32 of lane corrections and
64 of scales; the tokens pass over CHUNK blocks at a time (3 x 16 x 352 bytes = 16.5 KB, L1),
the output rows holding the partial sums between chunks.

Q8_0's signed codes against a 0-255 activation would saturate a pair sum (2 x 255 x 127), so
they go in as two planes, c = 16 h + l with h = c >> 4 (-8..7) and l = c & 15: two vpmaddubsw
per 32 values where the sign trick (_q8: vpsignb on the activation for each code vector) spent
the same pipes on a vpsignb, a vpabsb and a vpmaddwd per multiply and a broadcast per token.
Each plane's lanes start from their corrections as above and end at sum y h (within 16 x 127
x 8 = 16256) and sum y l (16 x 127 x 15 = 30480); the row's dot is 16 x the first's pair sums
plus the second's, exact, so the bits are again those of every path.
"""

from __future__ import annotations

import numba
import numpy as np

from pyml.core.simd import (f32x8, fma, fnma, load_f32x8, load_fp16x8c, load_i16x16, load_i8x32, load_u8x4_bcast, mul,
                            splat_u8, store_f32x8, store_i16x16, store_i8x32, to_f32, zeros_f32x8)
from pyml.core.simd_int import (add_i16, add_i32, as_i8, i16_halves, madd, maddubs, minus_i8, nibbles_lo, sar_i8,
                                sub_i16, sub_i32, sum_pairs)
from pyml.quant.ggml_types import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0
from pyml.quant.interleaved_gemv import _block_codes, _k_scales, _sb_size


SIGNED_KINDS = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K)  # the types whose GEMM runs in triples on AVX2
RECORD = 352  # staging bytes per block and group: codes 256, lane corrections 32, scales 2 x 32
CHUNK = 16  # blocks per pass over the tokens
RECORD_Q8 = 608  # Q8_0: code planes 2 x 256, lane corrections 2 x 32, scales 32
CHUNK_Q8 = 8  # 3 x 8 x 608 bytes = 14.6 KB


@numba.njit
def _record(kind):
    numba.literally(kind)
    return RECORD_Q8 if kind == Q8_0 else RECORD


@numba.njit
def _chunk(kind):
    numba.literally(kind)
    return CHUNK_Q8 if kind == Q8_0 else CHUNK


@numba.njit
def _signed_codes(kind, v):
    """The code vectors v recentred as the signed operand: c - o_s (section doc), as I8x32."""
    numba.literally(kind)
    if kind == Q4_0:
        return (minus_i8(v[0], 8), minus_i8(v[1], 8), minus_i8(v[2], 8), minus_i8(v[3], 8),
                minus_i8(v[4], 8), minus_i8(v[5], 8), minus_i8(v[6], 8), minus_i8(v[7], 8))
    if kind == Q5_0 or kind == Q5_1:
        return (minus_i8(v[0], 16), minus_i8(v[1], 16), minus_i8(v[2], 16), minus_i8(v[3], 16),
                minus_i8(v[4], 16), minus_i8(v[5], 16), minus_i8(v[6], 16), minus_i8(v[7], 16))
    return (as_i8(v[0]), as_i8(v[1]), as_i8(v[2]), as_i8(v[3]), as_i8(v[4]), as_i8(v[5]), as_i8(v[6]), as_i8(v[7]))


@numba.njit
def _stage_q8(w, b, buf, o):
    """Q8_0's record of block b at o: code c = 16 h + l split into the planes h (-8..7) and l (0..15),
    each in _quads' order, then their lanes' corrections as _stage_signed's, and d."""
    c128 = splat_u8(128)
    v = _block_codes(Q8_0, w, b)  # chunk n: code bytes 4n .. 4n + 3 of each row, met by quad yo + 4n
    v = (v[0], v[4], v[1], v[5], v[2], v[6], v[3], v[7])
    sh, sl = i16_halves(0, 0), i16_halves(0, 0)
    for n in range(8):
        h, lo = sar_i8(as_i8(v[n]), 4), as_i8(nibbles_lo(v[n]))
        store_i8x32(buf, o + 32 * n, h)
        store_i8x32(buf, o + 256 + 32 * n, lo)
        sh, sl = add_i16(sh, maddubs(c128, h)), add_i16(sl, maddubs(c128, lo))
    store_i16x16(buf, o + 512, sub_i16(i16_halves(0, 0), sh))
    store_i16x16(buf, o + 544, sub_i16(i16_halves(0, 0), sl))
    store_f32x8(buf, o + 576, load_fp16x8c(w, _sb_size(Q8_0) * b))


@numba.njit
def _stage_signed(kind, w, nb, buf, k):
    """Group w's records into buf [3 * nb * _record(kind)], block b's at _record(kind) (3 b + k): the
    signed codes, each 16-bit lane's -128 x code sum, the scales (d; d, m; Q4_K d x sc, dmin x mn)."""
    numba.literally(kind)
    c128 = splat_u8(128)
    for b in range(nb):
        if kind == Q8_0:
            _stage_q8(w, b, buf, _record(Q8_0) * (3 * b + k))
            continue
        o = RECORD * (3 * b + k)
        v = _signed_codes(kind, _block_codes(kind, w, b))
        s = maddubs(c128, v[0])
        store_i8x32(buf, o, v[0])
        for n in range(1, 8):
            s = add_i16(s, maddubs(c128, v[n]))
            store_i8x32(buf, o + 32 * n, v[n])
        store_i16x16(buf, o + 256, sub_i16(i16_halves(0, 0), s))
        if kind == Q4_K:
            d_sc, dmin_mn = _k_scales(w, b)
            store_f32x8(buf, o + 288, d_sc)
            store_f32x8(buf, o + 320, dmin_mn)
        else:
            store_f32x8(buf, o + 288, load_fp16x8c(w, _sb_size(kind) * b))
            if kind == Q4_1 or kind == Q5_1:
                store_f32x8(buf, o + 320, load_fp16x8c(w, _sb_size(kind) * b + 16))


@numba.njit
def _quads(y8, yo):
    """The 8 activation quads of the block at yo, broadcast, in the order _dot pairs them with code vectors."""
    return (load_u8x4_bcast(y8, yo), load_u8x4_bcast(y8, yo + 16), load_u8x4_bcast(y8, yo + 4),
            load_u8x4_bcast(y8, yo + 20), load_u8x4_bcast(y8, yo + 8), load_u8x4_bcast(y8, yo + 24),
            load_u8x4_bcast(y8, yo + 12), load_u8x4_bcast(y8, yo + 28))


@numba.njit
def _signed_block(kind, q, buf, o, yd, ys, qsum, acc):
    """acc + one group's rows dotted with one activation block: q its _quads, o the record, qsum
    the block's code sum (Q5_1 adds 16 x it back)."""
    numba.literally(kind)
    if kind == Q8_0:  # y . c = 16 (y . h) + y . l: |y . h| <= 16 x 127 x 8, y . l <= 16 x 127 x 15 per lane
        h = add_i16(load_i16x16(buf, o + 512), maddubs(q[0], load_i8x32(buf, o)))
        lo = add_i16(load_i16x16(buf, o + 544), maddubs(q[0], load_i8x32(buf, o + 256)))
        for n in range(1, 8):
            h = add_i16(h, maddubs(q[n], load_i8x32(buf, o + 32 * n)))
            lo = add_i16(lo, maddubs(q[n], load_i8x32(buf, o + 256 + 32 * n)))
        i = add_i32(madd(h, i16_halves(16, 16)), sum_pairs(lo))
        return fma(mul(load_f32x8(buf, o + 576), f32x8(yd)), to_f32(i), acc)
    p = add_i16(load_i16x16(buf, o + 256), maddubs(q[0], load_i8x32(buf, o)))
    for n in range(1, 8):
        p = add_i16(p, maddubs(q[n], load_i8x32(buf, o + 32 * n)))
    i = sum_pairs(p)
    if kind == Q5_1:
        i = sub_i32(i, -16 * qsum)
    acc = fma(mul(load_f32x8(buf, o + 288), f32x8(yd)), to_f32(i), acc)
    if kind == Q4_1 or kind == Q5_1:
        acc = fma(load_f32x8(buf, o + 320), f32x8(ys), acc)
    elif kind == Q4_K:
        acc = fnma(load_f32x8(buf, o + 320), f32x8(ys), acc)
    return acc


@numba.njit
def _gemm_triple(kind, w0, w1, w2, n, y8, xd, xs, qs, out, g):
    """Rows 8g .. 8g + 8n - 1 of out [T, R] from groups w0, w1, w2 (section doc; with n < 3 the last
    ones repeat and are not stored); y8, xd, xs, qs: quantize_rows_u8_sums'."""
    numba.literally(kind)
    T, nb = xd.shape
    rec, chunk = _record(kind), _chunk(kind)
    buf = np.empty(3 * rec * nb, np.uint8)
    _stage_signed(kind, w0, nb, buf, 0)
    _stage_signed(kind, w1, nb, buf, 1)
    _stage_signed(kind, w2, nb, buf, 2)
    for b0 in range(0, nb, chunk):
        for t in range(T):
            row = out[t]
            a0, a1, a2 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
            if b0 > 0:
                a0 = load_f32x8(row, 8 * g)
                if n > 1:
                    a1 = load_f32x8(row, 8 * g + 8)
                if n > 2:
                    a2 = load_f32x8(row, 8 * g + 16)
            for b in range(b0, min(nb, b0 + chunk)):
                q, o = _quads(y8[t], 32 * b), 3 * rec * b
                yd, ys, qsum = xd[t, b], xs[t, b], qs[t, b]
                a0 = _signed_block(kind, q, buf, o, yd, ys, qsum, a0)
                a1 = _signed_block(kind, q, buf, o + rec, yd, ys, qsum, a1)
                a2 = _signed_block(kind, q, buf, o + 2 * rec, yd, ys, qsum, a2)
            store_f32x8(row, 8 * g, a0)
            if n > 1:
                store_f32x8(row, 8 * g + 8, a1)
            if n > 2:
                store_f32x8(row, 8 * g + 16, a2)
