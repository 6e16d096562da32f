"""Helpers for the quant tests: random valid blocks, the activation the int8 kernels see, bounds.

The oracle is the gguf package (gguf.quants.dequantize / quantize), an independent NumPy
implementation of ggml's formats.
"""

from __future__ import annotations

import gguf
import numpy as np

from pyml.quant import QuantType, row_bytes

QUANT_TYPES = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0,
               QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K,
               QuantType.Q2_K, QuantType.Q3_K, QuantType.IQ4_NL, QuantType.IQ4_XS]
FLOAT_TYPES = [QuantType.F32, QuantType.F16, QuantType.BF16]
K_TYPES = {QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K, QuantType.Q2_K, QuantType.Q3_K, QuantType.IQ4_XS}
GGUF_QUANTIZES = {QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0}

# fp16 scale fields (byte offsets in a block) overwritten with sane values in random blocks
_SCALE_OFFSETS = {QuantType.Q4_0: (0,), QuantType.Q4_1: (0, 2), QuantType.Q5_0: (0,), QuantType.Q5_1: (0, 2),
                  QuantType.Q8_0: (0,), QuantType.Q4_K: (0, 2), QuantType.Q5_K: (0, 2), QuantType.Q6_K: (208,),
                  QuantType.Q2_K: (80, 82), QuantType.Q3_K: (108,), QuantType.IQ4_NL: (0,), QuantType.IQ4_XS: (0,)}


def odd_cols(qtype) -> int:
    """A column count that is a multiple of the block size but of nothing rounder."""
    return 768 if qtype in K_TYPES else 96


def random_blocks(rng, qtype, rows: int, n_cols: int) -> np.ndarray:
    """Random raw blocks (rows, row_bytes) with every code pattern and valid fp16 scales.

    Random bytes give every code, sign and 6-bit scale; the fp16 d / dmin / m fields are then
    set to modest values of both signs so no block holds NaN or inf."""
    bs, ts = gguf.constants.GGML_QUANT_SIZES[qtype]
    nb = n_cols // bs
    raw = rng.integers(0, 256, size=(rows, nb, ts), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype]:
        scales = (rng.uniform(0.0005, 0.02, (rows, nb)) * rng.choice([-1, 1], (rows, nb))).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * ts)


def quantized_blocks(rng, qtype, rows: int, n_cols: int) -> np.ndarray:
    """Blocks as a quantizer makes them (gguf's), for the types gguf can quantize."""
    w = rng.standard_normal((rows, n_cols)).astype(np.float32)
    return gguf.quants.quantize(w, qtype)


def make_weights(rng, qtype, rows: int, n_cols: int) -> np.ndarray:
    """Stored weights of any supported type, read-only (as a GGUF memory map is)."""
    if qtype == QuantType.F32:
        w = rng.standard_normal((rows, n_cols)).astype(np.float32)
    elif qtype == QuantType.F16:
        w = rng.standard_normal((rows, n_cols)).astype(np.float16)
    elif qtype == QuantType.BF16:
        w = (rng.standard_normal((rows, n_cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        w = random_blocks(rng, qtype, rows, n_cols)
        assert w.shape == (rows, row_bytes(qtype, n_cols))
    w.flags.writeable = False
    return w


def q8_activation(x: np.ndarray) -> np.ndarray:
    """What the int8 kernels multiply by: x quantized per 32 values (activation.py), decoded, float64."""
    xb = np.asarray(x, np.float32).reshape(-1, 32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv)
    d = (amax / np.float32(127.0)).astype(np.float32)
    return (q.astype(np.float64) * d).reshape(x.shape)
