"""load_model warms one decode step; a prefill's kernels load before the first prompt that needs
them, never in a run whose prompts are one token long. Each case runs in a fresh interpreter:
in this one, other tests have loaded every kernel already."""

from __future__ import annotations

import json
import subprocess
import sys

from pyml.cli.standins import write_llama_gguf

PROBE = r"""
import json, sys
from pyml import load_model
from pyml.nn import attention_prefill
lm = load_model(gguf=sys.argv[1], threads=1, warmup=sys.argv[2] == "warm")
tiled = lambda: len(attention_prefill._tiled.signatures) + len(attention_prefill._tiled_bf16.signatures)  # f32 or bf16
seen = {"load": [tiled(), lm.warmup_s]}
lm.generate([5], max_tokens=3)
seen["one-token prompt"] = [tiled(), lm.warmup_s]
lm.generate([5, 9, 33], max_tokens=3)
seen["three-token prompt"] = [tiled(), lm.warmup_s]
lm.generate([7, 8], max_tokens=2)
seen["again"] = [tiled(), lm.warmup_s]
print(json.dumps(seen))
"""


def _run(path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(path), mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_prefill_kernels_load_before_the_first_multi_token_prompt_only(tmp_path):
    seen = _run(write_llama_gguf(tmp_path / "m.gguf", "llama-tiny", "q4_0"), "warm")
    (tiled, warm_s) = seen["load"]
    assert tiled == 0 and warm_s > 0  # the decode step is warm, the prefill's attention not loaded
    assert seen["one-token prompt"] == [0, warm_s]  # a one-token prompt is a decode step: nothing more
    tiled, after = seen["three-token prompt"]
    assert tiled == 1 and after > warm_s  # loaded by a warm-up of its own, before the prompt's prefill
    assert seen["again"] == [1, after]  # once


def test_no_warmup_means_none_later_either(tmp_path):
    seen = _run(write_llama_gguf(tmp_path / "m.gguf", "llama-tiny", "q4_0"), "cold")
    assert [s[1] for s in seen.values()] == [0.0] * 4
    assert seen["three-token prompt"][0] == 1  # the prefill loaded its kernels itself, untimed apart
