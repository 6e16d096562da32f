"""Bit-equality between two kernels, judged where both are in one compile state.

A kernel compiled in this process and the same kernel loaded from the kernel cache can give results
one ulp apart (docs/performance-journal.md, "Fresh and cached kernels"). A test worker whose cache is
half warm (another worker compiled one of the two kernels) can so see two otherwise bit-equal kernels
differ. Every run after the first has all kernels cached: that is the state these tests judge in, in
a new process, when the comparison in this one fails (both kernels are in the cache by then)."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _call_in_new_process(module: str, function: str, args: tuple):
    code = ("import pickle, sys\n"
            f"from {module} import {function} as f\n"
            "sys.stdout.buffer.write(pickle.dumps(f(*pickle.loads(sys.stdin.buffer.read()))))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(args), capture_output=True, env=env,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return pickle.loads(done.stdout)


def assert_same_bits(module: str, function: str, *args) -> np.ndarray:
    """function(*args) returns (got, expect) arrays computed by two kernels: equal bits here, or else
    in a new process where both kernels come from the cache. Returns `got`."""
    got, expect = getattr(__import__(module, fromlist=[function]), function)(*args)
    if np.array_equal(got, expect):
        return got
    got, expect = _call_in_new_process(module, function, args)
    np.testing.assert_array_equal(got, expect)
    return got
