"""pyml-chat as a user drives it: in a pseudo-terminal (turns, /reset, Ctrl-C during a reply),
and scripted, with stdin a pipe (one line per turn, only the replies on stdout)."""

import os
import pty
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyml.cli.standins import write_gpt2
from pyml.nlp.api import load_model
from tests.conftest import readable

ROOT = Path(__file__).resolve().parents[2]
CHAT = [sys.executable, str(ROOT / "bin" / "pyml-chat")]


def env():
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    e.pop("LOG", None)
    return e


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny", n_positions=512)


def test_scripted_turns_print_only_the_replies(tiny):
    proc = subprocess.run([*CHAT, "-m", str(tiny), "-n", "6", "-t", "1", "--system", "Be brief.",
                           "--verbose"],
                          input="hello\n/stats\nhow are you\n", capture_output=True, text=True, timeout=120, env=env())
    assert proc.returncode == 0, proc.stderr
    lm = load_model(safetensors=str(tiny), threads=1)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    first = lm.chat(messages, max_tokens=6).text  # without a cache: the oracle for the cached turns
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "how are you"}]
    second = lm.chat(messages, max_tokens=6).text
    assert proc.stdout == f"{first}\n{second}\n"
    timings = [ln for ln in proc.stderr.splitlines() if ln.startswith("[prompt")]
    assert len(timings) == 3  # two replies and /stats
    assert "cached" not in timings[0] and re.search(r"\(\d+ cached\)", timings[2])
    assert all(re.search(r"\| decode [\d.]+ ms/step: attention \d+% ffn \d+% head \d+%", t) for t in timings)


class Terminal:
    """A child process on a pseudo-terminal; every read is bounded in time."""

    def __init__(self, argv):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its terminal is the pty, so ^C there is SIGINT
            # as a shell at a terminal starts it: SIGINT's default action, whatever the test runner
            # inherited (started in the background by a shell without job control, SIGINT is
            # ignored, the ignoring survives exec, and Python then leaves it so: ^C did nothing)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(argv[0], argv, env())
        self.seen = b""

    # a bound against a hang, not a speed check: a process that finds its kernels not yet cached
    # compiles them before its first prompt or reply (over a minute on a busy 2-core machine)
    def expect(self, pattern: bytes, timeout=300) -> bytes:
        deadline = time.monotonic() + timeout
        while not (match := re.search(pattern, self.seen)):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.seen[-2000:]!r}"
            if readable(self.fd, min(left, 1.0)):
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    chunk = b""
                assert chunk, f"the process ended before {pattern!r}: {self.seen[-2000:]!r}"
                self.seen += chunk
        found, self.seen = self.seen[:match.end()], self.seen[match.end():]  # what follows is for the next expect
        return found

    def send(self, text: bytes):
        os.write(self.fd, text)

    def wait(self, timeout=30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if readable(self.fd, 0.2):
                try:
                    os.read(self.fd, 65536)
                except OSError:
                    pass
        os.kill(self.pid, 9)
        raise AssertionError("pyml-chat did not exit")


def test_two_turns_reset_and_ctrl_c_in_a_terminal(tmp_path):
    # wide enough that a 1500-token reply takes seconds: long enough to interrupt
    model = write_gpt2(tmp_path, "gpt2-tiny", n_positions=2048, n_embd=256, n_layer=4)
    term = Terminal([sys.executable, *CHAT[1:], "-m", str(model), "-n", "1500", "-t", "1"])
    interrupted = rb"\[prompt \d+ tokens([^\]]*) in[^\]]*generated (\d+) tokens[^\]]*\| interrupted\]"
    try:
        term.expect(rb"> ")
        term.send(b"hello\r")
        term.expect(rb"hello\r\n(?s:.){20}")  # the reply has started (sampled: it may begin with a newline)
        term.send(b"\x03")
        first = re.search(interrupted, term.expect(interrupted))
        assert int(first.group(2)) < 1500
        term.expect(rb"> ")  # the session goes on
        term.send(b"tell me more\r")
        # a whole 1500-token reply: seconds alone, minutes on a machine busy with other work
        second = term.expect(rb"\[prompt \d+ tokens \(\d+ cached\) in \d+ ms \| generated \d+ tokens")
        assert b"interrupted" not in second  # a whole reply, on the first turn's cache
        term.expect(rb"> ")
        term.send(b"/reset\r")
        term.expect(rb"conversation reset")
        term.send(b"hi again\r")
        term.expect(rb"hi again\r\n(?s:.){20}")
        term.send(b"\x03")
        third = re.search(interrupted, term.expect(interrupted))
        assert b"cached" not in third.group(1)  # /reset emptied the cache
        term.expect(rb"> ")
        term.send(b"/exit\r")
        assert term.wait() == 0
    finally:
        try:
            os.kill(term.pid, 9)
            os.waitpid(term.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(term.fd)
