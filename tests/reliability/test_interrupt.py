"""Ctrl-C through the real pyml-infer process: during decode and during a long prefill.

Either way it stops at once, prints what was generated and the timing summary so far, and
exits 130. SIGINT is sent on an observed event (the first text on stdout; the first layer of
the prefill finishing, seen in the debug log), never after a sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from pyml.cli.standins import write_gpt2
from tests.cli.test_infer import ROOT, in_process


def _start(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    env.pop("LOG", None)
    # A runner started in the background by a non-interactive shell (`cmd &`) ignores SIGINT, and
    # children inherit that: Python would then never raise KeyboardInterrupt. Ctrl-C at a terminal
    # is what is tested, so the child starts with SIGINT's default disposition.
    return subprocess.Popen([sys.executable, str(ROOT / "bin" / "pyml-infer"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _drain(stream, sink: list, event: threading.Event | None = None, needle: bytes | None = None):
    """Read a pipe to the end (so the child never blocks on it), setting `event` when `needle` shows
    (no needle: when anything but whitespace shows)."""
    for chunk in iter(lambda: stream.read1(4096), b""):
        sink.append(chunk)
        seen = b"".join(sink)
        if event is not None and not event.is_set() and (needle in seen if needle else seen.strip()):
            event.set()


def _interrupt_when(proc, out_event, err_event):
    out, err = [], []
    readers = [threading.Thread(target=_drain, args=(proc.stdout, out, out_event), daemon=True),
               threading.Thread(target=_drain, args=(proc.stderr, err, err_event[0], err_event[1]), daemon=True)]
    for r in readers:
        r.start()
    seen = (out_event or err_event[0]).wait(timeout=300)
    assert seen, b"".join(err).decode(errors="replace")[-2000:]
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=120)
    for r in readers:
        r.join(timeout=10)
    return code, b"".join(out).decode(), b"".join(err).decode()


def test_ctrl_c_during_decode_prints_the_text_and_summary_so_far(smollm2_gguf):
    proc = _start("--gguf", str(smollm2_gguf), "--prompt", "Write a long story about a dragon.", "--chat",
                  "--max-tokens", "2000", "--threads", "2")
    first_text = threading.Event()
    code, out, err = _interrupt_when(proc, first_text, (None, None))
    summary = err.strip().splitlines()[-1]
    assert code == 130, err
    assert out.strip(), "the text generated before Ctrl-C is on stdout"
    assert "interrupted" in summary and "prefill" in summary and "ms/token" in summary, summary
    generated = int(summary.split("generated ")[1].split(" tokens")[0])
    assert 1 <= generated < 2000
    assert "Traceback" not in err


def test_ctrl_c_during_prefill_stops_before_the_first_token(smollm2_gguf):
    # ~7000 tokens: seconds of prefill after its first layer, on a fast CPU too (1,500 tokens were
    # 0.77 s on a Zen 5; on a CI machine whose other worker was compiling, the run once ended
    # before the signal arrived)
    prompt = "The quick brown fox jumps over the lazy dog. " * 700
    proc = _start("--gguf", str(smollm2_gguf), "--prompt", prompt, "--max-tokens", "5", "--no-warmup",
                  "--log", "debug,flat", "--threads", "2")
    # without warm-up the first layer to finish is the prefill's; in flat order its line is printed
    # from inside the pass, once it has run a second (in tree order, only when the pass ends)
    in_prefill = threading.Event()
    code, out, err = _interrupt_when(proc, None, (in_prefill, b"transformer[0]::forward"))
    summary = err.strip().splitlines()[-1]
    assert code == 130, err[-2000:]
    assert "generated 0 tokens" in summary and "interrupted" in summary, summary
    assert "generator::prefill" not in err  # the prefill span never completed
    assert "Traceback" not in err


def test_an_error_that_ctrl_c_caused_still_gives_the_summary_so_far(tmp_path, monkeypatch):
    """Ctrl-C inside a compile or a span's cleanup can surface as another exception whose cause or
    context is the KeyboardInterrupt: pyml-infer treats it as the interrupt it is (exit 130, the
    text and summary so far), where it used to end with a bare `pyml-infer: interrupted`."""
    from pyml.nlp.models.base import DecoderModel
    forward, calls = DecoderModel.forward, []

    def interrupted_on_the_third(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the prefill, one decode step, then Ctrl-C inside the second
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("a span's cleanup failed")  # its __context__: the interrupt
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DecoderModel, "forward", interrupted_on_the_third)
    tiny = write_gpt2(tmp_path, "gpt2-tiny", n_positions=32)
    proc = in_process("--safetensors", str(tiny), "-p", "Hello", "-n", "8", "--no-warmup")
    summary = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 130, proc.stderr
    assert "generated 2 tokens" in summary and summary.endswith("| interrupted]"), summary
