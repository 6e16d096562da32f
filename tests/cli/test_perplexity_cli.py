"""pyml-perplexity: llama-perplexity's output (the running estimate, the last line), --json, the KL
divergence's base file and table, the plot, and bad input as one line with exit code 2."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyml import quant
from pyml.cli.pyml_perplexity import main
from pyml.cli.standins import write_gpt2
from pyml.nlp import perplexity as ppl
from pyml.nlp.api import load_model

ROOT = Path(__file__).resolve().parents[2]
FINAL = re.compile(r"^Final estimate: PPL = (\d+\.\d{4}) \+/- (\d+\.\d{5})$")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny", n_positions=512))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    # bytes are the tiny model's tokens: 600 of them, four chunks of 128 and a tail
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(12))[:600])
    return str(path)


def run(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(rc, err, *words):
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]


def test_the_last_line_is_llama_perplexitys(tiny, text_file):
    proc = subprocess.run([sys.executable, str(ROOT / "bin" / "pyml-perplexity"), "-m", tiny, "-f", text_file,
                           "-c", "128", "-t", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    final = FINAL.match(lines[-1])
    ref = ppl.perplexity(load_model(safetensors=tiny, threads=1), Path(text_file).read_text(), 128)
    assert final and float(final[1]) == pytest.approx(ref.estimate.ppl, abs=1e-4)
    assert float(final[2]) == pytest.approx(ref.estimate.err, abs=1e-5)
    assert lines[0] == "".join(f"[{i + 1}]{e.ppl:.4f}," for i, e in enumerate(ref.running))
    assert "calculating perplexity over 4 chunks, n_ctx=128" in proc.stderr


def test_only_the_prefill_is_warmed(tiny, text_file, capsys, monkeypatch):
    """Perplexity runs prompts' passes only: the warm-up before them is a prefill's (the kernels its
    passes load), never a decode step's, which would compile or load kernels nothing uses."""
    from pyml.nlp import api
    warmed = []
    real = api._warm_forward
    monkeypatch.setattr(api, "_warm_forward", lambda model, prefill: (warmed.append(prefill), real(model, prefill)))
    rc, out, err = run(capsys, "-m", tiny, "-f", text_file, "-c", "128", "--chunks", "1", "-t", "1")
    assert rc == 0, err
    assert warmed == [True]


def test_json_and_several_chunks_a_pass(tiny, text_file, capsys):
    rc, out, err = run(capsys, "-m", tiny, "-f", text_file, "-c", "128", "--chunks", "3", "-b", "256", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["chunks"] == 3 and doc["n_seq"] == 2 and doc["count"] == 3 * 63 and len(doc["running"]) == 3
    rc, out, _ = run(capsys, "-m", tiny, "-f", text_file, "-c", "128", "--chunks", "3", "--json")
    assert json.loads(out)["ppl"] == pytest.approx(doc["ppl"], rel=1e-5)


def test_activations_rounded_as_ggml(smollm2_gguf, text_file, capsys):
    """--activations ggml scores the same chunks with llama.cpp's activation rounding (how near that comes
    to llama.cpp's own figures is the peer test's): said in --json, a draw of its own near pyml's, the
    library's figure under quant.ggml_activations()."""
    args = ("-m", str(smollm2_gguf), "-f", text_file, "-c", "64", "--chunks", "2", "--json")
    rc, out, err = run(capsys, *args)
    assert rc == 0, err
    own = json.loads(out)
    rc, out, err = run(capsys, *args, "--activations", "ggml")
    assert rc == 0, err
    doc = json.loads(out)
    assert (own["activations"], doc["activations"]) == ("pyml", "ggml")
    assert doc["ppl"] != own["ppl"] and doc["ppl"] == pytest.approx(own["ppl"], rel=0.05)
    lm = load_model(gguf=str(smollm2_gguf), warmup=False, float_compute="f32")
    with quant.ggml_activations():
        got = ppl.perplexity(lm, Path(text_file).read_text(), 64, 2, seqs=doc["n_seq"]).estimate.ppl  # as batched
    assert got == pytest.approx(doc["ppl"], rel=1e-6)


def test_kl_divergence_of_a_model_from_itself(tiny, text_file, tmp_path, capsys):
    base = tmp_path / "base.npz"
    rc, out, err = run(capsys, "-m", tiny, "-f", text_file, "-c", "128", "--kl-divergence-base", str(base),
                       "--kl-top-k", "64")
    assert rc == 0 and base.exists(), err
    plain = FINAL.match(out.strip().splitlines()[-1])
    rc, out, err = run(capsys, "-m", tiny, "--kl-divergence-base", str(base), "--kl-divergence",
                       "--plot", str(tmp_path / "kld.png"))
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("chunk             PPL") and lines[-1] == plain[0]
    assert "====== KL divergence statistics ======" in lines and "Same top p: 100.000 ± 0.000 %" in lines
    mean = next(ln for ln in lines if ln.startswith("Mean    KLD:"))
    assert float(mean.split()[2]) < 1e-5  # the same model: nothing but the top-64 file's rounding
    assert (tmp_path / "kld.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_input_is_one_line(tiny, text_file, tmp_path, capsys):
    one_error(*run(capsys, "-m", tiny, "-f", str(tmp_path / "missing.txt"))[::2], "missing.txt")
    one_error(*run(capsys, "-m", tiny, "-f", text_file, "-c", "1024")[::2], "1024", "512 positions")
    one_error(*run(capsys, "-m", tiny, "-f", text_file, "-c", "400")[::2], "needs at least 800")
    one_error(*run(capsys, "-m", tiny, "-f", text_file, "-c", "128", "-b", "200")[::2], "multiple")
    one_error(*run(capsys, "-m", tiny, "-f", text_file, "--plot", "x.png")[::2], "--plot")
    one_error(*run(capsys, "-m", tiny, "--kl-divergence")[::2], "--kl-divergence-base")
    # --kl-top-k is what a saved base keeps: on a plain run, or a comparison (K read from the base), it was ignored
    one_error(*run(capsys, "-m", tiny, "-f", text_file, "--kl-top-k", "5")[::2], "--kl-top-k", "--kl-divergence-base")
    one_error(*run(capsys, "-m", tiny, "--kl-divergence-base", str(tmp_path / "b.npz"), "--kl-divergence",
                   "--kl-top-k", "5")[::2], "--kl-top-k")
    one_error(*run(capsys, "-m", tiny, "-f", text_file, "--activations", "ggml", "--float-compute", "bf16")[::2],
              "--activations ggml", "--float-compute bf16")
    one_error(*run(capsys, "-m", tiny, "--kl-divergence-base", str(tmp_path / "none.npz"), "--kl-divergence")[::2],
              "none.npz")
    one_error(*run(capsys, "-m", tiny, "-f", text_file, "--kl-divergence-base", str(tmp_path / "no" / "b.npz"))[::2],
              f"no folder {tmp_path / 'no'} to write it in")  # was said after the whole run
    one_error(*run(capsys, "-m", tiny, "-f", text_file, "--kl-divergence-base", str(tmp_path))[::2], "a folder")
    other = str(write_gpt2(tmp_path / "other", "gpt2-tiny", n_positions=512, vocab_size=600))
    base = tmp_path / "other.npz"
    assert run(capsys, "-m", other, "-f", text_file, "-c", "128", "--kl-divergence-base", str(base))[0] == 0
    one_error(*run(capsys, "-m", tiny, "--kl-divergence-base", str(base), "--kl-divergence")[::2],
              "another vocabulary")
