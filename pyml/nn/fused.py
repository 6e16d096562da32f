"""The fused decode step: a model's blocks in as few compiled calls as their shapes allow, where
the layer-by-layer path (TransformerBlock, Attention, the feed-forwards) makes ~15 per block.

At T == 1 every op of a small model is a few µs of arithmetic behind ~5-15 µs of Python. So a
block's decode step runs as

    pre_attention   norm -> qkv (+ bias) -> (q/k norm) -> RoPE
    attention       KV write + decode attention (attention_kernels.decode_into)
    post_attention  o_proj (+ bias) -> (post norm) -> residual -> norm -> gate/up or up
                    -> activation -> down (+ bias) -> (post norm) -> residual

over the same kernels the layers call (pyml.quant's KernelSets and x8 kernels, core.ops' row
kernels) and buffers allocated once per block. Untimed, the three are one compiled call per
block (decode_layer), and FusedStep runs each stretch of like blocks (SmolLM2: all 30) as one
call (decode_layers: every layer's arrays reached by address from the first one's), timed or
not: with spans on, the same call times every op from inside. The layer-by-layer path stays the
reference (tests hold this one to it on every architecture and weight type).

Kernels are made per block *shape* (which norms, which weight types and layouts, which
activation), never per weight: a factory's closure holds only the shape's ints (shape_key), and
the weight kernels are picked at compile time by a literal type id (`_matvec`'s overload), so Numba's on-disk cache
keys them by those ints and a second process loads them instead of compiling (a closure that
captured the KernelSet's dispatchers would be recompiled by every process: its cache key
pickles them differently each time). SmolLM2 needs one kernel of each kind; a Q4_K_M file, with
Q6_K mixed in, a few.

Timing: when any of a block's spans is on, decode_layers reads the time-stamp counter around
every op - the cache write and the attention apart - and each layer's start, middle and end, and
(at trace) writes (op id, layer, start, end) into the run's EventBuffer (core/clock.py): no block
returns to Python. decode_region (a run of x8 blocks as one parallel region) writes the same
ticks and rows from whichever thread takes each one-thread step (see its section). The step itself only hands those rows and ticks to perf.defer; when the perf
buffer is drained, after the step, _layer_spans turns them into the spans the layer-by-layer
path opens - the same names, details, attributes and nesting (attention::forward holds the qkv
projection, the q/k norms, RoPE, kv_cache::update, attention::sdpa and o_proj) - and the block's
`attn` / `ffn` parts. With logging off no counter is read (`timed` is a runtime argument).
"""

from __future__ import annotations

import logging
import math
import threading
from functools import lru_cache

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic, overload

from pyml import quant
from pyml.core import atomics, clock, ops, perf
from pyml.core.jit import FASTMATH
from pyml.nn.attention import Attention
from pyml.nn.feed_forward import MLP, GatedMLP
from pyml.nn.linear import Linear
from pyml.nn.norm import LayerNorm, RMSNorm
from pyml.nn import attention_kernels
from pyml.quant import interleaved_gemv

_perf = perf.get("pyml.nn.block")
_ATTN_PERF = perf.get("pyml.nn.attention")
_KV_PERF, _SDPA_PERF = perf.get("pyml.nn.kv_cache"), attention_kernels.PERF
_PAIRS = clock.clock_pairs()
_NO_EVENTS = np.zeros((1, 4), np.int64)  # a debug step's op events: counted, never stored
_ACT_IDS = {ops.gelu_tanh: 1, ops.gelu_erf: 2, ops.silu: 0}
_EMPTY = np.zeros(0, np.float32)


# --- the weight kernels, chosen by literal type id -------------------------------------------

def _matvec(kind, layout, w, tail, x, out):
    """out [R] = W x for a weight of type `kind` (a literal), stored in the file's layout
    (layout 0: w, tail unused) or the x8 layout (layout 1: w = groups, tail = the last R % 8 rows)."""


@overload(_matvec, prefer_literal=True)
def _matvec_overload(kind, layout, w, tail, x, out):
    if not isinstance(kind, types.IntegerLiteral) or not isinstance(layout, types.IntegerLiteral):
        return None
    traits = quant.traits_of(kind.literal_value)
    gemv = traits.kernels.gemv
    if layout.literal_value == 1:
        groups_gemv = traits.interleaved.gemv

        def packed(kind, layout, w, tail, x, out):
            groups_gemv(w, x, out)
            if tail.shape[0]:
                gemv(tail, x, out[8 * w.shape[0]:])
        return packed

    def stored(kind, layout, w, tail, x, out):
        gemv(w, x, out)
    return stored


def _weight(lin: Linear):
    """(kind, layout, w, tail) of a Linear as the kernels read it."""
    data, qtype = lin.weight.data, lin.weight.qtype
    if isinstance(data, quant.Packed):
        return int(qtype), 1, data.groups, data.tail
    w = quant.kernel_view(data, qtype, lin.in_features)
    return int(qtype), 0, w, w[:0]


def _bias(lin: Linear):
    return _EMPTY if lin.bias is None else np.ascontiguousarray(lin.bias, dtype=np.float32)


# --- op ids: the events the kernels write ------------------------------------------------------
# pre_attention: the norm, then (quant, linear) per projection (one fused qkv or q, k, v), then
# the q/k norms and RoPE; post_attention: o_proj, the norms, the feed-forward's ops, its span.
A_NORM, A_MM, A_QNORM, A_KNORM, A_ROPE_Q, A_ROPE_K = 0, 1, 7, 8, 9, 10
B_MM_O, B_POST_ATTN, B_NORM, B_MM_1, B_ACT, B_MM_DOWN, B_FFN, B_POST_FFN = 0, 2, 3, 4, 8, 9, 11, 12
C_KV, C_SDPA = 0, 1  # between them, a timed decode_layers call's cache write and attention


@numba.njit(inline="always")
def _linear(events, trace, layer, op, kind, layout, w, tail, bias, x, out):
    t = clock.start(trace)
    _matvec(kind, layout, w, tail, x, out)
    clock.done(events, trace, op, layer, t)
    if bias.size:
        out += bias
    clock.done(events, trace, op + 1, layer, t)


@numba.njit(inline="always")
def _norm(kind, unit_offset, x, w, b, eps, out):  # kind 0: RMSNorm, 1: LayerNorm; x, out [1, d]
    if kind == 0:
        ops.rms_norm_rows(x, w, eps, unit_offset, out)
    else:
        ops.layer_norm_rows(x, w, b, eps, out)


# --- the two halves of a block, written once ---------------------------------------------------
# A block's shape reaches the bodies as a literal string of its ints (shape_key): the overloads
# below turn it back into ints at compile time, so every kernel that runs a half - decode_layer,
# decode_layers - shares one body, and the kernels' closures hold strings only (Numba's cache
# keys them by value: a second process loads them).

def shape_key(shape: tuple) -> str:
    return ",".join(str(int(v)) for v in shape)


def _shape_of(key) -> tuple:
    return tuple(int(v) for v in key.literal_value.split(","))


_BODY_OPTIONS = {"fastmath": FASTMATH, "error_model": "numpy"}


def _pre_step(shape, x, nw, nb, eps, wq, tq, bq, wk, tk, bk, wv, tv, bv, qn, kn, qk_eps, inv_freq, pos,
              h, qkv, q2, k2, q3, k3, nq, nkv, events, trace, layer):
    """norm -> qkv (+ bias) -> (q/k norm) -> RoPE for one token; `shape`: shape_key of PreShape's ints.
    Returns the counter at its start (0 when not tracing)."""


@overload(_pre_step, prefer_literal=True, jit_options=_BODY_OPTIONS)
def _pre_step_overload(shape, x, nw, nb, eps, wq, tq, bq, wk, tk, bk, wv, tv, bv, qn, kn, qk_eps, inv_freq, pos,
                       h, qkv, q2, k2, q3, k3, nq, nkv, events, trace, layer):
    if not isinstance(shape, types.StringLiteral):
        return None
    norm, unit_offset, n_proj, kq, lq, kk, lk, kv, lv, qk_norm, qk_unit, rope = _shape_of(shape)

    def pre_attention(shape, x, nw, nb, eps, wq, tq, bq, wk, tk, bk, wv, tv, bv, qn, kn, qk_eps, inv_freq, pos,
                      h, qkv, q2, k2, q3, k3, nq, nkv, events, trace, layer):
        t0 = clock.start(trace)
        _norm(norm, unit_offset, x, nw, nb, eps, h)
        clock.done(events, trace, A_NORM, layer, t0)
        if n_proj == 1:
            _linear(events, trace, layer, A_MM, kq, lq, wq, tq, bq, h[0], qkv)
        else:
            _linear(events, trace, layer, A_MM, kq, lq, wq, tq, bq, h[0], qkv[:nq])
            _linear(events, trace, layer, A_MM + 2, kk, lk, wk, tk, bk, h[0], qkv[nq:nq + nkv])
            _linear(events, trace, layer, A_MM + 4, kv, lv, wv, tv, bv, h[0], qkv[nq + nkv:])
        if qk_norm:
            t = clock.start(trace)
            ops.rms_norm_rows(q2, qn, qk_eps, qk_unit, q2)
            clock.done(events, trace, A_QNORM, layer, t)
            t = clock.start(trace)
            ops.rms_norm_rows(k2, kn, qk_eps, qk_unit, k2)
            clock.done(events, trace, A_KNORM, layer, t)
        if rope:
            t = clock.start(trace)
            ops.rope_rows(q3, pos, inv_freq, rope == 2)
            clock.done(events, trace, A_ROPE_Q, layer, t)
            t = clock.start(trace)
            ops.rope_rows(k3, pos, inv_freq, rope == 2)
            clock.done(events, trace, A_ROPE_K, layer, t)
        return t0

    return pre_attention


def _post_step(shape, ctx, wo, to, bo, x, pan_w, pan_eps, nw, nb, eps, w1, t1, b1, w2, t2, b2, wd, td, bd,
               pfn_w, pfn_eps, y, h, gu, a, events, trace, layer):
    """o_proj -> (post norm) -> residual -> norm -> feed-forward -> (post norm) -> residual, in place
    on x; `shape`: shape_key of PostShape's ints. Returns the counter at the norm and at the end."""


@overload(_post_step, prefer_literal=True, jit_options=_BODY_OPTIONS)
def _post_step_overload(shape, ctx, wo, to, bo, x, pan_w, pan_eps, nw, nb, eps, w1, t1, b1, w2, t2, b2, wd, td, bd,
                        pfn_w, pfn_eps, y, h, gu, a, events, trace, layer):
    if not isinstance(shape, types.StringLiteral):
        return None
    (ko, lo, post_attn, pan_unit, norm, unit_offset, mlp, k1, l1, k2, l2, kd, ld, act, post_ffn,
     pfn_unit) = _shape_of(shape)

    def post_attention(shape, ctx, wo, to, bo, x, pan_w, pan_eps, nw, nb, eps, w1, t1, b1, w2, t2, b2, wd, td, bd,
                       pfn_w, pfn_eps, y, h, gu, a, events, trace, layer):
        _linear(events, trace, layer, B_MM_O, ko, lo, wo, to, bo, ctx, y[0])
        if post_attn:
            t = clock.start(trace)
            ops.rms_norm_rows(y, pan_w, pan_eps, pan_unit, y)
            clock.done(events, trace, B_POST_ATTN, layer, t)
        x += y
        t_mid = clock.start(trace)
        _norm(norm, unit_offset, x, nw, nb, eps, h)
        clock.done(events, trace, B_NORM, layer, t_mid)
        t_ffn = clock.start(trace)
        if mlp == 0:  # down(act(up(x)))
            _linear(events, trace, layer, B_MM_1, k1, l1, w1, t1, b1, h[0], gu[0])
        elif mlp == 1:  # one fused gate_up
            _linear(events, trace, layer, B_MM_1, k1, l1, w1, t1, b1, h[0], gu[0])
        else:  # gate and up apart
            f = a.shape[1]
            _linear(events, trace, layer, B_MM_1, k1, l1, w1, t1, b1, h[0], gu[0, :f])
            _linear(events, trace, layer, B_MM_1 + 2, k2, l2, w2, t2, b2, h[0], gu[0, f:])
        t = clock.start(trace)
        ops.act_row(gu[0], act, mlp != 0, a[0])
        clock.done(events, trace, B_ACT, layer, t)
        _linear(events, trace, layer, B_MM_DOWN, kd, ld, wd, td, bd, a[0], y[0])
        clock.done(events, trace, B_FFN, layer, t_ffn)
        if post_ffn:
            t = clock.start(trace)
            ops.rms_norm_rows(y, pfn_w, pfn_eps, pfn_unit, y)
            clock.done(events, trace, B_POST_FFN, layer, t)
        x += y
        return t_mid, clock.start(trace)

    return post_attention


# --- the kernels: one block untimed, and a run of blocks (timed when asked) ----------------------

@lru_cache(maxsize=None)
def decode_layer_kernel(pre_shape: tuple, post_shape: tuple):
    """A whole block's untimed decode step in one compiled call: pre_attention, the KV write and
    decode attention (attention_kernels.decode_into), post_attention. One call where the timed path
    makes three and opens the attention's spans in Python between them: measured on SmolLM2
    (see docs/performance.md), the attention's Python span was ~4 us of a ~9 us call per layer."""
    pre_key, post_key = shape_key(pre_shape), shape_key(post_shape)

    @numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
    def decode_layer(x, nw, nb, eps, wq, tq, bq, wk, tk, bk, wv, tv, bv, qn, kn, qk_eps, inv_freq, pos,
                     h, qkv, q2, k2, q3, k3, nq, nkv, v3, keys, k_scale, values, v_scale, start, scale, splits, ctx,
                     wo, to, bo, out, pan_w, pan_eps, nw2, nb2, eps2, w1, t1, b1, w2, t2, b2, wd, td, bd,
                     pfn_w, pfn_eps, y, h2, gu, a, events, layer):
        _pre_step(pre_key, x, nw, nb, eps, wq, tq, bq, wk, tk, bk, wv, tv, bv, qn, kn, qk_eps, inv_freq, pos,
                  h, qkv, q2, k2, q3, k3, nq, nkv, events, False, layer)
        attention_kernels.decode_into(q3[0], k3, v3, keys, k_scale, values, v_scale, start, pos + 1, 0, scale, splits,
                                      ctx)
        out[:] = x
        _post_step(post_key, ctx.reshape(ctx.size), wo, to, bo, out, pan_w, pan_eps, nw2, nb2, eps2, w1, t1, b1,
                   w2, t2, b2, wd, td, bd, pfn_w, pfn_eps, y, h2, gu, a, events, False, layer)
        return out

    return decode_layer


@intrinsic
def _rebased(typingctx, arrays, addresses):
    """The tuple `arrays` with its arrays' data pointers replaced, in order, by `addresses` (int64
    [n arrays]): the same types, shapes and strides over another layer's memory. What lets one
    compiled call walk many layers without Numba unboxing every layer's ~40 arrays (~60 ns
    each): the caller checks that those layers' arrays agree in all but address (FusedStep)."""
    if not isinstance(arrays, types.BaseTuple) or not isinstance(addresses, types.Array):
        return None

    def codegen(context, builder, sig, args):
        tup, table = args[0], context.make_array(sig.args[1])(context, builder, args[1])
        k = 0
        for i, ty in enumerate(sig.args[0]):
            if isinstance(ty, types.Array):
                arr = context.make_array(ty)(context, builder, builder.extract_value(tup, i))
                at = builder.load(builder.gep(table.data, [context.get_constant(types.intp, k)]))
                arr.data = builder.inttoptr(at, arr.data.type)
                tup = builder.insert_value(tup, arr._getvalue(), i)
                k += 1
        context.nrt.incref(builder, sig.args[0], tup)  # a new reference: the template's owners
        return tup

    return arrays(arrays, addresses), codegen


def _addresses(values) -> list:
    """The data addresses of the arrays among `values`, in order (what _rebased reads)."""
    return [v.ctypes.data for v in values if isinstance(v, np.ndarray)]


@lru_cache(maxsize=None)
def decode_layers_kernel(pre_shape: tuple, post_shape: tuple):
    """decode_layer over consecutive blocks of one shape, in one compiled call: each layer's
    weights and cache arrays are the first layer's, rebased to its own addresses (pre_at, post_at,
    kv_at: int64 [layers, arrays]); the scratch buffers are shared, the layers running in turn.
    `timed`: each layer's start, middle and end ticks go to `ticks` [layers, 3] (its block span)
    and every op's event to `events` (LOG=trace: an EventBuffer's rows, layer = layer0 + the
    run's index, the model's layer; LOG=debug: a buffer that only counts them), the cache write
    and the attention apart (write_kv, then decode_into with nothing to write) as the
    layer-by-layer path's kv_cache::update and attention::sdpa."""
    pre_key, post_key = shape_key(pre_shape), shape_key(post_shape)

    @numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
    def decode_layers(x, pre_w, pre_at, bufs, post_w, post_at, kv, kv_at, start, pos, scale, splits, ctx, out,
                      events, timed, ticks, layer0):
        h, qkv, q2, k2, q3, k3, nq, nkv, v3, y, gu, a = bufs
        out[:] = x
        for layer in range(pre_at.shape[0]):
            nw, nb, eps, wq, tq, bq, wk, tk, bk, wv, tv, bv, qn, kn, qk_eps, inv_freq = _rebased(pre_w, pre_at[layer])
            t0 = _pre_step(pre_key, out, nw, nb, eps, wq, tq, bq, wk, tk, bk, wv, tv, bv, qn, kn, qk_eps, inv_freq,
                           pos, h, qkv, q2, k2, q3, k3, nq, nkv, events, timed, layer0 + layer)
            keys, k_scale, values, v_scale = _rebased(kv, kv_at[layer])
            if timed:  # the cache write and the attention timed apart
                t = clock.start(timed)
                attention_kernels.write_kv(k3, v3, pos, keys, k_scale, values, v_scale)
                clock.done(events, timed, C_KV, layer0 + layer, t)
                t = clock.start(timed)
                attention_kernels.decode_into(q3[0], k3[:0], v3[:0], keys, k_scale, values, v_scale, start, pos + 1, 0,
                                          scale, splits, ctx)
                clock.done(events, timed, C_SDPA, layer0 + layer, t)
            else:
                attention_kernels.decode_into(q3[0], k3, v3, keys, k_scale, values, v_scale, start, pos + 1, 0, scale,
                                          splits, ctx)
            (wo, to, bo, pan_w, pan_eps, fnw, fnb, f_eps, w1, t1, b1, w2, t2, b2, wd, td, bd, pfn_w,
             pfn_eps) = _rebased(post_w, post_at[layer])
            t_mid, t_end = _post_step(post_key, ctx.reshape(ctx.size), wo, to, bo, out, pan_w, pan_eps, fnw, fnb,
                                      f_eps, w1, t1, b1, w2, t2, b2, wd, td, bd, pfn_w, pfn_eps, y, h, gu, a, events,
                                      timed, layer0 + layer)
            if timed:
                ticks[layer, 0], ticks[layer, 1], ticks[layer, 2] = t0, t_mid, t_end
        return out

    return decode_layers


# --- the step as one parallel region ------------------------------------------------------------
# decode_layers makes ~5 parallel launches a layer (the q|k|v GEMV, the attention's parts, o_proj,
# gate|up, down), each ~1.5 µs to start on this machine plus the wait at its join for the slower
# thread. decode_region runs a whole stretch of layers in one region instead: its threads take
# each op's pieces (8-row groups of a matrix, the attention's (kv head, part) items) from an
# atomic counter, and wait at the op's end until its pieces are counted done (core/atomics.py);
# the one-thread steps between (norms, the activations' quantization, RoPE, the KV write, the
# softmax merge, residuals) are taken by whichever thread comes first. No thread waits for the
# other to start: a thread that comes late finds the pieces taken, so the region is also right
# on one thread. Taken when every matrix of the block is in the x8 layout with no tail rows and
# the projections are fused (q|k|v, gate|up or an up alone): SmolLM2's Q4_0 / Q4_1 / Q8_0 files.

_PHASES = 11  # counters per layer: see _region_layer
_SLOT = 16  # int64s between counters: claim and done counts on cache lines of their own
_LAST = 1  # a step's slot (timed): the latest tick a thread finished one of its pieces at
PIECES_PER_THREAD = 4  # a matrix's groups are claimed in about this many pieces per thread


def region_counters(n_layers: int) -> np.ndarray:
    """decode_region's counters for a run of n_layers: _PHASES steps a layer, and one slot more
    (timed: the latest tick recorded, _now)."""
    return np.zeros((n_layers * _PHASES + 1) * _SLOT, np.int64)


@numba.njit(inline="always")
def _first(counters, ph):
    """Whether this thread takes one-thread step `ph` (the first to ask does)."""
    return atomics.fetch_add(counters, _SLOT * ph, 1) == 0


@numba.njit(inline="always")
def _finish(counters, ph):
    atomics.fetch_add(counters, _SLOT * ph + _SLOT // 2, 1)


@numba.njit(inline="always")
def _wait(counters, ph, n):
    """Until n pieces of step `ph` are done (by any thread)."""
    while atomics.load(counters, _SLOT * ph + _SLOT // 2) < n:
        atomics.pause()


# --- timing inside the region ---------------------------------------------------------------
# Only the thread that takes a one-thread step records (the steps are ordered by the counters:
# what one wrote before its _finish the next one reads after its _wait), so the layer's ticks
# and its ops' events are written by one thread at a time. A step's pieces run on every thread:
# each piece, timed, puts its end into the step's _LAST slot (an atomic max) before counting
# itself done, and the next one-thread step reads the latest one - the op ran from its
# activation's quantization (the gemv's first work, as decode_layers times it) to its last
# piece done. Every tick is taken no earlier than the last one recorded (the counters' last
# slot): ticks read on two cores stay ordered, whatever their counters' skew.

@numba.njit(inline="always")
def _now(on, counters):
    """The counter (not before the latest tick recorded) when `on`, else 0 and no read."""
    if not on:
        return 0
    at = counters.size - _SLOT
    t = max(clock.ticks(), counters[at])
    counters[at] = t
    return t


@numba.njit(inline="always")
def _pieces_done(counters, ph):
    """The tick step ph's last piece was done at (timed), taken as the latest tick recorded."""
    at = counters.size - _SLOT
    t = max(atomics.load(counters, _SLOT * ph + _LAST), counters[at])
    counters[at] = t
    return t


@numba.njit(inline="always")
def _piece_done(counters, ph, timed):
    if timed:
        atomics.fetch_max(counters, _SLOT * ph + _LAST, clock.ticks())
    _finish(counters, ph)


@numba.njit(inline="always")
def _event(events, trace, r, op, layer, t0, t1):
    """Event row r (a slot of the layer's rows, decode_layers' end order): op ran from t0 to t1."""
    if trace:
        events[r, 0] = op
        events[r, 1] = layer
        events[r, 2] = t0
        events[r, 3] = t1


@numba.njit(inline="always")
def _quantize(kind, x, act):
    xq, xd, xs, xp, xoff, y8 = act
    interleaved_gemv.gemv_activation(kind, x, xq, xd, xs, xp, xoff, y8)


@numba.njit(inline="always")
def _gemv_pieces(counters, ph, kind, groups, act, out, n_threads, timed):
    """Step `ph`: out = W x over the x8 `groups`, in pieces claimed from the counter; x as
    interleaved_gemv.gemv_activation left it in `act`. Returns when every piece is done."""
    xq, xd, xs, xp, xoff, y8 = act
    y = interleaved_gemv.activation_bytes(kind, xq, y8)
    G = groups.shape[0]
    n = min(G, PIECES_PER_THREAD * n_threads)
    while True:
        c = atomics.fetch_add(counters, _SLOT * ph, 1)
        if c >= n:
            break
        for g in range(c * G // n, (c + 1) * G // n):
            interleaved_gemv.gemv_group_into(kind, groups, g, y, xq, xd, xs, xoff, out)
        _piece_done(counters, ph, timed)
    _wait(counters, ph, n)


@numba.njit(inline="always")
def _add_bias(out, bias):  # out += bias (a loop: no array expression for parallel=True to turn into a launch)
    for i in range(bias.size):
        out[i] += bias[i]


def region_slots(pre_shape: tuple, post_shape: tuple) -> tuple:
    """Where each event of a layer goes among its rows in a traced region (decode_layers' end
    order, which FusedBlock._layer_spans slices): (norm, q|k|v quant, linear, q norm, k norm,
    rope q, rope k, kv write, sdpa, o quant, linear, post-attention norm, ffn norm, up quant,
    linear, activation, down quant, linear, feed_forward, post-ffn norm, rows a layer); the
    slot of an op the shape lacks is -1."""
    qk_norm, rope = pre_shape[9], pre_shape[11]
    post_attn, post_ffn = post_shape[2], post_shape[14]
    slots, k = [], 0
    for present in (1, 1, 1, qk_norm, qk_norm, rope, rope, 1, 1, 1, 1, post_attn, 1, 1, 1, 1, 1, 1, 1, post_ffn):
        slots.append(k if present else -1)
        k += bool(present)
    return tuple(slots) + (k,)


def _region_layers(pre_key, post_key, pre_w, pre_at, bufs, post_w, post_at, kv, kv_at, act_d, act_q, act_f, attn_s,
                   start, pos, scale, splits, ctx, out, counters, n_threads, events, row, trace, timed, ticks, layer0):
    """One thread's walk through decode_region's layers (the module's one-region section)."""


@overload(_region_layers, prefer_literal=True, jit_options=_BODY_OPTIONS)
def _region_layers_overload(pre_key, post_key, pre_w, pre_at, bufs, post_w, post_at, kv, kv_at, act_d, act_q, act_f,
                            attn_s, start, pos, scale, splits, ctx, out, counters, n_threads, events, row, trace,
                            timed, ticks, layer0):
    if not isinstance(pre_key, types.StringLiteral) or not isinstance(post_key, types.StringLiteral):
        return None
    pre_shape, post_shape = _shape_of(pre_key), _shape_of(post_key)
    norm, unit_offset, _, kq, _, _, _, _, _, qk_norm, qk_unit, rope = pre_shape
    (ko, _, post_attn, pan_unit, fnorm, f_unit, mlp, k1, _, _, _, kd, _, act, post_ffn, pfn_unit) = post_shape
    (e_norm, e_qkv, e_qkv_lin, e_qn, e_kn, e_rq, e_rk, e_kv, e_sdpa, e_o, e_o_lin, e_pan, e_fn, e_up, e_up_lin, e_act,
     e_down, e_down_lin, e_ffn, e_pfn, n_ev) = region_slots(pre_shape, post_shape)

    def region_layers(pre_key, post_key, pre_w, pre_at, bufs, post_w, post_at, kv, kv_at, act_d, act_q, act_f,
                      attn_s, start, pos, scale, splits, ctx, out, counters, n_threads, events, row, trace, timed,
                      ticks, layer0):
        h, qkv, q2, k2, q3, k3, nq, nkv, v3, y, gu, a = bufs
        qs, qpos, m, l, acc, scores = attn_s
        n_kv = kv[2].shape[0]
        items = n_kv * splits
        end = pos + 1
        flat_ctx = ctx.reshape(ctx.size)
        for layer in range(pre_at.shape[0]):
            nw, nb, eps, wq, tq, bq, wk, tk, bk, wv, tv, bv, qn, kn, qk_eps, inv_freq = _rebased(pre_w, pre_at[layer])
            keys, k_scale, values, v_scale = _rebased(kv, kv_at[layer])
            (wo, to, bo, pan_w, pan_eps, fnw, fnb, f_eps, w1, t1, b1, w2, t2, b2, wd, td, bd, pfn_w,
             pfn_eps) = _rebased(post_w, post_at[layer])
            ph = _PHASES * layer
            li, r = layer0 + layer, row + layer * n_ev  # the model's layer; its first event row
            if _first(counters, ph):  # the attention norm; its output quantized for q|k|v
                t = _now(timed, counters)
                if timed:
                    ticks[layer, 0] = t
                _norm(norm, unit_offset, out, nw, nb, eps, h)
                t_mm = _now(trace, counters)
                _event(events, trace, r + e_norm, A_NORM, li, t, t_mm)
                _quantize(kq, h[0], act_d)
                if trace:
                    events[r + e_qkv, 2] = t_mm
                _finish(counters, ph)
            _wait(counters, ph, 1)
            _gemv_pieces(counters, ph + 1, kq, wq, act_d, qkv, n_threads, trace)
            if _first(counters, ph + 2):  # bias, q/k norms, RoPE, the KV write, the query rows
                t_mm = 0
                if trace:
                    t_mm = events[r + e_qkv, 2]
                    _event(events, trace, r + e_qkv, A_MM, li, t_mm, _pieces_done(counters, ph + 1))
                _add_bias(qkv, bq)
                t = _now(trace, counters)
                _event(events, trace, r + e_qkv_lin, A_MM + 1, li, t_mm, t)
                if qk_norm:
                    ops.rms_norm_rows(q2, qn, qk_eps, qk_unit, q2)
                    t_q = _now(trace, counters)
                    _event(events, trace, r + e_qn, A_QNORM, li, t, t_q)
                    ops.rms_norm_rows(k2, kn, qk_eps, qk_unit, k2)
                    t = _now(trace, counters)
                    _event(events, trace, r + e_kn, A_KNORM, li, t_q, t)
                if rope:
                    ops.rope_rows(q3, pos, inv_freq, rope == 2)
                    t_q = _now(trace, counters)
                    _event(events, trace, r + e_rq, A_ROPE_Q, li, t, t_q)
                    ops.rope_rows(k3, pos, inv_freq, rope == 2)
                    t = _now(trace, counters)
                    _event(events, trace, r + e_rk, A_ROPE_K, li, t_q, t)
                attention_kernels.write_kv(k3, v3, pos, keys, k_scale, values, v_scale)
                t_kv = _now(trace, counters)
                _event(events, trace, r + e_kv, C_KV, li, t, t_kv)
                attention_kernels.decode_begin(q3[0], scale, end, qs, qpos)
                if trace:
                    events[r + e_sdpa, 2] = t_kv
                _finish(counters, ph + 2)
            _wait(counters, ph + 2, 1)
            group = q3.shape[1] // n_kv
            while True:  # the attention's (kv head, part) items
                c = atomics.fetch_add(counters, _SLOT * (ph + 3), 1)
                if c >= items:
                    break
                attention_kernels.decode_item(c, splits, qs, qpos, group, keys, k_scale, values, v_scale, start, end, 0,
                                          m, l, acc, scores)
                _piece_done(counters, ph + 3, False)
            _wait(counters, ph + 3, items)
            if _first(counters, ph + 4):  # the parts merged; the context quantized for o_proj
                attention_kernels.decode_merge(n_kv, splits, group, m, l, acc, ctx)
                t_mm = _now(trace, counters)
                if trace:
                    _event(events, trace, r + e_sdpa, C_SDPA, li, events[r + e_sdpa, 2], t_mm)
                    events[r + e_o, 2] = t_mm
                _quantize(ko, flat_ctx, act_q)
                _finish(counters, ph + 4)
            _wait(counters, ph + 4, 1)
            _gemv_pieces(counters, ph + 5, ko, wo, act_q, y[0], n_threads, trace)
            if _first(counters, ph + 6):  # bias, post norm, residual, the FFN norm, quantized
                t_mm = 0
                if trace:
                    t_mm = events[r + e_o, 2]
                    _event(events, trace, r + e_o, B_MM_O, li, t_mm, _pieces_done(counters, ph + 5))
                _add_bias(y[0], bo)
                t = _now(trace, counters)
                _event(events, trace, r + e_o_lin, B_MM_O + 1, li, t_mm, t)
                if post_attn:
                    ops.rms_norm_rows(y, pan_w, pan_eps, pan_unit, y)
                    t_q = _now(trace, counters)
                    _event(events, trace, r + e_pan, B_POST_ATTN, li, t, t_q)
                _add_bias(out[0], y[0])
                t = _now(timed, counters)
                if timed:
                    ticks[layer, 1] = t
                _norm(fnorm, f_unit, out, fnw, fnb, f_eps, h)
                t_mm = _now(trace, counters)
                _event(events, trace, r + e_fn, B_NORM, li, t, t_mm)
                _quantize(k1, h[0], act_d)
                if trace:
                    events[r + e_up, 2] = t_mm
                    events[r + e_ffn, 2] = t_mm
                _finish(counters, ph + 6)
            _wait(counters, ph + 6, 1)
            _gemv_pieces(counters, ph + 7, k1, w1, act_d, gu[0], n_threads, trace)
            if _first(counters, ph + 8):  # bias, the activation, quantized for down
                t_mm = 0
                if trace:
                    t_mm = events[r + e_up, 2]
                    _event(events, trace, r + e_up, B_MM_1, li, t_mm, _pieces_done(counters, ph + 7))
                _add_bias(gu[0], b1)
                t = _now(trace, counters)
                _event(events, trace, r + e_up_lin, B_MM_1 + 1, li, t_mm, t)
                ops.act_row(gu[0], act, mlp != 0, a[0])
                t_mm = _now(trace, counters)
                _event(events, trace, r + e_act, B_ACT, li, t, t_mm)
                _quantize(kd, a[0], act_f)
                if trace:
                    events[r + e_down, 2] = t_mm
                _finish(counters, ph + 8)
            _wait(counters, ph + 8, 1)
            _gemv_pieces(counters, ph + 9, kd, wd, act_f, y[0], n_threads, trace)
            if _first(counters, ph + 10):  # bias, post norm, residual
                t_mm = 0
                if trace:
                    t_mm = events[r + e_down, 2]
                    _event(events, trace, r + e_down, B_MM_DOWN, li, t_mm, _pieces_done(counters, ph + 9))
                _add_bias(y[0], bd)
                t = _now(trace, counters)
                if trace:
                    _event(events, trace, r + e_down_lin, B_MM_DOWN + 1, li, t_mm, t)
                    _event(events, trace, r + e_ffn, B_FFN, li, events[r + e_ffn, 2], t)
                if post_ffn:
                    ops.rms_norm_rows(y, pfn_w, pfn_eps, pfn_unit, y)
                    t_q = _now(trace, counters)
                    _event(events, trace, r + e_pfn, B_POST_FFN, li, t, t_q)
                _add_bias(out[0], y[0])
                t = _now(timed, counters)
                if timed:
                    ticks[layer, 2] = t
                _finish(counters, ph + 10)
            _wait(counters, ph + 10, 1)

    return region_layers


@lru_cache(maxsize=None)
def decode_region_kernel(pre_shape: tuple, post_shape: tuple):
    """decode_layers as one parallel region over its layers (see above); the shapes must pass
    region_shapes_ok. `timed`: each layer's start, middle and end ticks go to `ticks` [layers, 3],
    as decode_layers writes them; `trace`: every op's event too, into `events` from `row` on
    (region_slots' rows a layer, in decode_layers' order; layer = layer0 + the run's index)."""
    pre_key, post_key = shape_key(pre_shape), shape_key(post_shape)
    n_ev = region_slots(pre_shape, post_shape)[-1]

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
    def decode_region(x, pre_w, pre_at, bufs, post_w, post_at, kv, kv_at, act_d, act_q, act_f, attn_s, start, pos,
                      scale, splits, ctx, out, counters, n_threads, events, row, trace, timed, ticks, layer0):
        # n_threads: numba.get_num_threads() from Python (called in here it is a ctypes pointer,
        # which keeps the kernel out of the disk cache)
        for i in range(counters.size):
            counters[i] = 0
        for i in range(x.shape[1]):
            out[0, i] = x[0, i]
        for _ in numba.prange(n_threads):
            _region_layers(pre_key, post_key, pre_w, pre_at, bufs, post_w, post_at, kv, kv_at, act_d, act_q, act_f,
                           attn_s, start, pos, scale, splits, ctx, out, counters, n_threads, events, row, trace,
                           timed, ticks, layer0)
        if trace:  # the rows written: as decode_layers' appends would have counted them
            events[0, 0] = row - 1 + pre_at.shape[0] * n_ev
        return out

    return decode_region


def region_shapes_ok(pre_shape: tuple, post_shape: tuple) -> bool:
    """Whether decode_region implements blocks of these shapes: fused projections, every matrix
    in the x8 layout (the tails are checked by the caller: FusedBlock.region_ok)."""
    n_proj, lq = pre_shape[2], pre_shape[4]
    lo, mlp, l1, ld = post_shape[1], post_shape[6], post_shape[8], post_shape[12]
    return n_proj == 1 and lq == 1 and lo == 1 and mlp in (0, 1) and l1 == 1 and ld == 1


def can_fuse(block) -> bool:
    """Whether a block is made of the layers the fused kernels implement."""
    attn, ffn = block.attn, block.ffn
    norms = [block.attn_norm, block.ffn_norm]
    post = [n for n in (block.post_attn_norm, block.post_ffn_norm) if n is not None]
    return (isinstance(attn, Attention) and isinstance(ffn, (MLP, GatedMLP))
            and all(isinstance(n, (RMSNorm, LayerNorm)) for n in norms)
            and all(isinstance(n, RMSNorm) for n in post)
            and (attn.q_norm is None or isinstance(attn.q_norm, RMSNorm))
            and (attn.rope is None or attn.rope.rotary_dim == attn.rope.head_dim))


class FusedBlock:
    """A TransformerBlock's decode step in one compiled call (see the module doc). Made once per block,
    after the weights are packed; holds the argument lists and scratch buffers."""

    def __init__(self, block):
        self.block = block
        attn, ffn = block.attn, block.ffn
        H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
        nq, nkv = H * hd, Hkv * hd
        d = block.attn_norm.weight.shape[0]
        self.qkv = np.zeros(nq + 2 * nkv, np.float32)
        q2, k2 = self.qkv[:nq].reshape(H, hd), self.qkv[nq:nq + nkv].reshape(Hkv, hd)
        self.q3, self.k3 = q2.reshape(1, H, hd), k2.reshape(1, Hkv, hd)
        self.v3 = self.qkv[nq + nkv:].reshape(1, Hkv, hd)
        self.x, self.h, self.y = (np.zeros((1, d), np.float32) for _ in range(3))
        self._busy = threading.Lock()

        projs = [attn.qkv] if isinstance(attn.qkv, Linear) else list(attn.qkv)
        ws = [_weight(p) for p in projs]
        while len(ws) < 3:
            ws.append(ws[0])
        bs = [_bias(p) for p in projs] + [_EMPTY] * (3 - len(projs))
        rope = 0 if attn.rope is None else (2 if attn.rope.style == "interleaved" else 1)
        qk_norm = attn.q_norm is not None
        norm = block.attn_norm
        pre_shape = (_norm_kind(norm), int(getattr(norm, "unit_offset", False)), len(projs),
                     ws[0][0], ws[0][1], ws[1][0], ws[1][1], ws[2][0], ws[2][1],
                     int(qk_norm), int(qk_norm and attn.q_norm.unit_offset), rope)
        self.pre_args = (norm.weight, _norm_bias(norm), norm.eps,
                         ws[0][2], ws[0][3], bs[0], ws[1][2], ws[1][3], bs[1], ws[2][2], ws[2][3], bs[2],
                         attn.q_norm.weight if qk_norm else _EMPTY, attn.k_norm.weight if qk_norm else _EMPTY,
                         attn.q_norm.eps if qk_norm else 0.0,
                         _EMPTY.astype(np.float64) if attn.rope is None else attn.rope.inv_freq)
        self.pre_bufs = (self.h, self.qkv, q2, k2, self.q3, self.k3, nq, nkv)

        if isinstance(ffn, MLP):
            mlp, ups, act = 0, [ffn.up], _ACT_IDS[ffn.act]
        else:
            mlp, ups = (1, [ffn.gate_up]) if ffn.fused else (2, [ffn.gate, ffn.up])
            act = ops.GATED_ACTS[ffn.act]
        f = ffn.down.in_features
        self.gu = np.zeros((1, f if mlp == 0 else 2 * f), np.float32)
        self.a = np.zeros((1, f), np.float32)
        w1, w2 = _weight(ups[0]), _weight(ups[-1])
        wo, wd = _weight(attn.o_proj), _weight(ffn.down)
        pan, pfn, fnorm = block.post_attn_norm, block.post_ffn_norm, block.ffn_norm
        post_shape = (wo[0], wo[1], int(pan is not None), int(pan is not None and pan.unit_offset),
                      _norm_kind(fnorm), int(getattr(fnorm, "unit_offset", False)), mlp,
                      w1[0], w1[1], w2[0], w2[1], wd[0], wd[1], act, int(pfn is not None),
                      int(pfn is not None and pfn.unit_offset))
        self.post_args = (wo[2], wo[3], _bias(attn.o_proj))
        self.post_args2 = (_EMPTY if pan is None else pan.weight, 0.0 if pan is None else pan.eps,
                           fnorm.weight, _norm_bias(fnorm), fnorm.eps,
                           w1[2], w1[3], _bias(ups[0]), w2[2], w2[3], _bias(ups[-1]), wd[2], wd[3], _bias(ffn.down),
                           _EMPTY if pfn is None else pfn.weight, 0.0 if pfn is None else pfn.eps,
                           self.y, self.h, self.gu, self.a)
        self.shapes = (pre_shape, post_shape)
        self.layer = decode_layer_kernel(pre_shape, post_shape)
        self.ctx = np.zeros((H, attn.head_dim), np.float32)
        self.step_bufs = (self.h, self.qkv, q2, k2, self.q3, self.k3, nq, nkv, self.v3, self.y, self.gu, self.a)
        self.window = attn.window or 0
        self.tables = _op_tables(block, projs, ups, mlp, d, H, Hkv, hd, f)
        self.op_loggers = {op.perf for table in self.tables for op in table if op is not None}
        self.op_loggers |= {_ATTN_PERF, _KV_PERF, _SDPA_PERF}
        self._attn_tables = {}  # kv type -> the cache write's and attention's Ops (_attention_ops)
        # every op of a table writes one event a call, and the cache write and attention one each:
        # a traced call's events take these many rows per layer
        self.n_pre, self.n_post = (sum(op is not None for op in table) for table in self.tables)
        self.n_events = self.n_pre + 2 + self.n_post
        self.events = clock.EventBuffer(64 * self.n_events)  # 64 steps: records are made later (_run_spans)
        self.ticks = TickPool(1)  # a timed call's (start, middle, end)
        self._run = None  # this block alone as a decode_layers run (_solo)

    def __call__(self, x: np.ndarray, pos: int, cache) -> np.ndarray:
        # generations on several threads may share a model: they take turns in a block (its
        # buffers are one set) and each leaves with its own copy of the output
        with self._busy:
            return self._step(x, pos, cache).copy()

    def _step(self, x, pos, cache):
        block, events = self.block, self.events.events
        ops_on = any(p.trace_on for p in self.op_loggers)
        if ops_on or _perf.debug_on:
            return _call(self._solo(), x, pos, cache, cache.addresses(), ops_on, True, self.ticks.take())
        i, attn = block.index, block.attn
        cache.claim(i, pos)  # the kernel writes the position's key and value
        start = max(0, pos + 1 - self.window) if self.window else 0
        splits = attention_kernels.decode_plan(self.ctx.size, attn.n_kv_heads, pos + 1 - start)
        return self.layer(x, *self.pre_args, pos, *self.pre_bufs, self.v3, *cache.layer(i), start, attn.scale,
                          splits, self.ctx, *self.post_args, self.x, *self.post_args2, events, i)

    def _solo(self) -> tuple:
        """This block as a run of one (FusedStep.runs' tuple): its timed step is FusedStep's."""
        if self._run is None:
            i = self.block.index
            self._run = (self, decode_layers_kernel(*self.shapes), range(i, i + 1),
                         np.array([_addresses(self.pre_args)], np.int64),
                         np.array([_addresses(self.post_weights())], np.int64), [self])
        return self._run

    def _attention_ops(self, kv_type: str) -> list:
        """The Ops of a timed call's cache write and attention (C_KV, C_SDPA), as KVCache.update and
        attention_kernels.attend_decode name them for this cache type."""
        ops_ = self._attn_tables.get(kv_type)
        if ops_ is None:
            a, i = self.block.attn, self.block.index
            window = self.window
            span = clock.AtPos((lambda pos: min(pos + 1, window)) if window else (lambda pos: pos + 1))
            ops_ = self._attn_tables[kv_type] = [
                clock.Op(_KV_PERF.name, "kv_cache::update", "layer={} pos={} {}", i, clock.POS, kv_type, layer=i,
                         op="kv_cache"),
                clock.Op(_SDPA_PERF.name, "attention::sdpa", "q=[{}, {}] kv=[{}, {}, {}] {}", a.n_heads, a.head_dim,
                         a.n_kv_heads, span, a.head_dim, kv_type, op="sdpa")]
        return ops_

    def _layer_spans(self, rows, parent, depth, ctx, thread, pos, kv_type, t0, t_mid, t_end, cal) -> list:
        """The spans of one layer of a timed call, in end order, as the layer-by-layer path opens
        them: the attention norm (the block's), the projections, q/k norms, RoPE, the cache write,
        the attention and o_proj (the attention span's), the attention span, the feed-forward and
        norms (the block's), the block span with its `attn` / `ffn` parts. `rows`: the layer's
        event rows (pre_attention's, the cache write's and attention's, post_attention's), empty
        at debug; t0, t_mid, t_end: its ticks."""
        to_s = _seconds(cal, t0)
        s0, s_mid, s_end = to_s(t0), to_s(t_mid), to_s(t_end)
        block_id = perf.new_id() if _perf.debug_on else None
        up, up_depth, floor = _parent_of(parent, depth, block_id, s0)
        out = []
        if rows:
            i, n_pre, (pre, post) = self.block.index, self.n_pre, self.tables
            attention = (clock.op_items({i: pre}, pos, rows[1:n_pre], cal)
                         + clock.op_items({i: self._attention_ops(kv_type)}, pos, rows[n_pre:n_pre + 2], cal)
                         + clock.op_items({i: post}, pos, rows[n_pre + 2:n_pre + 4], cal))
            out += perf.nest(clock.op_items({i: pre}, pos, rows[:1], cal), up, up_depth, ctx, thread, floor)
            if _ATTN_PERF.trace_on:
                attn_id = perf.new_id()
                attn = to_s(rows[1][2]), to_s(rows[n_pre + 3][3])  # the first projection's start .. o_proj's end
                out += perf.nest(attention, attn_id, up_depth + 1, ctx, thread, perf._on_grid(attn[0], up=True))
                out.append(perf.span_at(*_attention_span(self.block, pos), *attn, up, up_depth, ctx, thread,
                                        span_id=attn_id, floor=floor))
            else:
                out += perf.nest(attention, up, up_depth, ctx, thread, floor)
            out += perf.nest(clock.op_items({i: post}, pos, rows[n_pre + 4:], cal), up, up_depth, ctx, thread, floor)
        if block_id is not None:  # its ends pushed out to the µs grid: its parts and ops fit inside
            b = self.block
            out.append(perf.span_at(_perf, logging.DEBUG, b._event, "", (),
                                    {"module": b.name, "op": "block", "layer": b.index, "kind": b.attn.kind},
                                    math.floor(s0 * 1e6) / 1e6, perf._on_grid(s_end, up=True),
                                    parent.id if parent is not None else None, depth, ctx, thread,
                                    span_id=block_id, parts={"attn": s_mid - s0, "ffn": s_end - s_mid},
                                    floor=_floor(parent)))
        return out


    def region_ok(self) -> bool:
        """Whether decode_region implements this block (region_shapes_ok, and no tail rows)."""
        tails = (self.pre_args[4], self.post_args[1], self.post_args2[6], self.post_args2[12])
        return region_shapes_ok(*self.shapes) and all(t.shape[0] == 0 for t in tails)

    def post_weights(self) -> tuple:
        """post_attention's weights and constants: post_args and post_args2 without the buffers."""
        weights = self.__dict__.get("_post_weights")  # the same tuple every step: made once
        if weights is None:
            weights = self._post_weights = self.post_args + self.post_args2[:-4]
        return weights

    def signature(self) -> tuple:
        """What blocks walked by one decode_layers call must share: the kernel shapes, the window,
        and every weight array's type, shape and strides (its address aside) and every constant."""
        def describe(v):
            if isinstance(v, np.ndarray):
                return v.dtype.str, v.shape, v.strides, v.flags.writeable, v.flags.aligned
            return v
        attn = self.block.attn
        return (self.shapes, self.window, float(attn.scale),
                tuple(describe(v) for v in self.pre_args + self.post_weights()))


def _seconds(cal, k_near):
    """Ticks near k_near -> perf_counter seconds (one reference pair for a whole call's times)."""
    k_ref, t_ref, per_tick = cal.reference(k_near)
    return lambda k: t_ref + (k - k_ref) * per_tick


def _floor(span) -> float:
    return perf._on_grid(span.t0, up=True) if span is not None else 0.0


def _parent_of(parent, depth, block_id, start) -> tuple:
    """(parent id, depth, floor) of the block's own ops: the block span when it is on (it starts
    at `start`, seconds), else the block's parent."""
    if block_id is not None:
        return block_id, depth + 1, max(math.floor(start * 1e6) / 1e6, _floor(parent))
    return (parent.id if parent is not None else None), depth, _floor(parent)


class FusedStep:
    """A decode step through all of a model's blocks: each run of consecutive blocks of one
    signature (SmolLM2: all 30; Gemma 3: its sliding and global layers apart) is one
    decode_layers call, where FusedBlock makes one per block. What that leaves out per block - a
    Python call chain, ~60 arguments unboxed, a lock, a copy - was ~7 us of SmolLM2's ~100 us
    layers. A run whose blocks decode_region implements is one parallel region instead, timed or
    not. Timed (spans on) the same calls time every op from inside; a block set to the reference
    path, and the blocks run one by one."""

    timed_in_region = True  # False: timed steps through decode_layers (as before; to compare them)

    def __init__(self, blocks, fused):
        self.blocks, self.fused = blocks, fused
        self.op_loggers = set().union(*(f.op_loggers for f in fused))
        self.runs = []  # (first FusedBlock, its kernel, layer indices, pre_at, post_at, the run's FusedBlocks)
        i = 0
        while i < len(fused):
            j = i + 1
            while j < len(fused) and fused[j].signature() == fused[i].signature():
                j += 1
            first = fused[i]
            self.runs.append((first, decode_layers_kernel(*first.shapes), range(i, j),
                              np.array([_addresses(f.pre_args) for f in fused[i:j]], np.int64),
                              np.array([_addresses(f.post_weights()) for f in fused[i:j]], np.int64), fused[i:j]))
            # a traced call writes the whole run's events into its first block's buffer: 64 steps' worth
            first.events = clock.EventBuffer(64 * (j - i) * first.n_events)
            i = j
        # a timed call's (start, middle, end) per layer: a pool per run, taken from under the run's
        # lock (one array for the step was written by two threads' runs at once)
        self.ticks = [TickPool(len(layers)) for _, _, layers, *_ in self.runs]
        # the step of a run whose blocks decode_region implements: (kernel, counters, activation
        # buffers, attention scratch), or None
        self.regions = [self._region(first, len(layers)) for first, _, layers, *_ in self.runs]

    @staticmethod
    def _region(first, n_layers):
        if not first.region_ok():
            return None
        attn = first.block.attn
        d, f = first.h.shape[1], first.a.shape[1]
        return [decode_region_kernel(*first.shapes), region_counters(n_layers),
                interleaved_gemv.gemv_buffers(d), interleaved_gemv.gemv_buffers(attn.n_heads * attn.head_dim),
                interleaved_gemv.gemv_buffers(f), None]

    def _attention_scratch(self, region, first, cache, layer, items):
        """The region's attention buffers, made (again) when the cache's head_dim or the items grow."""
        attn, hdp = first.block.attn, cache.layer(layer)[2].shape[2]
        s = region[5]
        if s is None or s[0].shape[2] != hdp or s[2].shape[0] < items:
            region[5] = s = attention_kernels.decode_scratch(attn.n_heads, attn.n_kv_heads, hdp, items)
        return s

    def _region_call(self, run, region, x, pos, cache, kv_at, ops_on, timed, ticks, n_threads):
        """One decode_region call over a run of like blocks; timed, what it recorded is deferred
        as _call's is (the same rows and ticks)."""
        first, _, layers, pre_at, post_at, _ = run
        start = _claim(first, layers, pos, cache)
        attn = first.block.attn
        splits = attention_kernels.decode_splits(attn.n_kv_heads, pos + 1 - start, n_threads)
        scratch = self._attention_scratch(region, first, cache, layers[0], attn.n_kv_heads * splits)
        events, row = _event_rows(first, layers, ops_on)
        out = region[0](x, first.pre_args, pre_at, first.step_bufs, first.post_weights(), post_at,
                        cache.layer(layers[0]), kv_at[layers[0]:layers[-1] + 1], region[2], region[3], region[4],
                        scratch, start, pos, attn.scale, splits, first.ctx, first.x, region[1],
                        n_threads, events, row, ops_on, timed, ticks, layers[0])
        if timed:
            _defer(run, events, row, ticks, pos, cache)
        return out

    def __call__(self, x: np.ndarray, pos: int, cache) -> np.ndarray:
        if not all(b.fused_decode for b in self.blocks):
            for block in self.blocks:
                x = block(x, pos, cache)
            return x
        ops_on = any(p.trace_on for p in self.op_loggers)
        timed = ops_on or _perf.debug_on
        in_region = self.timed_in_region or not timed
        kv_at = cache.addresses()
        n_threads = numba.get_num_threads()
        # A model shared by threads: its buffers (and ticks) are one set a run, so a run's lock is
        # held until the next run has read the output it left in its buffer (each kernel copies
        # its input first), and the step leaves with a copy of the last. The locks are taken in
        # the runs' order: no two threads wait on each other. A copy after every run cost Gemma
        # 3's 14 runs ~50 µs a step, on caches its weights had just flushed.
        held = None
        try:
            for run, region, pool in zip(self.runs, self.regions, self.ticks):
                run[0]._busy.acquire()
                try:
                    ticks = pool.take() if timed else pool.untimed
                    if region is not None and in_region:
                        x = self._region_call(run, region, x, pos, cache, kv_at, ops_on, timed, ticks, n_threads)
                    else:
                        x = _call(run, x, pos, cache, kv_at, ops_on, timed, ticks, n_threads)
                finally:
                    if held is not None:
                        held.release()
                    held = run[0]._busy
            return x.copy()
        finally:
            if held is not None:
                held.release()


def _claim(first, layers, pos, cache) -> int:
    """Claims the position in each layer's cache (the kernel writes its keys and values); returns
    the first position the attention reads (a sliding window's start)."""
    cache.claim_layers(layers, pos)
    return max(0, pos + 1 - first.window) if first.window else 0


def _event_rows(first, layers, ops_on) -> tuple:
    """(events array, first row) a call over `layers` writes its op events to: the run's
    EventBuffer's next rows when tracing, else rows never written (row 0)."""
    if ops_on:
        return first.events.reserve(len(layers) * first.n_events)
    return first.events.events, 0


def _call(run, x, pos, cache, kv_at, ops_on, timed, ticks, n_threads=None):
    """One decode_layers call over a run of like blocks (FusedStep.runs' tuple). Timed, nothing is
    made here: the layers' ticks, the rows their events took in the run's EventBuffer (at trace)
    and the few Python fields the records need go to perf.defer, and _run_spans makes the spans
    when the perf buffer is drained, after the step."""
    first, kernel, layers, pre_at, post_at, fused = run
    start = _claim(first, layers, pos, cache)
    attn = first.block.attn
    splits = attention_kernels.decode_plan(first.ctx.size, attn.n_kv_heads, pos + 1 - start, n_threads)
    events, row = _event_rows(first, layers, ops_on)
    if timed and not ops_on:  # debug: the ops' events counted and dropped
        events = _NO_EVENTS
    out = kernel(x, first.pre_args, pre_at, first.step_bufs, first.post_weights(), post_at, cache.layer(layers[0]),
                 kv_at[layers[0]:layers[-1] + 1], start, pos, attn.scale, splits, first.ctx, first.x, events, timed,
                 ticks, layers[0])
    if timed:
        _defer(run, events, row, ticks, pos, cache)
    return out


class TickPool:
    """A run's timed calls' ticks, (start, middle, end) per layer: each call takes rows of its own,
    which stay as they are until its deferred records have read them; when the pool is used up a
    fresh one takes its place (the old one lives as long as the entries that point into it), as
    EventBuffer's rows do. Copying each call's ticks out instead (`tolist`) cost ~11 µs of a
    SmolLM2 step at debug, on the caches its weights had just flushed."""

    def __init__(self, n_layers: int, calls: int = 64):
        self.rows = np.zeros((calls, n_layers, 3), np.int64)
        self.next = 0
        self.untimed = np.zeros((n_layers, 3), np.int64)  # an untimed call's: never written

    def last(self) -> np.ndarray:
        """The rows the latest timed call took."""
        return self.rows[self.next - 1]

    def take(self) -> np.ndarray:
        if self.next == len(self.rows):
            self.rows = np.zeros_like(self.rows)
            self.next = 0
        self.next += 1
        return self.rows[self.next - 1]


def _defer(run, events, row, ticks, pos, cache):
    """A timed call's ticks (its own rows of a TickPool), event rows and context to perf.defer."""
    stack, ctx, thread = perf.frame()
    perf.defer((_run_spans, run[5], events, row, ticks, stack[-1] if stack else None, len(stack), ctx,
                thread, pos, cache.kv_type))
    if ticks[-1, 2] > _PAIRS.due:  # a (ticks, perf_counter) pair now and then, to convert with later
        _PAIRS.note()


def _run_spans(fused, events, row, ticks, parent, depth, ctx, thread, pos, kv_type) -> list:
    """The spans of a timed decode_layers call (perf.defer's entry), layer after layer."""
    cal = clock.calibration()
    layer_ticks = ticks.tolist()
    n = fused[0].n_events
    rows = events[row:row + len(fused) * n].tolist() if row else []
    out = []
    for k, f in enumerate(fused):
        out += f._layer_spans(rows[k * n:(k + 1) * n], parent, depth, ctx, thread, pos, kv_type, *layer_ticks[k],
                              cal)
    return out


def _norm_kind(norm) -> int:
    return 1 if isinstance(norm, LayerNorm) else 0


def _norm_bias(norm):
    return norm.bias if isinstance(norm, LayerNorm) else _EMPTY


def _attention_span(block, pos):
    """(PerfLogger, level, name, fmt, args, attrs) of the attention::forward span Attention opens."""
    a = block.attn
    return (_ATTN_PERF, perf.TRACE, "attention::forward", "layer={} {} tokens={} pos={}",
            (block.index, a.kind, 1, pos), {"module": a.name, "op": "attention", "layer": block.index,
                                            "kind": a.kind})


def _linear_ops(lin: Linear) -> list:
    """(quant::matmul, linear::forward) of a Linear at T == 1, as Linear.__call__ names them."""
    return [clock.Op("pyml.nn.linear", lin._quant_event, "[{}x{}]x[{}x{}]", 1, lin.in_features,
                     lin.out_features, lin.in_features, module=lin.name, op="quant_matmul"),
            clock.Op("pyml.nn.linear", "linear::forward", "{}->{} {}", (1, lin.in_features), lin._dims,
                     lin._type_name, module=lin.name, op="linear", dtype=lin._type_name)]


def _norm_op(norm, shape) -> clock.Op:
    name = "layer_norm" if isinstance(norm, LayerNorm) else "rms_norm"
    return clock.Op("pyml.core.ops", name, "{}", shape)


def _op_tables(block, projs, ups, mlp, d, H, Hkv, hd, f):
    attn, ffn = block.attn, block.ffn
    pre = [None] * 11
    pre[A_NORM] = _norm_op(block.attn_norm, (1, d))
    for j, lin in enumerate(projs):
        pre[A_MM + 2 * j:A_MM + 2 * j + 2] = _linear_ops(lin)
    if attn.q_norm is not None:
        pre[A_QNORM], pre[A_KNORM] = _norm_op(attn.q_norm, (1, H, hd)), _norm_op(attn.k_norm, (1, Hkv, hd))
    if attn.rope is not None:
        for op, heads in ((A_ROPE_Q, H), (A_ROPE_K, Hkv)):
            pre[op] = clock.Op("pyml.nn.rope", "rope", "{} pos={} {}", (1, heads, hd), clock.POS, attn.rope.style,
                               op="rope")
    post = [None] * 13
    post[B_MM_O:B_MM_O + 2] = _linear_ops(attn.o_proj)
    if block.post_attn_norm is not None:
        post[B_POST_ATTN] = _norm_op(block.post_attn_norm, (1, d))
    post[B_NORM] = _norm_op(block.ffn_norm, (1, d))
    for j, lin in enumerate(ups):
        post[B_MM_1 + 2 * j:B_MM_1 + 2 * j + 2] = _linear_ops(lin)
    if mlp == 0:
        act_name = {ops.gelu_tanh: ("gelu", "{} tanh"), ops.gelu_erf: ("gelu", "{} erf"),
                    ops.silu: ("silu", "{}")}[ffn.act]
        post[B_ACT] = clock.Op("pyml.core.ops", act_name[0], act_name[1], (1, f))
        post[B_FFN] = clock.Op("pyml.nn.feed_forward", "feed_forward", "{} mlp", (1, d), module=ffn.name,
                               op="feed_forward")
    else:
        post[B_ACT] = clock.Op("pyml.core.ops", "gated_act", "{} {}", (1, 2 * f), ffn.act)
        post[B_FFN] = clock.Op("pyml.nn.feed_forward", "feed_forward", "{} {}", (1, d), ffn.act,
                               module=ffn.name, op="feed_forward")
    post[B_MM_DOWN:B_MM_DOWN + 2] = _linear_ops(ffn.down)
    if block.post_ffn_norm is not None:
        post[B_POST_FFN] = _norm_op(block.post_ffn_norm, (1, d))
    return pre, post
