"""--float-compute on whole models: a random F16 Llama against transformers in f32 and bf16, the real
SmolLM2 F16 file against transformers in bf16, and the bf16 blocks through the packed-weights cache."""

import numpy as np
import pytest

import pyml
from pyml import quant
from pyml.core import isa
from pyml.nlp.loaders import packed_cache
from tests.conftest import hf_gguf_model, hf_logits
from tests.nlp.test_llama import PROMPTS, save_hf_llama

IDS = [3, 17, 42, 90, 0, 7, 7, 56, 11, 23, 5, 64, 31, 2, 88, 40, 19]
needs_bf16 = pytest.mark.skipif(not quant.BF16_AVAILABLE, reason=f"no avx512_bf16 on ISA path {isa.ISA}: "
                                                                   "tests/quant/test_bf16_gemm.py checks the fallback")


def _range_err(got, ref) -> float:
    return float(np.abs(got - ref).max() / (ref.max() - ref.min()))


@pytest.fixture
def f16_llama(tmp_path, monkeypatch, torch):
    """A random Llama saved in float16, and transformers' float32 model on the same (fp16) weights."""
    monkeypatch.setenv("PYML_PACKED_CACHE", str(tmp_path / "packed"))
    hf = save_hf_llama(tmp_path / "f32", hidden_size=128, intermediate_size=320, num_attention_heads=4)
    hf.half().save_pretrained(tmp_path / "f16", safe_serialization=True)
    return tmp_path / "f16", hf.float()


@needs_bf16
def test_random_f16_llama_in_both_modes(f16_llama):
    """f32 is exact up to summation order; bf16 rounds weights and activations of every prefill GEMM to
    8 significant bits: measured 2.5e-3 of the logit range here (f32: 6.5e-6) (SmolLM2 below: <= 5.3e-3), bound 2e-2."""
    path, hf = f16_llama
    ref = hf_logits(hf, IDS)
    errs = {}
    for mode in ("f32", "bf16", "auto"):
        lm = pyml.load_model(safetensors=str(path), warmup=False, kv_type="f32", float_compute=mode)
        assert lm.model.float_compute == mode
        assert all((lin.prefill_weight is not None) == (mode != "f32") for b in lm.model.blocks
                   for lin in b.linears())
        assert lm.model.lm_head.prefill_weight is None  # the head runs on the last token only
        errs[mode] = _range_err(lm.forward(IDS, all_logits=True), ref)
    assert errs["f32"] < 3e-5 and errs["bf16"] < 2e-2 and errs["auto"] == errs["bf16"], errs


@needs_bf16
def test_bf16_blocks_come_back_from_the_packed_cache(f16_llama):
    path, _ = f16_llama
    first = pyml.load_model(safetensors=str(path), warmup=False, float_compute="bf16")
    logits = first.forward(IDS)
    files = sorted(packed_cache.folder().glob(f"*{packed_cache.SUFFIX}"))
    second = pyml.load_model(safetensors=str(path), warmup=False, float_compute="bf16")
    blocks = second.model.blocks[0].linears()[0].prefill_weight.blocks
    assert not blocks.flags.writeable and not blocks.flags.owndata  # a view of the cache file's mapping
    assert np.array_equal(second.forward(IDS), logits)
    assert sorted(packed_cache.folder().glob(f"*{packed_cache.SUFFIX}")) == files  # read, not re-packed
    stamp = [f.stat().st_mtime_ns for f in files]
    f32 = pyml.load_model(safetensors=str(path), warmup=False, float_compute="f32")  # the same file serves f32
    assert f32.model.blocks[0].linears()[0].prefill_weight is None
    assert sorted(packed_cache.folder().glob(f"*{packed_cache.SUFFIX}")) == files
    assert [f.stat().st_mtime_ns for f in files] == stamp


@needs_bf16
def test_real_smollm2_f16_in_bf16_matches_transformers(smollm2_gguf, requantized, torch):
    """The last token's logits within 1.5e-2 of the logit range (measured <= 4.7e-3) and the same top-1."""
    path = requantized("f16")
    lm = pyml.load_model(gguf=str(path), warmup=False, kv_type="f32", float_compute="bf16")
    hf = hf_gguf_model(path)
    for prompt in PROMPTS[:2]:
        ids = lm.encode(prompt)
        got, ref = lm.forward(ids), hf_logits(hf, ids)[-1]
        assert got.argmax() == ref.argmax()
        assert _range_err(got, ref) < 1.5e-2
