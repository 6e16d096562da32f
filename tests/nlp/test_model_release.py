"""A dropped model lets go of its files: no descriptor or mapping of the model file or its packed
cache outlives the last reference. load_model freezes the loaded objects out of the cyclic GC (a
full collection walking them paused a decode step), so a reference cycle among them would never be
collected: every load leaked its mappings (a test worker reached 1,024 descriptors)."""

from __future__ import annotations

import gc
import os

from pyml.cli.standins import write_llama_gguf
from pyml.nlp.api import load_model


def _held(names: tuple) -> list:
    """This process's open descriptors and mappings whose path holds one of `names`."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if any(n in target for n in names):
            held.append(f"fd {fd} -> {target}")
    with open("/proc/self/maps") as f:
        held += [f"mapping {line.split()[-1]}" for line in f if any(n in line for n in names)]
    return held


def test_a_dropped_model_closes_its_files_after_a_step_a_batch_and_a_prompt(tmp_path):
    path = write_llama_gguf(tmp_path / "released.gguf", "llama-tiny", "q8_0")
    names = (path.name,)  # the file and its packed cache (<name>.<digest>.pyml-packed)
    lm = load_model(str(path), threads=1)
    lm.generate("Hello", max_tokens=3)  # the decode step: FusedBlock, FusedStep
    lm.generate_batch(["Hello", "Hi there"], max_tokens=3)  # a KVPool and its sequences
    assert _held(names)  # the weights are mapped while the model lives
    del lm
    assert _held(names) == []
    gc.collect()  # nothing waits for a collection either (it could not reach frozen objects)
    assert _held(names) == []
