"""pyml-infer as a user runs it: its exit code, its stdout and stderr.

What only a real process shows runs in one (run_cli): a generation's stats line and [perf] lines,
--debug's traceback, stdin's decoding, the status a refused run exits with. The rest - refusals of a
bad flag, file or prompt, and what a flag does to a generation - runs the command's own main(argv)
in this process (in_process): the same parser, run and one-line ending, without starting a Python
that imports NumPy and Numba (1-4 s each: 25 of this file's 33 runs were processes before)."""

import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numba
import pytest

from pyml.cli import pyml_batch, pyml_chat, pyml_infer, pyml_serve
from pyml.cli.standins import write_gpt2

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    env.pop("LOG", None)
    return subprocess.run([sys.executable, str(ROOT / "bin" / "pyml-infer"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def in_process(*args, main=pyml_infer.main, stdin: str = "") -> subprocess.CompletedProcess:
    """main(argv) here, with what it writes and its exit status as run_cli returns them. Bytes in
    argv are decoded as Python decodes a process's argv (os.fsdecode: undecodable bytes become
    surrogates); stdin holds `stdin` (empty, as run_cli's /dev/null); LOG and PYML_LOG are unset
    while it runs (run_cli's process has no LOG); Numba's thread count (-t) is put back after."""
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.pop(k) for k in ("LOG", "PYML_LOG") if k in os.environ}
    threads, stdin_before, sys.stdin = numba.get_num_threads(), sys.stdin, io.StringIO(stdin)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main([os.fsdecode(a) for a in args])
            except SystemExit as e:  # argparse's own errors
                code = e.code
    finally:
        sys.stdin = stdin_before
        os.environ.update(saved)
        numba.set_num_threads(threads)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def one_line_error(proc, *needles, code=2):
    # a first run's compile says so on stderr (pyml/core/compiles.py): progress, not the error
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith(("pyml: compil"))]
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny", n_positions=32)


def test_generates_and_prints_a_summary(tiny):
    proc = run_cli("--safetensors", str(tiny), "--prompt", "Hello", "--max-tokens", "5", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    assert "prompt 5 tokens, generated 5 tokens" in summary
    for key in ("prefill", "tok/s", "ms/token", "load", "threads 1"):
        assert key in summary
    assert "logging" not in summary  # nothing logged, no cost of it to state


def test_debug_log_on_the_command_line(tiny):
    proc = run_cli("--safetensors", str(tiny), "--prompt", "Hi", "--max-tokens", "2", "--log", "debug")
    assert proc.returncode == 0, proc.stderr
    assert "[perf] generator::prefill tokens=2" in proc.stderr
    assert "[perf]     transformer[1]::forward attn=" in proc.stderr  # depth 2, in the step's tree


def _perf_lines(stderr: str) -> list:
    """(depth, indentation, name, start, end) of each [perf] line, in order."""
    out = []
    for ln in stderr.splitlines():
        m = re.match(r"^\[perf\] (?P<ind> *)(?P<name>\S+) .*?(?P<ms>\d+\.\d{3})ms \| .*\bdepth=(?P<depth>\d+) "
                     r"start=(?P<start>\S+)", ln)
        if m:
            start = float(m.group("start"))
            out.append((int(m.group("depth")), len(m.group("ind")), m.group("name"), start,
                        start + float(m.group("ms")) / 1e3))
    return out


def test_trace_lines_come_as_trees_parent_first_without_the_warmup(tiny):
    """LOG=trace pyml-infer -n 4: each step's lines start with the step and every line comes after
    the line of the span it ran in (one level up, its time inside that span's), indented by its
    depth; no warm-up pass is printed unless the spec asks for it."""
    env = {**os.environ, "LOG": "trace", "PYTHONPATH": str(ROOT)}
    env.pop("PYML_LOG", None)
    args = [sys.executable, str(ROOT / "bin" / "pyml-infer"), "--safetensors", str(tiny), "-p", "Hi", "-n", "4",
            "-t", "1"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    lines = _perf_lines(proc.stderr)
    assert len(lines) == sum(ln.startswith("[perf]") for ln in proc.stderr.splitlines()) > 50
    assert "phase=warmup" not in proc.stderr and "runtime::warmup" not in proc.stderr
    tops = [name for depth, _, name, *_ in lines if depth == 0]
    assert tops == ["model::load", "generator::prefill"] + ["generator::decode_step"] * 3
    open_path = []  # the lines this one may be inside, top-level first
    for depth, indent, name, start, end in lines:
        assert indent == 2 * depth, name
        del open_path[depth:]
        assert len(open_path) == depth, f"{name} at depth {depth} without its parent's line before it"
        if depth:
            up = open_path[-1]
            assert up[0] - 2e-6 <= start <= up[1] + 2e-6, (name, up)
        open_path.append((start, end))
    steps = [i for i, (depth, _, name, *_) in enumerate(lines) if name == "generator::decode_step"]
    assert [lines[i + 1][2] for i in steps] == ["model::forward"] * 3  # the step first, its pass next
    # the stats line: the engine's decode figure, and what the lines cost beside it
    summary = proc.stderr.strip().splitlines()[-1]
    m = re.search(r"decode (\S+) ms/token \(\S+ tok/s\) \+ logging (\S+) ms/token \|", summary)
    assert m and float(m.group(2)) > 0, summary

    env["LOG"] = "trace,warmup"
    proc = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=300, env=env,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "runtime::warmup" in proc.stderr and "phase=warmup" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["logging"]["predicted_per_token_ms"] > 0 and out["timings"]["predicted_n"] == 4
    assert out["logging"]["predicted_per_token_ms"] == pytest.approx(out["logging"]["predicted_ms"] / 3)


def test_missing_directory():
    """The one refusal run as a process: sys.exit(main()) ends it with main's status."""
    one_line_error(run_cli("--safetensors", "/nonexistent/model-dir"), "/nonexistent/model-dir")


def test_config_without_required_keys(tmp_path, tiny):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 512}))
    (d / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    one_line_error(in_process("--safetensors", str(d)), "config.json", "'n_embd'", "missing")


def test_tensor_shapes_disagree_with_config(tmp_path, tiny):
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").symlink_to(tiny / "model.safetensors")
    one_line_error(in_process("--safetensors", str(d)), "transformer.wte.weight", "[512, 64]", "[1000, 64]")


def test_prompt_longer_than_the_context(tiny):
    one_line_error(in_process("--safetensors", str(tiny), "--prompt", "x" * 40), "40 tokens", "context window of 32")


def test_generation_stops_at_the_context_window(tiny):
    proc = in_process("--safetensors", str(tiny), "--prompt", "x" * 30, "--max-tokens", "10")
    assert proc.returncode == 0, proc.stderr
    # positions 0..31 are fed; the token predicted at position 31 is the last one
    assert "generated 3 tokens" in proc.stderr
    assert "stopped at the context size (32 tokens" in proc.stderr


def test_a_context_past_the_models_window_is_said_and_capped(tiny):
    proc = in_process("--safetensors", str(tiny), "--prompt", "x" * 30, "--max-tokens", "10", "-c", "100")
    assert proc.returncode == 0, proc.stderr
    assert "pyml-infer: -c 100 is past the model's window of 32 positions; using 32" in proc.stderr
    assert "generated 3 tokens" in proc.stderr


def test_context_shift_goes_on_past_a_full_cache(tiny):
    proc = in_process("--safetensors", str(tiny), "-p", "x" * 6, "-n", "20", "-c", "12", "--context-shift",
                   "--keep", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # 6 prompt tokens; a full 12-position cache keeps 2 + 5 of its 12 each time: 3 shifts in 19 fed tokens
    assert out["generated_tokens"] == 20 and out["stop_reason"] == "max_tokens" and out["context_shifts"] == 3
    one_line_error(in_process("--safetensors", str(tiny), "-c", "0"), "--ctx-size must be >= 1")


@pytest.mark.parametrize("flag,value,needle", [("--max-tokens", "-1", "--max-tokens must be >= 0"),
                                               ("--temperature", "-0.5", "--temperature must be >= 0"),
                                               ("--temperature", "inf", "--temperature must be >= 0 and finite, got inf"),
                                               ("--repeat-penalty", "inf", "--repetition-penalty must be > 0 and finite"),
                                               ("--top-p", "0", "--top-p"),
                                               ("--threads", "0", "--threads"),
                                               ("--stop", "", "--stop is empty"),
                                               ("--seed", "-1", "--seed must be >= 0, got -1")])
def test_bad_flag_values(tiny, flag, value, needle):
    one_line_error(in_process("--safetensors", str(tiny), flag, value), needle)


def test_more_threads_than_the_pool_has_are_said_not_silently_capped(tiny):
    over = numba.config.NUMBA_NUM_THREADS + 3
    proc = in_process("--safetensors", str(tiny), "-p", "Hello", "-n", "1", "--threads", str(over))
    assert proc.returncode == 0, proc.stderr
    pool = numba.config.NUMBA_NUM_THREADS
    assert f"--threads {over}: this process can run at most {pool} kernel threads" in proc.stderr
    assert f"threads {pool}]" in proc.stderr


def test_unknown_flag_and_bad_log_level(tiny):
    one_line_error(in_process("--bogus"), "unrecognized arguments: --bogus")
    one_line_error(in_process("--safetensors", str(tiny), "--log", "loud"), "unknown log level 'loud'")


def test_debug_flag_shows_the_traceback():
    proc = run_cli("--safetensors", "/nonexistent/model-dir", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


@pytest.mark.parametrize("args, needle", [(["-p", b"hi \xff"], "the prompt (-p) holds the byte 0xff, which is not UTF-8"),
                                          (["--stop", b"\xfe"], "--stop holds the byte 0xfe"),
                                          (["--system", b"a\xc3"], "--system holds the byte 0xc3")])
def test_bytes_that_are_not_utf8_in_argv_are_refused_by_name(tiny, args, needle):
    # argv reaches Python as surrogateescape text ('hi \udcff'): "internal error: TypeError" before
    one_line_error(in_process("--safetensors", str(tiny), "-n", "1", *args), needle)


@pytest.mark.parametrize("locale", ["C.UTF-8", "C"])  # strict UTF-8 stdin, and surrogateescape under C
def test_bytes_that_are_not_utf8_on_stdin_are_refused_by_name(tiny, locale):
    env = dict(os.environ, LC_ALL=locale, PYTHONUTF8="0",
               PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    env.pop("PYTHONIOENCODING", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bin" / "pyml-infer"), "--safetensors", str(tiny), "-n", "1"],
                          input=b"hi \xff there", capture_output=True, timeout=300, env=env)
    proc.stderr = proc.stderr.decode("utf-8", "backslashreplace")
    one_line_error(proc, "the prompt on stdin")


def test_a_prompt_file_that_is_not_utf8_is_refused_by_name(tiny, tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"hi \xff there")
    one_line_error(in_process("--safetensors", str(tiny), "-n", "1", "-f", str(bad)), f"--file {bad}", "utf-8")


def test_json_schema_and_grammar_files_shape_the_output(tmp_path, smollm2_gguf):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    proc = in_process("--gguf", str(smollm2_gguf), "-p", "Is it ok?", "--chat", "-n", "12", "-t", "1",
                   "--temperature", "1", "--seed", "3", "--json-schema", str(tmp_path / "s.json"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(json.loads(proc.stdout)["text"]) in ({"ok": True}, {"ok": False})
    (tmp_path / "g.gbnf").write_text('root ::= "yes" | "no"\n')
    proc = in_process("--gguf", str(smollm2_gguf), "-p", "Is it ok?", "-n", "4", "-t", "1",
                   "--grammar", str(tmp_path / "g.gbnf"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"] in ("yes", "no")


@pytest.mark.parametrize("flag, content, said", [
    ("--json-schema", "{not json", "is not valid JSON"),
    ("--json-schema", "[1, 2]", "must be a JSON object"),
    ("--grammar", "root ::= (", "does not parse"),
    ("--grammar", None, "No such file"),
])
def test_a_bad_schema_or_grammar_file_is_one_line_exit_2(tmp_path, flag, content, said):
    path = tmp_path / "shape"
    if content is not None:
        path.write_text(content)
    # refused before the model loads: the missing model is never reached
    proc = in_process("--gguf", str(tmp_path / "never-loaded.gguf"), "-p", "hi", flag, str(path))
    one_line_error(proc, flag, said)


def test_json_schema_and_grammar_exclude_each_other(tmp_path):
    proc = in_process("--json-schema", "a", "--grammar", "b", "-p", "hi")
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


@pytest.mark.parametrize("main", [pyml_infer.main, pyml_serve.main, pyml_batch.main, pyml_chat.main],
                         ids=["infer", "serve", "batch", "chat"])
def test_a_draft_max_without_a_drafter_is_refused_by_name(tiny, tmp_path, main):
    """--draft-max bounds speculative decoding's drafts: with neither --lookup-ngram nor --draft-model
    nothing drafts, and it was ignored."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "hi"}\n')
    first = [str(src), "--out", str(tmp_path / "o.jsonl")] if main is pyml_batch.main else []
    one_line_error(in_process(*first, "-m", str(tiny), "--draft-max", "3", main=main),
                   "--draft-max without --lookup-ngram or --draft-model is not implemented")
