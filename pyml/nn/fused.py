"""The fused decode step: a model's blocks in as few compiled calls as their shapes allow, where
the layer-by-layer path (TransformerBlock, Attention, the feed-forwards) makes ~15 per block.

At T == 1 an op of a small model is less arithmetic than the Python that calls it. A block's
decode step is written once, as decode_recipe.py's steps, and run by one of decode_kernels.py's
two drivers over the same kernels the layers call and buffers allocated once per block:
FusedStep runs each stretch of like blocks (SmolLM2: all 30) as one call - decode_region, one
parallel region, where every matrix is x8 with its projections fused, else decode_layers - and
FusedBlock a block alone (decode_layers over one layer). FusedStep.rows runs a batched decode step
(B sequences, one token each) the same way, one decode_rows call per run, untimed. The
layer-by-layer path is the oracle: tests/nn/test_fused.py holds the one-row drivers to it on every
architecture and weight type, tests/nlp/test_batch_fused.py decode_rows to its batched path.

Kernels are made per block *shape* (BlockShape: which norms, which weight types and layouts, which
activation), never per weight: their closures hold only the shape's key string and ints, and the
weight kernels are picked at compile time by a literal type id (decode_recipe.matvec), so Numba's
on-disk cache keys them by those and a second process loads them instead of compiling (a closure
that captured the KernelSet's dispatchers would be recompiled by every process: its cache key
pickles them differently each time). SmolLM2 needs one kernel of each kind; a Q4_K_M file, with
Q6_K mixed in, a few.

Timing: when any of a block's spans is on, the call reads the time-stamp counter around every op
(the cache write and the attention apart) and each layer's start, middle and end, and (at trace)
writes (op id, layer, start, end) into the run's EventBuffer (core/clock.py): no block returns to
Python. The step only hands those rows and ticks to perf.defer; when the perf buffer is drained,
after the step, _layer_spans turns them into the spans the layer-by-layer path opens - the same
names, details, attributes and nesting (attention::forward holds the qkv projection, the q/k
norms, RoPE, kv_cache::update, attention::sdpa and o_proj) - and the block's `attn` / `ffn`
parts. With logging off no counter is read (`timed` is a runtime argument).
"""

from __future__ import annotations

import logging
import math
import threading
import weakref

import numba
import numpy as np

from pyml import quant
from pyml.core import clock, ops, perf
from pyml.nn import attention, attention_kernels, feed_forward, kv_cache, linear, rope
from pyml.nn.attention import Attention
from pyml.nn.decode_kernels import (RowBuffers, addresses, clock_slot, decode_layers_kernel, decode_region_kernel,
                                    decode_rows_kernel, decode_rows_region_kernel, region_counters, region_shape_ok,
                                    rows_region_counters)
from pyml.nn.decode_recipe import (A_KNORM, A_MM, A_NORM, A_QNORM, A_ROPE_K, A_ROPE_Q, B_ACT, B_FFN, B_MM_1,
                                   B_MM_DOWN, B_MM_O, B_NORM, B_POST_ATTN, B_POST_FFN, N_POST_OPS, N_PRE_OPS,
                                   BlockShape, PostWeights, PreWeights, StepBuffers, event_slots)
from pyml.nn.feed_forward import MLP, GatedMLP
from pyml.nn.linear import Linear
from pyml.nn.norm import LayerNorm, RMSNorm
from pyml.quant import interleaved_gemv, interleaved_rows

_perf = perf.get("pyml.nn.block")
_ATTN_PERF = perf.get("pyml.nn.attention")
_KV_PERF, _SDPA_PERF = perf.get("pyml.nn.kv_cache"), attention_kernels.PERF
_PAIRS = clock.clock_pairs()
_ACT_IDS = {ops.gelu_tanh: 1, ops.gelu_erf: 2, ops.silu: 0}
_EMPTY = np.zeros(0, np.float32)
_NO_KV = np.zeros((0, 1, 1), np.float32)  # decode_rows' attention writes no key or value: after_qkv did


def _weight(lin: Linear):
    """(kind, layout, w, tail) of a Linear as the kernels read it."""
    data, qtype = lin.weight.data, lin.weight.qtype
    if isinstance(data, quant.Packed):
        return int(qtype), 1, data.groups, data.tail
    w = quant.kernel_view(data, qtype, lin.in_features)
    return int(qtype), 0, w, w[:0]


def _bias(lin: Linear):
    return _EMPTY if lin.bias is None else np.ascontiguousarray(lin.bias, dtype=np.float32)


def _read_only(weights):
    """`weights` (PreWeights or PostWeights) with every array a read-only view. Numba compiles a
    kernel apart for each mix of writable and read-only arrays: a memory-mapped file's weights are
    read-only, packed ones, biases, norms made in NumPy and the empty stand-ins writable, so one
    block shape cost 2-5 compiles of decode_layers and decode_region (the costliest kernels) where
    one read-only kind gives one."""
    def frozen(v):
        if isinstance(v, np.ndarray) and v.flags.writeable:
            v = v.view()
            v.flags.writeable = False
        return v
    return type(weights)(*(frozen(v) for v in weights))


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
    """A TransformerBlock's decode step in one compiled call (decode_layers over this block alone).
    Made once per block, after the weights are packed; holds the argument lists, scratch buffers and
    the block's shape, which FusedStep's runs share."""

    def __init__(self, block):
        # the block owns this and is reached through a weak reference: a cycle between them would
        # outlive the model, for a loaded model's objects are frozen out of the cyclic GC (load_model)
        self._block = weakref.ref(block)
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
        rope_kind = 0 if attn.rope is None else (2 if attn.rope.style == "interleaved" else 1)
        qk_norm = attn.q_norm is not None
        norm = block.attn_norm
        self.pre_w = _read_only(PreWeights(
            norm.weight, _norm_bias(norm), norm.eps, ws[0][2], ws[0][3], bs[0], ws[1][2], ws[1][3], bs[1],
            ws[2][2], ws[2][3], bs[2], q_norm_w=attn.q_norm.weight if qk_norm else _EMPTY,
            k_norm_w=attn.k_norm.weight if qk_norm else _EMPTY, qk_eps=attn.q_norm.eps if qk_norm else 0.0,
            inv_freq=_EMPTY.astype(np.float64) if attn.rope is None else attn.rope.inv_freq))

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
        self.post_w = _read_only(PostWeights(
            wo[2], wo[3], _bias(attn.o_proj), post_attn_w=_EMPTY if pan is None else pan.weight,
            post_attn_eps=0.0 if pan is None else pan.eps, ffn_norm_w=fnorm.weight, ffn_norm_b=_norm_bias(fnorm),
            ffn_norm_eps=fnorm.eps, w1=w1[2], t1=w1[3], b1=_bias(ups[0]), w2=w2[2], t2=w2[3], b2=_bias(ups[-1]),
            wd=wd[2], td=wd[3], bd=_bias(ffn.down), post_ffn_w=_EMPTY if pfn is None else pfn.weight,
            post_ffn_eps=0.0 if pfn is None else pfn.eps))
        self.shape = BlockShape(
            norm=_norm_kind(norm), norm_unit=int(getattr(norm, "unit_offset", False)), n_proj=len(projs),
            q_kind=ws[0][0], q_layout=ws[0][1], k_kind=ws[1][0], k_layout=ws[1][1], v_kind=ws[2][0],
            v_layout=ws[2][1], qk_norm=int(qk_norm), qk_unit=int(qk_norm and attn.q_norm.unit_offset),
            rope=rope_kind,
            o_kind=wo[0], o_layout=wo[1], post_attn=int(pan is not None),
            post_attn_unit=int(pan is not None and pan.unit_offset), ffn_norm=_norm_kind(fnorm),
            ffn_norm_unit=int(getattr(fnorm, "unit_offset", False)), mlp=mlp, up_kind=w1[0], up_layout=w1[1],
            up2_kind=w2[0], up2_layout=w2[1], down_kind=wd[0], down_layout=wd[1], act=act,
            post_ffn=int(pfn is not None), post_ffn_unit=int(pfn is not None and pfn.unit_offset))
        self.ctx = np.zeros((H, attn.head_dim), np.float32)
        self.bufs = StepBuffers(self.h, self.qkv, q2, k2, self.q3, self.k3, self.v3, nq, nkv, self.y, self.gu, self.a,
                                *_rot_buffers(hd))
        self.window = attn.window or 0
        self.tables = _op_tables(block, projs, ups, mlp, d, H, Hkv, hd, f)
        self.op_loggers = {op.perf for table in self.tables for op in table if op is not None}
        self.op_loggers |= {_ATTN_PERF, _KV_PERF, _SDPA_PERF}
        self._attn_tables = {}  # kv type -> the cache write's and attention's Ops (_attention_ops)
        # every op of a table writes one event a call, and the cache write and attention one each:
        # a traced call's events take these many rows per layer
        self.n_pre = sum(op is not None for op in self.tables[0])
        self.n_events = event_slots(self.shape).n  # the tables' ops, and the cache write and attention
        self.events = clock.EventBuffer(64 * self.n_events)  # 64 steps: records are made later (_run_spans)
        self.ticks = TickPool(1)  # a timed call's (start, middle, end)
        self.clock = clock_slot()  # decode_layers' latest tick (decode_recipe.now)
        self._run = None  # this block alone as a decode_layers run (_solo)
        self._rows = {}  # B -> a batched step's buffers for B rows (row_buffers)
        self._rows_max = None  # their ROWS_MAX-row arrays, made on the first batched step
        self._acts_max = None  # and their activations' quantization buffers (decode_rows_region's)

    @property
    def block(self):
        return self._block()

    def row_buffers(self, B: int) -> tuple:
        """(StepBuffers of B rows, RowBuffers, output [B, d], the activations' quantization buffers
        for d, nq and f columns [B, ...]: decode_rows_region's) for decode_rows_kernel: views of one
        ROWS_MAX-row set, so a step of any B allocates nothing."""
        bufs = self._rows.get(B)
        if bufs is None:
            if self._rows_max is None:
                R, attn, b = interleaved_rows.ROWS_MAX, self.block.attn, self.bufs
                nq, nkv, d, f = b.nq, b.nkv, self.x.shape[1], self.a.shape[1]
                n1, n_apart = (nq, nkv) if self.shape.n_proj == 3 else (nq + 2 * nkv, 0)
                f_apart = f if self.shape.mlp == 2 else 0
                z = lambda *shape: np.zeros((R,) + shape, np.float32)  # noqa: E731
                self._rows_max = (z(d), z(self.gu.shape[1]), z(f), z(d), z(d), z(n1), z(n_apart), z(n_apart),
                                  z(nq), z(attn.n_heads, attn.head_dim), z(f_apart), z(f_apart),
                                  *_rot_buffers(attn.head_dim, R))
                self._acts_max = tuple(interleaved_gemv.activation_buffers((R, n)) for n in (d, nq, f))
            h, gu, a, y, out, *rows = (v[:B] for v in self._rows_max)
            b = self.bufs
            bufs = self._rows[B] = (StepBuffers(h, b.qkv, b.q2, b.k2, b.q3, b.k3, b.v3, b.nq, b.nkv, y, gu, a, b.rot,
                                                b.rot_of), RowBuffers(*rows), out,
                                    tuple(tuple(v[:B] for v in act) for act in self._acts_max))
        return bufs

    def __call__(self, x: np.ndarray, pos: int, cache) -> np.ndarray:
        # generations on several threads may share a model: they take turns in a block (its
        # buffers are one set) and each leaves with its own copy of the output
        with self._busy:
            return self._step(x, pos, cache).copy()

    def _step(self, x, pos, cache):
        ops_on = any(p.trace_on for p in self.op_loggers)
        timed = ops_on or _perf.debug_on
        ticks = self.ticks.take() if timed else self.ticks.untimed
        return _call(self._solo(), x, pos, cache, cache.addresses(), ops_on, timed, ticks)

    def _solo(self) -> tuple:
        """This block as a run of one (FusedStep.runs' tuple): its timed step is FusedStep's."""
        if self._run is None:
            i = self.block.index
            self._run = (self, decode_layers_kernel(self.shape), range(i, i + 1),
                         np.array([addresses(self.pre_w)], np.int64),
                         np.array([addresses(self.post_w)], np.int64), [self])
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
                clock.Op(_KV_PERF.name, *kv_cache.UPDATE_SPAN, i, clock.POS, kv_type, layer=i, op="kv_cache"),
                clock.Op(_SDPA_PERF.name, *attention_kernels.DECODE_SPAN, a.n_heads, a.head_dim, a.n_kv_heads, span,
                         a.head_dim, kv_type, op="sdpa")]
        return ops_

    def _layer_spans(self, rows, parent, depth, ctx, thread, pos, kv_type, t0, t_mid, t_end, cal) -> list:
        """The spans of one layer of a timed call, in end order, as the layer-by-layer path opens
        them: the attention norm (the block's), the projections, q/k norms, RoPE, the cache write,
        the attention and o_proj (the attention span's), the attention span, the feed-forward and
        norms (the block's), the block span with its `attn` / `ffn` parts. `rows`: the layer's
        event rows (at event_slots' places: up to the attention's, the cache write's and attention's,
        from o_proj on), empty at debug; t0, t_mid, t_end: its ticks."""
        to_s = _seconds(cal, t0)
        s0, s_mid, s_end = to_s(t0), to_s(t_mid), to_s(t_end)
        block_id = perf.new_id() if _perf.debug_on else None
        up, up_depth, floor = _parent_of(parent, depth, block_id, s0)
        out = []
        if rows:
            i, n_pre, (pre, post) = self.block.index, self.n_pre, self.tables
            # every piece converted by the pair the block's ticks use (op_items' `near`)
            attn_items = (clock.op_items({i: pre}, pos, rows[1:n_pre], cal, t0)
                         + clock.op_items({i: self._attention_ops(kv_type)}, pos, rows[n_pre:n_pre + 2], cal, t0)
                         + clock.op_items({i: post}, pos, rows[n_pre + 2:n_pre + 4], cal, t0))
            out += perf.nest(clock.op_items({i: pre}, pos, rows[:1], cal, t0), up, up_depth, ctx, thread, floor)
            if _ATTN_PERF.trace_on:
                attn_id = perf.new_id()
                attn = to_s(rows[1][2]), to_s(rows[n_pre + 3][3])  # the first projection's start .. o_proj's end
                out += perf.nest(attn_items, attn_id, up_depth + 1, ctx, thread, perf._on_grid(attn[0], up=True))
                out.append(perf.span_at(*_attention_span(self.block, pos), *attn, up, up_depth, ctx, thread,
                                        span_id=attn_id, floor=floor))
            else:
                out += perf.nest(attn_items, up, up_depth, ctx, thread, floor)
            out += perf.nest(clock.op_items({i: post}, pos, rows[n_pre + 4:], cal, t0), up, up_depth, ctx, thread,
                             floor)
        if block_id is not None:  # its ends pushed out to the µs grid: its parts and ops fit inside
            b = self.block
            out.append(perf.span_at(_perf, logging.DEBUG, b.span_name, "", (),
                                    {"module": b.name, "op": "block", "layer": b.index, "kind": b.attn.kind},
                                    math.floor(s0 * 1e6) / 1e6, perf._on_grid(s_end, up=True),
                                    parent.id if parent is not None else None, depth, ctx, thread,
                                    span_id=block_id, parts={"attn": s_mid - s0, "ffn": s_end - s_mid},
                                    floor=_floor(parent)))
        return out


    def region_ok(self) -> bool:
        """Whether decode_region implements this block (region_shape_ok, and no tail rows)."""
        tails = (self.pre_w.tq, self.post_w.to, self.post_w.t1, self.post_w.td)
        return region_shape_ok(self.shape) and all(t.shape[0] == 0 for t in tails)

    def signature(self) -> tuple:
        """What blocks walked by one decode_layers call must share: the kernel shapes, the window,
        and every weight array's type, shape and strides (its address aside) and every constant."""
        def describe(v):
            if isinstance(v, np.ndarray):
                return v.dtype.str, v.shape, v.strides, v.flags.writeable, v.flags.aligned
            return v
        attn = self.block.attn
        return (self.shape, self.window, float(attn.scale),
                tuple(describe(v) for v in self.pre_w + self.post_w))


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
    decode_layers call, where FusedBlock makes one per block; that leaves out per block a Python
    call chain, ~60 arguments unboxed, a lock and a copy. A run whose blocks decode_region implements is one parallel region instead, timed or
    not. Timed (spans on) the same calls time every op from inside; a block set to the reference
    path, and the blocks run one by one."""

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
            self.runs.append((first, decode_layers_kernel(first.shape), range(i, j),
                              np.array([addresses(f.pre_w) for f in fused[i:j]], np.int64),
                              np.array([addresses(f.post_w) for f in fused[i:j]], np.int64), fused[i:j]))
            # a traced call writes the whole run's events into its first block's buffer: 64 steps' worth
            first.events = clock.EventBuffer(64 * (j - i) * first.n_events)
            i = j
        # a timed call's (start, middle, end) per layer: a pool per run, taken from under the run's
        # lock (one array for the step was written by two threads' runs at once)
        self.ticks = [TickPool(len(layers)) for _, _, layers, *_ in self.runs]
        # the step of a run whose blocks decode_region implements: (kernel, counters, activation
        # buffers, attention scratch), or None
        self.regions = [self._region(first, len(layers)) for first, _, layers, *_ in self.runs]
        # a batched step's runs: decode_rows_region's counters where it takes the run, else None (decode_rows)
        self.rows_counters = [rows_region_counters(len(layers)) if first.region_ok() else None
                              for first, _, layers, *_ in self.runs]

    @staticmethod
    def _region(first, n_layers):
        if not first.region_ok():
            return None
        attn = first.block.attn
        d, f = first.h.shape[1], first.a.shape[1]
        return [decode_region_kernel(first.shape), region_counters(n_layers),
                interleaved_gemv.activation_buffers((d,)),
                interleaved_gemv.activation_buffers((attn.n_heads * attn.head_dim,)),
                interleaved_gemv.activation_buffers((f,)), None]

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
        # the span cut as attend_decode cuts it (one part where that runs serially): the parts' merge
        # rounds, and a speculative verify pass attends through attend_decode and must get these bits
        splits = attention_kernels.decode_plan(first.ctx.size, attn.n_kv_heads, pos + 1 - start, n_threads) or 1
        scratch = self._attention_scratch(region, first, cache, layers[0], attn.n_kv_heads * splits)
        events, row = _event_rows(first, layers, ops_on)
        out = region[0](x, first.pre_w, pre_at, first.bufs, first.post_w, post_at,
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
        kv_at = cache.addresses()
        n_threads = numba.get_num_threads()
        # A model shared by threads: its buffers (and ticks) are one set a run, so a run's lock is
        # held until the next run has read the output it left in its buffer (each kernel copies
        # its input first), and the step leaves with a copy of the last. The locks are taken in
        # the runs' order: no two threads wait on each other. (A copy after every run cost Gemma 3's
        # 14 runs a measurable share of a step: the journal's "Figures that were in the code".)
        held = None
        try:
            for run, region, pool in zip(self.runs, self.regions, self.ticks):
                run[0]._busy.acquire()
                try:
                    ticks = pool.take() if timed else pool.untimed
                    if region is not None:
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

    def takes_rows(self) -> bool:
        """Whether rows() runs now: every block on the fused path, and no spans on."""
        return all(b.fused_decode for b in self.blocks) and not (
            _perf.debug_on or any(p.trace_on for p in self.op_loggers))

    def rows(self, x: np.ndarray, pool, seqs: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
        """Decode rows through all the blocks: row b one token of sequence seqs[b] of `pool` (a KVPool,
        or a OneSequence) at position ends[b]-1, 2 <= B <= ROWS_MAX - a batched decode step (nn/batch.py),
        or a speculative verify pass (one sequence's consecutive positions: every row's keys and
        values are written before any row attends). One decode_rows_region call per run of like blocks
        (decode_rows' below ROWS_REGION_MIN rows, or where the region does not take the blocks:
        rows_counters None), the recipe's steps over the B rows, the products and the attention as
        the layer-by-layer path runs them on B rows (the same kernels: the same bits). None where that path must run: a
        block set to the reference path, or spans on (the batched step is not timed from inside)."""
        if not self.takes_rows():
            return None
        B = len(seqs)
        x = np.ascontiguousarray(x, np.float32)  # the kernel's one argument type
        kv_at = pool.addresses()
        threads = numba.get_num_threads()
        chunks = interleaved_rows.chunks_for(threads)
        held = None  # the runs' locks, taken in order as __call__ takes them
        try:
            for (first, _, layers, pre_at, post_at, _), counters in zip(self.runs, self.rows_counters):
                first._busy.acquire()
                try:
                    buf, rows, out, acts = first.row_buffers(B)
                    attn = first.block.attn
                    splits = attention_kernels.batch_splits(first.ctx.size, attn.n_kv_heads, ends, first.window,
                                                            threads)
                    kv, run_at = pool.layer(layers[0]), kv_at[layers[0]:layers[-1] + 1]
                    if counters is not None and B >= ROWS_REGION_MIN:
                        x = decode_rows_region_kernel(first.shape)(
                            x, first.pre_w, pre_at, buf, rows, first.post_w, post_at, kv, run_at, seqs, ends, splits,
                            first.window, attn.scale, *acts, chunks, out, counters, threads, first.events.events,
                            first.ticks.untimed, layers[0])
                    else:
                        x = decode_rows_kernel(first.shape)(
                            x, first.pre_w, pre_at, buf, rows, first.bufs, first.post_w, post_at, kv, run_at, seqs,
                            ends, splits, first.window, attn.scale, chunks, _NO_KV, out, first.clock,
                            first.events.events, first.ticks.untimed, layers[0])
                finally:
                    if held is not None:
                        held.release()
                    held = first._busy
            return x.copy()
        finally:
            if held is not None:
                held.release()


# From this many rows a batched step takes decode_rows_region where it can; below, decode_rows. SmolLM2
# Q4_1 at depth 192, the two alternating in one process: B = 2 3.81 against 3.37 ms (the region's
# attention takes rows in pairs: one thread's), B = 4 4.76 / 4.68, B = 8 6.55 / 6.79, B = 16 10.57 / 11.09.
ROWS_REGION_MIN = 8


def _rot_buffers(head_dim: int, rows: int = 0) -> tuple:
    """StepBuffers' rot and rot_of (of `rows` rows: RowBuffers'), no angles in them yet."""
    lead = (rows,) if rows else ()
    return np.zeros(lead + (2, 1, head_dim // 2), np.float32), np.full(lead + (1 + head_dim // 2,), np.nan)


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
    out = kernel(x, first.pre_w, pre_at, first.bufs, first.post_w, post_at, cache.layer(layers[0]),
                 kv_at[layers[0]:layers[-1] + 1], start, pos, attn.scale, splits, first.ctx, first.x, first.clock,
                 events, row, ops_on, timed, ticks, layers[0])
    if timed:
        _defer(run, events, row, ticks, pos, cache)
    return out


class TickPool:
    """A run's timed calls' ticks, (start, middle, end) per layer: each call takes rows of its own,
    which stay as they are until its deferred records have read them; when the pool is used up a
    fresh one takes its place (the old one lives as long as the entries that point into it), as
    EventBuffer's rows do: copying each call's ticks out instead (`tolist`) cost a measurable share
    of a step at debug (the journal's "Figures that were in the code")."""

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
    return perf.within_ended(out, parent)


def _norm_kind(norm) -> int:
    return 1 if isinstance(norm, LayerNorm) else 0


def _norm_bias(norm):
    return norm.bias if isinstance(norm, LayerNorm) else _EMPTY


def _attention_span(block, pos):
    """(PerfLogger, level, name, fmt, args, attrs) of the attention::forward span Attention opens."""
    a = block.attn
    return (_ATTN_PERF, perf.TRACE, *attention.FORWARD_SPAN, (block.index, a.kind, 1, pos),
            {"module": a.name, "op": "attention", "layer": block.index, "kind": a.kind})


def _linear_ops(lin: Linear) -> list:
    """(quant::matmul, linear::forward) of a Linear at T == 1, as Linear.__call__ names them."""
    return [clock.Op("pyml.nn.linear", lin.matmul_event, linear.MATMUL_FMT, 1, lin.in_features, lin.out_features,
                     lin.in_features, module=lin.name, op="quant_matmul"),
            clock.Op("pyml.nn.linear", *linear.FORWARD_SPAN, (1, lin.in_features), lin.dims, lin.type_name,
                     module=lin.name, op="linear", dtype=lin.type_name)]


def _norm_op(norm, shape) -> clock.Op:
    return clock.Op("pyml.core.ops", *(ops.LAYER_NORM_SPAN if isinstance(norm, LayerNorm) else ops.RMS_NORM_SPAN),
                    shape)


def _op_tables(block, projs, ups, mlp, d, H, Hkv, hd, f):
    attn, ffn = block.attn, block.ffn
    pre = [None] * N_PRE_OPS
    pre[A_NORM] = _norm_op(block.attn_norm, (1, d))
    for j, lin in enumerate(projs):
        pre[A_MM + 2 * j:A_MM + 2 * j + 2] = _linear_ops(lin)
    if attn.q_norm is not None:
        pre[A_QNORM], pre[A_KNORM] = _norm_op(attn.q_norm, (1, H, hd)), _norm_op(attn.k_norm, (1, Hkv, hd))
    if attn.rope is not None:
        for op, heads in ((A_ROPE_Q, H), (A_ROPE_K, Hkv)):
            pre[op] = clock.Op("pyml.nn.rope", *rope.SPAN, (1, heads, hd), clock.POS, attn.rope.style, op="rope")
    post = [None] * N_POST_OPS
    post[B_MM_O:B_MM_O + 2] = _linear_ops(attn.o_proj)
    if block.post_attn_norm is not None:
        post[B_POST_ATTN] = _norm_op(block.post_attn_norm, (1, d))
    post[B_NORM] = _norm_op(block.ffn_norm, (1, d))
    for j, lin in enumerate(ups):
        post[B_MM_1 + 2 * j:B_MM_1 + 2 * j + 2] = _linear_ops(lin)
    if mlp == 0:
        act_span = {ops.gelu_tanh: ops.GELU_TANH_SPAN, ops.gelu_erf: ops.GELU_ERF_SPAN, ops.silu: ops.SILU_SPAN}
        post[B_ACT] = clock.Op("pyml.core.ops", *act_span[ffn.act], (1, f))
        post[B_FFN] = clock.Op("pyml.nn.feed_forward", *feed_forward.MLP_SPAN, (1, d), module=ffn.name,
                               op="feed_forward")
    else:
        post[B_ACT] = clock.Op("pyml.core.ops", *ops.GATED_SPAN, (1, 2 * f), ffn.act)
        post[B_FFN] = clock.Op("pyml.nn.feed_forward", *feed_forward.GATED_SPAN, (1, d), ffn.act, module=ffn.name,
                               op="feed_forward")
    post[B_MM_DOWN:B_MM_DOWN + 2] = _linear_ops(ffn.down)
    if block.post_ffn_norm is not None:
        post[B_POST_FFN] = _norm_op(block.post_ffn_norm, (1, d))
    return pre, post

