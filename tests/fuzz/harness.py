"""What every fuzz input must satisfy, for the GGUF and safetensors loaders.

A model file is untrusted input. Whatever its bytes, loading it either succeeds
with tensors that lie inside the file, or raises a PymlError whose message is one
line naming the file. Any other exception, a crash, a hang or a large allocation
is a bug. The atheris campaign (run_campaign.py), the hypothesis properties and
the regression corpus all go through `check()`.

    python -m tests.fuzz.harness FILE...   # one JSON line per file (used by the corpus test)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pyml.core.errors import PymlError  # noqa: E402

SLOW_S = 5.0  # a small input taking longer than this to accept or refuse counts as a hang


class Finding(AssertionError):
    """An input that broke a property: not a PymlError, a bad message, a bad tensor, too slow."""


def kind_of(path: Path, data: bytes | None = None) -> str:
    head = data[:4] if data is not None else path.open("rb").read(4)
    if path.suffix == ".gguf":
        return "gguf"
    if path.suffix == ".safetensors":
        return "safetensors"
    return "gguf" if head == b"GGUF" else "safetensors"


def _check_message(e: PymlError, path: Path):
    msg = str(e)
    if "\n" in msg or not msg.strip():
        raise Finding(f"error message is not one line: {msg!r}")
    if str(path) not in msg:
        raise Finding(f"error message does not name the file: {msg!r}")


def _check_gguf_tensors(f):
    """Every accepted tensor: its bytes inside the data section, aligned, not overlapping another."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType
    spans = []
    for name, (data, type_name, shape) in f.tensors.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        n = int(np.prod(shape, dtype=object))
        if n % block or data.nbytes != n // block * size:
            raise Finding(f"tensor {name!r}: {data.nbytes} bytes for {type_name} {shape}")
        start = data.__array_interface__["data"][0]
        spans.append((start, start + data.nbytes, name))
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1 and b1 > b0 and a1 > a0:
            raise Finding(f"tensors {an!r} and {bn!r} overlap")


def check_gguf(path: Path, model: bool = False) -> str:
    """'ok' or 'rejected: <message>'; raises Finding (or anything unexpected) for a bug."""
    from pyml.nlp.api import build_gguf
    from pyml.nlp.loaders.gguf import GGUFFile
    try:
        if model:
            net, tokenizer, _, _ = _timed(build_gguf, path)
            _run(net, tokenizer)  # not timed: the first call of a kernel compiles it
        else:
            _check_gguf_tensors(_timed(GGUFFile, path))
    except PymlError as e:
        _check_message(e, path)
        return "rejected: " + str(e)
    return "ok"


def check_safetensors(path: Path, model: bool = False) -> str:
    """`path` is a model directory's model.safetensors (with config.json beside it for `model`)."""
    from pyml.nlp.loaders.safetensors import load_tensors
    directory = path.parent
    try:
        if model:
            import pyml
            lm = _timed(lambda d: pyml.load_model(safetensors=str(d), warmup=False), directory)
            _run(lm.model, lm.tokenizer)
        else:
            store = _timed(load_tensors, directory)
            for name in store.names():
                data = store.tensors[name][0]
                if data.size:
                    np.asarray(data).reshape(-1)[-1:].copy()  # touch the last element of each view
    except PymlError as e:
        _check_message(e, directory)
        return "rejected: " + str(e)
    return "ok"


def _timed(load, path):
    """load(path), which must accept or refuse a small file within SLOW_S (a hang is a finding)."""
    t0 = time.perf_counter()
    try:
        return load(path)
    finally:
        elapsed = time.perf_counter() - t0
        if elapsed > SLOW_S:
            raise Finding(f"loading took {elapsed:.1f} s (> {SLOW_S} s) for a {Path(path).stat().st_size}-byte input")


def _run(net, tokenizer):
    """A short prefill and one decode step: every kernel reads the weights the loader accepted."""
    cache = net.new_cache(4)
    logits = net.forward([0, 1], cache)
    net.forward([int(np.argmax(logits)) % max(1, net.config.vocab_size)], cache)
    if tokenizer is not None:
        tokenizer.decode(tokenizer.encode("hi") + [0])


def check(path, model: bool = False, beside: Path | None = None) -> str:
    """Run one file through its loader and every property; returns the outcome.

    A safetensors file is linked into a directory of its own as model.safetensors, with the
    files of `beside` (config.json, tokenizer.json) next to it.
    """
    path = Path(path)
    if kind_of(path) == "gguf":
        outcome = check_gguf(path, model)
    else:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="pyml-fuzz-") as d:
            target = Path(d) / "model.safetensors"
            target.symlink_to(path.resolve())
            for extra in (beside.iterdir() if beside else ()):
                if extra.suffix != ".safetensors":
                    (Path(d) / extra.name).symlink_to(extra.resolve())
            outcome = check_safetensors(target, model)
    return outcome


def main(argv):
    """One JSON line per file: {"file", "outcome"} or {"file", "finding"} for a bug (exit 1)."""
    model = "--model" in argv
    files = [a for a in argv if a != "--model"]
    bad = 0
    for name in files:
        print(json.dumps({"file": name, "start": True}), flush=True)
        try:
            out = {"file": name, "outcome": check(name, model)}
        except Exception as e:  # noqa: BLE001 - everything but a PymlError is the finding
            bad += 1
            out = {"file": name, "finding": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
