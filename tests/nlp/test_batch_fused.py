"""A batched decode step in one compiled call per run of like blocks (FusedStep.rows, decode_rows)
against its oracle, the layer-by-layer batched path (TransformerBlock over a Batch: Attention._batched,
the layers' own products over the rows), on every stand-in architecture (pyml/cli/standins.py), with
f16 caches (the default) and f32 ones.

Both paths run the same kernels on the same rows (each decode row its GEMV's bits, the batched
attention over the pool), so the logits are equal bit for bit. Each sequence alone is the oracle of
both (tests/nlp/test_batch.py: check_batch_equals_alone, whose decode steps now take this path).
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pyml
from pyml.cli.standins import write_gemma3, write_gemma3_gguf, write_gpt2, write_llama_gguf
from pyml.core import perf
from pyml.nn import fused
from pyml.nn.fused import FusedStep

# no one-token prompt: its prefill would be a one-sequence decode step in the pool's cache type, a
# decode_region compile of its own for f32 (~1 min of a core); a one-token prompt's row: test_batch.py
PROMPTS = [[5, 9, 2, 77, 31, 64, 12], [8, 90], [1, 33, 47, 3, 100, 17, 4, 4, 60, 21, 2], [42, 6]]
STEPS = 6  # past gemma3-tiny's window of 8 for the 11-token prompt


def _model(tmp_path, arch):
    if arch == "gpt2":  # LayerNorm, a plain MLP, biases, learned positions; f32 weights (the file's layout)
        return pyml.load_model(safetensors=str(write_gpt2(tmp_path, "gpt2-tiny", n_positions=64)), threads=2).model
    if arch == "gemma3":  # q/k norms, sandwich norms, sliding and global layers apart; f32 weights
        directory = write_gemma3(tmp_path / "g", "gemma3-tiny", max_position_embeddings=256)
        return pyml.load_model(safetensors=str(directory), threads=2).model
    if arch == "gemma3-q8_0":  # the same in x8 Q8_0
        path = write_gemma3_gguf(tmp_path / "g.gguf", "gemma3-tiny", target="q8_0")
        return pyml.load_model(gguf=str(path), threads=2).model
    _, target = arch.split("-")  # llama: x8 Q4_0; Q6_K (llama-256's mix: the file's layout, K-quants); f16
    name = "llama-256" if target.endswith("_k") else "llama-tiny"
    path = write_llama_gguf(tmp_path / f"{arch}.gguf", name, target=target)
    return pyml.load_model(gguf=str(path), threads=2, float_compute="f32").model


def decode_steps(model, compiled: bool, kv_type: str) -> list:
    """Logits of STEPS batched decode steps (every row one token) after each prompt's prefill, through
    the compiled step (`compiled`) or the layer-by-layer one; the rows in another order each step and
    one sequence left out of some steps (each row's own sequence and position)."""
    pool = model.new_pool(len(PROMPTS), 64, kv_type=kv_type)
    tokens = [int(np.argmax(model.forward_batch(pool, [(i, p, 0)])[0])) for i, p in enumerate(PROMPTS)]
    out = []
    for block in model.blocks:
        block.fused_decode = compiled
    try:
        for step in range(STEPS):
            seqs = [i for i in range(len(PROMPTS)) if not (step % 3 == 2 and i == 1)]
            seqs = seqs[::-1] if step % 2 else seqs
            logits = model.forward_batch(pool, [(i, [tokens[i]], pool.sequence(i).length) for i in seqs])
            out.append(logits)
            for i, row in zip(seqs, logits):
                tokens[i] = int(np.argmax(row))
    finally:
        for block in model.blocks:
            block.fused_decode = True
    return out


@pytest.fixture
def compiled_steps(monkeypatch):
    """Counts the batched steps FusedStep.rows ran compiled (it returns None where it does not)."""
    calls = []
    rows = FusedStep.rows

    def counted(self, x, *where):
        out = rows(self, x, *where)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(FusedStep, "rows", counted)
    return calls


# Every stand-in with the default f16 cache, and with an f32 one where that pool's compiled step is
# compiled by the default tier anyway (gpt2, gemma3: tests/nlp/test_batch.py). An f32 pool on the others
# is the deep tier's: a decode_rows compile of its own each (~15 s of a core with an empty kernel cache)
# for the same code - the cache type reaches the step only as the attention's and the KV write's array
# types, which gpt2 and gemma3 here, and tests/nn/test_attention_batch.py per kernel, already run in f32.
_ARCHS = ["llama-q4_0", "llama-q6_k", "llama-f16", "gpt2", "gemma3", "gemma3-q8_0"]
_F32_DEFAULT = ("gpt2", "gemma3")


@pytest.mark.parametrize("arch, kv_type", [(a, "f16") for a in _ARCHS] + [
    (a, "f32") if a in _F32_DEFAULT else pytest.param(a, "f32", marks=pytest.mark.deep) for a in _ARCHS])
def test_compiled_batched_step_equals_layer_by_layer(tmp_path, arch, kv_type, compiled_steps):
    model = _model(tmp_path, arch)
    got = decode_steps(model, True, kv_type)
    assert compiled_steps == [True] * STEPS  # every step took the compiled call
    ref = decode_steps(model, False, kv_type)
    assert compiled_steps == [True] * STEPS + [False] * STEPS  # the reference: never compiled
    for step, (a, b) in enumerate(zip(got, ref)):
        assert np.array_equal(a, b), f"{kv_type} step {step}: {np.abs(a - b).max():.2e}"


@pytest.mark.parametrize("arch", ["llama-q4_0", "gemma3-q8_0"])
def test_the_rows_region_equals_decode_rows(tmp_path, arch, compiled_steps, monkeypatch):
    """x8 blocks take decode_rows_region (a batched step as one parallel region); the same steps as
    decode_rows' calls, the same bits. Its rows step by step against decode_rows' on the same model,
    at 3 and 4 rows (below fused.ROWS_REGION_MIN, which is a speed threshold only)."""
    monkeypatch.setattr(fused, "ROWS_REGION_MIN", 2)
    model = _model(tmp_path, arch)
    step = model._fused_step()
    assert all(c is not None for c in step.rows_counters)  # the region is what runs
    got = decode_steps(model, True, "f16")
    counters, step.rows_counters = step.rows_counters, [None] * len(step.runs)  # decode_rows instead
    ref = decode_steps(model, True, "f16")
    step.rows_counters = counters
    assert compiled_steps == [True] * (2 * STEPS)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert np.array_equal(a, b), f"step {i}: {np.abs(a - b).max():.2e}"


def test_a_traced_decode_step_keeps_the_layer_by_layer_spans(tmp_path, compiled_steps):
    """LOG=trace: the batched decode step takes the layer-by-layer path (its spans: each product over
    the B rows, the attention with `batch=B`); logging off, the compiled call."""
    model = _model(tmp_path, "llama-q4_0")
    pool = model.new_pool(2, 64)
    model.forward_batch(pool, [(0, [1, 2, 3], 0), (1, [4, 5], 0)])
    got = []
    perf.add_collector(got.append)
    try:
        model.forward_batch(pool, [(0, [7], 3), (1, [8], 2)])
    finally:
        perf.remove_collector(got.append)
    n_layers = len(model.blocks)
    assert compiled_steps == [False]
    assert sum(r["name"] == "attention::sdpa" and r["details"].startswith("batch=2 ") for r in got) == n_layers
    products = [r["details"] for r in got if r["name"] == "linear::forward"]
    assert len(products) == 4 * n_layers + 1 and all(d.startswith("[2, ") for d in products)  # and the head
    model.forward_batch(pool, [(0, [9], 4), (1, [10], 3)])
    assert compiled_steps == [False, True]


# A batched generation in a fresh process, after warm_batch: 12 prompts of 2-4 tokens over 9 slots,
# so prompt rows beside decode rows, 9-row steps (the rows region) and fewer-row ones (decode_rows).
# Prints the misses of every disk-cached kernel it ran, every compile of the process, the kernels
# loaded after warm_batch and the steps' (rows, sequences).
_BATCHED_STEP = textwrap.dedent("""
    import gc, json, sys
    import numba
    import pyml
    from pyml.core import compiles
    from pyml.nlp.batch_generator import BatchGenerator

    def loaded():
        return {(id(d), sig): d for d in gc.get_objects() if isinstance(d, numba.core.dispatcher.Dispatcher)
                for sig in d.overloads}

    lm = pyml.load_model(gguf=sys.argv[1], threads=2)
    lm.warm_batch(9)
    warm = loaded()
    gen = BatchGenerator(lm.model, 9, 32)
    for i in range(12):
        gen.submit([5 + i, 9, 2, 7][:2 + i % 3], 3 + i % 4)
    shapes = set()
    while gen.busy:
        gen.step()
        shapes.add(gen.last_shape)
    after = loaded()
    cached = [d for d in gc.get_objects() if isinstance(d, numba.core.dispatcher.Dispatcher) and d._cache.__class__
              .__name__ != "NullCache"]
    print(json.dumps({"misses": {d.py_func.__qualname__: sum(d.stats.cache_misses.values()) for d in cached
                                 if d.stats.cache_misses or d.stats.cache_hits},
                      "compiled": compiles.compiled(),
                      "after_warm": sorted({compiles.kernel_name(after[k]) for k in after.keys() - warm.keys()}),
                      "shapes": sorted(shapes)}))
""")


def test_a_second_process_loads_the_batched_steps_kernels_from_the_cache_in_warm_batch(tmp_path):
    """A kernel whose cache index changes from process to process (a closure holding another
    dispatcher: its pickle is the process's) compiles in every run: the first pyml-batch step of
    each run once took 13 s; one without a disk cache called from Python (the rows' activation
    buffers) compiled in every run too, 0.45 s of a first batched step. The second of two processes
    compiles nothing, and warm_batch has loaded every kernel the generation's steps run."""
    path = write_llama_gguf(tmp_path / "l.gguf", "llama-tiny", target="q4_0")
    runs = [subprocess.run([sys.executable, "-c", _BATCHED_STEP, str(path)], capture_output=True, text=True,
                           timeout=600, env=dict(os.environ, PYML_COMPILE_HELPER="0")) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    got = json.loads(runs[1].stdout.strip().splitlines()[-1])
    shapes = [tuple(s) for s in got["shapes"]]
    assert any(rows > seqs > 1 for rows, seqs in shapes), shapes  # prompt rows beside decode rows
    assert any(rows == seqs >= fused.ROWS_REGION_MIN for rows, seqs in shapes), shapes
    assert any(2 <= rows == seqs < fused.ROWS_REGION_MIN for rows, seqs in shapes), shapes
    misses = got["misses"]
    assert any("decode_rows_region" in name for name in misses), misses  # what the steps ran
    assert not {name: n for name, n in misses.items() if n}, misses
    assert got["compiled"] == [], got["compiled"]
    assert got["after_warm"] == [], got["after_warm"]
