"""The compiled drivers of a run of like blocks' decode step, all running decode_recipe.py's steps:

- decode_layers: the layers one after the other on the calling thread, every matrix product and
  the attention a whole call of its kernel (each parallel inside): any weight type and layout;
- decode_region: one parallel region over the run, whose threads claim each product's pieces
  (8-row groups of an x8 matrix) and the attention's (kv head, part) items from atomic counters
  (core/atomics.py) and wait at its end until they are all done; the recipe's one-thread steps
  between them go to whichever thread asks first, so a late or missing thread never holds the
  others (the region is also right on one thread). decode_layers makes ~5 parallel launches a
  layer, each with its join; the region makes one a run. It takes blocks whose every matrix is
  x8 with no tail rows and whose projections are fused (region_shape_ok);
- decode_rows: a batched decode step's B rows (one token of its own sequence each) as
  decode_layers walks one: the steps over all rows, after_qkv row by row, the products and the
  batched attention over the KV pool as whole calls of the kernels the layer-by-layer path calls;
- decode_rows_region: decode_rows as one parallel region (region_shape_ok's blocks), as
  decode_region is decode_layers: the rows' steps claimed a block of rows at a time, the
  attention two rows, the products in chunks, so the steps decode_rows runs on one thread
  (the norms, after_qkv, the activations' quantization: ~1.3 ms of a 16-row SmolLM2 step) run on all.

Each layer's weights and cache arrays are the first layer's, rebased to its own addresses
(_rebased: the caller checks that the layers' arrays agree in all but address, FusedStep).
`timed`: each layer's start, middle and end ticks go to `ticks` [layers, 3]; `trace`: every op's
event too, into `events` from `row` on (event_slots' rows a layer; layer = layer0 + the run's
index, the model's layer), and events[0, 0] counts the rows written.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from pyml.core import atomics, clock
from pyml.core.jit import FASTMATH
from pyml.nn import attention_kernels
from pyml.nn.decode_recipe import (A_MM, B_MM_1, B_MM_DOWN, B_MM_O, C_SDPA, SLOT, BlockShape, StepBuffers,
                                   add_bias, after_down, after_o, after_qkv, after_up, attn_norm, event, event_slots,
                                   linear, linear_rows, now, per_shape)
from pyml.quant import interleaved_gemv, interleaved_rows

_PHASES = 11  # counters per layer in a region: see _region_layers
_LAST = 1  # a step's slot (timed): the latest tick a thread finished one of its pieces at
PIECES_PER_THREAD = 4  # a matrix's groups are claimed in about this many pieces per thread


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


def addresses(values) -> list:
    """The data addresses of the arrays among `values`, in order (what _rebased reads)."""
    return [v.ctypes.data for v in values if isinstance(v, np.ndarray)]


def clock_slot() -> np.ndarray:
    """decode_layers' `counters`: only the latest-tick slot that decode_recipe.now keeps."""
    return np.zeros(SLOT, np.int64)


# --- decode_layers ------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def decode_layers_kernel(shape: BlockShape):
    """decode_layers for blocks of `shape` (see the module doc)."""
    key, e, s = shape.key(), event_slots(shape), shape  # the closure holds the key and ints only
    n_ev, sep_qkv, sep_up, e_sdpa = e.n, s.n_proj == 3, s.mlp == 2, e.sdpa
    (pq, lq), (pk, lk), (pv, lv) = e.proj if sep_qkv else e.proj * 3
    (po, lo), (pu, lu), (pu2, lu2), (pd, ld) = e.o, e.up[0], e.up[-1], e.down
    kind_q, lay_q, kind_k, lay_k, kind_v, lay_v = s.q_kind, s.q_layout, s.k_kind, s.k_layout, s.v_kind, s.v_layout
    kind_o, lay_o, kind_1, lay_1 = s.o_kind, s.o_layout, s.up_kind, s.up_layout
    kind_2, lay_2, kind_d, lay_d = s.up2_kind, s.up2_layout, s.down_kind, s.down_layout

    @numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
    def decode_layers(x, pre_w, pre_at, buf, post_w, post_at, kv, kv_at, start, pos, scale, splits, ctx, out,
                      counters, events, row, trace, timed, ticks, layer0):
        h, qkv, q3, k3, v3, y, gu, a = buf.h, buf.qkv, buf.q3, buf.k3, buf.v3, buf.y, buf.gu, buf.a
        nq, nkv = buf.nq, buf.nkv
        flat_ctx = ctx.reshape(ctx.size)
        f = a.shape[1]
        out[:] = x
        for layer in range(pre_at.shape[0]):
            pw, qw = _rebased(pre_w, pre_at[layer]), _rebased(post_w, post_at[layer])
            cache = _rebased(kv, kv_at[layer])
            keys, k_scale, values, v_scale = cache
            li, r = layer0 + layer, row + layer * n_ev  # the model's layer; its first event row
            t = attn_norm(key, pw, buf, out, events, trace, timed, counters, ticks, layer, li, r)
            if sep_qkv:
                t = linear(events, trace, counters, r + pq, r + lq, A_MM, li, t, kind_q, lay_q, pw.wq, pw.tq, pw.bq,
                           h[0], qkv[:nq])
                t = linear(events, trace, counters, r + pk, r + lk, A_MM + 2, li, t, kind_k, lay_k, pw.wk, pw.tk,
                           pw.bk, h[0], qkv[nq:nq + nkv])
                t = linear(events, trace, counters, r + pv, r + lv, A_MM + 4, li, t, kind_v, lay_v, pw.wv, pw.tv,
                           pw.bv, h[0], qkv[nq + nkv:])
            else:
                t = linear(events, trace, counters, r + pq, r + lq, A_MM, li, t, kind_q, lay_q, pw.wq, pw.tq, pw.bq,
                           h[0], qkv)
            t = after_qkv(key, pw, buf, cache, pos, t, events, trace, counters, li, r)
            attention_kernels.decode_into(q3[0], k3[:0], v3[:0], keys, k_scale, values, v_scale, start, pos + 1, 0,
                                          scale, splits, ctx)
            t_at = now(trace, counters)
            event(events, trace, r + e_sdpa, C_SDPA, li, t, t_at)
            t = linear(events, trace, counters, r + po, r + lo, B_MM_O, li, t_at, kind_o, lay_o, qw.wo, qw.to, qw.bo,
                       flat_ctx, y[0])
            t = after_o(key, qw, buf, out, t, events, trace, timed, counters, ticks, layer, li, r)
            if sep_up:
                t = linear(events, trace, counters, r + pu, r + lu, B_MM_1, li, t, kind_1, lay_1, qw.w1, qw.t1,
                           qw.b1, h[0], gu[0, :f])
                t = linear(events, trace, counters, r + pu2, r + lu2, B_MM_1 + 2, li, t, kind_2, lay_2, qw.w2,
                           qw.t2, qw.b2, h[0], gu[0, f:])
            else:
                t = linear(events, trace, counters, r + pu, r + lu, B_MM_1, li, t, kind_1, lay_1, qw.w1, qw.t1,
                           qw.b1, h[0], gu[0])
            t = after_up(key, buf, t, events, trace, counters, li, r)
            t = linear(events, trace, counters, r + pd, r + ld, B_MM_DOWN, li, t, kind_d, lay_d, qw.wd, qw.td,
                       qw.bd, a[0], y[0])
            after_down(key, qw, buf, out, t, events, trace, timed, counters, ticks, layer, li, r)
        if trace:  # the rows written
            events[0, 0] = row - 1 + pre_at.shape[0] * n_ev
        return out

    return decode_layers


# --- decode_rows: a batched decode step's B rows ---------------------------------------------------

class RowBuffers(NamedTuple):
    """decode_rows' scratch for B rows (a ROWS_MAX-row set sliced to B: FusedBlock.row_buffers): the
    products' outputs p1 [B, q | k | v, or q], pk, pv [B, nkv] (q, k, v apart; else [B, 0]), q rows
    [B, nq] after the q norm and RoPE, ctx [B, H, hd], gate's [B, f] (gate and up apart; else
    [B, 0]) and up's [B, f] before they are laid side by side in `gu`, and each row's RoPE angles
    (StepBuffers' rot [B, 2, 1, hd/2] and rot_of [B, 1 + hd/2]: a row's layers compute them once)."""
    p1: object
    pk: object
    pv: object
    q: object
    ctx: object
    g1: object
    g2: object
    rot: object
    rot_of: object


@lru_cache(maxsize=None)
def decode_rows_kernel(shape: BlockShape):
    """decode_rows for blocks of `shape`: a batched decode step's B rows (each one token of its own
    sequence of a KVPool, 2 <= B <= ROWS_MAX) through a run of like blocks, as decode_layers walks
    them (rebased weights and cache arrays), on the same recipe: the steps run over all B rows
    (`buf`'s arrays [B, ...]) except after_qkv, run row by row on the one-row buffers `one` (each row
    its own position, sequence and angles); every product is decode_recipe.matrows (each row its GEMV's
    bits) and the attention attention_kernels' batched decode over the pool's layer arrays (`seqs`,
    `ends`, `splits` per row: attention_kernels.batch_splits). Untimed: a timed batched step takes
    the layer-by-layer path (nn/fused.py)."""
    key, s = shape.key(), shape  # the closure holds the key and ints only
    sep_qkv, sep_up = s.n_proj == 3, s.mlp == 2
    kind_q, lay_q, kind_k, lay_k, kind_v, lay_v = s.q_kind, s.q_layout, s.k_kind, s.k_layout, s.v_kind, s.v_layout
    kind_o, lay_o, kind_1, lay_1 = s.o_kind, s.o_layout, s.up_kind, s.up_layout
    kind_2, lay_2, kind_d, lay_d = s.up2_kind, s.up2_layout, s.down_kind, s.down_layout

    @numba.njit(cache=True, fastmath=FASTMATH, error_model="numpy")
    def decode_rows(x, pre_w, pre_at, buf, rows, one, post_w, post_at, kv, kv_at, seqs, ends, splits, window, scale,
                    chunks, no_kv, out, counters, events, ticks, layer0):
        h, y, gu, a = buf.h, buf.y, buf.gu, buf.a
        p1, pk, pv, q, ctx, g1, g2, rot, rot_of = rows
        qkv, nq, nkv = one.qkv, one.nq, one.nkv
        B, f, n1 = x.shape[0], a.shape[1], p1.shape[1]
        q3 = q.reshape(ctx.shape)
        flat_ctx = ctx.reshape((B, ctx.shape[1] * ctx.shape[2]))
        out[:] = x
        for layer in range(pre_at.shape[0]):
            pw, qw = _rebased(pre_w, pre_at[layer]), _rebased(post_w, post_at[layer])
            keys, k_scale, values, v_scale = _rebased(kv, kv_at[layer])
            li = layer0 + layer
            attn_norm(key, pw, buf, out, events, False, False, counters, ticks, layer, li, 0)
            linear_rows(kind_q, lay_q, pw.wq, pw.tq, pw.bq, h, p1, chunks)
            if sep_qkv:
                linear_rows(kind_k, lay_k, pw.wk, pw.tk, pw.bk, h, pk, chunks)
                linear_rows(kind_v, lay_v, pw.wv, pw.tv, pw.bv, h, pv, chunks)
            for b in range(B):  # q/k norms, RoPE and the KV write: each row at its own position
                qkv[:n1] = p1[b]
                if sep_qkv:
                    qkv[nq:nq + nkv] = pk[b]
                    qkv[nq + nkv:] = pv[b]
                s_, row = seqs[b], StepBuffers(one.h, qkv, one.q2, one.k2, one.q3, one.k3, one.v3, nq, nkv, one.y,
                                               one.gu, one.a, rot[b], rot_of[b])  # the row's angles
                after_qkv(key, pw, row, (keys[s_], k_scale[s_], values[s_], v_scale[s_]), ends[b] - 1, 0, events,
                          False, counters, li, 0)
                q[b] = qkv[:nq]
            # every row's k, v written above: the batched attention only reads (no_kv: [0, Hkv, hd])
            attention_kernels._decode_batch(q3, no_kv, no_kv, keys, k_scale, values, v_scale, seqs, ends, splits,
                                            window, scale, ctx)
            linear_rows(kind_o, lay_o, qw.wo, qw.to, qw.bo, flat_ctx, y, chunks)
            after_o(key, qw, buf, out, 0, events, False, False, counters, ticks, layer, li, 0)
            if sep_up:
                linear_rows(kind_1, lay_1, qw.w1, qw.t1, qw.b1, h, g1, chunks)
                linear_rows(kind_2, lay_2, qw.w2, qw.t2, qw.b2, h, g2, chunks)
                for b in range(B):
                    gu[b, :f] = g1[b]
                    gu[b, f:] = g2[b]
            else:
                linear_rows(kind_1, lay_1, qw.w1, qw.t1, qw.b1, h, gu, chunks)
            after_up(key, buf, 0, events, False, counters, li, 0)
            linear_rows(kind_d, lay_d, qw.wd, qw.td, qw.bd, a, y, chunks)
            after_down(key, qw, buf, out, 0, events, False, False, counters, ticks, layer, li, 0)
        return out

    return decode_rows


# --- decode_region: its counters ---------------------------------------------------------------------

def region_counters(n_layers: int) -> np.ndarray:
    """decode_region's counters for a run of n_layers: _PHASES steps a layer, and one slot more
    (timed: the latest tick recorded, decode_recipe.now)."""
    return np.zeros((n_layers * _PHASES + 1) * SLOT, np.int64)


@numba.njit(inline="always")
def _first(counters, ph):
    """Whether this thread takes one-thread step `ph` (the first to ask does)."""
    return atomics.fetch_add(counters, SLOT * ph, 1) == 0


@numba.njit(inline="always")
def _finish(counters, ph):
    atomics.fetch_add(counters, SLOT * ph + SLOT // 2, 1)


@numba.njit(inline="always")
def _wait(counters, ph, n):
    """Until n pieces of step `ph` are done (by any thread)."""
    while atomics.load(counters, SLOT * ph + SLOT // 2) < n:
        atomics.pause()


# Only the thread that takes a one-thread step records (the steps are ordered by the counters: what
# one wrote before its _finish the next one reads after its _wait), so the layer's ticks and its
# ops' events are written by one thread at a time. A product's pieces run on every thread: each,
# timed, puts its end into the step's _LAST slot (an atomic max) before counting itself done, and
# the next one-thread step reads the latest: the product ran from its activation's quantization to
# its last piece done, as decode_layers times it.

@numba.njit(inline="always")
def _pieces_done(counters, ph):
    """The tick step ph's last piece was done at (timed), taken as the latest tick recorded."""
    at = counters.size - SLOT
    t = max(atomics.load(counters, SLOT * ph + _LAST), counters[at])
    counters[at] = t
    return t


@numba.njit(inline="always")
def _piece_done(counters, ph, timed):
    if timed:
        atomics.fetch_max(counters, SLOT * ph + _LAST, clock.ticks())
    _finish(counters, ph)


@numba.njit(inline="always")
def _product_start(events, trace, r_mm, t, kind, x, act):
    """A product's one-thread start: x quantized into `act` for the pieces; its event starts at t."""
    xq, xd, xs, xp, xoff, y8 = act
    interleaved_gemv.gemv_activation(kind, x, xq, xd, xs, xp, xoff, y8)
    if trace:
        events[r_mm, 2] = t


@numba.njit(inline="always")
def _product_pieces(counters, ph, kind, groups, act, out, n_threads, timed):
    """Step `ph`: out = W x over the x8 `groups`, in pieces claimed from the counter; x as
    _product_start left it in `act`. Returns when every piece is done."""
    xq, xd, xs, xp, xoff, y8 = act
    y = interleaved_gemv.activation_bytes(kind, xq, y8)
    G = groups.shape[0]
    n = min(G, PIECES_PER_THREAD * n_threads)
    while True:
        c = atomics.fetch_add(counters, SLOT * ph, 1)
        if c >= n:
            break
        for g in range(c * G // n, (c + 1) * G // n):
            interleaved_gemv.gemv_group_into(kind, groups, g, y, xq, xd, xs, xoff, out)
        _piece_done(counters, ph, timed)
    _wait(counters, ph, n)


@numba.njit(inline="always")
def _product_end(events, trace, counters, ph, r_mm, r_lin, op, li, out, bias):
    """A product's one-thread end (the step after its pieces): its events and the bias, as
    decode_recipe.linear makes them. Returns the end tick."""
    t0 = 0
    if trace:
        t0 = events[r_mm, 2]
        event(events, trace, r_mm, op, li, t0, _pieces_done(counters, ph))
    add_bias(out, bias)
    t = now(trace, counters)
    event(events, trace, r_lin, op + 1, li, t0, t)
    return t


@numba.njit(inline="always")
def _product(counters, ph, kind, groups, act, out, n_threads, events, trace, r_mm, r_lin, op, li, bias):
    """A product's pieces (step ph), then its end if this thread is the first to take step ph + 1:
    (whether it did, the end tick). The taker then runs the recipe's steps up to the next product
    and hands on (_hand_on)."""
    _product_pieces(counters, ph, kind, groups, act, out, n_threads, trace)
    if _first(counters, ph + 1):
        return True, _product_end(events, trace, counters, ph, r_mm, r_lin, op, li, out, bias)
    return False, np.int64(0)


@numba.njit(inline="always")
def _hand_on(counters, ph, took):
    """One-thread step ph done (by the thread that took it); every thread waits for it."""
    if took:
        _finish(counters, ph)
    _wait(counters, ph, 1)


# --- decode_region ------------------------------------------------------------------------------

def region_shape_ok(shape: BlockShape) -> bool:
    """Whether decode_region implements blocks of this shape: fused projections, every matrix in
    the x8 layout (the tails are checked by the caller: FusedBlock.region_ok)."""
    return (shape.n_proj == 1 and shape.q_layout == 1 and shape.o_layout == 1 and shape.mlp in (0, 1)
            and shape.up_layout == 1 and shape.down_layout == 1)


def _region_layers(key, x, pre_w, pre_at, buf, post_w, post_at, kv, kv_at, act_d, act_q, act_f, attn_s, start,
                   pos, scale, splits, ctx, out, counters, n_threads, events, row, trace, timed, ticks, layer0):
    """One thread's walk through decode_region's layers: the recipe's one-thread steps taken by the
    first thread to ask, the products' and the attention's pieces by every thread."""


@per_shape(_region_layers)
def _make_region_layers(shape, e):
    n_ev, e_sdpa = e.n, e.sdpa  # plain ints below: constants in the code
    (pq, lq), (po, lo), (pu, lu), (pd, ld) = e.proj[0], e.o, e.up[0], e.down
    kq, ko, k1, kd = shape.q_kind, shape.o_kind, shape.up_kind, shape.down_kind

    def region_layers(key, x, pre_w, pre_at, buf, post_w, post_at, kv, kv_at, act_d, act_q, act_f, attn_s, start,
                      pos, scale, splits, ctx, out, counters, n_threads, events, row, trace, timed, ticks, layer0):
        h, qkv, q3, y, gu, a = buf.h, buf.qkv, buf.q3, buf.y, buf.gu, buf.a
        qs, qpos, m, l, acc, scores = attn_s
        n_kv = kv[2].shape[0]
        items = n_kv * splits
        end = pos + 1
        flat_ctx = ctx.reshape(ctx.size)
        for layer in range(pre_at.shape[0]):
            pw, qw = _rebased(pre_w, pre_at[layer]), _rebased(post_w, post_at[layer])
            cache = _rebased(kv, kv_at[layer])
            keys, k_scale, values, v_scale = cache
            ph = _PHASES * layer
            li, r = layer0 + layer, row + layer * n_ev  # the model's layer; its first event row
            took = _first(counters, ph)
            if took:
                t = attn_norm(key, pw, buf, out, events, trace, timed, counters, ticks, layer, li, r)
                _product_start(events, trace, r + pq, t, kq, h[0], act_d)
            _hand_on(counters, ph, took)
            took, t = _product(counters, ph + 1, kq, pw.wq, act_d, qkv, n_threads, events, trace, r + pq, r + lq,
                               A_MM, li, pw.bq)
            if took:
                t = after_qkv(key, pw, buf, cache, pos, t, events, trace, counters, li, r)
                attention_kernels.decode_begin(q3[0], scale, end, qs, qpos)
                if trace:
                    events[r + e_sdpa, 2] = t
            _hand_on(counters, ph + 2, took)
            group = q3.shape[1] // n_kv
            while True:  # the attention's (kv head, part) items
                c = atomics.fetch_add(counters, SLOT * (ph + 3), 1)
                if c >= items:
                    break
                attention_kernels.decode_item(c, splits, qs, qpos, group, keys, k_scale, values, v_scale, start,
                                              end, 0, m, l, acc, scores, keys, values, -1)
                _piece_done(counters, ph + 3, False)
            _wait(counters, ph + 3, items)
            took = _first(counters, ph + 4)
            if took:  # the parts merged
                attention_kernels.decode_merge(n_kv, splits, group, m, l, acc, ctx)
                t = now(trace, counters)
                if trace:
                    event(events, trace, r + e_sdpa, C_SDPA, li, events[r + e_sdpa, 2], t)
                _product_start(events, trace, r + po, t, ko, flat_ctx, act_q)
            _hand_on(counters, ph + 4, took)
            took, t = _product(counters, ph + 5, ko, qw.wo, act_q, y[0], n_threads, events, trace, r + po, r + lo,
                               B_MM_O, li, qw.bo)
            if took:  # o_proj's end, the residual and the feed-forward's norm: then gate/up's start
                t = after_o(key, qw, buf, out, t, events, trace, timed, counters, ticks, layer, li, r)
                _product_start(events, trace, r + pu, t, k1, h[0], act_d)
            _hand_on(counters, ph + 6, took)
            took, t = _product(counters, ph + 7, k1, qw.w1, act_d, gu[0], n_threads, events, trace, r + pu, r + lu,
                               B_MM_1, li, qw.b1)
            if took:
                _product_start(events, trace, r + pd, after_up(key, buf, t, events, trace, counters, li, r), kd, a[0],
                               act_f)
            _hand_on(counters, ph + 8, took)
            took, t = _product(counters, ph + 9, kd, qw.wd, act_f, y[0], n_threads, events, trace, r + pd, r + ld,
                               B_MM_DOWN, li, qw.bd)
            if took:
                after_down(key, qw, buf, out, t, events, trace, timed, counters, ticks, layer, li, r)
            _hand_on(counters, ph + 10, took)

    return region_layers


@lru_cache(maxsize=None)
def decode_region_kernel(shape: BlockShape):
    """decode_region for blocks of `shape` (see the module doc); region_shape_ok(shape)."""
    key, n_ev = shape.key(), event_slots(shape).n  # the closure holds the key and an int only

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
    def decode_region(x, pre_w, pre_at, buf, post_w, post_at, kv, kv_at, act_d, act_q, act_f, attn_s, start, pos,
                      scale, splits, ctx, out, counters, n_threads, events, row, trace, timed, ticks, layer0):
        # n_threads: numba.get_num_threads() from Python (called in here it is a ctypes pointer,
        # which keeps the kernel out of the disk cache)
        for i in range(counters.size):
            counters[i] = 0
        for i in range(x.shape[1]):
            out[0, i] = x[0, i]
        for _ in numba.prange(n_threads):
            _region_layers(key, x, pre_w, pre_at, buf, post_w, post_at, kv, kv_at, act_d, act_q, act_f, attn_s,
                           start, pos, scale, splits, ctx, out, counters, n_threads, events, row, trace, timed, ticks,
                           layer0)
        if trace:  # the rows written
            events[0, 0] = row - 1 + pre_at.shape[0] * n_ev
        return out

    return decode_region



# --- decode_rows_region --------------------------------------------------------------------------

# A batched step's layer as decode_rows_region walks it: steps that alternate between the rows' own
# work (a block of rows claimed by one thread: the recipe's steps on the block's views, then each
# row's activation quantized for the next product) and a product's chunks (interleaved_rows.rows_chunk):
#   0 rows    layer 0 only: attn_norm, quantize h          (later layers': in step 9 of the one before)
#   1 chunks  qkv product -> p1
#   2 rows    its bias, after_qkv (in place in p1)         every row's k, v written before any attends
#   3 rows    the row's attention -> ctx, quantize ctx
#   4 chunks  o product -> y
#   5 rows    its bias, after_o, quantize h
#   6 chunks  up product -> gu
#   7 rows    its bias, after_up, quantize a
#   8 chunks  down product -> y
#   9 rows    its bias, after_down; the next layer's attn_norm, quantize h
_ROW_STEPS = 10
ROW_CLAIMS = 4  # a row step's rows are claimed in this many blocks (a claim is a contended atomic)
ATTENTION_ROWS = 2  # the attention's rows are claimed 2 at a time: a row fetches the next one's start


def rows_region_counters(n_layers: int) -> np.ndarray:
    """decode_rows_region's counters for a run of n_layers."""
    return np.zeros(n_layers * _ROW_STEPS * SLOT, np.int64)


@numba.njit(inline="always")
def _row_views(buf, rows, b, nq, nkv):
    """Row b's StepBuffers: buf's one-row views, its q | k | v in place in p1 (projections fused), its
    own angles."""
    qkv = rows.p1[b]
    H, hd = rows.ctx.shape[1], rows.ctx.shape[2]
    q, k, v = qkv[:nq], qkv[nq:nq + nkv], qkv[nq + nkv:]
    Hkv = nkv // hd
    return StepBuffers(buf.h[b:b + 1], qkv, q.reshape((H, hd)), k.reshape((Hkv, hd)), q.reshape((1, H, hd)),
                       k.reshape((1, Hkv, hd)), v.reshape((1, Hkv, hd)), nq, nkv, buf.y[b:b + 1], buf.gu[b:b + 1],
                       buf.a[b:b + 1], rows.rot[b], rows.rot_of[b])


@numba.njit(inline="always")
def _rows_views(buf, lo, hi):
    """StepBuffers of rows lo .. hi-1 for the recipe's steps over rows (attn_norm, after_o, after_up,
    after_down: h, y, gu, a; the per-head views are row lo's, unused)."""
    return StepBuffers(buf.h[lo:hi], buf.qkv, buf.q2, buf.k2, buf.q3, buf.k3, buf.v3, buf.nq, buf.nkv, buf.y[lo:hi],
                       buf.gu[lo:hi], buf.a[lo:hi], buf.rot, buf.rot_of)


def _rows_layers(key, out, pre_w, pre_at, buf, rows, post_w, post_at, kv, kv_at, seqs, ends, splits, window, scale,
                 act_d, act_q, act_f, chunks, counters, events, ticks, layer0):
    """One thread's walk through decode_rows_region's layers: every step's work claimed from the
    counters, then waited for until all of it is done."""


@per_shape(_rows_layers)
def _make_rows_layers(shape, e):
    kq, ko, k1, kd = shape.q_kind, shape.o_kind, shape.up_kind, shape.down_kind
    pairs_q, pairs_o, pairs_1, pairs_d = (interleaved_rows.takes_pairs(k) for k in (kq, ko, k1, kd))
    units, chunk = interleaved_rows.rows_units, interleaved_rows.rows_chunk

    @numba.njit(inline="always")
    def row_step(key, step, lo, hi, pw, qw, pw_next, layer, L, li, buf, rows, out, nq, nkv, cache, seqs, ends,
                 splits, window, scale, flat_ctx, acts, counters, events, ticks):
        """Rows lo .. hi-1 of row step `step`: the recipe's steps over the block's views (after_qkv
        and the attention a row at a time)."""
        act_d, act_q, act_f = acts
        keys, k_scale, values, v_scale = cache
        if step == 2:
            for b in range(lo, hi):
                add_bias(rows.p1[b], pw.bq)
                s = seqs[b]
                after_qkv(key, pw, _row_views(buf, rows, b, nq, nkv), (keys[s], k_scale[s], values[s], v_scale[s]),
                          ends[b] - 1, 0, events, False, counters, li, 0)
            return
        if step == 3:
            for b in range(lo, hi):
                attention_kernels.decode_row(b, rows.p1[b][:nq].reshape(rows.ctx.shape[1:]), keys, k_scale, values,
                                             v_scale, seqs, ends, splits, window, scale, rows.ctx[b])
                interleaved_rows.rows_activation(ko, flat_ctx[b], act_q, b)
            return
        block, x = _rows_views(buf, lo, hi), out[lo:hi]
        if step == 0:
            attn_norm(key, pw, block, x, events, False, False, counters, ticks, layer, li, 0)
            for b in range(lo, hi):
                interleaved_rows.rows_activation(kq, buf.h[b], act_d, b)
        elif step == 5:
            for b in range(lo, hi):
                add_bias(buf.y[b], qw.bo)
            after_o(key, qw, block, x, 0, events, False, False, counters, ticks, layer, li, 0)
            for b in range(lo, hi):
                interleaved_rows.rows_activation(k1, buf.h[b], act_d, b)
        elif step == 7:
            for b in range(lo, hi):
                add_bias(buf.gu[b], qw.b1)
            after_up(key, block, 0, events, False, counters, li, 0)
            for b in range(lo, hi):
                interleaved_rows.rows_activation(kd, buf.a[b], act_f, b)
        else:
            for b in range(lo, hi):
                add_bias(buf.y[b], qw.bd)
            after_down(key, qw, block, x, 0, events, False, False, counters, ticks, layer, li, 0)
            if layer + 1 < L:
                attn_norm(key, pw_next, block, x, events, False, False, counters, ticks, layer + 1, li + 1, 0)
                for b in range(lo, hi):
                    interleaved_rows.rows_activation(kq, buf.h[b], act_d, b)

    def rows_layers(key, out, pre_w, pre_at, buf, rows, post_w, post_at, kv, kv_at, seqs, ends, splits, window,
                    scale, act_d, act_q, act_f, chunks, counters, events, ticks, layer0):
        acts = (act_d, act_q, act_f)
        B, nq = out.shape[0], rows.q.shape[1]
        nkv = (rows.p1.shape[1] - nq) // 2
        flat_ctx = rows.ctx.reshape((B, nq))
        acc = np.empty(16 * B, np.float32)  # the products' scratch: in L1
        L = pre_at.shape[0]
        row_claim = (B + ROW_CLAIMS - 1) // ROW_CLAIMS
        row_claims = (B + row_claim - 1) // row_claim
        for layer in range(L):
            pw, qw = _rebased(pre_w, pre_at[layer]), _rebased(post_w, post_at[layer])
            pw_next = _rebased(pre_w, pre_at[min(layer + 1, L - 1)])
            cache = _rebased(kv, kv_at[layer])
            li = layer0 + layer
            n_q, n_o = min(units(pairs_q, pw.wq), chunks), min(units(pairs_o, qw.wo), chunks)
            n_1, n_d = min(units(pairs_1, qw.w1), chunks), min(units(pairs_d, qw.wd), chunks)
            for step in range(_ROW_STEPS):
                ph = _ROW_STEPS * layer + step
                n = row_claims
                if step == 0:
                    n = row_claims if layer == 0 else 0
                elif step == 3:
                    n = (B + ATTENTION_ROWS - 1) // ATTENTION_ROWS
                elif step == 1:
                    n = n_q
                elif step == 4:
                    n = n_o
                elif step == 6:
                    n = n_1
                elif step == 8:
                    n = n_d
                while True:
                    c = atomics.fetch_add(counters, SLOT * ph, 1)
                    if c >= n:
                        break
                    if step == 1:
                        chunk(kq, pairs_q, pw.wq, act_d, rows.p1, c, n, acc)
                    elif step == 4:
                        chunk(ko, pairs_o, qw.wo, act_q, buf.y, c, n, acc)
                    elif step == 6:
                        chunk(k1, pairs_1, qw.w1, act_d, buf.gu, c, n, acc)
                    elif step == 8:
                        chunk(kd, pairs_d, qw.wd, act_f, buf.y, c, n, acc)
                    else:
                        per = ATTENTION_ROWS if step == 3 else row_claim
                        row_step(key, step, c * per, min(B, (c + 1) * per), pw, qw, pw_next, layer, L, li, buf, rows,
                                 out, nq, nkv, cache, seqs, ends, splits, window, scale, flat_ctx, acts, counters,
                                 events, ticks)
                    _finish(counters, ph)
                _wait(counters, ph, n)

    return rows_layers


@lru_cache(maxsize=None)
def decode_rows_region_kernel(shape: BlockShape):
    """decode_rows_region for blocks of `shape` (region_shape_ok, no tail rows): decode_rows' batched
    step as one parallel region over the run (decode_region's counters): the rows' steps shared out
    by blocks of rows, the attention by pairs of rows, the products by chunk - where decode_rows runs
    the rows' steps and the activations' quantization on one thread. Each row gets decode_rows' bits
    (the same steps and kernels on the same numbers). Untimed, as decode_rows."""
    key = shape.key()

    @numba.njit(parallel=True, cache=True, fastmath=FASTMATH, error_model="numpy")
    def decode_rows_region(x, pre_w, pre_at, buf, rows, post_w, post_at, kv, kv_at, seqs, ends, splits, window,
                           scale, act_d, act_q, act_f, chunks, out, counters, n_threads, events, ticks, layer0):
        # act_d, act_q, act_f: the activations' quantization buffers (interleaved_gemv.activation_buffers of B rows)
        # for d, nq and f columns; n_threads: numba.get_num_threads() from Python (as decode_region's)
        B = x.shape[0]
        for i in range(counters.size):  # loops: no array expression for parallel=True to make a launch of
            counters[i] = 0
        for b in range(B):
            for i in range(x.shape[1]):
                out[b, i] = x[b, i]
        for _ in numba.prange(n_threads):
            _rows_layers(key, out, pre_w, pre_at, buf, rows, post_w, post_at, kv, kv_at, seqs, ends, splits, window,
                         scale, act_d, act_q, act_f, chunks, counters, events, ticks, layer0)
        return out

    return decode_rows_region
