"""The traits table agrees with ggml's block sizes, and every row is complete."""

import gguf
import pytest

from pyml import quant
from pyml.quant import TRAITS, QuantType

EXPECTED_BYTES = {QuantType.Q4_0: 18, QuantType.Q4_1: 20, QuantType.Q5_0: 22, QuantType.Q5_1: 24,
                  QuantType.Q8_0: 34, QuantType.Q4_K: 144, QuantType.Q5_K: 176, QuantType.Q6_K: 210,
                  QuantType.Q2_K: 84, QuantType.Q3_K: 110, QuantType.IQ4_NL: 18, QuantType.IQ4_XS: 136}


@pytest.mark.parametrize("qtype", list(EXPECTED_BYTES))
def test_block_bytes_match_ggml(qtype):
    fmt = TRAITS[qtype]
    assert fmt.type_size == EXPECTED_BYTES[qtype]
    assert (fmt.block_size, fmt.type_size) == gguf.constants.GGML_QUANT_SIZES[qtype]
    assert fmt.name == qtype.name


def test_float_types_have_block_size_one():
    for qtype in (QuantType.F32, QuantType.F16, QuantType.BF16):
        assert TRAITS[qtype].block_size == 1
        assert quant.is_supported(qtype)


def test_unsupported_types():
    assert not quant.is_supported(QuantType.IQ2_XXS)
    with pytest.raises(ValueError, match="unsupported"):
        quant.row_bytes(QuantType.IQ2_XXS, 256)


def test_row_bytes():
    assert quant.row_bytes(QuantType.Q4_0, 96) == 3 * 18
    assert quant.row_bytes(QuantType.Q6_K, 768) == 3 * 210
    assert quant.row_bytes(QuantType.F16, 77) == 154
    with pytest.raises(ValueError, match="whole blocks"):
        quant.row_bytes(QuantType.Q4_K, 96)
    with pytest.raises(ValueError, match="whole blocks"):
        quant.row_bytes(QuantType.Q8_0, 100)


@pytest.mark.parametrize("qtype", list(TRAITS), ids=lambda q: q.name)
def test_every_row_names_its_kernels(qtype):
    t = TRAITS[qtype]
    for kernel in ("dequant_rows", "dequant_tile", "gemv", "gemv_exact", "gemm"):
        assert callable(getattr(t.kernels, kernel)), (qtype.name, kernel)
    assert t.activation in ("q8", "f32")
    assert t.is_float == (qtype in (QuantType.F32, QuantType.F16, QuantType.BF16))
