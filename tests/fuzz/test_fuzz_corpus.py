"""Replay the regression corpus: every input any fuzz run has kept must now load or be refused cleanly.

The inputs run in a child process (python -m tests.fuzz.harness), so an input that crashes
the interpreter fails this test and is named, instead of taking pytest down with it. GGUF
inputs run in model mode: load, then a prefill and a decode step through every kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPUS = HERE / "corpus"


def corpus(kind: str) -> list[Path]:
    return sorted(p for p in (CORPUS / kind).glob("*") if p.is_file() and not p.name.startswith("."))


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_regression_corpus(kind):
    files = corpus(kind)
    assert files, f"the {kind} regression corpus is empty: the campaign's findings belong in tests/fuzz/corpus"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    args = [sys.executable, "-m", "tests.fuzz.harness", *(["--model"] if kind == "gguf" else []),
            *map(str, files)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    results, started = {}, None
    for line in proc.stdout.splitlines():
        rec = json.loads(line)
        if rec.get("start"):
            started = rec["file"]
        else:
            results[rec["file"]] = rec
    assert proc.returncode in (0, 1), f"the harness died ({proc.returncode}) on {started}: {proc.stderr[-2000:]}"
    findings = {Path(f).name: r["finding"] for f, r in results.items() if "finding" in r}
    assert not findings, findings
    assert len(results) == len(files)
