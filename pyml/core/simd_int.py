"""The SIMD vocabulary's integer lanes: byte-lane unpacking of weight codes, the integer dot products
(vpmaddubsw, vpmaddwd, vpdpbusd, or the same sums in plain IR) and the activation's rounding to
int8. The vector types, loads, stores and float lanes are simd.py's; the conventions (idx counted
in the array's elements, unaligned read-only loads) are the same.

Integer dot ops never saturate for the value ranges the kernels feed them (documented at each
op); on AVX2 they lower to the x86 instructions, otherwise to plain LLVM vector IR with the same
results (`tests/core/test_simd.py` checks both).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pyml.core.isa import AVX2 as HAVE_AVX2  # the path chosen at run time (core/isa.py)
from pyml.core.isa import VNNI as HAVE_VNNI
from pyml.core.simd import (_I8, _I16, _I32, F32x8, I8x32, I16x16, I32x8, U8x32, Vec, _call, _const_op, _is_vec,
                            _literal_int, _load, _mask, _splat, _vec_ptr, high_nibbles, lane_op, lanewise_op,
                            low_nibbles, splat_value, vec_int_op)


# --- byte lanes -----------------------------------------------------------------------


and_u8 = _const_op("and_", U8x32, "lanes & c (c an integer literal)")
shr_u8 = _const_op("lshr", U8x32, "lanes >> n, logical (n an integer literal)")
shl_u8 = _const_op("shl", U8x32, "lanes << n (n an integer literal)")
sar_i8 = _const_op("ashr", I8x32, "lanes >> n, arithmetic (n an integer literal)")
or_u8 = lanewise_op("or_", U8x32, "a | b, lane-wise")
nibbles_lo = lane_op(low_nibbles, U8x32, (U8x32,), "Low nibble of each byte.")
nibbles_hi = lane_op(high_nibbles, U8x32, (U8x32,), "High nibble of each byte.")


@intrinsic
def bits_to_u8(typingctx, bits, value):
    """32 lanes from a uint32: lane j = `value` if bit j is set, else 0 (value an integer literal).

    ggml's bytes_from_bits_32: broadcast byte j//8 to lane j, set every bit but j%8, compare.
    """
    if _literal_int(value) is None:
        return None
    val = _literal_int(value)

    def codegen(context, builder, sig, args):
        b32 = context.cast(builder, args[0], sig.args[0], types.uint32)
        bytes4 = builder.bitcast(b32, ir.VectorType(_I8, 4))
        spread = builder.shuffle_vector(bytes4, bytes4, _mask([j // 8 for j in range(32)]))
        vt = U8x32.llvm()
        others = ir.Constant(vt, [0xFF ^ (1 << (j % 8)) for j in range(32)])
        isset = builder.icmp_unsigned("==", builder.or_(spread, others), _splat(0xFF, vt))
        return builder.select(isset, _splat(val, vt), _splat(0, vt))
    return U8x32(bits, value), codegen


@intrinsic
def bit_to_u8(typingctx, v, bit, value):
    """Lane-wise: `value` if bit number `bit` (0-7) of the byte is set, else 0 (value a literal).
    Any unsigned byte vector (U8x32, or simd512's U8x64), returned as the same type."""
    if _literal_int(value) is None or not isinstance(bit, types.Integer):
        return None
    if not (isinstance(v, Vec) and v.kind == "u" and v.bits == 8):
        return None
    val = _literal_int(value)

    def codegen(context, builder, sig, args):
        vt = sig.args[0].llvm()
        b8 = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), _I8)
        mask = builder.shl(ir.Constant(_I8, 1), b8)
        maskv = builder.shuffle_vector(builder.insert_element(ir.Constant(vt, None), mask, _I32(0)),
                                       ir.Constant(vt, None), _mask([0] * vt.count))
        isset = builder.icmp_unsigned("!=", builder.and_(args[0], maskv), _splat(0, vt))
        return builder.select(isset, _splat(val, vt), _splat(0, vt))
    return v(v, bit, value), codegen


minus_i8 = _const_op("sub", U8x32, "U8x32 lanes - c as signed I8x32 (c an integer literal): recentre unsigned "
                     "codes, e.g. q - 8.", out=I8x32)


@intrinsic
def as_i8(typingctx, v):
    """Reinterpret U8x32 as I8x32 (codes < 128, or bytes that hold signed codes)."""
    if not _is_vec(v, U8x32):
        return None

    def codegen(context, builder, sig, args):
        return args[0]
    return I8x32(v), codegen


@intrinsic
def abs_u8(typingctx, v):
    """|lanes| of an I8x32 as U8x32 (vpabsb)."""
    if not _is_vec(v, I8x32):
        return None

    def codegen(context, builder, sig, args):
        negative = builder.icmp_signed("<", args[0], _splat(0, I8x32.llvm()))
        return builder.select(negative, builder.neg(args[0]), args[0])
    return U8x32(v), codegen


@intrinsic
def sign_i8(typingctx, v, s):
    """v with the sign of s applied lane-wise, 0 where s == 0 (vpsignb): with abs_u8 this turns a
    signed x signed byte dot into maddubs(abs_u8(s), sign_i8(v, s))."""
    if not (_is_vec(v, I8x32) and _is_vec(s, I8x32)):
        return None

    def codegen(context, builder, sig, args):
        if HAVE_AVX2:
            return _call(builder, "llvm.x86.avx2.psign.b", I8x32.llvm(), [args[0], args[1]])
        zero = _splat(0, I8x32.llvm())
        neg = builder.select(builder.icmp_signed("<", args[1], zero), builder.neg(args[0]), args[0])
        return builder.select(builder.icmp_signed("==", args[1], zero), zero, neg)
    return I8x32(v, s), codegen


@intrinsic
def kscales(typingctx, ary, idx):
    """The 8 six-bit scales and 8 mins of a Q4_K/Q5_K superblock (12 bytes at idx) as two F32x8.

    sc[j] = b[j] & 63, mn[j] = b[j+4] & 63                               (j < 4)
    sc[j] = (b[j+4] & 15) | (b[j-4] >> 6) << 4, mn[j] = (b[j+4] >> 4) | (b[j] >> 6) << 4   (j >= 4)
    """
    ret = types.UniTuple(F32x8, 2)

    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(_I8, 8)
        b = _load(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I8, 12))
        lo = builder.shuffle_vector(b, b, _mask([0, 1, 2, 3, 0, 1, 2, 3]))     # b[j], b[j-4]
        mid = builder.shuffle_vector(b, b, _mask([4, 5, 6, 7, 4, 5, 6, 7]))    # b[j+4], b[j]
        hi = builder.shuffle_vector(b, b, _mask([8, 9, 10, 11, 8, 9, 10, 11]))  # b[j+4] for j >= 4
        first = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])
        c63, c15, c4, c6 = (_splat(k, v8) for k in (63, 15, 4, 6))
        sc = builder.select(first, builder.and_(lo, c63),
                            builder.or_(builder.and_(hi, c15), builder.shl(builder.lshr(lo, c6), c4)))
        mn = builder.select(first, builder.and_(mid, c63),
                            builder.or_(builder.lshr(hi, c4), builder.shl(builder.lshr(mid, c6), c4)))
        vt32 = ir.VectorType(_I32, 8)
        scf = builder.uitofp(builder.zext(sc, vt32), F32x8.llvm())
        mnf = builder.uitofp(builder.zext(mn, vt32), F32x8.llvm())
        return context.make_tuple(builder, ret, [scf, mnf])
    return ret(ary, idx), codegen


# --- integer dot products -------------------------------------------------------------

def _pairs(builder, v, n):
    even = builder.shuffle_vector(v, v, _mask(range(0, n, 2)))
    odd = builder.shuffle_vector(v, v, _mask(range(1, n, 2)))
    return even, odd


def _pair_sums(builder, a, b, elem: ir.IntType, a_signed: bool):
    """Lane i = a[2i] * b[2i] + a[2i+1] * b[2i+1] in `elem` integers, b signed: the plain IR of
    vpmaddubsw (a unsigned bytes) and vpmaddwd (a signed words)."""
    n = a.type.count
    vt = ir.VectorType(elem, n)
    p = builder.mul(builder.sext(a, vt) if a_signed else builder.zext(a, vt), builder.sext(b, vt))
    even, odd = _pairs(builder, p, n)
    return builder.add(even, odd)


def maddubs_ir(builder, a, b, generic: bool):
    """u8 x i8 pair sums -> i16 (vpmaddubsw); exact while |pair sum| < 2^15."""
    if HAVE_AVX2 and not generic:
        return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", I16x16.llvm(), [a, b])
    return _pair_sums(builder, a, b, _I16, False)


def madd_ir(builder, a, b, generic: bool):
    """i16 x i16 pair sums -> i32 (vpmaddwd); exact except -32768*-32768*2."""
    if HAVE_AVX2 and not generic:
        return _call(builder, "llvm.x86.avx2.pmadd.wd", I32x8.llvm(), [a, b])
    return _pair_sums(builder, a, b, _I32, True)


def _dot_op(a_vec: Vec, b_vec: Vec | None, out_vec: Vec, build, doc: str, generic: bool):
    """An intrinsic over one or two vectors whose IR `build(builder, args, generic)` makes; generic
    forces the portable IR (tests compare it with the x86 instructions)."""
    if b_vec is None:
        @intrinsic
        def fn(typingctx, a):
            if not _is_vec(a, a_vec):
                return None

            def codegen(context, builder, sig, args):
                return build(builder, args, generic)
            return out_vec(a), codegen
    else:
        @intrinsic
        def fn(typingctx, a, b):
            if not (_is_vec(a, a_vec) and _is_vec(b, b_vec)):
                return None

            def codegen(context, builder, sig, args):
                return build(builder, args, generic)
            return out_vec(a, b), codegen
    fn.__doc__ = doc
    return fn


def _dot_i8_ir(builder, args, generic):
    if HAVE_AVX2 and not generic:
        negative = builder.icmp_signed("<", args[0], _splat(0, I8x32.llvm()))
        absa = builder.select(negative, builder.neg(args[0]), args[0])  # vpabsb
        signed_b = _call(builder, "llvm.x86.avx2.psign.b", I8x32.llvm(), [args[1], args[0]])
        return maddubs_ir(builder, absa, signed_b, generic)
    vt = ir.VectorType(_I16, 32)
    p = builder.mul(builder.sext(args[0], vt), builder.sext(args[1], vt))
    even, odd = _pairs(builder, p, 32)
    return builder.add(even, odd)


def _dot_ops(generic: bool):
    """(maddubs, dot_i8, madd, sum_pairs): the x86 instructions, or with generic their portable IR."""
    return (
        _dot_op(U8x32, I8x32, I16x16, lambda b, args, g: maddubs_ir(b, args[0], args[1], g),
                """U8x32 * I8x32 -> I16x16: lane i = a[2i]*b[2i] + a[2i+1]*b[2i+1].

        Exact for the kernels' inputs: weights <= 63 and |activation| <= 127 give |sum| <= 16002.""",
                generic),
        _dot_op(I8x32, I8x32, I16x16, _dot_i8_ir,
                """I8x32 * I8x32 -> I16x16 pair sums of signed bytes (ggml's abs/sign trick on AVX2).

        Exact when a lanes are > -128 (Q8_0 weights are in [-127, 127]) and |b| <= 127.""", generic),
        _dot_op(I16x16, I16x16, I32x8, lambda b, args, g: madd_ir(b, args[0], args[1], g),
                "I16x16 * I16x16 -> I32x8: lane i = a[2i]*b[2i] + a[2i+1]*b[2i+1].", generic),
        _dot_op(I16x16, None, I32x8, lambda b, args, g: madd_ir(b, args[0], _splat(1, I16x16.llvm()), g),
                "I16x16 -> I32x8: lane i = a[2i] + a[2i+1] (vpmaddwd with ones).", generic),
    )


def dpbusd_ir(builder, acc, a, b, generic: bool):
    """acc + u8 x i8 sums of 4 adjacent products -> i32 (vpdpbusd, AVX-512 VNNI / AVX-VNNI)."""
    if HAVE_VNNI and not generic:
        vt = I32x8.llvm()
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", vt,
                     [acc, builder.bitcast(a, vt), builder.bitcast(b, vt)])
    vt = ir.VectorType(_I32, 32)
    p = builder.mul(builder.zext(a, vt), builder.sext(b, vt))
    quads = [builder.shuffle_vector(p, p, _mask(range(k, 32, 4))) for k in range(4)]
    return builder.add(acc, builder.add(builder.add(quads[0], quads[1]), builder.add(quads[2], quads[3])))


def _make_dpbusd(generic: bool):
    @intrinsic
    def dpbusd(typingctx, acc, a, b):
        """I32x8 acc + (U8x32 a * I8x32 b): lane i += a[4i]*b[4i] + ... + a[4i+3]*b[4i+3], exact in
        32 bits (no saturation). One instruction on VNNI CPUs; elsewhere the same sums in plain IR."""
        if not (_is_vec(acc, I32x8) and _is_vec(a, U8x32) and _is_vec(b, I8x32)):
            return None

        def codegen(context, builder, sig, args):
            return dpbusd_ir(builder, args[0], args[1], args[2], generic)
        return I32x8(acc, a, b), codegen
    return dpbusd


maddubs, dot_i8, madd, sum_pairs = _dot_ops(generic=False)
# the portable forms, for tests on x86 machines
maddubs_generic, dot_i8_generic, madd_generic, sum_pairs_generic = _dot_ops(generic=True)
dpbusd, dpbusd_generic = _make_dpbusd(False), _make_dpbusd(True)


def _halves_i16(builder, a, b):
    """I16x16 IR with lanes 0-7 = the i16 value a and lanes 8-15 = b."""
    vt2 = ir.VectorType(_I16, 2)
    pair = builder.insert_element(builder.insert_element(ir.Constant(vt2, None), a, _I32(0)), b, _I32(1))
    return builder.shuffle_vector(pair, pair, _mask([0] * 8 + [1] * 8))


@intrinsic
def i16_halves(typingctx, a, b):
    """I16x16 with lanes 0-7 = a and lanes 8-15 = b (two 16-element sub-block scales)."""
    def codegen(context, builder, sig, args):
        return _halves_i16(builder, context.cast(builder, args[0], sig.args[0], types.int16),
                           context.cast(builder, args[1], sig.args[1], types.int16))
    return I16x16(a, b), codegen


pair_i16 = vec_int_op(lambda builder, v, m: _halves_i16(builder, builder.extract_element(v, m),
                                                      builder.extract_element(v, builder.add(m, _I32(1)))),
                      I16x16, "I16x16 with lanes 0-7 = v[m] and lanes 8-15 = v[m+1] (Q6_K: the two scales of a group).")


add_i16 = lanewise_op("add", I16x16, "a + b, lane-wise (wraps: callers keep the sums in range)")
add_i32 = lanewise_op("add", I32x8, "a + b, lane-wise")
sub_lanes_i32 = lanewise_op("sub", I32x8, "a - b, lane-wise")
sub_i16 = lanewise_op("sub", I16x16, "a - b, lane-wise")
shl_i16 = _const_op("shl", I16x16, "lanes << n (n an integer literal)")


sub_i32 = vec_int_op(lambda builder, v, x: builder.sub(v, splat_value(builder, x, v.type)), I32x8,
                     "I32x8 lanes minus the integer n in every lane.")


# --- activation quantization ----------------------------------------------------------

@intrinsic
def absmax32(typingctx, ary, idx):
    """max |x[idx : idx+32]| of a float32 array; NaN if any value is NaN (so a NaN in the activation
    turns the block's scale, and every output it touches, into NaN rather than vanishing).

    On the bits: with the sign cleared, a float's magnitude order is its bits' unsigned integer order,
    and every NaN lies above +inf, so one integer max finds the largest magnitude or a NaN. The float
    max reduction (llvm.vector.reduce.fmaximum, NaN-propagating) lowers to compare-and-blend chains,
    slower (the journal's "Figures that were in the code")."""
    def codegen(context, builder, sig, args):
        it = ir.VectorType(_I32, 32)
        x = builder.bitcast(_load(context, builder, sig.args[0], args[0], args[1],
                                  ir.VectorType(ir.FloatType(), 32), 4), it)
        magnitude = builder.and_(x, _splat(0x7FFFFFFF, it))
        return builder.bitcast(_call(builder, "llvm.vector.reduce.umax.v32i32", _I32, [magnitude]), ir.FloatType())
    return types.float32(ary, idx), codegen


def _rounded32(context, builder, sig, args):
    """<32 x i32> rint(x[idx : idx+32] * inv_scale) of an intrinsic's (ary, idx, inv_scale, ...)."""
    vt = ir.VectorType(ir.FloatType(), 32)
    x = _load(context, builder, sig.args[0], args[0], args[1], vt, 4)
    s = context.cast(builder, args[2], sig.args[2], types.float32)
    sv = builder.shuffle_vector(builder.insert_element(ir.Constant(vt, None), s, _I32(0)),
                                ir.Constant(vt, None), _mask([0] * 32))
    r = _call(builder, "llvm.rint.v32f32", vt, [builder.fmul(x, sv)])
    return builder.fptosi(r, ir.VectorType(_I32, 32))


@intrinsic
def round_store32(typingctx, ary, idx, inv_scale, out, oidx, pairs):
    """out[oidx : oidx+32] = int8(rint(x[idx : idx+32] * inv_scale)) and
    pairs[oidx/2 : oidx/2+16] = int16 sums of adjacent codes; returns the sum of the codes."""

    def codegen(context, builder, sig, args):
        q32 = _rounded32(context, builder, sig, args)
        q8 = builder.trunc(q32, ir.VectorType(ir.IntType(8), 32))
        builder.store(q8, _vec_ptr(context, builder, sig.args[3], args[3], args[4], q8.type), align=1)
        p32 = builder.add(builder.shuffle_vector(q32, q32, _mask(range(0, 32, 2))),
                          builder.shuffle_vector(q32, q32, _mask(range(1, 32, 2))))
        p16 = builder.trunc(p32, ir.VectorType(ir.IntType(16), 16))
        pidx = builder.ashr(args[4], ir.Constant(args[4].type, 1))
        builder.store(p16, _vec_ptr(context, builder, sig.args[5], args[5], pidx, p16.type), align=2)
        return _call(builder, "llvm.vector.reduce.add.v32i32", _I32, [q32])
    return types.int32(ary, idx, inv_scale, out, oidx, pairs), codegen


@intrinsic
def round_store32_u8(typingctx, ary, idx, inv_scale, out, oidx):
    """out[oidx : oidx+32] = uint8(rint(x[idx : idx+32] * inv_scale) + 128): round_store32's codes,
    offset to unsigned bytes for the unsigned operand of vpdpbusd / vpmaddubsw, with no pair sums;
    returns the sum of the codes (unused, LLVM drops it)."""

    def codegen(context, builder, sig, args):
        q32 = _rounded32(context, builder, sig, args)
        q8 = builder.trunc(q32, ir.VectorType(_I8, 32))
        u8 = builder.xor(q8, _splat(-128, q8.type))  # + 128 on a byte is a flip of its top bit
        builder.store(u8, _vec_ptr(context, builder, sig.args[3], args[3], args[4], u8.type), align=1)
        return _call(builder, "llvm.vector.reduce.add.v32i32", _I32, [q32])
    return types.int32(ary, idx, inv_scale, out, oidx), codegen
