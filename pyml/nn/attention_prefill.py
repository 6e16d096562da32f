"""Attention for a prefill: T queries over the KV cache (their own keys and values already written),
in (kv head, TILE_Q queries) items with an online softmax, so no [T, S] score matrix exists; on the
avx512_bf16 path QK^T and PV may run on vdpbf16ps. The cache's layout, the shared rows-against-a-span
core and decode: attention_kernels.py.
"""

from __future__ import annotations

import numba
import numpy as np

from pyml.core import atomics
from pyml.core.isa import BF16 as HAVE_BF16
from pyml.core.jit import FASTMATH
from pyml.core.ops import exp32
from pyml.nn.attention_kernels import CHUNK, PERF, ROWS, TYPE_NAMES, attend_rows, chunk_row_max, read_kv
from pyml.quant import bf16_gemm

TILE_Q = 8  # queries per work item (x the group's heads = its rows)


# --- prefill: tiles of queries x the key tiles they see ---------------------------------

@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _items(q, n_kv):
    """A prefill's work items, (kv head, TILE_Q queries) each: (heads a kv head, tiles, items)."""
    n_tiles = (q.shape[0] + TILE_Q - 1) // TILE_Q
    return q.shape[1] // n_kv, n_tiles, n_kv * n_tiles


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _scratch(R, q_width, acc_width):
    """A worker's buffers for R query rows: qs [R, q_width] (zeros), qpos, the online softmax's
    m, l and acc [R, acc_width], a chunk's scores [R, CHUNK]."""
    return (np.zeros((R, q_width), np.float32), np.empty(R, np.int64), np.empty(R, np.float32),
            np.empty(R, np.float32), np.empty((R, acc_width), np.float32), np.empty((R, CHUNK), np.float32))


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _item_begin(q, pos, item, n_kv, n_tiles, scale, window, qs, qpos, m, l, acc):
    """A prefill item's start: item -> (kv head, tile's first query t0, its queries nt, the first
    position its rows see), the latest tiles first; qs [R, hdp] <- its queries' heads of that group
    (scaled, zero padding rows), qpos their positions (padding rows: the tile's last); the online
    softmax's m, l, acc reset."""
    T, H, hd = q.shape
    group = H // n_kv
    kv, tile = item % n_kv, n_tiles - 1 - item // n_kv
    t0 = tile * TILE_Q
    nt = min(TILE_Q, T - t0)
    qs[:, :] = 0.0
    qpos[:] = pos + t0 + nt - 1
    for t in range(nt):
        for g in range(group):
            qpos[t * group + g] = pos + t0 + t
            for i in range(hd):
                qs[t * group + g, i] = q[t0 + t, kv * group + g, i] * scale
    m[:] = -np.inf
    l[:] = 0.0
    acc[:, :] = 0.0
    return kv, t0, nt, max(0, pos + t0 - window + 1) if window > 0 else 0


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _item_out(acc, l, kv, t0, nt, group, out):
    """out[t0 .. t0+nt, kv head kv's group of heads] = acc / l of the item's rows."""
    for t in range(nt):
        for g in range(group):
            r = t * group + g
            for i in range(out.shape[2]):
                out[t0 + t, kv * group + g, i] = acc[r, i] / l[r]


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def _tiled(q, pos, keys, k_scale, values, v_scale, window, scale, out, n_threads):
    """q [T, H, hd] at positions pos .. pos+T-1 -> out [T, H, hd]; items (kv head, TILE_Q queries).

    Causal items are unequal (the last tile of a 512-token prompt sees 64x the keys of the
    first), so a static split of the items by count left one thread with ~3/4 of the work. Each
    thread instead claims the next item from a shared counter, the heaviest (latest) tiles first:
    the threads end within about one light item of each other, and a thread the OS descheduled
    leaves its share to the other rather than holding it."""
    n_kv, hdp = values.shape[0], values.shape[2]  # the cache's head_dim, padded to 16 with zeros
    group, n_tiles, n_items = _items(q, n_kv)
    R = (TILE_Q * group + ROWS - 1) // ROWS * ROWS
    claimed = np.zeros(1, np.int64)
    for _worker in numba.prange(min(n_threads, n_items)):
        qs, qpos, m, l, acc, scores = _scratch(R, hdp, hdp)
        while True:
            item = atomics.fetch_add(claimed, 0, 1)
            if item >= n_items:
                break
            kv, t0, nt, lo = _item_begin(q, pos, item, n_kv, n_tiles, scale, window, qs, qpos, m, l, acc)
            attend_rows(qs, qpos, nt * group, keys, k_scale, values, v_scale, kv, lo, pos + t0 + nt, window,
                         m, l, acc, scores, keys, values, -2, 0)
            _item_out(acc, l, kv, t0, nt, group, out)
    return out


# --- prefill on vdpbf16ps (the avx512_bf16 path) --------------------------------------------
#
# The prefill's QK^T and PV are GEMMs: q rows [R, hd] x a chunk's keys, probabilities [R, 64] x its
# values. On a CPU with AVX-512 BF16 both run through bf16_gemm.py's register tile (32 lanes x 8 rows,
# 16 vdpbf16ps accumulators: twice the float32 FMA's products per instruction), on the span's keys
# and values rounded to bf16 once per call in the tile's layout:
#
#   kb  uint16 [Hkv, n32, hdp/2 * 64]      32 positions per block, pairs of dims (bf16_gemm.py's rows =
#                                           positions, columns = dims): one block x a query row's
#                                           dim pairs -> 32 scores
#   vb  uint16 [Hkv, hdw/32, n32*16 * 64]  32 dims per block, pairs of positions (rows = dims,
#                                           columns = positions): a chunk's 32 pairs x a row's
#                                           probability pairs -> 32 dims of its P.V
#
# positions base + i, base = the span's first position rounded down to a chunk, zeros past its end.
# q (scaled) and the probabilities are rounded to bf16 (RNE) too; scores, the softmax and the
# accumulators stay float32, and each row's sum l adds the rounded probabilities it multiplied.

PAIR_BF16 = 2 * bf16_gemm.ROWS  # values per pair of a 32-lane bf16 block


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def _span_to_bf16(keys, k_scale, values, v_scale, lo, hi, base, kf, vf, kb, vb):
    """Positions lo .. hi-1 of the cache -> kb, vb (layouts above; kf, vf float32 [Hkv, n32 * 32, hdp]
    scratch): read_kv's reading of each stored type, then bf16 RNE; zeros outside lo .. hi-1."""
    n_kv, n32, hdp = kb.shape[0], kb.shape[1], kf.shape[2]
    n_vblocks = vb.shape[1]
    for item in numba.prange(n_kv * n32):
        kv, b = item // n32, item % n32
        p0 = base + b * bf16_gemm.ROWS
        r0, r1 = min(max(p0, lo), hi), min(max(p0 + bf16_gemm.ROWS, lo), hi)  # the block's positions in the span
        kf[kv, p0 - base:p0 - base + bf16_gemm.ROWS, :] = 0.0
        vf[kv, p0 - base:p0 - base + bf16_gemm.ROWS, :] = 0.0
        if r0 < r1:
            read_kv(keys[kv:kv + 1], k_scale[kv:kv + 1], values[kv:kv + 1], v_scale[kv:kv + 1], r0, r1,
                    kf[kv:kv + 1, r0 - base:r1 - base], vf[kv:kv + 1, r0 - base:r1 - base])
        for j in range(bf16_gemm.ROWS):
            ku = kf[kv, p0 - base + j].view(np.uint32)
            vu = vf[kv, p0 - base + j].view(np.uint32)
            lane = 32 * (j // 16) + 2 * (j % 16)  # keys: position j of the block is a row
            for pr in range(hdp // 2):
                kb[kv, b, PAIR_BF16 * pr + lane] = bf16_gemm._round_bits(ku[2 * pr])
                kb[kv, b, PAIR_BF16 * pr + lane + 1] = bf16_gemm._round_bits(ku[2 * pr + 1])
            pair, odd = (b * bf16_gemm.ROWS + j) // 2, (b * bf16_gemm.ROWS + j) % 2  # values: position j is a column
            for g in range(n_vblocks):
                for dd in range(bf16_gemm.ROWS):
                    d = g * bf16_gemm.ROWS + dd
                    bits = bf16_gemm._round_bits(vu[d]) if d < hdp else np.uint16(0)
                    vb[kv, g, PAIR_BF16 * pair + 32 * (dd // 16) + 2 * (dd % 16) + odd] = bits


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _rows8(r0):
    return (r0, r0 + 1, r0 + 2, r0 + 3, r0 + 4, r0 + 5, r0 + 6, r0 + 7)


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def _tiled_bf16(q, pos, kb, vb, base, window, scale, out, n_threads):
    """_tiled's items and online softmax over kb, vb (the span in bf16, from base): out [T, H, hd]."""
    n_kv, hdp, n_vblocks = kb.shape[0], kb.shape[2] // bf16_gemm.ROWS, vb.shape[1]
    hdw = n_vblocks * bf16_gemm.ROWS
    group, n_tiles, n_items = _items(q, n_kv)
    R = (TILE_Q * group + 7) // 8 * 8  # bf16_gemm._tile computes 8 rows at a time
    claimed = np.zeros(1, np.int64)
    for _worker in numba.prange(min(n_threads, n_items)):
        qs, qpos, m, l, acc, scores = _scratch(R, hdp, hdw)
        qb = np.zeros((R, hdp), np.uint16)
        pv = np.empty((R, hdw), np.float32)
        pb = np.zeros((R, CHUNK), np.uint16)
        while True:
            item = atomics.fetch_add(claimed, 0, 1)
            if item >= n_items:
                break
            kv, t0, nt, lo = _item_begin(q, pos, item, n_kv, n_tiles, scale, window, qs, qpos, m, l, acc)
            n_rows = nt * group
            for r in range(R):
                u = qs[r].view(np.uint32)
                for i in range(hdp):
                    qb[r, i] = bf16_gemm._round_bits(u[i])
            hi = pos + t0 + nt
            q_first, q_last = pos + t0, pos + t0 + nt - 1
            c0 = lo - (lo - base) % CHUNK
            while c0 < hi:
                blk = (c0 - base) // bf16_gemm.ROWS
                for half in range(CHUNK // bf16_gemm.ROWS):
                    for r0 in range(0, R, 8):
                        bf16_gemm._tile(kb[kv, blk + half], qb, _rows8(r0), hdp // 2, scores, half * bf16_gemm.ROWS)
                unmasked = c0 >= lo and c0 + CHUNK <= hi and c0 + CHUNK - 1 <= q_first and \
                    (window == 0 or q_last - c0 < window)
                for r in range(R):
                    if r >= n_rows:
                        pb[r, :] = 0
                        continue
                    best = chunk_row_max(scores, r, CHUNK, c0, lo, hi, qpos[r], window, not unmasked, m, l, acc, hdw)
                    if best == -np.inf:
                        pb[r, :] = 0
                        continue
                    mr = m[r]
                    total = np.float32(0.0)
                    for j in range(CHUNK):
                        s = scores[r, j]
                        e = bf16_gemm.round_f32(exp32(s - mr))  # the probability PV multiplies, as float32
                        e = e if s > -np.inf else np.float32(0.0)
                        pb[r, j] = bf16_gemm.high_bits(e)
                        total += e
                    l[r] += total
                off = PAIR_BF16 * ((c0 - base) // 2)
                for g in range(n_vblocks):
                    for r0 in range(0, R, 8):
                        bf16_gemm._tile(vb[kv, g, off:], pb, _rows8(r0), CHUNK // 2, pv, g * bf16_gemm.ROWS)
                for r in range(n_rows):
                    for i in range(hdw):
                        acc[r, i] += pv[r, i]
                c0 += CHUNK
            _item_out(acc, l, kv, t0, nt, group, out)
    return out


def _attend_tiled_bf16(q, pos, keys, k_scale, values, v_scale, scale, window, out):
    T = q.shape[0]
    n_kv, hdp = values.shape[0], values.shape[2]
    lo = max(0, pos - window + 1) if window > 0 else 0
    hi = pos + T
    base = lo - lo % CHUNK
    n32 = -(-(hi - base) // CHUNK) * (CHUNK // bf16_gemm.ROWS)
    hdw = -(-hdp // bf16_gemm.ROWS) * bf16_gemm.ROWS
    kf = np.empty((n_kv, n32 * bf16_gemm.ROWS, hdp), np.float32)
    vf = np.empty((n_kv, n32 * bf16_gemm.ROWS, hdp), np.float32)
    kb = np.empty((n_kv, n32, hdp // 2 * PAIR_BF16), np.uint16)
    vb = np.empty((n_kv, hdw // bf16_gemm.ROWS, n32 * bf16_gemm.ROWS // 2 * PAIR_BF16), np.uint16)
    _span_to_bf16(keys, k_scale, values, v_scale, lo, hi, base, kf, vf, kb, vb)
    return _tiled_bf16(q, pos, kb, vb, base, window, scale, out, numba.get_num_threads())




def attend_tiled(q: np.ndarray, pos: int, keys: np.ndarray, k_scale: np.ndarray, values: np.ndarray,
                 v_scale: np.ndarray, scale: float, window: int = 0, use_bf16: bool = False) -> np.ndarray:
    """Causal attention for T queries at positions pos .. pos+T-1 over the cache (their own keys
    and values already written): q [T, H, hd] float32 -> [T, H, hd]. Blocks of TILE_Q queries x
    8-position key tiles with an online softmax; no [T, S] score matrix is ever formed.
    use_bf16: QK^T and PV on vdpbf16ps (the avx512_bf16 path only), else float32."""
    with PERF.trace("attention::sdpa", "q=[{}, {}, {}] kv=[{}, {}, {}] {} tiled{}", *q.shape, values.shape[0],
                     pos + q.shape[0], q.shape[2], TYPE_NAMES[values.dtype.type], " bf16" if use_bf16 else "",
                     op="sdpa"):
        if use_bf16:
            if not HAVE_BF16:
                raise RuntimeError("bf16 attention needs AVX-512 BF16 (ISA path avx512_bf16)")
            return _attend_tiled_bf16(np.ascontiguousarray(q), pos, keys, k_scale, values, v_scale,
                                      np.float32(scale), window, np.empty(q.shape, np.float32))
        return _tiled(np.ascontiguousarray(q), pos, keys, k_scale, values, v_scale, window, np.float32(scale),
                      np.empty(q.shape, np.float32), numba.get_num_threads())
