"""A prompt's attention in quant.ggml_activations() (nn/attention_ggml.py: Q and the probabilities rounded to
f16, as llama.cpp's mul_mats over its f16 cache round them) against torch's scaled_dot_product_attention in
float64 on the f16-rounded queries; ggml's own ops are the oracle of the peer tier
(tests/quant/test_ggml_grids_peer.py)."""

import numpy as np
import pytest
import torch

import pyml
from pyml import quant
from pyml.core.errors import PymlError
from pyml.nn import attention
from pyml.nn.attention_ggml import attend_as_ggml

T, H, N_KV, HD, POS = 9, 4, 2, 32, 5


def sdpa64(q, keys, values, pos, start, scale, window):
    """torch's attention in float64: q [T, H, hd], keys/values [Hkv, S, hd] -> [T, H, hd], and the probabilities."""
    qp, kp = np.arange(pos, pos + q.shape[0])[:, None], np.arange(start, start + keys.shape[1])[None, :]
    visible = kp <= qp
    if window:
        visible &= kp > qp - window
    group = q.shape[1] // keys.shape[0]
    k = torch.from_numpy(np.repeat(keys, group, axis=0)).double()
    v = torch.from_numpy(np.repeat(values, group, axis=0)).double()
    qt = torch.from_numpy(q).double().transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(qt, k, v, attn_mask=torch.from_numpy(visible), scale=scale)
    probs = torch.softmax((qt @ k.transpose(1, 2) * scale).masked_fill(~torch.from_numpy(visible), -np.inf), -1)
    return out.transpose(0, 1).numpy(), probs, v


@pytest.mark.parametrize("window", [0, 6])
def test_attention_as_ggml_is_sdpa_on_f16_queries_with_f16_probabilities(window):
    rng = np.random.default_rng(3)
    start = max(0, POS - window + 1) if window else 0
    S = POS + T - start
    q = (rng.standard_normal((T, H, HD)) * 4).astype(np.float32)  # scores of tens: Q's rounding shows
    keys, values = (rng.standard_normal((2, N_KV, S, HD)).astype(np.float16).astype(np.float32))  # an f16 cache
    scale = HD ** -0.5
    got = attend_as_ggml(q, POS, keys, values, start, scale, window)
    q16 = q.astype(np.float16).astype(np.float32)
    want, probs, v = sdpa64(q16, keys, values, POS, start, scale, window)
    # the probabilities' f16 rounding (2^-11 of each, relative) plus float32 sums
    sums = 1e-5
    bound = 2.0 ** -11 * (probs @ v.abs()).transpose(0, 1).numpy() + sums
    assert np.all(np.abs(got - want) <= bound)
    # each rounding shows: not within the bound of unrounded queries, nor within float32 sums' of
    # unrounded probabilities
    unrounded, _, _ = sdpa64(q, keys, values, POS, start, scale, window)
    assert not np.all(np.abs(got - unrounded) <= bound)
    assert np.abs(got - want).max() > 10 * sums


def test_an_f32_cache_rounds_nothing_and_q8_0_is_refused():
    """ggml's vec_dot_type of an f32 cache is f32: the attention is sdpa's to float32 sums; a q8_0 cache
    llama.cpp attends only with flash attention, not emulated: refused by name."""
    rng = np.random.default_rng(4)
    q = (rng.standard_normal((T, H, HD)) * 4).astype(np.float32)
    keys, values = rng.standard_normal((2, N_KV, POS + T, HD)).astype(np.float32)
    got = attend_as_ggml(q, POS, keys, values, 0, HD ** -0.5, 0, "f32")
    want, _, _ = sdpa64(q, keys, values, POS, 0, HD ** -0.5, 0)
    assert np.abs(got - want).max() < 1e-5
    with pytest.raises(PymlError, match="q8_0 KV cache needs its flash attention"):
        attend_as_ggml(q, POS, keys, values, 0, HD ** -0.5, 0, "q8_0")


def test_prompts_attend_as_ggml_inside_the_mode(smollm2_gguf, monkeypatch):
    """Inside quant.ggml_activations() a prompt's attention (batched, as perplexity runs it, or one
    sequence) is attend_as_ggml's; outside, pyml's own kernels', near it."""
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return attend_as_ggml(*args)

    monkeypatch.setattr(attention, "attend_as_ggml", counted)
    lm = pyml.load_model(gguf=str(smollm2_gguf), warmup=False, float_compute="f32")
    ids = lm.encode("The history of the printing press begins in Mainz")
    own = lm.model.forward(ids, lm.new_cache(64), all_logits=True)
    assert calls == []
    with quant.ggml_activations():
        got = lm.model.forward(ids, lm.new_cache(64), all_logits=True)
    assert calls == [len(ids)] * lm.model.config.n_layers
    assert 0 < np.abs(got - own).max() < 0.05 * np.abs(own).max()
