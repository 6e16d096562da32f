"""The instruction-set path: chosen from the host's features, lowered by PYML_ISA, part of the kernel
cache stamp; every path this machine can run gives the gguf package's answers."""

import pytest
import json
import os
import subprocess
import sys
import textwrap


from pyml.core import isa

ZEN4 = {"avx", "avx2", "fma", "avx512f", "avx512vl", "avx512bw", "avx512vnni", "avx512bf16"}
ICE_LAKE = ZEN4 - {"avx512bf16"}
ALDER_LAKE = {"avx", "avx2", "fma", "avxvnni"}
HASWELL = {"avx", "avx2", "fma"}


def test_paths_follow_the_features():
    assert isa.supported(ZEN4) == ("avx512_bf16", "avx512_vnni", "avx2", "portable")
    assert isa.supported(ICE_LAKE) == ("avx512_vnni", "avx2", "portable")
    assert isa.supported(ALDER_LAKE) == ("avx_vnni", "avx2", "portable")
    assert isa.supported(HASWELL) == ("avx2", "portable")
    assert isa.supported(set()) == ("portable",)
    assert isa.choose(ZEN4, None) == ("avx512_bf16", None)


def test_pyml_isa_lowers_but_never_raises_the_path():
    assert isa.choose(ZEN4, "avx2") == ("avx2", None)
    assert isa.choose(ZEN4, "avx512_vnni") == ("avx512_vnni", None)  # the int8 kernels alone, no bf16
    path, warning = isa.choose(ICE_LAKE, "avx512_bf16")
    assert path == "avx512_vnni" and "cannot run it" in warning
    assert isa.choose(ZEN4, " Portable ") == ("portable", None)
    path, warning = isa.choose(HASWELL, "avx512_vnni")
    assert path == "avx2" and "cannot run it" in warning
    path, warning = isa.choose(HASWELL, "sse9")
    assert path == "avx2" and "not a path" in warning


_PROBE = textwrap.dedent("""
    import hashlib, json, warnings, numba, numpy as np, gguf
    # A Numba performance warning is an error: on a path other than the test machine's own it would
    # reach users' terminals unseen (raised when the kernels compile, i.e. after any kernel change).
    warnings.simplefilter("error", numba.NumbaPerformanceWarning)
    from pyml import quant
    from pyml.core import isa, jit
    from pyml.quant import QuantType
    rng = np.random.default_rng(0)
    errors, digest, digest_q6k = {}, hashlib.sha1(), hashlib.sha1()
    for qtype in (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0, QuantType.Q4_K,
                  QuantType.Q6_K):
        w = rng.standard_normal((24, 256)).astype(np.float32)
        if qtype == QuantType.Q6_K:  # gguf quantizes neither K-quant: random codes and scales, d = 0.01
            raw = rng.integers(0, 256, (24, 210), dtype=np.uint8)
            raw[:, 208:210] = np.array([0.01], np.float16).view(np.uint8)
        elif qtype == QuantType.Q4_K:  # d = 0.01, dmin = 0.02
            raw = rng.integers(0, 256, (24, 144), dtype=np.uint8)
            raw[:, 0:4] = np.array([0.01, 0.02], np.float16).view(np.uint8)
        else:
            raw = gguf.quants.quantize(w, qtype)
        ref_w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
        packed = quant.pack(raw, qtype, 256) if qtype != QuantType.Q6_K else raw
        for T in (1, 5):
            x = rng.standard_normal((T, 256)).astype(np.float32)
            y = quant.matmul(x, packed, qtype, 256)
            ref = x.astype(np.float64) @ ref_w.T
            # the activations' int8 rounding: half a step of each 32-value block's scale, times |w|
            step = np.abs(x).reshape(T, -1, 32).max(axis=2) / np.float32(127.0)
            bound = np.repeat(step.astype(np.float64) / 2, 32, axis=1) @ np.abs(ref_w).T
            errors[f"{qtype.name} T={T}"] = float((np.abs(y - ref) / (bound + 1e-6)).max())
            # Q6_K's T > 1 runs on transcoded int8 tiles where there is AVX2, in the file layout elsewhere
            (digest_q6k if qtype == QuantType.Q6_K else digest).update(y.tobytes())
    # float weights: the GEMM's register tile follows the registers (quant/floats.py); 26 rows and
    # T = 5 leave edge tiles on both sides, T = 70 runs 16-register paths' panels with edges too.
    # Bound: float32 accumulation, n x eps x sum |x w|.
    for qtype in (QuantType.F32, QuantType.F16):
        w = rng.standard_normal((26, 256)).astype(np.float32)
        raw = w if qtype == QuantType.F32 else w.astype(np.float16)
        ref_w = raw.astype(np.float64)
        for T in (1, 5, 70):
            x = rng.standard_normal((T, 256)).astype(np.float32)
            y = quant.matmul(x, raw, qtype, 256)
            bound = 256 * float(np.finfo(np.float32).eps) * (np.abs(x).astype(np.float64) @ np.abs(ref_w).T)
            errors[f"{qtype.name} T={T}"] = float((np.abs(y - x.astype(np.float64) @ ref_w.T) / bound).max())
    print(json.dumps({"isa": isa.ISA, "fingerprint": jit.FINGERPRINT, "errors": errors,
                      "digest": digest.hexdigest(), "digest_q6k": digest_q6k.hexdigest(),
                      "registers": isa.REGISTERS}))
""")


@pytest.mark.deep  # every ISA path in subprocesses; the native path's kernels against gguf: tests/quant/test_matmul.py, test_interleaved.py
def test_every_path_this_cpu_runs_matches_gguf_and_has_its_own_cache_stamp(say):
    available = isa.supported(isa.HOST_FEATURES)
    unavailable = [p for p in isa.PATHS if p not in available]
    say(f"ISA paths run here: {', '.join(available)}; not on this CPU: {', '.join(unavailable) or 'none'}")
    stamps, digests, digests_q6k = {}, set(), set()
    # The paths' probes run at once: each mostly compiles its kernels, on one core, for ~30 s cold
    # (run one after another they were CI's slowest test, 128 s).
    probes = {path: subprocess.Popen([sys.executable, "-c", _PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ, PYML_ISA=path, NUMBA_NUM_THREADS="1"))
              for path in available}
    try:
        for path, probe in probes.items():
            stdout, stderr = probe.communicate(timeout=900)
            assert probe.returncode == 0, stderr[-2000:]
            got = json.loads(stdout.strip().splitlines()[-1])
            assert got["isa"] == path
            # int8 activations: within the bound of the activation rounding (quant docstring); float
            # weights within float32 accumulation's
            assert max(got["errors"].values()) <= 1.0, got
            if path in ("avx512_bf16", "avx512_vnni"):
                assert got["registers"] == 32, got
            elif path != "portable" and path != available[0]:  # forced below AVX-512: compiled without it
                assert got["registers"] == 16, got
            stamps[path] = got["fingerprint"]
            digests.add(got["digest"])
            if path != "portable":
                digests_q6k.add(got["digest_q6k"])
    finally:
        for probe in probes.values():
            if probe.poll() is None:
                probe.kill()
                probe.communicate()
    assert len(set(stamps.values())) == len(stamps)  # no path loads another's machine code
    assert len(digests) == 1  # the integer dots are exact on every path: the same floats, bit for bit
    assert len(digests_q6k) <= 1  # Q6_K's int8 tiles: vpdpbusd on VNNI, three at a time on AVX2


def test_a_forced_path_caps_what_llvm_may_use():
    zen4 = {name: True for name in ZEN4} | {"avx512dq": True, "sse4.2": True, "avxvnni": False}
    avx2 = isa.codegen_features("avx2", zen4).split(",")
    assert "+avx2" in avx2 and "+fma" in avx2 and "+sse4.2" in avx2
    assert {"-avx512f", "-avx512bw", "-avx512vnni", "-avx512bf16", "-avx512dq", "-avxvnni"} <= set(avx2)
    vnni = isa.codegen_features("avx512_vnni", zen4).split(",")
    assert "+avx512vnni" in vnni and "+avx512f" in vnni and "-avx512bf16" in vnni
    assert isa.codegen_features("avx512_bf16", zen4) is None  # the host's best: its own features
    assert isa.codegen_features("portable", zen4) is None  # plain vector IR, lowered for the host
    haswell = {name: True for name in HASWELL}
    assert isa.codegen_features("avx2", haswell) is None


# 24 float accumulators live across a loop: LLVM keeps them in ymm0-31 where AVX-512 is allowed, and
# within ymm0-15 (spilling the rest) where it is not; only with AVX-512 does it fold a broadcast into
# the multiply ({1to8}).
_N = 24
_ASM_PROBE = textwrap.dedent("""
    import json, re, numba, numpy as np
    from pyml.core import isa
    from pyml.core.simd import f32x8, fma, load_f32x8, mul, store_f32x8, zeros_f32x8

    @numba.njit
    def many(x, out):
        {zeros}
        for i in range(0, x.size - {span}, {span}):
            {fmas}
        {stores}
        return out

    x = np.ones(4096, np.float32)
    many(x, np.empty({n8}, np.float32))
    asm = "\\n".join(many.inspect_asm().values())
    print(json.dumps({{"isa": isa.ISA, "high_ymm": bool(re.search(r"[yz]mm(1[6-9]|2[0-9]|3[01])\\b", asm)),
                      "evex_broadcast": "{{1to" in asm}}))
""").format(zeros="; ".join(f"a{k} = zeros_f32x8()" for k in range(_N)),
            fmas="; ".join(f"a{k} = fma(load_f32x8(x, i + {8 * k}), load_f32x8(x, i + {8 * k + 8}), a{k})"
                           for k in range(_N)),
            stores="; ".join(f"store_f32x8(out, {8 * k}, mul(a{k}, f32x8(x[{k}])))" for k in range(_N)),
            span=8 * _N + 8, n8=8 * _N)


def isa_probe(source, path):
    """Run `source` in a process of its own with PYML_ISA=path; the JSON its last line prints."""
    run = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYML_ISA=path))
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.deep  # every ISA path in subprocesses; the native path's kernels against gguf: tests/quant/test_matmul.py, test_interleaved.py
def test_forced_avx2_compiles_as_for_an_avx2_only_cpu(say):
    available = isa.supported(isa.HOST_FEATURES)
    if "avx2" not in available:
        say("the avx2 path is not on this CPU: its code is not compiled here")
        return
    got = isa_probe(_ASM_PROBE, "avx2")
    assert got["isa"] == "avx2"
    assert not got["high_ymm"] and not got["evex_broadcast"], got
    if available[0] in ("avx512_bf16", "avx512_vnni"):  # the probe can tell: the best path uses them
        best = isa_probe(_ASM_PROBE, available[0])
        assert best["high_ymm"] and best["evex_broadcast"], best
