"""Every command a report suggests runs: pyml-infer --profile on real models, then each suggestion."""

import sys

import pytest

from pyml.cli.pyml_infer import main as infer_main
from pyml.cli.pyml_quantize import main as quantize_main
from pyml.cli.standins import write_gpt2
from pyml.report import findings, load_run
from tests import oracle_cache

RUNNERS = {"pyml-infer": infer_main, "pyml-quantize": quantize_main}


@pytest.fixture(params=["gpt2-standin", "smollm2-q4_1", "gemma3"])
def model(request, tmp_path_factory):
    if request.param == "gpt2-standin":  # float32 weights, an untied-size head worth quantizing
        return str(write_gpt2(tmp_path_factory.mktemp("gpt2"), "gpt2-tiny", n_embd=128, vocab_size=8192))
    return str(request.getfixturevalue("smollm2_gguf" if request.param.startswith("smollm2") else "gemma3_gguf"))


def _run(argv, monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", list(argv))  # as a shell would start it: run.json records this
    return RUNNERS[argv[0]](argv[1:])


def test_every_command_a_report_suggests_runs(model, tmp_path, monkeypatch, say):
    prof = tmp_path / "prof"
    # one thread of two: "use every core" is worth suggesting unless other processes hold the cores
    assert _run(["pyml-infer", "-m", model, "-p", "Hi", "-n", "3", "-t", "1", "--profile", str(prof)],
                monkeypatch) == 0
    run = load_run(prof)
    ranking = findings.bottlenecks(run, run.info.get("timing"))
    said = [s for item in ranking for s in item["suggestions"]]
    report = (prof / "report.md").read_text()
    head = run.info["model"]["lm_head"]["dtype"]
    for s in said:
        assert s["command"] and f"`{s['command']}`" in report and s["gain_ms"] is not None
        assert s["changes"].get("--threads") != 1  # never what the run used
        if "--lm-head-quant" in s["changes"]:
            assert head in ("F32", "F16", "BF16")  # pyml refuses it for a quantized head
    if head == "F32":  # the stand-in: its float head is always worth a look
        assert any("--lm-head-quant" in s["changes"] for s in said)
    _check_qkv_advice(model, report)
    # one run per distinct command: each bottleneck a wider core count helps suggests the same one
    commands = list(dict.fromkeys(tuple(argv) for s in said for argv in s["commands"]))
    for argv in commands:
        assert _run(argv, monkeypatch) == 0, argv
    say(f"{run.info['model']['name']}: {len(said)} suggestions, {len(commands)} distinct commands run: "
        + "; ".join(" ".join(argv) for argv in commands))


def _check_qkv_advice(model: str, report: str):
    """What the report says of Q, K and V, against the file's tensor types as gguf-py reads them (its
    table kept by oracle_cache: parsing Gemma's vocabulary first costs ~15 s a run): the
    layers where they differ (Gemma 3 Q4_K_M: Q5_0, Q5_0, Q8_0 in half its layers) cannot be one matmul."""
    if not model.endswith(".gguf"):
        return
    types = {t.name: t.tensor_type.name for t in oracle_cache.gguf_tensors(model).values()}
    n_layers = 1 + max(int(name.split(".")[1]) for name in types if name.startswith("blk."))
    mixed = [i for i in range(n_layers) if len({types[f"blk.{i}.attn_{p}.weight"] for p in "qkv"}) > 1]
    if mixed:
        assert f"Q, K and V stay three matmuls in {len(mixed)} of {n_layers} layers" in report
        assert "Fuse Q, K and V into one matmul" not in report
    else:
        assert "Q, K and V stay three matmuls" not in report
