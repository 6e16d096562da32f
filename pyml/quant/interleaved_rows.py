"""The x8 layout's product with a few activation rows (2 .. ROWS_MAX: a batched decode step of up
to 16 sequences, a speculative decoding's verify pass): the GEMV's loop, each superblock's code
vectors unpacked once into registers and dotted with every row in turn, so the weights are read
once for all the rows.

Each row gets exactly the GEMV's integers and float ops in the GEMV's order (gemv_activation's
quantization; per superblock _block, or for Q4_K _k_block per group of 32), so its row of the
result has the bits a GEMV of that row alone gives: a sequence decoded in a batch, or verified in
a speculative pass, sees the numbers a decode step of it alone would. The GEMM (interleaved_gemm.py)
stages every group's codes into a scratch and works in tiles of 4 tokens in another order: at
a few rows its fixed cost is 2-9x a GEMV's, and its rows round differently.

On the avx512 paths (core/isa.py's ZMM) the ZMM_KINDS take two groups a step on 512-bit vectors
(_rows_pair, Q4_K's _rows_pair_k: interleaved_pairs.py's lanes, the same ops per lane, the same
bits; Q4_K's d x sc fenced as in _k_scales): group u with
group u + G/2, not with its neighbour, so that each thread reads two long sequential streams. Two
neighbours (one stream jumping back and forth 2.6 KB apart at SmolLM2's 576 columns) read their
weights from memory 0.77x as fast as one group at a time; two halves of the matrix 1.1-1.5x as fast,
a 16-sequence step of SmolLM2 Q4_0 1.2x (docs/performance-journal.md, "Two halves of the matrix").
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np
from numba import prange

from pyml.core.isa import ZMM
from pyml.core.simd import FASTMATH, load_f32x8, store_f32x8
from pyml.core.simd512 import load_f32x16, store_f32x16
from pyml.quant.ggml_types import Q4_K
from pyml.quant.interleaved import Q4_K_SUPERBLOCK
from pyml.quant.interleaved_gemv import (_block, _block_scales, _codes, _corrections, _k_block, _k_codes, _k_scales,
                                         _sb_size, activation_buffers, activation_bytes, block_prefetch, gemv_activation,
                                         k_prefetch)
from pyml.quant.interleaved_pairs import (ZMM_KINDS, _block16, _block_scales16, _codes16, _corrections16, _k_block16,
                                         _k_codes16, _k_scales16)

ROWS_MAX = 16  # up to this many rows take rows_kernel (a batched decode of 16 sequences); more: the GEMM
# The groups are shared out in chunks, one accumulator buffer a chunk, one contiguous chunk a thread:
# four a thread made a batched step of SmolLM2 (Q4_0, Q4_1, Q8_0) 4-10% slower at 8 and 16 rows
# (the rows region's products and decode_rows', the chunks claimed in turn), Gemma 3's Q4_K the same
# either way; a product alone, in cache or not, the same (docs/performance.md, "One chunk a thread").
CHUNKS_PER_THREAD = 1


def serves(T: int) -> bool:
    """Whether rows_kernel serves a product of T activation rows (T == 1 is the GEMV's)."""
    return 1 < T <= ROWS_MAX


def chunks_for(threads: int) -> int:
    return CHUNKS_PER_THREAD * threads


@numba.njit
def _rows_group(kind, w, y, xd, xs, xoff, acc):
    """acc [8T] <- the group w's 8 rows dotted with every activation row t at 8t .. 8t+7, as _gemv_group."""
    numba.literally(kind)
    sb = _sb_size(kind)
    acc[:] = 0.0
    for b in range(xd.shape[1]):
        o = sb * b
        block_prefetch(w, o, sb)  # as the GEMV
        v = _codes(kind, w, o)
        corr, ws = _corrections(kind, v), _block_scales(kind, w, o)
        for t in range(xd.shape[0]):
            store_f32x8(acc, 8 * t, _block(kind, v, corr, ws, y[t], b, xd[t, b], xoff[t], xs[t, b],
                                           load_f32x8(acc, 8 * t)))


@numba.njit
def _rows_pair(kind, w0, w1, y, xd, xs, xoff, acc):
    """acc [16T] <- groups w0 and w1 (16 rows: lanes 0-7 w0's, 8-15 w1's) dotted with every activation
    row t at 16t .. 16t+15: _rows_group on 512-bit vectors (interleaved_pairs.py's lanes), each lane
    the GEMV's integers and float ops in its order. Both groups' streams are fetched ahead."""
    numba.literally(kind)
    sb = _sb_size(kind)
    acc[:] = 0.0
    for b in range(xd.shape[1]):
        o = sb * b
        block_prefetch(w0, o, sb)
        block_prefetch(w1, o, sb)
        v = _codes16(kind, w0, w1, o)
        corr, ws = _corrections16(kind, v), _block_scales16(kind, w0, w1, o)
        for t in range(xd.shape[0]):
            store_f32x16(acc, 16 * t, _block16(kind, v, corr, ws, y[t], b, xd[t, b], xoff[t], xs[t, b],
                                               load_f32x16(acc, 16 * t)))


@numba.njit
def _rows_group_k(w, xq, xd, xs, acc):
    """Q4_K: _rows_group in _gemv_group_k's order (superblock, chunk pair, low then high nibbles)."""
    acc[:] = 0.0
    for s in range(xd.shape[1] // 8):
        o = Q4_K_SUPERBLOCK * s
        for p in range(4):
            c, u = o + 160 + 256 * p, 8 * s + 2 * p
            k_prefetch(w, c)
            lo, ks = _k_codes(w, c, 0), _k_scales(w, u)
            for t in range(xd.shape[0]):
                store_f32x8(acc, 8 * t, _k_block(lo, ks, xq[t], u, xd[t, u], xs[t, u], load_f32x8(acc, 8 * t)))
            hi, ks = _k_codes(w, c, 1), _k_scales(w, u + 1)
            for t in range(xd.shape[0]):
                store_f32x8(acc, 8 * t, _k_block(hi, ks, xq[t], u + 1, xd[t, u + 1], xs[t, u + 1],
                                                 load_f32x8(acc, 8 * t)))


@numba.njit
def _rows_pair_k(w0, w1, xq, xd, xs, acc):
    """Q4_K: _rows_group_k on two groups at once (16 rows, lanes as _rows_pair's), both streams fetched ahead."""
    acc[:] = 0.0
    for s in range(xd.shape[1] // 8):
        o = Q4_K_SUPERBLOCK * s
        for p in range(4):
            c, u = o + 160 + 256 * p, 8 * s + 2 * p
            k_prefetch(w0, c)
            k_prefetch(w1, c)
            lo, ks = _k_codes16(w0, w1, c, 0), _k_scales16(w0, w1, u)
            for t in range(xd.shape[0]):
                store_f32x16(acc, 16 * t, _k_block16(lo, ks, xq[t], u, xd[t, u], xs[t, u], load_f32x16(acc, 16 * t)))
            hi, ks = _k_codes16(w0, w1, c, 1), _k_scales16(w0, w1, u + 1)
            for t in range(xd.shape[0]):
                store_f32x16(acc, 16 * t, _k_block16(hi, ks, xq[t], u + 1, xd[t, u + 1], xs[t, u + 1],
                                                     load_f32x16(acc, 16 * t)))


@numba.njit(inline="always")
def rows_activation(kind, x, act, t):
    """Row t of act (activation_buffers of T rows) <- x quantized as the GEMV quantizes it."""
    xq, xd, xs, xp, xoff, y8 = act
    gemv_activation(kind, x, xq[t], xd[t], xs[t], xp[t], xoff[t], y8[t])


def takes_pairs(kind: int) -> bool:
    """Whether products of `kind` take two groups a step (512-bit vectors): rows_units' and
    rows_chunk's `pairs`, a constant of their callers (the other paths compile no pair loop)."""
    return bool(ZMM and kind in ZMM_KINDS)


@numba.njit
def rows_units(pairs, groups):
    """The units of work of a product over `groups`: pairs of groups (takes_pairs; a last odd group
    alone), else groups."""
    numba.literally(pairs)
    G = groups.shape[0]
    P = G // 2 if pairs else 0
    return P + (G - 2 * P)


@numba.njit
def rows_chunk(kind, pairs, groups, act, out, c, chunks, acc):
    """Units c*U/chunks .. (c+1)*U/chunks - 1 (rows_units) of out [T, >= 8G] = x W^T, x quantized in
    `act` (rows_activation), acc [16T] f32 scratch: gemv_rows' chunks and decode_kernels' batched
    region run it, one loop for both."""
    numba.literally(kind)
    numba.literally(pairs)
    xq, xd, xs, xp, xoff, y8 = act
    y = activation_bytes(kind, xq, y8)
    T, U = xd.shape[0], rows_units(pairs, groups)
    P = groups.shape[0] // 2 if pairs else 0
    for u in range(c * U // chunks, (c + 1) * U // chunks):
        if pairs:
            if u < P:
                if kind == Q4_K:
                    _rows_pair_k(groups[u], groups[u + P], xq, xd, xs, acc)
                else:
                    _rows_pair(kind, groups[u], groups[u + P], y, xd, xs, xoff, acc)
                for t in range(T):
                    store_f32x8(out[t], 8 * u, load_f32x8(acc, 16 * t))
                    store_f32x8(out[t], 8 * (u + P), load_f32x8(acc, 16 * t + 8))
                continue
        g = u + P
        if kind == Q4_K:
            _rows_group_k(groups[g], xq, xd, xs, acc)
        else:
            _rows_group(kind, groups[g], y, xd, xs, xoff, acc)
        for t in range(T):
            store_f32x8(out[t], 8 * g, load_f32x8(acc, 8 * t))


@lru_cache(maxsize=None)
def rows_kernel(kind: int):
    """(groups, x, out, chunks): groups [G, nb*sb] u8 (interleaved.py), x [T, n_cols] f32 -> out [T, >= 8G]
    f32; the groups shared out in `chunks` pieces (chunks_for: kernels never read the thread count)."""
    kind = int(kind)  # a plain int: Numba types a captured int as a constant, an IntEnum not
    pairs = takes_pairs(kind)

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv_rows(groups, x, out, chunks):
        T = x.shape[0]
        act = activation_buffers((T, x.shape[1]))
        for t in range(T):  # each row as the GEMV quantizes it
            rows_activation(kind, x[t], act, t)
        chunks = min(rows_units(pairs, groups), chunks)
        for c in prange(chunks):
            acc = np.empty(16 * T, np.float32)  # lane r of row t at 8t + r (a pair's: 16t + r): in L1
            rows_chunk(kind, pairs, groups, act, out, c, chunks, acc)
        return out

    return gemv_rows
