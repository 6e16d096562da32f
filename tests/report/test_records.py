"""Loading records: events.jsonl and saved logs give the same records; bad input fails in one line."""

import json

import pytest

from pyml.core.errors import PymlError
from pyml.report.records import (EventsFormatError, LogFormatError, load_run, normalize,
                                     parse_log_line)
from tests.report.streams import S, emit, generation, to_log


def write_events(path, raws):
    recs, _ = normalize(raws, main_thread=1)
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in recs))
    return path


def test_normalize_links_tree_and_derives_fields():
    recs, orphans = normalize(emit(generation(2)), main_thread=1)
    assert orphans == 0
    by_name = {}
    for r in recs:
        by_name.setdefault(r.name, []).append(r)
    c_attn = [r for r in recs if r.module == "transformer.h.1.attn.c_attn" and r.phase == "decode"]
    assert len(c_attn) == 2
    q = c_attn[0]
    assert (q.op, q.layer, q.dtype, q.step, q.depth, q.thread) == ("linear", 1, "F32", 1, 4, 0)
    assert q.parent_rec.name == "attention::forward" and q.parent_rec.kind == "global"
    sdpa = next(r for r in recs if r.name == "attention::sdpa")
    assert sdpa.owner == "transformer.h.0.attn" and sdpa.module is None and sdpa.layer == 0
    block = next(r for r in recs if r.name == "transformer[1]::forward" and r.phase == "decode")
    assert block.kind == "global" and block.self_ms == pytest.approx(0.3)
    assert [r.phase for r in by_name["model::load"]] == ["load"]


def test_log_lines_parse_back():
    rec = parse_log_line("model::forward tokens=1 pos=7 embedding=0.066ms layers=1.085ms norm=0.040ms "
                         "projection=0.053ms total=1.249ms | model depth=1 start=2361.869871")
    assert rec == {"name": "model::forward", "details": "tokens=1 pos=7", "dur_ms": 1.249, "module": "model",
                   "depth": 1, "start": 2361.869871,
                   "parts": {"embedding": 0.066, "layers": 1.085, "norm": 0.04, "projection": 0.053}}
    rec = parse_log_line("linear::forward [1, 64]->[64, 192] F32 0.013ms | transformer.h.1.attn.c_attn depth=4 "
                         "start=1.000002 thread=77")
    assert (rec["details"], rec["module"], rec["thread"], rec["parts"]) == \
        ("[1, 64]->[64, 192] F32", "transformer.h.1.attn.c_attn", 77, {})
    assert parse_log_line("softmax [4, 1, 3] 0.020ms | depth=x start=1.0") is None
    assert parse_log_line("softmax [4, 1, 3] fast") is None


def test_log_and_events_give_identical_records(tmp_path):
    raws = emit(generation(3))
    events = write_events(tmp_path / "events.jsonl", raws)
    log = tmp_path / "run.log"
    log.write_text("debug: gpt2: layers=2 linears=9 types={'F32': 9} fusions=0\nHello world"
                   + to_log(raws) + "[prompt 5 tokens, generated 4 tokens | prefill 20.0 ms]\n")
    a, b = load_run(events), load_run(log)
    assert b.kind == "log" and b.info["model"]["describe"].startswith("gpt2")
    assert len(a.records) == len(b.records) == len(raws)
    assert [r.key() for r in a.records] == [r.key() for r in b.records]


def _as_tree(log_text: str, raws) -> str:
    """The lines of `to_log` (one per raw, flat: in end order) as pyml writes them in tree order:
    each top-level span's tree after it ends, parent first, indented two spaces a level."""
    line_of = dict(zip((r["id"] for r in raws), log_text.splitlines()))
    kids = {}
    for r in raws:
        kids.setdefault(r["parent"], []).append(r)
    out = []

    def visit(r, depth):
        out.append("[perf] " + "  " * depth + line_of[r["id"]][len("[perf] "):])
        for k in kids.get(r["id"], []):
            visit(k, depth + 1)
    for r in kids[None]:
        visit(r, 0)
    return "\n".join(out) + "\n"


def test_a_log_in_tree_order_gives_the_records_of_one_in_end_order(tmp_path):
    raws = emit(generation(3))
    for r in raws:
        if r["name"] == "attention::sdpa":
            r["compiled"] = True
    flat = to_log(raws)
    tree = _as_tree(flat, raws)
    assert tree != flat and "\n[perf]         linear::forward " in tree  # a projection at depth 4
    (tmp_path / "flat.log").write_text(flat)
    (tmp_path / "tree.log").write_text(tree)
    a, b, c = (load_run(write_events(tmp_path / "events.jsonl", raws)), load_run(tmp_path / "flat.log"),
               load_run(tmp_path / "tree.log"))
    assert [r.key() for r in a.records] == [r.key() for r in b.records] == [r.key() for r in c.records]
    assert [r.depth for r in a.records] == [r.depth for r in c.records]
    assert not c.notes


def test_a_tree_whose_parent_line_never_came_keeps_its_lines_as_orphans(tmp_path):
    raws = emit(generation(2))
    step2 = max(r["id"] for r in raws if r["name"] == "generator::decode_step")
    tree = _as_tree(to_log(raws), raws).splitlines()
    at = next(i for i, ln in enumerate(tree) if f"step=2" in ln and "depth=0" in ln)
    del tree[at]  # the step raised: its line never came, the lines inside it did
    (tmp_path / "run.log").write_text("\n".join(tree) + "\n")
    run = load_run(tmp_path / "run.log")
    assert sum(r.orphan for r in run.records) == sum(1 for r in raws if r["parent"] == step2)
    assert "belong to spans that never ended" in run.notes[0]
    assert len(run.named("generator::decode_step")) == 1


def test_log_and_events_agree_on_spans_timed_in_compiled_code(tmp_path):
    raws = emit(generation(2))
    for r in raws:
        if r["name"].startswith("transformer[") or r["name"] == "attention::sdpa":
            r["compiled"] = True  # as nn/fused.py's records say
    log = tmp_path / "run.log"
    log.write_text(to_log(raws))
    a, b = load_run(write_events(tmp_path / "events.jsonl", raws)), load_run(log)
    assert [r.key() for r in a.records] == [r.key() for r in b.records]
    assert [r.name for r in b.records if r.compiled] == [r["name"] for r in raws if r.get("compiled")]
    assert len([r for r in b.records if r.compiled]) == 12 and not b.named("model::forward")[0].compiled


def test_interrupted_span_leaves_orphans_as_top_level_events(tmp_path):
    raws = emit(generation(2))
    step2 = max(r["id"] for r in raws if r["name"] == "generator::decode_step")
    raws = [r for r in raws if r["id"] != step2]  # the step raised: its own record never came
    raws += emit([S("generator::prefill", 5.0, phase="prefill", step=0)], start=200.0)
    for r in raws[-1:]:
        r["id"] = 10 ** 5
    events = write_events(tmp_path / "events.jsonl", raws)
    log = tmp_path / "run.log"
    log.write_text(to_log(raws))
    a, b = load_run(events), load_run(log)
    assert [r.key() for r in a.records] == [r.key() for r in b.records]
    assert "1 events belong to spans that never ended" in a.notes[0] and b.notes == a.notes
    orphan = next(r for r in b.records if r.name == "model::forward" and r.parent_rec is None)
    assert orphan.phase is None and orphan.step is None  # a partial step stays out of the step tables


@pytest.mark.parametrize("text, message", [
    ('{"id": 1, "name": "x", "dur_ms": 1.0, "start": 0.0}\n{"id": 2, "name": \n', r"events.jsonl:2: not a JSON record"),
    ('{"id": 1, "name": "x", "dur_ms": 1.0, "start": 0.0}\n{"id": 2, "name": "y", "start": 0.0}\n',
     r"events.jsonl:2: record has no 'dur_ms' field"),
    ('{"id": 1, "name": "x", "dur_ms": 1.0, "start": 0.0}\n{"id": 2, "name": "x", "dur_ms": "fast", "start": 0.0}\n',
     r"events.jsonl:2: field 'dur_ms' has the wrong type"),
    # a first line that is no perf event: some other JSONL, said as such
    ('{"id": "req-1", "prompt": "Hello"}\n', r"events.jsonl: not a pyml profile: .*field 'id' has the wrong type"),
    ('{\n  "model": {}\n}\n', r"events.jsonl: not a pyml profile: .*not a JSON record"),
    ('{"id": 1, "name": "x", "dur_ms": 1.0, "start": 0.0}\n{"id": 2, "name": "y", "dur_ms": 1.0, "st',
     r"events.jsonl:2: truncated"),
    ('[1, 2]\n', r"events.jsonl: not a pyml profile: .*expected a JSON object"),
])
def test_bad_events_file_names_the_line(tmp_path, text, message):
    (tmp_path / "events.jsonl").write_text(text)
    with pytest.raises(EventsFormatError, match=message) as e:
        load_run(tmp_path)
    assert "\n" not in str(e.value) and isinstance(e.value, PymlError)


@pytest.mark.parametrize("info, message", [
    ("[1, 2]", r"run.json: not a run description \(a JSON list, not an object\)"),
    ('{"threads": "two"}', r'run.json: "threads" is a str, where pyml writes int'),
    ('{"threads": true}', r'run.json: "threads" is a bool, where pyml writes int'),
    ('{"read_bandwidth": 27.1}', r'run.json: "read_bandwidth" is a float, where pyml writes dict'),
    ('{"load_s": "1 s"}', r'run.json: "load_s" is a str, where pyml writes int or float'),
])
def test_a_run_json_of_other_types_than_pyml_writes_is_named(tmp_path, info, message):
    # these were AttributeError / TypeError from the report's sections ("internal error")
    (tmp_path / "events.jsonl").write_text('{"id": 1, "name": "x", "dur_ms": 1.0, "start": 0.0}\n')
    (tmp_path / "run.json").write_text(info)
    with pytest.raises(PymlError, match=message):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text('{"threads": 2, "warmup_s": null, "read_bandwidth": {"gb_s": 27.1}}')
    assert load_run(tmp_path).info["threads"] == 2


def test_bad_log_names_the_line(tmp_path):
    good = to_log(emit(generation(1))).splitlines()
    log = tmp_path / "run.log"
    log.write_text("\n".join(good[:3] + ["[perf] softmax [4, 1, 3] 0.0x2ms | depth=4 start=1.0"] + good[3:]) + "\n")
    with pytest.raises(LogFormatError, match=r"run.log:4: cannot read this \[perf\] line"):
        load_run(log)
    log.write_text("\n".join(good)[:-7])  # cut off mid-line
    with pytest.raises(LogFormatError, match=rf"run.log:{len(good)}: truncated"):
        load_run(log)
    log.write_text("[perf] softmax [4, 1, 3] 0.020ms\n" + good[0] + "\n")  # old and new lines mixed
    with pytest.raises(LogFormatError, match=r"run.log:2: this \[perf\] line has the ' \| depth= start=' context"):
        load_run(log)
    log.write_text("nothing here\n")
    with pytest.raises(LogFormatError, match="no \\[perf\\] lines"):
        load_run(log)


def test_a_binary_file_is_not_read_whole(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(10_000))
    with pytest.raises(PymlError, match=r"model.gguf: not a pyml profile or log: a binary file$"):
        load_run(model)


def test_missing_inputs(tmp_path):
    with pytest.raises(PymlError, match="no such file"):
        load_run(tmp_path / "nope")
    with pytest.raises(PymlError, match="not a profile directory"):
        load_run(tmp_path)


def test_a_log_from_before_the_context_tail_still_gives_its_tables(tmp_path):
    """Old lines (`[perf] name details elapsed`) are put back into their tree by pyml's span hierarchy."""
    from pyml.report import aggregate
    raws = emit(generation(3))
    events = write_events(tmp_path / "events.jsonl", raws)
    log = tmp_path / "old.log"
    log.write_text("".join(line.split(" | ")[0] + "\n" for line in to_log(raws).splitlines()))
    a, b = load_run(events), load_run(log)
    assert "predates" in b.notes[0]
    assert [(r.name, r.depth, r.phase, r.step, r.layer) for r in a.records] == \
        [(r.name, r.depth, r.phase, r.step, r.layer) for r in b.records]
    assert aggregate.step_breakdowns(a) == aggregate.step_breakdowns(b)
    for phase in ("prefill", "decode"):
        assert aggregate.category_table(a.records, {phase}) == aggregate.category_table(b.records, {phase})
    names = {r.module for r in b.records if r.op == "linear"}
    assert names == {"lm_head", "layers.0.attn.in0", "layers.0.attn.out", "layers.0.mlp.in0", "layers.0.mlp.out",
                     "layers.1.attn.in0", "layers.1.attn.out", "layers.1.mlp.in0", "layers.1.mlp.out"}
