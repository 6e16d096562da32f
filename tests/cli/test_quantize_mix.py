"""pyml-quantize's K-quant mixes without llama.cpp: the per-tensor types of SmolLM2 q4_k_m worked out
by hand from llama-quantize's rules, every weight within its type's error of the F16 input, and bad
input refused in one line. Against llama-quantize's own files: test_quantize_mix_peer.py."""

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.cli import pyml_quantize
from pyml.cli.quant_mix import llama_order, use_more_bits
from tests import oracle_cache

Q = quant.QuantType
# SmolLM2 (30 layers): the first and last eighth (0-2, 26-29) and every third layer from 3 (5, 8, ... 23)
MORE_BITS = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
REL_RMS = {Q.Q4_K: 0.087, Q.Q5_0: 0.065, Q.Q6_K: 0.022, Q.Q8_0: 0.008}  # measured max 0.020, 0.052, 0.018, 0.0065


def test_use_more_bits_by_hand():
    assert {i for i in range(30) if use_more_bits(i, 30)} == MORE_BITS
    assert {i for i in range(8) if use_more_bits(i, 8)} == {0, 3, 6, 7}  # n/8 = 1, 7n/8 = 7: (i-1)%3 == 2


def test_llama_order_sorts_layers_by_number():
    names = ["blk.10.attn_q.weight", "token_embd.weight", "blk.2.ffn_up.weight", "blk.2.attn_k.weight",
             "output_norm.weight"]
    assert llama_order(names) == ["output_norm.weight", "token_embd.weight", "blk.2.attn_k.weight",
                                  "blk.2.ffn_up.weight", "blk.10.attn_q.weight"]


def _expected_q4_k_m(name: str, stored: Q) -> Q:
    """SmolLM2's q4_k_m by hand: 576 columns do not divide 256, so Q4_K falls back to Q5_0 and Q6_K
    to Q8_0; 1536 (ffn_down) does. The tied token embedding is the output: Q6_K, or Q8_0 for 576."""
    if stored == Q.F32:
        return Q.F32  # the norms
    if name == "token_embd.weight":
        return Q.Q8_0
    layer = int(name.split(".")[1])
    if "ffn_down" in name:
        return Q.Q6_K if layer in MORE_BITS else Q.Q4_K
    if "attn_v" in name:
        return Q.Q8_0 if layer in MORE_BITS else Q.Q5_0
    return Q.Q5_0


def test_q4_k_m_of_smollm2_by_hand(requantized, tmp_path):
    src = requantized("f16")
    out, chosen = pyml_quantize.quantize_gguf(src, tmp_path / "q4_k_m.gguf", "q4_k_m", progress=False)
    before = oracle_cache.gguf_tensors(src)  # gguf's reader's, its table kept between runs
    after = gguf.GGUFReader(out)
    assert after.fields["general.file_type"].contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert len(after.tensors) == len(before)
    for t in after.tensors:
        qtype = Q(int(t.tensor_type))
        assert qtype == chosen[t.name] == _expected_q4_k_m(t.name, Q(int(before[t.name].tensor_type))), t.name
        if qtype == Q.F32:
            continue
        x = gguf.quants.dequantize(np.asarray(before[t.name].data), Q.F16).astype(np.float32)
        y = gguf.quants.dequantize(np.asarray(t.data), qtype)
        rel = np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean())
        assert rel < REL_RMS[qtype], (t.name, rel)


def test_unknown_type_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        pyml_quantize.main(["smollm2-135m", str(tmp_path / "x.gguf"), "--type", "q4_k_x"])
    assert e.value.code == 2 and "q4_k_x" in capsys.readouterr().err


def test_a_mix_of_a_quantized_file_is_refused_by_name(smollm2_gguf, tmp_path, capsys):
    dst = tmp_path / "x.gguf"
    assert pyml_quantize.main([str(smollm2_gguf), str(dst), "--type", "q4_k_m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Q4_1" in err[0] and "--allow-requantize" in err[0] and "Traceback" not in err[0]
    assert not dst.exists()


def test_an_output_path_with_no_folder_or_that_is_a_folder_is_one_line(smollm2_gguf, tmp_path, capsys):
    # the missing folder was an internal FileNotFoundError, after the work
    for dst, said in ((tmp_path / "none" / "x.gguf", f"no folder {tmp_path / 'none'} to write it in"),
                      (tmp_path, "a folder; give the output file's path")):
        assert pyml_quantize.main([str(smollm2_gguf), str(dst), "--type", "q8_0"]) == 2
        assert capsys.readouterr().err.strip() == f"pyml-quantize: error: {dst}: {said}"
    assert list(tmp_path.iterdir()) == []
