"""A long prompt runs in micro-batches of `model.ubatch` positions: the same logits as one pass
(each micro-batch attends to the cache the earlier ones wrote), a fraction of the activations."""

import numpy as np
import pytest

from pyml.cli.standins import write_gemma3, write_llama_gguf
from pyml.nlp.api import load_model


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return load_model(gguf=str(write_llama_gguf(d / "m.gguf", "llama-tiny", "f32")), threads=1,
                          kv_type="f32").model
    return load_model(safetensors=str(write_gemma3(d, "gemma3-tiny", sliding_window=4)), threads=1,
                      kv_type="f32").model


def test_micro_batches_give_one_pass_logits(model):
    tokens = np.random.default_rng(0).integers(1, 500, 37)
    whole = model.forward(tokens, model.new_cache(64), all_logits=True)
    saved = model.ubatch
    try:
        model.ubatch = 8
        cache = model.new_cache(64)
        parts = model.forward(tokens, cache, all_logits=True)
        last = model.forward(tokens, model.new_cache(64))
    finally:
        model.ubatch = saved
    assert cache.length == 37 and parts.shape == whole.shape
    np.testing.assert_allclose(parts, whole, rtol=1e-4, atol=1e-4 * np.abs(whole).max())
    np.testing.assert_allclose(last, whole[-1], rtol=1e-4, atol=1e-4 * np.abs(whole).max())


def test_the_head_runs_once_per_prompt(model, monkeypatch):
    """Only the last micro-batch's last position needs logits: the earlier micro-batches fill the
    cache and skip the final norm and the head (Gemma 3's is 262144 x 640)."""
    tokens = np.random.default_rng(2).integers(1, 500, 37)
    head, calls = model.lm_head, []
    monkeypatch.setattr(model, "lm_head", lambda x: calls.append(x.shape) or head(x))
    monkeypatch.setattr(model, "ubatch", 8)
    cache = model.new_cache(64)
    last = model.forward(tokens, cache)
    assert calls == [(1, model.config.hidden_size)] and cache.length == 37
    monkeypatch.setattr(model, "ubatch", 512)
    np.testing.assert_allclose(last, model.forward(tokens, model.new_cache(64)), rtol=1e-4,
                               atol=1e-4 * np.abs(last).max())
    assert model.forward(tokens[:5], cache, head=False) is None and cache.length == 42


def test_micro_batches_on_top_of_a_ring(tmp_path):
    """Gemma 3's sliding layers keep a ring (window 4 + 256 slack slots here): a 600-token prompt in
    micro-batches of 300 writes layer 0's second batch before layer 1 starts its own; each layer
    is checked against what it wrote itself, and the logits are one pass's."""
    model = load_model(safetensors=str(write_gemma3(tmp_path, "gemma3-tiny", sliding_window=4,
                                                    max_position_embeddings=1024)), threads=1, kv_type="f32").model
    tokens = np.random.default_rng(1).integers(1, 500, 600)
    whole = model.forward(tokens, model.new_cache(700), all_logits=True)
    cache = model.new_cache(700)
    assert cache.is_ring(0)
    model.ubatch = 300
    try:
        parts = model.forward(tokens, cache, all_logits=True)
    finally:
        model.ubatch = 512
    np.testing.assert_allclose(parts, whole, rtol=1e-4, atol=1e-4 * np.abs(whole).max())
