"""pyml-quantize's K-quant mixes against llama-quantize's (llama_model_quantize through llama-cpp-python,
no imatrix) on SmolLM2 F16: the same type for every tensor, the same bytes, the same file.
`-m peer` runs them."""

import gguf
import numpy as np
import pytest

from pyml.cli import pyml_quantize
from pyml.cli.quant_mix import MIXES
from tests.cli.llama_quantize_peer import llama_quantized

pytestmark = pytest.mark.peer


@pytest.mark.parametrize("mix", list(MIXES))
def test_mix_equals_llama_quantize(requantized, tmp_path, mix):
    src = requantized("f16")
    ours, _ = pyml_quantize.quantize_gguf(src, tmp_path / f"{mix}.gguf", mix, progress=False)
    theirs = llama_quantized(src, mix)
    a = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    b = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    assert list(a) == list(b)  # the same tensors in the same order
    assert {n: t.tensor_type.name for n, t in a.items()} == {n: t.tensor_type.name for n, t in b.items()}
    for name in a:
        assert np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data)), name
    assert ours.read_bytes() == theirs.read_bytes()  # metadata too: the whole file
