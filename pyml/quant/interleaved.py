"""The 8-row interleaved ("x8") layout: ggml's blocks re-laid 8 rows at a time, so each instruction serves 8 rows.

Why: in the file's layout a GEMV spends ~14 instructions on every 32-value block of a row
(unpack the codes, one maddubs, convert and broadcast the block's scale, and a horizontal sum
per row at the end); on this machine Q4_0 ran at 13-20 GB/s where the memory gives ~30, so the
4-bit types decoded no faster than Q8_0 with twice their bytes. With 8 rows interleaved, one
32-byte load holds 4 codes of each of 8 rows; a maddubs against the 4 matching activation bytes,
broadcast, leaves each row's partial sums in that row's own lanes; the 8 rows' scales convert as
one vector, and no horizontal sum is left: ~6 instructions per row and block. Measured on
SmolLM2's shapes: the Q4_0 GEMV 2.5-3.1x, the GEMM (T = 128) 2.2-2.6x, from the same integer
arithmetic. llama.cpp repacks Q4_0 in the same spirit for its AVX2 kernels (block_q4_0x8).

Layout of a matrix of R rows, nb blocks of 32 values per row, ts bytes per block in the file:

    groups  uint8 [R // 8, nb * 8 * ts]: group g holds rows 8g..8g+7; block b of the group is a
            superblock of 8 * ts bytes at b * 8 * ts:
                d[8]        fp16, the scales of the 8 rows                        16 bytes
                m[8]        fp16, the mins of the 8 rows (Q4_1, Q5_1)             16 bytes
                h[32]       Q5_0, Q5_1: the fifth bits, see below                 32 bytes
                codes       Q4/Q5: qs[4][8][4], chunk k = code bytes 4k..4k+3 of each row   128 bytes
                            Q8_0:  qs[8][8][4], chunk k = code bytes 4k..4k+3 of each row   256 bytes
            So code byte j of row r sits at 32 * (j // 4) + 4 * r + j % 4 of the codes; as in the
            file, a 4-bit code byte holds value j in its low nibble and value j + 16 in its high
            nibble. Code vector n (n = 0..7) is, for Q4/Q5, chunk n // 2's low (n even) or high
            (n odd) nibbles - values v(n, i) = 16 * (n % 2) + 4 * (n // 2) + i in lane 4r + i - and
            for Q8_0 chunk n. Q5: bit n of h's byte 4r + i is the fifth bit of value v(n, i) of row r.
    tail    uint8 [R % 8, nb * ts]: the last rows, in the file's layout (the file kernels).

Q4_K (256-value superblocks of 8 groups of 32, kquants.py) the same way, 8 rows x 256 values
in 1184 bytes instead of 8 x 144 = 1152: its 6-bit scales and mins are stored one per byte,
so a group's 8 rows load theirs as one 8-byte vector (kscales would unpack 8 rows separately):
                d[8], dmin[8]   fp16                                      32 bytes
                sc[8][8]        u8, group j's scales of the 8 rows at 8j  64 bytes
                mn[8][8]        u8, the mins the same way                 64 bytes
                codes[4][8][8][4]  chunk pair p = the file's 32 code bytes 32p..32p+31 of
                                each row, in 8 chunks of 4 bytes x 8 rows  1024 bytes
            The low nibbles of pair p are group 2p, the high nibbles group 2p + 1, value l of
            the group in byte l as in the file: y . w_r = d_r sc_rj d_y dot_rj - dmin_r mn_rj s_y.

The integer dot of a superblock with an activation block y (int8 [32], activation.py), lane r:
    dot_r = sum over n of sum_pairs(maddubs(code vector n, y's quad for it in every quad))
            Q4: the 8 maddubs add up in 16 bits first (|each| <= 2*15*127 = 3810, 8 <= 30480);
            Q5: 4 at a time (|each| <= 2*31*127 = 7874, 4 <= 31496 < 2^15);
            Q8_0: signed codes, each maddubs on |code| and y with the code's sign (ggml's trick),
            each widened to 32 bits (a single one reaches 2*127*127 = 32258).
    Q4_0, Q5_0, Q8_0  value = d (code - o), o = 8, 16, 0:  y . w_r = d_r d_y (dot_r - o sum(y))
    Q4_1, Q5_1        value = d code + m:    y . w_r = d_r d_y dot_r + m_r s_y   (s_y = d_y sum(y))

On VNNI the dots are vpdpbusd, one per code vector and token, in two chains of 4 per token (a
tile's 4 tokens then give the 8 independent chains the instruction's latency x 2 pipes needs). On
the avx512_vnni path the GEMM (T > 1) of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q4_K runs two groups side by side on
512-bit vectors (simd512.py: lanes 0-7 group g, 8-15 group g + 1, each half loaded from its own
group, the bytes unchanged): the same float ops per lane, so the same bits as the 256-bit loop, with
twice the work per scheduler entry (1 thread, T = 128, SmolLM2's shapes: Q8_0 48-50% -> 63-65% of
the vpdpbusd peak; Gemma 3's Q5_0 shapes 46-49% -> 52-55%; docs/performance.md).
Without VNNI (AVX2, portable) the GEMM of every type runs three groups at a time, each
activation quad broadcast once for 24 rows and the codes recentred as vpmaddubsw's signed operand
(section "T > 1 without VNNI"): the same integers and float ops, so the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, NamedTuple

import numba
import numpy as np
from numba import prange

from pyml.core import derived
from pyml.core.mapping import release_pages
from pyml.core.isa import ZMM
from pyml.quant.activation import quantize_row_q8, quantize_rows_q8, quantize_rows_u8, quantize_rows_u8_sums
from pyml.quant.ggml_types import BLOCK_SIZE, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0, TYPE_SIZE
from pyml.quant.simd import (FASTMATH, HAVE_VNNI, abs_u8, add_i16, add_i32, as_i8, bit_to_u8, dpbusd, f32x8, fma,
                             fnma, i16_halves, load_f32x8, load_fp16x8c, load_i8x4_bcast, load_i8x32, load_i16x16,
                             load_i32_bcast, load_i32x8, load_u8x4_bcast, load_u8x8_f32, load_u8x32, madd, maddubs,
                             minus_i8, mul, nibbles_hi, nibbles_lo, or_u8, prefetch, sar_i8, sign_i8, splat_u8,
                             store_f32x8, store_i8x32, store_i16x16, store_i32x8, store_u8x32, sub_i16, sub_i32,
                             sub_lanes_i32, sum_pairs, to_f32, zeros_f32x8, zeros_i32x8)
from pyml.quant.simd512 import (add_i32x16, as_i8x64, dpbusd16, f32x16, fma16, fnma16, load_fp16x8c_pair,
                                load_i8x4_bcast16, load_i32_bcast16, load_i32x8_pair, load_u8x4_bcast16,
                                load_u8x8_f32_pair, load_u8x32_pair, load_f32x16, load_u8x64, mul16, nibbles_hi64, nibbles_lo64, or_u8x64,
                                store_f32x16, store_u8x64, sub_i32x16, to_f32x16, zeros_f32x16, zeros_i32x16)

FIELDS = {Q4_0: 1, Q4_1: 2, Q5_0: 1, Q5_1: 2, Q8_0: 1}  # fp16 fields first: d (, m)
Q4_K_SUPERBLOCK = 1184  # bytes of 8 rows x 256 values: scales and mins one per byte (module doc)
# The layout's version: a packed-weights cache made under another one is re-packed. Bump it with
# any change to the bytes pack() writes.
LAYOUT_VERSION = 1


def superblock_bytes(kind: int) -> int:
    """Bytes of 8 rows x one block in this layout."""
    return Q4_K_SUPERBLOCK if kind == Q4_K else 8 * TYPE_SIZE[kind]


@dataclass(frozen=True, eq=False)
class Packed:
    """A quantized matrix in the 8-row interleaved layout; see the module doc. Made by pack(), read by
    pyml.quant."""

    kind: int             # GGML type id
    n_cols: int
    rows: int
    groups: np.ndarray    # uint8 [rows // 8, nb * 8 * type_size], read-only
    tail: np.ndarray      # uint8 [rows % 8, nb * type_size], read-only

    @property
    def nbytes(self) -> int:
        return self.groups.nbytes + self.tail.nbytes

    def unpack(self) -> np.ndarray:
        """The matrix in the file's layout, uint8 [rows, nb * type_size] (a copy: the exact path, tests)."""
        kind, G = self.kind, self.groups.shape[0]
        nb, ts, sb = self.n_cols // BLOCK_SIZE[kind], TYPE_SIZE[kind], superblock_bytes(kind)
        out = np.empty((self.rows, nb * ts), np.uint8)
        relay = _relay_q4k if kind == Q4_K else _relay
        relay(kind, out[:8 * G].reshape(G, 8, nb, ts), self.groups.reshape(G, nb, sb), to_x8=False)
        out[8 * G:] = self.tail
        return out


def pack(raw: np.ndarray, kind: int, n_cols: int, key: str | None = None) -> Packed:
    """raw uint8 [rows, nb * type_size] in the file's layout -> the x8 layout.

    Copied a slab of rows at a time, each slab's pages of a file-mapped `raw` given back as soon as
    it is copied (raw stays valid: a later read pages it in again), so a load never holds the
    file's pages and the copy of a whole tensor at once. The arrays are derived ones
    (core/derived.py) under `key`: a packed-weights cache fills them straight into its file, or
    hands back the ones it holds without reading `raw` at all."""
    G, rows = raw.shape[0] // 8, raw.shape[0]
    nb, ts, sb = n_cols // BLOCK_SIZE[kind], TYPE_SIZE[kind], superblock_bytes(kind)
    relay = _relay_q4k if kind == Q4_K else _relay

    def fill_groups(groups):
        for g0 in range(0, G, _SLAB_GROUPS):
            g1 = min(G, g0 + _SLAB_GROUPS)
            src = raw[8 * g0:8 * g1]
            relay(kind, src.reshape(g1 - g0, 8, nb, ts), groups[g0:g1].reshape(g1 - g0, nb, sb), to_x8=True)
            release_pages(src)

    def fill_tail(tail):
        tail[...] = raw[8 * G:]

    groups = derived.array(key and f"{key}.x8", (G, nb * sb), np.uint8, fill_groups)
    tail = derived.array(key and f"{key}.x8_tail", (rows - 8 * G, nb * ts), np.uint8, fill_tail)
    return Packed(kind, n_cols, rows, groups, tail)


def packed_from_cache(key: str, kind: int, rows: int, n_cols: int) -> Packed | None:
    """The Packed matrix `pack(..., key=key)` made, if the derived-array provider holds it: a
    caller can then skip making the matrix it would have packed (a fusion's concatenation)."""
    G, nb = rows // 8, n_cols // BLOCK_SIZE[kind]
    groups = derived.lookup(f"{key}.x8", (G, nb * superblock_bytes(kind)), np.uint8)
    tail = derived.lookup(f"{key}.x8_tail", (rows - 8 * G, nb * TYPE_SIZE[kind]), np.uint8)
    if groups is None or tail is None:
        return None
    return Packed(kind, n_cols, rows, groups, tail)


_SLAB_GROUPS = 1024  # 8192 rows: a few MB in flight


def _relay(kind: int, blocks: np.ndarray, sb: np.ndarray, to_x8: bool) -> None:
    """Copy between the file's blocks [g, r, b, byte] and the superblocks [g, b, byte] of the same
    groups, either way. Every view below only splits or permutes axes, so numpy copies element by
    element with no temporary (the fifth bits of Q5 excepted: 8 bytes per bit while regrouped)."""
    G, _, nb, ts = blocks.shape
    f = 2 * FIELDS[kind]
    for i in range(0, f, 2):  # fp16 fields: [g, b, (r, 2)] <-> [g, r, b, 2]
        _copy(sb[..., 8 * i:8 * i + 16].reshape(G, nb, 8, 2).transpose(0, 2, 1, 3), blocks[..., i:i + 2], to_x8)
    at = 8 * f
    if kind in (Q5_0, Q5_1):
        if to_x8:
            bits = np.unpackbits(blocks[..., f:f + 4], axis=-1, bitorder="little")   # [g, r, b, value]
            h = bits.transpose(0, 2, 1, 3)[..., _H_VALUES]                            # [g, b, r, i, n]
            sb[..., at:at + 32] = np.packbits(h, axis=-1, bitorder="little").reshape(G, nb, 32)
        else:
            h = np.unpackbits(sb[..., at:at + 32].reshape(G, nb, 8, 4, 1), axis=-1, bitorder="little")
            bits = np.empty((G, nb, 8, 32), np.uint8)
            bits[..., _H_VALUES] = h
            blocks[..., f:f + 4] = np.packbits(bits, axis=-1, bitorder="little").transpose(0, 2, 1, 3)
        f, at = f + 4, at + 32
    n = (ts - f) // 4  # code chunks: [g, b, (k, r, 4)] <-> [g, r, b, (k, 4)]
    _copy(sb[..., at:].reshape(G, nb, n, 8, 4).transpose(0, 3, 1, 2, 4), blocks[..., f:].reshape(G, 8, nb, n, 4),
          to_x8)


def _copy(x8_view: np.ndarray, file_view: np.ndarray, to_x8: bool) -> None:
    if to_x8:
        x8_view[...] = file_view
    else:
        file_view[...] = x8_view


def _relay_q4k(kind: int, blocks: np.ndarray, sb: np.ndarray, to_x8: bool) -> None:
    """_relay for Q4_K: blocks [g, r, b, 144] <-> superblocks [g, b, 1184] (module doc)."""
    G, _, nb, _ = blocks.shape
    for i in (0, 2):  # d, dmin: [g, b, (r, 2)] <-> [g, r, b, 2]
        _copy(sb[..., 8 * i:8 * i + 16].reshape(G, nb, 8, 2).transpose(0, 2, 1, 3), blocks[..., i:i + 2], to_x8)
    # scales and mins: [g, b, (j, r)] <-> the 12 packed bytes of [g, r, b]
    sc, mn = sb[..., 32:96].reshape(G, nb, 8, 8), sb[..., 96:160].reshape(G, nb, 8, 8)
    packed = blocks[..., 4:16]
    if to_x8:
        lo, mid, hi = (packed[..., k:k + 4].transpose(0, 2, 3, 1) for k in (0, 4, 8))  # [g, b, j, r]
        sc[:, :, :4], mn[:, :, :4] = lo & 63, mid & 63
        sc[:, :, 4:], mn[:, :, 4:] = (hi & 15) | (lo >> 6) << 4, (hi >> 4) | (mid >> 6) << 4
    else:
        s, m = sc.transpose(0, 3, 1, 2), mn.transpose(0, 3, 1, 2)  # [g, r, b, j]
        packed[..., 0:4] = s[..., :4] | (s[..., 4:] >> 4) << 6
        packed[..., 4:8] = m[..., :4] | (m[..., 4:] >> 4) << 6
        packed[..., 8:12] = (s[..., 4:] & 15) | (m[..., 4:] & 15) << 4
    # codes: [g, b, (p, k, r, 4)] <-> [g, r, b, (p, k, 4)]
    _copy(sb[..., 160:].reshape(G, nb, 4, 8, 8, 4).transpose(0, 4, 1, 2, 3, 5),
          blocks[..., 16:].reshape(G, 8, nb, 4, 8, 4), to_x8)


# value of code vector n's lane 4r + i: 16 * (n % 2) + 4 * (n // 2) + i, as an [i, n] table
_H_VALUES = np.array([[16 * (n % 2) + 4 * (n // 2) + i for n in range(8)] for i in range(4)])


# --- one superblock ----------------------------------------------------------------------

@numba.njit
def _sb_size(kind):
    numba.literally(kind)
    if kind == Q4_K:
        return Q4_K_SUPERBLOCK
    return 8 * TYPE_SIZE[kind]


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
def _block(kind, v, corr, w, o, y, b, yd, yoff, ys, acc):
    """acc + the 8 rows' dot with activation block b (y int8, scale yd, float sum ys; yoff int32
    [nb]: the code offset o (module doc) x each block's code sum, loaded as a broadcast memory operand)."""
    numba.literally(kind)
    scale = mul(load_fp16x8c(w, o), f32x8(yd))
    i = _dot(kind, v, y, 32 * b, corr)
    if kind == Q4_0 or kind == Q5_0:
        i = sub_lanes_i32(i, load_i32_bcast(yoff, b))
    acc = fma(scale, to_f32(i), acc)
    if kind == Q4_1 or kind == Q5_1:
        acc = fma(load_fp16x8c(w, o + 16), f32x8(ys), acc)
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
def _k_block(v, w, o, j, y, u, yd, ys, acc):
    """Q4_K: acc + the 8 rows' group j of the superblock at o, dotted with activation block u."""
    scale = mul(mul(load_fp16x8c(w, o), load_u8x8_f32(w, o + 32 + 8 * j)), f32x8(yd))
    acc = fma(scale, to_f32(_dot(Q4_0, v, y, 32 * u, zeros_i32x8())), acc)  # 4-bit codes, no offset: Q4_0's dot
    return fnma(mul(load_fp16x8c(w, o + 16), load_u8x8_f32(w, o + 96 + 8 * j)), f32x8(ys), acc)


@numba.njit
def _offset_sums(kind, xq, out):  # xq [nb*32] int8 -> out int32 [nb]: code offset o (module doc) x block code sums
    numba.literally(kind)
    offset = 8 if kind == Q4_0 else 16 if kind == Q5_0 else 0
    for b in range(out.size):
        acc = 0
        for j in range(32):
            acc += xq[32 * b + j]
        out[b] = offset * acc


# --- T == 1 --------------------------------------------------------------------------------

@numba.njit
def _gemv_group(kind, w, xq, xd, xs, xoff):  # F32x8: group w [nb * 8 * ts] . x, lane r = row r
    numba.literally(kind)
    sb = _sb_size(kind)
    acc = zeros_f32x8()
    for b in range(xd.size):
        o = sb * b
        prefetch(w, o + 1024)  # the streams of both threads stay ahead of their loads
        prefetch(w, o + 1088)
        v = _codes(kind, w, o)
        acc = _block(kind, v, _corrections(kind, v), w, o, xq, b, xd[b], xoff, xs[b], acc)
    return acc


@numba.njit
def _gemv_group_k(w, xq, xd, xs):  # Q4_K: F32x8, group w [nsb * 1184] . x, lane r = row r
    acc = zeros_f32x8()
    for s in range(xd.size // 8):
        o = Q4_K_SUPERBLOCK * s
        for p in range(4):
            c, u = o + 160 + 256 * p, 8 * s + 2 * p
            prefetch(w, c + 1024)
            prefetch(w, c + 1088)
            prefetch(w, c + 1152)
            prefetch(w, c + 1216)
            acc = _k_block(_k_codes(w, c, 0), w, o, 2 * p, xq, u, xd[u], xs[u], acc)
            acc = _k_block(_k_codes(w, c, 1), w, o, 2 * p + 1, xq, u + 1, xd[u + 1], xs[u + 1], acc)
    return acc


# The GEMV in two steps, so that compiled code which shares out a matrix's groups between threads
# itself (nn/fused.py's one-region decode step) quantizes the activation once, into buffers it
# keeps, and calls the same group kernel the GEMV's prange does.

@numba.njit(cache=True)
def gemv_buffers(n):
    """(xq, xd, xs, xp, xoff, y8): what gemv_activation fills for an activation of n values."""
    return (np.empty(n, np.int8), np.empty(n // 32, np.float32), np.empty(n // 32, np.float32),
            np.empty(n // 2, np.int16), np.empty(n // 32, np.int32), np.empty(n, np.uint8))


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
    """x [n] f32 quantized into the gemv_buffers (activation.py's blocks, the code offsets'
    sums); returns activation_bytes."""
    numba.literally(kind)
    quantize_row_q8(x, xq, xd, xs, xp)
    _offset_sums(kind, xq, xoff)
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


# --- T > 1 ---------------------------------------------------------------------------------

# The GEMM unpacks each row group's codes (nibbles, Q5's fifth bits) once per call into a scratch
# of nb x 8 code vectors, and its token tiles load them from there: unpacked per tile of 4 tokens,
# Q5_0's ~28 unpacking ops on 16 rows ran beside its 32 vpdpbusd in the same pipes. The scratch is
# 256 bytes per block and 8 rows (Gemma 3's K = 640: 5 KB; 16 rows on 512-bit vectors 10 KB), so it
# stays in L1/L2. Q4_K's float scales (d x sc, dmin x mn) are made once per call the same way.
# The same integers and float ops, so the same bits. kernel_bench, 1 thread, CPU time, T = 512, old
# and new builds alternating (docs/performance.md): Q5_0 54-55% -> 64-70% of the vpdpbusd peak,
# Q5_1 49-55% -> 56-66%, Q4_K 45-56% -> 52-63%; Q4_0, Q4_1 and Q8_0 within the noise (57-73%).

@numba.njit
def _staged_codes(kind, w, nb):
    """uint8 [nb * 256]: _codes of the group's nb superblocks (Q4_K: _k_codes of its nb groups of 32), block b at 256 b."""
    numba.literally(kind)
    st = np.empty(256 * nb, np.uint8)
    for b in range(nb):
        v = _block_codes(kind, w, b)
        for n in range(8):
            store_u8x32(st, 256 * b + 32 * n, v[n])
    return st


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
def _staged(st, b):  # the 8 code vectors of block b of _staged_codes
    c = 256 * b
    return (load_u8x32(st, c), load_u8x32(st, c + 32), load_u8x32(st, c + 64), load_u8x32(st, c + 96),
            load_u8x32(st, c + 128), load_u8x32(st, c + 160), load_u8x32(st, c + 192), load_u8x32(st, c + 224))


@numba.njit
def _table_row(kind, table, b):  # I32x8: row b of a _correction_table (zeros where it is empty)
    numba.literally(kind)
    if kind == Q8_0 and HAVE_VNNI:
        return load_i32x8(table, 8 * b)
    return zeros_i32x8()


@numba.njit
def _gemm_group(kind, w, xq, xd, xs, xoff, out, g):
    """Rows 8g..8g+7 of out [T, R]: the codes unpacked once (_staged_codes), then 4 activation rows at a time."""
    numba.literally(kind)
    sb = _sb_size(kind)
    T, nb = xd.shape
    table = _correction_table(kind, w, nb)
    st = _staged_codes(kind, w, nb)
    for t in range(0, T - 3, 4):
        y0, y1, y2, y3 = xq[t], xq[t + 1], xq[t + 2], xq[t + 3]
        f0, f1, f2, f3 = xoff[t], xoff[t + 1], xoff[t + 2], xoff[t + 3]
        a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
        for b in range(nb):
            o = sb * b
            v = _staged(st, b)
            corr = _table_row(kind, table, b)
            a0 = _block(kind, v, corr, w, o, y0, b, xd[t, b], f0, xs[t, b], a0)
            a1 = _block(kind, v, corr, w, o, y1, b, xd[t + 1, b], f1, xs[t + 1, b], a1)
            a2 = _block(kind, v, corr, w, o, y2, b, xd[t + 2, b], f2, xs[t + 2, b], a2)
            a3 = _block(kind, v, corr, w, o, y3, b, xd[t + 3, b], f3, xs[t + 3, b], a3)
        store_f32x8(out[t], 8 * g, a0)
        store_f32x8(out[t + 1], 8 * g, a1)
        store_f32x8(out[t + 2], 8 * g, a2)
        store_f32x8(out[t + 3], 8 * g, a3)
    for t in range(T - T % 4, T):
        acc = zeros_f32x8()
        for b in range(nb):
            o = sb * b
            acc = _block(kind, _staged(st, b), _table_row(kind, table, b), w, o, xq[t], b, xd[t, b], xoff[t],
                         xs[t, b], acc)
        store_f32x8(out[t], 8 * g, acc)


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
def _k_scales(w, u):
    """Q4_K: (d x sc, dmin x mn) of the 8 rows for group u of 32 values, F32x8 each."""
    o, j = Q4_K_SUPERBLOCK * (u // 8), u % 8
    return (mul(load_fp16x8c(w, o), load_u8x8_f32(w, o + 32 + 8 * j)),
            mul(load_fp16x8c(w, o + 16), load_u8x8_f32(w, o + 96 + 8 * j)))


@numba.njit
def _k_block_s(v, sc, u, y, yd, ys, acc):
    """_k_block, its scales from _staged_scales_k (the same float ops)."""
    acc = fma(mul(load_f32x8(sc, 16 * u), f32x8(yd)), to_f32(_dot(Q4_0, v, y, 32 * u, zeros_i32x8())), acc)
    return fnma(load_f32x8(sc, 16 * u + 8), f32x8(ys), acc)


@numba.njit
def _gemm_group_k(w, xq, xd, xs, out, g):  # Q4_K: _gemm_group for the superblocks of module doc
    T, n = xd.shape
    st, sc = _staged_codes(Q4_K, w, n), _staged_scales_k(w, n)
    for t in range(0, T - 3, 4):
        y0, y1, y2, y3 = xq[t], xq[t + 1], xq[t + 2], xq[t + 3]
        a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
        for u in range(n):
            v = _staged(st, u)
            a0 = _k_block_s(v, sc, u, y0, xd[t, u], xs[t, u], a0)
            a1 = _k_block_s(v, sc, u, y1, xd[t + 1, u], xs[t + 1, u], a1)
            a2 = _k_block_s(v, sc, u, y2, xd[t + 2, u], xs[t + 2, u], a2)
            a3 = _k_block_s(v, sc, u, y3, xd[t + 3, u], xs[t + 3, u], a3)
        store_f32x8(out[t], 8 * g, a0)
        store_f32x8(out[t + 1], 8 * g, a1)
        store_f32x8(out[t + 2], 8 * g, a2)
        store_f32x8(out[t + 3], 8 * g, a3)
    for t in range(T - T % 4, T):
        store_f32x8(out[t], 8 * g, _gemv_group_k(w, xq[t], xd[t], xs[t]))


# --- T > 1 without VNNI: three groups share each activation quad ----------------------------------
#
# _gemm_group spends a vpbroadcastd on every vpmaddubsw: its 8 code vectors stay in registers
# across a tile of 4 tokens, and each token's quads are broadcast against them. Compiled for AVX2
# alone (16 registers) it issued ~165 instructions per 32 vpmaddubsw and ran at 50-53% of the
# instruction's peak. Here the roles turn round: the activation, offset by 128, is vpmaddubsw's
# unsigned operand (a quad broadcast once per token and block, into a register), and the codes
# are its signed operand, loaded straight from a staging buffer as the instruction's memory
# operand; so one broadcast serves three groups (24 rows), and the loop issues ~88 instructions
# per 24 vpmaddubsw.
#
# The codes go in recentred, c - o_s (o_s = 8 for the 4-bit codes of Q4_0, 16 for Q5_0 and
# Q5_1, 0 for Q4_1 and Q4_K), and each 16-bit lane starts from -128 x the sum of its 16 codes
# (made once per call, like the codes): sum (y + 128)(c - o_s) - 128 sum (c - o_s) = sum y (c - o_s).
# Each vpmaddubsw pair sum stays within 2 x 255 x 16 = 8160, so none saturates; the 16-bit adds
# wrap, but modulo 2^16, and the lane's final value is within |16 x 127 x 16| = 32512 (Q4_1's
# o_s = 0: 16 x 127 x 15 = 30480), so it comes out exact. The integers are those of _dot less
# the code offset (Q5_1, whose values carry no offset: plus 16 sum y), and the float ops are
# _block's and _k_block_s's (Q4_K's last T % 4 tokens: its GEMV's, as on the other paths): the
# same bits as every other path (tests/core/test_isa.py).
#
# Memory: the staging holds, per block and group, 256 bytes of codes, 32 of lane corrections and
# 64 of scales; the tokens pass over CHUNK blocks at a time (3 x 16 x 352 bytes = 16.5 KB, L1),
# the output rows holding the partial sums between chunks. kernel_bench, 1 thread, T = 512,
# compiled as for AVX2 alone (PYML_ISA=avx2), share of the vpmaddubsw peak, old and new builds
# alternating: Q4_0 46-48% -> 60-65%, Q5_0 46-50% -> 59-65%, Q4_1 47-52% -> 53-59%, Q4_K 49-51%
# -> 53-59%, Q5_1 47-51% -> 48-55% (the mins' FMA per block weighs on the last three;
# docs/performance.md).
#
# Q8_0's signed codes against a 0-255 activation would saturate a pair sum (2 x 255 x 127), so
# they go in as two planes, c = 16 h + l with h = c >> 4 (-8..7) and l = c & 15: two vpmaddubsw
# per 32 values where the sign trick (_q8: vpsignb on the activation for each code vector) spent
# the same pipes on a vpsignb, a vpabsb and a vpmaddwd per multiply and a broadcast per token.
# Each plane's lanes start from their corrections as above and end at sum y h (within 16 x 127
# x 8 = 16256) and sum y l (16 x 127 x 15 = 30480); the row's dot is 16 x the first's pair sums
# plus the second's, exact, so the bits are again those of every path.

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
    # Q4_K's last T % 4 tokens go through its GEMV, as in _gemm_group_k and _gemm_pair_k: that
    # kernel's float ops round differently from _k_block_s's, and every path gives the same bits.
    tiled = T - T % 4 if kind == Q4_K else T
    rec, chunk = _record(kind), _chunk(kind)
    buf = np.empty(3 * rec * nb, np.uint8)
    _stage_signed(kind, w0, nb, buf, 0)
    _stage_signed(kind, w1, nb, buf, 1)
    _stage_signed(kind, w2, nb, buf, 2)
    for t in range(tiled, T):
        xq = (y8[t] ^ np.uint8(128)).view(np.int8)  # the GEMV's activation: the codes themselves
        store_f32x8(out[t], 8 * g, _gemv_group_k(w0, xq, xd[t], xs[t]))
        if n > 1:
            store_f32x8(out[t], 8 * g + 8, _gemv_group_k(w1, xq, xd[t], xs[t]))
        if n > 2:
            store_f32x8(out[t], 8 * g + 16, _gemv_group_k(w2, xq, xd[t], xs[t]))
    for b0 in range(0, nb, chunk):
        for t in range(tiled):
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


# --- T > 1 on 512-bit vectors: two groups, 16 rows per instruction (simd512.py) --------------------

ZMM_KINDS = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K)  # the types whose GEMM runs on 512-bit vectors (avx512_vnni)


@numba.njit
def _codes16(kind, w0, w1, o):
    """_codes of superblock o of two groups: lanes 0-31 of each vector group w0's, 32-63 group w1's."""
    numba.literally(kind)
    if kind == Q8_0:
        c = o + 16
        return (load_u8x32_pair(w0, w1, c), load_u8x32_pair(w0, w1, c + 32), load_u8x32_pair(w0, w1, c + 64),
                load_u8x32_pair(w0, w1, c + 96), load_u8x32_pair(w0, w1, c + 128), load_u8x32_pair(w0, w1, c + 160),
                load_u8x32_pair(w0, w1, c + 192), load_u8x32_pair(w0, w1, c + 224))
    c = o + (32 if kind == Q4_1 else 48 if kind == Q5_0 else 64 if kind == Q5_1 else 16)
    v0, v1 = load_u8x32_pair(w0, w1, c), load_u8x32_pair(w0, w1, c + 32)
    v2, v3 = load_u8x32_pair(w0, w1, c + 64), load_u8x32_pair(w0, w1, c + 96)
    n = (nibbles_lo64(v0), nibbles_hi64(v0), nibbles_lo64(v1), nibbles_hi64(v1),
         nibbles_lo64(v2), nibbles_hi64(v2), nibbles_lo64(v3), nibbles_hi64(v3))
    if kind == Q4_0 or kind == Q4_1:
        return n
    h = load_u8x32_pair(w0, w1, c - 32)  # Q5: the fifth bits, as _codes
    return (or_u8x64(n[0], bit_to_u8(h, 0, 16)), or_u8x64(n[1], bit_to_u8(h, 1, 16)),
            or_u8x64(n[2], bit_to_u8(h, 2, 16)), or_u8x64(n[3], bit_to_u8(h, 3, 16)),
            or_u8x64(n[4], bit_to_u8(h, 4, 16)), or_u8x64(n[5], bit_to_u8(h, 5, 16)),
            or_u8x64(n[6], bit_to_u8(h, 6, 16)), or_u8x64(n[7], bit_to_u8(h, 7, 16)))


@numba.njit
def _dot16(kind, v, y, yo):
    """_dot_vnni on 16 rows: I32x16, lane r = row r's integer dot (Q8_0: before its correction)."""
    numba.literally(kind)
    acc, acc2 = zeros_i32x16(), zeros_i32x16()
    if kind == Q8_0:
        for n in range(0, 8, 2):
            acc = dpbusd16(acc, load_u8x4_bcast16(y, yo + 4 * n), as_i8x64(v[n]))
            acc2 = dpbusd16(acc2, load_u8x4_bcast16(y, yo + 4 * n + 4), as_i8x64(v[n + 1]))
    else:
        for n in range(0, 8, 2):
            acc = dpbusd16(acc, v[n], load_i8x4_bcast16(y, yo + 2 * n))
            acc2 = dpbusd16(acc2, v[n + 1], load_i8x4_bcast16(y, yo + 16 + 2 * n))
    return add_i32x16(acc, acc2)


@numba.njit
def _block16(kind, v, corr, w0, w1, o, y, b, yd, yoff, ys, acc):
    """_block on 16 rows (corr: the two groups' _corrections side by side, Q8_0)."""
    numba.literally(kind)
    scale = mul16(load_fp16x8c_pair(w0, w1, o), f32x16(yd))
    i = _dot16(kind, v, y, 32 * b)
    if kind == Q8_0:
        i = sub_i32x16(i, corr)
    elif kind == Q4_0 or kind == Q5_0:
        i = sub_i32x16(i, load_i32_bcast16(yoff, b))
    acc = fma16(scale, to_f32x16(i), acc)
    if kind == Q4_1 or kind == Q5_1:
        acc = fma16(load_fp16x8c_pair(w0, w1, o + 16), f32x16(ys), acc)
    return acc


@numba.njit
def _staged_codes16(kind, w0, w1, nb):
    """_staged_codes of two groups on 512-bit vectors: uint8 [nb * 512], block b at 512 b."""
    numba.literally(kind)
    st = np.empty(512 * nb, np.uint8)
    for b in range(nb):
        if kind == Q4_K:
            s, j = b // 8, b % 8
            c = Q4_K_SUPERBLOCK * s + 160 + 256 * (j // 2)
            v = _k_codes16(w0, w1, c, 0) if j % 2 == 0 else _k_codes16(w0, w1, c, 1)
        else:
            v = _codes16(kind, w0, w1, _sb_size(kind) * b)
        for n in range(8):
            store_u8x64(st, 512 * b + 64 * n, v[n])
    return st


@numba.njit
def _staged16(st, b):  # the 8 code vectors of block b of _staged_codes16
    c = 512 * b
    return (load_u8x64(st, c), load_u8x64(st, c + 64), load_u8x64(st, c + 128), load_u8x64(st, c + 192),
            load_u8x64(st, c + 256), load_u8x64(st, c + 320), load_u8x64(st, c + 384), load_u8x64(st, c + 448))


@numba.njit
def _pair_corrections(kind, t0, t1, b):  # I32x16: rows b of two _correction_tables (zeros where empty)
    numba.literally(kind)
    if kind == Q8_0:
        return load_i32x8_pair(t0, t1, 8 * b)
    return zeros_i32x16()


@numba.njit
def _gemm_pair(kind, w0, w1, xq, xd, xs, xoff, out, g):
    """Rows 8g..8g+15 of out [T, R] from groups g (w0) and g + 1 (w1): _gemm_group on 16 rows."""
    numba.literally(kind)
    sb = _sb_size(kind)
    T, nb = xd.shape
    t0, t1 = _correction_table(kind, w0, nb), _correction_table(kind, w1, nb)
    st = _staged_codes16(kind, w0, w1, nb)
    for t in range(0, T - 3, 4):
        y0, y1, y2, y3 = xq[t], xq[t + 1], xq[t + 2], xq[t + 3]
        f0, f1, f2, f3 = xoff[t], xoff[t + 1], xoff[t + 2], xoff[t + 3]
        a0, a1, a2, a3 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
        for b in range(nb):
            o = sb * b
            v = _staged16(st, b)
            corr = _pair_corrections(kind, t0, t1, b)
            a0 = _block16(kind, v, corr, w0, w1, o, y0, b, xd[t, b], f0, xs[t, b], a0)
            a1 = _block16(kind, v, corr, w0, w1, o, y1, b, xd[t + 1, b], f1, xs[t + 1, b], a1)
            a2 = _block16(kind, v, corr, w0, w1, o, y2, b, xd[t + 2, b], f2, xs[t + 2, b], a2)
            a3 = _block16(kind, v, corr, w0, w1, o, y3, b, xd[t + 3, b], f3, xs[t + 3, b], a3)
        store_f32x16(out[t], 8 * g, a0)
        store_f32x16(out[t + 1], 8 * g, a1)
        store_f32x16(out[t + 2], 8 * g, a2)
        store_f32x16(out[t + 3], 8 * g, a3)
    for t in range(T - T % 4, T):
        acc = zeros_f32x16()
        for b in range(nb):
            o = sb * b
            acc = _block16(kind, _staged16(st, b), _pair_corrections(kind, t0, t1, b), w0, w1, o, xq[t], b,
                           xd[t, b], xoff[t], xs[t, b], acc)
        store_f32x16(out[t], 8 * g, acc)


@numba.njit
def _k_codes16(w0, w1, c, half):
    """_k_codes of two groups (16 rows)."""
    numba.literally(half)
    v0, v1 = load_u8x32_pair(w0, w1, c), load_u8x32_pair(w0, w1, c + 128)
    v2, v3 = load_u8x32_pair(w0, w1, c + 32), load_u8x32_pair(w0, w1, c + 160)
    v4, v5 = load_u8x32_pair(w0, w1, c + 64), load_u8x32_pair(w0, w1, c + 192)
    v6, v7 = load_u8x32_pair(w0, w1, c + 96), load_u8x32_pair(w0, w1, c + 224)
    if half == 0:
        return (nibbles_lo64(v0), nibbles_lo64(v1), nibbles_lo64(v2), nibbles_lo64(v3),
                nibbles_lo64(v4), nibbles_lo64(v5), nibbles_lo64(v6), nibbles_lo64(v7))
    return (nibbles_hi64(v0), nibbles_hi64(v1), nibbles_hi64(v2), nibbles_hi64(v3),
            nibbles_hi64(v4), nibbles_hi64(v5), nibbles_hi64(v6), nibbles_hi64(v7))


@numba.njit
def _staged_scales16_k(w0, w1, n):
    """Q4_K, two groups: float32 [n * 32], group u of 32 values at 32 u: d x sc of the 16 rows, then
    dmin x mn. Made once per call, as the codes: _k_block16 converted and multiplied them per token tile."""
    sc = np.empty(32 * n, np.float32)
    for u in range(n):
        o, j = Q4_K_SUPERBLOCK * (u // 8), u % 8
        store_f32x16(sc, 32 * u, mul16(load_fp16x8c_pair(w0, w1, o), load_u8x8_f32_pair(w0, w1, o + 32 + 8 * j)))
        store_f32x16(sc, 32 * u + 16, mul16(load_fp16x8c_pair(w0, w1, o + 16),
                                            load_u8x8_f32_pair(w0, w1, o + 96 + 8 * j)))
    return sc


@numba.njit
def _k_block16s(v, sc, u, y, yd, ys, acc):
    """_k_block_s on 16 rows."""
    acc = fma16(mul16(load_f32x16(sc, 32 * u), f32x16(yd)), to_f32x16(_dot16(Q4_0, v, y, 32 * u)), acc)
    return fnma16(load_f32x16(sc, 32 * u + 16), f32x16(ys), acc)


@numba.njit
def _gemm_pair_k(w0, w1, xq, xd, xs, out, g):
    """Q4_K: rows 8g..8g+15 of out [T, R] from groups g (w0) and g + 1 (w1)."""
    T, n = xd.shape
    st, sc = _staged_codes16(Q4_K, w0, w1, n), _staged_scales16_k(w0, w1, n)
    for t in range(0, T - 3, 4):
        y0, y1, y2, y3 = xq[t], xq[t + 1], xq[t + 2], xq[t + 3]
        a0, a1, a2, a3 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
        for u in range(n):
            v = _staged16(st, u)
            a0 = _k_block16s(v, sc, u, y0, xd[t, u], xs[t, u], a0)
            a1 = _k_block16s(v, sc, u, y1, xd[t + 1, u], xs[t + 1, u], a1)
            a2 = _k_block16s(v, sc, u, y2, xd[t + 2, u], xs[t + 2, u], a2)
            a3 = _k_block16s(v, sc, u, y3, xd[t + 3, u], xs[t + 3, u], a3)
        store_f32x16(out[t], 8 * g, a0)
        store_f32x16(out[t + 1], 8 * g, a1)
        store_f32x16(out[t + 2], 8 * g, a2)
        store_f32x16(out[t + 3], 8 * g, a3)
    for t in range(T - T % 4, T):
        store_f32x8(out[t], 8 * g, _gemv_group_k(w0, xq[t], xd[t], xs[t]))
        store_f32x8(out[t], 8 * g + 8, _gemv_group_k(w1, xq[t], xd[t], xs[t]))


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

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
    def gemv(groups, x, out):
        xq, xd, xs, xp, xoff, y8 = gemv_buffers(x.size)
        y = gemv_activation(kind, x, xq, xd, xs, xp, xoff, y8)
        for g in prange(groups.shape[0]):
            gemv_group_into(kind, groups, g, y, xq, xd, xs, xoff, out)
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
        if ZMM and (kind == Q4_0 or kind == Q4_1 or kind == Q5_0 or kind == Q5_1 or kind == Q8_0
                    or kind == Q4_K):  # ZMM_KINDS
            for p in prange(G // 2):
                if kind == Q4_K:
                    _gemm_pair_k(groups[2 * p], groups[2 * p + 1], xq, xd, xs, out, 2 * p)
                else:
                    _gemm_pair(kind, groups[2 * p], groups[2 * p + 1], y, xd, xs, xoff, out, 2 * p)
            if G % 2:
                if kind == Q4_K:
                    _gemm_group_k(groups[G - 1], xq, xd, xs, out, G - 1)
                else:
                    _gemm_group(kind, groups[G - 1], y, xd, xs, xoff, out, G - 1)
            return out
        for g in prange(G):  # a group's weights stay in L1/L2 while the activations stream by
            if kind == Q4_K:
                _gemm_group_k(groups[g], xq, xd, xs, out, g)
            else:
                _gemm_group(kind, groups[g], y, xd, xs, xoff, out, g)
        return out

    if not HAVE_VNNI and kind in SIGNED_KINDS:  # three groups per activation quad
        return InterleavedKernels(gemv, gemm_triples, gemm_triples)
    return InterleavedKernels(gemv, gemm, gemm_triples)
