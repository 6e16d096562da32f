"""The instruction-set path: chosen from the host's features, lowered by PYML_ISA, part of the kernel
cache stamp; every path this machine can run gives the gguf package's answers."""

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
    import hashlib, json, numpy as np, gguf
    from pyml import quant
    from pyml.core import isa, jit
    from pyml.quant import QuantType
    rng = np.random.default_rng(0)
    errors, digest = {}, hashlib.sha1()
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
            if qtype != QuantType.Q6_K:  # Q6_K's T > 1 path differs by path (VNNI: transcoded int8 tiles)
                digest.update(y.tobytes())
    print(json.dumps({"isa": isa.ISA, "fingerprint": jit.FINGERPRINT, "errors": errors,
                      "digest": digest.hexdigest()}))
""")


def test_every_path_this_cpu_runs_matches_gguf_and_has_its_own_cache_stamp(capsys):
    available = isa.supported(isa.HOST_FEATURES)
    unavailable = [p for p in isa.PATHS if p not in available]
    with capsys.disabled():  # said in the test output, not skipped silently
        print(f"\nISA paths run here: {', '.join(available)}; not on this CPU: {', '.join(unavailable) or 'none'}")
    stamps, digests = {}, set()
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
            # int8 activations: within the bound of the activation rounding (quant docstring)
            assert max(got["errors"].values()) <= 1.0, got
            stamps[path] = got["fingerprint"]
            digests.add(got["digest"])
    finally:
        for probe in probes.values():
            if probe.poll() is None:
                probe.kill()
                probe.communicate()
    assert len(set(stamps.values())) == len(stamps)  # no path loads another's machine code
    assert len(digests) == 1  # the integer dots are exact on every path: the same floats, bit for bit
