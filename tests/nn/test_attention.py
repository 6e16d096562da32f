"""The attention layer over its KV cache: a sliding-window layer's ring against transformers (prompts
longer than the ring, decode far past the window), the cache's types and their errors on the real
models (docs/performance-journal.md, "Attention and the KV cache"), and what a cache costs in memory."""

import numpy as np
import pytest

import pyml
from pyml.core.errors import PymlError
from pyml.nn.kv_cache import RING_SLACK, KVCache
from tests.conftest import hf_logits, max_rel_err
from tests.nlp.test_gemma3 import save_hf_gemma3

WINDOW = 4


def test_ring_matches_transformers_past_the_ring(torch, tmp_path):
    """Sliding layers keep window + RING_SLACK slots: a prompt longer than that is written and
    attended in pieces, and the decode steps after it wrap the ring again."""
    n = RING_SLACK + 2 * WINDOW + 60
    hf = save_hf_gemma3(tmp_path, sliding_window=WINDOW, max_position_embeddings=2 * n)
    lm = pyml.load_model(safetensors=str(tmp_path), warmup=False, kv_type="f32")
    ids = list(np.random.default_rng(0).integers(0, 101, n))
    ref = hf_logits(hf, ids)
    cache = lm.new_cache(n)
    assert sum(cache.is_ring(i) for i in range(cache.n_layers)) == 6  # the 6 sliding layers of 7
    prompt = n - 20
    got = [lm.model.forward(ids[:prompt], cache, all_logits=True)]
    got += [lm.model.forward([t], cache)[None] for t in ids[prompt:]]
    assert max_rel_err(np.concatenate(got), ref) < 1e-4


def test_ring_memory_is_the_window():
    cache = KVCache(2, 1, 32, 4096, "f16", windows=[512, None])
    assert cache.slots == [512 + RING_SLACK, 4096]
    assert cache.nbytes == 2 * 2 * 32 * (512 + RING_SLACK + 4096)


def test_kv_type_names_are_checked():
    with pytest.raises(PymlError, match="unknown KV cache type 'q4'"):
        KVCache(1, 1, 32, 8, "q4")
    with pytest.raises(PymlError, match="multiple of 32"):
        KVCache(1, 1, 48, 8, "q8_0")


# greedy continuation and top-1 agreement of each type against f32, on the real models:
# the steps f32 takes greedily are fed to every type (teacher forcing), each step's top-1 compared
STEPS = 200
AGREEMENT = {"f16": 0.9, "q8_0": 0.9}


@pytest.mark.deep  # two real models, 3 x 200 decode steps each (~1-2 min); each KV type against f32 and a float64 oracle: the tests above
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_kv_types_agree_with_f32_on_the_real_models(model, smollm2_gguf, gemma3_gguf):
    path = smollm2_gguf if model == "smollm2" else gemma3_gguf
    lm = pyml.load_model(gguf=str(path), warmup=False)
    assert lm.model.kv_type == "f16"  # the default, as llama.cpp's
    prompt = lm.encode("The history of the printing press begins")
    top1 = {}
    for kv_type in ("f32", "f16", "q8_0"):  # f32 first: its greedy steps are every type's input
        cache = lm.new_cache(len(prompt) + STEPS, kv_type)
        logits, steps = lm.model.forward(prompt, cache), []
        for i in range(STEPS):
            steps.append(int(np.argmax(logits)))
            logits = lm.model.forward([top1["f32"][i] if top1 else steps[-1]], cache)
        top1[kv_type] = steps
    agree = {kv_type: np.mean(np.array(top1[kv_type]) == np.array(top1["f32"])) for kv_type in AGREEMENT}
    for kv_type in AGREEMENT:
        same = next((i for i, (a, b) in enumerate(zip(top1[kv_type], top1["f32"])) if a != b), STEPS)
        print(f"\n[{model} kv {kv_type}] top-1 agreement {agree[kv_type]:.3f}, greedy identical for {same} tokens")
    assert all(agree[kv_type] >= bound for kv_type, bound in AGREEMENT.items()), agree


def test_a_ring_refuses_to_resume_where_its_window_was_overwritten():
    """A PromptCache that reuses a short prefix of a long history cannot resume on a ring whose
    slots now hold later positions: one clear error, never a silently wrong window."""
    cache = KVCache(1, 1, 32, 1000, "f32", windows=[8])
    kv = np.zeros((600, 1, 32), np.float32)
    cache.update(0, 0, kv, kv)  # slots hold positions 336 .. 599
    assert cache.resumable(600) and cache.resumable(343) and cache.resumable(0)
    assert not cache.resumable(100)
    with pytest.raises(PymlError, match="prefill from position 0"):
        cache.update(0, 100, kv[:1], kv[:1])
