"""Attention kernels over the KV cache in its stored type (f32, f16, q8_0): the cache's layout, its
write and read, the rows-against-a-span core, and decode (the prefill's tiles: attention_prefill.py).

They live beside the KV cache whose layout they define (nn/kv_cache.py), written in the SIMD
vocabulary of core/simd512.py: F32x16 values (two ymm registers on the 256-bit paths, one zmm on
the avx512 ones) and vcvtph2ps loads.

Cache layout (one layer; Hkv kv heads, `cap` slots, head_dim hd; see nn/kv_cache.py):

    keys     [Hkv, cap/8, hd, 8]   tiles of 8 positions: for each dimension, the 8 positions
                                   side by side, so a query's scores for 8 positions accumulate
                                   in one vector (an FMA per dimension, no horizontal sum), and
                                   every query row of a GQA group is computed against one load
    values   [Hkv, cap, hd]        a position's values contiguous: P.V runs along hd
    k_scale  [Hkv, cap/8, hd/32, 8]  q8_0 only (else a dummy): the fp16 scale of each 32-dim
    v_scale  [Hkv, cap, hd/32]       block of each position, laid out like the codes it scales

Stored types: f32 (float32), f16 (uint16 holding IEEE half bits, converted in-register by
vcvtph2ps), q8_0 (int8 codes, fp16 scale per 32 values along head_dim, as llama.cpp's Q8_0
block: d = max|x| / 127, code = roundf(x / d); the same codes and scale as ggml, tiled).
Position p lives in slot p % cap: a full cache has cap >= every position, a sliding-window
layer's ring holds the last `cap` positions (cap >= window + the longest write).

Softmax is online (flash-attention): 64 positions at a time per query row, a running max m,
sum l and accumulator acc, rescaled when the max grows. Decode splits the span over threads
(flash-decoding) and merges the partial (m, l, acc); prefill gives each thread (kv head,
tile of queries) items, so peak extra memory is O(T x hd), never O(T x S).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba.extending import overload

from pyml.core import perf, simd
from pyml.core.isa import ZMM
from pyml.core.jit import FASTMATH
from pyml.core.ops import PARALLEL_MIN_WORK, exp32, max32
from pyml.core.simd import prefetch_l2
from pyml.core.simd512 import (f32x16, fma16, load_f16x8_split, load_f16x16, load_f32x8_split, load_f32x16,
                               load_i8x8_f32_split, load_i8x16_f32, store_f32x16, zeros_f32x16)

PERF = perf.get("pyml.nn.attention_kernels")  # attention::sdpa, decode's and the prefill's
DECODE_SPAN = ("attention::sdpa", "q=[{}, {}] kv=[{}, {}, {}] {}")  # H, hd, Hkv, span, hd, kv type
# a batched step's: sequences, H, hd, Hkv, positions attended over all of them, hd, kv type
BATCH_SPAN = ("attention::sdpa", "batch={} q=[{}, {}] kv=[{}, {}, {}] {}")
# a verify pass's: queries, H, hd, Hkv, positions attended over all of them, hd, kv type
QUERIES_SPAN = ("attention::sdpa", "queries={} q=[{}, {}] kv=[{}, {}, {}] {}")

BLOCK = 8       # positions per key tile: 8 lanes of scores
CHUNK = 64      # positions per online-softmax step (a multiple of BLOCK)
ROWS = 4        # query rows computed against one load of a key tile
TILES = 4 if ZMM else 2  # key tiles a _scores call scores: a 16-lane vector holds two
QBLOCK = 32     # q8_0: values per scale, along head_dim

KV_TYPES = {"f32": np.float32, "f16": np.uint16, "q8_0": np.int8}  # name -> stored code dtype
TYPE_NAMES = {code: name for name, code in KV_TYPES.items()}
_NOTHING = np.zeros((0, 1, 1), np.float32)  # attend_decode without a key and value to write


# the loads of the stored types (float32, uint16 = f16 bits, int8 = q8_0 codes), as float32 lanes
_LOADS16 = {numba.float32: load_f32x16, numba.uint16: load_f16x16, numba.int8: load_i8x16_f32}
_LOADS8X2 = {numba.float32: load_f32x8_split, numba.uint16: load_f16x8_split, numba.int8: load_i8x8_f32_split}


def _load16(ary, idx):
    """16 stored values at flat element idx as F32x16 (the 512-bit decode's values)."""


@overload(_load16, inline="always")
def _load16_typed(ary, idx):
    load = _LOADS16.get(ary.dtype)
    return None if load is None else lambda ary, idx: load(ary, idx)


def _load8x2(ary, i, j):
    """8 stored values at flat element i (lanes 0-7) and 8 at j (lanes 8-15) as F32x16: one dimension
    of two key tiles (the 512-bit decode's keys)."""


@overload(_load8x2, inline="always")
def _load8x2_typed(ary, i, j):
    load = _LOADS8X2.get(ary.dtype)
    return None if load is None else lambda ary, i, j: load(ary, i, j)


def _scale8x2(scales, i, j):
    """The fp16 scales of two key tiles' block (8 at flat i, 8 at j) as F32x16; 1.0 for a float cache
    (its scales are a dummy array)."""


@overload(_scale8x2, inline="always")
def _scale8x2_typed(scales, i, j):
    if scales.dtype == numba.uint16:
        return lambda scales, i, j: load_f16x8_split(scales, i, j)
    return lambda scales, i, j: f32x16(1.0)


def _scale1(scales, kv, slot, block):
    """One value's fp16 scale as float32; 1.0 for a float cache."""


@overload(_scale1, inline="always")
def _scale1_typed(scales, kv, slot, block):
    if scales.dtype == numba.uint16:
        return lambda scales, kv, slot, block: simd.half_to_f32(scales[kv, slot, block])
    return lambda scales, kv, slot, block: np.float32(1.0)


def _is_q8(ary):
    """Whether a cache array holds q8_0 codes (int8)."""


@overload(_is_q8, inline="always")
def _is_q8_typed(ary):
    flag = ary.dtype == numba.int8
    return lambda ary: flag


def _is_f16(ary):
    """Whether a cache array holds fp16 bits (uint16)."""


@overload(_is_f16, inline="always")
def _is_f16_typed(ary):
    flag = ary.dtype == numba.uint16
    return lambda ary: flag


# --- writing the cache ---------------------------------------------------------------

@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _roundf(x):
    """Round half away from zero (C's roundf, as ggml's quantizer)."""
    return np.float32(math.copysign(math.floor(abs(x) + np.float32(0.5)), x))


@numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def write_kv(k, v, pos, keys, k_scale, values, v_scale):
    """Store k, v [T, Hkv, hd] float32 at positions pos .. pos+T-1 (slots p % cap), in the
    cache's stored type (from the arrays' dtype: float32, uint16 = f16, int8 = q8_0)."""
    T, n_kv, hd = k.shape  # the cache's own head_dim may be padded: its padding stays zero
    cap = values.shape[1]
    for t in range(T):
        slot = (pos + t) % cap
        kb, lane = slot // BLOCK, slot % BLOCK
        for h in range(n_kv):
            if _is_q8(values):
                for b in range(hd // QBLOCK):
                    i0 = b * QBLOCK
                    ka = np.float32(0.0)
                    va = np.float32(0.0)
                    for i in range(i0, i0 + QBLOCK):
                        ka = max(ka, abs(k[t, h, i]))
                        va = max(va, abs(v[t, h, i]))
                    kd, vd = ka / np.float32(127.0), va / np.float32(127.0)
                    kid = np.float32(1.0) / kd if kd != 0 else np.float32(0.0)
                    vid = np.float32(1.0) / vd if vd != 0 else np.float32(0.0)
                    k_scale[h, kb, b, lane] = simd.f32_to_half(kd)
                    v_scale[h, slot, b] = simd.f32_to_half(vd)
                    for i in range(i0, i0 + QBLOCK):
                        keys[h, kb, i, lane] = np.int8(_roundf(k[t, h, i] * kid))
                        values[h, slot, i] = np.int8(_roundf(v[t, h, i] * vid))
            elif _is_f16(values):
                for i in range(hd):
                    keys[h, kb, i, lane] = simd.f32_to_half(k[t, h, i])
                    values[h, slot, i] = simd.f32_to_half(v[t, h, i])
            else:
                for i in range(hd):
                    keys[h, kb, i, lane] = k[t, h, i]
                    values[h, slot, i] = v[t, h, i]


@numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def read_kv(keys, k_scale, values, v_scale, start, end, k_out, v_out):
    """Positions start .. end-1 back as float32 [Hkv, end-start, hd] (inspection and tests)."""
    n_kv, hd, cap = values.shape[0], k_out.shape[2], values.shape[1]
    for h in range(n_kv):
        for p in range(start, end):
            slot = p % cap
            kb, lane = slot // BLOCK, slot % BLOCK
            for i in range(hd):
                kx, vx = keys[h, kb, i, lane], values[h, slot, i]
                if _is_q8(values):
                    k_out[h, p - start, i] = np.float32(kx) * simd.half_to_f32(k_scale[h, kb, i // QBLOCK, lane])
                    v_out[h, p - start, i] = np.float32(vx) * simd.half_to_f32(v_scale[h, slot, i // QBLOCK])
                elif _is_f16(values):
                    k_out[h, p - start, i] = simd.half_to_f32(kx)
                    v_out[h, p - start, i] = simd.half_to_f32(vx)
                else:
                    k_out[h, p - start, i] = kx
                    v_out[h, p - start, i] = vx


# --- the shared core: rows of queries against a span of positions ----------------------

@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _scores(q, r0, keys, k_scale, kv, kb, scores, col):
    """scores[r0..r0+3, col .. col + TILES * 8 - 1] = q[r0..r0+3] . keys of tiles kb .. kb+TILES-1: a
    pair of tiles a 16-lane vector (two ymm registers on the 256-bit paths; a zmm on the avx512
    ones, which take two pairs), one load for 4 rows, and 8 registers of accumulators keep both FMA
    ports busy (4 chains wait on the FMA latency); q8_0 scales applied per 32-dim block. Each score
    is its lane's chain of FMAs over hd, in the same order on every path: the same bits."""
    hd = q.shape[1]
    nkb = keys.shape[1]
    k1, k2, k3 = (kb + 1) % nkb, (kb + 2) % nkb, (kb + 3) % nkb  # past the span: read, never used
    b0, b1 = (kv * nkb + kb) * hd * BLOCK, (kv * nkb + k1) * hd * BLOCK
    b2, b3 = (kv * nkb + k2) * hd * BLOCK, (kv * nkb + k3) * hd * BLOCK
    per_tile = (hd // QBLOCK) * BLOCK
    c0, c1 = (kv * nkb + kb) * per_tile, (kv * nkb + k1) * per_tile
    c2, c3 = (kv * nkb + k2) * per_tile, (kv * nkb + k3) * per_tile
    s0, s1, s2, s3 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
    t0, t1, t2, t3 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
    for b in range((hd + QBLOCK - 1) // QBLOCK):  # hd: a multiple of 32 for q8_0, of 16 otherwise
        p0, p1, p2, p3 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
        u0, u1, u2, u3 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
        for i in range(b * QBLOCK, min(hd, b * QBLOCK + QBLOCK)):
            q0, q1, q2, q3 = f32x16(q[r0, i]), f32x16(q[r0 + 1, i]), f32x16(q[r0 + 2, i]), f32x16(q[r0 + 3, i])
            kx = _load8x2(keys, b0 + i * BLOCK, b1 + i * BLOCK)
            p0, p1, p2, p3 = fma16(q0, kx, p0), fma16(q1, kx, p1), fma16(q2, kx, p2), fma16(q3, kx, p3)
            if ZMM:
                ky = _load8x2(keys, b2 + i * BLOCK, b3 + i * BLOCK)
                u0, u1, u2, u3 = fma16(q0, ky, u0), fma16(q1, ky, u1), fma16(q2, ky, u2), fma16(q3, ky, u3)
        d = _scale8x2(k_scale, c0 + b * BLOCK, c1 + b * BLOCK)
        s0, s1, s2, s3 = fma16(d, p0, s0), fma16(d, p1, s1), fma16(d, p2, s2), fma16(d, p3, s3)
        if ZMM:
            e = _scale8x2(k_scale, c2 + b * BLOCK, c3 + b * BLOCK)
            t0, t1, t2, t3 = fma16(e, u0, t0), fma16(e, u1, t1), fma16(e, u2, t2), fma16(e, u3, t3)
    store_f32x16(scores[r0], col, s0)
    store_f32x16(scores[r0 + 1], col, s1)
    store_f32x16(scores[r0 + 2], col, s2)
    store_f32x16(scores[r0 + 3], col, s3)
    if ZMM:
        store_f32x16(scores[r0], col + 2 * BLOCK, t0)
        store_f32x16(scores[r0 + 1], col + 2 * BLOCK, t1)
        store_f32x16(scores[r0 + 2], col + 2 * BLOCK, t2)
        store_f32x16(scores[r0 + 3], col + 2 * BLOCK, t3)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _fetch_ahead(ahead, n, n_ahead, nk, keys, k_at, values, v_at, per_line):
    """Up to n more lines of what attend_rows fetches ahead (nk elements of keys from k_at, then of
    values from v_at; `ahead` elements so far): returns the new count."""
    end = min(n_ahead, ahead + n * per_line)  # a bound, not a count of n: ~8% faster loops around it
    while ahead < end:
        if ahead < nk:
            prefetch_l2(keys, k_at + ahead)
        else:
            prefetch_l2(values, v_at + ahead - nk)
        ahead += per_line
    return ahead


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def chunk_row_max(scores, r, width, c0, lo, hi, qp, window, masked, m, l, acc, acc_width):
    """The online softmax's step for row r of a chunk of scores (positions c0 ..): when `masked`,
    the positions outside lo .. hi-1, after the row's query position qp or beyond its window set to
    -inf; then the running max m[r] raised to the chunk's, l[r] and acc[r, :acc_width] rescaled to
    it. Returns the chunk's max: -inf when the row sees nothing in it. Decode, the float32 prefill
    and the bf16 prefill all take it."""
    if masked:
        for j in range(width):
            p = c0 + j
            keep = (p >= lo) & (p < hi) & (p <= qp) & ((window == 0) | (qp - p < window))
            scores[r, j] = scores[r, j] if keep else -np.inf
    best = max32(scores[r], width)
    if best > m[r]:
        alpha = exp32(m[r] - best) if m[r] > -np.inf else np.float32(0.0)
        l[r] *= alpha
        for i in range(acc_width):
            acc[r, i] *= alpha
        m[r] = best
    return best


@numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def attend_rows(q, qpos, n_rows, keys, k_scale, values, v_scale, kv, lo, hi, window, m, l, acc, scores,
                next_keys, next_values, next_kv, next_lo):
    """Fold positions lo .. hi-1 of kv head `kv` into the online softmax of query rows q
    [R, hd] (R a multiple of ROWS, already scaled; rows >= n_rows are padding). Row r sees
    position p when p <= qpos[r] and (window == 0 or qpos[r] - p < window).
    State: m, l [R] (running max, sum), acc [R, hd]; scores [R, CHUNK] is scratch.
    While a chunk's values are folded in, the next chunk's keys and values are fetched ahead into
    L2, spread over the passes of the P.V loop: one thread's span is two short streams the hardware
    prefetcher does not run far enough ahead of (into L1, SmolLM2's shape ran up to 1.5x slower).
    Once less than half a chunk of the span is left, the first chunk of the caller's next span is
    fetched instead: positions next_lo .. of kv head next_kv of (next_keys, next_values) (next_kv -1:
    none; -2: nothing ahead at all, for a prefill, whose spans the items share in cache). Fetched
    only after the last chunk, it had started cold: a batched step's spans of 193 positions were read
    at 19 GB/s, at 26 with it and 512-bit vectors (of ~28-33; SmolLM2, 16 rows, Zen 5).
    On the avx512 paths the products run on 512-bit vectors (_scores, the ZMM P.V loop): each
    score and output lane is the same chain of FMAs in the same order as on 256-bit ones."""
    R, hd = q.shape
    cap = values.shape[1]
    nkb = keys.shape[1]
    q_first, q_last = qpos[0], qpos[0]
    for r in range(n_rows):
        q_first, q_last = min(q_first, qpos[r]), max(q_last, qpos[r])
    c0 = lo - lo % BLOCK
    while c0 < hi:
        c1 = min(c0 + CHUNK, hi)
        nb = (c1 - c0 + BLOCK - 1) // BLOCK
        # key tiles outer: a pair of tiles stays in L1 while every row meets it (with the rows
        # outer, Gemma's hd-256 chunk was re-read from L2 once per 4 rows)
        for b in range(0, nb, TILES):  # a last call's tiles past `width` land there, unread
            for r0 in range(0, R, ROWS):
                _scores(q, r0, keys, k_scale, kv, (c0 // BLOCK + b) % nkb, scores, b * BLOCK)
        width = nb * BLOCK
        # a chunk wholly inside the span, before every row's position and within every row's
        # window needs no mask: the common case, kept free of per-score comparisons
        unmasked = c0 >= lo and c0 + width <= hi and c0 + width - 1 <= q_first and \
            (window == 0 or q_last - c0 < window)
        for r in range(R):
            if r >= n_rows:
                scores[r, :width] = 0.0
                continue
            best = chunk_row_max(scores, r, width, c0, lo, hi, qpos[r], window, not unmasked, m, l, acc, hd)
            if best == -np.inf:
                scores[r, :width] = 0.0
                continue
            mr = m[r]
            total = np.float32(0.0)
            for j in range(width):
                s = scores[r, j]
                e = exp32(s - mr)
                e = e if s > -np.inf else np.float32(0.0)
                scores[r, j] = e
                total += e
            l[r] += total
        j0 = max(lo, c0) - c0
        j1 = c1 - c0
        # positions c0+j0 .. c0+j1-1 sit in the ring from first_slot on and wrap at most once (a
        # span is never longer than the ring): one division a chunk, where a `% cap` per position
        # cost the float32 prefill 18% of its time
        first_slot = (c0 + j0) % cap
        split = min(j1, j0 + cap - first_slot)
        pk, pv, pkv, plo, phi = keys, values, kv, c1, min(c1 + CHUNK, hi)
        if hi - c1 < CHUNK // 2:  # less than half a chunk left: the next span's first would start cold
            pk, pv, pkv, plo, phi = next_keys, next_values, next_kv, next_lo, next_lo + CHUNK
        nk, nv = 0, 0
        if pkv >= 0 and next_kv >= -1:  # the tiles and slots of positions plo .. phi-1, up to the ring's end
            tile = plo // BLOCK % nkb
            nk = min((phi - plo + plo % BLOCK + BLOCK - 1) // BLOCK, nkb - tile) * hd * BLOCK
            nv = min(phi - plo, cap - plo % cap) * hd
        k_ahead, v_ahead = (pkv * nkb + plo // BLOCK % nkb) * hd * BLOCK, (pkv * cap + plo % cap) * hd
        per_line = 64 // values.itemsize
        ahead, n_ahead = 0, nk + nv
        width_pass = 4 * BLOCK if ZMM else 2 * BLOCK  # the columns of hd a pass of the P.V loop covers
        passes = (hd + width_pass - 1) // width_pass * (R // ROWS) * (j1 - j0)
        per_pass = (n_ahead // per_line + passes - 1) // passes  # a short chunk fetches more a pass
        # a pass: 4 rows x a 16-lane slice of hd (two ymm registers; on the avx512 paths two zmm slices,
        # an odd last 16 alone): 8 independent FMA chains, and a column of the chunk's values stays
        # in L1 for all rows
        for i in range(0, hd - 2 * BLOCK + 1, width_pass):
            i2 = min(i + 2 * BLOCK, hd - 2 * BLOCK)  # the avx512 paths' second slice, or the first again
            for r0 in range(0, R, ROWS):
                a0, a1 = load_f32x16(acc[r0], i), load_f32x16(acc[r0 + 1], i)
                a2, a3 = load_f32x16(acc[r0 + 2], i), load_f32x16(acc[r0 + 3], i)
                b0, b1, b2, b3 = a0, a1, a2, a3
                if ZMM:
                    b0, b1 = load_f32x16(acc[r0], i2), load_f32x16(acc[r0 + 1], i2)
                    b2, b3 = load_f32x16(acc[r0 + 2], i2), load_f32x16(acc[r0 + 3], i2)
                for seg in range(2):  # before the ring wraps, then after
                    ja, jb, shift = (j0, split, first_slot - j0) if seg == 0 else (split, j1, first_slot - j0 - cap)
                    for j in range(ja, jb):
                        slot = j + shift
                        ahead = _fetch_ahead(ahead, per_pass, n_ahead, nk, pk, k_ahead, pv, v_ahead, per_line)
                        d = _scale1(v_scale, kv, slot, i // QBLOCK)  # q8_0: i2 is in i's 32-block
                        w0, w1 = f32x16(scores[r0, j] * d), f32x16(scores[r0 + 1, j] * d)
                        w2, w3 = f32x16(scores[r0 + 2, j] * d), f32x16(scores[r0 + 3, j] * d)
                        vx = _load16(values, (kv * cap + slot) * hd + i)
                        a0, a1, a2, a3 = fma16(w0, vx, a0), fma16(w1, vx, a1), fma16(w2, vx, a2), fma16(w3, vx, a3)
                        if ZMM:
                            vy = _load16(values, (kv * cap + slot) * hd + i2)
                            b0, b1, b2, b3 = fma16(w0, vy, b0), fma16(w1, vy, b1), fma16(w2, vy, b2), fma16(w3, vy, b3)
                if ZMM and i2 > i:  # with one slice (an odd last 16), a0 .. a3 are its sums
                    store_f32x16(acc[r0], i2, b0)
                    store_f32x16(acc[r0 + 1], i2, b1)
                    store_f32x16(acc[r0 + 2], i2, b2)
                    store_f32x16(acc[r0 + 3], i2, b3)
                store_f32x16(acc[r0], i, a0)
                store_f32x16(acc[r0 + 1], i, a1)
                store_f32x16(acc[r0 + 2], i, a2)
                store_f32x16(acc[r0 + 3], i, a3)
        c0 = c1


# --- decode: one query position, the span split over threads --------------------------

@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def decode_item(item, splits, qs, qpos, group, keys, k_scale, values, v_scale, start, end, window,
                 m, l, acc, scores, next_keys, next_values, next_lo):
    # after the last item: positions next_lo .. of kv head 0 of (next_keys, next_values) come next
    # (next_lo < 0: nothing); before it, the call's next item
    kv, part = item // splits, item % splits
    step = ((end - start + splits - 1) // splits + CHUNK - 1) // CHUNK * CHUNK
    lo = start + part * step
    hi = min(end, lo + step)
    m[item, :] = -np.inf
    l[item, :] = 0.0
    acc[item, :, :] = 0.0
    n_kv = values.shape[0]
    nkv, nlo, nkeys, nvalues = (item + 1) // splits, start + (item + 1) % splits * step, keys, values
    if item + 1 == n_kv * splits:
        nkv, nlo, nkeys, nvalues = 0 if next_lo >= 0 else -1, next_lo, next_keys, next_values
    if lo < hi:
        attend_rows(qs[kv], qpos, group, keys, k_scale, values, v_scale, kv, lo, hi, window,
                     m[item], l[item], acc[item], scores[item], nkeys, nvalues, nkv, nlo)


def decode_scratch(n_heads: int, n_kv: int, hd: int, items: int) -> tuple:
    """(qs, qpos, m, l, acc, scores): the buffers of a decode step of up to `items` (kv head, part)
    items (hd: the cache's, padded to 16), for callers that keep them (nn/decode_kernels.py's region
    step); decode_begin, decode_item and decode_merge use them."""
    R = (n_heads // n_kv + ROWS - 1) // ROWS * ROWS
    return (np.zeros((n_kv, R, hd), np.float32), np.zeros(R, np.int64), np.empty((items, R), np.float32),
            np.empty((items, R), np.float32), np.empty((items, R, hd), np.float32),
            np.empty((items, R, CHUNK), np.float32))


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def decode_begin(q, scale, end, qs, qpos):
    """The query rows the items read: qs [n_kv, R, hd] = q [H, hd] x scale, a GQA group's heads
    as rows (the padding rows and columns stay as they are: zero); every row at position end-1.
    Returns the group size."""
    H, n_kv = q.shape[0], qs.shape[0]
    group = H // n_kv
    for h in range(H):
        for i in range(q.shape[1]):
            qs[h // group, h % group, i] = q[h, i] * scale
    for r in range(qpos.size):
        qpos[r] = end - 1
    return group


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _decode_setup(q, values, splits, scale, end):
    H, n_kv, hd = q.shape[0], values.shape[0], values.shape[2]
    R = (H // n_kv + ROWS - 1) // ROWS * ROWS
    qs = np.zeros((n_kv, R, hd), np.float32)  # hd: the cache's, padded to 16 with zeros
    qpos = np.empty(R, np.int64)
    group = decode_begin(q, scale, end, qs, qpos)
    items = n_kv * splits
    return (group, qs, qpos, np.empty((items, R), np.float32), np.empty((items, R), np.float32),
            np.empty((items, R, hd), np.float32), np.empty((items, R, CHUNK), np.float32))


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def decode_merge(n_kv, splits, group, m, l, acc, out):
    """The split parts' (m, l, acc) -> out [H, hd]: each rescaled to the common max."""
    hd = out.shape[1]
    for kv in range(n_kv):
        for g in range(group):
            best = np.float32(-np.inf)
            for part in range(splits):
                best = max(best, m[kv * splits + part, g])
            total = np.float32(0.0)
            h = kv * group + g
            out[h, :] = 0.0
            for part in range(splits):
                it = kv * splits + part
                if m[it, g] == -np.inf:
                    continue
                w = exp32(m[it, g] - best)
                total += w * l[it, g]
                for i in range(hd):
                    out[h, i] += w * acc[it, g, i]
            for i in range(hd):
                out[h, i] /= total
    return out


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def _decode_parallel(q, k, v, keys, k_scale, values, v_scale, start, end, window, scale, splits, out):
    write_kv(k, v, end - 1, keys, k_scale, values, v_scale)  # T = 0: nothing to write
    n_kv = values.shape[0]
    group, qs, qpos, m, l, acc, scores = _decode_setup(q, values, splits, scale, end)
    for item in numba.prange(n_kv * splits):
        decode_item(item, splits, qs, qpos, group, keys, k_scale, values, v_scale, start, end, window,
                     m, l, acc, scores, keys, values, -1)
    return decode_merge(n_kv, splits, group, m, l, acc, out)


@numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def _decode_serial(q, k, v, keys, k_scale, values, v_scale, start, end, window, scale, splits, out):
    write_kv(k, v, end - 1, keys, k_scale, values, v_scale)
    n_kv = values.shape[0]
    group, qs, qpos, m, l, acc, scores = _decode_setup(q, values, 1, scale, end)
    for item in range(n_kv):
        decode_item(item, 1, qs, qpos, group, keys, k_scale, values, v_scale, start, end, window,
                     m, l, acc, scores, keys, values, -1)
    return decode_merge(n_kv, 1, group, m, l, acc, out)


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def _decode_batch(q, k, v, keys, k_scale, values, v_scale, seqs, ends, splits, window, scale, out):
    # row b: sequence seqs[b] of a pool's layer arrays ([n_seqs, ...]) at position ends[b]-1; its
    # k, v written there and its heads attended on one thread (the rows are the parallel work), its
    # span cut in the splits[b] parts its decode step alone cuts it in (batch_splits): the same bits
    for b in numba.prange(q.shape[0]):
        s = seqs[b]
        write_kv(k[b:b + 1], v[b:b + 1], ends[b] - 1, keys[s], k_scale[s], values[s], v_scale[s])
        decode_row(b, q[b], keys, k_scale, values, v_scale, seqs, ends, splits, window, scale, out[b])
    return out


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def decode_row(b, q, keys, k_scale, values, v_scale, seqs, ends, splits, window, scale, out):
    """Row b of a batched decode step on the calling thread: out [H, hd] <- its query q [H, hd] over
    its sequence's cache (position ends[b]-1 written), in the splits[b] parts its decode step alone
    cuts the span in; the next row's first keys and values fetched meanwhile (its thread, or the
    other, takes it next)."""
    s, end, parts = seqs[b], ends[b], splits[b]
    ks, kss, vs, vss = keys[s], k_scale[s], values[s], v_scale[s]
    start = max(0, end - window) if window else 0
    n_kv = vs.shape[0]
    group, qs, qpos, m, l, acc, scores = _decode_setup(q, vs, parts, scale, end)
    nb = min(b + 1, seqs.shape[0] - 1)
    next_keys, next_values = keys[seqs[nb]], values[seqs[nb]]
    next_lo = (max(0, ends[nb] - window) if window else 0) if nb > b else -1
    for item in range(n_kv * parts):
        decode_item(item, parts, qs, qpos, group, ks, kss, vs, vss, start, end, 0, m, l, acc, scores,
                    next_keys, next_values, next_lo)
    decode_merge(n_kv, parts, group, m, l, acc, out)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _queries_setup(q, values, ends, items, scale):
    # the buffers of _decode_queries' items and every query's scaled rows (decode_begin)
    T, H = q.shape[0], q.shape[1]
    n_kv, hd = values.shape[0], values.shape[2]
    R = (H // n_kv + ROWS - 1) // ROWS * ROWS
    qs = np.zeros((T, n_kv, R, hd), np.float32)  # hd: the cache's, padded to 16 with zeros
    qpos = np.empty((T, R), np.int64)
    group = H // n_kv
    for t in range(T):
        decode_begin(q[t], scale, ends[t], qs[t], qpos[t])
    return (group, qs, qpos, np.empty((items, R), np.float32), np.empty((items, R), np.float32),
            np.empty((items, R, hd), np.float32), np.empty((items, R, CHUNK), np.float32))


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _query_item(i, item_query, offsets, splits, qs, qpos, group, keys, k_scale, values, v_scale, starts, ends,
                m, l, acc, scores):
    t = item_query[i]
    o = offsets[t]
    decode_item(i - o, splits[t], qs[t], qpos[t], group, keys, k_scale, values, v_scale, starts[t], ends[t], 0,
                m[o:], l[o:], acc[o:], scores[o:], keys, values, -1)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _queries_merge(n_kv, offsets, splits, group, m, l, acc, out):
    for t in range(out.shape[0]):  # the merges are small: on this thread, not a second parallel region
        o = offsets[t]
        decode_merge(n_kv, splits[t], group, m[o:], l[o:], acc[o:], out[t])
    return out


# query t of one sequence at position ends[t]-1, over starts[t] .. ends[t]-1, its span cut in
# splits[t] parts as a decode step of it cuts it; items offsets[t] .. offsets[t+1]-1 are its
# (kv head, part) pairs (item_query: each item's query). Every query's items in one call, each item
# and merge a decode step's; in parallel, or on the calling thread when there is too little work.
@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def _decode_queries(q, keys, k_scale, values, v_scale, starts, ends, splits, offsets, item_query, scale, out):
    items = item_query.shape[0]
    group, qs, qpos, m, l, acc, scores = _queries_setup(q, values, ends, items, scale)
    for i in numba.prange(items):
        _query_item(i, item_query, offsets, splits, qs, qpos, group, keys, k_scale, values, v_scale, starts, ends,
                    m, l, acc, scores)
    return _queries_merge(values.shape[0], offsets, splits, group, m, l, acc, out)


@numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def _decode_queries_serial(q, keys, k_scale, values, v_scale, starts, ends, splits, offsets, item_query, scale,
                           out):
    items = item_query.shape[0]
    group, qs, qpos, m, l, acc, scores = _queries_setup(q, values, ends, items, scale)
    for i in range(items):
        _query_item(i, item_query, offsets, splits, qs, qpos, group, keys, k_scale, values, v_scale, starts, ends,
                    m, l, acc, scores)
    return _queries_merge(values.shape[0], offsets, splits, group, m, l, acc, out)


@numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def decode_into(q, k, v, keys, k_scale, values, v_scale, start, end, window, scale, splits, out):
    """attend_decode's work (KV write + decode attention) for callers that are compiled themselves
    (nn/decode_kernels.py's decode_layers): `splits` from decode_plan, 0 = on the calling thread."""
    if splits:
        return _decode_parallel(q, k, v, keys, k_scale, values, v_scale, start, end, window, scale, splits, out)
    return _decode_serial(q, k, v, keys, k_scale, values, v_scale, start, end, window, scale, 1, out)

# --- public entry points -----------------------------------------------------------------

def decode_splits(n_kv: int, span: int, threads: int | None = None) -> int:
    """How many parts a decode step's span is cut into: enough (kv head, part) items that every
    `threads` (default numba.get_num_threads(): a caller making many calls a step asks once)
    gets the same number, never parts shorter than a softmax chunk."""
    threads = threads or numba.get_num_threads()
    return max(1, min(threads // math.gcd(n_kv, threads), span // CHUNK))


def decode_plan(q_size: int, n_kv: int, span: int, threads: int | None = None) -> int:
    """How a decode step over `span` positions runs: 0 on the calling thread (too little work to pay
    for waking the others), else the number of parts the span is cut into (decode_splits)."""
    return decode_splits(n_kv, span, threads) if q_size * span >= PARALLEL_MIN_WORK else 0


def batch_splits(q_size: int, n_kv: int, ends: np.ndarray, window: int, threads: int | None = None) -> np.ndarray:
    """int64 [B]: the parts each row of a batched decode step (positions ends-1) cuts its span into -
    those its decode step alone would (decode_plan; on the calling thread: one), as the merge of the
    parts rounds: each sequence gets the bits it gets alone, at any depth."""
    threads = threads or numba.get_num_threads()
    spans = np.minimum(ends, window) if window else ends
    return np.array([decode_plan(q_size, n_kv, int(span), threads) or 1 for span in spans], np.int64)


def attend_decode(q: np.ndarray, keys: np.ndarray, k_scale: np.ndarray, values: np.ndarray,
                  v_scale: np.ndarray, start: int, end: int, scale: float, out: np.ndarray,
                  window: int = 0, k: np.ndarray | None = None, v: np.ndarray | None = None) -> np.ndarray:
    """Decode attention, all heads in one call: out [H, hd] = softmax(q K^T * scale) V over the
    cached positions start .. end-1 (the query is position end-1; with `window`, positions
    further than window-1 back are left out as well).

    q [H, hd] float32 (H a multiple of Hkv: head h reads kv head h // (H / Hkv)); keys, k_scale,
    values, v_scale: one layer's cache arrays as KVCache.layer(i) returns them (layout and types
    in this module's docstring); out [H, hd] float32, returned. k, v [Hkv, hd] float32: the new
    position's key and value, written at end-1 in the same compiled call (KV write + attention in
    one); without them, position end-1 must already be written (write_kv / KVCache.update).
    """
    with PERF.trace(*DECODE_SPAN, *q.shape, values.shape[0], end - start,
                     q.shape[1], TYPE_NAMES[values.dtype.type], op="sdpa"):
        span = end - start
        shape = (1, values.shape[0], q.shape[1])
        k = _NOTHING if k is None else np.ascontiguousarray(k, np.float32).reshape(shape)
        v = _NOTHING if v is None else np.ascontiguousarray(v, np.float32).reshape(shape)
        splits = decode_plan(q.size, values.shape[0], span)
        if splits:
            return _decode_parallel(q, k, v, keys, k_scale, values, v_scale, start, end, window, np.float32(scale),
                                    splits, out)
        return _decode_serial(q, k, v, keys, k_scale, values, v_scale, start, end, window, np.float32(scale), 1,
                              out)


def attend_decode_batch(q: np.ndarray, k: np.ndarray, v: np.ndarray, layer_arrays: tuple, seqs: np.ndarray,
                        ends: np.ndarray, window: int, scale: float, out: np.ndarray) -> np.ndarray:
    """A batched decode step's KV write and attention, one row per sequence, in one call: row b's
    k, v [B, Hkv, hd] written at position ends[b]-1 of pool sequence seqs[b], then out[b] [H, hd] =
    softmax(q[b] K^T * scale) V over that sequence's positions (the last `window` with a window).
    layer_arrays: a KVPool's layer(i) ([n_seqs, ...] arrays); q, k, v, out float32, contiguous."""
    with PERF.trace(*BATCH_SPAN, q.shape[0], q.shape[1], q.shape[2], k.shape[1],
                    int(np.minimum(ends, window).sum() if window else ends.sum()), q.shape[2],
                    TYPE_NAMES[layer_arrays[2].dtype.type], op="sdpa"):
        splits = batch_splits(q[0].size, layer_arrays[2].shape[1], ends, window)
        return _decode_batch(q, k, v, *layer_arrays, seqs, ends, splits, window, np.float32(scale), out)


def attend_queries(q: np.ndarray, keys: np.ndarray, k_scale: np.ndarray, values: np.ndarray,
                   v_scale: np.ndarray, pos: int, window: int, scale: float, out: np.ndarray) -> np.ndarray:
    """A speculative verify pass's attention: q [T, H, hd], the queries of one sequence at positions
    pos .. pos+T-1 (their keys and values already written), out [T, H, hd] - in one call, each query
    with the bits a decode step of it alone gets (attend_decode, the fused step): its span cut in
    the parts decode_plan gives that span (0, on the calling thread, is one part: the same sums)."""
    T, n_kv = q.shape[0], values.shape[0]
    ends = np.arange(pos + 1, pos + T + 1, dtype=np.int64)
    starts = np.maximum(ends - window, 0) if window else np.zeros(T, np.int64)
    threads = numba.get_num_threads()
    plans = [decode_plan(q[0].size, n_kv, int(e - s), threads) for s, e in zip(starts, ends)]
    splits = np.array([plan or 1 for plan in plans], np.int64)
    offsets = np.zeros(T + 1, np.int64)
    np.cumsum(n_kv * splits, out=offsets[1:])
    item_query = np.repeat(np.arange(T, dtype=np.int64), n_kv * splits)
    span = int((ends - starts).sum())
    # in parallel where the longest query's decode step would be (one launch then; measured at depth
    # 160, 8 queries, loaded 2 cores: the parallel call 260 us, on this thread 84 us, 8 decode calls 98 us);
    # which kernel changes only where items run, not their sums: the bits are the same
    kernel = _decode_queries if plans[-1] else _decode_queries_serial
    with PERF.trace(*QUERIES_SPAN, T, q.shape[1], q.shape[2], n_kv, span, q.shape[2],
                    TYPE_NAMES[values.dtype.type], op="sdpa"):
        return kernel(q, keys, k_scale, values, v_scale, starts, ends, splits, offsets, item_query,
                      np.float32(scale), out)
