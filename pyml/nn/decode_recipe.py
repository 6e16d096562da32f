"""A block's decode step (T == 1), written once: the recipe both compiled paths run.

    attn_norm    norm(x) -> h                                          (the qkv projection's input)
      qkv        h -> q | k | v (+ bias)                               a matrix product
    after_qkv    q/k norms -> RoPE -> the KV write
      attention  softmax(q K^T s) V over the cache -> ctx
      o_proj     ctx -> y (+ bias)                                     a matrix product
    after_o      post-attention norm -> x += y -> the FFN norm -> h
      up         h -> gate|up, or up (+ bias)                          a matrix product (two apart)
    after_up     the activation -> a
      down       a -> y (+ bias)                                       a matrix product
    after_down   post-FFN norm -> x += y

The one-thread steps between the matrix products and the attention are this module's four
`after_*` functions and `attn_norm`; the drivers (nn/decode_kernels.py) differ only in how they
run the products and the attention: decode_layers runs each whole on the calling thread's kernels
(any weight type and layout), decode_region shares their pieces out between the threads of one
parallel region (x8 weights), decode_rows runs them over a batched step's B rows (matrows, the
pool's batched attention). The steps take x and their buffers as [rows, ...]: one row at T == 1,
B in decode_rows (after_qkv, whose per-head views are one row's, it calls row by row). A new op of
a block is a change to the step it belongs to here, and its kernel; every driver runs it. The layer-by-layer path (nn/block.py and the layers) is the
oracle the tests hold this recipe to (tests/nn/test_fused.py).

Every function here takes the block's shape as a literal string (BlockShape.key()): its ints are
read at compile time, so the compiled code holds constants only (Numba's disk cache keys it by
them: a second process loads it). Timing: each step writes its ops' events to the layer's rows of
an event buffer (`trace`) at the slots event_slots gives, in end order (the order the layer-by-layer
path's spans end), and the layer's start, middle and end ticks (`timed`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numba
from numba import types
from numba.core.typing.templates import infer, infer_global, make_overload_template
from numba.extending import overload

from pyml import quant
from pyml.core import clock, ops
from pyml.core.jit import FASTMATH
from pyml.nn import attention_kernels
from pyml.quant import interleaved_rows


class BlockShape(NamedTuple):
    """What the compiled kernels of a block are made for: never its weights, only their kinds."""
    norm: int             # the attention norm: 0 RMSNorm, 1 LayerNorm
    norm_unit: int        # RMSNorm scales by (1 + w) (Gemma)
    n_proj: int           # 1: q|k|v fused in one matrix; 3: q, k, v apart
    q_kind: int           # each projection's ggml type id and layout (0: the file's, 1: x8)
    q_layout: int
    k_kind: int
    k_layout: int
    v_kind: int
    v_layout: int
    qk_norm: int          # per-head RMSNorm of q and k before RoPE (Gemma 3, Qwen3)
    qk_unit: int
    rope: int             # 0 none, 1 rotate-half, 2 interleaved pairs
    o_kind: int
    o_layout: int
    post_attn: int        # RMSNorm of the attention's output before its residual add (Gemma 3)
    post_attn_unit: int
    ffn_norm: int         # as `norm`, for the feed-forward
    ffn_norm_unit: int
    mlp: int              # 0: down(act(up x)); 1: one gate|up matrix; 2: gate and up apart
    up_kind: int          # the first up matrix (gate|up, gate or up)
    up_layout: int
    up2_kind: int         # the second (mlp 2: up), else the first again
    up2_layout: int
    down_kind: int
    down_layout: int
    act: int              # ops.act_row's activation id
    post_ffn: int         # RMSNorm of the feed-forward's output before its residual add (Gemma 3)
    post_ffn_unit: int

    def key(self) -> str:
        return ",".join(str(int(v)) for v in self)

    @classmethod
    def of(cls, key) -> "BlockShape":
        """The shape of a literal key, at compile time."""
        return cls(*(int(v) for v in key.literal_value.split(",")))


class PreWeights(NamedTuple):
    """A block's arrays and constants up to the attention (FusedBlock fills them; a driver reaches
    another layer's by rebasing the arrays: decode_kernels._rebased)."""
    norm_w: object        # the attention norm's weight, bias (LayerNorm; else empty), eps
    norm_b: object
    norm_eps: float
    wq: object            # each projection: weight (x8: its groups), tail rows (x8: the last R % 8), bias
    tq: object
    bq: object
    wk: object
    tk: object
    bk: object
    wv: object
    tv: object
    bv: object
    q_norm_w: object      # the q/k norms' weights and eps (empty where the shape has none)
    k_norm_w: object
    qk_eps: float
    inv_freq: object      # RoPE's float64 frequencies (empty without RoPE)


class PostWeights(NamedTuple):
    """A block's arrays and constants from o_proj on (as PreWeights)."""
    wo: object
    to: object
    bo: object
    post_attn_w: object
    post_attn_eps: float
    ffn_norm_w: object
    ffn_norm_b: object
    ffn_norm_eps: float
    w1: object            # the first up matrix (gate|up, gate or up)
    t1: object
    b1: object
    w2: object            # the second (gate and up apart: up), else the first again
    t2: object
    b2: object
    wd: object
    td: object
    bd: object
    post_ffn_w: object
    post_ffn_eps: float


class StepBuffers(NamedTuple):
    """A run's scratch, allocated once per block: h [1, d] a norm's output; qkv [nq + 2 nkv] and its
    views q2 [H, hd], k2 [Hkv, hd], q3 [1, H, hd], k3, v3 [1, Hkv, hd]; y [1, d] a product's output;
    gu [1, f or 2f] the up product's; a [1, f] the activation's; rot [2, 1, hd/2] the cos and sin
    of the position RoPE turns q and k by, and rot_of [1 + hd/2] float64 the position and
    frequencies they are of (NaN: none yet), so a step's layers compute them once (_rope_angles)."""
    h: object
    qkv: object
    q2: object
    k2: object
    q3: object
    k3: object
    v3: object
    nq: int
    nkv: int
    y: object
    gu: object
    a: object
    rot: object
    rot_of: object


# --- op ids: what an event stands for (FusedBlock's op tables name them) --------------------------
A_NORM, A_MM, A_QNORM, A_KNORM, A_ROPE_Q, A_ROPE_K = 0, 1, 7, 8, 9, 10  # A_MM + 2j: projection j
B_MM_O, B_POST_ATTN, B_NORM, B_MM_1, B_ACT, B_MM_DOWN, B_FFN, B_POST_FFN = 0, 2, 3, 4, 8, 9, 11, 12
C_KV, C_SDPA = 0, 1  # between them: the cache write and the attention
N_PRE_OPS, N_POST_OPS = A_ROPE_K + 1, B_POST_FFN + 1  # the op tables' lengths: a new id goes above and here


class EventSlots(NamedTuple):
    """Where each op's event goes among a layer's rows (its end order); -1: the shape lacks it."""
    norm: int
    proj: tuple           # (quant, linear) slots of each projection: one or three pairs
    q_norm: int
    k_norm: int
    rope_q: int
    rope_k: int
    kv: int
    sdpa: int
    o: tuple
    post_attn: int
    ffn_norm: int
    up: tuple             # (quant, linear) of each up matrix: one or two pairs
    act: int
    down: tuple
    ffn: int
    post_ffn: int
    n: int                # rows a layer


def event_slots(shape: BlockShape) -> EventSlots:
    k = 0

    def take(present=True):
        nonlocal k
        k += bool(present)
        return k - 1 if present else -1
    pair = lambda: (take(), take())  # noqa: E731 - a product's quant and linear events
    norm = take()
    proj = tuple(pair() for _ in range(shape.n_proj))
    qn, kn = take(shape.qk_norm), take(shape.qk_norm)
    rq, rk = take(shape.rope), take(shape.rope)
    kv, sdpa, o = take(), take(), pair()
    post_attn, ffn_norm = take(shape.post_attn), take()
    up = tuple(pair() for _ in range(2 if shape.mlp == 2 else 1))
    act, down, ffn, post_ffn = take(), pair(), take(), take(shape.post_ffn)
    return EventSlots(norm, proj, qn, kn, rq, rk, kv, sdpa, o, post_attn, ffn_norm, up, act, down, ffn, post_ffn, k)


_BODY_OPTIONS = {"fastmath": FASTMATH, "error_model": "numpy"}


def _one_impl_per_signature(template):
    """`template` (an overload's), its implementations kept per argument types alone. Numba keys them by
    the caller's compile flags too, and a parallel kernel types its loop's body under two sets (the
    function's, then the loop's gufunc's): decode_region's walk, nearly all of its code, was compiled
    twice (SmolLM2: 45 s of a first run's 49 s decode-step compile)."""
    if "_pyml_one_impl" not in template.__dict__:
        def _get_impl(self, args, kws):
            key = self.context, tuple(args), tuple(kws.items())
            found = self._impl_cache.get(key)
            return found if found is not None else self._build_impl(key, args, kws)
        template._get_impl = _get_impl
        template._pyml_one_impl = True
    return template


def per_shape(stub):
    """Register `make(shape: BlockShape, slots: EventSlots) -> step` as the Numba implementation of
    `stub` (a function whose first argument is a literal shape key, BlockShape.key()): `step` takes
    stub's arguments and is compiled once per block shape, with the ints make reads from the shape
    as constants. Numba checks the step's signature against stub's (functools.wraps lends it)."""
    def register(make):
        @functools.wraps(stub)
        def typer(shape, *args):
            if not isinstance(shape, types.StringLiteral):
                return None
            s = BlockShape.of(shape)
            return make(s, event_slots(s))
        template = _one_impl_per_signature(make_overload_template(stub, typer, _BODY_OPTIONS, True, "never", True))
        infer(template)  # what overload(stub, prefer_literal=True, jit_options=_BODY_OPTIONS) registers
        infer_global(stub, types.Function(template))
        return make
    return register
SLOT = 16  # int64s between the counters' slots (decode_kernels): each on a cache line of its own


# --- time and events --------------------------------------------------------------------------

@numba.njit(inline="always")
def now(on, counters):
    """The counter (not before the latest tick recorded, kept in the counters' last slot: ticks
    read on two cores stay ordered) when `on`, else 0 and no read."""
    if not on:
        return 0
    at = counters.size - SLOT
    t = max(clock.ticks(), counters[at])
    counters[at] = t
    return t


@numba.njit(inline="always")
def event(events, trace, r, op, layer, t0, t1):
    """Event row r: op ran from t0 to t1 (when tracing)."""
    if trace:
        events[r, 0] = op
        events[r, 1] = layer
        events[r, 2] = t0
        events[r, 3] = t1


@numba.njit(inline="always")
def add_bias(out, bias):  # out += bias (a loop: no array expression for parallel=True to turn into a launch)
    for i in range(bias.size):
        out[i] += bias[i]


@numba.njit(inline="always")
def _rms(x, w, eps, unit, out):
    """ops.rms_norm_rows with `unit` (a shape's 0/1 constant) as the bool the Python side passes: one
    compile of it serves both (a literal int each was two more, the branch being per row anyway)."""
    ops.rms_norm_rows(x, w, eps, unit != 0, out)


@numba.njit(inline="always")
def _norm(kind, unit_offset, x, w, b, eps, out):  # kind 0: RMSNorm, 1: LayerNorm; x, out [1, d]
    if kind == 0:
        _rms(x, w, eps, unit_offset, out)
    else:
        ops.layer_norm_rows(x, w, b, eps, out)


@numba.njit(inline="always")
def _branch_end(post, unit, y, w, eps, x, t, events, trace, timed, counters, ticks, layer, li, r_post, op, col):
    """A branch's end: its output y normed when `post` (Gemma's sandwich norm; op's event at row
    r_post, from tick t), then x += y; the layer's tick `col` taken after it. Returns that tick."""
    if post:
        _rms(y, w, eps, unit, y)
        event(events, trace, r_post, op, li, t, now(trace, counters))
    for b in range(x.shape[0]):  # every row: one at T == 1, a batched step's B
        add_bias(x[b], y[b])
    t = now(timed, counters)
    if timed:
        ticks[layer, col] = t
    return t


# --- the weight kernels, chosen by literal type id ------------------------------------------------

def matvec(kind, layout, w, tail, x, out):
    """out [R] = W x for a weight of type `kind` (a literal), stored in the file's layout
    (layout 0: w, tail unused) or the x8 layout (layout 1: w = groups, tail = the last R % 8 rows)."""


@overload(matvec, prefer_literal=True)
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


def matrows(kind, layout, w, tail, x, out, chunks):
    """out [B, R] = x W^T for B decode rows (2 .. interleaved_rows.ROWS_MAX), each row with the bits of
    its GEMV alone, as quant.matmul's decode-rows branch computes it: the x8 layout (layout 1) by
    interleaved_rows.rows_kernel (its groups shared out in `chunks`) and its tail rows by the GEMV
    row by row, the file's layout (layout 0) by the type's KernelSet.gemv_rows."""


@overload(matrows, prefer_literal=True)
def _matrows_overload(kind, layout, w, tail, x, out, chunks):
    if not isinstance(kind, types.IntegerLiteral) or not isinstance(layout, types.IntegerLiteral):
        return None
    kernels = quant.traits_of(kind.literal_value).kernels
    if layout.literal_value == 1:
        rows, gemv = interleaved_rows.rows_kernel(kind.literal_value), kernels.gemv

        def packed(kind, layout, w, tail, x, out, chunks):
            rows(w, x, out, chunks)
            if tail.shape[0]:
                head = 8 * w.shape[0]
                for b in range(x.shape[0]):
                    gemv(tail, x[b], out[b, head:])
        return packed
    gemv_rows = kernels.gemv_rows

    def stored(kind, layout, w, tail, x, out, chunks):
        gemv_rows(w, x, out)
    return stored


@numba.njit(inline="always")
def linear_rows(kind, layout, w, tail, bias, x, out, chunks):
    """out = x W^T + bias over B decode rows (matrows), untimed: a batched step is timed by the
    layer-by-layer path (decode_kernels.decode_rows_kernel)."""
    matrows(kind, layout, w, tail, x, out, chunks)
    for b in range(out.shape[0]):
        add_bias(out[b], bias)


@numba.njit(inline="always")
def linear(events, trace, counters, r_mm, r_lin, op, layer, t0, kind, layout, w, tail, bias, x, out):
    """out = W x + bias on the calling thread, from t0: the quant::matmul event (the product) at
    row r_mm, the linear::forward one (with the bias) at r_lin. Returns the end tick."""
    matvec(kind, layout, w, tail, x, out)
    t1 = now(trace, counters)
    event(events, trace, r_mm, op, layer, t0, t1)
    add_bias(out, bias)
    t2 = now(trace, counters)
    event(events, trace, r_lin, op + 1, layer, t0, t2)
    return t2


# --- the one-thread steps ---------------------------------------------------------------------------

def attn_norm(shape, pw, buf, x, events, trace, timed, counters, ticks, layer, li, r):
    """buf.h = norm(x); the layer's start tick. Returns the tick the qkv product starts at."""


@per_shape(attn_norm)
def _attn_norm(s, e):
    norm, unit, e_norm = s.norm, s.norm_unit, e.norm  # plain ints: constants in the code

    def step(shape, pw, buf, x, events, trace, timed, counters, ticks, layer, li, r):
        t = now(timed, counters)
        if timed:
            ticks[layer, 0] = t
        _norm(norm, unit, x, pw.norm_w, pw.norm_b, pw.norm_eps, buf.h)
        t1 = now(trace, counters)
        event(events, trace, r + e_norm, A_NORM, li, t, t1)
        return t1
    return step


@numba.njit(inline="always")
def _rope_angles(pos, inv_freq, rot, rot_of):
    """rot <- the cos and sin of position pos by inv_freq, unless it holds them already (rot_of): the
    layers of a step share its position and mostly one set of frequencies, and a libm cos and sin
    a pair cost 0.4 µs a row and layer (1/5 of after_qkv at SmolLM2's head_dim 64)."""
    same = rot_of[0] == pos
    for i in range(inv_freq.shape[0]):
        if not same:
            break
        same = rot_of[1 + i] == inv_freq[i]
    if not same:
        ops.rope_angles(pos, inv_freq, rot[0, 0], rot[1, 0])
        rot_of[0] = pos
        for i in range(inv_freq.shape[0]):  # a loop: no array expression for a parallel caller to launch
            rot_of[1 + i] = inv_freq[i]


def after_qkv(shape, pw, buf, kv, pos, t, events, trace, counters, li, r):
    """q/k norms -> RoPE -> the KV write into the layer's cache arrays `kv`, from tick t (the
    projections' end). Returns the tick the attention starts at."""


@per_shape(after_qkv)
def _after_qkv(s, e):
    qk_norm, qk_unit, rope = s.qk_norm, s.qk_unit, s.rope
    e_qn, e_kn, e_rq, e_rk, e_kv = e.q_norm, e.k_norm, e.rope_q, e.rope_k, e.kv

    def step(shape, pw, buf, kv, pos, t, events, trace, counters, li, r):
        q2, k2, q3, k3 = buf.q2, buf.k2, buf.q3, buf.k3
        if qk_norm:
            _rms(q2, pw.q_norm_w, pw.qk_eps, qk_unit, q2)
            t_q = now(trace, counters)
            event(events, trace, r + e_qn, A_QNORM, li, t, t_q)
            _rms(k2, pw.k_norm_w, pw.qk_eps, qk_unit, k2)
            t = now(trace, counters)
            event(events, trace, r + e_kn, A_KNORM, li, t_q, t)
        if rope:
            cos, sin = buf.rot[0], buf.rot[1]
            _rope_angles(pos, pw.inv_freq, buf.rot, buf.rot_of)
            ops.rope_apply(q3, cos, sin, rope == 2)
            t_q = now(trace, counters)
            event(events, trace, r + e_rq, A_ROPE_Q, li, t, t_q)
            ops.rope_apply(k3, cos, sin, rope == 2)
            t = now(trace, counters)
            event(events, trace, r + e_rk, A_ROPE_K, li, t_q, t)
        keys, k_scale, values, v_scale = kv
        attention_kernels.write_kv(k3, buf.v3, pos, keys, k_scale, values, v_scale)
        t_kv = now(trace, counters)
        event(events, trace, r + e_kv, C_KV, li, t, t_kv)
        return t_kv
    return step


def after_o(shape, qw, buf, x, t, events, trace, timed, counters, ticks, layer, li, r):
    """post-attention norm -> x += y -> buf.h = FFN norm(x), from tick t (o_proj's end, into buf.y);
    the layer's middle tick. Returns the tick the up product starts at (also the feed-forward's start)."""


@per_shape(after_o)
def _after_o(s, e):
    post_attn, pan_unit, fnorm, f_unit = s.post_attn, s.post_attn_unit, s.ffn_norm, s.ffn_norm_unit
    e_pan, e_fn, e_ffn = e.post_attn, e.ffn_norm, e.ffn

    def step(shape, qw, buf, x, t, events, trace, timed, counters, ticks, layer, li, r):
        t = _branch_end(post_attn, pan_unit, buf.y, qw.post_attn_w, qw.post_attn_eps, x, t, events, trace, timed,
                        counters, ticks, layer, li, r + e_pan, B_POST_ATTN, 1)
        _norm(fnorm, f_unit, x, qw.ffn_norm_w, qw.ffn_norm_b, qw.ffn_norm_eps, buf.h)
        t_mm = now(trace, counters)
        event(events, trace, r + e_fn, B_NORM, li, t, t_mm)
        if trace:
            events[r + e_ffn, 2] = t_mm  # the feed-forward's span starts here; after_down ends it
        return t_mm
    return step


def after_up(shape, buf, t, events, trace, counters, li, r):
    """buf.a = act(buf.gu) (gated: act(gate) * up), from tick t. Returns the tick the down product starts at."""


@per_shape(after_up)
def _after_up(s, e):
    act, gated, e_act = s.act, s.mlp != 0, e.act

    def step(shape, buf, t, events, trace, counters, li, r):
        for b in range(buf.a.shape[0]):  # every row: one at T == 1, a batched step's B
            ops.act_row(buf.gu[b], act, gated, buf.a[b])
        t1 = now(trace, counters)
        event(events, trace, r + e_act, B_ACT, li, t, t1)
        return t1
    return step


def after_down(shape, qw, buf, x, t, events, trace, timed, counters, ticks, layer, li, r):
    """The feed-forward's end -> post-FFN norm -> x += y, from tick t (down's end); the layer's end tick."""


@per_shape(after_down)
def _after_down(s, e):
    post_ffn, pfn_unit, e_ffn, e_pfn = s.post_ffn, s.post_ffn_unit, e.ffn, e.post_ffn

    def step(shape, qw, buf, x, t, events, trace, timed, counters, ticks, layer, li, r):
        if trace:
            event(events, trace, r + e_ffn, B_FFN, li, events[r + e_ffn, 2], t)
        _branch_end(post_ffn, pfn_unit, buf.y, qw.post_ffn_w, qw.post_ffn_eps, x, t, events, trace, timed, counters,
                    ticks, layer, li, r + e_pfn, B_POST_FFN, 2)
    return step

