"""Records made in other processes (pyml-batch --ray's workers) merged into one profile: each keeps
its worker, the report gets a row per worker, the trace a process per worker."""

import json

import pytest

import pyml
from pyml.cli.standins import write_gpt2
from pyml.core import perf
from pyml.report import load_run, write_reports
from pyml.report.capture import profile
from pyml.report.chrome import validate_chrome_trace
from pyml.report.records import EventsFormatError, normalize


@pytest.fixture(scope="module")
def worker_records(tmp_path_factory):
    """Two generations' records as a worker ships them (normalized, to_json), from one model."""
    checkpoint = write_gpt2(tmp_path_factory.mktemp("gpt2"), "gpt2-tiny")
    lm = pyml.load_model(safetensors=str(checkpoint), threads=1)
    shipped = []
    for prompt, n in (([1, 2, 3], 4), ([4, 5, 6, 7, 8], 6)):
        raws = []
        perf.add_collector(raws.append, level=perf.TRACE)
        try:
            lm.generate(prompt, max_tokens=n)
        finally:
            perf.remove_collector(raws.append)
        shipped.append([r.to_json() for r in normalize(raws)[0]])
    return shipped


def test_each_worker_keeps_its_records_apart(worker_records, tmp_path):
    with profile(tmp_path, argv=["test"]) as prof:
        prof.add_records(worker_records[0], worker=1)
        prof.add_records(worker_records[1], worker=2, clock_shift=0.5)
    run = load_run(tmp_path)
    assert len(run.records) == sum(len(w) for w in worker_records)
    assert {r.worker for r in run.records} == {1, 2}
    # the same span ids in both workers (one process's counter) stay two trees
    assert all(r.parent_rec is None or r.parent_rec.worker == r.worker for r in run.records)
    firsts = [min(r.start for r in run.records if r.worker == w) for w in (1, 2)]
    assert firsts[1] - firsts[0] == pytest.approx(0.5 + worker_records[1][0]["start"] - worker_records[0][0]["start"],
                                                  abs=0.2)
    write_reports(run, tmp_path, plots=False)
    report = (tmp_path / "report.md").read_text()
    rows = [line.split(" | ") for line in report.split("## Workers")[1].split("\n## ")[0].splitlines()
            if line.startswith(("| 1 ", "| 2 "))]
    assert [(row[0], row[2], row[5]) for row in rows] == [("| 1", "1", "3"), ("| 2", "1", "5")]  # decode steps
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert validate_chrome_trace(trace) == len(run.records)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names) == [2, 3] and names[2].startswith("pyml worker 1")


def test_one_process_has_no_workers_table(worker_records, tmp_path):
    with profile(tmp_path, argv=["test"]) as prof:
        prof.add_records(worker_records[0], worker=0)
    write_reports(load_run(tmp_path), tmp_path, plots=False)
    assert "## Workers" not in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("bad", ['"1"', "-1", "true", "1.5"])
def test_a_bad_worker_field_is_one_line(tmp_path, bad):
    (tmp_path / "events.jsonl").write_text(f'{{"id": 1, "name": "x", "dur_ms": 1.0, "start": 0.0, "worker": {bad}}}\n')
    with pytest.raises(EventsFormatError, match="events.jsonl:1: field 'worker' must be a non-negative integer"):
        load_run(tmp_path)
