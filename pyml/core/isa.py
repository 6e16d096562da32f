"""The instruction set the kernels are compiled for, chosen from the host CPU at run time.

Paths, best first (each implies the ones after it):
    avx512_bf16   avx512_vnni + AVX-512 BF16: vdpbf16ps (bf16 pair dot, into f32) for the float weights'
                  prefill GEMM under --float-compute bf16 (quant/bf16.py); the int8 kernels as avx512_vnni
    avx512_vnni   AVX-512 VL/BW + VNNI: vpdpbusd (u8 x i8 dot of 4, into i32) on 256-bit vectors, and
                  on 512-bit ones in the x8 GEMM (16 rows per instruction: quant/simd512.py)
    avx_vnni      AVX-VNNI: the same vpdpbusd, VEX-encoded (Alder Lake and later)
    avx2          AVX2 + FMA: vpmaddubsw / vpmaddwd, ggml's AVX2 recipe
    portable      plain LLVM vector IR: the same results on any CPU, slower

PYML_ISA=<path> forces a lower path (for comparing paths on one machine); a path the host lacks
is never chosen. The kernels read `ISA` when they compile, so the kernel cache is stamped with it
(core/jit.py): machine code compiled for one path is never loaded for another, and Numba's own
cache index is keyed by the CPU model and features as well.
"""

from __future__ import annotations

import os

from llvmlite import binding as llvm_binding

PATHS = ("avx512_bf16", "avx512_vnni", "avx_vnni", "avx2", "portable")


def host_features() -> set:
    """The LLVM feature names the host CPU has (avx2, avx512vnni, avxvnni, ...)."""
    return {name for name, on in llvm_binding.get_host_cpu_features().items() if on}


def supported(features: set) -> tuple:
    """The paths a CPU with `features` can run, best first."""
    has = {
        "avx512_bf16": {"avx512bf16", "avx512vnni", "avx512vl", "avx512bw", "avx2", "fma"} <= features,
        "avx512_vnni": {"avx512vnni", "avx512vl", "avx512bw", "avx2", "fma"} <= features,
        "avx_vnni": {"avxvnni", "avx2", "fma"} <= features,
        "avx2": {"avx2", "fma"} <= features,
        "portable": True,
    }
    return tuple(p for p in PATHS if has[p])


def choose(features: set, forced: str | None) -> tuple[str, str | None]:
    """(path, warning or None): the best supported path, or `forced` when the host has it."""
    available = supported(features)
    if not forced:
        return available[0], None
    forced = forced.strip().lower()
    if forced not in PATHS:
        return available[0], f"PYML_ISA={forced!r} is not a path ({', '.join(PATHS)}); using {available[0]}"
    if forced not in available:
        return available[0], f"PYML_ISA={forced}: this CPU cannot run it; using {available[0]}"
    return forced, None


HOST_FEATURES = host_features()
ISA, ISA_WARNING = choose(HOST_FEATURES, os.environ.get("PYML_ISA"))
VNNI = ISA in ("avx512_bf16", "avx512_vnni", "avx_vnni")
AVX2 = ISA != "portable"
ZMM = ISA in ("avx512_bf16", "avx512_vnni")  # 512-bit vectors in the x8 GEMM
BF16 = ISA == "avx512_bf16"  # vdpbf16ps: --float-compute bf16 can run
