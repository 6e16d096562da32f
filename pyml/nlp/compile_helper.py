"""A first run's second core: the prefill's kernels compiled in a helper process while this one
compiles the decode step's.

On an empty kernel cache a first run compiles two sets of kernels one after the other: the decode
step's (load_model's warm-up) and the prefill's (before the first prompt of more than one token).
Numba compiles on the calling thread under a process-wide lock, so one core works and the others
wait. When the decode step's warm-up starts compiling and the run was given two threads or more,
a helper process loads the same model (its weights already packed, from the packed-weights cache)
and warms its prefill; the kernel cache's per-kernel locks (core/jit.py) have each kernel compiled
by one of the two and loaded by the other, and the time this process waits for the helper's
compiles is shown and counted as compile time (core/compiles.py). The helper says only how many
kernels it compiled (to this process, which counts them in its compile line); if it fails, this
process compiles what it lacks as it would have; it is stopped if this process ends first.
PYML_COMPILE_HELPER=0 turns it off (the test suite's workers fill the cores already).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path


# the helper: load the model without its decode step's warm-up, warm the prefill, say how many
# kernels it compiled (the run's own count holds only its own), end
_HELPER = ("import json, sys\n"
           "from pyml.core import compiles\n"
           "from pyml.nlp.api import load_model\n"
           "load_model(**json.loads(sys.argv[1]), warmup=False).warm_up(prefill=True, cold=True)\n"
           "print(compiles.kernels())\n")


def enabled(threads: int) -> bool:
    return threads >= 2 and os.environ.get("PYML_COMPILE_HELPER", "1") != "0"


def start(options: dict) -> subprocess.Popen | None:
    """A helper warming the prefill of `load_model(**options)`; None if it could not start."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])  # pyml importable however this process found it
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    try:
        helper = subprocess.Popen([sys.executable, "-c", _HELPER, json.dumps(options)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, env=env)
    except OSError:
        return None
    atexit.register(_stop, helper)
    return helper


def finish(helper: subprocess.Popen, timeout_s: float = 300.0) -> int:
    """Wait until the helper has ended (its last compiles would otherwise share the cores with
    what this process times next), at most `timeout_s`, then stop it. The kernels it compiled
    (0 if it failed or was stopped)."""
    try:
        said, _ = helper.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(helper)
        return 0
    last = said.split()[-1:] if helper.returncode == 0 else []
    return int(last[0]) if last and last[0].isdigit() else 0


def _stop(helper: subprocess.Popen) -> None:
    if helper.poll() is None:
        helper.terminate()  # a kernel it was writing is not half there: Numba's cache writes by rename
        try:
            helper.wait(5)
        except subprocess.TimeoutExpired:
            helper.kill()
