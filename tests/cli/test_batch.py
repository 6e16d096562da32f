"""pyml-batch in one process: input lines to output lines in input order, bad lines as error lines,
per-line overrides, resuming, --profile, and --ray without Ray installed."""

import json
import re
import socket
import stat
import subprocess
import sys

import pytest

from pyml.cli import pyml_batch
from pyml.cli.batch_jobs import id_key, parse_line, resume
from pyml.cli.standins import write_gpt2
from pyml.core.errors import PymlError
from pyml.nlp.api import load_model

PROMPTS = {"a": "Hello there", "b": "The capital of France is", 3: "xyz", "d": "0123456789 " * 3}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A GPT-2 layout with random weights, a byte tokenizer and a 128-token window."""
    return write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny")


@pytest.fixture(scope="module")
def tiny_lm(tiny):
    return load_model(str(tiny), threads=1)


def write_input(path, extra=()):
    lines = [json.dumps({"id": k, "prompt": v}) for k, v in PROMPTS.items()]
    lines[2:2] = extra
    path.write_text("\n".join(lines) + "\n")
    return path


def read_output(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("line, message", [
    ("{not json", "not a JSON object"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"prompt": "x"}', 'no "id"'),
    ('{"id": null, "prompt": "x"}', 'no "id"'),
    ('{"id": 1}', 'exactly one of "prompt"'),
    ('{"id": 1, "prompt": "x", "messages": []}', 'exactly one of "prompt"'),
    ('{"id": 1, "prompt": 5}', '"prompt" must be a string'),
    ('{"id": 1, "messages": [{"role": "user"}]}', '"messages" must be a non-empty list'),
    ('{"id": 1, "prompt": "x", "temp": 0.5}', "unknown field temp"),
    ('{"id": 1, "prompt": "x", "max_tokens": "8"}', '"max_tokens" has the wrong type (str)'),
    ('{"id": 1, "prompt": "x", "max_tokens": true}', '"max_tokens" has the wrong type (bool)'),
    ('{"id": 1, "prompt": "x", "stop": ["a", 1]}', '"stop" must be a list of strings'),
    ('{"id": 1, "prompt": "x", "max_tokens": -1}', '"max_tokens" must be >= 0, got -1'),
    # the sampling fields are named as the line names them too, not as the flags are spelt
    ('{"id": 1, "prompt": "x", "temperature": -1}', '^"temperature" must be >= 0 and finite, got -1'),
    ('{"id": 1, "prompt": "x", "top_p": 2}', '^"top_p" must be in (0, 1], got 2'),
    ('{"id": 1, "prompt": "x", "top_k": -3}', '^"top_k" must be >= 0, got -3'),
    ('{"id": 1, "prompt": "x", "min_p": 1.5}', '^"min_p" must be in [0, 1], got 1.5'),
    ('{"id": 1, "prompt": "x", "repetition_penalty": 0}', '^"repetition_penalty" must be > 0 and finite, got 0'),
    ('{"id": 1, "prompt": "x", "seed": -1}', '^"seed" must be an integer >= 0, got -1'),
])
def test_a_bad_line_says_what_is_wrong(line, message):
    with pytest.raises(PymlError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_line(line, 1, {"max_tokens": 4})


def test_overrides_replace_the_flags_for_their_line():
    job = parse_line('{"id": "x", "prompt": "p", "max_tokens": 3, "temperature": 0.5, "stop": ["."], '
                     '"system": "Be brief."}', 7, {"max_tokens": 16, "temperature": 0.0, "stop": []})
    assert (job.id, job.line, job.prompt, job.system) == ("x", 7, "p", "Be brief.")
    assert job.options == {"max_tokens": 3, "temperature": 0.5, "stop": ["."]}


@pytest.mark.parametrize("batch", [1, 3])
def test_batch_writes_every_line_in_input_order(tiny, tiny_lm, tmp_path, capsys, batch):
    """One prompt at a time, or three sequences a step (--batch 3): the same lines, the same texts."""
    src = write_input(tmp_path / "in.jsonl", extra=[
        "{broken", json.dumps({"id": "long", "prompt": "x" * 200}), json.dumps({"id": "a", "prompt": "again"}),
        json.dumps({"id": "short", "prompt": "Hello there", "max_tokens": 2}), ""])
    out = tmp_path / "out.jsonl"
    assert pyml_batch.main([str(src), "--out", str(out), "-m", str(tiny), "-n", "6", "-t", "1",
                            "--batch", str(batch)]) == 1  # three lines failed
    lines = read_output(out)
    assert [o.get("id") for o in lines] == ["a", "b", None, "long", "a", "short", 3, "d"]
    assert lines[2] == {"line": 3, "error": lines[2]["error"]} and "not a JSON object" in lines[2]["error"]
    assert lines[3]["error"] == "the prompt is 200 tokens, longer than the model's context window of 128"
    assert lines[4]["error"] == "id 'a' repeats the id of line 1"
    for o in (lines[0], lines[1], lines[6], lines[7]):
        expected = tiny_lm.generate(PROMPTS[o["id"]], 6)  # greedy: the library's own answer
        assert (o["text"], o["tokens"], o["stop_reason"]) == (expected.text, expected.tokens, "max_tokens")
        assert o["timings"]["predicted_n"] == 6 and o["timings"]["prompt_n"] == len(expected.prompt_tokens)
    assert len(lines[5]["tokens"]) == 2
    err = capsys.readouterr().err
    assert "pyml-batch: 5 prompts done, 3 errors" in err and "1 process, 1 threads" in err
    assert ("3 sequences a step" in err) == (batch == 3)


def test_a_batch_larger_than_the_prompts_says_the_sequences_a_step_holds(tiny, tmp_path, capsys):
    """--batch 1000 over the four prompts: a step holds four sequences, and the summary says four (it
    said 1000, and the pool was made of 1000 slots)."""
    src = write_input(tmp_path / "in.jsonl")
    assert pyml_batch.main([str(src), "--out", str(tmp_path / "out.jsonl"), "-m", str(tiny), "-n", "2", "-t", "1",
                            "--batch", "1000"]) == 0
    err = capsys.readouterr().err
    assert "4 prompts done, 0 errors" in err and "4 sequences a step" in err and "1000" not in err


@pytest.mark.parametrize("batch", ["1", "3"])
def test_speculation_gives_the_same_lines_and_counts_its_drafts(tiny, tiny_lm, tmp_path, batch):
    """--lookup-ngram 1: every line's text is the library's plain greedy answer; the drafts are in its
    timings - one prompt at a time, or three a step with their drafts verified together."""
    src = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    assert pyml_batch.main([str(src), "--out", str(out), "-m", str(tiny), "-n", "24", "-t", "1",
                            "--lookup-ngram", "1", "--batch", batch]) == 0
    lines = read_output(out)
    for o in lines:
        expected = tiny_lm.generate(PROMPTS[o["id"]], 24)
        assert (o["text"], o["tokens"]) == (expected.text, expected.tokens)
        assert 0 <= o["timings"].get("draft_n_accepted", 0) <= o["timings"].get("draft_n", 0)
    assert sum(o["timings"].get("draft_n", 0) for o in lines) > 0


@pytest.mark.parametrize("flags, named", [(["--lookup-ngram", "2", "--ray"], "speculative decoding with --ray"),
                                          (["--draft-model", "x.gguf", "--batch", "2"], "--draft-model with --batch N > 1")])
def test_a_draft_model_with_batching_or_speculation_on_ray_is_refused_by_name(tiny, tmp_path, capsys, flags, named):
    src = write_input(tmp_path / "in.jsonl")
    assert pyml_batch.main([str(src), "--out", str(tmp_path / "out.jsonl"), "-m", str(tiny), *flags]) == 2
    assert f"{named} is not implemented" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_resume_skips_the_ids_done_and_reruns_errors(tiny, tmp_path, monkeypatch, capsys):
    src = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    done = {"id": "a", "text": "earlier", "tokens": [1], "stop_reason": "max_tokens", "timings": {}}
    # an earlier run: "a" done, "b" failed, 3 cut off while being written
    out.write_text(json.dumps(done) + "\n" + json.dumps({"id": "b", "line": 2, "error": "boom"}) + '\n{"id": 3, "te')
    ran = []
    monkeypatch.setattr(pyml_batch, "run_job", lambda lm, job, speculative=None: ran.append(job.id) or
                        {"id": job.id, "text": "", "tokens": [], "stop_reason": "eos", "timings": {}})
    assert pyml_batch.main([str(src), "--out", str(out), "-m", str(tiny)]) == 0
    assert ran == ["b", 3, "d"]
    assert [o["id"] for o in read_output(out)] == ["a", "b", 3, "d"]
    assert read_output(out)[0] == done
    assert "3 prompts done, 0 errors, 1 already done" in capsys.readouterr().err
    ran.clear()
    assert pyml_batch.main([str(src), "--out", str(out), "-m", str(tiny)]) == 0
    assert ran == [] and len(read_output(out)) == 4
    assert "nothing to run" in capsys.readouterr().err


def test_resume_of_a_missing_file_is_a_fresh_start(tmp_path):
    assert resume(tmp_path / "none.jsonl") == set()


def earlier_run(out):
    """An earlier run's output: "a" done, "b" failed, "c" cut off while being written."""
    done = {"id": "a", "text": "earlier", "tokens": [1], "stop_reason": "max_tokens", "timings": {}}
    out.write_text(json.dumps(done) + "\n" + json.dumps({"id": "b", "line": 2, "error": "boom"}) + '\n{"id": "c", "te')
    return json.dumps(done) + "\n"


def test_resume_keeps_the_files_mode(tmp_path):
    out = tmp_path / "out.jsonl"
    kept = earlier_run(out)
    out.chmod(0o600)
    assert resume(out) == {id_key("a")}
    assert out.read_text() == kept and stat.S_IMODE(out.stat().st_mode) == 0o600  # was 0644 (tmp + replace)
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary file left


def test_resume_writes_through_a_symlink_to_its_target(tmp_path):
    target = tmp_path / "real" / "out.jsonl"
    target.parent.mkdir()
    kept = earlier_run(target)
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert resume(link) == {id_key("a")}
    assert link.is_symlink() and target.read_text() == kept  # the link was replaced by a file before


@pytest.mark.parametrize("content", ["my notes\n", '{"id": 1, "prompt": "an input line"}\n', "[1, 2]\n",
                                     '{"id": "a", "text": "x", "tokens": [], "stop_reason": "eos", "timings": {}}\n'
                                     "not json\n{}", "\xff\xfe\n"])
def test_resume_refuses_a_file_that_is_not_its_own_output(tmp_path, content, capsys):
    out = tmp_path / "out.jsonl"
    out.write_bytes(content.encode("latin-1") if content.startswith("\xff") else content.encode())
    before = out.read_bytes()
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "hi"}\n')
    assert pyml_batch.main([str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a line pyml-batch writes" in err[0], err
    assert out.read_bytes() == before  # erased before


def test_resume_of_a_finished_file_does_not_touch_it(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": "x", "tokens": [], "stop_reason": "eos", "timings": {}}\n')
    inode = out.stat().st_ino
    assert resume(out) == {id_key("a")} and out.stat().st_ino == inode


def test_a_missing_input_file_is_one_line(tmp_path, capsys):
    assert pyml_batch.main([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pyml-batch: error: ") and "nope.jsonl" in err[0]


@pytest.mark.parametrize("flag, value", [("--workers", "4"), ("--address", "10.0.0.1:6379")])
def test_a_ray_setting_without_ray_is_refused_by_name(tmp_path, capsys, flag, value):
    """--workers and --address set up Ray's workers: without --ray the prompts ran here and ignored them."""
    src = write_input(tmp_path / "in.jsonl")
    assert pyml_batch.main([str(src), "--out", str(tmp_path / "o.jsonl"), flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pyml-batch: error: {flag} without --ray is not implemented: it sets up Ray's workers (add --ray); "
                   "this process runs the work itself"]
    assert not (tmp_path / "o.jsonl").exists()


def test_messages_and_chat_use_the_chat_template(tiny, tiny_lm, tmp_path):
    src = tmp_path / "in.jsonl"
    messages = [{"role": "user", "content": "hi"}]
    src.write_text(json.dumps({"id": 1, "messages": messages}) + "\n" + json.dumps({"id": 2, "prompt": "hi"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert pyml_batch.main([str(src), "--out", str(out), "-m", str(tiny), "-n", "4", "--chat",
                            "--system", "Be brief."]) == 0
    one, two = read_output(out)
    expected = tiny_lm.generate(tiny_lm.chat_prompt([{"role": "system", "content": "Be brief."}] + messages), 4)
    assert one["tokens"] == two["tokens"] == expected.tokens
    assert one["timings"]["prompt_n"] == len(expected.prompt_tokens)


def test_profile_gives_one_report_over_the_batch(tiny, tmp_path):
    src = write_input(tmp_path / "in.jsonl")
    prof = tmp_path / "prof"
    assert pyml_batch.main([str(src), "--out", str(tmp_path / "o.jsonl"), "-m", str(tiny), "-n", "3",
                            "--profile", str(prof)]) == 0
    report = (prof / "report.md").read_text()
    assert "| Generations | 4 |" in report and "## Workers" not in report  # one process: no per-worker rows
    assert json.loads((prof / "run.json").read_text())["model"]["arch"] == "gpt2"


def test_a_batched_profile_reports_its_steps_and_aggregate_speed(tiny, tmp_path):
    src = write_input(tmp_path / "in.jsonl")
    prof = tmp_path / "prof"
    assert pyml_batch.main([str(src), "--out", str(tmp_path / "o.jsonl"), "-m", str(tiny), "-n", "5",
                            "--batch", "4", "--profile", str(prof)]) == 0
    events = [json.loads(line) for line in (prof / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e.get("name") == "generator::batch_step" and e.get("phase") == "decode"]
    decoded = sum(int(e["details"].split("decoding=")[1].split()[0]) for e in steps)
    tokens = sum(len(r["tokens"]) for r in read_output(tmp_path / "o.jsonl"))
    # every token but each prompt's first (chosen by its prefill) comes from a decode step
    assert steps and decoded == tokens - len(PROMPTS)
    report = (prof / "report.md").read_text()
    line = next(x for x in report.splitlines() if x.startswith("| Decode (mean/batched step)"))
    assert f"over {len(steps)} steps of {decoded / len(steps):.1f} decoding sequences" in line


def test_a_batched_profiles_layer_tables_leave_out_steps_where_prompts_joined(tiny, tmp_path):
    """A prompt that joins while others decode makes a mixed step (prompt rows beside decode rows):
    a decode step to the sequences decoding in it, but its layers are not a decode step's. The
    per-layer and matmul tables cover the other decode steps, and say how many they left out."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": n}) + "\n"
                           for i, (p, n) in enumerate([("Hello there", 2), ("The capital of France is", 8),
                                                       ("xyz abc", 8), ("0123456789", 3)])))
    prof = tmp_path / "prof"
    assert pyml_batch.main([str(src), "--out", str(tmp_path / "o.jsonl"), "-m", str(tiny),
                            "--batch", "2", "--profile", str(prof)]) == 0
    events = [json.loads(line) for line in (prof / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e.get("name") == "generator::batch_step" and e.get("phase") == "decode"]
    shape = [(int(e["details"].split("rows=")[1].split()[0]), int(e["details"].split("decoding=")[1].split()[0]))
             for e in steps]
    mixed = sum(1 for rows, decoding in shape if rows > decoding)
    assert mixed and mixed < len(steps)  # the input makes both kinds
    report = (prof / "report.md").read_text()
    assert f"× {len(steps) - mixed} steps)" in report
    assert f"Over the {len(steps) - mixed} decode steps of decode rows only: the {mixed} steps" in report
    table = report.split("## Per-layer breakdown")[1].split("\n## ")[0]
    rows_seen = {int(m) for m in re.findall(r"\[(\d+), \d+\]->", table)}
    assert rows_seen and max(rows_seen) <= 2  # the products of 1 or 2 decode rows, no prompt's


def test_ray_flag_without_ray_is_one_line_naming_the_extra(tiny, tmp_path):
    src = write_input(tmp_path / "in.jsonl")
    code = ("import sys; sys.modules['ray'] = None\n"  # `import ray` now raises ImportError
            "from pyml.cli import pyml_batch, pyml_sweep\n"
            f"a = pyml_batch.main([{str(src)!r}, '--out', {str(tmp_path / 'o.jsonl')!r}, '-m', {str(tiny)!r}, "
            "'--ray'])\n"
            f"b = pyml_sweep.main(['--ray', '--out', {str(tmp_path / 'sweep')!r}])\n"
            "sys.exit(10 * a + b)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 22, proc.stderr
    assert not (tmp_path / "o.jsonl").exists()
    lines = proc.stderr.strip().splitlines()
    assert lines == ['pyml-batch: error: Ray is not installed: pip install "pyml[ray]" (or pip install ray) '
                     'to use --ray',
                     'pyml-sweep: error: Ray is not installed: pip install "pyml[ray]" (or pip install ray) '
                     'to use --ray']


def test_an_unreachable_cluster_is_one_line_before_the_output_is_touched(tiny, tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "o.jsonl"
    assert pyml_batch.main([str(src), "--out", str(out), "-m", str(tiny), "--ray", "--address",
                            f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pyml-batch: error: cannot reach the Ray cluster at 127.0.0.1:{port}: Connection refused "
                   f"(is `ray start --head` running there?)"]
    assert not out.exists()


@pytest.mark.parametrize("flags, message", [
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--batch", "2", "--context-shift"], "--context-shift is not available with --batch > 1"),
])
def test_batch_flags_it_cannot_honour_are_refused_in_one_line(tiny, tmp_path, capsys, flags, message):
    src = write_input(tmp_path / "in.jsonl")
    code = pyml_batch.main([str(src), "--out", str(tmp_path / "out.jsonl"), "-m", str(tiny), "-t", "1", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
