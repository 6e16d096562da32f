"""The 8-row interleaved ("x8") layout: ggml's blocks re-laid 8 rows at a time, so each instruction
serves 8 rows; pack() and unpack() between it and the file's layout.

Why: in the file's layout a GEMV spends ~14 instructions on every 32-value block of a row
(unpack the codes, one maddubs, convert and broadcast the block's scale, and a horizontal sum
per row at the end), so the 4-bit types decoded no faster per weight than Q8_0 with twice their
bytes (docs/performance-journal.md, "What moved the numbers"). With 8 rows interleaved, one
32-byte load holds 4 codes of each of 8 rows; a maddubs against the 4 matching activation bytes,
broadcast, leaves each row's partial sums in that row's own lanes; the 8 rows' scales convert as
one vector, and no horizontal sum is left: ~6 instructions per row and block. llama.cpp
repacks Q4_0 in the same spirit for its AVX2 kernels (block_q4_0x8).

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

The kernels that read it: interleaved_gemv.py (T == 1, the integer dot of a superblock),
interleaved_gemm.py (T > 1 with VNNI, and the kernels of one type), interleaved_pairs.py (two
groups on 512-bit vectors), interleaved_triples.py (three groups per activation quad, without VNNI).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyml.core import derived
from pyml.core.mapping import release_pages
from pyml.quant.ggml_types import BLOCK_SIZE, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0, TYPE_SIZE


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
