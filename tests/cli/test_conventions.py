"""The CLI conventions llama.cpp and ollama users expect: -m/-p/-f/-n/-t, stdin prompts, --json,
--temp, --system, --stop, PYML_LOG over LOG, and a closed stdout pipe.

The flags run pyml-infer's main(argv) in this process (tests/cli/test_infer.py's in_process: the
same parser and run, without a Python start each); what a process's environment or its pipes
decide - LOG, PYML_LOG, a closed stdout - runs in a real one."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pyml.cli.pyml_infer import build_parser
from pyml.cli.standins import write_gpt2
from pyml.nlp.api import guess_format, load_model
from tests.cli.test_infer import in_process

ROOT = Path(__file__).resolve().parents[2]
INFER = [sys.executable, str(ROOT / "bin" / "pyml-infer")]


def env(**extra):
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [e.get("PYTHONPATH"), str(ROOT)]))
    for k in ("LOG", "PYML_LOG"):
        e.pop(k, None)
    e.update(extra)
    return e


def infer(*args, **extra):
    return subprocess.run([*INFER, *args], capture_output=True, text=True, timeout=120, env=env(**extra),
                          stdin=subprocess.DEVNULL)


def as_json(proc):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def generated(proc):
    """What --json says was generated, without the timings that differ run to run."""
    out = as_json(proc)
    return out["prompt_tokens"], out["tokens"], out["text"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny", n_positions=1024))


@pytest.fixture(scope="module")
def tiny_lm(tiny):
    return load_model(safetensors=tiny, threads=1)


def test_json_output_with_short_flags(tiny, tiny_lm):
    out = as_json(in_process("-m", tiny, "-p", "Hello", "-n", "4", "-t", "1", "--json"))
    ref = tiny_lm.generate("Hello", max_tokens=4)
    assert out["tokens"] == ref.tokens and out["text"] == ref.text
    assert out["stop_reason"] == "max_tokens" and out["threads"] == 1
    assert out["prompt_tokens"] == len(tiny_lm.encode("Hello"))
    assert out["timings"]["predicted_n"] == 4 and out["timings"]["prompt_n"] == out["prompt_tokens"]


def test_prompt_from_stdin_and_from_a_file(tiny, tmp_path):
    by_flag = generated(in_process("-m", tiny, "-p", "Once upon", "-n", "3", "--json"))
    assert by_flag[0] == 9  # not the default prompt's 23 bytes
    assert generated(in_process("-m", tiny, "-n", "3", "--json", stdin="Once upon")) == by_flag
    (tmp_path / "p.txt").write_text("Once upon")
    assert generated(in_process("-m", tiny, "-f", str(tmp_path / "p.txt"), "-n", "3", "--json")) == by_flag
    assert generated(in_process("-m", tiny, "-f", "-", "-n", "3", "--json", stdin="Once upon")) == by_flag


def test_missing_prompt_file_is_one_line(tiny):
    proc = in_process("-m", tiny, "-f", "/nonexistent/prompt.txt")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "/nonexistent/prompt.txt" in proc.stderr


def test_stop_string_and_system_message(tiny, tiny_lm):
    full = tiny_lm.generate("The cat", max_tokens=20).text
    stop = full[6:9]
    out = as_json(in_process("-m", tiny, "-p", "The cat", "-n", "20", "--stop", stop, "--json"))
    assert out["text"] == full[:full.find(stop)] and out["stop_reason"] == "stop"
    out = as_json(in_process("-m", tiny, "-p", "hi", "--system", "Be brief.", "-n", "2", "--json"))
    chat = tiny_lm.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert out["prompt_tokens"] == len(tiny_lm.encode(chat))


def test_temp_and_min_p_flags():
    args = build_parser().parse_args(["--temp", "0.7", "--min-p", "0.05", "-n", "9", "-t", "2", "-m", "x"])
    assert (args.temperature, args.min_p, args.max_tokens, args.threads, args.model) == (0.7, 0.05, 9, 2, "x")


def test_model_format_is_guessed(tiny, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    assert guess_format(tiny) == "safetensors"
    assert guess_format("gpt2") == "safetensors"
    assert guess_format("HuggingFaceTB/SmolLM2-135M") == "safetensors"
    assert guess_format("smollm2-135m") == "gguf"
    assert guess_format(str(tmp_path / "m.gguf")) == "gguf"
    assert guess_format("hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M") == "gguf"  # a hub GGUF, not a hub id


def test_a_foreign_log_value_is_ignored_with_one_warning(tiny):
    proc = infer("-m", tiny, "-p", "Hi", "-n", "2", LOG="verbose")
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if "LOG=verbose" in ln]
    assert len(warnings) == 1 and "ignored" in warnings[0]


def test_pyml_log_takes_precedence_over_log(tiny):
    proc = infer("-m", tiny, "-p", "Hi", "-n", "2", LOG="verbose", PYML_LOG="debug")
    assert proc.returncode == 0, proc.stderr
    assert "[perf] generator::prefill" in proc.stderr and "LOG=verbose" not in proc.stderr
    bad = infer("-m", tiny, "-p", "Hi", "-n", "2", PYML_LOG="verbose")
    assert bad.returncode == 2 and "unknown log level 'verbose'" in bad.stderr


def test_a_closed_stdout_pipe_ends_quietly(tiny):
    """`pyml-infer ... | head -c 5` through a real shell pipe: the reader leaves after 5 bytes."""
    cmd = " ".join(shlex.quote(a) for a in [*INFER, "-m", tiny, "-p", "Hello", "-n", "1000", "-t", "1",
                                                    "--temp", "1", "--seed", "0"])
    proc = subprocess.run(["bash", "-c", f"{cmd} 2>err.txt | head -c 5; echo \" ${{PIPESTATUS[0]}}\""],
                          capture_output=True, text=True, timeout=120, env=env(), cwd=tiny)
    err = (Path(tiny) / "err.txt").read_text()
    assert proc.stdout.split()[-1] == "141", err
    assert "Traceback" not in err and "error" not in err, err
