"""pyml-sweep on tiny shapes: the measurements are consistent, configurations that do not fit are skipped."""

import json

import numpy as np
import pytest

from pyml.cli import pyml_sweep


@pytest.fixture
def tiny_sizes(monkeypatch):
    monkeypatch.setattr(pyml_sweep, "SIZES", {"t1": (64, 256, 2, 4), "t2": (96, 384, 3, 4)})
    monkeypatch.setattr(pyml_sweep, "CONTEXTS", (8, 16, 32, 1024))


def test_shape_arithmetic():
    s = pyml_sweep.Shape("small", *pyml_sweep.SIZES["small"], vocab=50257)
    assert s.head_dim == 64
    assert 123e6 < s.params < 124e6  # GPT-2 small (124M) without its 0.8M position embeddings
    mm, sm = s.attention_flops(128)
    assert sm / mm == pytest.approx(pyml_sweep.SOFTMAX_FLOPS_PER_SCORE / (4 * s.head_dim))
    assert s.pass_bytes(1024) > s.pass_bytes(128)


def test_measure_one_configuration():
    shape = pyml_sweep.Shape("t", 64, 256, 2, 4, vocab=100)
    model = pyml_sweep.build_gpt2(shape, n_positions=16)
    assert model.blocks[1].attn.qkv.weight.shape == (192, 64)
    r = pyml_sweep.measure(model, shape, 16, passes=2, plain_passes=1, all_logits=False)
    assert r["config"] == "t_ctx16" and r["passes"] == 2
    assert r["op_ms"] + r["glue_ms"] == pytest.approx(r["forward_ms"], rel=1e-6, abs=1e-3)
    assert r["forward_ms"] <= r["python_ms"]
    assert r["matmul_pct"] + r["sdpa_pct"] + r["other_ops_pct"] + r["glue_pct"] == pytest.approx(100.0)
    top = {o["op"]: o for o in r["top_ops"]}
    assert top["matmul:attn.c_attn"]["count"] == 2  # once per layer per pass
    assert r["flop_ratio_pct"] == pytest.approx(100 * 5 / (4 * 16))
    assert r["sdpa_ms"] > 0 and r["sdpa_pct"] > 0 and r["sdpa_gflop_s"] > 0
    # the block shares are parts of the forward pass: none negative, together at most all of it
    parts = (r["attention_core_pct"], r["attention_proj_pct"], r["ffn_pct"])
    assert min(parts) > 0 and sum(parts) <= 100.0


def test_attention_share_answer_names_the_crossover():
    rows = [{"config": f"t_ctx{c}", "size": "t", "ctx": c, "attention_core_pct": a, "attention_proj_pct": 10.0,
             "ffn_pct": f} for c, a, f in [(128, 20.0, 60.0), (1024, 45.0, 40.0), (4096, 70.0, 20.0)]]
    text = "\n".join(pyml_sweep.attention_share_section(rows))
    assert "t: from 1024 tokens" in text
    text = "\n".join(pyml_sweep.attention_share_section(rows[:1]))
    assert "t: not up to 128 tokens (core 20% vs FFN 60% there)" in text


def test_sweep_command_skips_what_does_not_fit(tiny_sizes, monkeypatch, tmp_path, capsys):
    t1, t2 = (pyml_sweep.Shape(n, *pyml_sweep.SIZES[n], vocab=100) for n in ("t1", "t2"))
    # enough for everything but t2 at 1024 tokens
    limit = 1.2 * (t1.weight_bytes(1024) + t1.pass_bytes(1024)) + 1
    monkeypatch.setattr(pyml_sweep, "available_memory", lambda: int(limit))
    assert t2.weight_bytes(1024) + t2.pass_bytes(1024) > limit / 1.2
    code = pyml_sweep.main(["--sizes", "t1,t2", "--contexts", "8,1024", "--passes", "1", "--plain-passes", "0",
                       "--vocab", "100", "--out", str(tmp_path)])
    assert code == 0
    err = capsys.readouterr().err
    assert "pyml-sweep: skip t2 ctx=1024: needs ~" in err
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["config"] for r in data["results"]] == ["t1_ctx8", "t1_ctx1024", "t2_ctx8"]
    md = (tmp_path / "sweep.md").read_text()
    for heading in ("## (a) Forward pass time", "## (b) Top op", "## (c) Top 5 ops", "## (d) Matrix multiplication",
                    "## (e) Softmax vs matrix multiplication", "## (f) Attention against the feed-forward block"):
        assert heading in md
    assert (tmp_path / "attention_share.png").stat().st_size > 1000
    assert "t2 ctx=1024" in md


def test_sweep_rejects_unknown_sizes(capsys):
    with pytest.raises(SystemExit) as e:
        pyml_sweep.main(["--sizes", "huge"])
    assert e.value.code == 2 and "unknown size huge" in capsys.readouterr().err


def test_sweep_refuses_an_out_it_cannot_make_before_the_work(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    assert pyml_sweep.main(["--out", str(tmp_path / "a-file")]) == 2
    assert capsys.readouterr().err.strip() == (f"pyml-sweep: error: --out {tmp_path / 'a-file'}: "
                                               f"{tmp_path / 'a-file'} is a file, not a folder")


def test_an_address_without_ray_is_refused_by_name(tmp_path, capsys):
    """--address sets up Ray: without --ray the sweep ran here and ignored it."""
    assert pyml_sweep.main(["--address", "10.0.0.1:6379", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("pyml-sweep: error: --address without --ray is not implemented: it sets "
                                               "up Ray's workers (add --ray); this process runs the work itself")


def test_random_weights_are_float32_and_finite():
    model = pyml_sweep.build_gpt2(pyml_sweep.Shape("t", 32, 64, 1, 2, vocab=50), n_positions=8)
    logits = model.forward(np.arange(8), model.new_cache(8))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
