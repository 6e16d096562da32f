"""pyml-bench as a user runs it: a real process writing its three tables (its refusals of bad
flags and files: main(argv) in this process, tests/cli/test_infer.py's in_process)."""

import csv
import json
import re
import subprocess
import sys

import pytest

from pyml.cli import pyml_bench
from tests.cli.test_infer import ROOT, in_process, one_line_error


def run_bench(*args, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / "bin" / "pyml-bench"), *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def bench_here(*args):
    return in_process(*args, main=pyml_bench.main)


def test_bench_writes_markdown_csv_json(tmp_path, smollm2_gguf):
    r = run_bench("--models", "smollm2-135m-q4_1", "--reps", "2", "--n-prompt", "16", "--n-gen", "8",
                  "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    md = (tmp_path / "bench.md").read_text()
    assert md == r.stdout
    assert "| smollm2-135m-q4_1 |" in md and "pp16" in md and "tg8" in md and "Measured at " in md
    rows = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert [row["test"] for row in rows] == ["pp16", "tg8"]
    data = json.loads((tmp_path / "bench.json").read_text())
    # a decode step reads the weights once and the cached keys/values: 4 positions on average over tg8
    read = (data["info"]["bytes_per_token"]["smollm2-135m-q4_1"]
            + 4 * data["info"]["kv_bytes_per_position"]["smollm2-135m-q4_1"])
    limit = data["info"]["bandwidth_gbs"] * 1e9 / read
    tg = next(row for row in data["rows"] if row["test"] == "tg8")
    assert 0 < data["info"]["bandwidth_gbs"] < 1000  # that the probe's read is vectorised: test_bandwidth_probe_...
    assert abs(tg["pct_limit"] - tg["tok_s"] / limit * 100) < 1e-6
    assert 0 < tg["tok_s"] and tg["std"] >= 0
    # a prompt's linear layers as GOP/s (2 x their parameters per token) over the measured int8 peak x threads
    pp, peaks = next(row for row in data["rows"] if row["test"] == "pp16"), data["info"]["peaks"]
    assert 10 < peaks["int8_gops"] < 10000 and 1 < peaks["fp32_gflops"] < 5000
    assert abs(pp["gops"] - pp["tok_s"] * 2 * data["info"]["params_m"]["smollm2-135m-q4_1"] / 1e3) < 1e-6
    assert abs(pp["pct_limit"] - 100 * pp["gops"] / (peaks["int8_gops"] * pp["threads"])) < 1e-6
    assert "Compute peak per core" in md


def test_bandwidth_probe_reads_in_vector_lanes():
    """The probe is memory-bound only if its sum is vectorised (a scalar float reduction is add-latency
    bound at ~8 GB/s): its machine code adds packed floats. Checked in the code, not by a speed that
    a loaded machine cannot promise."""
    import numpy as np
    import numba
    from pyml.report.machine import _sum
    # numba returns no machine code for a function loaded from its cache (CI's warm run): compile a
    # fresh copy with the probe's own options
    options = {k: v for k, v in _sum.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = numba.njit(**options)(_sum.py_func)
    fresh(np.ones((2, 16384), np.float32))
    asm = "\n".join(fresh.inspect_asm().values())
    assert re.search(r"\bvaddps\s+%[yz]mm", asm), "the bandwidth probe's sum is not vectorised"


@pytest.mark.deep  # a benchmark table; the bench's run, tables and figures: test_bench_writes_markdown_csv_json
def test_log_cost_table(tmp_path, smollm2_gguf):
    r = run_bench("--log-cost", "--models", "smollm2-135m-q4_1", "--reps", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split("|") for line in r.stdout.splitlines()[2:6]]
    assert [row[3].strip() for row in rows] == ["off", "debug", "trace", "profile"]
    assert rows[0][5].strip() == "+0.0%" and rows[0][6].strip() == "+0.0% .. +0.0%"  # off against itself
    assert all(float(row[4]) > 0 and ".." in row[6] for row in rows)
    assert "2 rounds per level" in r.stdout  # --reps: the rounds
    assert (tmp_path / "log-cost.md").read_text() == r.stdout
    assert "[perf]" not in r.stderr  # the lines went to os.devnull


def test_any_gguf_file_by_its_path(tmp_path, smollm2_gguf):
    """-m takes a GGUF file's path as llama-bench's -m does: the row names the file, and the quant column is
    the file's general.file_type (SmolLM2's PyPI file: Q4_1)."""
    r = run_bench("-m", str(smollm2_gguf), "--reps", "1", "--tests", "tg", "-n", "4", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(row["model"], row["quant"], row["test"]) for row in rows] == [(smollm2_gguf.name, "Q4_1", "tg4")]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    one_line_error(bench_here("-m", str(bad), "--out", str(tmp_path)), "bad.gguf", "not a readable GGUF file")
    one_line_error(bench_here("-m", str(tmp_path / "absent.gguf"), "--out", str(tmp_path)), "unknown model",
                   "absent.gguf")


def test_bad_flags_are_one_line(tmp_path):
    one_line_error(bench_here("--models", "nope", "--out", str(tmp_path)), "unknown model", "nope")
    one_line_error(bench_here("--peers", "vllm", "--out", str(tmp_path)), "unknown peer", "vllm")
    (tmp_path / "a-file").write_text("")  # was an internal FileExistsError, after the whole run
    one_line_error(bench_here("--out", str(tmp_path / "a-file" / "x")), f"{tmp_path / 'a-file'} is a file, not a folder")


@pytest.mark.parametrize("args, said", [
    (("--batch", "1,4", "--spec"), "--batch with --spec: one mode a run"),
    (("--cold", "--memory"), "--cold with --memory: one mode a run"),
    (("--batch", "1,4", "--depth", "512"), "--depth with --batch is not implemented: it reads -t, --reps, -p, -n, "
                                           "--peers, --kv-type"),
    (("--batch", "1,4", "-p", "64,128"), "-p 64,128 with --batch is not implemented: it takes one value"),
    (("--spec", "-t", "1,2"), "-t 1,2 with --spec is not implemented: it takes one value"),
    (("--memory", "--peers", "llama.cpp"), "--peers with --memory is not implemented"),
    (("--cold", "--tests", "pp"), "--tests with --cold is not implemented"),
    (("--lookup-ngram", "2",), "--lookup-ngram with the pp/tg tests is not implemented"),
    (("--batch", "2", "--float-compute", "f32"), "--float-compute with --batch is not implemented"),
    (("--memory", "--reps", "3"), "--reps with --memory is not implemented: it reads -t, -p, -n, --depth")])
def test_a_setting_the_mode_does_not_read_is_refused_by_name(tmp_path, args, said):
    """Each mode reads some of the settings and one value of some (--batch ran at depth 0 with
    --depth 512 given, on the first of -p 64,128): the rest are refused before anything loads."""
    one_line_error(bench_here(*args, "--out", str(tmp_path)), said)


@pytest.mark.deep  # a benchmark table; the bench's run, tables and figures: test_bench_writes_markdown_csv_json
def test_memory_table(tmp_path, smollm2_gguf):
    """Each model measured in a process of its own: the weights it reads are resident (the model part
    is at least the file), and the table is what the file holds."""
    r = run_bench("--memory", "--models", "smollm2-135m-q4_1", "--n-prompt", "16", "--n-gen", "8",
                  "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "memory.md").read_text() == r.stdout
    cells = [c.strip() for c in r.stdout.splitlines()[2].split("|")[1:-1]]
    name, depth, file_mib, kv_mib, model_mib, ratio, over = cells
    assert name == "smollm2-135m-q4_1" and depth == "0"
    assert int(file_mib) == round(smollm2_gguf.stat().st_size / 2**20)
    assert float(kv_mib) > 0 and int(model_mib) >= 0.9 * int(file_mib)
    assert abs(float(ratio[:-1]) - int(model_mib) / (int(file_mib) + float(kv_mib))) < 0.02
    assert abs(int(over) - (int(model_mib) - int(file_mib) - float(kv_mib))) <= 2


@pytest.mark.deep  # a benchmark table; the bench's run, tables and figures: test_bench_writes_markdown_csv_json
def test_lists_of_prompt_lengths_and_depths(tmp_path, smollm2_gguf):
    """-p/-n/-d lists as llama-bench takes them: every test at every depth, in one table; decode at
    depth is held to a limit that counts the cached keys and values it reads."""
    r = run_bench("-m", "smollm2-135m-q4_1", "--reps", "1", "-p", "8,16", "-n", "4", "-d", "0,24",
                  "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [row["test"] for row in data["rows"]] == ["pp8@d0", "pp16@d0", "tg4@d0", "pp8@d24", "pp16@d24",
                                                      "tg4@d24"]
    assert data["info"]["kv_bytes_per_position"]["smollm2-135m-q4_1"] > 0
    one_line_error(bench_here("-d", "-1", "--out", str(tmp_path)), "--depth takes integers >= 0")
    one_line_error(bench_here("-p", "x", "--out", str(tmp_path)), "--n-prompt takes comma-separated integers")


def test_openvino_peer_has_a_matching_precision_for_every_bench_model(tmp_path):
    from pyml.cli.bench_models import MODELS
    from pyml.cli.bench_openvino import WEIGHT_FORMATS, exported
    from pyml.core.errors import PymlError
    assert {m.quant for m in MODELS.values()} <= set(WEIGHT_FORMATS)
    assert WEIGHT_FORMATS["Q4_0"][WEIGHT_FORMATS["Q4_0"].index("--group-size") + 1] == "32"  # ggml's block
    with pytest.raises(PymlError, match="no matching precision for IQ2_XS"):
        exported(tmp_path / "m.gguf", "IQ2_XS")


class _Recorder:
    """A stand-in engine: records what it was asked, in one log shared by all of them."""

    vocab = 50000

    def __init__(self, name, log):
        self.name, self.log = name, log

    def pp(self, tokens):
        self.log.append((self.name, tuple(tokens)))
        return 0.5

    def tg(self, first, n):
        self.log.append((self.name, first))
        return 0.25


def test_engines_take_turns_on_the_same_inputs():
    from pyml.cli.pyml_bench import Test, bench_turns
    log = []
    engines = {name: _Recorder(name, log) for name in ("pyml", "llama.cpp", "openvino")}
    rates = bench_turns(engines, Test("pp", 8), reps=4)
    assert rates == {name: [16.0] * 4 for name in engines}  # 8 tokens in 0.5 s
    # each repetition runs every engine once, the order rotating by one
    assert [name for name, _ in log] == ["pyml", "llama.cpp", "openvino", "llama.cpp", "openvino", "pyml",
                                         "openvino", "pyml", "llama.cpp", "pyml", "llama.cpp", "openvino"]
    # ... on the same prompt within a repetition, another one in the next
    prompts = [{p for _, p in log[3 * r:3 * r + 3]} for r in range(4)]
    assert all(len(p) == 1 for p in prompts) and len(set.union(*prompts)) == 4
    log.clear()
    assert bench_turns(engines, Test("tg", 32), reps=2)["openvino"] == [128.0, 128.0]
    assert len({first for _, first in log[:3]}) == 1


def test_ratio_is_the_median_of_the_repetitions_ratios():
    from pyml.cli.pyml_bench import Row, add_ratios
    def row(backend, runs, test="tg128"):
        return Row("m", 1.0, 1.0, "Q4_0", backend, 2, test, sorted(runs)[len(runs) // 2], 0.0, runs)
    # the machine's speed moved between repetitions: their ratios are 2.0, 1.67 and 2.0, the
    # medians' 110 / 60 = 1.83
    pyml, peer = row("pyml", [200.0, 100.0, 110.0]), row("llama.cpp", [100.0, 60.0, 55.0])
    other = row("llama.cpp", [1.0, 1.0, 1.0], test="pp512")  # another test: not compared
    add_ratios([pyml, peer, other])
    assert pyml.ratio == {"llama.cpp": 2.0} and peer.ratio == {}


def test_batch_table(tmp_path, smollm2_gguf):
    """--batch 1,2,4: a row per batch size, every rate positive, B = 1 the baseline; a peer without a
    batched mode (transformers) is refused by name."""
    r = run_bench("--batch", "1,2,4", "--models", "smollm2-135m-q4_1", "--reps", "2", "--n-prompt", "8",
                  "--n-gen", "4", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "batch.md").read_text() == r.stdout
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in r.stdout.splitlines() if line.startswith("| smollm2")]
    assert [row[1] for row in rows] == ["1", "2", "4"] and rows[0][5] == "1.00x"
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in rows)
    assert all(abs(float(row[4]) - float(row[3]) / int(row[1])) < 0.2 for row in rows)  # per sequence
    for row in rows[1:]:  # the ratio of the medians, then the range of the two repetitions' own ratios:
        # of two, the medians' ratio is (a1 + a2) / (b1 + b2), which lies between a1 / b1 and a2 / b2
        ratio, lo, hi = (float(x) for x in re.fullmatch(r"([\d.]+)x \(([\d.]+)-([\d.]+)\)", row[5]).groups())
        assert abs(ratio - float(row[3]) / float(rows[0][3])) < 0.01 + 0.01 * ratio
        assert 0 < lo <= hi and lo - 0.011 <= ratio <= hi + 0.011
    assert "the range of the repetitions' own ratios" in r.stdout.splitlines()[0]
    assert ", f16 KV cache," in r.stdout.splitlines()[0]  # the default, as the pools were made
    refused = bench_here("--batch", "4", "--peers", "transformers", "--out", str(tmp_path))
    assert refused.returncode == 2 and "--peers transformers with --batch is not implemented" in refused.stderr
    # a batch whose caches the machine could not hold: refused once the model says its cache's size
    # (it was "error: out of memory" after minutes of trying)
    refused = bench_here("--batch", "1,10000000", "--models", "smollm2-135m-q4_1", "--out", str(tmp_path))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert re.search(r"pyml-bench: error: --batch 10000000: 10000000 sequences of 257 positions could hold [\d.]+ GB "
                     r"of keys and values, more than this machine's [\d.]+ GB of memory; lower --batch, -p or -n",
                     refused.stderr), refused.stderr


def test_batch_table_on_a_q8_0_kv_cache(tmp_path, smollm2_gguf):
    """--kv-type q8_0 (llama-bench's -ctk/-ctv): the sequences' caches are q8_0, as the header says
    (read off the loaded model, not the flag); a mode or a peer it does not reach is refused by name."""
    r = run_bench("--batch", "1,2", "--kv-type", "q8_0", "--models", "smollm2-135m-q4_1", "--reps", "1",
                  "--n-prompt", "8", "--n-gen", "4", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert ", q8_0 KV cache," in r.stdout.splitlines()[0]
    assert [line.split("|")[2].strip() for line in r.stdout.splitlines() if line.startswith("| smollm2")] == ["1", "2"]
    for args, said in [(("--spec",), "--kv-type with --spec is not implemented"),
                       (("--peers", "transformers"), "--kv-type q8_0 with --peers transformers is not implemented"),
                       (("--kv-type", "q4_0"), "invalid choice: 'q4_0'")]:
        refused = bench_here("--kv-type", "q8_0", *args, "--out", str(tmp_path))
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr


@pytest.mark.peer
def test_batch_table_beside_llama_cpp(tmp_path, smollm2_gguf):
    """--batch 1,4 --peers llama.cpp: llama.cpp's batched decode (llama_batch, n_seq_max = B) in three
    more columns of each row, and pyml's ratio to it."""
    r = run_bench("--batch", "1,4", "--models", "smollm2-135m-q4_1", "--peers", "llama.cpp", "--reps", "2",
                  "--n-prompt", "8", "--n-gen", "4", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in r.stdout.splitlines() if line.startswith("| smollm2")]
    assert [row[1] for row in rows] == ["1", "4"] and all(len(row) == 9 for row in rows)
    for row in rows:
        assert float(row[6]) > 0 and float(row[7]) > 0
        ratio = float(row[8].split("x")[0])
        assert abs(ratio - float(row[3]) / float(row[7])) < 0.02 * ratio + 0.01 and row[8].endswith(")")
    # both engines on q8_0 caches (llama.cpp's with flash attention, which its quantized V cache needs)
    r = run_bench("--batch", "1,2", "--kv-type", "q8_0", "--models", "smollm2-135m-q4_1", "--peers", "llama.cpp",
                  "--reps", "1", "--n-prompt", "8", "--n-gen", "4", "--out", str(tmp_path))
    assert r.returncode == 0 and ", q8_0 KV cache," in r.stdout.splitlines()[0], r.stderr[-2000:]
    assert all(float(line.split("|")[8]) > 0 for line in r.stdout.splitlines() if line.startswith("| smollm2"))


def test_spec_table(tmp_path, smollm2_gguf):
    """--spec: a row per prompt with plain and lookup rates, their ratio, the drafts kept of those made,
    and the tokens identical (greedy speculation changes nothing but the speed); a peer is refused by name."""
    r = run_bench("--spec", "--models", "smollm2-135m-q4_1", "--reps", "2", "--n-gen", "24", "--lookup-ngram", "3",
                  "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "spec.md").read_text() == r.stdout and "--lookup-ngram 3" in r.stdout
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in r.stdout.splitlines() if line.startswith("| smollm2")]
    assert [row[1] for row in rows] == ["summarise-text", "edit-code", "free-chat"]
    for row in rows:
        plain, lookup = float(row[2]), float(row[3])
        assert plain > 0 and lookup > 0 and abs(float(row[4][:-1]) - lookup / plain) < 0.01
        kept, made = (int(x) for x in row[5].split(" / "))
        assert 0 <= kept <= made and row[6] == "yes"
    refused = bench_here("--spec", "--peers", "transformers", "--out", str(tmp_path))
    assert refused.returncode == 2 and "--peers transformers with --spec is not implemented" in refused.stderr


def test_spec_table_with_a_draft_model(tmp_path, smollm2_gguf):
    """--spec --draft-model: a model drafting for itself is right every time (greedy, each verify row
    has its decode step's bits), so every draft is kept."""
    r = run_bench("--spec", "--models", "smollm2-135m-q4_1", "--draft-model", "smollm2-135m-q4_1", "--reps", "1",
                  "--n-gen", "24", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "a draft model (smollm2-135m-q4_1" in r.stdout and "| draft tok/s |" in r.stdout
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in r.stdout.splitlines() if line.startswith("| smollm2")]
    assert len(rows) == 3
    for row in rows:
        kept, made = (int(x) for x in row[5].split(" / "))
        assert made > 0 and kept == made and row[6] == "yes"
    refused = bench_here("--spec", "--draft-model", "nope", "--out", str(tmp_path))
    assert refused.returncode == 2 and "unknown --draft-model nope" in refused.stderr


@pytest.mark.peer
def test_spec_table_beside_llama_cpp(tmp_path, smollm2_gguf):
    """--spec --peers llama.cpp: llama-cpp-python's prompt lookup (LlamaPromptLookupDecoding) on the same file
    and prompts in four more columns: its plain and lookup rates, their ratio, whether its texts agreed."""
    r = run_bench("--spec", "--models", "smollm2-135m-q4_1", "--peers", "llama.cpp", "--reps", "2", "--n-gen", "24",
                  "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in r.stdout.splitlines() if line.startswith("| smollm2")]
    assert len(rows) == 3 and all(len(row) == 11 for row in rows)
    for row in rows:
        plain, lookup = float(row[7]), float(row[8])
        assert plain > 0 and lookup > 0 and abs(float(row[9][:-1]) - lookup / plain) < 0.01
