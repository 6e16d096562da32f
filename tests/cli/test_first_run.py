"""A first run says what it is doing: with an empty kernel cache pyml-infer shows the compile at once
(one line through a pipe, a bar at a terminal), and its stats line keeps compile apart from load and
warm-up; after `pyml-cache warm` a run compiles nothing and says compile 0.0 s."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from pyml.cli.standins import write_llama_gguf
from pyml.nlp import compile_helper
from tests.conftest import readable

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("first-run") / "tiny.gguf", "llama-tiny", "q8_0")


def _env(numba_cache: Path | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    for name in ("LOG", "PYML_LOG"):
        env.pop(name, None)
    if numba_cache is not None:
        env["NUMBA_CACHE_DIR"] = str(numba_cache)
    return env


def _command(tool: str, *args) -> list:
    return [sys.executable, str(ROOT / "bin" / tool), *args]


def _first_compile_line(read, proc, deadline_s: float) -> tuple[str, float]:
    """What the process has written up to the first 'compiling kernels' mention, and when."""
    seen, t0 = "", time.monotonic()
    while time.monotonic() - t0 < deadline_s and proc.poll() is None:
        seen += read()
        if "compiling kernels" in seen:
            return seen, time.monotonic() - t0
    return seen, float("inf")


def _stop(proc):
    proc.kill()
    proc.wait(timeout=30)


def test_a_cold_run_through_a_pipe_says_so_in_one_line_at_once(tiny, tmp_path):
    proc = subprocess.Popen(_command("pyml-infer", "-m", str(tiny), "-p", "Hello", "-n", "2", "-t", "1"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=_env(tmp_path / "empty-numba-cache"))
    try:
        fd = proc.stderr.fileno()
        os.set_blocking(fd, False)
        read = lambda: (readable(fd, 0.2) and os.read(fd, 65536).decode()) or ""  # noqa: E731
        seen, after_s = _first_compile_line(read, proc, 60)
    finally:
        _stop(proc)
    # the process starts (Python, NumPy, Numba: a few seconds on a busy machine), writes the tiny
    # model's packed cache and meets its first kernel: the line comes then, not after the compile
    assert after_s < 30, seen
    line = next(ln for ln in seen.splitlines() if "compiling kernels" in ln)
    assert line.startswith("pyml: compiling kernels for ") and "first run only" in line
    assert "\r" not in seen and "\x1b" not in seen  # no bar redraws into a pipe


def test_a_cold_run_at_a_terminal_draws_a_bar_naming_the_kernel(tiny, tmp_path):
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size
    proc = subprocess.Popen(_command("pyml-infer", "-m", str(tiny), "-p", "Hello", "-n", "2", "-t", "1"),
                            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                            env=_env(tmp_path / "empty-numba-cache"))
    os.close(follower)
    try:
        read = lambda: (readable(leader, 0.2) and os.read(leader, 65536).decode()) or ""  # noqa: E731
        seen, after_s = _first_compile_line(read, proc, 60)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:  # a redraw or two, naming the kernel being compiled
            seen += read()
    finally:
        _stop(proc)
        os.close(leader)
    assert after_s < 30, seen
    assert "pyml: compiling kernels for " in seen
    assert "kernel" in seen.split("compiling kernels", 1)[1]
    assert "\r" in seen  # a bar, redrawn in place
    assert re.search(r"\d+(/\d+)? ?kernel", seen), seen  # its count


def test_warm_then_run_compiles_nothing(tiny):
    """pyml-cache warm compiles what the model needs (or finds it compiled: the suite's kernel cache
    is shared); the run after it compiles nothing, and pyml-cache info counts the kernels."""
    env = _env()
    warm = subprocess.run(_command("pyml-cache", "warm", "-m", str(tiny), "-t", "1"), capture_output=True,
                          text=True, env=env, stdin=subprocess.DEVNULL, timeout=900)
    assert warm.returncode == 0, warm.stderr
    assert re.search(r"compiled [1-9]\d* kernels|every kernel was already compiled", warm.stdout), warm.stdout

    run = subprocess.run(_command("pyml-infer", "-m", str(tiny), "-p", "Hello world", "-n", "3", "-t", "1"),
                         capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "compil" not in run.stderr.replace("compile 0.0 s", ""), run.stderr
    stats = run.stderr.strip().splitlines()[-1]
    assert re.search(r"\| load \d+\.\d\d s \| compile 0\.0 s \| warm-up \d+\.\d\d s \|", stats), stats

    again = subprocess.run(_command("pyml-cache", "warm", "-m", str(tiny), "-t", "1"), capture_output=True,
                           text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert "every kernel was already compiled" in again.stdout, again.stdout
    info = subprocess.run(_command("pyml-cache", "info"), capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=120)
    kernels = [ln for ln in info.stdout.splitlines() if ln.startswith("kernels ")]
    assert any(re.search(r"[1-9]\d* function\(s\) compiled from these sources", ln) for ln in kernels), info.stdout


def _options(model: Path, threads: int) -> dict:
    return {"gguf": str(model), "threads": threads, "lm_head_quant": None, "kv_type": "f16", "float_compute": "auto"}




def test_the_compile_helper_starts_loads_and_warms_the_prefill(tiny):
    """nlp/compile_helper.py's process, on the suite's kernel cache: it starts with the options a run
    passes it, loads the model and warms its prefill, and ends (what it compiles on an empty cache:
    the deep test below)."""
    helper = compile_helper.start(_options(tiny, 2))
    compile_helper.finish(helper)
    assert helper.returncode == 0


@pytest.mark.deep  # its start and run on a warm cache: test_the_compile_helper_starts_loads_and_warms_the_prefill
def test_the_compile_helper_compiles_what_a_prefill_needs(tiny, tmp_path, monkeypatch):
    """nlp/compile_helper.py, which a first run on two threads or more starts when its decode step
    starts compiling: on an empty kernel cache it compiles the prefill's kernels and says how many,
    so that a prefill warm-up after it compiles none (before it, one compiles them all)."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    helper = compile_helper.start(_options(tiny, 2))
    compiled = compile_helper.finish(helper)
    assert helper.returncode == 0 and compiled > 0
    # the helper's own code again, in a process of its own: it finds everything compiled
    check = subprocess.run([sys.executable, "-c", compile_helper._HELPER, json.dumps(_options(tiny, 1))], env=_env(),
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    assert int(check.stdout.split()[-1]) == 0, check.stderr


@pytest.mark.deep  # the helper itself: test_the_compile_helper_compiles_what_a_prefill_needs
def test_a_first_run_on_two_threads_compiles_its_prefill_in_a_helper_meanwhile(tiny, tmp_path):
    """pyml-infer -t 2 on an empty kernel cache, the helper on: the same text as a warm run of the same
    command, the compile in the stats line, and no helper left running when it has answered."""
    env = dict(_env(tmp_path / "empty-numba-cache"), PYML_COMPILE_HELPER="1")
    command = _command("pyml-infer", "-m", str(tiny), "-p", "Hello world, hello", "-n", "4", "-t", "2")
    cold = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=900)
    assert cold.returncode == 0, cold.stderr[-2000:]
    helpers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).count("compile_helper")
               and str(tiny) in _cmdline(p)]
    assert not helpers
    assert "pyml: compiling kernels for " in cold.stderr
    # the prefill's kernels were the helper's, and the run says how many (with its own wait's line,
    # or on a line of their own when the helper had ended before the prefill's warm-up)
    assert re.search(r"\([1-9]\d* more by a helper process; |pyml: a helper process compiled [1-9]\d* kernels "
                     r"meanwhile", cold.stderr), cold.stderr
    assert re.search(r"\| compile [1-9]\d*\.\d s \(first run only\) \|", cold.stderr), cold.stderr[-500:]
    warm = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert warm.returncode == 0 and "compiling" not in warm.stderr, warm.stderr[-2000:]
    assert warm.stdout == cold.stdout


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_text()
    except OSError:
        return ""
