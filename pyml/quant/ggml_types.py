"""GGML type ids and block sizes as the kernels take them: plain ints, compile-time constants.

The numbering and sizes are ggml's, read from the gguf package (GGMLQuantizationType,
GGML_QUANT_SIZES). Kernels receive a weight's type id as `kind`, specialise on it with
numba.literally, and index these tuples with it: Numba folds each lookup into a constant.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as QuantType
from gguf.constants import GGML_QUANT_SIZES

F32, F16, BF16 = int(QuantType.F32), int(QuantType.F16), int(QuantType.BF16)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (int(QuantType.Q4_0), int(QuantType.Q4_1), int(QuantType.Q5_0),
                                int(QuantType.Q5_1), int(QuantType.Q8_0))
Q4_K, Q5_K, Q6_K = int(QuantType.Q4_K), int(QuantType.Q5_K), int(QuantType.Q6_K)
Q2_K, Q3_K = int(QuantType.Q2_K), int(QuantType.Q3_K)
IQ4_NL, IQ4_XS = int(QuantType.IQ4_NL), int(QuantType.IQ4_XS)

_SIZES = {int(q): sizes for q, sizes in GGML_QUANT_SIZES.items()}
BLOCK_SIZE = tuple(_SIZES.get(i, (0, 0))[0] for i in range(1 + max(_SIZES)))  # values per block, by id
TYPE_SIZE = tuple(_SIZES.get(i, (0, 0))[1] for i in range(1 + max(_SIZES)))   # bytes per block, by id

# ggml-common.h's static asserts on the block structs (candle's size_of checks): the kernels'
# byte offsets assume exactly these
assert [TYPE_SIZE[k] for k in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)] == [18, 20, 22, 24, 34, 144, 176, 210]
assert [TYPE_SIZE[k] for k in (Q2_K, Q3_K, IQ4_NL, IQ4_XS)] == [84, 110, 18, 136]
