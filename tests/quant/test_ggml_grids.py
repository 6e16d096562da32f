"""quant.ggml_activations(): llama.cpp's activation rounding (quant/ggml_grids.py).

The q8_0 grid against gguf-py's Q8_0 quantize / dequantize, and by hand where llama.cpp's x86 kernel
(round half to even) and the reference C code gguf-py follows (round half away) part; q8_K by hand
(gguf-py has no Q8_K quantizer); the float grids against torch's casts; a matmul inside the mode
against gguf-py's float64 decoding of the weights times the rounded x, for every weight type. Whether
the whole adds up to llama.cpp's figures is the peer test's (tests/nlp/test_perplexity_peer.py)."""

import gguf
import numpy as np
import pytest
import torch

from pyml import quant
from pyml.quant import QuantType
from pyml.quant.ggml_grids import round_as_ggml
from tests.quant.helpers import FLOAT_TYPES, QUANT_TYPES, make_weights


def test_q8_0_is_gguf_pys_q8_0_round_trip(rng):
    x = (rng.standard_normal((64, 1024)) * rng.lognormal(0, 2, (64, 1))).astype(np.float32)
    x[0, :32] = 0  # a block of zeros: d = 0
    x[1, 40] = -1e4  # a block ruled by one large negative value
    ref = gguf.quants.dequantize(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                                 gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(round_as_ggml(x, "q8_0"), ref)
    np.testing.assert_array_equal(round_as_ggml(x, "q8_1"), ref)  # the same codes and d (the module doc)


def test_q8_0_rounds_halves_to_even_as_the_x86_kernel():
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [127.0, 2.5, -3.5, 0.5, 1.5]  # amax 127: d = 1, and each x * 127 / amax lands on a half
    assert round_as_ggml(x, "q8_0")[0, :5].tolist() == [127.0, 2.0, -4.0, 0.0, 2.0]
    half_away = gguf.quants.dequantize(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                                       gguf.GGMLQuantizationType.Q8_0)
    assert half_away[0, :5].tolist() == [127.0, 3.0, -4.0, 1.0, 2.0]  # ggml-quants.c's reference, not the x86 path


def test_q8_k_by_hand():
    x = np.zeros((1, 512), np.float32)
    # block 0: the largest |x| is -2 (the first of -2 and 2): iscale = -127 / -2 = 63.5, d = 1 / 63.5
    x[0, [0, 1, 5, 7, 200]] = [1.0, 0.25, -2.0, 2.0, 0.004]
    # block 1: the largest is +3: iscale = -127 / 3 < 0, codes of the opposite sign, d < 0
    x[0, [256, 257, 258]] = [3.0, -3.0, 1.5]
    y = round_as_ggml(x, "q8_K")[0]
    # 1.0 * 63.5 = 63.5 -> 64 (half to even), 0.25 * 63.5 = 15.875 -> 16, 0.004 * 63.5 = 0.254 -> 0
    np.testing.assert_allclose(y[[0, 1, 5, 7, 200]], [64 / 63.5, 16 / 63.5, -2.0, 2.0, 0.0], rtol=1e-6)
    # 1.5 * -127 / 3 = -63.5 -> -64: 64 * 3 / 127
    np.testing.assert_allclose(y[[256, 257, 258]], [3.0, -3.0, 64 * 3 / 127], rtol=1e-6)
    assert not y[np.setdiff1d(np.arange(512), [0, 1, 5, 7, 256, 257, 258])].any()
    # one scale per 256 values: the small value at 200 is lost, where a scale per 32 (q8_0) keeps it
    assert round_as_ggml(x, "q8_0")[0, 200] == pytest.approx(0.004, rel=1e-2)
    assert not round_as_ggml(np.zeros((2, 256), np.float32), "q8_K").any()


def test_float_grids_are_torchs_casts(rng):
    x = rng.standard_normal((8, 256)).astype(np.float32) * 100
    x[0, :3] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)]  # bf16 halves: to even
    for grid, dtype in (("f16", torch.float16), ("bf16", torch.bfloat16)):
        np.testing.assert_array_equal(round_as_ggml(x, grid), torch.from_numpy(x).to(dtype).float().numpy())
    assert round_as_ggml(x, "bf16")[0, :3].tolist() == [1.0, 1 + 2 ** -6, -1.0]
    assert round_as_ggml(x, "f32") is x
    wide = rng.standard_normal((4, 1024)).astype(np.float32)
    for grid in ("q8_0", "q8_K", "f16", "bf16"):  # a strided view (every other column) as its copy
        np.testing.assert_array_equal(round_as_ggml(wide[:, ::2], grid), round_as_ggml(wide[:, ::2].copy(), grid))


@pytest.mark.parametrize("qtype", QUANT_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
def test_a_matmul_rounds_as_ggml_for_its_weight_type(rng, qtype):
    """Inside the mode: gguf-py's float64 decoding of W times x on ggml's grid for W's type, to float32
    sums; outside it, pyml's own rounding again. Packed weights (pack()) and decode rows alike."""
    rows, n_cols = 16, 512
    raw = make_weights(rng, qtype, rows, n_cols)
    x = rng.standard_normal((5, n_cols)).astype(np.float32)
    grid = quant.traits_of(qtype).ggml_activation
    w = (raw.astype(np.float64) if qtype in (QuantType.F32, QuantType.F16) else
         torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).double().numpy() if qtype == QuantType.BF16 else
         gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype))).astype(np.float64))
    want = round_as_ggml(x, grid).astype(np.float64) @ w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    packed = quant.pack(raw, qtype, n_cols)
    with quant.ggml_activations():
        for weights in (raw, packed) if packed is not None else (raw,):
            for T in (1, 5):
                got = quant.matmul(x[:T], weights, qtype, n_cols)
                assert np.all(np.abs(got - want[:T]) <= 1e-5 * scale[:T]), (weights.__class__, T)
            with quant.decode_rows(True):
                assert np.all(np.abs(quant.matmul(x, weights, qtype, n_cols) - want) <= 1e-5 * scale)
    if grid in ("f32", "f16", "bf16") and qtype in FLOAT_TYPES:
        return  # pyml computes float weights with float32 x: nothing of its own to tell apart
    own = quant.matmul(x, raw, qtype, n_cols)
    assert not np.all(np.abs(own - want) <= 1e-5 * scale)  # the mode ended with the block
