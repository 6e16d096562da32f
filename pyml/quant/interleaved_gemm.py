"""The x8 layout's GEMM (T > 1) on 256-bit vectors, and the GEMV and GEMM of one type
(interleaved_kernels), by instruction-set path:

- VNNI: vpdpbusd, one per code vector and token, in two chains of 4 per token (a tile's 4 tokens
  then give the 8 independent chains the instruction's latency x 2 pipes needs);
- avx512_vnni: the GEMM of ZMM_KINDS two groups at a time on 512-bit vectors (interleaved_pairs.py);
- without VNNI (AVX2, portable): three groups per activation quad (interleaved_triples.py).
Every path does the same integer dots and float ops, so gives the same bits.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple

import numba
import numpy as np
from numba import prange

from pyml.core.isa import ZMM
from pyml.core.simd import (FASTMATH, HAVE_VNNI, load_f32x8, load_i32x8, load_u8x32, store_f32x8, store_u8x32,
                            zeros_f32x8, zeros_i32x8)
from pyml.quant.activation import quantize_rows_q8, quantize_rows_u8, quantize_rows_u8_sums
from pyml.quant.ggml_types import Q4_K, Q8_0
from pyml.quant.interleaved_gemv import (_block, _block_codes, _block_scales, _correction_table, _k_block, _k_scales,
                                         _offset_sums, _sb_size, activation_buffers, gemv_activation, gemv_group_into)
from pyml.quant.interleaved_pairs import ZMM_KINDS, _gemm_pair, _gemm_pair_k
from pyml.quant.interleaved_tiles import code_scratch, token_tiles
from pyml.quant.interleaved_triples import SIGNED_KINDS, _gemm_triple


# The GEMM unpacks each row group's codes (nibbles, Q5's fifth bits) once per call into a scratch
# of nb x 8 code vectors, and its token tiles load them from there: unpacked per tile of 4 tokens,
# Q5_0's ~28 unpacking ops on 16 rows ran beside its 32 vpdpbusd in the same pipes. The scratch is
# 256 bytes per block and 8 rows (Gemma 3's K = 640: 5 KB; 16 rows on 512-bit vectors 10 KB), so it
# stays in L1/L2. Q4_K's float scales (d x sc, dmin x mn) are made once per call the same way.
# The same integers and float ops, so the same bits.

_stage, _staged = code_scratch(load_u8x32, store_u8x32, 32)


@numba.njit
def _staged_codes(kind, w, nb):
    """uint8 [nb * 256]: _codes of the group's nb superblocks (Q4_K: _k_codes of its nb groups of 32), block b at 256 b."""
    numba.literally(kind)
    st = np.empty(256 * nb, np.uint8)
    for b in range(nb):
        _stage(st, b, _block_codes(kind, w, b))
    return st


@numba.njit
def _table_row(kind, table, b):  # I32x8: row b of a _correction_table (zeros where it is empty)
    numba.literally(kind)
    if kind == Q8_0 and HAVE_VNNI:
        return load_i32x8(table, 8 * b)
    return zeros_i32x8()


@numba.njit
def _shared(kind, data, b):  # block b's codes and Q8_0's corrections (data: codes, correction table, group)
    return _staged(data[0], b), _table_row(kind, data[1], b)


@numba.njit
def _block_dot(kind, data, s, b, y, yd, yoff, ys, acc):
    return _block(kind, s[0], s[1], _block_scales(kind, data[2], _sb_size(kind) * b), y, b, yd, yoff, ys, acc)


@numba.njit
def _staged_scales_k(w, n):
    """Q4_K: float32 [n * 16], group u of 32 values at 16 u: d x sc of the 8 rows, then dmin x mn.
    Made once per call, as the codes: _k_block converted and multiplied them per token tile."""
    sc = np.empty(16 * n, np.float32)
    for u in range(n):
        d_sc, dmin_mn = _k_scales(w, u)
        store_f32x8(sc, 16 * u, d_sc)
        store_f32x8(sc, 16 * u + 8, dmin_mn)
    return sc


@numba.njit
def _shared_k(kind, data, u):  # Q4_K: group u's codes (data: codes, staged scales, group)
    return _staged(data[0], u)


@numba.njit
def _block_dot_k(kind, data, v, u, y, yd, yoff, ys, acc):
    """_k_block, its scales from _staged_scales_k."""
    sc = data[1]
    return _k_block(v, (load_f32x8(sc, 16 * u), load_f32x8(sc, 16 * u + 8)), y, u, yd, ys, acc)


_tiles = token_tiles(zeros_f32x8, store_f32x8, _shared, _block_dot)
# Q4_K's rows left over after the tiles of 4 take _block_dot_k block by block, as the tiles do (not
# its GEMV, whose float ops round differently): a row's bits do not depend on where it lands in T.
_tiles_k = token_tiles(zeros_f32x8, store_f32x8, _shared_k, _block_dot_k)


@numba.njit
def _gemm_group(kind, w, xq, xd, xs, xoff, out, g):
    """Rows 8g..8g+7 of out [T, R]: the codes unpacked once (_staged_codes), then 4 activation rows at a time."""
    numba.literally(kind)
    nb = xd.shape[1]
    _tiles(kind, (_staged_codes(kind, w, nb), _correction_table(kind, w, nb), w), xq, xd, xs, xoff, out, 8 * g)


@numba.njit
def _gemm_group_k(w, xq, xd, xs, xoff, out, g):  # Q4_K: _gemm_group for the superblocks of module doc
    n = xd.shape[1]
    _tiles_k(Q4_K, (_staged_codes(Q4_K, w, n), _staged_scales_k(w, n), w), xq, xd, xs, xoff, out, 8 * g)


# --- the kernels of one type ------------------------------------------------------------------

class InterleavedKernels(NamedTuple):
    gemv: Callable  # (groups, x, out): groups [G, nb*sb] u8, x [n_cols] f32 -> out [>= 8G] f32
    gemm: Callable  # (groups, x, out): x [T, n_cols] f32 -> out [T, >= 8G] f32
    gemm_triples: Callable  # gemm's form without VNNI for SIGNED_KINDS (runs on any path, for tests)


@lru_cache(maxsize=None)
def interleaved_kernels(kind: int) -> InterleavedKernels:
    """The GEMV and GEMM of one type in this layout (`kind` a constant in each); the tail rows
    (R % 8) stay in the file's layout and go through the type's KernelSet."""
    kind = int(kind)  # a plain int: Numba types a captured int as a constant, an IntEnum not
    pairs = ZMM and kind in ZMM_KINDS  # a constant: the other paths compile no pair loop

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv(groups, x, out):
        xq, xd, xs, xp, xoff, y8 = activation_buffers((x.size,))
        y = gemv_activation(kind, x, xq, xd, xs, xp, xoff, y8)
        for g in prange(groups.shape[0]):  # prange's index is a uint64; decode_kernels' loop passes an
            # int64: one type, so one compile of gemv_group_into per kind, not two of the same code
            gemv_group_into(kind, groups, np.int64(g), y, xq, xd, xs, xoff, out)
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemm_triples(groups, x, out):
        y8, xd, xs, qs = quantize_rows_u8_sums(x)
        G = groups.shape[0]
        for u in prange((G + 2) // 3):
            g = 3 * u
            n = min(3, G - g)  # the last unit may hold fewer groups: it repeats its last one
            _gemm_triple(kind, groups[g], groups[g + min(1, n - 1)], groups[g + n - 1], n, y8, xd, xs, qs, out, g)
        return out

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemm(groups, x, out):
        G = groups.shape[0]
        if kind == Q8_0 and HAVE_VNNI:  # the offset codes straight from the quantizer; no sums to make
            y, xd = quantize_rows_u8(x)
            xq, xs, xoff = y.view(np.int8), xd, np.zeros((x.shape[0], 1), np.int32)  # xq, xs, xoff unread
        else:
            xq, xd, xs, _ = quantize_rows_q8(x)
            xoff = np.empty(xd.shape, np.int32)
            for t in prange(x.shape[0]):
                _offset_sums(kind, xq[t], xoff[t])
            y = xq.view(np.uint8)  # the codes themselves: the loads reinterpret the bytes as they need
        if pairs:
            for p in prange(G // 2):
                if kind == Q4_K:
                    _gemm_pair_k(groups[2 * p], groups[2 * p + 1], xq, xd, xs, xoff, out, 2 * p)
                else:
                    _gemm_pair(kind, groups[2 * p], groups[2 * p + 1], y, xd, xs, xoff, out, 2 * p)
            if G % 2:
                if kind == Q4_K:
                    _gemm_group_k(groups[G - 1], xq, xd, xs, xoff, out, G - 1)
                else:
                    _gemm_group(kind, groups[G - 1], y, xd, xs, xoff, out, G - 1)
            return out
        for g in prange(G):  # a group's weights stay in L1/L2 while the activations stream by
            if kind == Q4_K:
                _gemm_group_k(groups[g], xq, xd, xs, xoff, out, g)
            else:
                _gemm_group(kind, groups[g], y, xd, xs, xoff, out, g)
        return out

    if not HAVE_VNNI and kind in SIGNED_KINDS:  # three groups per activation quad
        return InterleavedKernels(gemv, gemm_triples, gemm_triples)
    return InterleavedKernels(gemv, gemm, gemm_triples)
