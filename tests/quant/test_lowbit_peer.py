"""Q3_K, IQ4_NL and IQ4_XS as llama.cpp's own quantizer writes them (llama_model_quantize through
llama-cpp-python, from SmolLM2's F16 file, no imatrix): every tensor decodes bit for bit as gguf-py decodes
it, and the file's perplexity is llama.cpp's within 0.5%. `-m peer` runs them (CI has no llama_cpp).

SmolLM2's 576-wide rows are not whole 256-value superblocks, so llama-quantize falls back there, and its
Q2_K mix puts the 1536-wide ffn_down at Q3_K: the q2_k file holds no Q2_K tensor (nor does Gemma 3 270M's,
nor q3_k_m's any Q3_K): a random-weight llama with 256-wide rows (standins' llama-256) is Q2_K's file."""

from collections import Counter

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.cli.standins import write_llama_gguf
from pyml.nlp.api import load_model
from pyml.quant import QuantType
from tests.nlp.test_perplexity import text  # noqa: F401 (the fixture)
from tests.nlp.test_perplexity_peer import check_against_llama

pytestmark = pytest.mark.peer
# llama-quantize's type -> the low-bit types its SmolLM2 file holds
KINDS = {"q2_k": (QuantType.Q3_K,), "iq4_nl": (QuantType.IQ4_NL,), "iq4_xs": (QuantType.IQ4_XS, QuantType.IQ4_NL)}


@pytest.fixture(scope="module")
def llama_file(requantized):
    """kind -> SmolLM2 quantized by llama.cpp's code (built once into the model cache)."""
    llama_quantize_peer = pytest.importorskip("tests.cli.llama_quantize_peer")
    f16 = requantized("f16")
    return lambda kind: llama_quantize_peer.llama_quantized(f16, kind)


@pytest.mark.parametrize("kind", list(KINDS))
def test_llama_quantized_tensors_decode_as_gguf_py(kind, say, llama_file):
    reader = gguf.GGUFReader(llama_file(kind))
    types = Counter(t.tensor_type.name for t in reader.tensors)
    say(f"SmolLM2 {kind} by llama.cpp: tensor types {dict(types)}")
    assert all(types[q.name] > 0 for q in KINDS[kind])
    for t in reader.tensors:
        if t.tensor_type in KINDS[kind]:
            n_cols = int(t.shape[0])
            raw = np.asarray(t.data).reshape(-1, quant.row_bytes(t.tensor_type, n_cols))
            np.testing.assert_array_equal(quant.dequantize(raw, t.tensor_type, n_cols),
                                          gguf.quants.dequantize(raw, t.tensor_type), err_msg=t.name)


# q2_k read 14.3081 vs llama.cpp's 14.4501 (-0.98%) as one figure each; over perturbed copies of the file
# (check_against_llama) llama.cpp's own figure ranges 14.24-14.45 and the means are 0.2% apart (docs/perplexity.md).
@pytest.mark.parametrize("kind", list(KINDS))
def test_llama_quantized_perplexity_matches_llama_cpp(kind, say, llama_file, text, tmp_path):  # noqa: F811
    check_against_llama(say, llama_file(kind), text, f"SmolLM2 {kind} (llama-quantize)", tmp_path)


def _decoded_as_gguf_py(reader, qtypes):
    for t in reader.tensors:
        if t.tensor_type in qtypes:
            n_cols = int(t.shape[0])
            raw = np.asarray(t.data).reshape(-1, quant.row_bytes(t.tensor_type, n_cols))
            np.testing.assert_array_equal(quant.dequantize(raw, t.tensor_type, n_cols),
                                          gguf.quants.dequantize(raw, t.tensor_type), err_msg=t.name)


def _llama_logits(path, ids):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], np.float64)


def test_llama_quantized_q2_k_runs_as_llama_cpp(say, tmp_path):
    """A Q2_K mix of 256-wide rows: Q2_K and Q3_K tensors decode as gguf-py's, and pyml's logits differ
    from llama.cpp's on the same file by far less than the file differs from its F16 source."""
    llama_cpp = pytest.importorskip("llama_cpp")
    f16 = write_llama_gguf(tmp_path / "f16.gguf", "llama-256", "f16")
    q2 = tmp_path / "q2_k.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K, 1
    assert llama_cpp.llama_model_quantize(str(f16).encode(), str(q2).encode(), params) == 0
    reader = gguf.GGUFReader(q2)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    say(f"llama-256 q2_k by llama.cpp: tensor types {dict(types)}")
    assert types["Q2_K"] > 0 and types["Q3_K"] > 0
    _decoded_as_gguf_py(reader, (QuantType.Q2_K, QuantType.Q3_K))
    ids = [1] + list(range(300, 331))
    ours = np.array(load_model(gguf=str(q2), float_compute="f32").forward(ids, all_logits=True), np.float64)
    theirs, source = _llama_logits(q2, ids), _llama_logits(f16, ids)
    ours_err = np.sqrt(np.mean((ours - theirs) ** 2))
    quant_err = np.sqrt(np.mean((theirs - source) ** 2))
    say(f"llama-256 q2_k logits: RMS pyml - llama.cpp {ours_err:.3g}, llama.cpp q2_k - f16 {quant_err:.3g}")
    assert ours_err < 0.1 * quant_err
