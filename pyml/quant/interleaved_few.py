"""The x8 layout's matmul for a few tokens (2 .. FEW_TOKENS: a speculative decoding's verify pass,
a short prompt): the GEMV's loop, with each superblock's code vectors loaded once and dotted with
every token's activation in turn, so the weights are read once for all of them.

Each token gets exactly the GEMV's integers and float ops (gemv_activation's quantization, _block
per superblock in the same order), so its row of the result has the bits a GEMV of that token
alone gives: a verify pass sees the numbers a decode step would. The GEMM (interleaved_gemm.py)
stages every group's codes into a scratch and works in tiles of 4 tokens; at 2 .. 8 tokens that
cost 3-9x a GEMV on SmolLM2's head (1 thread), where this costs about what the weights' bytes do.
Q4_K (its own superblocks) keeps the GEMM.
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np
from numba import prange

from pyml.core.simd import FASTMATH, load_f32x8, prefetch, store_f32x8
from pyml.quant.ggml_types import Q4_K
from pyml.quant.interleaved_gemv import _block, _codes, _corrections, _sb_size, activation_bytes, gemv_activation

FEW_TOKENS = 8  # up to this many tokens take few_token_gemm (a verify pass of draft_max 7 + 1)
CHUNKS_PER_THREAD = 4  # groups are shared out in chunks: one accumulator buffer per chunk, not per group


def serves(kind: int, T: int) -> bool:
    """Whether few_token_gemm serves a matmul of T tokens on weights of this kind."""
    return 1 < T <= FEW_TOKENS and kind != Q4_K


def chunks_for(threads: int) -> int:
    return CHUNKS_PER_THREAD * threads


@lru_cache(maxsize=None)
def few_token_gemm(kind: int):
    """(groups, x, out, chunks): groups [G, nb*sb] u8 (interleaved.py), x [T, n_cols] f32 -> out [T, >= 8G]
    f32; the groups shared out in `chunks` pieces (chunks_for: kernels never read the thread count)."""
    kind = int(kind)  # a plain int: Numba types a captured int as a constant, an IntEnum not

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemm_few(groups, x, out, chunks):
        T, n = x.shape
        nb = n // 32
        xq, xd, xs = np.empty((T, n), np.int8), np.empty((T, nb), np.float32), np.empty((T, nb), np.float32)
        xp, xoff, y8 = np.empty((T, n // 2), np.int16), np.empty((T, nb), np.int32), np.empty((T, n), np.uint8)
        for t in range(T):  # each row as the GEMV quantizes it
            gemv_activation(kind, x[t], xq[t], xd[t], xs[t], xp[t], xoff[t], y8[t])
        y = activation_bytes(kind, xq, y8)
        sb, G = _sb_size(kind), groups.shape[0]
        chunks = min(G, chunks)
        for c in prange(chunks):
            acc = np.empty(8 * T, np.float32)  # lane r of token t at 8t + r
            for g in range(c * G // chunks, (c + 1) * G // chunks):
                w = groups[g]
                acc[:] = 0.0
                for b in range(nb):
                    o = sb * b
                    prefetch(w, o + 1024)  # as the GEMV: the streams stay ahead of their loads
                    prefetch(w, o + 1088)
                    v = _codes(kind, w, o)
                    corr = _corrections(kind, v)
                    for t in range(T):
                        store_f32x8(acc, 8 * t, _block(kind, v, corr, w, o, y[t], b, xd[t, b], xoff[t], xs[t, b],
                                                       load_f32x8(acc, 8 * t)))
                for t in range(T):
                    for r in range(8):
                        out[t, 8 * g + r] = acc[8 * t + r]
        return out

    return gemm_few
