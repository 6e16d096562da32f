"""Tensor ops on float32 NumPy arrays: the arithmetic every layer is made of.

Stateless and model-agnostic. Each op has a shape contract in its signature
comment and a trace-level `[perf]` event. Row-wise ops (norms, activations) are
small jitted kernels: as 4-5 NumPy calls their dispatch would cost more than the
arithmetic of a small model's row.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pyml.core import perf
from pyml.core.jit import FASTMATH

_perf = perf.get("pyml.core.ops")
# (name, details format) of the ops' spans, each of x's shape (gated_act: and the act); the fused
# decode step names its compiled ops with them
RMS_NORM_SPAN, LAYER_NORM_SPAN = ("rms_norm", "{}"), ("layer_norm", "{}")
GELU_TANH_SPAN, GELU_ERF_SPAN, SILU_SPAN = ("gelu", "{} tanh"), ("gelu", "{} erf"), ("silu", "{}")
GATED_SPAN = ("gated_act", "{} {}")

# Every kernel takes error_model="numpy": with Python's, each float division checks for zero
# and raises, and that branch keeps LLVM from vectorising the loop (a SiLU row ran 5x slower).
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# --- jitted kernels -----------------------------------------------------------

@numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def _rms_norm_rows(x, w, eps, unit_offset, out):  # x [T, d], w [d] -> out [T, d]
    T, d = x.shape
    for t in range(T):
        ss = 0.0
        for i in range(d):
            ss += np.float64(x[t, i]) * x[t, i]
        inv = np.float32(1.0 / math.sqrt(ss / d + eps))
        if unit_offset:
            for i in range(d):
                out[t, i] = x[t, i] * inv * (np.float32(1.0) + w[i])
        else:
            for i in range(d):
                out[t, i] = x[t, i] * inv * w[i]
    return out


@numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def _layer_norm_rows(x, w, b, eps, out):  # x [T, d] -> out [T, d]
    T, d = x.shape
    for t in range(T):
        mean = 0.0
        for i in range(d):
            mean += x[t, i]
        mean /= d
        var = 0.0
        for i in range(d):
            c = x[t, i] - mean
            var += c * c
        inv = 1.0 / math.sqrt(var / d + eps)
        for i in range(d):
            out[t, i] = np.float32((x[t, i] - mean) * inv) * w[i] + b[i]
    return out


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.int32), ir.FloatType())
    return types.float32(bits), codegen


def _flip_negative(builder, bits):
    """int32 bits with a negative float's magnitude bits inverted: float32 bits -> a key that orders
    as the floats do (NaN aside), and the key back (the map is its own inverse)."""
    i32 = ir.IntType(32)
    return builder.xor(bits, builder.and_(builder.ashr(bits, ir.Constant(i32, 31)), ir.Constant(i32, 0x7FFFFFFF)))


@intrinsic
def _order_key(typingctx, x):
    """An int32 that orders as the float32 x does (NaN aside)."""
    def codegen(context, builder, sig, args):
        return _flip_negative(builder, builder.bitcast(args[0], ir.IntType(32)))
    return types.int32(types.float32), codegen


@intrinsic
def _from_order_key(typingctx, key):
    """The float32 of an _order_key."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(_flip_negative(builder, args[0]), ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _max_i32(typingctx, a, b):
    """max of two int32 in 32-bit arithmetic (Numba's max widens to int64: 8 lanes a vector, not 16)."""
    def codegen(context, builder, sig, args):
        return builder.select(builder.icmp_signed(">", args[0], args[1]), args[0], args[1])
    return types.int32(types.int32, types.int32), codegen


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def max32(row, n):
    """The largest of row[0 .. n) (float32, no NaN, n >= 1), by integer keys: a float max chain
    without fastmath's nnan stays scalar (an attention row's 64 scores took 3.7x as long)."""
    best = _order_key(row[0])
    for j in range(1, n):
        best = _max_i32(best, _order_key(row[j]))
    return _from_order_key(best)


@intrinsic
def _fma32(typingctx, a, b, c):
    """a * b + c in float32 with one rounding (llvm.fma): fastmath may reassociate +, -, * but
    never splits this, which keeps the range reduction of exp32 exact."""
    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fn, [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)])
    return types.float32(a, b, c), codegen


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def exp32(x):
    """e^x in float32 as pure arithmetic (Cephes' expf), so that loops calling it vectorise.

    Numba compiles math.exp to one libm call per element (no vector math library here), which
    keeps every loop around it scalar: a Gemma prefill spent 27% of its time in GeGLU's tanh.
    n = round(x / ln 2), r = x - n ln 2 by two FMAs (ln 2 split in two constants: exact, and
    out of fastmath's reach), a degree-5 polynomial for e^r, 2^n written into the exponent bits.
    All in float32 (math.floor would give an int64 and a scalar loop). Error < 1 ulp (0.53
    measured); x is clamped to [-87, 88], the float32 range of e^x without denormals (callers
    add 1 to the result or divide by it: the clamp changes nothing there).
    """
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = _fma32(n, np.float32(-0.693359375), x)
    r = _fma32(n, np.float32(2.12194440e-4), r)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * r * r + r + np.float32(1.0)) * _f32_from_bits((np.int32(n) + np.int32(127)) << 23)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _silu1(v):
    return v / (np.float32(1.0) + exp32(-v))


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _gelu_tanh1(v):  # 0.5 v (1 + tanh u) = v sigmoid(2u): no cancellation for negative v
    u = np.float32(0.7978845608028654) * (v + np.float32(0.044715) * v * v * v)
    return v / (np.float32(1.0) + exp32(np.float32(-2.0) * u))


# Elementwise kernels run over rows in parallel when there are several (a prefill: 10-25x the
# scalar libm loops they replace); a single row (a decode step) stays on the calling thread, as
# a parallel region costs more than its few microseconds of work.

@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def _act_rows(x, act, gated, out):
    """out [T, n] = act(x) for x [T, n]; gated: act(x[:, :n]) * x[:, n:] for x [T, 2n] (SwiGLU,
    GeGLU). act: 0 silu, 1 gelu tanh, 2 gelu erf."""
    if x.shape[0] == 1:
        _act_row(x[0], act, gated, out[0])
    else:
        for t in numba.prange(x.shape[0]):
            _act_row(x[t], act, gated, out[t])
    return out


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _act_row(x, act, gated, out):  # the branches are loop-invariant: LLVM hoists them
    n = out.size
    for i in range(n):
        v = x[i]
        if act == 0:
            a = _silu1(v)
        elif act == 1:
            a = _gelu_tanh1(v)
        else:
            a = np.float32(0.5) * v * (np.float32(1.0) + np.float32(math.erf(v * 0.7071067811865476)))
        out[i] = a * x[n + i] if gated else a


@numba.njit(inline="always")
def _rotate(x, t, h, i, half, c, s, interleaved):
    """Pair i of x[t, h] turned by the angle whose cosine and sine are c, s: the pair (2i, 2i+1)
    when interleaved (ggml's normal mode), else (i, i + half) (NeoX mode, transformers' rotate_half)."""
    j, k = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
    a, b = x[t, h, j], x[t, h, k]
    x[t, h, j] = a * c - b * s
    x[t, h, k] = b * c + a * s


@numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def _rope_rows(x, pos, inv_freq, interleaved):  # x [T, H, hd] in place
    T, H, _ = x.shape
    half = inv_freq.shape[0]
    for t in range(T):
        for i in range(half):
            angle = (pos + t) * inv_freq[i]
            c, s = np.float32(math.cos(angle)), np.float32(math.sin(angle))
            for h in range(H):
                _rotate(x, t, h, i, half, c, s, interleaved)
    return x


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _angles(position, inv_freq, cos, sin):  # cos, sin [half] of one position (an int64)
    for i in range(inv_freq.shape[0]):
        angle = position * inv_freq[i]  # float64, as _rope_rows
        cos[i], sin[i] = np.float32(math.cos(angle)), np.float32(math.sin(angle))


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def _rope_table(positions, inv_freq, cos, sin):  # cos, sin [T, half] for positions [T] (int64)
    for t in numba.prange(cos.shape[0]):
        _angles(positions[t], inv_freq, cos[t], sin[t])
    return cos, sin


# by a table, a rotation is 4 multiplies a pair (Gemma 3's q of 512 positions: 60 µs on one
# thread), less than a parallel region costs on a loaded machine: it stays on the calling thread
@numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
def _rope_apply(x, cos, sin, interleaved):  # x [T, H, hd] in place, by the table of its T positions
    T, H, _ = x.shape
    half = cos.shape[1]
    for t in range(T):
        for h in range(H):
            for i in range(half):
                _rotate(x, t, h, i, half, cos[t, i], sin[t, i], interleaved)
    return x


# The row kernels the fused decode step (nn/fused.py) calls from inside its own kernels (a step's
# q and k share one position's angles: rope_angles, then rope_apply to each).
rms_norm_rows, layer_norm_rows, act_row = _rms_norm_rows, _layer_norm_rows, _act_row
rope_angles, rope_apply = _angles, _rope_apply


# Below this many multiply-adds a parallel region costs more than it saves: waking the
# second thread is ~3 µs on an idle machine and up to a scheduler tick (ms) on a busy one.
PARALLEL_MIN_WORK = 1 << 17


# --- public ops -----------------------------------------------------------------

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, unit_offset: bool = False,
             out: np.ndarray | None = None) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * (w or 1 + w), over the last axis; x [.., d]."""
    with _perf.trace(*RMS_NORM_SPAN, x.shape):
        x2 = x.reshape(-1, x.shape[-1])
        res = np.empty_like(x2) if out is None else out.reshape(x2.shape)
        _rms_norm_rows(x2, weight, eps, unit_offset, res)
        return res.reshape(x.shape)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * w + b over the last axis; x [.., d]."""
    with _perf.trace(*LAYER_NORM_SPAN, x.shape):
        x2 = x.reshape(-1, x.shape[-1])
        return _layer_norm_rows(x2, weight, bias, eps, np.empty_like(x2)).reshape(x.shape)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (GPT-2 `gelu_new`, Gemma `gelu_pytorch_tanh`)."""
    with _perf.trace(*GELU_TANH_SPAN, x.shape):
        return _activation(x, 1)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """GELU, exact erf form."""
    with _perf.trace(*GELU_ERF_SPAN, x.shape):
        return _activation(x, 2)


def silu(x: np.ndarray) -> np.ndarray:
    with _perf.trace(*SILU_SPAN, x.shape):
        return _activation(x, 0)


def _activation(x: np.ndarray, act: int) -> np.ndarray:  # x [.., n] -> act(x), same shape
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    return _act_rows(x2, act, False, np.empty_like(x2)).reshape(x.shape)


GATED_ACTS = {"silu": 0, "gelu_tanh": 1}


def gated(gate_up: np.ndarray, act: str) -> np.ndarray:
    """act(gate) * up for a fused [T, 2f] gate+up projection -> [T, f] (SwiGLU / GeGLU)."""
    with _perf.trace(*GATED_SPAN, gate_up.shape, act):
        T, f2 = gate_up.shape
        return _act_rows(gate_up, GATED_ACTS[act], True, np.empty((T, f2 // 2), np.float32))


def rope(x: np.ndarray, pos: int, inv_freq: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate x [T, n_heads, head_dim] in place for positions pos .. pos+T-1.

    interleaved: pairs (2i, 2i+1) (Meta layout); otherwise (i, i + head_dim/2) (rotate-half).
    """
    return _rope_rows(x, pos, inv_freq, interleaved)


def rope_table(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [T, len(inv_freq)] of the T positions (int64: a prefill's pos .. pos+T-1, or
    a batched step's rows, each at its sequence's position; the angles as `rope`'s)."""
    T = positions.shape[0]
    with _perf.trace("rope_table", "T={} pairs={}", T, inv_freq.shape[0]):
        half = inv_freq.shape[0]
        return _rope_table(positions, inv_freq, np.empty((T, half), np.float32), np.empty((T, half), np.float32))


def rope_by_table(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate x [T, n_heads, head_dim] in place by a rope_table of its T positions: a prefill's q and
    k, and every layer of one kind, share one table, where `rope` computes a float64 cos and sin per
    pair and call, on one thread (5.5% of Gemma 3's pp512; 1.95 -> 0.06 ms a layer, 1 thread)."""
    return _rope_apply(x, cos, sin, interleaved)


def warmup():
    """Compile the jitted ops on tiny inputs (see RuntimeConfig.warmup_thread_pool)."""
    x = np.ones((2, 8), np.float32)
    w = np.ones(8, np.float32)
    _rms_norm_rows(x, w, 1e-6, False, np.empty_like(x))
    _rms_norm_rows(x, w, 1e-6, True, np.empty_like(x))
    _layer_norm_rows(x, w, w, 1e-5, np.empty_like(x))
    for act in range(3):
        _act_rows(x, act, False, np.empty_like(x))
        _act_rows(x, act, True, np.empty((2, 4), np.float32))
    q = np.ones((2, 1, 8), np.float32)
    inv = np.ones(4, np.float64)
    _rope_rows(q, 0, inv, True)
    _rope_rows(q, 0, inv, False)
    cos, sin = _rope_table(np.arange(2), inv, np.empty((2, 4), np.float32), np.empty((2, 4), np.float32))
    _rope_apply(q, cos, sin, True)
    _rope_apply(q, cos, sin, False)
