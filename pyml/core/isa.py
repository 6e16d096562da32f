"""The instruction set the kernels are compiled for, chosen from the host CPU at run time.

Paths, best first (each implies the ones after it):
    avx512_bf16   avx512_vnni + AVX-512 BF16: vdpbf16ps (bf16 pair dot, into f32) for the float weights'
                  prefill GEMM under --float-compute bf16 (quant/bf16_gemm.py); the int8 kernels as avx512_vnni
    avx512_vnni   AVX-512 VL/BW + VNNI: vpdpbusd (u8 x i8 dot of 4, into i32) on 256-bit vectors, and
                  on 512-bit ones in the x8 GEMM (16 rows per instruction: core/simd512.py)
    avx_vnni      AVX-VNNI: the same vpdpbusd, VEX-encoded (Alder Lake and later)
    avx2          AVX2 + FMA: vpmaddubsw / vpmaddwd, ggml's AVX2 recipe
    portable      plain LLVM vector IR: the same results on any CPU, slower

PYML_ISA=<path> forces a lower path (for comparing paths on one machine); a path the host lacks
is never chosen. The kernels read `ISA` when they compile, so the kernel cache is stamped with it
(core/jit.py): machine code compiled for one path is never loaded for another, and Numba's own
cache index is keyed by the CPU model and features as well.

A forced path also caps what LLVM may use (NUMBA_CPU_FEATURES, set here before Numba compiles
anything): PYML_ISA=avx2 on an AVX-512 CPU compiles as for a CPU without AVX-512 or AVX-VNNI. The
kernels' intrinsics were AVX2's already, but LLVM had still been free to allocate AVX-512's 32
vector registers and EVEX forms (embedded broadcasts, ymm16-31), which an AVX2-only CPU does not
have: its code keeps 16 ymm registers and spills what does not fit. So a forced path runs the
machine code a CPU whose best path it is would run, on this CPU's cores. A NUMBA_CPU_FEATURES of the
user's own is left alone; the portable path is not capped (its plain vector IR is lowered for the host).
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


# What a CPU whose best path is the key has not (LLVM feature names, or their prefixes).
_ABOVE = {
    "avx512_vnni": ("avx512bf16", "amx", "avx10"),
    "avx_vnni": ("avx512", "amx", "avx10"),
    "avx2": ("avx512", "amx", "avx10", "avxvnni", "avxifma", "avxneconvert"),
}
_OURS = "_PYML_NUMBA_CPU_FEATURES"  # marks a NUMBA_CPU_FEATURES this module set (and a child may reset)


def codegen_features(path: str, host: dict) -> str | None:
    """The LLVM feature string for compiling `path`'s kernels on a host with the feature map `host`
    (name -> on): the host's, less what a CPU whose best path is `path` has not. None when nothing
    needs taking away (the host's best path, or portable)."""
    above = _ABOVE.get(path)
    if above is None or path == supported({n for n, on in host.items() if on})[0]:
        return None
    return ",".join(("+" if on and not name.startswith(above) else "-") + name for name, on in sorted(host.items()))


def _cap_codegen(path: str) -> str | None:
    """Set NUMBA_CPU_FEATURES for `path` (codegen_features), unless the user set one; a warning or None.
    Numba re-reads its configuration from the environment before each compile, and reads the
    features when it first makes its code generator: both follow this setting."""
    env = os.environ
    if "NUMBA_CPU_FEATURES" in env and env["NUMBA_CPU_FEATURES"] != env.get(_OURS):
        return None  # the user's own
    features = codegen_features(path, dict(llvm_binding.get_host_cpu_features()))
    if features is None:
        env.pop("NUMBA_CPU_FEATURES", None)
        env.pop(_OURS, None)
    else:
        env["NUMBA_CPU_FEATURES"] = env[_OURS] = features
    from numba.core import config, registry
    config.reload_config()
    made = registry.cpu_target.__dict__.get("_toplevel_target_context")  # made by an earlier compile?
    if made is not None and made.codegen()._tm_features != config.CPU_FEATURES and features is not None:
        return (f"PYML_ISA={path}: Numba compiled before pyml was imported, so its code may still use "
                f"the host's wider instructions (set NUMBA_CPU_FEATURES to cap it)")
    return None


def _compiled_features() -> set:
    """The features LLVM compiles the kernels for: NUMBA_CPU_FEATURES's '+' names where it is set
    (by _cap_codegen or the user), else the host's."""
    given = os.environ.get("NUMBA_CPU_FEATURES")
    if given is None:
        return HOST_FEATURES
    return {f[1:] for f in given.split(",") if f.startswith("+")}


HOST_FEATURES = host_features()
ISA, ISA_WARNING = choose(HOST_FEATURES, os.environ.get("PYML_ISA"))
ISA_WARNING = ISA_WARNING or _cap_codegen(ISA)
# The vector registers LLVM allocates the kernels' values from: 32 where it compiles with AVX-512
# (EVEX encodes ymm16-31), 16 otherwise. Register tiles are sized by it (quant/floats.py).
REGISTERS = 32 if "avx512f" in _compiled_features() else 16
VNNI = ISA in ("avx512_bf16", "avx512_vnni", "avx_vnni")
AVX2 = ISA != "portable"
ZMM = ISA in ("avx512_bf16", "avx512_vnni")  # 512-bit vectors in the x8 GEMM
BF16 = ISA == "avx512_bf16"  # vdpbf16ps: --float-compute bf16 can run
