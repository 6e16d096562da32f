"""Kernel cache entries are stamped with the fingerprint of all kernel sources (pyml/core/jit.py)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from numba.core import caching

from pyml.core import jit, ops
from pyml.quant import TRAITS, QuantType

PACKAGE = Path(jit.__file__).resolve().parents[1]

# Runs one cached kernel in a fresh process; prints whether it came from the disk cache.
_PROBE = textwrap.dedent("""
    import json
    import numpy as np
    from pyml.quant import TRAITS, QuantType
    kernel = TRAITS[QuantType.Q4_0].kernels.dequant_rows
    raw = np.zeros((2, 18), np.uint8)
    out = np.empty((1, 32), np.float32)
    kernel(raw, np.array([1], np.int64), out)
    stats = kernel.stats
    print(json.dumps({"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values()),
                      "path": kernel._cache._impl.locator.get_cache_path()}))
""")


def test_kernels_use_the_package_stamped_cache():
    q4_0, q6_k, f16 = (TRAITS[q] for q in (QuantType.Q4_0, QuantType.Q6_K, QuantType.F16))
    for kernel in (q4_0.kernels.gemv, q4_0.interleaved.gemm, q6_k.kernels.gemm, f16.kernels.gemv,
                   ops._rms_norm_rows):
        locator = kernel._cache._impl.locator
        assert getattr(type(locator), "_pyml_stamped", False), type(locator).__qualname__
        assert locator.get_source_stamp() == jit.FINGERPRINT


def test_every_module_that_makes_kernel_code_is_in_the_fingerprint():
    """A module of core/quant/nn that defines jitted functions, overloads or intrinsics puts code
    inside other modules' kernels: an edit there must recompile them (core/atomics.py and
    quant/bf16_gemm.py were once missing)."""
    makers = ("@numba.njit", "@njit", "@intrinsic", "@overload", "numba.njit(")
    found = {f"{d.name}/{f.name}" for d in jit._KERNEL_DIRS for f in d.glob("*.py")
             if any(m in f.read_text() for m in makers)}
    assert found <= set(jit._KERNEL_SOURCES), sorted(found - set(jit._KERNEL_SOURCES))


def test_an_edit_to_an_inlined_helper_recompiles_in_a_user_cache_dir(tmp_path):
    """NUMBA_CACHE_DIR set (as CI sets it): an edit to simd.py, whose helpers are inlined into
    the block kernels (kernel_set.py), must recompile them - Numba's own stamp (kernel_set.py
    alone) would load the old machine code, as it once did in CI."""
    tree = tmp_path / "tree"
    shutil.copytree(PACKAGE, tree / "pyml", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(tree))

    def probe():
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=tree,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = probe()
    assert first["path"].startswith(str(tmp_path / "numba"))
    assert (first["hits"], first["misses"]) == (0, 1)
    again = probe()
    assert (again["hits"], again["misses"]) == (1, 0)  # unchanged sources: loaded from disk
    with open(tree / "pyml" / "core" / "simd.py", "a") as f:
        f.write("\n# an edit\n")
    assert probe()["misses"] == 1  # recompiled, not loaded stale


def test_a_run_on_another_isa_path_leaves_the_native_entries_alone(tmp_path):
    """PYML_ISA=portable (as test_isa's probes and `PYML_ISA=avx2 pyml-bench` run) compiles the
    same functions for another path. Its entries go to a folder of their own: in one folder the
    function's index file was rewritten with the other path's stamp, and the next native run
    recompiled everything such a run had touched."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env.pop("PYML_ISA", None)

    def probe(**extra):
        out = subprocess.run([sys.executable, "-c", _PROBE], env=dict(env, **extra), cwd=PACKAGE.parent,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    native = probe()
    assert native["misses"] == 1
    other = probe(PYML_ISA="portable")
    assert other["misses"] == 1 and other["path"] != native["path"]
    again = probe()
    assert (again["hits"], again["misses"]) == (1, 0)  # still on disk after the portable run


def test_a_damaged_cache_file_is_a_miss_said_once_and_written_anew(tmp_path):
    """A kernel's machine code cut short, then its index: each run recompiles the kernel with one
    warning line naming the file (it stopped every run with "UnpicklingError: pickle data was
    truncated" until the folder was deleted), and the next run loads what it wrote."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env.pop("PYML_ISA", None)

    def probe():
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=PACKAGE.parent,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr

    first, _ = probe()
    assert first["misses"] == 1
    folder = Path(first["path"])
    for damaged in (next(folder.glob("*dequant_rows*.nbc")), next(folder.glob("*dequant_rows*.nbi"))):
        damaged.write_bytes(damaged.read_bytes()[:len(damaged.read_bytes()) // 2])
        again, err = probe()
        assert again["misses"] == 1, err
        said = [line for line in err.splitlines() if "unreadable" in line]
        assert len(said) == 1 and str(damaged) in said[0] and "compiling it again" in said[0], err
        assert "Traceback" not in err
        healed, err = probe()
        assert (healed["hits"], healed["misses"]) == (1, 0) and "unreadable" not in err


_RACE = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from pyml.quant import TRAITS, QuantType
    kernel = TRAITS[QuantType.Q5_1].kernels.dequant_rows
    ready, other = sys.argv[1], sys.argv[2]
    open(ready, "w").close()
    while not os.path.exists(other):  # both processes ask for the kernel at the same moment
        time.sleep(0.001)
    kernel(np.zeros((2, 24), np.uint8), np.array([1], np.int64), np.empty((1, 32), np.float32))
    stats = kernel.stats
    print(json.dumps({"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}))
""")


def test_two_processes_on_a_cold_cache_compile_a_kernel_once(tmp_path):
    """Both ask for one uncached kernel at once: one compiles it, the other waits for its lock and
    loads what the first wrote (without the lock both compiled: [1, 1] misses)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    flags = [str(tmp_path / "a"), str(tmp_path / "b")]
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, mine, other], env=env, cwd=PACKAGE.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mine, other in (flags, flags[::-1])]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["misses"] for r in results) == [0, 1], results
    assert sorted(r["hits"] for r in results) == [0, 1], results


def test_two_entries_of_one_function_saved_at_once_both_stay_in_its_index(tmp_path):
    """A function's signatures share one index file that Numba rewrites by read-modify-write: two
    saves at once (two processes, or two threads as here, each with its own lock descriptor) are
    taken one at a time, so both entries stay and each names its own data file (a mutant without
    the index lock kept one entry, the other's machine code under its number)."""
    index = caching.IndexDataCacheFile(str(tmp_path), "kernel-1.py42", jit.FINGERPRINT)
    read = index._load_index

    def slow_read():  # both saves would read the old index before either wrote it
        found = read()
        time.sleep(0.3)
        return found
    index._load_index = slow_read
    saves = [threading.Thread(target=index.save, args=(key, f"code for {key}")) for key in ("sig a", "sig b")]
    for t in saves:
        t.start()
    for t in saves:
        t.join(timeout=60)
    assert index.load("sig a") == "code for sig a"
    assert index.load("sig b") == "code for sig b"


# Decode attention on fixed inputs; with "callee-first", the kernel it calls (attend_rows) is run on its
# own first, so its own library is in the process before _decode_serial's.
_ORDER_PROBE = textwrap.dedent("""
    import hashlib, sys
    import numpy as np
    from pyml.nn import attention_kernels as ak
    from pyml.nn.kv_cache import KVCache
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((125, 3, 64), np.float32), rng.standard_normal((125, 3, 64), np.float32)
    cache = KVCache(1, 3, 64, 165, "f32")
    cache.update(0, 0, k, v)
    q = rng.standard_normal((9, 64), np.float32)
    if sys.argv[1] == "callee-first":
        keys, k_scale, values, v_scale = cache.layer(0)
        ak.attend_rows(np.zeros((4, 64), np.float32), np.zeros(4, np.int64), 3, keys, k_scale, values, v_scale,
                       0, 0, 8, 0, np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros((4, 64), np.float32),
                       np.zeros((4, 64), np.float32), keys, values, -1, 0)
    nothing = np.zeros((0, 3, 64), np.float32)
    out = ak._decode_serial(q, nothing, nothing, *cache.layer(0), 0, 125, 0, np.float32(0.125), 1, np.empty_like(q))
    print(hashlib.sha1(out.tobytes()).hexdigest())
""")


def test_a_kernel_has_the_same_bits_whichever_kernels_the_process_loaded_first():
    """Numba links a callee into each caller as a weak symbol bound to the first definition the
    process loaded: the callee's own compile or the caller's copy, one ulp apart here before
    core/jit.py renamed each module's copies for itself (journal: "Fresh and cached kernels")."""
    runs = [subprocess.run([sys.executable, "-c", _ORDER_PROBE, order], capture_output=True, text=True, timeout=600,
                           cwd=PACKAGE.parent, env=dict(os.environ, NUMBA_NUM_THREADS="1"))
            for order in ("plain", "callee-first", "plain")]
    assert all(run.returncode == 0 for run in runs), [run.stderr[-800:] for run in runs]
    assert len({run.stdout for run in runs}) == 1, [run.stdout for run in runs]


# Compiles (or loads) the dequant_rows of the types named, in that order, and checks each against gguf.
_TWO_CLOSURES = textwrap.dedent("""
    import sys
    import gguf
    import numpy as np
    from pyml.quant import TRAITS, QuantType
    rng = np.random.default_rng(0)
    environments = set()
    for name in sys.argv[1:]:
        qtype = QuantType[name]
        if qtype == QuantType.Q5_K:  # gguf quantizes no K-quant: random codes and scales, d 0.01, dmin 0.02
            raw = rng.integers(0, 256, (2, 176), dtype=np.uint8)
            raw[:, 0:4] = np.array([0.01, 0.02], np.float16).view(np.uint8)
        else:
            raw = gguf.quants.quantize(rng.standard_normal((2, 256)).astype(np.float32), qtype)
        out = np.empty((2, 256), np.float32)
        got = TRAITS[qtype].kernels.dequant_rows(raw, np.arange(2, dtype=np.int64), out)
        assert np.array_equal(got, gguf.quants.dequantize(raw, qtype)), name
        # each kernel its own environment (the constants it boxes and raises with), not a namesake's
        environments.add(id(next(iter(TRAITS[qtype].kernels.dequant_rows.overloads.values())).environment))
    assert len(environments) == len(sys.argv) - 1, "two kernels share one environment"
    print("ok")
""")


def test_closures_of_one_factory_compiled_in_two_processes_load_together(tmp_path):
    """kernel_set makes a dequant_rows per type from one closure: the same qualified name and argument
    types. Compiled first thing in two processes, Numba named both "v1", and a third process loading
    both from the cache gave the second the first's environment (CI: "'descr' is NULL" from Q5_K's)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    run = [sys.executable, "-c", _TWO_CLOSURES]
    procs = [subprocess.Popen(run + [name], env=env, cwd=PACKAGE.parent, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name in ("Q4_0", "Q5_K")]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.strip() == "ok", err[-2000:]
    both = subprocess.run(run + ["Q4_0", "Q5_K"], env=env, cwd=PACKAGE.parent, capture_output=True, text=True,
                          timeout=300)
    assert both.returncode == 0 and both.stdout.strip() == "ok", both.stderr[-2000:]
