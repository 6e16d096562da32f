"""A small SIMD vocabulary for Numba kernels: 256-bit vector values and the ops ggml's AVX2 code uses.

Why this exists: Numba's auto-vectoriser only handles the simplest loop shapes (a store into
an array while loading from another, or a 16-lane inner loop, stays scalar: LLVM cannot prove
they do not alias, or unrolls first). Written with these vector values, a kernel's 32-weight
block becomes ~12 instructions (`vpmaddubsw`, `vpmaddwd`, `vcvtdq2ps`, `vfmadd`...) as in
ggml's AVX2 kernels (docs/performance-journal.md, "What moved the numbers", has what that bought).

Each op is a Numba `@intrinsic` that emits a few LLVM IR instructions; kernels stay plain
`@numba.njit` functions that call them like scalar functions, and LLVM keeps the vector
values in registers. Types (LLVM vectors):

    F32x8   <8 x float>     float lanes: accumulators, activations
    I32x8   <8 x i32>       integer dot-product lanes
    I16x16  <16 x i16>      products of byte pairs (maddubs), scales
    U8x32   <32 x i8>       unsigned bytes: 4/5/6-bit weight codes
    I8x32   <32 x i8>       signed bytes: Q8 weights and quantized activations

This module holds the types, loads and stores, scalar conversions and float lanes; simd_int.py
the integer lanes (code unpacking, the integer dots, the activation's rounding); simd512.py the
512-bit values of the x8 GEMM. The quant kernels and the attention kernels (nn/) share them.

Loads take an array and an index counted in the array's elements (bytes for uint8
arrays); arrays must be contiguous from that index on (a row of a C-contiguous matrix).
Loads are unaligned, read-only, and work on read-only (memory-mapped) arrays.

Pitfall seen while writing the kernels: a block's fp16 scale compiles to `vpinsrw` into an
existing xmm register; when LLVM picks a loop-carried register, every block waits for the
previous one. With the current `load_fp16` it picks a loop-invariant one; after changing a
kernel, check its `inspect_asm` for that pattern.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from pyml.core.isa import AVX2 as HAVE_AVX2  # noqa: F401 - the path chosen at run time (core/isa.py),
from pyml.core.isa import VNNI as HAVE_VNNI  # noqa: F401 - imported from here by the kernels with the ops
from pyml.core.jit import FASTMATH  # noqa: F401 - the kernels import it from here with the ops


class Vec(types.Type):
    """A vector value type; `kind` is 'f' (float), 'i' (signed int) or 'u' (unsigned int)."""

    def __init__(self, kind: str, bits: int, lanes: int):
        self.kind, self.bits, self.lanes = kind, bits, lanes
        super().__init__(name=f"Vec<{kind}{bits}x{lanes}>")

    def llvm(self) -> ir.VectorType:
        elem = ir.FloatType() if self.kind == "f" else ir.IntType(self.bits)
        return ir.VectorType(elem, self.lanes)


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, fe_type.llvm())


F32x8 = Vec("f", 32, 8)
I32x8 = Vec("i", 32, 8)
I16x16 = Vec("i", 16, 16)
U8x32 = Vec("u", 8, 32)
I8x32 = Vec("i", 8, 32)

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)


def _mask(indices) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(indices)), list(indices))


def _splat(value: int, vt: ir.VectorType) -> ir.Constant:
    return ir.Constant(vt, [value] * vt.count)


def splat_value(builder, x, vt: ir.VectorType):
    """The scalar IR value x in every lane of a `vt` (insert into lane 0, then a zero-mask shuffle)."""
    one = builder.insert_element(ir.Constant(vt, None), x, _I32(0))
    return builder.shuffle_vector(one, one, _mask([0] * vt.count))


def _vec_ptr(context, builder, arytype, ary, idx, vt: ir.Type):
    """Pointer to `vt` at element `idx` of the array."""
    data = context.make_array(arytype)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [idx]), vt.as_pointer())


def _load(context, builder, arytype, ary, idx, vt: ir.Type, align: int = 1):
    return builder.load(_vec_ptr(context, builder, arytype, ary, idx, vt), align=align)


def _call(builder, name: str, ret: ir.Type, args: list):
    """Call the LLVM intrinsic `name` (fully mangled, e.g. llvm.fma.v8f32)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _is_vec(t, *candidates) -> bool:
    return any(t == c for c in candidates)


def _literal_int(t):
    """The value of an integer-literal argument, or None (Numba then retries with literals)."""
    return t.literal_value if isinstance(t, types.IntegerLiteral) else None


# --- loads and stores (idx counts the array's elements: bytes for uint8) --------------

def vector_load(vec: Vec, align: int, doc: str):
    """An intrinsic loading one `vec` value from an array at an element index."""
    @intrinsic
    def fn(typingctx, ary, idx):
        def codegen(context, builder, sig, args):
            return _load(context, builder, sig.args[0], args[0], args[1], vec.llvm(), align=align)
        return vec(ary, idx), codegen
    fn.__doc__ = doc
    return fn


def vector_store(vec: Vec, align: int, doc: str):
    """An intrinsic storing one `vec` value into an array at an element index."""
    @intrinsic
    def fn(typingctx, ary, idx, v):
        if not _is_vec(v, vec):
            return None

        def codegen(context, builder, sig, args):
            builder.store(args[2], _vec_ptr(context, builder, sig.args[0], args[0], args[1], vec.llvm()), align=align)
            return context.get_dummy_value()
        return types.none(ary, idx, v), codegen
    fn.__doc__ = doc
    return fn


load_u8x32 = vector_load(U8x32, 1, "32 bytes from a uint8/int8 array as unsigned lanes.")
load_i8x32 = vector_load(I8x32, 1, "32 bytes from a uint8/int8 array as signed lanes.")
load_i16x16 = vector_load(I16x16, 2, "16 int16 values from an int16 array.")
load_f32x8 = vector_load(F32x8, 4, "8 float32 values from a float32 array.")
load_i32x8 = vector_load(I32x8, 4, "8 int32 values from an int32 array.")
store_i8x32 = vector_store(I8x32, 1, "Store 32 byte lanes (I8x32) into a uint8/int8 array at idx.")
store_u8x32 = vector_store(U8x32, 1, "Store 32 byte lanes (U8x32) into a uint8/int8 array at idx.")
store_i16x16 = vector_store(I16x16, 2, "Store 16 int16 lanes into an int16 (or uint8, idx in bytes) array at idx.")
store_i32x8 = vector_store(I32x8, 4, "Store 8 int32 lanes into an int32 array at idx.")
store_f32x8 = vector_store(F32x8, 4, "Store 8 float lanes into a float32 array at idx.")


@intrinsic
def transpose_u32(typingctx, src, s0, s_stride, dst, d0, n):
    """Transpose an n x n matrix of 4-byte words (n = 8 or 16, a literal) between uint8 arrays: row r
    of the source is the 4n bytes at src[s0 + r * s_stride], row c of the result the 4n bytes at
    dst[d0 + 4 n c]. In vector registers, by swapping off-diagonal blocks of 8, 4, 2 and 1 words
    (n log2 n two-source shuffles), where word-by-word copies cost two scalar moves per word."""
    count = _literal_int(n)
    if count is None:
        return None
    if count not in (8, 16):
        raise ValueError("transpose_u32 takes n = 8 or 16")

    def codegen(context, builder, sig, args):
        vt = ir.VectorType(_I32, count)
        src_ary, start, stride, dst_ary, d_start = args[0], args[1], args[2], args[3], args[4]
        rows = [_load(context, builder, sig.args[0], src_ary,
                      builder.add(start, builder.mul(stride, ir.Constant(stride.type, r))), vt, 1)
                for r in range(count)]
        block = count // 2
        while block:
            for i in range(count):
                if i & block:
                    continue
                x, y = rows[i], rows[i + block]
                # new x: x's lanes without the block bit, then y's from the same lanes minus block;
                # new y: x's lanes with the block bit, then y's own
                lo = [l if not l & block else count + l - block for l in range(count)]
                hi = [l + block if not l & block else count + l for l in range(count)]
                rows[i], rows[i + block] = (builder.shuffle_vector(x, y, _mask(lo)),
                                            builder.shuffle_vector(x, y, _mask(hi)))
            block //= 2
        for c in range(count):
            idx = builder.add(d_start, ir.Constant(d_start.type, 4 * count * c))
            builder.store(rows[c], _vec_ptr(context, builder, sig.args[3], dst_ary, idx, vt), align=1)
        return context.get_dummy_value()
    return types.none(src, s0, s_stride, dst, d0, n), codegen


@intrinsic
def load_nibbles16(typingctx, ary, idx):
    """16 bytes -> 32 unsigned lanes: low nibbles in lanes 0-15, high nibbles in 16-31.

    This is the element order of the 32-value 4/5-bit blocks: byte j holds elements j and j+16.
    """
    def codegen(context, builder, sig, args):
        vt16 = ir.VectorType(_I8, 16)
        v = _load(context, builder, sig.args[0], args[0], args[1], vt16)
        lo = builder.and_(v, _splat(15, vt16))
        hi = builder.lshr(v, _splat(4, vt16))
        return builder.shuffle_vector(lo, hi, _mask(range(32)))
    return U8x32(ary, idx), codegen


def widen_halves(builder, v, vt):  # IEEE halves (as i16 lanes) -> float lanes (vcvtph2ps)
    return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), v.type.count)), vt)


def widen_bf16(builder, v, vt):  # bfloat16 bits (i16 lanes): the top half of a float32
    wide = ir.VectorType(_I32, v.type.count)
    return builder.bitcast(builder.shl(builder.zext(v, wide), _splat(16, wide)), vt)


def widen_u8_f32(builder, v, vt):  # unsigned bytes -> float lanes (vpmovzxbd + vcvtdq2ps)
    return builder.uitofp(builder.zext(v, ir.VectorType(_I32, v.type.count)), vt)


def widen_sext(builder, v, vt):
    return builder.sext(v, vt)


def widening_load(src: ir.VectorType, vec: Vec, widen, align: int, doc: str):
    """An intrinsic loading `src` at an element index, then `widen(builder, v, vec's LLVM type)` to a `vec` value."""
    @intrinsic
    def fn(typingctx, ary, idx):
        def codegen(context, builder, sig, args):
            return widen(builder, _load(context, builder, sig.args[0], args[0], args[1], src, align=align), vec.llvm())
        return vec(ary, idx), codegen
    fn.__doc__ = doc
    return fn


def broadcast_load(src: ir.VectorType, vec: Vec, align: int, doc: str):
    """An intrinsic loading `src` (n elements) at an element index and repeating it over the lanes
    of a `vec` value: lane j = element j % n (vpbroadcastd, or a {1toN} memory operand on AVX-512)."""
    @intrinsic
    def fn(typingctx, ary, idx):
        def codegen(context, builder, sig, args):
            v = _load(context, builder, sig.args[0], args[0], args[1], src, align=align)
            return builder.shuffle_vector(v, v, _mask([j % src.count for j in range(vec.lanes)]))
        return vec(ary, idx), codegen
    fn.__doc__ = doc
    return fn


load_i8x16_i16 = widening_load(ir.VectorType(_I8, 16), I16x16, widen_sext, 1, "16 signed bytes -> I16x16 (sign-extended).")
load_i32_bcast = broadcast_load(ir.VectorType(_I32, 1), I32x8, 4,
                                "The int32 at idx of an int32 array in all 8 lanes (a memory operand with {1to8} on "
                                "AVX-512: no scalar register and no vpbroadcastd from one, which Zen 4 runs as 2 uops).")
load_f16x8 = widening_load(ir.VectorType(_I16, 8), F32x8, widen_halves, 2,
                           "8 IEEE halves (a uint16 array of fp16 bits) -> F32x8 (vcvtph2ps).")
load_bf16x8 = widening_load(ir.VectorType(_I16, 8), F32x8, widen_bf16, 2,
                            "8 bfloat16s (a uint16 array of bf16 bits) -> F32x8: the bits are the top half of a float32.")


@intrinsic
def load_fp16(typingctx, ary, idx):
    """The fp16 at byte `idx` of a uint8 array, as float32 (a block's scale)."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        h = builder.load(builder.bitcast(builder.gep(data, [args[1]]), _I16.as_pointer()), align=1)
        return builder.fpext(builder.bitcast(h, ir.HalfType()), ir.FloatType())
    return types.float32(ary, idx), codegen


@intrinsic
def load_fp16x8(typingctx, ary, idx, stride):
    """8 fp16 values at byte idx, idx + stride, ... (the scales of 8 consecutive blocks) as F32x8."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i64 = ir.IntType(64)
        idx = context.cast(builder, args[1], sig.args[1], types.int64)
        st = context.cast(builder, args[2], sig.args[2], types.int64)
        v = ir.Constant(ir.VectorType(_I16, 8), None)
        for k in range(8):
            off = builder.add(idx, builder.mul(st, ir.Constant(i64, k)))
            h = builder.load(builder.bitcast(builder.gep(data, [off]), _I16.as_pointer()), align=1)
            v = builder.insert_element(v, h, _I32(k))
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 8)), F32x8.llvm())
    return F32x8(ary, idx, stride), codegen


load_fp16x8c = widening_load(ir.VectorType(_I16, 8), F32x8, widen_halves, 1,
                             "8 contiguous fp16 values at byte idx of a uint8 array as F32x8 (vcvtph2ps from "
                             "memory): the scales of 8 rows in the 8-row interleaved layout (interleaved.py).")
load_u8x8_f32 = widening_load(ir.VectorType(_I8, 8), F32x8, widen_u8_f32, 1,
                              "8 unsigned bytes at idx as F32x8 (vpmovzxbd + vcvtdq2ps): Q4_K's 8 rows' scales of "
                              "a group in the 8-row interleaved layout (interleaved.py).")
load_i8x4_bcast = broadcast_load(ir.VectorType(_I8, 4), I8x32, 1,
                                 "The 4 bytes at idx, repeated in all 8 groups of 4 lanes (vpbroadcastd): one "
                                 "activation quad against 8 weight rows whose 4 codes for it sit side by side "
                                 "(interleaved.py).")
load_u8x4_bcast = broadcast_load(ir.VectorType(_I8, 4), U8x32, 1,
                                 "load_i8x4_bcast as unsigned lanes: the first operand of vpdpbusd (activations "
                                 "offset by 128).")


def splat_op(vec: Vec, doc: str):
    """An intrinsic (c): a `vec` value with every lane the integer literal c."""
    @intrinsic
    def fn(typingctx, c):
        value = _literal_int(c)
        if value is None:
            return None

        def codegen(context, builder, sig, args):
            return _splat(value, vec.llvm())
        return vec(c), codegen
    fn.__doc__ = doc
    return fn


splat_u8 = splat_op(U8x32, "U8x32 with every lane c (an integer literal).")


@intrinsic
def load_u32(typingctx, ary, idx):
    """The little-endian uint32 at byte `idx` of a uint8 array (Q5 high bits)."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.load(builder.bitcast(builder.gep(data, [args[1]]), _I32.as_pointer()), align=1)
    return types.uint32(ary, idx), codegen


def _prefetch_codegen(locality: int):
    """llvm.prefetch of the line holding element idx of the array: a read, kept at `locality`
    (3: L1, prefetcht0; 2: L2, prefetcht1); it never faults."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), _I8.as_pointer())
        _call(builder, "llvm.prefetch.p0", ir.VoidType(), [ptr, _I32(0), _I32(locality), _I32(1)])
        return context.get_dummy_value()
    return codegen


@intrinsic
def prefetch(typingctx, ary, idx):
    """Hint the cache line holding element idx of the array into L1 (prefetcht0; never faults)."""
    return types.none(ary, idx), _prefetch_codegen(3)


@intrinsic
def prefetch_l2(typingctx, ary, idx):
    """Hint the cache line holding element idx of the array into L2 (prefetcht1; never faults)."""
    return types.none(ary, idx), _prefetch_codegen(2)


# --- scalar conversions ---------------------------------------------------------------

@intrinsic
def half_to_f32(typingctx, h):
    """fp16 bits (an integer) -> float32."""
    def codegen(context, builder, sig, args):
        h16 = context.cast(builder, args[0], sig.args[0], types.uint16)
        return builder.fpext(builder.bitcast(h16, ir.HalfType()), ir.FloatType())
    return types.float32(h), codegen


@intrinsic
def bf16_to_f32(typingctx, h):
    """bfloat16 bits (an integer) -> float32: the bits are the top half of the float32."""
    def codegen(context, builder, sig, args):
        u32 = builder.zext(context.cast(builder, args[0], sig.args[0], types.uint16), _I32)
        return builder.bitcast(builder.shl(u32, _I32(16)), ir.FloatType())
    return types.float32(h), codegen


@intrinsic
def f32_to_half(typingctx, v):
    """float32 -> fp16 bits (uint16), rounded to nearest even like numpy's astype(float16)."""
    def codegen(context, builder, sig, args):
        f = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.bitcast(builder.fptrunc(f, ir.HalfType()), _I16)
    return types.uint16(v), codegen


# --- lane-wise op makers (the float and the integer lanes use them) ----------------

def _const_op(op: str, vec: Vec, doc: str, out: Vec | None = None):
    """An intrinsic applying builder.<op> to each lane of a `vec` value and an integer literal (the
    result typed `out`, by default `vec`: the same bits read another way)."""
    @intrinsic
    def fn(typingctx, v, c):
        if _literal_int(c) is None or not _is_vec(v, vec):
            return None
        value = _literal_int(c)

        def codegen(context, builder, sig, args):
            return getattr(builder, op)(args[0], _splat(value, vec.llvm()))
        return (out or vec)(v, c), codegen
    fn.__doc__ = doc
    return fn


def lane_op(build, out: Vec, ins: tuple, doc: str):
    """An intrinsic over vectors of the types `ins` (one to three) whose IR `build(builder, *args)`
    makes, typed `out`. The builders below are width-generic: simd512.py makes its ops from them."""
    if len(ins) == 1:
        @intrinsic
        def fn(typingctx, a):
            if not _is_vec(a, ins[0]):
                return None
            return out(a), lambda context, builder, sig, args: build(builder, *args)
    elif len(ins) == 2:
        @intrinsic
        def fn(typingctx, a, b):
            if not (_is_vec(a, ins[0]) and _is_vec(b, ins[1])):
                return None
            return out(a, b), lambda context, builder, sig, args: build(builder, *args)
    else:
        @intrinsic
        def fn(typingctx, a, b, c):
            if not (_is_vec(a, ins[0]) and _is_vec(b, ins[1]) and _is_vec(c, ins[2])):
                return None
            return out(a, b, c), lambda context, builder, sig, args: build(builder, *args)
    fn.__doc__ = doc
    return fn


def vec_int_op(build, vec: Vec, doc: str):
    """An intrinsic (v, n): v a `vec` value, n any integer (as i32); `build(builder, v, n)` makes a `vec`."""
    @intrinsic
    def fn(typingctx, v, n):
        if not (_is_vec(v, vec) and isinstance(n, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            return build(builder, args[0], context.cast(builder, args[1], sig.args[1], types.int32))
        return vec(v, n), codegen
    fn.__doc__ = doc
    return fn


def lanewise_op(op: str, vec: Vec, doc: str):
    """An intrinsic applying builder.<op> lane by lane to two `vec` values."""
    return lane_op(lambda builder, a, b: getattr(builder, op)(a, b), vec, (vec, vec), doc)


def zeros_op(vec: Vec):
    """An intrinsic making a `vec` value of zeros."""
    @intrinsic
    def fn(typingctx):
        def codegen(context, builder, sig, args):
            return ir.Constant(vec.llvm(), [0.0 if vec.kind == "f" else 0] * vec.lanes)
        return vec(), codegen
    return fn


# width-generic builders for lane_op (the lane count is the value's)
def low_nibbles(builder, v):
    return builder.and_(v, _splat(15, v.type))


def high_nibbles(builder, v):
    return builder.lshr(v, _splat(4, v.type))


def int_to_float(builder, v):
    return builder.sitofp(v, ir.VectorType(ir.FloatType(), v.type.count))


def fused_mul_add(builder, a, b, c):  # a * b + c
    return _call(builder, f"llvm.fma.v{a.type.count}f32", a.type, [a, b, c])


def fused_neg_mul_add(builder, a, b, c):  # c - a * b
    return _call(builder, f"llvm.fma.v{a.type.count}f32", a.type, [builder.fneg(a), b, c])


def fenced_product(builder, a, b):  # a * b, its rounding kept: see mul_fenced
    return _call(builder, f"llvm.arithmetic.fence.v{a.type.count}f32", a.type, [builder.fmul(a, b)])


# --- float lanes ----------------------------------------------------------------------

to_f32 = lane_op(int_to_float, F32x8, (I32x8,), "I32x8 -> F32x8.")


@intrinsic
def lanes_f32(typingctx, v, k):
    """Byte lanes 8k..8k+7 of a U8x32/I8x32 -> F32x8 (zero/sign-extended by kind; k literal)."""
    if _literal_int(k) is None or not _is_vec(v, U8x32, I8x32):
        return None
    kk, signed = _literal_int(k), v.kind == "i"

    def codegen(context, builder, sig, args):
        part = builder.shuffle_vector(args[0], args[0], _mask(range(8 * kk, 8 * kk + 8)))
        vt32 = ir.VectorType(_I32, 8)
        wide = builder.sext(part, vt32) if signed else builder.zext(part, vt32)
        return builder.sitofp(wide, F32x8.llvm())
    return F32x8(v, k), codegen


def broadcast_op(vec: Vec, doc: str):
    """An intrinsic broadcasting a scalar to every float lane of a `vec` value."""
    @intrinsic
    def fn(typingctx, s):
        def codegen(context, builder, sig, args):
            return splat_value(builder, context.cast(builder, args[0], sig.args[0], types.float32), vec.llvm())
        return vec(s), codegen
    fn.__doc__ = doc
    return fn


f32x8 = broadcast_op(F32x8, "Broadcast a scalar to 8 float lanes.")


zeros_f32x8, zeros_i32x8 = zeros_op(F32x8), zeros_op(I32x8)


lane = vec_int_op(lambda builder, v, j: splat_value(builder, builder.extract_element(v, j), v.type), F32x8,
                  "F32x8 with every lane = lane j of v (a shuffle once j is a known constant).")
fma = lane_op(fused_mul_add, F32x8, (F32x8,) * 3, "a * b + c, fused, lane-wise.")
fnma = lane_op(fused_neg_mul_add, F32x8, (F32x8,) * 3, "c - a * b, fused, lane-wise.")
add = lanewise_op("fadd", F32x8, "a + b, lane-wise")
sub = lanewise_op("fsub", F32x8, "a - b, lane-wise")
mul = lanewise_op("fmul", F32x8, "a * b, lane-wise")
mul_fenced = lane_op(fenced_product, F32x8, (F32x8, F32x8),
                     "a * b, lane-wise, behind llvm.arithmetic.fence: fastmath's reassociation cannot regroup it "
                     "with a multiply it feeds (x y z is (x y) z wherever it is inlined, the same bits on every path)")


@intrinsic
def hsum(typingctx, v):
    """Sum of the 8 lanes, as a tree (the summation order is fixed: results are deterministic)."""
    def codegen(context, builder, sig, args):
        v8 = args[0]
        v4 = builder.fadd(builder.shuffle_vector(v8, v8, _mask(range(4))),
                          builder.shuffle_vector(v8, v8, _mask(range(4, 8))))
        v2 = builder.fadd(builder.shuffle_vector(v4, v4, _mask(range(2))),
                          builder.shuffle_vector(v4, v4, _mask(range(2, 4))))
        return builder.fadd(builder.extract_element(v2, _I32(0)), builder.extract_element(v2, _I32(1)))
    return types.float32(v), codegen


# --- composite ops (plain njit helpers; LLVM inlines them) ---------------------------

@numba.njit
def dot32_f32(q, x, xo):
    """F32x8 partial sums of q[j] * x[xo + j] over 32 byte lanes q (U8x32 or I8x32)."""
    t = mul(lanes_f32(q, 0), load_f32x8(x, xo))
    t = fma(lanes_f32(q, 1), load_f32x8(x, xo + 8), t)
    t = fma(lanes_f32(q, 2), load_f32x8(x, xo + 16), t)
    return fma(lanes_f32(q, 3), load_f32x8(x, xo + 24), t)


@numba.njit
def dot16_f32(q, half, x, xo):
    """F32x8 partial sums of q[16*half + j] * x[xo + j] over 16 byte lanes (half a literal 0/1)."""
    if half == 0:
        return fma(lanes_f32(q, 1), load_f32x8(x, xo + 8), mul(lanes_f32(q, 0), load_f32x8(x, xo)))
    return fma(lanes_f32(q, 3), load_f32x8(x, xo + 8), mul(lanes_f32(q, 2), load_f32x8(x, xo)))
