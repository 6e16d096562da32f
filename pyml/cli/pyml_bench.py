"""pyml-bench: prompt processing and text generation speed, beside llama.cpp and PyTorch.

In the style of llama-bench: for each model x thread count it measures `pp128` (a
128-token prompt in one forward pass) and `tg128` (128 single-token decode steps) as
tokens/s (median of n repetitions after a warm-up), with the same model file, thread count
and token ids for every engine, in one process run. `-p`, `-n` and `-d` take lists: `-d 4096`
runs each test on top of a 4096-token context already in the cache (`tg128@d4096`). It also
measures the machine's read bandwidth and reports each engine's decode as a share of the limit
it sets:
    limit tok/s = bandwidth / (bytes of weights + bytes of cached keys and values read per token),
and each prompt's linear layers as achieved GOP/s and a share of the compute peak one core measures
for the ISA path in use (kernel_bench's chains: int8 dot for quantized weights, float32 FMA for float
ones, vdpbf16ps for float ones computed in bf16: `--float-compute`, named beside the quant type),
times the thread count:
    GOP/s = tok/s x 2 x parameters of the linear layers (the LM head, run for the last token only, and
    attention not counted).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import logging
import subprocess
from importlib.metadata import PackageNotFoundError, version

import numba
import numpy as np
from tqdm import tqdm

from pyml import quant
from pyml.cli import bench_cold
from pyml.cli.bench_batch import batch_table
from pyml.cli.bench_engines import ENGINES, KV_PEERS
from pyml.cli.bench_models import DEFAULT_MODELS, FLOAT_QUANTS, MODELS
from pyml.cli.bench_spec import spec_table
from pyml.cli.kernel_bench import bf16_peak, compute_peaks
from pyml.cli.main import Parser, run_command
from pyml.cli.options import check_output_folder
from pyml.core import ops, perf
from pyml.core.errors import PymlError
from pyml.core.runtime import RuntimeConfig
from pyml.nlp.api import load_model
from pyml.nn.kv_cache import DEFAULT_KV_TYPE, KV_TYPES
from pyml.report.machine import git_info, machine_info, read_bandwidth
from pyml.report.timing import RecordSink


# --- measurements -------------------------------------------------------------------

def weight_bytes_per_token(lm) -> int:
    """Bytes of every matrix a decode step multiplies through (each weight read once)."""
    seen, total = set(), 0
    for lin in lm.model.linears():
        if id(lin.weight.data) not in seen:
            seen.add(id(lin.weight.data))
            total += lin.weight.nbytes
    return total


def kv_bytes_per_position(lm) -> list:
    """Bytes of keys and values one cached position holds, per layer, and the positions each layer
    keeps (its sliding window, or None): a decode step at depth d reads min(d, window) of them."""
    cache = lm.new_cache(64)
    return [(cache.bytes_per_position(i), block.attn.window) for i, block in enumerate(lm.model.blocks)]


def bytes_read_per_token(weights: int, kv_layers: list, depth: int) -> float:
    return weights + sum(b * (depth if window is None else min(depth, window)) for b, window in kv_layers)


def add_limit(row, test, info, model_bytes):
    """tg rows: tok/s as a share of the bandwidth limit, the weights and the cached context read once
    per token (at the test's depth plus half its steps)."""
    if test.kind != "tg" or model_bytes is None:
        return
    weights, kv_layers = model_bytes
    limit = info["bandwidth_gbs"] * 1e9 / bytes_read_per_token(weights, kv_layers, test.depth + test.n // 2)
    row.pct_limit = 100 * row.tok_s / limit


def add_compute_share(row, test, info):
    """pp rows: the linear layers' GOP/s and their share of the compute peak of `row.threads` cores."""
    params = info.get("params_m", {}).get(row.model)
    if test.kind != "pp" or not params or "peaks" not in info:
        return
    row.gops = row.tok_s * 2 * params * 1e6 / 1e9
    kind = "int8_gops" if row.quant not in FLOAT_QUANTS else "bf16_gflops" if row.compute == "bf16" else "fp32_gflops"
    peak = info["peaks"][kind] * row.threads
    row.pct_limit = 100 * row.gops / peak


@dataclass
class Row:
    model: str
    size_mib: float
    params_m: float
    quant: str
    backend: str
    threads: int
    test: str
    tok_s: float
    std: float
    runs: list = field(default_factory=list)
    ratio: dict = field(default_factory=dict)     # pyml / peer, on pyml rows
    pct_limit: float | None = None                # tg: share of the bandwidth limit; pp: of the compute peak
    gops: float | None = None                     # pp: the linear layers' GOP/s
    compute: str = ""                             # pyml on float weights: what the prefill computes in


@dataclass(frozen=True)
class Test:
    """One llama-bench test: `pp` (a prompt of n tokens in one pass) or `tg` (n decode steps), on top
    of a context of `depth` tokens already in the cache."""
    kind: str
    n: int
    depth: int = 0

    def label(self, with_depth: bool) -> str:
        return f"{self.kind}{self.n}" + (f"@d{self.depth}" if with_depth else "")


def plan(kinds, n_prompts, n_gens, depths) -> list:
    """The tests in table order: by depth, prompts before generation, as llama-bench lists them."""
    return [Test(kind, n, d) for d in depths for kind in ("pp", "tg") if kind in kinds
            for n in (n_prompts if kind == "pp" else n_gens)]


def random_tokens(rng, vocab: int, n: int) -> list:
    return rng.integers(0, min(vocab, 32000), n).tolist()


def bench_once(engine, test: Test, seed: int) -> float:
    """One repetition of a test, in tokens per second; its prompt or first token drawn from `seed`,
    so every engine gets the same input for the same repetition."""
    rng = np.random.default_rng(seed)
    if test.kind == "pp":
        return test.n / engine.pp(random_tokens(rng, engine.vocab, test.n))
    return test.n / engine.tg(int(rng.integers(0, min(engine.vocab, 32000))), test.n)


def rotated(items: list, k: int) -> list:
    """items starting from its k-th (mod len): round k's order, so that no one always runs right
    after another (what one leaves in the caches and clocks carries into the next)."""
    k %= len(items)
    return items[k:] + items[:k]


def bench_turns(engines: dict, test: Test, reps: int) -> dict:
    """{engine name: rates}: `reps` repetitions in which every engine runs the test once, taking
    turns in an order that rotates by one each repetition. A shared machine drifts over seconds;
    turns spread the drift over all engines, where each engine's reps in one stretch gave its
    ratio to the others whatever the machine did in between."""
    names = list(engines)
    rates = {name: [] for name in names}
    for rep in range(reps):
        for name in rotated(names, rep):
            rates[name].append(bench_once(engines[name], test, seed=rep))
    return rates


def add_ratios(rows):
    """On each pyml row, its ratio to every peer's row of the same model, threads and test: the
    median of the repetitions' own ratios (the engines ran each repetition a few seconds apart)."""
    for row in rows:
        if row.backend == "pyml":
            for peer in rows:
                if peer.backend != "pyml" and (peer.model, peer.threads, peer.test) == (row.model, row.threads,
                                                                                          row.test):
                    row.ratio[peer.backend] = statistics.median(a / b for a, b in zip(row.runs, peer.runs))


def model_size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def run(models, threads_list, reps, peers, tests: list, progress=True,
        float_compute: str = "auto", kv_type: str = DEFAULT_KV_TYPE) -> tuple[list, dict]:
    rows, info = [], {"git": git_info(), "machine": machine_info(), "peers": _peer_versions()}
    with tqdm(total=0, desc="bandwidth", file=sys.stderr, disable=not progress, bar_format="{desc}") as bar:
        numba.set_num_threads(max(threads_list))
        info["bandwidth_gbs"] = read_bandwidth() / 1e9
        bar.set_description(f"read bandwidth {info['bandwidth_gbs']:.1f} GB/s")
        if any(t.kind == "pp" for t in tests):
            fp32, int8 = compute_peaks(rounds=3, n=1_000_000)  # one thread: the per-core peak
            info["peaks"] = {"fp32_gflops": fp32, "int8_gops": int8}
            if quant.BF16_AVAILABLE:
                info["peaks"]["bf16_gflops"] = bf16_peak(rounds=3, n=1_000_000)
    info["float_compute"], info["kv_type"] = float_compute, kv_type
    work = [(m, t) for m in models for t in threads_list]
    bar = tqdm(work, desc="benchmarking", file=sys.stderr, disable=not progress, unit="model")
    bytes_per_token = {}
    with_depth = any(t.depth for t in tests)
    room = max(t.n + (t.kind == "tg") for t in tests)
    for name, threads in bar:
        model = MODELS[name]
        path = model.locate()
        engines = {}  # every engine of the model loaded at once: they take turns in each repetition
        for engine_name in ["pyml", *peers]:
            bar.set_postfix_str(f"{name} t={threads}: loading {engine_name}")
            try:
                options = {"float_compute": float_compute} if engine_name == "pyml" else {}
                if engine_name in ("pyml", *KV_PEERS):  # the others were refused a --kv-type (run_bench)
                    options["kv_type"] = kv_type
                engines[engine_name] = ENGINES[engine_name](model, path, threads, **options)
            except (ImportError, PymlError, OSError, ValueError) as e:
                print(f"pyml-bench: {engine_name} skipped on {name}: {type(e).__name__}: {e}", file=sys.stderr)
        if "pyml" in engines:
            lm = engines["pyml"].lm
            info["kv_type"] = lm.model.kv_type  # the type its caches are made of, as the header says
            bytes_per_token[name] = (weight_bytes_per_token(lm), kv_bytes_per_position(lm))
            params = sum(lin.in_features * lin.out_features for lin in lm.model.linears()[:-1])
            info.setdefault("params_m", {})[name] = params / 1e6
            lm = None
        for engine in engines.values():
            bench_once(engine, Test("tg", 8), seed=reps)  # warm: first calls, caches, threads
        got = {}  # (engine name, test) -> rates
        for depth in sorted({t.depth for t in tests}):
            here = {}
            for engine_name, engine in engines.items():
                if depth and not getattr(engine, "supports_depth", True):
                    print(f"pyml-bench: {engine_name} skipped at depth {depth} on {name}: it keeps no cache "
                          "between calls", file=sys.stderr)
                    continue
                # the same context for every engine: the rng is seeded per depth, not per engine
                engine.set_context(random_tokens(np.random.default_rng(depth), engine.vocab, depth), room)
                here[engine_name] = engine
            for test in (t for t in tests if t.depth == depth):
                bar.set_postfix_str(f"{name} t={threads}: {test.label(with_depth)}, {', '.join(here)} taking turns")
                for engine_name, rates in bench_turns(here, test, reps).items():
                    got[engine_name, test] = rates
        for engine_name in engines:
            for test in tests:
                if (engine_name, test) not in got:
                    continue
                rates = got[engine_name, test]
                row = Row(model.name, model_size(path) / 2**20, info.get("params_m", {}).get(name, 0.0), model.quant,
                          engine_name, threads, test.label(with_depth), statistics.median(rates),
                          statistics.stdev(rates) if len(rates) > 1 else 0.0, rates,
                          compute=getattr(engines[engine_name], "compute", ""))
                add_limit(row, test, info, bytes_per_token.get(name))
                add_compute_share(row, test, info)
                rows.append(row)
        for engine in engines.values():
            engine.close()
        engines = None
        gc.collect()
    add_ratios(rows)
    info["bytes_per_token"] = {name: weights for name, (weights, _) in bytes_per_token.items()}
    info["kv_bytes_per_position"] = {name: sum(b for b, _ in kv) for name, (_, kv) in bytes_per_token.items()}
    return rows, info


# --- output -------------------------------------------------------------------------

def _peer_versions() -> dict:
    out = {}
    for name in ("llama-cpp-python", "torch", "transformers", "openvino-genai"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def markdown(rows, info, peers) -> str:
    head = ["model", "size (MiB)", "params (M)", "quant", "backend", "threads", "test", "t/s",
            "% of limit"] + [f"pyml/{p}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in rows:
        cells = [r.model, f"{r.size_mib:.0f}", f"{r.params_m:.0f}", r.quant + (f" ({r.compute})" if r.compute else ""),
                 r.backend, str(r.threads), r.test,
                 f"{r.tok_s:.2f} ± {r.std:.2f}", "" if r.pct_limit is None else f"{r.pct_limit:.0f}%"]
        cells += [f"{r.ratio[p]:.2f}x" if p in r.ratio else "" for p in peers]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if peers:
        lines.append("The engines take turns in every repetition (the order rotating); a pyml/peer ratio is the "
                     "median of the repetitions' own ratios.")
        lines.append("")
    git, machine = info.get("git"), info.get("machine") or {}
    where = f"commit {git['commit'][:12]}{' (with local changes)' if git['dirty'] else ''}" if git else "no git checkout"
    lines.append(f"Measured at {where} on {machine.get('cpu', '?')} ({machine.get('usable_cores', '?')} cores, "
                 f"kernels for {machine.get('isa', '?')} of {', '.join(machine.get('isa_supported', []))}), "
                 f"Python {machine.get('python', '?')}, NumPy {machine.get('numpy', '?')}, "
                 f"Numba {machine.get('numba', '?')}"
                 + "".join(f", {k} {v}" for k, v in (info.get("peers") or {}).items())
                 + f"; {info.get('kv_type', DEFAULT_KV_TYPE)} KV cache.")
    lines.append("")
    if "peaks" in info:
        lines.append(f"Compute peak per core ({machine.get('isa', '?')}): int8 {info['peaks']['int8_gops']:.0f} "
                     f"GOP/s, float32 {info['peaks']['fp32_gflops']:.0f} GFLOP/s"
                     + (f", bf16 {info['peaks']['bf16_gflops']:.0f} GFLOP/s" if "bf16_gflops" in info["peaks"] else "")
                     + f"; --float-compute {info.get('float_compute', 'auto')} (a float row's quant names what "
                     "its prefill computes in: pyml's by this option, OpenVINO's by its CPU plugin's precision). A pp row's % is its linear "
                     "layers' rate (2 x their parameters per token) over the peak x threads: "
                     + ", ".join(f"{r.backend} {r.model} {r.test} {r.gops:.0f} GOP/s" for r in rows if r.gops)
                     + ".")
        lines.append("")
    lines.append(f"Read bandwidth (all threads): {info['bandwidth_gbs']:.1f} GB/s. Bandwidth limit of decode, "
                 "tok/s = bandwidth / bytes of weights per token:")
    for name, b in info["bytes_per_token"].items():
        kv = info.get("kv_bytes_per_position", {}).get(name)
        lines.append(f"- {name}: {b / 2**20:.0f} MiB of weights per token -> {info['bandwidth_gbs'] * 1e9 / b:.1f} "
                     f"tok/s at depth 0" + (f"; + {kv / 1024:.0f} KiB per cached position" if kv else ""))
    return "\n".join(lines) + "\n"


def write_outputs(rows, info, peers, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(markdown(rows, info, peers))
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "size_mib", "params_m", "quant", "backend", "threads", "test", "tok_s", "std",
                    "pct_limit"] + [f"ratio_{p}" for p in peers])
        for r in rows:
            w.writerow([r.model, f"{r.size_mib:.1f}", f"{r.params_m:.1f}", r.quant, r.backend, r.threads, r.test,
                        f"{r.tok_s:.3f}", f"{r.std:.3f}", "" if r.pct_limit is None else f"{r.pct_limit:.1f}"]
                       + [f"{r.ratio[p]:.3f}" if p in r.ratio else "" for p in peers])
    (out / "bench.json").write_text(json.dumps({"info": info, "rows": [asdict(r) for r in rows]}, indent=2))


def log_cost(model_names, threads: int, rounds: int = 40, steps: int = 8) -> str:
    """The cost of logging, measured: decode steps of one loaded model in short blocks of `steps`,
    the levels off / debug / trace / profile interleaved over `rounds`, in a rotating order, every
    step at the same cache position: the same work. `profile` is what `--profile` records: every
    span at trace level into a collector like the profile's, no text. Lines go to os.devnull: the
    cost of making them, not of a terminal.
    A shared machine drifts by more than the targets (blocks of 32 steps spread by 15-20% between
    rounds), so each level is compared with the off block of its own round, a few milliseconds
    apart, and "vs off" is the median of those paired ratios; the middle half of them shows the
    spread. A block starts with one untimed step after the level is set: the drain of the
    previous block's records (perf.flush) leaves the caches cold for one step, whatever the level.
    The steps' own time (wall and this process's CPU time) is apart from what making the records
    and lines costs after them (perf.flush: the drain at the end of a generation or a profile),
    per step: a block's drains all come after it (perf.DRAIN_EVERY_S held off meanwhile), where a
    generation's come once a second, between its steps.
    Returns a Markdown table of medians and the change against off."""
    sink = open(os.devnull, "w")
    root = logging.getLogger("pyml")
    saved = list(root.handlers)
    root.handlers[:] = []
    perf.configure("warning", stream=sink)
    drain_every = perf.DRAIN_EVERY_S
    lines = ["| model | threads | LOG | ms/step (median) | vs off | vs off, middle half of rounds | CPU ms/step "
             "| vs off (CPU) | made after the steps, ms/step |", "|---|---|---|---|---|---|---|---|---|"]
    levels = ["off", "debug", "trace", "profile"]
    try:
        for name in model_names:
            model = MODELS[name]
            lm = load_model(threads=threads, **{model.kind: str(model.locate())})
            cache = lm.new_cache(16)
            lm.model.forward([1, 2, 3], cache)
            # per level: (wall ms, CPU ms, made-after ms) of each round's block, per step
            got = {level: [] for level in levels}
            for r in tqdm(range(rounds), desc=f"log cost {name}", unit="round", leave=False,
                          disable=not sys.stderr.isatty()):
                for level in rotated(levels, r):
                    perf.configure(level if level in ("debug", "trace") else "warning")
                    records = RecordSink()
                    if level == "profile":
                        perf.add_collector(records, level=perf.TRACE)
                    perf.DRAIN_EVERY_S = math.inf
                    cache.length = 3
                    lm.model.forward([5], cache)  # untimed: the caches after the last drain
                    perf.flush()
                    walls = []
                    c0 = time.process_time()
                    for _ in range(steps):
                        cache.length = 3
                        t0 = time.perf_counter()
                        lm.model.forward([5], cache)
                        walls.append(time.perf_counter() - t0)
                    c1 = time.process_time()
                    perf.DRAIN_EVERY_S = drain_every
                    t1 = time.perf_counter()
                    perf.flush()
                    got[level].append((statistics.median(walls) * 1e3, (c1 - c0) / steps * 1e3,
                                       (time.perf_counter() - t1) / steps * 1e3))
                    if level == "profile":
                        perf.remove_collector(records)
            perf.configure("warning")
            for level, blocks in got.items():
                wall, cpu, made = (statistics.median(b[j] for b in blocks) for j in (0, 1, 2))
                paired = [[b[j] / o[j] - 1 for b, o in zip(blocks, got["off"])] for j in (0, 1)]
                q1, _, q3 = statistics.quantiles(paired[0], n=4) if len(paired[0]) > 1 else paired[0] * 3
                lines.append(f"| {name} | {threads} | {level} | {wall:.2f} | {statistics.median(paired[0]) * 100:+.1f}% "
                             f"| {q1 * 100:+.1f}% .. {q3 * 100:+.1f}% | {cpu:.2f} "
                             f"| {statistics.median(paired[1]) * 100:+.1f}% | {made:.2f} |")
            lm = None
            gc.collect()
    finally:
        perf.DRAIN_EVERY_S = drain_every
        root.handlers[:] = saved
        perf.refresh()
        sink.close()
    lines += ["", f"{rounds} rounds per level of {steps} timed steps at one cache position, each paired with the "
              "off block of its round; 'vs off' is the median of those ratios."]
    return "\n".join(lines) + "\n"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_probe(name: str, threads: int, n_prompt: int, n_gen: int, depth: int = 0) -> dict:
    """In this (fresh) process: RSS with pyml imported and its kernels loaded, then the peak RSS of
    loading the model, a prompt of `depth` tokens in one pass (what a long prompt costs), pp and tg
    on top of it. The difference is what the model costs."""
    RuntimeConfig(threads).apply()
    ops.warmup()
    quant.warmup()
    gc.collect()
    base = _status_kib("VmRSS")
    try:  # restart the peak from here (Linux >= 4.0); without it the peak is still >= base
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    model = MODELS[name]
    path = model.locate()
    lm = load_model(threads=threads, **{model.kind: str(path)})
    cache = lm.new_cache(depth + n_prompt + n_gen)
    tokens = np.random.default_rng(0).integers(1, min(lm.config.vocab_size, 32000), depth + n_prompt).tolist()
    if depth:
        lm.model.forward(tokens[:depth], cache)
    token = int(np.argmax(lm.model.forward(tokens[depth:], cache)))
    for _ in range(n_gen):
        token = int(np.argmax(lm.model.forward([token], cache)))
    return {"model": name, "depth": depth, "file": model_size(path), "kv_cache": cache.nbytes,
            "base": base * 1024, "peak": _status_kib("VmHWM") * 1024}


def memory(model_names, threads: int, n_prompt: int, n_gen: int, depths=(0,)) -> str:
    """Peak resident memory of each model at each depth, each in its own process, against file + KV cache."""
    lines = ["| model | depth | file (MiB) | KV cache (MiB) | peak RSS over pyml's own (MiB) | / (file + KV cache) "
             "| over file + KV cache (MiB) |", "|---|---|---|---|---|---|---|"]
    for name, depth in ((name, depth) for name in model_names for depth in depths):
        MODELS[name].locate()  # build a stand-in here, not inside the measured process
        cmd = [sys.executable, "-m", "pyml.cli.pyml_bench", "--memory-probe", name, "--threads", str(threads),
               "--n-prompt", str(n_prompt), "--n-gen", str(n_gen), "--depth", str(depth)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise PymlError(f"memory probe of {name} failed: {done.stderr.strip().splitlines()[-1:]}")
        m = json.loads(done.stdout.strip().splitlines()[-1])
        model_part, held = m["peak"] - m["base"], m["file"] + m["kv_cache"]
        lines.append(f"| {name} | {depth} | {m['file'] / 2**20:.0f} | {m['kv_cache'] / 2**20:.1f} | "
                     f"{model_part / 2**20:.0f} | {model_part / held:.2f}x | {(model_part - held) / 2**20:+.0f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> Parser:
    p = Parser(prog="pyml-bench", description=__doc__.split("\n")[0])
    p.add_argument("-m", "--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated, from: {', '.join(MODELS)} (or 'all'), or paths of GGUF files")
    p.add_argument("-t", "--threads", default=str(os.cpu_count() or 1), help="comma-separated thread counts")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions per test (default 5); with --log-cost, rounds of each level (default 40)")
    p.add_argument("--tests", default="pp,tg", help="pp, tg or both")
    p.add_argument("-p", "--n-prompt", default="128", help="prompt lengths, comma-separated (pp tests)")
    p.add_argument("-n", "--n-gen", default="128", help="generated tokens, comma-separated (tg tests)")
    p.add_argument("-d", "--depth", default="0",
                   help="context already in the cache before each test, comma-separated (pp512@d4096)")
    p.add_argument("--peers", default="", help="comma-separated: " + ", ".join(e for e in ENGINES if e != "pyml"))
    p.add_argument("--float-compute", choices=list(quant.FLOAT_COMPUTE), default="auto",
                   help="what pyml computes float weights' prefill in (pyml-infer --help; default auto)")
    p.add_argument("--kv-type", choices=list(KV_TYPES), default=DEFAULT_KV_TYPE,
                   help=f"the KV cache's type, pyml's and llama.cpp's (llama-bench's -ctk/-ctv; default "
                        f"{DEFAULT_KV_TYPE}): pp/tg and --batch")
    p.add_argument("--out", default="bench-results", help="directory for bench.md / .csv / .json")
    p.add_argument("--log-cost", action="store_true",
                   help="instead of pp/tg: decode ms/step with LOG off, debug, trace and --profile recording, "
                        "interleaved")
    p.add_argument("--log", metavar="LEVEL", default=None,
                   help="pyml's log level while measuring (or env LOG): the cost of logging, measured")
    p.add_argument("--memory", action="store_true",
                   help="instead of pp/tg: peak resident memory of each model (one process each) "
                        "against its file size + KV cache")
    p.add_argument("--memory-probe", metavar="MODEL", help=argparse.SUPPRESS)  # the child of --memory
    p.add_argument("--batch", metavar="B,B,...", default=None,
                   help="instead of pp/tg: B sequences a step for each B (e.g. 1,4,16): prefill and aggregate "
                        "decode tokens/s, llama-batched-bench's table (-p, -n, --reps as for pp/tg)")
    p.add_argument("--spec", action="store_true",
                   help="instead of pp/tg: decode tok/s with prompt-lookup speculative decoding vs without, "
                        "alternating, on summarise / edit-code / free-chat prompts (-n tokens, --reps; bench_spec.py)")
    p.add_argument("--lookup-ngram", type=int, default=4, metavar="N",
                   help="with --spec: prompt lookup's longest n-gram (default 4, llama.cpp's lookup's largest)")
    p.add_argument("--draft-model", metavar="NAME", default=None,
                   help="with --spec: this bench model (-m's names) drafts instead of prompt lookup")
    p.add_argument("--cold", action="store_true",
                   help="instead of pp/tg: one-shot 16-token runs, each a fresh process (wall, first token, "
                        "load, warm-up, peak RSS, model memory; --peers llama.cpp beside), and the PSS of "
                        "two processes on one model (bench_cold.py)")
    return p


def _table_out(out: str, name: str, table: str) -> int:
    """A table mode's output: written to OUT/name and to stdout."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(table)
    sys.stdout.write(table)
    return 0


def run_bench(args) -> int:
    if args.memory_probe:
        print(json.dumps(memory_probe(args.memory_probe, int(args.threads.split(",")[0]), int(args.n_prompt),
                                      int(args.n_gen), int(args.depth))))
        return 0
    perf.configure(args.log)
    models = list(MODELS) if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise PymlError(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}, or give a "
                        "GGUF file's path")
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    bad = [x for x in peers if x not in ENGINES or x == "pyml"]
    if bad:
        raise PymlError(f"unknown peer(s) {', '.join(bad)}: choose from "
                        + ", ".join(e for e in ENGINES if e != "pyml"))
    threads = _int_list(args.threads, "--threads", 1)
    n_prompts, n_gens = _int_list(args.n_prompt, "--n-prompt", 1), _int_list(args.n_gen, "--n-gen", 1)
    depths = _int_list(args.depth, "--depth", 0)
    kinds = [t.strip() for t in args.tests.split(",") if t.strip() in ("pp", "tg")]
    reps = args.reps if args.reps is not None else 40 if args.log_cost else 5
    if reps < 1 or not kinds:
        raise PymlError("--reps must be >= 1 and --tests one of pp, tg")
    check_output_folder(args.out, "--out")  # not found unwritable after the whole run
    _refuse_what_the_mode_ignores(args)  # the modes that read no --kv-type refuse it here
    others = [x for x in peers if x not in KV_PEERS]
    if args.kv_type != DEFAULT_KV_TYPE and others:
        raise PymlError(f"--kv-type {args.kv_type} with --peers {','.join(others)} is not implemented: of the "
                        f"peers, {' and '.join(KV_PEERS)} take it")
    if args.batch is not None:
        if set(peers) - {"llama.cpp"}:
            raise PymlError(f"--peers {','.join(sorted(set(peers) - {'llama.cpp'}))} with --batch is not "
                            "implemented: its batched peer is llama.cpp")
        batches = _int_list(args.batch, "--batch", 1)
        return _table_out(args.out, "batch.md", batch_table(MODELS, models, threads[0], batches, n_prompts[0],
                                                            n_gens[0], reps, tuple(peers), args.kv_type))
    if args.spec:
        if args.draft_model is not None and args.draft_model not in MODELS:
            raise PymlError(f"unknown --draft-model {args.draft_model}: choose from {', '.join(MODELS)}")
        if args.draft_model is not None and peers:
            raise PymlError("--peers with --spec --draft-model is not implemented: llama.cpp's peer column is its "
                            "prompt lookup")
        if set(peers) - {"llama.cpp"}:
            raise PymlError(f"--peers {','.join(peers)} with --spec is not implemented: llama.cpp's lookup is the one "
                            "peer (llama-cpp-python's LlamaPromptLookupDecoding)")
        return _table_out(args.out, "spec.md", spec_table(MODELS, models, threads[0], n_gens[0], reps,
                                                          ngram=args.lookup_ngram, peers=tuple(peers),
                                                          draft=args.draft_model))
    if args.cold:
        sys.stdout.write(bench_cold.cold(models, MODELS, reps, peers, threads[0], Path(args.out)))
        return 0
    if args.log_cost or args.memory:
        if args.log_cost:
            table, name = "".join(log_cost(models, t, rounds=reps) for t in threads), "log-cost.md"
        else:
            table, name = "".join(memory(models, t, n_prompts[0], n_gens[0], depths) for t in threads), "memory.md"
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(table)
        sys.stdout.write(table)
        return 0
    rows, info = run(models, threads, reps, peers, plan(kinds, n_prompts, n_gens, depths),
                     progress=sys.stderr.isatty(), float_compute=args.float_compute, kv_type=args.kv_type)
    write_outputs(rows, info, peers, Path(args.out))
    sys.stdout.write(markdown(rows, info, peers))
    return 0


# The settings each mode reads (besides -m, --out and --log), and those it reads one value of: any
# other setting given is refused by name, not run past (`--batch 1,4 --depth 512` measured depth 0).
_SETTINGS = {"threads": "-t", "reps": "--reps", "tests": "--tests", "n_prompt": "-p", "n_gen": "-n",
             "depth": "--depth", "peers": "--peers", "float_compute": "--float-compute", "kv_type": "--kv-type",
             "lookup_ngram": "--lookup-ngram", "draft_model": "--draft-model"}
_MODES = {"batch": ("--batch", {"threads", "reps", "n_prompt", "n_gen", "peers", "kv_type"},
                    {"threads", "n_prompt", "n_gen"}),
          "spec": ("--spec", {"threads", "reps", "n_gen", "peers", "lookup_ngram", "draft_model"},
                   {"threads", "n_gen"}),
          "cold": ("--cold", {"threads", "reps", "peers"}, {"threads"}),
          "log_cost": ("--log-cost", {"threads", "reps"}, set()),
          "memory": ("--memory", {"threads", "n_prompt", "n_gen", "depth"}, {"n_prompt", "n_gen"})}
_PP_TG = ("the pp/tg tests", {"threads", "reps", "tests", "n_prompt", "n_gen", "depth", "peers", "float_compute",
                              "kv_type"}, set())


def _refuse_what_the_mode_ignores(args) -> None:
    """One mode a run, and only the settings it reads (_MODES), each with as many values as it takes."""
    chosen = [dest for dest in _MODES if getattr(args, dest) not in (None, False)]
    if len(chosen) > 1:
        raise PymlError(f"{' with '.join(_MODES[d][0] for d in chosen)}: one mode a run")
    mode, reads, one = _MODES[chosen[0]] if chosen else _PP_TG
    defaults = build_parser()
    for dest, flag in _SETTINGS.items():
        value = getattr(args, dest)
        if value == defaults.get_default(dest):
            continue
        if dest not in reads:
            raise PymlError(f"{flag} with {mode} is not implemented: it reads "
                            f"{', '.join(_SETTINGS[d] for d in _SETTINGS if d in reads)}")
        if dest in one and len([x for x in str(value).split(",") if x.strip()]) > 1:
            raise PymlError(f"{flag} {value} with {mode} is not implemented: it takes one value")


def _int_list(text: str, flag: str, low: int) -> list:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PymlError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < low:
        raise PymlError(f"{flag} takes integers >= {low}, got {text!r}")
    return values


def main(argv=None) -> int:
    return run_command("pyml-bench", run_bench, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
