"""Numba's runtime module from a file (pyml/core/numba_runtime.py): a process that finds a valid file
loads it instead of compiling, and computes what a process that compiled it does - cached kernels
(a model's logits) and a kernel compiled in that process, which links the runtime and allocates
through it; a damaged file is compiled again and rewritten. Each case is a fresh interpreter: in
this one the runtime was set up long ago."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from pyml.cli.standins import write_llama_gguf

PROBE = r"""
import json, sys
import numba, numpy as np
from pyml import load_model
from pyml.core import numba_runtime
lm = load_model(gguf=sys.argv[1], threads=1)
logits = lm.forward([1, 5, 9, 33])

@numba.njit  # compiled here, not cached: links the runtime library and allocates through it
def fresh(n):
    return np.arange(n).astype(np.float64).sum()

print(json.dumps({"source": numba_runtime.source, "logits": logits.tolist(), "fresh": fresh(10)}))
"""


def _run(model, folder) -> dict:
    env = {**os.environ, "PYML_NUMBA_RUNTIME_CACHE": str(folder)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(model)], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_the_runtime_module_is_compiled_once_then_loaded_with_the_same_results(tmp_path):
    model = write_llama_gguf(tmp_path / "m.gguf", "llama-tiny", "q4_0")
    folder = tmp_path / "nrt"
    first = _run(model, folder)
    (written,) = folder.glob("pyml-nrt-*.bin")
    second = _run(model, folder)
    assert (first["source"], second["source"]) == ("compiled", "file")
    np.testing.assert_array_equal(np.array(second["logits"]), np.array(first["logits"]))
    assert first["fresh"] == second["fresh"] == 45.0

    raw = bytearray(written.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # one flipped bit in the object code: the checksum refuses it
    written.write_bytes(bytes(raw))
    third = _run(model, folder)
    assert third["source"] == "compiled" and third["fresh"] == 45.0
    np.testing.assert_array_equal(np.array(third["logits"]), np.array(first["logits"]))
    assert _run(model, folder)["source"] == "file"  # rewritten whole

    written.write_bytes(b"PYMLNRT1")  # truncated inside the header
    assert _run(model, folder)["source"] == "compiled"
