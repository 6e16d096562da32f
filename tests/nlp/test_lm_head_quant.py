"""--lm-head-quant: the float head re-stored as ggml blocks, against transformers running the
head that the `gguf` package's own quantize/dequantize makes of the same matrix."""

import copy
import functools
import numpy as np
import pytest

import pyml
from pyml.cli.standins import write_byte_tokenizer
from pyml.quant import QuantType
from tests.conftest import hf_logits, max_rel_err, save_hf_gpt2
from tests.cli.test_infer import run_cli


@pytest.fixture(scope="module")
def untied_gpt2(tmp_path_factory, torch):
    d = tmp_path_factory.mktemp("gpt2_untied")
    hf = save_hf_gpt2(d, tie_word_embeddings=False, vocab_size=300, seed=5)
    write_byte_tokenizer(d, 300)
    return d, hf


def oracle_with_quantized_head(hf, qtype):
    import gguf
    import torch
    w = hf.lm_head.weight.detach().numpy()
    ggml_type = gguf.GGMLQuantizationType[qtype.name]
    wq = gguf.quants.dequantize(gguf.quants.quantize(w, ggml_type), ggml_type)
    assert 0 < np.abs(wq - w).max() < 0.1 * np.abs(w).max()  # really requantized, not a copy
    model = copy.deepcopy(hf)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.from_numpy(wq))
    return model


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_head_matches_gguf_quantizer(untied_gpt2, kind, monkeypatch):
    from pyml import quant
    monkeypatch.setattr(quant, "matmul", functools.partial(quant.matmul, exact=True))
    d, hf = untied_gpt2
    lm = pyml.load_model(safetensors=str(d), warmup=False, kv_type="f32", lm_head_quant=kind)
    qtype = QuantType[kind.upper()]
    assert lm.model.lm_head.weight.qtype == qtype
    ids = [3, 17, 42, 99, 0, 7, 150, 56]
    got = lm.forward(ids, all_logits=True)
    ref = hf_logits(oracle_with_quantized_head(hf, qtype), ids)
    assert max_rel_err(got, ref) < 1e-4
    # and it is a different head from the float one (the test can fail)
    assert max_rel_err(got, hf_logits(hf, ids)) > 1e-4


def test_embedding_keeps_the_float_rows_when_tied(tmp_path, torch):
    hf = save_hf_gpt2(tmp_path, seed=2)  # tied: wte is the head
    lm = pyml.load_model(safetensors=str(tmp_path), warmup=False, kv_type="f32", lm_head_quant="q8_0")
    assert lm.model.lm_head.weight.qtype == QuantType.Q8_0
    assert lm.model.embed_tokens.weight.qtype == QuantType.F32
    ids = [4, 8, 15, 16, 23, 42]
    # the int8 kernels on a Q8_0 head: close to the float model, not equal to it
    assert max_rel_err(lm.forward(ids, all_logits=True), hf_logits(hf, ids)) < 2e-2


def test_already_quantized_head_is_refused(smollm2_gguf):
    with pytest.raises(pyml.PymlError, match="already stored as Q"):
        pyml.load_model(gguf=str(smollm2_gguf), warmup=False, kv_type="f32", lm_head_quant="q8_0")


def test_cli_debug_log_states_the_saving(untied_gpt2):
    d, _ = untied_gpt2
    r = run_cli("--safetensors", str(d), "--prompt", "hi", "--max-tokens", "2", "--lm-head-quant", "q4_0",
                "--log", "debug", "--no-warmup")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if "lm_head: F32 -> Q4_0" in ln)
    # 300 x 64 float32 = 76800 bytes; Q4_0 = 300 rows x 2 blocks x 18 bytes = 10800 bytes
    assert "76,800 -> 10,800 bytes" in line
