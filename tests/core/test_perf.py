"""The [perf] events: format, nesting, consistency of the timings, and zero cost when off."""

import io
import logging
import re

import numpy as np
import pytest

import pyml
from pyml.core import perf
from pyml.cli.standins import write_gpt2

# `[perf] name [details] [parts] elapsed | [module] depth=N start=S [phase=P step=K] [thread=T]`, the name
# indented two spaces a level of depth in tree order (the default)
TAIL = r" \| (\S+ )?depth=\d+ start=\d+\.\d{6}( phase=\w+)?( step=\d+)?( thread=\d+)?( compiled=1)?$"
LINE = re.compile(r"^\[perf\] (?P<indent> *)\S+( .*)? (total=)?\d+\.\d{3}ms \| (\S+ )?depth=(?P<depth>\d+) "
                  r"start=\d+\.\d{6}( phase=\w+)?( step=\d+)?( thread=\d+)?( compiled=1)?$")
IND = r"(?:  )*"  # a tree line's indentation, in the patterns below


def well_formed(line: str, tree: bool = True) -> bool:
    """A [perf] line of the documented shape, indented by its depth in tree order (flat: not at all)."""
    m = LINE.match(line)
    return bool(m) and len(m.group("indent")) == (2 * int(m.group("depth")) if tree else 0)


def name_of(line: str) -> str:
    return line.split()[1]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    d = write_gpt2(tmp_path_factory.mktemp("gpt2"), "gpt2-tiny", n_layer=3)
    return pyml.load_model(safetensors=str(d), warmup=False)


@pytest.fixture
def log_to(request, every_step):
    """Configure levels from a spec; yield the stream the lines go to (written as each top-level
    span ends); restore afterwards."""
    stream = io.StringIO()

    def apply(spec):
        root = logging.getLogger("pyml")
        for h in list(root.handlers):
            root.removeHandler(h)
        perf.configure(spec, stream=stream)
        return stream

    yield apply
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("pyml"):
            logging.getLogger(name).setLevel(logging.NOTSET)
    perf.configure("")


def by_id(recs):
    return {r["id"]: r for r in recs}


def ancestors(rec, index):
    names = []
    while rec["parent"] is not None:
        rec = index[rec["parent"]]
        names.append(rec["name"])
    return names


def test_debug_lines(lm, log_to):
    stream = log_to("debug")
    lm.generate([1, 2, 3, 4, 5], max_tokens=3)
    lines = stream.getvalue().splitlines()
    assert all(well_formed(line) for line in lines), lines
    text = "\n".join(lines)
    assert re.search(r"^\[perf\] generator::prefill tokens=5 .*\d\.\d{3}ms" + TAIL, text, re.M)
    assert re.search(r"^\[perf\]   model::forward tokens=5 pos=0 embedding=\S+ms layers=\S+ms "
                     r"norm=\S+ms projection=\S+ms total=\S+ms" + TAIL, text, re.M)
    assert re.search(r"^\[perf\]     transformer\[0\]::forward attn=\S+ms ffn=\S+ms total=\S+ms" + TAIL, text, re.M)
    assert re.search(r"^\[perf\] generator::decode_step token=5 model=\S+ms sample=\S+ms total=\S+ms" + TAIL,
                     text, re.M)
    assert "linear::forward" not in text  # trace-level events stay out at debug


def test_trace_lines(lm, log_to):
    stream = log_to("trace")
    lm.generate([1, 2, 3], max_tokens=2)
    text = stream.getvalue()
    for pattern in [r"linear::forward \[1, 64\]->\[64, 192\] F32 \S+ms",
                    r"attention::sdpa q=\[3, 4, 16\] kv=\[4, 3, 16\] f16 tiled \S+ms",  # prefill
                    r"attention::sdpa q=\[4, 16\] kv=\[4, 4, 16\] f16 \S+ms",  # decode: one fused kernel
                    r"kv_cache::update layer=0 pos=3 f16 \S+ms",
                    r"embedding::lookup tokens=1 dim=64 F32 \S+ms",
                    r"layer_norm \[1, 64\] \S+ms",
                    r"attention::forward layer=2 global tokens=1 pos=3 \S+ms",
                    r"feed_forward \[1, 64\] mlp \S+ms"]:
        assert re.search(r"^\[perf\] " + IND + pattern + TAIL, text, re.M), pattern


def test_line_tail_carries_module_depth_start_and_root_phase(lm, log_to):
    stream = log_to("trace")
    lm.generate([1, 2, 3], max_tokens=2)
    lines = stream.getvalue().splitlines()
    assert all(well_formed(line) for line in lines), [x for x in lines if not well_formed(x)]
    text = "\n".join(lines)
    assert re.search(r"^\[perf\] {9}linear::forward .* \| transformer\.h\.0\.attn\.c_attn depth=4 start=\S+$",
                     text, re.M)
    assert re.search(r"^\[perf\] {5}linear::forward .* \| lm_head depth=2 start=\S+$", text, re.M)
    assert re.search(r"^\[perf\] {3}model::forward .* \| model depth=1 start=\S+$", text, re.M)
    assert re.search(r"^\[perf\] generator::prefill .* \| depth=0 start=\S+ phase=prefill step=0$", text, re.M)
    assert re.search(r"^\[perf\] generator::decode_step .* \| depth=0 start=\S+ phase=decode step=1$",
                     text, re.M)
    # only top-level lines carry the phase: the rest inherit it from their tree
    assert not re.search(r"depth=[1-9]\d* .*phase=", text)


def test_per_logger_filters(log_to):
    log_to("pyml.nn=trace,pyml=debug")
    assert perf.get("pyml.nn.linear").trace_on
    assert not perf.get("pyml.core.ops").trace_on
    assert perf.get("pyml.core.ops").debug_on
    with pytest.raises(pyml.PymlError, match="unknown log level"):
        perf.configure("pyml=loud")


def test_records_nest_decode_step_model_layer_attention_linear(lm, records):
    lm.generate([1, 2, 3], max_tokens=3)
    index = by_id(records)
    q = [r for r in records if r["name"] == "linear::forward" and r.get("module", "").endswith("c_attn")
         and r["phase"] == "decode"]
    assert q
    assert ancestors(q[0], index)[:4] == ["attention::forward", "transformer[0]::forward", "model::forward",
                                         "generator::decode_step"]
    steps = [r for r in records if r["name"] == "generator::decode_step"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["phase"] == "decode" for r in steps)


def test_layer_times_sum_to_at_most_forward_and_ops_to_at_most_layer(lm, records):
    lm.generate(list(range(1, 9)), max_tokens=4)
    index = by_id(records)
    children = {}
    for r in records:
        children.setdefault(r["parent"], []).append(r)
    forwards = [r for r in records if r["name"] == "model::forward"]
    assert len(forwards) == 4
    for fwd in forwards:
        layers = [c for c in children[fwd["id"]] if c["name"].startswith("transformer[")]
        assert len(layers) == 3
        assert sum(c["dur_ms"] for c in layers) <= fwd["dur_ms"]
        assert sum(c["dur_ms"] for c in layers) <= fwd["parts"]["layers"] + 1e-9
        assert sum(fwd["parts"].values()) <= fwd["dur_ms"]
        for layer in layers:
            ops = children.get(layer["id"], [])
            assert ops, "trace ops inside each layer"
            assert sum(o["dur_ms"] for o in ops) <= layer["dur_ms"]
            assert sum(layer["parts"].values()) <= layer["dur_ms"]
    assert index  # records were collected at trace level


def test_logging_off_reads_no_clock_on_the_hot_path(lm, monkeypatch):
    perf.configure("")
    calls = []
    real = perf.clock
    monkeypatch.setattr(perf, "clock", lambda: calls.append(1) or real())
    cache = lm.new_cache(8)
    lm.model.forward([1, 2, 3], cache)
    for b in lm.model.blocks:  # event buffers left from earlier traced steps, emptied
        if b._fused is not None:
            b._fused.events.events[:] = 0
    lm.model.forward([4], cache)
    assert calls == []
    # the decode step ran as fused kernels, told not to time: no counter read, so no event written
    fused = [b._fused for b in lm.model.blocks]
    assert all(f is not None and not f.events.events.any() for f in fused)
    # and the same forward at debug level does read it (the counter works)
    seen = []
    perf.add_collector(seen.append, level=logging.DEBUG)
    try:
        lm.model.forward([5], cache)
    finally:
        perf.remove_collector(seen.append)
    assert len(calls) > 0 and seen
    # and at debug the fused kernels time the block's parts from inside
    blocks = [r for r in seen if r["name"].startswith("transformer[")]
    assert len(blocks) == 3 and all(set(r["parts"]) == {"attn", "ffn"} for r in blocks)


def test_collector_sees_attributes(lm, records):
    lm.generate([1, 2], max_tokens=2)
    lin = [r for r in records if r["name"] == "linear::forward"]
    assert {"module", "dtype", "phase", "step", "dur_ms", "parent", "start"} <= set(lin[0])
    assert lin[0]["dtype"] == "F32"
    blocks = [r for r in records if r["name"].startswith("transformer[")]
    assert sorted({r["layer"] for r in blocks}) == [0, 1, 2]
    assert np.isfinite([r["dur_ms"] for r in records]).all()


def test_direct_lines_keep_their_order_with_other_records(log_to):
    """[perf] lines skip LogRecord; they are held until a top-level span ends (or 50 ms pass),
    and in flat order a plain log message first writes what is held: the text reads in end order."""
    stream = log_to("trace,flat")
    outer, inner = perf.get("pyml.test.outer"), perf.get("pyml.test.inner")
    assert outer.direct is not None  # the fast path is the one under test
    with outer.debug("outer::step"):
        with inner.trace("inner::op", "a"):
            pass
        assert "inner::op" not in stream.getvalue()  # held: one write per step, not per op
        logging.getLogger("pyml.test").debug("a plain message")
        with inner.trace("inner::op", "b"):
            pass
    names = [name_of(ln) if ln.startswith("[perf]") else ln for ln in stream.getvalue().splitlines()]
    assert names == ["inner::op", "debug: a plain message", "inner::op", "outer::step"]


def test_tree_order_writes_a_step_whole_after_it_ends_parent_first(log_to):
    """In tree order a plain message inside a step comes before the step's lines: they wait for
    the step to end, then come parent first, each indented by its depth."""
    stream = log_to("trace")
    outer, inner = perf.get("pyml.test.outer"), perf.get("pyml.test.inner")
    with outer.debug("outer::step"):
        with inner.trace("inner::op", "a"):
            with inner.trace("inner::leaf"):
                pass
        logging.getLogger("pyml.test").debug("a plain message")
        with inner.trace("inner::op", "b"):
            pass
    lines = stream.getvalue().splitlines()
    assert [ln.split(" | ")[0].rsplit(" ", 1)[0] if ln.startswith("[perf]") else ln for ln in lines] == [
        "debug: a plain message", "[perf] outer::step", "[perf]   inner::op a", "[perf]     inner::leaf",
        "[perf]   inner::op b"]


def _preorder_of(records):
    """The records' trees, each parent before its children, siblings by start: the oracle of the
    tree order, from the parent ids the collector was given."""
    kids = {}
    for r in records:
        kids.setdefault(r["parent"], []).append(r)
    out = []

    def visit(r):
        out.append(r)
        for k in sorted(kids.get(r["id"], []), key=lambda k: k["start"]):
            visit(k)
    for r in sorted(kids.get(None, []), key=lambda r: r["start"]):
        visit(r)
    return out


@pytest.mark.parametrize("spec", ["trace", "debug", "trace,flat"])
def test_lines_follow_the_records_tree_or_their_end_order(lm, log_to, records, spec):
    """Every line is a record's (name and start), in the records' tree order, parent first, or in
    flat order as the records came (end order)."""
    stream = log_to(spec)
    lm.generate([1, 2, 3], max_tokens=3)
    lines = stream.getvalue().splitlines()
    assert all(well_formed(ln, tree="flat" not in spec) for ln in lines), lines
    shown = [r for r in records if r["level"] == "trace" and spec.startswith("trace") or r["level"] == "debug"]
    expected = shown if "flat" in spec else _preorder_of(shown)
    got = [(name_of(ln), re.search(r" start=(\S+)", ln).group(1)) for ln in lines]
    assert got == [(r["name"], f"{r['start']:.6f}") for r in expected]
    assert len(got) > 10


def test_warmup_lines_are_shown_only_when_asked(tmp_path, log_to, records):
    """Warm-up passes make records either way; their lines come with `warmup` in the spec."""
    d = write_gpt2(tmp_path, "gpt2-tiny", n_layer=2)
    for spec, shown in (("trace", False), ("trace,warmup", True), ("debug,warmup,flat", True)):
        stream = log_to(spec)
        records.clear()
        pyml.load_model(safetensors=str(d), warmup=True)
        perf.flush()
        warm = [r for r in records if r["phase"] == "warmup"]
        assert any(r["name"] == "runtime::warmup" for r in warm)
        text = stream.getvalue()
        assert ("phase=warmup" in text) == shown, spec
        assert "model::load" in text
        if shown:  # every warm-up record at the level printed has its line
            level = "debug" if spec.startswith("debug") else "trace"
            n = sum(r["level"] == "debug" or level == "trace" for r in warm)
            assert sum(f" start={r['start']:.6f}" in text for r in warm
                       if r["level"] == "debug" or level == "trace") == n


def test_a_spec_option_that_is_not_one_is_refused(log_to):
    with pytest.raises(pyml.PymlError, match="unknown log level 'wormup'.*warmup, flat"):
        log_to("trace,wormup")


def test_a_foreign_handler_gets_every_line(log_to):
    """With another handler on a pyml logger, lines go through logging as before."""
    log_to("trace")
    extra = io.StringIO()
    handler = logging.StreamHandler(extra)
    logging.getLogger("pyml.test.inner").addHandler(handler)
    try:
        perf.refresh()
        inner = perf.get("pyml.test.inner")
        assert inner.direct is None
        with inner.trace("inner::op", "c"):
            pass
        assert "inner::op c" in extra.getvalue()
    finally:
        logging.getLogger("pyml.test.inner").removeHandler(handler)
        perf.refresh()


def test_spans_wait_for_their_step_and_flush_delivers_them(records):
    """Ended spans are held until the top-level span ends (then records and lines are made in
    one pass, outside the step's measured time); perf.flush() delivers them early."""
    outer, inner = perf.get("pyml.test.outer"), perf.get("pyml.test.inner")
    with outer.debug("outer::step"):
        with inner.trace("inner::op", "n={}", 1, layer=3):
            pass
        assert records == []
        perf.flush()
        assert [r["name"] for r in records] == ["inner::op"]
        assert records[0]["layer"] == 3 and records[0]["details"] == "n=1"
    assert [r["name"] for r in records] == ["inner::op", "outer::step"]
    assert records[0]["parent"] == records[1]["id"]


def test_records_keep_the_phase_they_ended_in(records):
    """A record made after its context has changed still carries the phase and step it ran in."""
    inner = perf.get("pyml.test.inner")
    outer = perf.get("pyml.test.outer")
    with outer.debug("outer::run"):
        for step in (1, 2):
            with perf.context(phase="decode", step=step), inner.trace("inner::op"):
                pass
    assert [(r["phase"], r["step"]) for r in records if r["name"] == "inner::op"] == [("decode", 1),
                                                                                     ("decode", 2)]


def test_details_are_formatted_from_their_arguments_each_time(records):
    """Memoised details still follow their arguments (positions change every step)."""
    inner = perf.get("pyml.test.inner")
    for pos in (3, 4, 3):
        with inner.trace("inner::op", "{} pos={}", (1, 64), pos):
            pass
    unhashable = [1, 2]
    with inner.trace("inner::op", "{}", unhashable):
        pass
    assert [r["details"] for r in records] == ["[1, 64] pos=3", "[1, 64] pos=4", "[1, 64] pos=3", "[1, 2]"]


def test_records_and_lines_are_made_after_the_steps_and_all_come_when_the_generation_ends(lm, lines_at):
    """With the default pause between batches, a step's spans (the fused blocks' tick events
    too) are not made while the generation runs; when it ends every line is there, in order."""
    with lines_at("trace") as stream:
        perf._drained_at[0] = perf.clock()  # a batch just went out: the next one is a second away
        it = lm.stream([1, 2, 3], max_tokens=4)
        next(it)
        next(it)  # the prefill and one decode step are done
        held = stream.getvalue()
        assert perf._pending and "generator::decode_step" not in held
        for _ in it:
            pass
        lines = stream.getvalue().splitlines()
    assert all(well_formed(line) for line in lines), lines
    steps = [ln for ln in lines if ln.startswith("[perf] generator::decode_step")]
    assert len(steps) == 3 and not perf._pending
    assert sum(name_of(ln).startswith("transformer[") for ln in lines) == 3 * 4  # 3 layers x 4 passes
    # a step after another: each top-level span's tree, whole, after the one before
    starts = [float(re.search(r"start=(\d+\.\d+)", ln).group(1)) for ln in lines if "depth=0" in ln]
    assert starts == sorted(starts)


def test_an_interrupted_generation_still_writes_every_line_it_made(lm, lines_at):
    with lines_at("debug") as stream:
        perf._drained_at[0] = perf.clock()
        it = lm.stream([1, 2, 3], max_tokens=8)
        next(it)
        next(it)
        next(it)
        it.close()  # as a consumer that stops reading (Ctrl-C reaches the same finally)
        lines = stream.getvalue().splitlines()
    steps = sum(name_of(ln) == "generator::decode_step" for ln in lines)
    assert steps >= 2 and sum(name_of(ln) == "generator::prefill" for ln in lines) == 1
    assert sum(name_of(ln).startswith("transformer[") for ln in lines) == 3 * (1 + steps)  # every pass's blocks


def test_traced_blocks_outlive_their_event_buffer(lm, records, monkeypatch):
    """More traced steps than a block's event buffer holds: a full buffer is replaced, and the
    records still waiting read the old one; every step gets all its ops."""
    monkeypatch.setattr(perf, "LONG_PASS_S", 1e9)  # however slow the machine: one pass, no drain inside
    cache = lm.new_cache(100)
    lm.model.forward([1, 2, 3], cache)
    records.clear()
    fused = lm.model.blocks[0]._fused
    before = fused.events.events
    with perf.context(phase="decode"):
        with perf.get("pyml.test.outer").debug("outer::run"):  # one top-level span: nothing drained
            for pos in range(3, 3 + 70):
                lm.model.forward([5], cache, pos=pos)
            assert not records
    assert fused.events.events is not before  # 64 steps' worth, replaced once
    per_layer = [r for r in records if r["name"] == "linear::forward" and r["module"].startswith(fused.block.name + ".")]
    assert len(per_layer) == 70 * 4  # qkv, o_proj, up, down of every step
    assert all(r["dur_ms"] >= 0 for r in records)


def test_the_drains_are_kept_out_of_the_engine_figures_and_counted_apart(lm, records, lines_at, monkeypatch):
    """A drain that a step's end sets off (made slow here: 0.5 s more each) is not in the step's
    decode time, which stays near the step's own span (a loaded machine may pause the process in
    between), and is in the logging cost."""
    slow, real = 0.5, perf._write

    def write(items):  # the lines' write, inside each drain
        t0 = perf.clock()
        while perf.clock() - t0 < slow:  # busy, as making lines is
            pass
        real(items)
    monkeypatch.setattr(perf, "_write", write)
    monkeypatch.setattr(perf, "LONG_PASS_S", 1e9)  # a slow first prefill (compiling) drains after it, not inside
    with lines_at("trace"):
        result = lm.generate([1, 2, 3], max_tokens=4)
    steps = [r["dur_ms"] / 1e3 for r in records if r["name"] == "generator::decode_step"]
    prefill = next(r["dur_ms"] / 1e3 for r in records if r["name"] == "generator::prefill")
    assert len(result.decode_s) == len(steps) == 3
    for took, span in zip(result.decode_s, steps):
        assert span <= took + 1e-4 and took < span + slow / 2
    assert prefill <= result.prefill_s + 1e-4 and result.prefill_s < prefill + slow / 2
    # each step's end drained (DRAIN_EVERY_S is 0 here) and the prefill's: the last flush found nothing
    assert result.decode_log_s >= 3 * slow and result.prefill_log_s >= slow
    assert result.log_ms_per_token == pytest.approx(result.decode_log_s / 3 * 1e3)


def test_without_logging_nothing_is_counted_as_its_cost(lm):
    perf.configure("")
    result = lm.generate([1, 2, 3], max_tokens=3)
    assert result.decode_log_s == result.prefill_log_s == 0.0 and len(result.decode_s) == 2
