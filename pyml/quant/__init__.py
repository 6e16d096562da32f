"""pyml.quant: ggml weight formats and the kernels that read them where they lie (an index).

traits.py       the traits table: a row per ggml type (block size and bytes, kernels, layout,
                quantizer, activation format); ggml_types.py the type ids as kernel constants
dispatch.py     matmul, dequantize, pack, quantize, warmup: every weight read, dispatched by row
blocks32.py     Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 in the file's layout; kquants.py Q4_K Q5_K Q6_K;
                lowbit.py Q2_K Q3_K IQ4_NL IQ4_XS (plain loops, with their KernelSet);
                floats.py F32 F16 BF16; kernel_set.py a type's kernels as one record
interleaved.py  the 8-row "x8" layout and its packing; interleaved_gemv.py, interleaved_gemm.py,
                interleaved_pairs.py (512-bit), interleaved_triples.py (no VNNI) its kernels,
                interleaved_tiles.py the GEMMs' token-tile loop
bf16_gemm.py    the bf16-compute GEMM for float weights (--float-compute bf16)
activation.py   int8 activations; quantizers.py the weight quantizers; reference.py the scalar
                oracle path; ggml_grids.py llama.cpp's activation rounding (ggml_activations())
The SIMD vocabulary the kernels are written in is core/simd.py's.
"""

from __future__ import annotations

from pyml.core.isa import BF16 as BF16_AVAILABLE
from pyml.quant.bf16_gemm import BF16Packed
from pyml.quant.dispatch import (FLOAT_COMPUTE, as_decode_rows, attention_compute, decode_row_count, decode_rows, dequantize,
                                 dequantize_rows, every_row_decodes, float_compute,
                                 kernel_view, matmul, pack, pack_bf16, packed_from_cache, packs, quantize, row_reader,
                                 warmup, warmup_steps)
from pyml.quant.ggml_grids import ggml_activations
from pyml.quant.ggml_types import QuantType
from pyml.quant.interleaved import Packed
from pyml.quant.quantizers import to_bf16_bits
from pyml.quant.reference import dequantize_reference, matmul_reference
from pyml.quant.traits import FLOAT_TYPES, TRAITS, Traits, is_supported, row_bytes, traits_of

__all__ = ["QuantType", "TRAITS", "Traits", "FLOAT_TYPES", "is_supported", "traits_of", "row_bytes",
           "as_decode_rows", "decode_row_count", "decode_rows", "dequantize", "dequantize_rows", "every_row_decodes",
           "kernel_view", "matmul", "pack", "packs",
           "packed_from_cache", "Packed",
           "BF16Packed", "BF16_AVAILABLE", "FLOAT_COMPUTE", "float_compute", "attention_compute", "pack_bf16",
           "row_reader", "quantize", "to_bf16_bits", "warmup", "warmup_steps", "dequantize_reference",
           "matmul_reference", "ggml_activations"]
