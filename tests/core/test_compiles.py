"""The compile counter (pyml/core/compiles.py) against Numba's own record of what it built: the
overloads a dispatcher holds after the call."""

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numba

from pyml.core import compiles

ROOT = Path(__file__).resolve().parents[2]


def test_a_literal_argument_is_one_kernel_not_two():
    """numba.literally makes Numba try once with a plain int, stop, and compile with the constant:
    the stopped try built nothing, so it is not counted (it was: a cold test run listed it)."""
    @numba.njit
    def scaled(kind, x):
        numba.literally(kind)
        return x * kind

    before, listed = compiles.kernels(), len(compiles.compiled())
    assert scaled(3, 2.0) == 6.0
    assert len(scaled.overloads) == 1  # Numba's own count of what it compiled
    new = compiles.compiled()[listed:]
    assert [args for name, args in new if name == "test_compiles.scaled"] == ["(Literal[int](3), float64)"]
    assert compiles.kernels() - before == len(new)  # with Numba's own helper for `literally`

def test_a_plain_kernel_and_its_callee_are_two():
    @numba.njit
    def callee(x):
        return x + 1

    @numba.njit
    def caller(x):
        return callee(x) * 2

    before = compiles.kernels()
    assert caller(1) == 4
    assert len(caller.overloads) + len(callee.overloads) == 2
    assert compiles.kernels() - before == 2


def _scaled_by(kind: int):
    """A factory as kernel_set.block_kernels is: one dispatcher per constant, same argument types."""
    @numba.njit
    def scaled(x):
        return x * kind
    return scaled


def test_a_factory_kernel_is_listed_with_the_constants_it_was_made_for():
    """Two kernels a factory made for two kinds take the same argument types: without the closure's
    constants in the name, the list read them as one kernel compiled twice."""
    listed = len(compiles.compiled())
    assert _scaled_by(2)(3.0) == 6.0 and _scaled_by(5)(3.0) == 15.0
    names = [name for name, args in compiles.compiled()[listed:] if args == "(float64,)"]
    assert names == ["test_compiles.scaled[kind=2]", "test_compiles.scaled[kind=5]"]


# Compiles one of pyml's cached kernels into an empty cache, slowly: the save (inside the compile,
# under the kernel's lock) says so in the file argv[1], waits for the other process to say it is
# about to ask for the kernel (the file argv[2]; its start-up takes seconds on a busy machine), then
# 2 s more.
_SLOW_COMPILE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from numba.core import caching
    from pyml.quant import TRAITS, QuantType
    save = caching.Cache.save_overload
    def slow_save(self, sig, data):
        open(sys.argv[1], "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(2)
        return save(self, sig, data)
    caching.Cache.save_overload = slow_save
    TRAITS[QuantType.Q5_1].kernels.dequant_rows(np.zeros((2, 24), np.uint8), np.array([1], np.int64),
                                                np.empty((1, 32), np.float32))
""")

# Asks for that kernel while the other process compiles it, inside a compile display.
_WAITER = textwrap.dedent("""
    import json, sys
    import numba
    import numpy as np
    from pyml.core import compiles
    from pyml.quant import TRAITS, QuantType
    kernel = TRAITS[QuantType.Q5_1].kernels.dequant_rows
    numba.njit(lambda: 0)()  # Numba's compiler set up (a second or more on a busy machine), not timed below
    open(sys.argv[1], "w").close()  # about to ask: the other process's save can end 2 s from now
    with compiles.showing("probe") as shown:
        kernel(np.zeros((2, 24), np.uint8), np.array([1], np.int64), np.empty((1, 32), np.float32))
    stats = kernel.stats
    print(json.dumps({"seconds": shown.seconds, "kernels": shown.kernels, "hits": sum(stats.cache_hits.values())}))
""")


def test_a_wait_for_another_process_compiling_is_shown_and_counted_as_compile_time(tmp_path):
    """One process compiles a kernel (its save holding the kernel's lock, core/jit.py, until 2 s after
    the other has started); another asks for it meanwhile: it loads what the first wrote, compiling
    nothing, and its display says it waited - the wait counted in its compile seconds, not left to
    look like a slow warm-up."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    holding, asking = tmp_path / "holding", tmp_path / "asking"
    compiler = subprocess.Popen([sys.executable, "-c", _SLOW_COMPILE, str(holding), str(asking)], env=env,
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not holding.exists():
            assert compiler.poll() is None and time.monotonic() - t0 < 300, compiler.stderr.read()[-2000:]
            time.sleep(0.01)
        waiter = subprocess.run([sys.executable, "-c", _WAITER, str(asking)], env=env, cwd=ROOT, capture_output=True,
                                text=True, timeout=300)
    finally:
        compiler.communicate(timeout=300)
    assert compiler.returncode == 0 and waiter.returncode == 0, waiter.stderr[-2000:]
    got = json.loads(waiter.stdout.strip().splitlines()[-1])
    assert got["kernels"] == 0 and got["hits"] == 1, got
    assert got["seconds"] > 1.0, got  # most of the 2 s the save held the lock after the waiter started
    lines = waiter.stderr.strip().splitlines()
    assert lines[0].startswith("pyml: compiling kernels for probe (first run only"), lines
    assert re.fullmatch(r"pyml: waited \d+\.\d s for kernels another process compiled \(cached for later runs\)",
                        lines[-1]), lines


def test_kernels_a_helper_process_compiled_are_counted_in_the_summary():
    """A first run's compile helper (nlp/compile_helper.py) says how many kernels it compiled; the
    run's summary line counts them beside its own, so the line does not say half the work."""
    out = io.StringIO()
    with compiles.showing("probe", stream=out) as shown:
        numba.njit(lambda x: x + 1)(1)  # one compile here, never cached
        compiles.add_elsewhere(5)
    assert shown.kernels == 1 and shown.elsewhere == 5
    assert re.fullmatch(r"pyml: compiled 1 kernels in \d+\.\d s \(5 more by a helper process; cached for later "
                        r"runs\)", out.getvalue().strip().splitlines()[-1]), out.getvalue()
    # a helper that ended before the run's prefill warm-up: nothing compiled or waited for here
    out = io.StringIO()
    with compiles.showing("probe", stream=out) as shown:
        compiles.add_elsewhere(7)
    assert out.getvalue() == "pyml: a helper process compiled 7 kernels meanwhile (cached for later runs)\n"
