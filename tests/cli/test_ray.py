"""pyml-batch --ray and pyml-sweep --ray on a local Ray instance (2 CPUs) that this module starts
and always shuts down: the same greedy texts as one process, in input order; bad lines as error
lines; resuming; a killed worker's prompts retried on the other; the same sweep table."""

import json
import re

import pytest
import ray

from pyml.cli import pyml_batch, pyml_sweep, ray_runner
from pyml.cli.standins import write_gpt2
from pyml.report.chrome import validate_chrome_trace

PROMPTS = ["Hello there", "The capital of France is", "a", "0123456789 " * 4, "xyz", "Once upon a time",
           "What is 2 + 2?", "abc abc abc"]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             configure_logging=True, object_store_memory=100 * 2**20)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny")


@pytest.fixture(scope="module")
def batch_in(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    lines = [json.dumps({"id": f"p{i}", "prompt": p}) for i, p in enumerate(PROMPTS)]
    lines[3:3] = ['{"id": "bad", "prompt": ', json.dumps({"id": "long", "prompt": "x" * 300})]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def sequential(tiny, batch_in, tmp_path_factory):
    """The one-process batch's output lines (tests/cli/test_batch.py checks them against the library)."""
    out = tmp_path_factory.mktemp("seq") / "out.jsonl"
    assert pyml_batch.main([str(batch_in), "--out", str(out), "-m", str(tiny), "-n", "8", "-t", "1"]) == 1  # its two bad lines
    return read_output(out)


def read_output(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_timings(lines):
    return [{k: v for k, v in o.items() if k != "timings"} for o in lines]


@pytest.mark.deep  # Ray; the jobs its workers run: tests/cli/test_batch.py and test_sweep.py in-process
def test_two_workers_give_the_sequential_texts_in_input_order(local_ray, tiny, batch_in, sequential, tmp_path,
                                                               capsys):
    out, prof = tmp_path / "out.jsonl", tmp_path / "prof"
    assert pyml_batch.main([str(batch_in), "--out", str(out), "-m", str(tiny), "-n", "8", "--ray",
                            "--workers", "2", "--profile", str(prof)]) == 1
    got = read_output(out)
    assert without_timings(got) == without_timings(sequential)
    assert [o.get("id") for o in got] == ["p0", "p1", "p2", None, "long", "p3", "p4", "p5", "p6", "p7"]
    assert "not a JSON object" in got[3]["error"] and got[3]["line"] == 4
    assert got[4]["error"] == "the prompt is 300 tokens, longer than the model's context window of 128"
    err = capsys.readouterr().err
    assert "8 prompts done, 2 errors" in err and "Ray: 2 workers x 1 threads on 1 node" in err
    # one report over both workers: a row each, and one trace process each
    report = (prof / "report.md").read_text()
    assert "## Workers" in report and "| Generations | 8 |" in report
    workers = report.split("## Workers")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in workers.splitlines() if line.startswith(("| 1 ", "| 2 "))]
    assert len(rows) == 2 and sum(int(row[2]) for row in rows) == 8 and all(int(row[2]) for row in rows)
    trace = json.loads((prof / "trace.json").read_text())
    assert validate_chrome_trace(trace) > 0
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {2, 3}
    assert len(json.loads((prof / "run.json").read_text())["workers"]) == 2


@pytest.mark.deep  # Ray; the batched jobs: tests/cli/test_batch.py's --batch 3 in-process
def test_workers_that_batch_give_the_sequential_texts(local_ray, tiny, batch_in, sequential, tmp_path, capsys):
    """--ray --batch 3: each worker runs its share three sequences a step; the lines and texts are
    the one-process run's, in input order."""
    out = tmp_path / "out.jsonl"
    assert pyml_batch.main([str(batch_in), "--out", str(out), "-m", str(tiny), "-n", "8", "--ray",
                            "--workers", "2", "--batch", "3"]) == 1
    assert without_timings(read_output(out)) == without_timings(sequential)
    err = capsys.readouterr().err
    assert "8 prompts done, 2 errors" in err and "Ray: 2 workers x 1 threads on 1 node, 3 sequences a step each" in err


@pytest.mark.deep  # Ray; the jobs its workers run: tests/cli/test_batch.py and test_sweep.py in-process
def test_a_killed_workers_prompts_are_retried_on_the_other(local_ray, tiny, batch_in, sequential, tmp_path,
                                                           monkeypatch, capsys):
    killed = []

    def kill_the_first_to_answer(self, worker, reply):
        if not killed:  # it holds another prompt now, and gets more before its death is noticed
            killed.append(worker)
            ray.kill(self.actors[worker])

    monkeypatch.setattr(ray_runner.WorkerPool, "_received", kill_the_first_to_answer)
    out = tmp_path / "out.jsonl"
    assert pyml_batch.main([str(batch_in), "--out", str(out), "-m", str(tiny), "-n", "8", "--ray"]) == 1
    assert killed
    assert without_timings(read_output(out)) == without_timings(sequential)
    each = re.search(r"\((\d+), (\d+) prompts each\)", capsys.readouterr().err).groups()
    done = [int(n) for n in each]
    # the 8 prompts and the long one. The killed worker finished its first and, at most, the
    # IN_FLIGHT it held when ray.kill was sent (the kill lands asynchronously: a tiny model's
    # prompt can finish first); the rest ran on the other
    assert sum(done) == 9 and done[killed[0]] <= 1 + ray_runner.IN_FLIGHT


@pytest.mark.deep  # Ray; the jobs its workers run: tests/cli/test_batch.py and test_sweep.py in-process
def test_resume_on_ray_runs_only_what_is_missing(local_ray, tiny, batch_in, sequential, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    done = [o for o in sequential if o.get("id") in ("p0", "p4", "p7")]
    out.write_text("".join(json.dumps(o) + "\n" for o in done))
    assert pyml_batch.main([str(batch_in), "--out", str(out), "-m", str(tiny), "-n", "8", "--ray"]) == 1
    assert "5 prompts done, 2 errors, 3 already done" in capsys.readouterr().err
    got = read_output(out)
    assert got[:3] == done
    rest = [o for o in sequential if o.get("id") not in ("p0", "p4", "p7")]
    assert without_timings(got[3:]) == without_timings(rest)


@pytest.mark.deep  # Ray; OpenAI's batch format in-process: tests/cli/test_batch_openai.py
def test_openai_batch_lines_on_ray_give_the_one_process_replies(local_ray, tiny, tmp_path):
    """A file in OpenAI's batch format: the Ray workers write the same output lines as one process
    (ids and times apart), a refused line included."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}) for i, (url, body) in
                             enumerate([("/v1/completions", {"prompt": p, "max_tokens": 6}) for p in PROMPTS[:3]] +
                                       [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                        ("/v1/completions", {"prompt": "x", "n": 2})])) + "\n")

    def replies(*flags):
        out = tmp_path / f"out{len(flags)}.jsonl"
        assert pyml_batch.main([str(src), "--out", str(out), "-m", str(tiny), "-n", "8", "-t", "1", *flags]) == 1
        return [(o["custom_id"], o["response"]["status_code"],
                 {k: v for k, v in o["response"]["body"].items() if k not in ("id", "created", "timings")})
                for o in read_output(out)]

    alone, on_ray = replies(), replies("--ray", "--workers", "2")
    assert on_ray == alone and [status for _, status, _ in alone] == [200, 200, 200, 200, 400]


@pytest.mark.deep  # Ray; the jobs its workers run: tests/cli/test_batch.py and test_sweep.py in-process
def test_sweep_on_ray_gives_the_sequential_table(local_ray, monkeypatch, tmp_path):
    monkeypatch.setattr(pyml_sweep, "SIZES", {"t1": (64, 256, 2, 4), "t2": (96, 384, 3, 4)})
    monkeypatch.setattr(pyml_sweep, "CONTEXTS", (8, 16))
    common = ["--sizes", "t1,t2", "--contexts", "8,16", "--passes", "1", "--plain-passes", "0", "--vocab", "100",
              "-t", "1"]
    assert pyml_sweep.main(common + ["--out", str(tmp_path / "seq")]) == 0
    assert pyml_sweep.main(common + ["--out", str(tmp_path / "ray"), "--ray"]) == 0
    seq, par = (json.loads((tmp_path / d / "sweep.json").read_text()) for d in ("seq", "ray"))

    def table(data):  # everything but the timings
        return [(r["config"], r["size"], r["ctx"], r["passes"], r["flop_ratio_pct"],
                 sorted((o["op"], o["count"]) for o in r["top_ops"])) for r in data["results"]]

    assert table(par) == table(seq)
    assert [r["config"] for r in par["results"]] == ["t1_ctx8", "t1_ctx16", "t2_ctx8", "t2_ctx16"]
    assert par["skipped"] == seq["skipped"] == [] and par["meta"]["threads"] == 1
    md = (tmp_path / "ray" / "sweep.md").read_text()
    assert md.count("| t2_ctx16 |") == (tmp_path / "seq" / "sweep.md").read_text().count("| t2_ctx16 |")
