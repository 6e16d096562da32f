"""512-bit vector values for the x8 GEMM on AVX-512: two 8-row groups side by side, 16 rows per instruction
(and for the attention's decode: 16 positions or dimensions of the KV cache a vector).

Why: the x8 GEMM on 256-bit vectors keeps its vpdpbusd chains short enough only by spending a
scheduler entry on every 8 rows; on Zen 4 a 512-bit op does twice the work per entry (it is split
into two 256-bit halves in the pipes, so the peak is the same), so the same loop keeps twice as
much independent work in flight. Lanes 0-7 are the 8 rows of group g, lanes 8-15 those of group
g + 1 (interleaved.py's layout, unchanged: each half is loaded from its own group).

    F32x16  <16 x float>    accumulators, scales
    I32x16  <16 x i32>      integer dot lanes
    U8x64   <64 x i8>       weight codes (Q4) / offset activations (Q8_0)
    I8x64   <64 x i8>       activations (Q4) / weight codes (Q8_0)

Same conventions as simd.py (whose Vec type and helpers these share): loads take an array and an
element index, are unaligned and read-only. `dpbusd16` is vpdpbusd on zmm registers on the
avx512_vnni path and the same sums in plain IR elsewhere (tests compare the two).
"""

from __future__ import annotations

from llvmlite import ir
from numba.extending import intrinsic

from pyml.core.isa import ZMM
from pyml.core.simd import (Vec, _I16, _I32, _I8, _call, _load, _mask, broadcast_load, broadcast_op, fenced_product,
                            fused_mul_add, fused_neg_mul_add, high_nibbles, int_to_float, lane_op, lanewise_op, low_nibbles,
                            splat_op, vector_load, vector_store, widen_halves, widen_u8_f32, widening_load, zeros_op)

F32x16 = Vec("f", 32, 16)
I32x16 = Vec("i", 32, 16)
U8x64 = Vec("u", 8, 64)
I8x64 = Vec("i", 8, 64)


load_u8x64 = vector_load(U8x64, 1, "64 bytes from a uint8/int8 array as unsigned lanes.")
load_f32x16 = vector_load(F32x16, 4, "16 float32 values from a float32 array.")
load_i32x16 = vector_load(I32x16, 4, "16 int32 values from an int32 array.")


def _same(builder, v, vt):
    return v


def _joined(context, builder, types, arrays, indices, src: ir.VectorType, vec: Vec, widen, align: int):
    # `src` at indices[0] of arrays[0] (the low lanes) and at indices[1] of arrays[1] (the high), widened
    lo = _load(context, builder, types[0], arrays[0], indices[0], src, align=align)
    hi = _load(context, builder, types[1], arrays[1], indices[1], src, align=align)
    return widen(builder, builder.shuffle_vector(lo, hi, _mask(range(2 * src.count))), vec.llvm())


def _pair_load(src: ir.VectorType, vec: Vec, widen, align: int, doc: str):
    """An intrinsic (a, b, idx): `src` at idx of a (the low lanes) and at idx of b (the high), as one
    vector, then `widen(builder, v, vec's LLVM type)` (simd.py's widening_load on two groups)."""
    @intrinsic
    def fn(typingctx, a, b, idx):
        def codegen(context, builder, sig, args):
            return _joined(context, builder, sig.args[:2], args[:2], (args[2], args[2]), src, vec, widen, align)
        return vec(a, b, idx), codegen
    fn.__doc__ = doc
    return fn


def _split_load(src: ir.VectorType, vec: Vec, widen, align: int, doc: str):
    """An intrinsic (a, i, j): `src` at element i of a (the low lanes) and at element j (the high), as
    one vector, then widened: two pieces of one array that are not side by side."""
    @intrinsic
    def fn(typingctx, a, i, j):
        def codegen(context, builder, sig, args):
            return _joined(context, builder, (sig.args[0],) * 2, (args[0],) * 2, args[1:], src, vec, widen, align)
        return vec(a, i, j), codegen
    fn.__doc__ = doc
    return fn


def _sext_f32(builder, v, vt):  # signed bytes -> float lanes (vpmovsxbd + vcvtdq2ps)
    return builder.sitofp(builder.sext(v, ir.VectorType(_I32, v.type.count)), vt)


load_u8x32_pair = _pair_load(ir.VectorType(_I8, 32), U8x64, _same, 1,
                             "32 bytes at idx of a (lanes 0-31) and 32 bytes at idx of b (lanes 32-63), as U8x64.")
load_fp16x8c_pair = _pair_load(ir.VectorType(_I16, 8), F32x16, widen_halves, 1,
                               "8 fp16 at byte idx of a, then 8 at byte idx of b, as F32x16 (the 16 rows' block "
                               "scales).")
load_i32x8_pair = _pair_load(ir.VectorType(_I32, 8), I32x16, _same, 4, "8 int32 at idx of a, then 8 at idx of b, as I32x16.")
load_u8x8_f32_pair = _pair_load(ir.VectorType(_I8, 8), F32x16, widen_u8_f32, 1,
                                "8 unsigned bytes at idx of a, then 8 at idx of b, as F32x16 (Q4_K: 16 rows' scales "
                                "of a group).")
# the attention's KV cache (f32, f16 bits, q8_0 codes), 16 positions or dimensions a vector
load_f16x16 = widening_load(ir.VectorType(_I16, 16), F32x16, widen_halves, 2,
                            "16 IEEE halves (a uint16 array of fp16 bits) -> F32x16 (vcvtph2ps zmm).")
load_i8x16_f32 = widening_load(ir.VectorType(_I8, 16), F32x16, _sext_f32, 1, "16 signed bytes -> F32x16.")
load_f32x8_split = _split_load(ir.VectorType(ir.FloatType(), 8), F32x16, _same, 4,
                               "8 float32 at element i (lanes 0-7) and 8 at element j (lanes 8-15), as F32x16.")
load_f16x8_split = _split_load(ir.VectorType(_I16, 8), F32x16, widen_halves, 2,
                               "8 fp16 at element i and 8 at element j of a uint16 array, as F32x16.")
load_i8x8_f32_split = _split_load(ir.VectorType(_I8, 8), F32x16, _sext_f32, 1,
                                  "8 signed bytes at element i and 8 at element j, as F32x16.")
load_i8x4_bcast16 = broadcast_load(ir.VectorType(_I8, 4), I8x64, 1,
                                   "The 4 bytes at idx in all 16 groups of 4 lanes, signed (vpbroadcastd zmm).")
load_u8x4_bcast16 = broadcast_load(ir.VectorType(_I8, 4), U8x64, 1,
                                   "The 4 bytes at idx in all 16 groups of 4 lanes, unsigned (vpdpbusd's a).")
load_i32_bcast16 = broadcast_load(ir.VectorType(_I32, 1), I32x16, 4,
                                  "The int32 at idx of an int32 array in all 16 lanes (a {1to16} memory operand).")
f32x16 = broadcast_op(F32x16, "Broadcast a scalar to 16 float lanes.")
store_f32x16 = vector_store(F32x16, 4, "Store 16 float lanes into a float32 array at idx.")
store_u8x64 = vector_store(U8x64, 1, "Store 64 byte lanes (U8x64) into a uint8/int8 array at idx.")
zeros_f32x16, zeros_i32x16 = zeros_op(F32x16), zeros_op(I32x16)


def _dpbusd_ir(builder, acc, a, b, generic=False):
    if ZMM and not generic:
        vt = I32x16.llvm()
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", vt, [acc, builder.bitcast(a, vt), builder.bitcast(b, vt)])
    vt = ir.VectorType(_I32, 64)
    p = builder.mul(builder.zext(a, vt), builder.sext(b, vt))
    quads = [builder.shuffle_vector(p, p, _mask(range(k, 64, 4))) for k in range(4)]
    return builder.add(acc, builder.add(builder.add(quads[0], quads[1]), builder.add(quads[2], quads[3])))


dpbusd16 = lane_op(_dpbusd_ir, I32x16, (I32x16, U8x64, I8x64),
                   "I32x16 acc + (U8x64 a * I8x64 b): lane i += a[4i]*b[4i] + ... + a[4i+3]*b[4i+3] (vpdpbusd zmm).")
dpbusd16_generic = lane_op(lambda b, acc, x, y: _dpbusd_ir(b, acc, x, y, generic=True), I32x16,
                           (I32x16, U8x64, I8x64), "dpbusd16 in plain IR, whatever the path (tests compare the two).")
nibbles_lo64 = lane_op(low_nibbles, U8x64, (U8x64,), "Low nibble of each byte.")
nibbles_hi64 = lane_op(high_nibbles, U8x64, (U8x64,), "High nibble of each byte.")
or_u8x64 = lanewise_op("or_", U8x64, "a | b, lane-wise.")
as_i8x64 = lane_op(lambda b, v: v, I8x64, (U8x64,), "The same bytes as signed lanes.")
splat_u8x64 = splat_op(U8x64, "U8x64 with every lane c (an integer literal): splat_u8 on 64 lanes.")
add_i32x16 = lanewise_op("add", I32x16, "a + b, lane-wise.")
sub_i32x16 = lanewise_op("sub", I32x16, "a - b, lane-wise.")
to_f32x16 = lane_op(int_to_float, F32x16, (I32x16,), "I32x16 -> F32x16.")
mul16 = lanewise_op("fmul", F32x16, "a * b, lane-wise.")
mul16_fenced = lane_op(fenced_product, F32x16, (F32x16, F32x16), "simd.mul_fenced on 16 lanes.")
fnma16 = lane_op(fused_neg_mul_add, F32x16, (F32x16,) * 3, "c - a * b, fused, lane-wise.")
fma16 = lane_op(fused_mul_add, F32x16, (F32x16,) * 3, "a * b + c, fused, lane-wise.")
