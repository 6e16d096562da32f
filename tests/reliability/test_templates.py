"""A chat template is code inside a model file: through the real pyml-infer, a hostile one fails
in one line (exit 2) within the issue's bounds of time and memory. The sandbox's cases one by one
are in tests/nlp/test_chat.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fuzz import gguf_build as gb

ROOT = Path(__file__).resolve().parents[2]

# runs pyml-infer as its child and prints the child's peak resident memory (KB on Linux)
_MEASURE = ("import resource, subprocess, sys\n"
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, stdin=subprocess.DEVNULL)\n"
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, sep='\\t')\n"
            "print(p.stderr, file=sys.stderr)\n")


def gguf_with_template(path: Path, template: str) -> Path:
    spec = gb.tiny_llama_spec()
    spec.kvs.append(gb.KV("tokenizer.chat_template", gb.STRING, template))
    path.write_bytes(spec.encode())
    return path


def run_infer_measured(model: Path) -> tuple[int, int, str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    env.pop("LOG", None)
    cmd = [sys.executable, str(ROOT / "bin" / "pyml-infer"), "--gguf", str(model), "--chat", "-p", "hi",
           "-n", "1", "--no-warmup", "-t", "1"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, timeout=300,
                          env=env)
    elapsed = time.perf_counter() - t0
    code, peak_kb = (int(x) for x in proc.stdout.split())
    return code, peak_kb, proc.stderr.strip(), elapsed


@pytest.mark.parametrize("template, size", [("{{ 'a' * 1000000000 }}", "1,000,000,000"),
                                            ("{{ strftime_now('%Y' * 500000000) }}", "1,000,000,000")])
def test_a_template_building_a_gigabyte_fails_fast_in_one_line(tmp_path, template, size):
    code, baseline_kb, stderr, _ = run_infer_measured(gguf_with_template(tmp_path / "ok.gguf", "{{ 'plain' }}"))
    assert code == 0, stderr
    evil = gguf_with_template(tmp_path / "evil.gguf", template)
    code, peak_kb, stderr, elapsed = run_infer_measured(evil)
    # a first run's compile lines are progress, not the error (pyml/core/compiles.py)
    stderr = "\n".join(ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("pyml: compil"))
    assert code == 2 and len(stderr.splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert f"error: the chat template of {evil.name}: " in stderr and f"would be {size} long" in stderr, stderr
    assert elapsed < 10, elapsed  # the bound, start to exit
    assert (peak_kb - baseline_kb) < 500 * 1024, (peak_kb, baseline_kb)  # the bound; 12.6 GB before


def _peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_template_building_a_gigabyte_is_a_400_from_pyml_serve(tmp_path):
    """The same template behind pyml-serve: a 400 naming it within the issue's 10 s, the server's
    peak memory within 500 MB of what it was, and the server answering the next request."""
    from tests.cli.test_serve import serving
    evil = gguf_with_template(tmp_path / "evil.gguf", "{{ 'a' * 1000000000 }}")
    with serving(evil) as served:
        before = _peak_rss_kb(served.proc.pid)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        t0 = time.perf_counter()
        status, body = served.request("POST", "/v1/chat/completions", chat, timeout=60)
        elapsed = time.perf_counter() - t0
        assert status == 400, body
        message = json.loads(body)["error"]["message"]
        assert message.startswith(f"the chat template of {evil.name}: ") and "1,000,000,000" in message, message
        assert elapsed < 10, elapsed
        assert _peak_rss_kb(served.proc.pid) - before < 500 * 1024
        assert served.request("GET", "/health")[0] == 200
        plain = {"prompt": "hi", "max_tokens": 1}
        assert served.request("POST", "/v1/completions", plain)[0] == 200
