"""The bf16 prefill GEMM of float weights (F32, F16, BF16) on AVX-512 BF16: `--float-compute bf16`.

Why: the float32 GEMM (floats.py) is bound by the FMA peak, 16 multiply-adds per 256-bit FMA;
`vdpbf16ps` does 32 bf16 products per zmm instruction into 16 float32 sums, twice the float32
rate on the same pipes (OpenVINO's CPU plugin computes F16/F32 models in bf16 for this).
The cost is precision: weights and activations lose their mantissa bits past the 8th (round to
nearest even), the sums stay float32 (docs/performance-journal.md, "--float-compute bf16": accuracy
against transformers on the real models).

Layout of a matrix of R rows and K columns, K2 = ceil(K / 2) column pairs (made once at load,
kept in the packed-weights cache):

    blocks  uint16 [ceil(R / 32), K2 * 64]: block g holds rows 32g..32g+31 (zero rows past R);
            pair p (columns 2p and 2p + 1, a zero column past an odd K) is 64 values at 64p:
                rows 32g..32g+15, each its two columns   32 bf16 = one zmm   (lanes 0-15)
                rows 32g+16..32g+31, the same            32 bf16 = one zmm   (lanes 16-31)
            so one vdpbf16ps adds w[r, 2p] x[2p] + w[r, 2p+1] x[2p+1] into row r's lane for 16
            rows, against the activation pair broadcast from memory ({1to16}).

The activations are rounded to bf16 once per call (xb uint16 [T, 2 * K2]). A register tile is 32
rows x 8 tokens: 16 accumulators, 2 weight loads and 8 broadcasts per 16 vdpbf16ps. Threads
take (block, 64-token chunk) items, block-major, so a thread's weights stay in L1/L2 while the
activation tiles stream by.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import prange
from numba.extending import intrinsic

from pyml.core import derived
from pyml.core.isa import BF16 as HAVE_BF16
from pyml.quant.quantizers import to_bf16_bits
from pyml.core.simd import FASTMATH, _I32, _call, _load, _mask
from pyml.core.simd512 import F32x16, store_f32x16, zeros_f32x16

# The layout's version, part of the blocks' name in the packed-weights cache (`<linear>.bf16.v1`: a
# file made under another version holds no such array and is re-packed): bump it with any change to
# the bytes pack() writes.
LAYOUT_VERSION = 1
ROWS = 32           # rows per block: two zmm of 16 lanes
PAIR = 2 * ROWS     # bf16 values per column pair of a block
TOKENS = 8          # tokens per register tile
TOKEN_CHUNK = 64    # tokens per thread item
_SLAB_BLOCKS = 128  # blocks converted at a time at pack: 4096 rows of float32 in flight


class _BFloat(ir.types.Type):
    """LLVM's bfloat (llvmlite's IR builder has no such type; the intrinsic's operands are <32 x bfloat>)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_BF16x32 = ir.VectorType(_BFloat(), 32)


@intrinsic
def dpbf16(typingctx, acc, w, wi, x, xi):
    """F32x16 acc + w[wi .. wi+32] . (x[xi], x[xi+1]) broadcast: lane i += w[wi+2i] x[xi] + w[wi+2i+1] x[xi+1]
    (vdpbf16ps zmm with a {1to16} memory operand; w and x uint16 arrays of bf16 bits)."""
    def codegen(context, builder, sig, args):
        a = _load(context, builder, sig.args[1], args[1], args[2], _BF16x32, align=2)
        pair = _load(context, builder, sig.args[3], args[3], args[4], ir.VectorType(_I32, 1), align=2)
        b = builder.bitcast(builder.shuffle_vector(pair, pair, _mask([0] * 16)), _BF16x32)
        return _call(builder, "llvm.x86.avx512bf16.dpbf16ps.512", F32x16.llvm(), [args[0], a, b])
    return F32x16(acc, w, wi, x, xi), codegen


@intrinsic
def dpbf16_regs(typingctx, acc, a, b):
    """vdpbf16ps on registers only (F32x16 operands reinterpreted as 32 bf16 each): kernel_bench's peak."""
    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.x86.avx512bf16.dpbf16ps.512", F32x16.llvm(),
                     [args[0], builder.bitcast(args[1], _BF16x32), builder.bitcast(args[2], _BF16x32)])
    return F32x16(acc, a, b), codegen


# --- the activations rounded to bf16 (quantizers.to_bf16_bits, in a kernel) ------------------

@numba.njit(inline="always")
def _round_bits(u):  # float32 bits (uint32) -> bf16 bits, round to nearest even; NaN stays NaN
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@intrinsic
def round_f32(typingctx, x):
    """float32 x rounded to bf16 (nearest even), held as a float32 (low 16 bits zero); x not NaN
    (an exp's result). In 32-bit arithmetic, where _round_bits's integers widen to 64 bits and
    halve a loop's vector width."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        odd = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), odd)
        return builder.bitcast(builder.and_(rounded, ir.Constant(i32, -0x10000)), ir.FloatType())
    return numba.types.float32(numba.types.float32), codegen


@intrinsic
def high_bits(typingctx, x):
    """The bf16 bits of a float32 that round_f32 gave (its upper half)."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        return builder.trunc(builder.lshr(builder.bitcast(args[0], i32), ir.Constant(i32, 16)), ir.IntType(16))
    return numba.types.uint16(numba.types.float32), codegen


@numba.njit(parallel=True, cache=True)
def round_rows(x, out):
    """x float32 [T, K] -> out uint16 [T, >= K] bf16 bits (RNE), zeros in the columns past K."""
    K = x.shape[1]
    for t in prange(x.shape[0]):
        u = x[t].view(np.uint32)
        for k in range(K):
            out[t, k] = _round_bits(u[k])
        for k in range(K, out.shape[1]):
            out[t, k] = 0
    return out


# --- the packed matrix -----------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class BF16Packed:
    """A float matrix of `rows` x `n_cols` in the layout of the module doc; `kind` its stored type."""

    kind: int
    n_cols: int
    rows: int
    blocks: np.ndarray  # uint16 [ceil(rows / 32), ceil(n_cols / 2) * 64]

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


def packed_shape(rows: int, n_cols: int) -> tuple[int, int]:
    return (rows + ROWS - 1) // ROWS, (n_cols + 1) // 2 * PAIR


def pack(w: np.ndarray, kind: int, n_cols: int, to_f32, key: str | None = None) -> BF16Packed:
    """Stored float weights [rows, n_cols] -> BF16Packed, converted a slab of blocks at a time
    (`to_f32(rows_slab)` widens the stored type); a derived array named after `key`, the mode and the
    layout (core/derived.py), so a packed-weights cache fills it once and hands it back on later loads.
    The model's cache file is the same in every mode: an f32 load never asks for the blocks, a bf16
    load of a file made without them re-packs it once, with them."""
    rows = w.shape[0]
    G, width = packed_shape(rows, n_cols)
    K2 = width // PAIR

    def fill(blocks):
        for g0 in range(0, G, _SLAB_BLOCKS):
            g1 = min(G, g0 + _SLAB_BLOCKS)
            slab = np.zeros((ROWS * (g1 - g0), 2 * K2), np.float32)
            part = w[ROWS * g0:min(rows, ROWS * g1)]
            slab[:part.shape[0], :n_cols] = to_f32(part)
            bits = to_bf16_bits(slab).reshape(g1 - g0, 2, 16, K2, 2)  # [block, half, row, pair, column]
            blocks[g0:g1] = bits.transpose(0, 3, 1, 2, 4).reshape(g1 - g0, width)

    blocks = derived.array(key and f"{key}.bf16.v{LAYOUT_VERSION}", (G, width), np.uint16, fill)
    return BF16Packed(int(kind), int(n_cols), int(rows), blocks)


# --- the GEMM --------------------------------------------------------------------------------

@numba.njit(inline="always")
def _tile(w, xb, t, K2, out, col):
    """out[t[j], col .. col+32] for the 8 tokens t: 32 rows x 8 tokens in 16 accumulators."""
    a0, a1, a2, a3 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
    a4, a5, a6, a7 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
    b0, b1, b2, b3 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
    b4, b5, b6, b7 = zeros_f32x16(), zeros_f32x16(), zeros_f32x16(), zeros_f32x16()
    x0, x1, x2, x3, x4, x5, x6, x7 = xb[t[0]], xb[t[1]], xb[t[2]], xb[t[3]], xb[t[4]], xb[t[5]], xb[t[6]], xb[t[7]]
    for p in range(K2):
        o, k = PAIR * p, 2 * p
        a0, b0 = dpbf16(a0, w, o, x0, k), dpbf16(b0, w, o + 32, x0, k)
        a1, b1 = dpbf16(a1, w, o, x1, k), dpbf16(b1, w, o + 32, x1, k)
        a2, b2 = dpbf16(a2, w, o, x2, k), dpbf16(b2, w, o + 32, x2, k)
        a3, b3 = dpbf16(a3, w, o, x3, k), dpbf16(b3, w, o + 32, x3, k)
        a4, b4 = dpbf16(a4, w, o, x4, k), dpbf16(b4, w, o + 32, x4, k)
        a5, b5 = dpbf16(a5, w, o, x5, k), dpbf16(b5, w, o + 32, x5, k)
        a6, b6 = dpbf16(a6, w, o, x6, k), dpbf16(b6, w, o + 32, x6, k)
        a7, b7 = dpbf16(a7, w, o, x7, k), dpbf16(b7, w, o + 32, x7, k)
    # tokens past T repeat the last one (t[j] == t[j-1]): the same sums, stored twice
    store_f32x16(out[t[0]], col, a0), store_f32x16(out[t[0]], col + 16, b0)
    store_f32x16(out[t[1]], col, a1), store_f32x16(out[t[1]], col + 16, b1)
    store_f32x16(out[t[2]], col, a2), store_f32x16(out[t[2]], col + 16, b2)
    store_f32x16(out[t[3]], col, a3), store_f32x16(out[t[3]], col + 16, b3)
    store_f32x16(out[t[4]], col, a4), store_f32x16(out[t[4]], col + 16, b4)
    store_f32x16(out[t[5]], col, a5), store_f32x16(out[t[5]], col + 16, b5)
    store_f32x16(out[t[6]], col, a6), store_f32x16(out[t[6]], col + 16, b6)
    store_f32x16(out[t[7]], col, a7), store_f32x16(out[t[7]], col + 16, b7)


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH)
def gemm_blocks(blocks, xb, out):
    """out [T, 32 * G] = xb [T, 2 K2] (bf16 bits) . blocks [G, 64 K2]^T, float32 sums."""
    G, T, K2 = blocks.shape[0], xb.shape[0], xb.shape[1] // 2
    chunks = (T + TOKEN_CHUNK - 1) // TOKEN_CHUNK
    for item in prange(G * chunks):
        g, c = item // chunks, item % chunks
        w = blocks[g]
        for t0 in range(TOKEN_CHUNK * c, min(T, TOKEN_CHUNK * (c + 1)), TOKENS):
            last = T - 1
            t = (t0, min(t0 + 1, last), min(t0 + 2, last), min(t0 + 3, last),
                 min(t0 + 4, last), min(t0 + 5, last), min(t0 + 6, last), min(t0 + 7, last))
            _tile(w, xb, t, K2, out, ROWS * g)
    return out


def matmul(x: np.ndarray, p: BF16Packed, out: np.ndarray) -> np.ndarray:
    """out [T, rows] = x [T, n_cols] float32 @ W^T through the bf16 blocks (x, out as quant.matmul
    checked them). Rows past the last whole block go through a scratch of whole blocks."""
    if not HAVE_BF16:
        raise RuntimeError("the bf16 GEMM needs AVX-512 BF16 (ISA path avx512_bf16)")
    G, width = p.blocks.shape
    xb = round_rows(x, np.empty((x.shape[0], width // ROWS), np.uint16))
    if ROWS * G == p.rows:
        return gemm_blocks(p.blocks, xb, out)
    full = gemm_blocks(p.blocks, xb, np.empty((x.shape[0], ROWS * G), np.float32))
    out[...] = full[:, :p.rows]
    return out
