"""The fused decode step (nn/decode_recipe.py, run by nn/fused.py) against its oracle, the
layer-by-layer path, on every weight type and block shape: the same kernels in the same order, so
float32-close (in fact equal).
The whole models are held to transformers by tests/nlp (their decode steps run fused)."""

import logging

import numba
import numpy as np
import pytest

from pyml.core import perf
from pyml.nn.attention import Attention
from pyml.nn.block import TransformerBlock
from pyml.nn.feed_forward import MLP, GatedMLP
from pyml.nn.fused import FusedStep, TickPool
from pyml.nn.kv_cache import KVCache
from pyml.nn.linear import Linear, Weight
from pyml.nn.norm import LayerNorm, RMSNorm
from pyml.nn.rope import RoPE
from pyml.quant import FLOAT_TYPES, TRAITS, QuantType
from tests.quant.helpers import make_weights

K_TYPES = {q for q, t in TRAITS.items() if t.block_size == 256}  # super-blocks: rows of 256-multiples


def _linear(rng, qtype, out, inp, name, bias=False):
    w = make_weights(rng, qtype, out, inp)
    b = rng.standard_normal(out).astype(np.float32) * 0.1 if bias else None
    return Linear(Weight(w, qtype, (out, inp)), b, name=name)


def _norm_w(rng, d):
    return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)


def make_block(qtype, *, shape="llama", down_type=None, separate_qkv=False, bias=False, seed=0, index=0):
    """One block of a real family's shape with random weights of `qtype` (down_proj: `down_type`)."""
    rng = np.random.default_rng(seed)
    d, f = (256, 512) if qtype in K_TYPES or down_type in K_TYPES else (64, 96)
    H, Hkv, hd = 4, 2, d // 4
    lin = lambda out, inp, name, t=qtype: _linear(rng, t, out, inp, name, bias)  # noqa: E731
    if separate_qkv:
        qkv = (lin(H * hd, d, "q_proj"), lin(Hkv * hd, d, "k_proj"), lin(Hkv * hd, d, "v_proj"))
    else:
        qkv = lin((H + 2 * Hkv) * hd, d, "qkv_proj")
    o = lin(d, H * hd, "o_proj")
    down = lin(d, f, "down_proj", down_type or qtype)
    if shape == "gpt2":
        norm = lambda: LayerNorm(_norm_w(rng, d), 0.1 * rng.standard_normal(d).astype(np.float32), 1e-5)  # noqa
        attn = Attention(H, Hkv, hd, qkv, o, hd ** -0.5, name="attn")
        ffn = MLP(lin(f, d, "up_proj"), down, "gelu_tanh", name="mlp")
        return TransformerBlock(index, norm(), attn, norm(), ffn, name=f"h.{index}")
    gemma = shape == "gemma3"
    norm = lambda n=d: RMSNorm(0.1 * rng.standard_normal(n).astype(np.float32) if gemma else _norm_w(rng, n),  # noqa
                               1e-6, unit_offset=gemma)
    attn = Attention(H, Hkv, hd, qkv, o, hd ** -0.5, rope=RoPE(hd, 10000.0, "half" if gemma else "interleaved"),
                     q_norm=norm(hd) if gemma else None, k_norm=norm(hd) if gemma else None,
                     window=4 if gemma else None, name="self_attn")
    ffn = GatedMLP(lin(f, d, "gate_proj"), lin(f, d, "up_proj"), down, "gelu_tanh" if gemma else "silu", name="mlp")
    return TransformerBlock(index, norm(), attn, norm(), ffn, norm() if gemma else None, norm() if gemma else None,
                            name="layers.0")


def decode_both(block, steps=3, prompt=5):
    """Prefill (layer by layer, T > 1), then decode `steps` tokens fused and layer by layer from
    copies of the same cache; returns both outputs and both caches."""
    rng = np.random.default_rng(1)
    d = block.attn_norm.weight.shape[0]
    a = block.attn
    cache = KVCache(1, a.n_kv_heads, a.head_dim, prompt + steps)
    block(rng.standard_normal((prompt, d)).astype(np.float32), 0, cache)
    other = KVCache(1, a.n_kv_heads, a.head_dim, prompt + steps)
    other.k[0][:], other.v[0][:] = cache.k[0], cache.v[0]
    xs = [rng.standard_normal((1, d)).astype(np.float32) for _ in range(steps)]
    fused, ref = [], []
    for i, x in enumerate(xs):
        block.fused_decode = True
        fused.append(block(x.copy(), prompt + i, cache).copy())
        block.fused_decode = False
        ref.append(block(x.copy(), prompt + i, other).copy())
    assert block._fused is not None  # the fused path did run
    return np.array(fused), np.array(ref), cache, other


def span_rows(records) -> list:
    """Per record, in delivery (end) order: its ancestors' names, then its name, details and attributes."""
    index = {r["id"]: r for r in records}

    def ancestors(r):
        names = []
        while r["parent"] in index:
            r = index[r["parent"]]
            names.append(r["name"])
        return tuple(names)
    keys = ("name", "details", "module", "op", "layer", "kind", "dtype")
    return [(ancestors(r),) + tuple(str(r.get(k)) for k in keys) for r in records]


def assert_inside_parents(records):
    """Every span inside its parent, on the µs grid the lines print."""
    index = {r["id"]: r for r in records}
    for r in records:
        up = index.get(r["parent"])
        if up is not None:
            assert up["start"] <= r["start"] + 1e-9
            assert r["start"] + r["dur_ms"] / 1e3 <= up["start"] + up["dur_ms"] / 1e3 + 1e-9


def close(got, ref):
    """Within 1e-5 of ref's scale; a cache of f16 or q8_0 codes (integer arrays, whose differences
    would wrap around) must hold the same codes: both paths write a row's keys and values alike."""
    if np.issubdtype(ref.dtype, np.integer):
        np.testing.assert_array_equal(got, ref)
        return
    scale = np.abs(ref).max()
    assert np.all(np.isfinite(got)) and np.abs(got - ref).max() <= 1e-5 * scale, np.abs(got - ref).max() / scale


# Every weight type x the fused step is the deep tier's breadth. What a weight type brings to a
# decode_layers step (one block, FusedBlock) is one call: decode_recipe.matvec picks the type's GEMV
# (traits.interleaved.gemv in the x8 layout, traits.kernels.gemv in the file's), the dispatchers
# quant.matmul runs, whose bits every type's T = 1 case checks against gguf's dequantization
# (tests/quant/test_matmul.py, file layout; tests/quant/test_interleaved.py test_packed_matmul, x8).
# So the default tier drives the step once per kind of GEMV - float, x8, the K-quants' blocks, the
# low-bit codebooks - and a type runs here only in the deep tier when another type of its kind does
# (each case compiles a whole decode kernel of its own: ~18-25 s of a core with an empty cache):
_FUSED_ELSEWHERE = {
    QuantType.F32: "test_fused_decode_equals_layer_by_layer_on_every_block_shape[gpt2] (file layout)",
    QuantType.BF16: "[F16] here (float kernels, file layout); its GEMV: test_matmul[1-*-BF16]",
    QuantType.Q4_0: "test_region_under_debug_gives_the_block_spans_of_decode_layers[llama] (x8, 'layers')",
    QuantType.Q5_0: "[Q4_1] here (x8); its GEMV: test_packed_matmul[1-*-Q5_0]",
    QuantType.Q5_1: "[Q4_1] here (x8); its GEMV: test_packed_matmul[1-*-Q5_1]",
    QuantType.Q8_0: "[Q4_1] here (x8); its GEMV: test_packed_matmul[1-*-Q8_0]",
    QuantType.Q4_K: "test_fused_decode_equals_layer_by_layer_on_every_block_shape[gemma3] (x8)",
    QuantType.Q5_K: "Q6_K's down_proj in ..._on_every_block_shape[gemma3] (K-quant blocks, file layout); "
                    "its GEMV: test_matmul[1-*-Q5_K]",
    QuantType.Q6_K: "test_fused_decode_equals_layer_by_layer_on_every_block_shape[gemma3] (down_proj, file layout)",
    QuantType.Q3_K: "[Q2_K] here (low-bit kernels, file layout); its GEMV: test_matmul[1-*-Q3_K]",
    QuantType.IQ4_NL: "[Q2_K] here (low-bit kernels, file layout); its GEMV: test_matmul[1-*-IQ4_NL]",
    QuantType.IQ4_XS: "[Q2_K] here (low-bit kernels, file layout); its GEMV: test_matmul[1-*-IQ4_XS]",
}


@pytest.mark.parametrize("qtype", [pytest.param(q, marks=pytest.mark.deep) if q in _FUSED_ELSEWHERE else q
                                   for q in sorted(TRAITS, key=int)], ids=lambda q: QuantType(q).name)
def test_fused_decode_equals_layer_by_layer_on_every_weight_type(qtype):
    block = make_block(qtype)
    packed = [lin.pack() for lin in block.linears()]  # every linear in the x8 layout where the type has one
    assert packed == [TRAITS[qtype].interleaved is not None] * len(packed)
    fused, ref, cache, other = decode_both(block)
    close(fused, ref)
    close(cache.k[0], other.k[0])
    close(cache.v[0], other.v[0])


@pytest.mark.parametrize("shape, qtype, kw", [
    ("gpt2", QuantType.F32, dict(bias=True)),                             # LayerNorm, GELU MLP, biases
    ("llama", QuantType.Q8_0, dict(bias=True, separate_qkv=True)),       # Qwen2's q/k/v biases, apart
    ("gemma3", QuantType.Q4_K, dict(down_type=QuantType.Q6_K)),          # sandwich norms, q/k norms, GeGLU, Q4_K_M
    ("llama", QuantType.Q4_0, dict(down_type=QuantType.Q8_0)),           # mixed types, file layout (unpacked)
])
def test_fused_decode_equals_layer_by_layer_on_every_block_shape(shape, qtype, kw):
    block = make_block(qtype, shape=shape, **kw)
    if shape == "gemma3":
        for lin in block.linears():
            lin.pack()
    fused, ref, cache, other = decode_both(block)
    close(fused, ref)
    close(cache.k[0], other.k[0])


def test_one_block_shape_is_one_kernel_whether_its_arrays_are_writable_or_not():
    """A memory-mapped file's weights are read-only, weights made or packed in NumPy writable, and
    Numba compiles a kernel apart for each mix: FusedBlock hands the kernels read-only views of
    every array, so two blocks of one shape, one with every array read-only, one with none, get the
    same argument types (numba.typeof, what the dispatcher keys its compiles by): one compile."""
    def fused(read_only):
        block = make_block(QuantType.Q8_0, shape="gemma3", bias=True)  # norms, q/k norms, biases, RoPE
        block.attn.qkv.pack()
        for array in (n.weight for n in (block.attn_norm, block.ffn_norm, block.attn.q_norm)):
            array.flags.writeable = not read_only
        block.attn.qkv.bias.flags.writeable = not read_only
        return block.fused()

    kinds = [(numba.typeof(f.pre_w), numba.typeof(f.post_w)) for f in (fused(True), fused(False))]
    assert kinds[0] == kinds[1]
    arrays = [v for v in fused(False).pre_w + fused(False).post_w if isinstance(v, np.ndarray)]
    assert arrays and not any(a.flags.writeable for a in arrays)


def test_fused_decode_under_trace_reports_every_op_like_the_reference():
    """Names, details, attributes and nesting of a traced fused step are the reference step's."""
    def traced(fused):
        block = make_block(QuantType.Q8_0, shape="gemma3", seed=3)
        a = block.attn
        cache = KVCache(1, a.n_kv_heads, a.head_dim, 8)
        block(np.ones((3, 64), np.float32), 0, cache)
        block.fused_decode = fused
        got = []
        perf.add_collector(got.append)
        try:
            block(np.ones((1, 64), np.float32), 3, cache)
        finally:
            perf.remove_collector(got.append)
        return sorted(span_rows(got)), got

    fused, fused_recs = traced(True)
    ref, _ = traced(False)
    assert fused == ref
    step = next(r for r in fused_recs if r["name"] == "transformer[0]::forward")
    assert set(step["parts"]) == {"attn", "ffn"} and sum(step["parts"].values()) <= step["dur_ms"]


@pytest.mark.parametrize("shape, qtype, kw", [
    ("llama", QuantType.Q4_0, {}),                                   # one run over every block
    ("gemma3", QuantType.Q4_K, dict(down_type=QuantType.Q6_K)),      # a global layer between sliding ones
    ("gpt2", QuantType.F32, dict(bias=True)),                        # file layout, biases, LayerNorm
])
def test_fused_step_over_several_blocks_equals_layer_by_layer(shape, qtype, kw):
    """FusedStep walks runs of like blocks in one call each, every layer's weights and cache arrays
    reached by address from the first one's: held to the layer-by-layer path block by block."""
    blocks = [make_block(qtype, shape=shape, seed=seed, **kw) for seed in range(4)]
    for i, block in enumerate(blocks):
        block.index = i
        for lin in block.linears():
            lin.pack()
    if shape == "gemma3":
        blocks[2].attn.window = None  # Gemma 3's global layer: a run of its own
    step = FusedStep(blocks, [b.fused() for b in blocks])
    assert len(step.runs) == (3 if shape == "gemma3" else 1)
    step_against_blocks(blocks, step, prompt=5, steps=3, seed=2)


def step_against_blocks(blocks, step, prompt, steps, seed):
    """Prefill `prompt` positions layer by layer, then `steps` decode steps through `step` and
    block by block from copies of the cache: outputs and caches held equal."""
    n = len(blocks)
    a, d = blocks[0].attn, blocks[0].attn_norm.weight.shape[0]
    windows = [b.attn.window for b in blocks]
    cache, other = (KVCache(n, a.n_kv_heads, a.head_dim, prompt + steps, windows=windows) for _ in range(2))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((prompt, d)).astype(np.float32)
    for block in blocks:
        x = block(x, 0, cache)
    for i in range(n):
        other.k[i][:], other.v[i][:] = cache.k[i], cache.v[i]
        other.written[i] = cache.written[i]
    for t in range(steps):
        x = rng.standard_normal((1, d)).astype(np.float32)
        got = step(x.copy(), prompt + t, cache)
        ref = x.copy()
        for block in blocks:
            block.fused_decode = False
            ref = block(ref, prompt + t, other)
            block.fused_decode = True
        close(got, ref)
    for i in range(n):
        close(cache.k[i], other.k[i])
        close(cache.v[i], other.v[i])


def test_fused_step_under_debug_reports_the_blocks_like_one_by_one():
    """LOG=debug: the one-call step makes each block's span from the kernel's ticks (after the
    step), with the names, layers, parts and parent the block-by-block path gives them."""
    def debug_step(whole):
        blocks = [make_block(QuantType.Q4_0, shape="llama", seed=i, index=i) for i in range(3)]
        step = FusedStep(blocks, [b.fused() for b in blocks])
        a = blocks[0].attn
        cache = KVCache(3, a.n_kv_heads, a.head_dim, 8)
        x = np.ones((1, blocks[0].attn_norm.weight.shape[0]), np.float32)
        got = []
        perf.add_collector(got.append, level=logging.DEBUG)
        try:
            with perf.get("pyml.nlp.model").debug("model::forward", "", op="model"):
                if whole:
                    y = step(x, 0, cache)
                else:
                    y = x
                    for block in blocks:
                        y = block(y, 0, cache)
        finally:
            perf.remove_collector(got.append)
        top = next(r for r in got if r["name"] == "model::forward")
        recs = [r for r in got if r["name"] != "model::forward"]
        assert all(r["parent"] == top["id"] for r in recs)
        assert all(top["start"] <= r["start"] and r["start"] + r["dur_ms"] / 1e3 <= top["start"] + top["dur_ms"] / 1e3
                   for r in recs)
        return y, [(r["name"], r["layer"], r["kind"], sorted(r["parts"])) for r in recs]

    y, whole = debug_step(True)
    ref, one_by_one = debug_step(False)
    close(y, ref)
    assert whole == one_by_one == [(f"transformer[{i}]::forward", i, "global", ["attn", "ffn"]) for i in range(3)]


@pytest.mark.parametrize("shape, qtype, kw", [
    ("llama", QuantType.Q4_0, {}),                                   # one run over every block
    ("gemma3", QuantType.Q8_0, {}),                                  # q/k norms, sandwich norms, a window; 3 runs
    ("gpt2", QuantType.F32, dict(bias=True)),                        # LayerNorm, GELU MLP, biases, no RoPE
])
def test_fused_step_under_trace_gives_the_span_tree_of_the_block_by_block_and_layer_by_layer_paths(shape, qtype, kw):
    """LOG=trace through the one-call step: every op of every layer timed inside decode_layers
    (the cache write and attention too) and made into spans after the step - the same names,
    details, attributes, nesting, counts and end order as the blocks called one by one and as
    the layer-by-layer reference, whose spans are opened in Python."""
    def traced(path):
        blocks = [make_block(qtype, shape=shape, seed=i, index=i, **kw) for i in range(4)]
        if shape == "gemma3":
            blocks[2].attn.window = None  # a global layer between sliding ones: the model's layer
        step = FusedStep(blocks, [b.fused() for b in blocks])  # indices in the events, past run 0
        assert len(step.runs) == (3 if shape == "gemma3" else 1)
        a, d = blocks[0].attn, blocks[0].attn_norm.weight.shape[0]
        cache = KVCache(4, a.n_kv_heads, a.head_dim, 8, windows=[b.attn.window for b in blocks])
        x = np.random.default_rng(4).standard_normal((6, d)).astype(np.float32)
        for block in blocks:  # prefill past the window: the attention's span is capped by it
            x = block(x, 0, cache)
        got = []
        perf.add_collector(got.append)
        try:
            with perf.get("pyml.nlp.model").debug("model::forward", "", op="model"):
                y = np.ones((1, d), np.float32)
                if path == "step":
                    y = step(y, 6, cache)
                else:
                    for block in blocks:
                        block.fused_decode = path == "blocks"
                        y = block(y, 6, cache)
        finally:
            perf.remove_collector(got.append)
        assert_inside_parents(got)
        return y, span_rows(got)

    y, step = traced("step")
    y_blocks, blocks = traced("blocks")
    y_ref, ref = traced("reference")
    close(y, y_ref)
    close(y_blocks, y_ref)
    assert step == blocks == ref  # in end order: the lines come out in the same order
    names = [r[1] for r in step]
    assert names.count("kv_cache::update") == names.count("attention::sdpa") == names.count("attention::forward") == 4
    assert [r[5] for r in step if r[1] == f"transformer[{r[5]}]::forward"] == ["0", "1", "2", "3"]
    sdpa = [r[2] for r in step if r[1] == "attention::sdpa"]  # the span attended: 7 positions, or the window's 4
    assert sdpa == [f"q=[4, 16] kv=[2, {4 if shape == 'gemma3' and i != 2 else 7}, 16] f16" for i in range(4)]


@pytest.mark.parametrize("threads", [2, 1])
@pytest.mark.parametrize("shape, qtype, kw", [
    ("llama", QuantType.Q4_0, {}),                                   # SmolLM2's Q4_0 file
    ("llama", QuantType.Q4_1, dict(bias=True)),                      # mins, biases
    ("gemma3", QuantType.Q4_K, {}),                                  # sandwich and q/k norms, GeGLU, window
    ("gpt2", QuantType.Q8_0, dict(bias=True)),                       # LayerNorm, an up alone, Q8_0's offset bytes
])
def test_one_region_step_equals_layer_by_layer(shape, qtype, kw, threads):
    """The one-region step (decode_region: threads claim each op's pieces from counters) against
    the layer-by-layer path, over spans long enough to be split between threads, and on one
    thread, where the single thread must take every piece itself."""
    blocks = [make_block(qtype, shape=shape, seed=seed, **kw) for seed in range(3)]
    for i, block in enumerate(blocks):
        block.index = i
        for lin in block.linears():
            lin.pack()
    step = FusedStep(blocks, [b.fused() for b in blocks])
    assert all(r is not None for r in step.regions)  # the region is what runs
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        step_against_blocks(blocks, step, prompt=150, steps=4, seed=3)
    finally:
        numba.set_num_threads(before)


def _packed_blocks(shape, qtype, n, kw):
    blocks = [make_block(qtype, shape=shape, seed=i, index=i, **kw) for i in range(n)]
    for block in blocks:
        for lin in block.linears():
            lin.pack()
    if shape == "gemma3":
        blocks[2].attn.window = None  # a global layer between sliding ones: a run of its own
    return blocks


def _step_records(blocks, path, level, pos=6):
    """One decode step at `pos` after a layer-by-layer prefill, recorded at `level`: through the
    region ("region"), decode_layers ("layers": the step's regions taken away) or the reference;
    returns the output, the records, and the step."""
    step = FusedStep(blocks, [b.fused() for b in blocks])
    if path == "region":
        assert all(r is not None for r in step.regions)
    elif path == "layers":
        step.regions = [None] * len(step.runs)
    a, d = blocks[0].attn, blocks[0].attn_norm.weight.shape[0]
    cache = KVCache(len(blocks), a.n_kv_heads, a.head_dim, pos + 2, windows=[b.attn.window for b in blocks])
    x = np.random.default_rng(4).standard_normal((pos, d)).astype(np.float32)
    for block in blocks:
        block.fused_decode = True
        x = block(x, 0, cache)
    got = []
    perf.add_collector(got.append, level=level)
    try:
        with perf.get("pyml.nlp.model").debug("model::forward", "", op="model"):
            y = np.ones((1, d), np.float32)
            if path == "reference":
                for block in blocks:
                    block.fused_decode = False
                    y = block(y, pos, cache)
                    block.fused_decode = True
            else:
                y = step(y, pos, cache)
    finally:
        perf.remove_collector(got.append)
    assert_inside_parents(got)
    return y, got, step


REGION_SHAPES = [
    ("llama", QuantType.Q4_0, {}),                # SmolLM2's Q4_0 file: one run
    ("gemma3", QuantType.Q4_K, {}),               # q/k norms, sandwich norms, a window; 3 runs
]


@pytest.mark.parametrize("shape, qtype, kw", REGION_SHAPES)
def test_region_under_debug_gives_the_block_spans_of_decode_layers(shape, qtype, kw):
    """LOG=debug through the one-region step: each layer's (start, middle, end) ticks, written by
    whichever thread takes the layer's one-thread steps, become the block spans decode_layers'
    ticks make - same names, layers, parts, parent - ordered and inside the step."""
    blocks = _packed_blocks(shape, qtype, 4, kw)
    y, got, step = _step_records(blocks, "region", logging.DEBUG)
    y_layers, got_layers, _ = _step_records(blocks, "layers", logging.DEBUG)
    close(y, y_layers)

    def rows(records):
        top = next(r for r in records if r["name"] == "model::forward")
        return [(r["name"], r["layer"], r["kind"], sorted(r["parts"]), r["parent"] == top["id"]) for r in records
                if r is not top]
    assert rows(got) == rows(got_layers) == [(f"transformer[{i}]::forward", i, blocks[i].attn.kind, ["attn", "ffn"],
                                              True) for i in range(4)]
    ticks = np.concatenate([pool.last() for pool in step.ticks])  # the kernel's own: start <= middle <= end,
    # layer after layer
    assert (ticks > 0).all() and (np.diff(ticks.ravel()) >= 0).all()
    blocks_recs = [r for r in got if r["name"].startswith("transformer[")]
    assert all(0 < r["parts"]["attn"] and 0 < r["parts"]["ffn"] for r in blocks_recs)
    assert all(sum(r["parts"].values()) <= r["dur_ms"] + 1e-6 for r in blocks_recs)


@pytest.mark.parametrize("shape, qtype, kw", REGION_SHAPES)
def test_region_under_trace_gives_the_span_tree_of_decode_layers_and_the_reference(shape, qtype, kw):
    """LOG=trace through the one-region step: every op's event made inside the region (a GEMV's
    from its activation's quantization to its last piece done, on either thread) - the same
    names, details, attributes, nesting and end order as decode_layers and the layer-by-layer
    path, every span inside its parent."""
    blocks = _packed_blocks(shape, qtype, 4, kw)
    y, got, _ = _step_records(blocks, "region", perf.TRACE)
    y_layers, got_layers, _ = _step_records(blocks, "layers", perf.TRACE)
    y_ref, got_ref, _ = _step_records(blocks, "reference", perf.TRACE)
    close(y, y_ref)
    close(y_layers, y_ref)
    assert span_rows(got) == span_rows(got_layers) == span_rows(got_ref)


def test_spans_timed_inside_the_region_say_so():
    """Every span the region's ticks and events make is marked as timed inside compiled code (a
    report charges it two counter reads); the reference path's spans are Python's, unmarked."""
    blocks = _packed_blocks("llama", QuantType.Q4_0, 2, {})
    _, got, _ = _step_records(blocks, "region", perf.TRACE)
    _, ref, _ = _step_records(blocks, "reference", perf.TRACE)
    inside = [r for r in got if r["name"] != "model::forward"]
    assert len(inside) > 20 and all(r.get("compiled") for r in inside)
    assert not any(r.get("compiled") for r in ref)


def test_region_with_logging_off_writes_no_tick_and_no_event():
    """Logging off, the region takes `timed` False: no counter is read, so nothing is written."""
    blocks = _packed_blocks("llama", QuantType.Q4_0, 3, {})
    perf.configure("")
    step = FusedStep(blocks, [b.fused() for b in blocks])
    for pool in step.ticks:
        pool.rows[:] = -1
        pool.untimed[:] = -1
    first = step.runs[0][0]
    first.events.events[:] = 0
    a, d = blocks[0].attn, blocks[0].attn_norm.weight.shape[0]
    cache = KVCache(3, a.n_kv_heads, a.head_dim, 4)
    step(np.ones((1, d), np.float32), 0, cache)
    assert all((p.rows == -1).all() and (p.untimed == -1).all() and p.next == 0 for p in step.ticks)
    assert not first.events.events.any()
    assert not step.regions[0][1][-16:].any()  # the latest-tick slot never written


def test_tick_pool_keeps_each_calls_rows_past_a_refill():
    """A timed call's rows stay as the kernel left them until its deferred records read them,
    however many calls come before the drain: a used-up pool is replaced, not overwritten."""
    pool = TickPool(2, calls=2)
    taken = []
    for k in range(5):
        rows = pool.take()
        rows[:] = k
        taken.append(rows)
    assert [int(r[0, 0]) for r in taken] == [0, 1, 2, 3, 4] and (pool.last() == 4).all()
