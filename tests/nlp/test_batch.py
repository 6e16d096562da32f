"""A batched forward pass (DecoderModel.forward_batch over a KVPool) against each sequence run alone.

The oracle is the single-sequence path (itself checked against transformers in test_llama,
test_gemma3, test_gpt2 and test_architectures): the same prompts, one at a time, each in a KVCache
of its own. A batch must give the same greedy tokens; sequences of different lengths, at different
positions, a prompt that joins while the others decode (a mixed pass), sliding windows and a ring
that wraps are covered.

The logits are equal bit for bit (TOL = 0): a sequence's decode row takes its GEMV's bits in a batch
(quant.decode_rows), a prompt's rows the GEMM's, whose rows do not depend on the rows beside them
(tests/quant/test_row_invariance.py). One exception, float weights (F32/F16/BF16 matrices) when a
pass crosses floats.py's PANEL_MIN_T (64 rows): the pass takes the panel GEMM, a short prompt alone
the register tiles, which sum in another order (float32 rounding, ~1e-6 of the largest logit:
test_gemma3_sliding_window_and_a_ring_that_wraps, a 280-token prompt beside a 3-token one).
Float weights in f32 compute and with `float_compute` bf16 (auto on an avx512_bf16 CPU) alike: the
bf16 blocks' GEMM is row-invariant too.
"""

import numpy as np
import pytest

import pyml
from pyml.cli.standins import write_gemma3, write_gpt2, write_llama_gguf
from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.nn.batch import Batch

PROMPTS = [[5, 9, 2, 77, 31, 64, 12], [8, 90], [1, 33, 47, 3, 100, 17, 4, 4, 60, 21, 2], [42]]
STEPS = 6
TOL = 0.0  # bit for bit (see above)


def greedy_alone(model, prompt, steps, kv_type, max_len=64):
    """(tokens, logits per step) of one prompt decoded greedily in a cache of its own."""
    cache = model.new_cache(max_len, kv_type=kv_type)
    logits = [model.forward(prompt, cache)]
    tokens = [int(np.argmax(logits[-1]))]
    for _ in range(steps):
        logits.append(model.forward([tokens[-1]], cache))
        tokens.append(int(np.argmax(logits[-1])))
    return tokens, logits


def greedy_batched(model, prompts, steps, kv_type, join_at=None, max_len=64):
    """The same, every prompt in one KVPool and one pass a step. `join_at`: the last prompt joins at
    that step, its whole prompt a row of a pass whose other rows are decode steps."""
    pool = model.new_pool(len(prompts), max_len, kv_type=kv_type)
    late = len(prompts) - 1 if join_at is not None else None
    tokens, logits = [[] for _ in prompts], [[] for _ in prompts]
    for step in range(steps + 1 + (join_at or 0)):
        rows = []
        for i, prompt in enumerate(prompts):
            if i == late and step < join_at or len(tokens[i]) == steps + 1:
                continue
            cache = pool.sequence(i)
            rows.append((i, prompt if cache.length == 0 else [tokens[i][-1]], cache.length))
        out = model.forward_batch(pool, rows)
        for (i, _, _), row in zip(rows, out):
            logits[i].append(row)
            tokens[i].append(int(np.argmax(row)))
    return tokens, logits


# f16, load_model's own cache type: its warm-up compiles the fused decode step for it, and a test in
# another type compiles the step (a minute of a core for an x8 model) again. f32 and q8_0: below.
def check_batch_equals_alone(model, prompts=PROMPTS, kv_type="f16", join_at=None, max_len=64, tol=TOL):
    got_tokens, got_logits = greedy_batched(model, prompts, STEPS, kv_type, join_at, max_len)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = greedy_alone(model, prompt, STEPS, kv_type, max_len)
        assert got_tokens[i] == ref_tokens, f"sequence {i}"
        for step, (got, ref) in enumerate(zip(got_logits[i], ref_logits)):
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err <= tol, f"sequence {i} step {step}: {err:.2e}"


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return pyml.load_model(gguf=str(smollm2_gguf), threads=2).model


@pytest.fixture(scope="module")
def gemma3_real(gemma3_gguf):
    return pyml.load_model(gguf=str(gemma3_gguf), threads=2).model


def test_real_smollm2_batch_equals_alone(smollm2):
    check_batch_equals_alone(smollm2)


def test_real_smollm2_a_prompt_joins_while_others_decode(smollm2):
    check_batch_equals_alone(smollm2, join_at=2)


def test_a_long_prompts_micro_batches_never_end_in_one_token(smollm2, monkeypatch):
    """A prompt one token past a multiple of forward's micro-batch (ubatch): its last two tokens go
    in one pass, not the last alone (a decode step, whose attention is f32 where the prefill's is
    bf16, an avx512_bf16 CPU's default), so its logits are those of the prompt in one pass, bit for bit."""
    ids = [5, 9, 2, 77, 31, 64, 12, 8, 90]
    whole = smollm2.forward(ids, smollm2.new_cache(32))
    monkeypatch.setattr(smollm2, "ubatch", 4)  # 4 + 3 + 2, where it was 4 + 4 + 1
    assert np.array_equal(smollm2.forward(ids, smollm2.new_cache(32)), whole)


def test_real_gemma3_batch_equals_alone(gemma3_real):
    check_batch_equals_alone(gemma3_real, join_at=3)


# a prompt of several tokens joins while the others decode: that pass runs each projection as two
# matmuls (the decode rows' GEMVs, the prompt's GEMM), where PROMPTS' late [42] is one more decode row
JOINING = PROMPTS[:3] + [[42, 7, 19, 3, 88, 5]]


# Every weight type x the compiled batched step is the deep tier's breadth: each type is a block shape
# of its own, so a decode_rows, a decode_layers and (x8) a decode_region compile (~1 min of a core
# with an empty kernel cache). The default tier keeps the stand-ins tests/nlp/test_batch_fused.py
# compiles too (llama-tiny Q4_0 in x8, llama-256 Q6_K in the file's layout, llama-tiny F16); each other
# type's batched rows are its GEMV's bits in tests/quant/test_matmul.py and test_interleaved.py
# (test_a_few_rows_give_each_row_the_gemv_bits), its fused step the layer-by-layer path's in
# tests/nn/test_fused.py (test_fused_decode_equals_layer_by_layer_on_every_weight_type).
_BATCH_DEFAULT = ("q4_0", "q6_k", "f16")


@pytest.mark.parametrize("target", [t if t in _BATCH_DEFAULT else pytest.param(t, marks=pytest.mark.deep)
                                    for t in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k",
                                              "q6_k", "f16", "bf16", "f32")])
def test_llama_weight_types_batch_equals_alone(tmp_path, target):
    """Every weight type pyml-quantize writes, in the x8 layout where it has one and the file's
    otherwise: a batch's logits are each sequence's alone, bit for bit, a prompt joining mid-run.
    The K-quants need rows of 256 values (llama-256). Deep but for _BATCH_DEFAULT (see above)."""
    name = "llama-256" if target.endswith("_k") else "llama-tiny"
    path = write_llama_gguf(tmp_path / f"llama-{target}.gguf", name, target=target)
    check_batch_equals_alone(pyml.load_model(gguf=str(path), threads=2, float_compute="f32").model, JOINING,
                             join_at=1)


def test_gpt2_learned_positions_batch_equals_alone(tmp_path):
    """GPT-2 adds a learned embedding per position: each row's own position, not the pass's."""
    model = pyml.load_model(safetensors=str(write_gpt2(tmp_path, "gpt2-tiny", n_positions=64)), threads=2).model
    check_batch_equals_alone(model, join_at=2)


def test_gemma3_sliding_window_and_a_ring_that_wraps(tmp_path):
    """Gemma 3's sliding layers (window 8) attend to their window only, and past window + slack
    positions their ring wraps: each sequence's, at its own position."""
    directory = write_gemma3(tmp_path / "g", "gemma3-tiny", max_position_embeddings=512)
    model = pyml.load_model(safetensors=str(directory), threads=2).model
    rng = np.random.default_rng(0)
    long = [int(t) for t in rng.integers(3, 500, 280)]  # past the ring's 264 slots
    prompts = [long, [5, 9, 2], long[:150]]
    # float weights: a pass of 283 rows takes the panel GEMM, [5, 9, 2] alone the tiles (module doc)
    # an f32 cache: an f16 one rounds the two GEMMs' float32 differences into its keys (1.4e-5)
    check_batch_equals_alone(model, prompts, kv_type="f32", join_at=1, max_len=300, tol=1e-5)


# f32 on the real model is deep: a fused decode step of its own to compile; an f32 pool's batched
# step is held to the layer-by-layer path on every stand-in in tests/nlp/test_batch_fused.py
# (test_compiled_batched_step_equals_layer_by_layer), the one-sequence f32 step to transformers in
# tests/nlp/test_architectures.py (test_safetensors_matches_transformers).
@pytest.mark.parametrize("kv_type", [pytest.param("f32", marks=pytest.mark.deep), "q8_0"])
def test_stored_cache_types_batch_equals_alone(smollm2, kv_type):
    """An f32 or q8_0 cache (f16, the default: the tests above) stores the same keys and values
    either way, and the batched attention reads them in the same order as the one-sequence kernel:
    nothing changes."""
    check_batch_equals_alone(smollm2, kv_type=kv_type)


def test_a_copied_sequence_continues_as_the_original(smollm2):
    """n > 1 completions of one prompt: the prompt prefilled once, its cache copied to the others."""
    pool = smollm2.new_pool(3, 64, kv_type="f16")
    prompt = PROMPTS[0]
    first = smollm2.forward_batch(pool, [(0, prompt, 0)])[0]
    pool.copy(0, 2)
    token = int(np.argmax(first))
    out = smollm2.forward_batch(pool, [(0, [token], len(prompt)), (2, [token], len(prompt))])
    ref_tokens, ref_logits = greedy_alone(smollm2, prompt, 1, "f16")
    assert np.array_equal(out[0], out[1]) and np.abs(out[0] - ref_logits[1]).max() <= 1e-5 * np.abs(ref_logits[1]).max()
    pool.clear(2)
    assert pool.sequence(2).length == 0 and pool.sequence(0).length == len(prompt) + 1


@pytest.mark.parametrize("rows, message", [
    ([(0, [1], 0), (0, [2], 1)], "each sequence once"),
    ([(0, [], 0)], "at least one token"),
    ([(0, [1, 2], 63)], "do not fit"),
    ([(1, [3], 0), (0, [1], 64)], "do not fit"),  # a decode step's rows
    ([(5, [1], 0)], "not in this pool"),
])
def test_a_malformed_batch_is_refused_in_one_line(smollm2, rows, message):
    pool = smollm2.new_pool(2, 64)
    with pytest.raises(PymlError, match=message):
        smollm2.forward_batch(pool, rows)


def test_a_passs_rows_are_laid_out_decode_rows_first_each_as_given():
    """Batch: a decode step's rows stay in the order given (in_order: forward_batch returns the head's
    logits as they are); a prompt goes after the decode rows, and `order` maps the pass back."""
    class Pool:
        max_len = 16

    step = Batch(Pool(), [(3, [7], 5), (0, np.array([9]), 2)])
    assert step.in_order and step.order == [0, 1] and step.n_decode == 2 and step.prefill == []
    assert step.tokens.tolist() == [7, 9] and step.positions.tolist() == [5, 2]
    assert step.decode_seqs.tolist() == [3, 0] and step.decode_ends.tolist() == [6, 3]
    assert step.last_rows.tolist() == [0, 1] and step.segments == [(3, 5, 1), (0, 2, 1)]
    mixed = Batch(Pool(), [(1, [4, 5, 6], 0), (2, [8], 3)])
    assert not mixed.in_order and mixed.order == [1, 0] and mixed.n_decode == 1
    assert mixed.tokens.tolist() == [8, 4, 5, 6] and mixed.positions.tolist() == [3, 0, 1, 2]
    assert mixed.decode_seqs.tolist() == [2] and mixed.decode_ends.tolist() == [4]
    assert mixed.prefill == [(1, 1, 0, 3)] and mixed.last_rows.tolist() == [0, 3]
    assert mixed.segments == [(2, 3, 1), (1, 0, 3)]


def test_a_traced_batched_step_names_its_rows_and_sequences(smollm2):
    """LOG=trace of a batched step: the projections as one product over every row (T = rows), the
    attention as one call over the decode rows (`batch=`), a prompt's rows as its own prefill."""
    pool = smollm2.new_pool(3, 64)
    smollm2.forward_batch(pool, [(0, [1, 2, 3], 0), (1, [4, 5], 0)])
    got = []
    perf.add_collector(got.append)
    try:
        smollm2.forward_batch(pool, [(0, [7], 3), (1, [8], 2), (2, [9, 10, 11, 12], 0)])
    finally:
        perf.remove_collector(got.append)
    sdpa = [r["details"] for r in got if r["name"] == "attention::sdpa"]
    assert sdpa.count("batch=2 q=[9, 64] kv=[3, 7, 64] f16") == 30  # positions 0..3 and 0..2: 7 attended
    assert sum(d.startswith("q=[4, 9, 64] kv=[3, 4, 64]") for d in sdpa) == 30  # the prompt's own prefill
    model = [r for r in got if r["name"] == "model::forward"]
    assert len(model) == 1 and model[0]["details"] == "tokens=6 batch=3"
    products = [r["details"] for r in got if r["name"] == "linear::forward"]
    assert len(products) == 4 * 30 + 1 and all(d.startswith("[6, ") for d in products[:-1])  # every row
    assert products[-1].startswith("[3, 576]")  # the head: each sequence's last row only


def test_real_smollm2_batched_speculation_keeps_each_text_and_its_stop(smollm2_gguf):
    """Prompt lookup over a batch (lm.generate_batch's `speculative`) on the real SmolLM2: each text is the
    batch's without drafts, a stop string met inside a step's kept drafts ends the text where it would
    end without them (nothing past it shown), and max_tokens likewise."""
    from pyml.nlp.speculative import SpeculativeConfig
    lm = pyml.load_model(gguf=str(smollm2_gguf), threads=2)
    code = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    prompts = [lm.chat_prompt([{"role": "user", "content": f"Copy this code exactly:\n{code}"}]),
               "one two three four five one two three four five one two three",
               lm.chat_prompt([{"role": "user", "content": "Say hello."}])]
    lookup = SpeculativeConfig(lookup_ngram=3)
    plain = lm.generate_batch(prompts, 40, batch=3)
    spec = lm.generate_batch(prompts, 40, batch=3, speculative=lookup)
    assert [r.text for r in spec] == [r.text for r in plain] and sum(r.drafted for r in spec) > 0
    stop = plain[0].text[len(plain[0].text) // 2:][:6]  # a stop string inside the copied code
    plain = lm.generate_batch(prompts, 40, batch=3, stop=[stop])
    spec = lm.generate_batch(prompts, 40, batch=3, stop=[stop], speculative=lookup)
    assert [(r.text, r.stop_reason) for r in spec] == [(r.text, r.stop_reason) for r in plain]
    assert plain[0].stop_reason == "stop"
