"""Aggregation over hand-made event streams whose answers are known (see streams.py)."""

import pytest

from pyml.report import aggregate
from pyml.report.aggregate import (ACT, ATTN_CORE, ATTN_PROJ, EMB, FFN, GLUE, HEAD, NORM,
                                   SAMPLE)
from pyml.report import findings, pages
from pyml.report.doc import render_md
from pyml.report.records import Run, normalize
from tests.report.streams import S, decode_step, emit, generation


def make_run(roots, info=None):
    recs, _ = normalize(emit(roots), main_thread=1)
    return Run(recs, info or {}, "hand-made", "events")


@pytest.fixture
def run():
    return make_run(generation(3))


def test_categories_of_a_decode_step(run):
    cats = aggregate.category_table(run.records, {"decode"})
    per_step = {k: v / 3 for k, v in cats.items()}
    assert per_step == pytest.approx({HEAD: 1.4, FFN: 1.2, ATTN_PROJ: 2.0, ATTN_CORE: 0.6,
                                      ACT: 0.2, NORM: 1.2, EMB: 0.8, SAMPLE: 0.5, GLUE: 2.1})
    assert sum(cats.values()) == pytest.approx(30.0)  # the three steps' durations, every µs counted once


def test_labels_and_calls(run):
    labels = aggregate.label_table(run.records, {"decode"})
    assert labels["matmul:attn.c_attn"]["ms"] == pytest.approx(3 * 2 * 0.6)
    assert labels["matmul:attn.c_attn"]["calls"] == 6
    assert labels["matmul:mlp.c_proj"]["category"] == aggregate.FFN  # not confused with attn.c_proj
    assert labels["matmul:attn.c_proj"]["category"] == aggregate.ATTN_PROJ
    assert labels["attention (other)"]["ms"] == pytest.approx(3 * 2 * 0.2)
    assert labels["generator (other)"]["ms"] == pytest.approx(3 * 0.5)
    by_layer = aggregate.label_table(run.records, {"decode"}, by_layer=True)
    assert by_layer["matmul:attn.c_attn:L1"]["ms"] == pytest.approx(3 * 0.6)
    assert "matmul:lm_head" in by_layer


def test_module_table_sums_to_total_and_per_call(run):
    mt = aggregate.module_table(run.records, aggregate.GENERATION)
    assert mt["total_ms"] == pytest.approx(20.0 + 30.0)
    assert sum(r["pct"] for r in mt["rows"]) == pytest.approx(100.0)
    rows = {r["module"]: r for r in mt["rows"]}
    head = rows["lm_head"]
    assert (head["type"], head["calls"], head["dtype"]) == ("Linear", 4, "F32")
    assert head["total_ms"] == pytest.approx(1.0 + 3 * 1.4)
    for r in mt["rows"]:
        assert r["per_call_ms"] == pytest.approx(r["total_ms"] / r["calls"])
    # softmax-like ops without a module count toward the module around them
    assert rows["transformer.h.0.attn"]["total_ms"] == pytest.approx(4 * (0.05 + 0.25 + 0.2))
    assert rows["(generator)"]["calls"] == 4 and rows["(generator)"]["type"] == "Generator"
    assert mt["rows"][0]["module"] in ("transformer.h.0", "transformer.h.1")  # the prefill's 5.3 ms of block glue


def test_timeline_and_components(run):
    tl = aggregate.timeline(run)
    assert tl["load_ms"] == 50.0 and tl["warmup_ms"] is None
    assert tl["prefill"]["tokens"] == 5 and tl["prefill_ms_per_token"] == pytest.approx(4.0)
    assert tl["decode_steps"] == 3 and tl["decode_mean_ms"] == pytest.approx(10.0)
    assert tl["decode_tok_s"] == pytest.approx(100.0) and tl["ttft_ms"] == 20.0
    comps = aggregate.components(aggregate.step_breakdowns(run))
    assert comps["layers"]["mean"] == pytest.approx(6.1) and comps["projection"]["pct"] == pytest.approx(14.5)
    assert comps["other"]["mean"] == pytest.approx(10.0 - (0.9 + 6.1 + 0.45 + 1.45 + 0.5))
    assert sum(comps[k]["pct"] for k in aggregate.COMPONENTS) == pytest.approx(100.0)


def test_layer_breakdown_groups_ops_under_attention_and_ffn(run):
    bd = aggregate.layer_breakdown(run, 1, "decode")
    assert bd["n"] == 3 and bd["total"] == pytest.approx(3.0) and bd["traced"]
    attn = dict(bd["sections"]["attn"]["rows"])
    assert set(attn) == {"layer_norm", "matmul:attn.c_attn", "kv_cache", "sdpa", "matmul:attn.c_proj",
                         "attention (other)"}
    assert bd["sections"]["attn"]["ms"] == pytest.approx(0.2 + 1.5)
    assert bd["sections"]["ffn"]["ms"] == pytest.approx(0.2 + 0.8)
    assert bd["sections"]["block"]["ms"] == pytest.approx(0.3)
    total = sum(s["ms"] for s in bd["sections"].values())
    assert total == pytest.approx(bd["total"])


def test_gemma_style_norms_follow_their_branch():
    """Pre-attn, post-attn, pre-FFN, post-FFN norms: the post-attention one belongs to attention."""
    b = S("transformer[0]::forward", 4.0, S("rms_norm", 0.1), S("attention::forward", 1.0, details="layer=0 sliding"),
          S("rms_norm", 0.2), S("rms_norm", 0.3), S("feed_forward", 1.0), S("rms_norm", 0.4),
          parts={"attn": 1.5, "ffn": 1.9})
    run = make_run([S("generator::decode_step", 5.0, S("model::forward", 4.5, b), phase="decode", step=1)])
    bd = aggregate.layer_breakdown(run, 0)
    assert dict(bd["sections"]["attn"]["rows"])["rms_norm"]["ms"] == pytest.approx(0.3)
    assert dict(bd["sections"]["ffn"]["rows"])["rms_norm"]["ms"] == pytest.approx(0.7)
    assert run.records[-3].kind == "sliding"


def test_attention_vs_ffn_per_phase(run):
    af = aggregate.attn_ffn_by_phase(run)
    assert af["decode"]["ratio"] == pytest.approx(1.1 / 1.8)
    assert af["prefill"]["attn"] == pytest.approx(5.0) and af["prefill"]["ffn"] == pytest.approx(2.5)
    assert af["decode"]["attn_pct"] == pytest.approx(100 * 1.8 / 2.9)


def test_debug_level_parts_become_pieces():
    """Without trace-level children, a block's attn/ffn parts and the forward's parts are still counted."""
    blk = [S(f"transformer[{i}]::forward", 3.0, parts={"attn": 1.8, "ffn": 1.1}) for i in range(2)]
    fwd = S("model::forward", 9.0, *blk, parts={"embedding": 0.9, "layers": 6.1, "norm": 0.45, "projection": 1.45})
    run = make_run([S("generator::decode_step", 10.0, fwd, parts={"model": 9.2, "sample": 0.5},
                      phase="decode", step=1)])
    cats = aggregate.category_table(run.records)
    assert cats[aggregate.ATTN_COARSE] == pytest.approx(3.6) and cats[aggregate.FFN_COARSE] == pytest.approx(2.2)
    assert cats[aggregate.HEAD] == pytest.approx(1.45) and cats[aggregate.EMB] == pytest.approx(0.9)
    assert sum(cats.values()) == pytest.approx(10.0)
    bd = aggregate.layer_breakdown(run, 0)
    assert not bd["traced"]


def test_matmul_bandwidth(run):
    rows = {r["label"]: r for r in aggregate.matmul_table(run)}
    head = rows["lm_head"]
    assert (head["in"], head["out"], head["dtype"], head["calls"]) == (64, 512, "F32", 3)
    assert head["gb_s"] == pytest.approx(64 * 512 * 4 / 1.4e-3 / 1e9)
    assert aggregate.bytes_per_weight("Q8_0") == pytest.approx(34 / 32)
    assert aggregate.bytes_per_weight("Q4_0") == pytest.approx(18 / 32)


def test_consistency_and_instrumentation_cost(run):
    timing = {"span_overhead_us": 3.0, "span_floor_us": 1.0}
    checks = {c["check"]: c for c in aggregate.consistency(run, timing)}
    layers = checks["layers part − Σ transformer[i]"]
    assert layers["gap_ms"] == pytest.approx(0.1) and layers["spans"] == 2
    assert layers["timing_ms"] == pytest.approx(2 * 2e-3)
    cost = aggregate.instrumentation_cost(run, timing)
    n_decode = sum(1 for r in run.records if r.phase == "decode") / 3
    assert cost["spans_per_step"] == n_decode and cost["ms_per_step"] == pytest.approx(n_decode * 3e-3)


def _blocks_compiled(roots):
    """The stream with each decode step's blocks, and all inside them, timed inside compiled code
    (as nn/fused.py's step records them): 12 spans a block, 24 of a step's 29."""
    def mark(s):
        s.fields["compiled"] = True
        for c in s.children:
            mark(c)
    for root in roots:
        if root.fields.get("phase") == "decode":
            for c in root.children[0].children:
                if c.name.startswith("transformer["):
                    mark(c)
    return roots


def test_spans_timed_in_compiled_code_are_charged_two_counter_reads():
    run = make_run(_blocks_compiled(generation(3)))
    timing = {"span_overhead_us": 3.0, "span_floor_us": 1.0, "compiled_clock_ns": 10.0}
    cost = aggregate.instrumentation_cost(run, timing)
    assert (cost["spans_per_step"], cost["compiled_per_step"]) == (29, 24)
    assert cost["ms_per_step"] == pytest.approx((5 * 3.0 + 24 * 0.020) / 1e3)
    checks = {c["check"]: c for c in aggregate.consistency(run, timing)}
    assert checks["layers part − Σ transformer[i]"]["timing_ms"] == pytest.approx(2 * 2e-5)
    assert checks["attention::forward − Σ its ops"]["timing_ms"] == pytest.approx(2 * 4 * 2e-5)
    assert checks["model part − model::forward"]["timing_ms"] == pytest.approx(2e-3)  # a Python span
    page = render_md(pages.report_page(run, timing=timing, timing_src="hand-made"))
    assert "records 29 spans (24 of them timed inside compiled code, 20 ns each)" in page


def test_bottlenecks_ranked_by_share_with_mitigations(run):
    items = findings.bottlenecks(run, {"span_overhead_us": 3.0, "span_floor_us": 1.0})
    shares = [i["share"] for i in items]
    assert shares == sorted(shares, reverse=True)
    assert items[0]["title"] == aggregate.GLUE and items[0]["share"] == pytest.approx(21.0)
    head = next(i for i in items if i["title"] == aggregate.HEAD)
    assert head["ms_per_step"] == pytest.approx(1.4)
    q8 = next(s for s in head["suggestions"] if s["changes"] == {"--lm-head-quant": "q8_0"})
    assert q8["gain_ms"] == pytest.approx(1.4 * (1 - (34 / 32) / 4))  # the bytes it stops reading, same GB/s
    assert q8["command"] is None  # the run's command is not known: the option alone
    attn = next(i for i in items if i["title"] == aggregate.ATTN_PROJ)
    assert any("already one matmul" in m for m in attn["mitigations"])
    quantize = next(m for m in attn["mitigations"] if m.startswith("Quantize the weights to Q8_0"))
    assert "3.8x fewer bytes" in quantize and "pyml-quantize reads GGUF files" in quantize  # a safetensors run


def test_cold_layer_and_first_step_are_findings():
    steps = [decode_step(1, layer_ms=3.0)] + [decode_step(i) for i in range(2, 5)]
    steps[0].dur = 30.0  # a slow first step
    blocks = [c for c in steps[1].children[0].children if c.name.startswith("transformer")]
    run = make_run(steps)
    titles = [i["title"] for i in findings.bottlenecks(run)]
    assert "slow first decode step" in titles
    v = findings.verdict(run)
    assert any("cold first step" in s for s in v["secondary"]) and v["potential"] in ("Medium", "High")
    assert blocks  # the stream has layers to look at


def test_verdict_head_bound():
    roots = [decode_step(i, head_ms=4.0) for i in range(1, 4)]
    for step in roots:  # room for a 4 ms head: 31% of a 13 ms step
        step.dur, step.children[0].dur = 13.0, 12.0
    run = make_run(roots)
    ranking = findings.bottlenecks(run)
    assert ranking[0]["title"] == aggregate.HEAD
    v = findings.verdict(run, ranking)
    assert v["primary"] == findings.first_bottleneck(ranking) == "output head (31% of decode time)"
    assert v["status"] == "lm_head projection is a significant overhead"


def test_a_quantized_linear_is_one_call():
    """linear::forward holds quant::matmul_f32_q4_0 with the same module: one call, one label, one row."""
    lin = S("linear::forward", 2.0, S("quant::matmul_f32_q4_0", 1.7, details="[1x64]x[256x64]",
                                      module="model.layers.0.mlp.up_proj"),
            details="[1, 64]->[64, 256] Q4_0", module="model.layers.0.mlp.up_proj")
    ffn = S("feed_forward", 2.5, lin, module="model.layers.0.mlp")
    blk = S("transformer[0]::forward", 3.0, ffn, parts={"attn": 0.0, "ffn": 2.8}, module="model.layers.0")
    run = make_run([S("generator::decode_step", 4.0, S("model::forward", 3.5, blk, module="model"),
                      phase="decode", step=1)])
    labels = aggregate.label_table(run.records)
    assert labels["matmul:mlp.up_proj"] == {"ms": pytest.approx(2.0), "calls": 1, "category": aggregate.FFN}
    rows = {r["module"]: r for r in aggregate.module_table(run.records)["rows"]}
    assert rows["model.layers.0.mlp.up_proj"]["calls"] == 1
    assert rows["model.layers.0.mlp.up_proj"]["dtype"] == "Q4_0"
    (mm,) = aggregate.matmul_table(run)
    assert mm["bytes"] == pytest.approx(64 * 256 * 18 / 32) and mm["calls"] == 1


def test_a_run_without_generation_is_tabled_whole():
    from pyml.report.pages import modules_page
    from pyml.report.doc import render_md
    run = make_run([S("model::forward", 5.0, S("linear::forward", 2.0, details="[3, 64]->[64, 512] F32",
                                               module="lm_head"), module="model")])
    assert aggregate.scope(run.records) is None
    mt = aggregate.module_table(run.records, aggregate.scope(run.records))
    assert mt["total_ms"] == pytest.approx(5.0) and mt["phases"] == "all"
    md = render_md(modules_page(run))
    assert "| lm_head | Linear F32 | 1 | 2.00 | 2.000 | 40.0 |" in md and "(no phase)" in md


def test_per_op_table_is_the_median_over_layers_and_steps_with_the_outlier_named():
    from tests.report.streams import block
    roots = []
    for k in range(1, 4):
        blocks = [block(i) for i in range(5)]
        blocks[3].dur += 6.0  # layer 3: 9 ms where the others take 3 (6 ms more of its own glue)
        roots.append(S("generator::decode_step", 23.0, S("model::forward", 22.0, *blocks, module="model"),
                       phase="decode", step=k))
    run = make_run(roots)
    med = aggregate.op_medians(run)
    assert (med["n"], med["layers"], med["steps"]) == (15, 5, 3) and med["total"] == pytest.approx(3.0)
    rows = {label: v for sec in med["sections"].values() for label, v in sec["rows"]}
    assert rows["matmul:attn.c_attn"]["ms"] == pytest.approx(0.6) and rows["matmul:attn.c_attn"]["blocks"] == 15
    assert rows["block (other)"]["ms"] == pytest.approx(0.3) and rows["block (other)"]["p90"] == pytest.approx(6.3)
    assert [(o["layer"], round(o["factor"], 3)) for o in med["outliers"]] == [(3, 3.0)]
    page = render_md(pages.report_page(run))
    assert "median over 5 layers × 3 steps" in page and "layer 3 9.00ms (3.0x)" in page
    assert "this layer took 3.0x" in render_md(pages.report_page(run, layer=3))  # asked for: said it is odd


def test_an_op_that_runs_in_some_layers_only_says_in_how_many():
    """A batched step's RoPE table is made once, in layer 0: its median is over that layer alone,
    which the table says rather than let it pass for every layer's cost."""
    from tests.report.streams import block
    roots = []
    for k in range(1, 4):
        blocks = [block(i) for i in range(5)]
        attention = blocks[0].children[1]
        attention.children = attention.children + (S("rope_table", 0.05, details="T=16 pairs=32"),)
        roots.append(S("generator::decode_step", 23.0, S("model::forward", 22.0, *blocks, module="model"),
                       phase="decode", step=k))
    page = render_md(pages.report_page(make_run(roots)))
    assert "| Attention: rope_table | T=16 pairs=32 (in 1 of 5 layers) |" in page
    assert "| Attention: matmul:attn.c_attn | [1, 64]->[64, 192] F32 |" in page  # every layer: nothing added


@pytest.mark.parametrize("compile_s, said", [(62.0, "| Warm-up | 210.0ms | **compiled 62.0 s** (a first run"),
                                             (0.01, "| Warm-up | 210.0ms | kernels from cache (compiling 0.01 s)"),
                                             (None, "| Warm-up | 210.0ms | kernels loaded or compiled")])
def test_the_warm_up_says_whether_it_compiled(compile_s, said):
    run = make_run([S("runtime::warmup", 210.0, phase="warmup")] + generation(2), {"compile_s": compile_s})
    assert said in render_md(pages.report_page(run))
