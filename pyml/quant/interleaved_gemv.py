"""The x8 layout's GEMV (T == 1) and what its GEMMs share: the integer dot of a superblock with an
activation block y (int8 [32], activation.py), lane r, in the layout of interleaved.py:

    dot_r = sum over n of sum_pairs(maddubs(code vector n, y's quad for it in every quad))
            Q4: the 8 maddubs add up in 16 bits first (|each| <= 2*15*127 = 3810, 8 <= 30480);
            Q5: 4 at a time (|each| <= 2*31*127 = 7874, 4 <= 31496 < 2^15);
            Q8_0: signed codes, each maddubs on |code| and y with the code's sign (ggml's trick),
            each widened to 32 bits (a single one reaches 2*127*127 = 32258).
    Q4_0, Q5_0, Q8_0  value = d (code - o), o = 8, 16, 0:  y . w_r = d_r d_y (dot_r - o sum(y))
    Q4_1, Q5_1        value = d code + m:    y . w_r = d_r d_y dot_r + m_r s_y   (s_y = d_y sum(y))


On VNNI the dots are vpdpbusd, one per code vector.
"""

from __future__ import annotations

import numba
import numpy as np

from pyml.core.simd import (HAVE_VNNI, f32x8, fma, fnma, load_fp16x8c, load_i32_bcast, load_i8x4_bcast, load_u8x32,
                            load_u8x4_bcast, load_u8x8_f32, mul, mul_fenced, prefetch, splat_u8, store_f32x8, store_i32x8,
                            to_f32, zeros_f32x8, zeros_i32x8)
from pyml.core.simd_int import (abs_u8, add_i16, add_i32, as_i8, bit_to_u8, dpbusd, maddubs, nibbles_hi, nibbles_lo,
                                or_u8, sign_i8, sub_lanes_i32, sum_pairs)
from pyml.quant.activation import quantize_block_q8
from pyml.quant.ggml_types import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0, TYPE_SIZE
from pyml.quant.interleaved import Q4_K_SUPERBLOCK


# --- one superblock ----------------------------------------------------------------------

@numba.njit
def _sb_size(kind):
    numba.literally(kind)
    if kind == Q4_K:
        return Q4_K_SUPERBLOCK
    return 8 * TYPE_SIZE[kind]


@numba.njit
def block_prefetch(w, o, sb):
    """Every cache line of the sb-byte superblock 1 KB past o into L1 (prefetch never faults past the
    end), so the streams of both threads stay ahead of their loads. Two lines a superblock nearly covered
    Q4_0's 144 bytes but not Q5_0's 176 or Q8_0's 272: their other lines waited on memory, most in the
    few-rows kernel, where a superblock takes T rows' time and the hardware prefetcher falls behind."""
    for a in range(0, sb, 64):
        prefetch(w, o + 1024 + a)


@numba.njit
def _codes(kind, w, o):
    """The 8 code vectors of the superblock at byte o (module doc), as U8x32 (Q8_0: the bytes of
    its signed codes; every kind returns the same type, as Numba needs for one function)."""
    numba.literally(kind)
    if kind == Q8_0:
        c = o + 16
        return (load_u8x32(w, c), load_u8x32(w, c + 32), load_u8x32(w, c + 64), load_u8x32(w, c + 96),
                load_u8x32(w, c + 128), load_u8x32(w, c + 160), load_u8x32(w, c + 192), load_u8x32(w, c + 224))
    c = o + (32 if kind == Q4_1 else 48 if kind == Q5_0 else 64 if kind == Q5_1 else 16)
    v0, v1, v2, v3 = load_u8x32(w, c), load_u8x32(w, c + 32), load_u8x32(w, c + 64), load_u8x32(w, c + 96)
    n = (nibbles_lo(v0), nibbles_hi(v0), nibbles_lo(v1), nibbles_hi(v1),
         nibbles_lo(v2), nibbles_hi(v2), nibbles_lo(v3), nibbles_hi(v3))
    if kind == Q4_0 or kind == Q4_1:
        return n
    h = load_u8x32(w, c - 32)
    return (or_u8(n[0], bit_to_u8(h, 0, 16)), or_u8(n[1], bit_to_u8(h, 1, 16)),
            or_u8(n[2], bit_to_u8(h, 2, 16)), or_u8(n[3], bit_to_u8(h, 3, 16)),
            or_u8(n[4], bit_to_u8(h, 4, 16)), or_u8(n[5], bit_to_u8(h, 5, 16)),
            or_u8(n[6], bit_to_u8(h, 6, 16)), or_u8(n[7], bit_to_u8(h, 7, 16)))


@numba.njit
def _q8(v, y, yo):  # sum_pairs of one vector of signed codes (as bytes) against the activation quad at yo
    q = as_i8(v)
    return sum_pairs(maddubs(abs_u8(q), sign_i8(load_i8x4_bcast(y, yo), q)))


@numba.njit
def _corrections(kind, v):
    """What _dot takes off a Q8_0 dot on VNNI (its activations come offset by 128): 128 x each row's
    code sum in the superblock, I32x8; zeros for the other kinds and paths. It depends on the weights
    alone, so a GEMM computes it once per superblock and call (_correction_table), not per token tile."""
    numba.literally(kind)
    corr = zeros_i32x8()
    if kind == Q8_0 and HAVE_VNNI:
        c128 = splat_u8(128)
        for n in range(8):
            corr = dpbusd(corr, c128, as_i8(v[n]))
    return corr


@numba.njit
def _correction_table(kind, w, nb):
    """int32 [nb * 8]: _corrections of the group's nb superblocks (Q8_0 on VNNI; empty otherwise)."""
    numba.literally(kind)
    if not (kind == Q8_0 and HAVE_VNNI):
        return np.empty(0, np.int32)
    table = np.empty(8 * nb, np.int32)
    for b in range(nb):
        store_i32x8(table, 8 * b, _corrections(kind, _codes(kind, w, _sb_size(kind) * b)))
    return table


@numba.njit
def _dot(kind, v, y, yo, corr):
    """I32x8, lane r = sum_j code_rj * y[yo + j] for the code vectors v of a superblock (corr:
    _corrections(kind, v))."""
    numba.literally(kind)
    if HAVE_VNNI:  # one vpdpbusd per code vector, into 32-bit lanes: no 16-bit stage, no vpmaddwd
        return sub_lanes_i32(_dot_vnni(kind, v, y, yo), corr)
    if kind == Q8_0:
        s = add_i32(add_i32(_q8(v[0], y, yo), _q8(v[1], y, yo + 4)), add_i32(_q8(v[2], y, yo + 8), _q8(v[3], y, yo + 12)))
        return add_i32(s, add_i32(add_i32(_q8(v[4], y, yo + 16), _q8(v[5], y, yo + 20)),
                                  add_i32(_q8(v[6], y, yo + 24), _q8(v[7], y, yo + 28))))
    a = maddubs(v[0], load_i8x4_bcast(y, yo))
    a = add_i16(a, maddubs(v[1], load_i8x4_bcast(y, yo + 16)))
    a = add_i16(a, maddubs(v[2], load_i8x4_bcast(y, yo + 4)))
    a = add_i16(a, maddubs(v[3], load_i8x4_bcast(y, yo + 20)))
    b = maddubs(v[4], load_i8x4_bcast(y, yo + 8))
    b = add_i16(b, maddubs(v[5], load_i8x4_bcast(y, yo + 24)))
    b = add_i16(b, maddubs(v[6], load_i8x4_bcast(y, yo + 12)))
    b = add_i16(b, maddubs(v[7], load_i8x4_bcast(y, yo + 28)))
    if kind == Q4_0 or kind == Q4_1:
        return sum_pairs(add_i16(a, b))
    return add_i32(sum_pairs(a), sum_pairs(b))


@numba.njit
def _dot_vnni(kind, v, y, yo):
    """_dot with vpdpbusd (the same integers: every sum is exact in 32 bits)."""
    numba.literally(kind)
    acc = zeros_i32x8()
    if kind == Q8_0:
        # Signed codes: vpdpbusd multiplies unsigned by signed bytes, so the activation comes offset
        # by 128 (y: quantize_rows_u8's codes, or gemv_activation's y8) and 128 x each row's code sum comes off:
        # one vpdpbusd per code vector and token instead of vpsignb + vpdpbusd; the code sums
        # (_corrections) depend on the weights only. 1 thread, T = 128, SmolLM2's shapes: 184-192
        # GFLOP/s against 142-154, the same integers.
        # Two chains of 4 dependent vpdpbusd per token, not one of 8: the 4 tokens of a tile then
        # give 8 independent chains, as the instruction's latency x 2 pipes needs (41% -> 50% of
        # the peak, 1 thread, SmolLM2's shapes).
        acc2 = zeros_i32x8()
        for n in range(0, 8, 2):  # unrolled by LLVM: the trip count is constant
            acc = dpbusd(acc, load_u8x4_bcast(y, yo + 4 * n), as_i8(v[n]))
            acc2 = dpbusd(acc2, load_u8x4_bcast(y, yo + 4 * n + 4), as_i8(v[n + 1]))
        return add_i32(acc, acc2)
    # code vector n holds values 16 * (n % 2) + 4 * (n // 2) + i (module doc); two chains of 4
    acc2 = zeros_i32x8()
    for n in range(0, 8, 2):
        acc = dpbusd(acc, v[n], load_i8x4_bcast(y, yo + 2 * n))
        acc2 = dpbusd(acc2, v[n + 1], load_i8x4_bcast(y, yo + 16 + 2 * n))
    return add_i32(acc, acc2)


@numba.njit
def _block_scales(kind, w, o):
    """The 8 rows' d and (Q4_1, Q5_1) m of the superblock at byte o, as F32x8 (d twice for the others).
    Made once a superblock: the few-rows kernel converted them again for every row."""
    numba.literally(kind)
    d = load_fp16x8c(w, o)
    if kind == Q4_1 or kind == Q5_1:
        return d, load_fp16x8c(w, o + 16)
    return d, d


@numba.njit
def _block(kind, v, corr, ws, y, b, yd, yoff, ys, acc):
    """acc + the 8 rows' dot with activation block b (ws: _block_scales; y int8, scale yd, float sum ys;
    yoff int32 [nb]: the code offset o (module doc) x each block's code sum, loaded as a broadcast
    memory operand)."""
    numba.literally(kind)
    scale = mul(ws[0], f32x8(yd))
    i = _dot(kind, v, y, 32 * b, corr)
    if kind == Q4_0 or kind == Q5_0:
        i = sub_lanes_i32(i, load_i32_bcast(yoff, b))
    acc = fma(scale, to_f32(i), acc)
    if kind == Q4_1 or kind == Q5_1:
        acc = fma(ws[1], f32x8(ys), acc)
    return acc


@numba.njit
def _k_codes(w, c, half):
    """Q4_K: the 8 code vectors of one group, from the chunk pair at byte c: low nibbles (half 0)
    or high (half 1), ordered as _dot pairs them with the activation (values 0, 16, 4, 20, ...)."""
    numba.literally(half)
    if half == 0:
        return (nibbles_lo(load_u8x32(w, c)), nibbles_lo(load_u8x32(w, c + 128)),
                nibbles_lo(load_u8x32(w, c + 32)), nibbles_lo(load_u8x32(w, c + 160)),
                nibbles_lo(load_u8x32(w, c + 64)), nibbles_lo(load_u8x32(w, c + 192)),
                nibbles_lo(load_u8x32(w, c + 96)), nibbles_lo(load_u8x32(w, c + 224)))
    return (nibbles_hi(load_u8x32(w, c)), nibbles_hi(load_u8x32(w, c + 128)),
            nibbles_hi(load_u8x32(w, c + 32)), nibbles_hi(load_u8x32(w, c + 160)),
            nibbles_hi(load_u8x32(w, c + 64)), nibbles_hi(load_u8x32(w, c + 192)),
            nibbles_hi(load_u8x32(w, c + 96)), nibbles_hi(load_u8x32(w, c + 224)))


@numba.njit
def _k_block(v, ks, y, u, yd, ys, acc):
    """Q4_K: acc + the 8 rows' group u of 32 values (ks: its _k_scales), dotted with activation block u."""
    acc = fma(mul(ks[0], f32x8(yd)), to_f32(_dot(Q4_0, v, y, 32 * u, zeros_i32x8())), acc)  # no offset: Q4_0's dot
    return fnma(ks[1], f32x8(ys), acc)


@numba.njit
def _code_offset(kind):  # the code offset o of the module doc
    numba.literally(kind)
    return 8 if kind == Q4_0 else 16 if kind == Q5_0 else 0


@numba.njit
def _offset_sums(kind, xq, out):  # xq [nb*32] int8 -> out int32 [nb]: code offset o (module doc) x block code sums
    numba.literally(kind)
    offset = _code_offset(kind)
    for b in range(out.size):
        acc = 0
        for j in range(32):
            acc += xq[32 * b + j]
        out[b] = offset * acc


@numba.njit
def _block_codes(kind, w, b):
    """The 8 code vectors of block b of a group: _codes of superblock b, or for Q4_K _k_codes of its group b of 32."""
    numba.literally(kind)
    if kind == Q4_K:
        s, j = b // 8, b % 8
        c = Q4_K_SUPERBLOCK * s + 160 + 256 * (j // 2)
        return _k_codes(w, c, 0) if j % 2 == 0 else _k_codes(w, c, 1)
    return _codes(kind, w, _sb_size(kind) * b)


@numba.njit
def _k_scales(w, u):
    """Q4_K: (d x sc, dmin x mn) of the 8 rows for group u of 32 values, F32x8 each. Fenced: d x sc x yd
    is then (d x sc) x yd in the GEMV as in the kernels that make these once (the few-rows kernel, the
    GEMMs' staged scales); unfenced, fastmath regrouped it in the avx2 path's GEMV alone."""
    o, j = Q4_K_SUPERBLOCK * (u // 8), u % 8
    return (mul_fenced(load_fp16x8c(w, o), load_u8x8_f32(w, o + 32 + 8 * j)),
            mul_fenced(load_fp16x8c(w, o + 16), load_u8x8_f32(w, o + 96 + 8 * j)))


# --- T == 1 --------------------------------------------------------------------------------

@numba.njit
def _gemv_group(kind, w, xq, xd, xs, xoff):  # F32x8: group w [nb * 8 * ts] . x, lane r = row r
    numba.literally(kind)
    sb = _sb_size(kind)
    acc = zeros_f32x8()
    for b in range(xd.size):
        o = sb * b
        block_prefetch(w, o, sb)
        v = _codes(kind, w, o)
        acc = _block(kind, v, _corrections(kind, v), _block_scales(kind, w, o), xq, b, xd[b], xoff, xs[b], acc)
    return acc


@numba.njit
def k_prefetch(w, c):
    """Q4_K: the cache lines of the chunk pair 1024 bytes past c, so the streams stay ahead of the loads."""
    prefetch(w, c + 1024)
    prefetch(w, c + 1088)
    prefetch(w, c + 1152)
    prefetch(w, c + 1216)


@numba.njit
def _gemv_group_k(w, xq, xd, xs):  # Q4_K: F32x8, group w [nsb * 1184] . x, lane r = row r
    acc = zeros_f32x8()
    for s in range(xd.size // 8):
        o = Q4_K_SUPERBLOCK * s
        for p in range(4):
            c, u = o + 160 + 256 * p, 8 * s + 2 * p
            k_prefetch(w, c)
            acc = _k_block(_k_codes(w, c, 0), _k_scales(w, u), xq, u, xd[u], xs[u], acc)
            acc = _k_block(_k_codes(w, c, 1), _k_scales(w, u + 1), xq, u + 1, xd[u + 1], xs[u + 1], acc)
    return acc


# The GEMV in two steps, so that compiled code which shares out a matrix's groups between threads
# itself (nn/decode_kernels.py's decode_region) quantizes the activation once, into buffers it
# keeps, and calls the same group kernel the GEMV's prange does.

@numba.njit(cache=True)
def activation_buffers(shape):
    """(xq, xd, xs, xp, xoff, y8): what gemv_activation fills for activations of `shape`, (n,) for one
    of n values, (T, n) for T rows (interleaved_rows'). Cached: called from Python too (nn/fused.py),
    where an uncached kernel compiled again in every process (0.45 s of a first batched step)."""
    lead, n = shape[:-1], shape[-1]
    nb = n // 32
    return (np.empty(shape, np.int8), np.empty(lead + (nb,), np.float32), np.empty(lead + (nb,), np.float32),
            np.empty(lead + (n // 2,), np.int16), np.empty(lead + (nb,), np.int32), np.empty(shape, np.uint8))


@numba.njit
def activation_bytes(kind, xq, y8):
    """The bytes the dots of `kind` load: y8, filled by gemv_activation (Q8_0 on VNNI: the codes
    offset by 128, _dot_vnni), or the codes themselves."""
    numba.literally(kind)
    if kind == Q8_0 and HAVE_VNNI:
        return y8
    return xq.view(np.uint8)


@numba.njit
def gemv_activation(kind, x, xq, xd, xs, xp, xoff, y8):
    """x [n] f32 quantized into the activation_buffers (activation.py's blocks, the code offsets'
    sums: _offset_sums' integers from the quantizer's own code sums, not a second pass over the
    codes, which took as long as the quantization); returns activation_bytes."""
    numba.literally(kind)
    offset = _code_offset(kind)
    for b in range(xd.size):
        xoff[b] = offset * quantize_block_q8(x, b, xq, xd, xs, xp)
    if kind == Q8_0 and HAVE_VNNI:
        codes = xq.view(np.uint8)
        for i in range(codes.size):
            y8[i] = codes[i] ^ np.uint8(128)
    return activation_bytes(kind, xq, y8)


@numba.njit
def gemv_group_into(kind, groups, g, y, xq, xd, xs, xoff, out):
    """out[8g .. 8g+7] = rows 8g .. 8g+7 of W x, x given as gemv_activation left it."""
    numba.literally(kind)
    if kind == Q4_K:
        store_f32x8(out, 8 * g, _gemv_group_k(groups[g], xq, xd, xs))
    else:
        store_f32x8(out, 8 * g, _gemv_group(kind, groups[g], y, xd, xs, xoff))
