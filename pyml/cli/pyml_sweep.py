"""pyml-sweep: forward passes over GPT-style model sizes and context lengths, op by op.

The questions of an Nsight sweep, asked of pyml on the CPU: how long a forward
pass takes (the Python wall clock next to the summed op time), which ops take the
most cumulative time, how much of it is matmul, and — inside attention — how the
softmax compares with the matmuls, in time and in FLOPs.

Models are GPT-2 layouts with random weights, built in memory (a TensorStore of
float32 arrays fed to pyml.nlp.models.gpt2.GPT2). A pass is one prefill of `ctx`
tokens from position 0, logits for the last position only, no sampling. Each
configuration's memory is estimated first and the configuration skipped (with a
line saying so) when it would not fit in the available RAM.

    pyml-sweep                                   # small, medium at 128, 256 tokens
    pyml-sweep --sizes small,large --contexts 512,1024 --passes 5 --out sweep/
    pyml-sweep --all                             # every size and context that fits
    pyml-sweep --sizes small --contexts 256,1024,4096   # when does attention, not the FFN, dominate?

Each pass's time is also split into attention (its core: scores, softmax, weighted values, the
KV cache; and its projections) and the feed-forward block, and `attention_share.png` plots the
shares against context length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pyml.cli.main import Parser, run_command
from pyml.cli.options import check_output_folder, check_ray_only
from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.core.runtime import RuntimeConfig
from pyml.nlp.loaders.store import TensorStore
from pyml.nlp.models.gpt2 import GPT2, GPT2Config
from pyml.report import aggregate, plots
from pyml.report.doc import Doc, render_md
from pyml.report.machine import machine_info, memory
from pyml.report.records import normalize

# name -> (d_model, d_ff, n_layers, n_heads): the sizes of the GPT-2 family (as in the Nsight sweep)
SIZES = {"small": (768, 3072, 12, 12), "medium": (1024, 4096, 24, 16), "large": (1280, 5120, 36, 20),
         "xl": (1600, 6400, 48, 25), "2.7B": (2560, 10240, 32, 32)}
CONTEXTS = (128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_SIZES, DEFAULT_CONTEXTS = ("small", "medium"), (128, 256)
SOFTMAX_FLOPS_PER_SCORE = 5     # max, subtract, exp, sum, divide: one each per attention score


@dataclass(frozen=True)
class Shape:
    name: str
    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def params(self) -> int:
        d, f = self.d_model, self.d_ff
        return self.vocab * d + self.n_layers * (4 * d * d + 2 * d * f + 9 * d + f)

    def weight_bytes(self, n_positions: int) -> int:
        return 4 * (self.params + n_positions * self.d_model)

    def pass_bytes(self, ctx: int, all_logits: bool = False) -> int:
        """Peak extra memory of one prefill of ctx tokens: KV cache plus the largest activations."""
        d, f, h = self.d_model, self.d_ff, self.n_heads
        kv = 2 * self.n_layers * ctx * d * 4
        act = 4 * (ctx * 6 * d + 2 * h * ctx * ctx + 2 * ctx * f) + ctx * ctx  # qkv, scores, ffn, mask
        logits = 4 * ctx * self.vocab if all_logits else 4 * self.vocab
        return kv + act + logits

    def attention_flops(self, ctx: int) -> tuple[float, float]:
        """(matmul, softmax) FLOPs of one pass's attention core (Q·Kᵀ and P·V over all layers)."""
        scores = self.n_layers * self.n_heads * ctx * ctx
        return 2 * 2 * scores * self.head_dim, SOFTMAX_FLOPS_PER_SCORE * scores


def available_memory() -> int | None:
    return memory().get("MemAvailable")


def build_gpt2(shape: Shape, n_positions: int, seed: int = 0):
    """A GPT2 with random float32 weights (uniform, std ~0.02), built in memory."""
    rng = np.random.default_rng(seed)
    d, f = shape.d_model, shape.d_ff

    def rnd(*s):
        a = rng.random(s, dtype=np.float32)
        a -= np.float32(0.5)
        a *= np.float32(0.07)
        return a

    def const(n, v):
        return np.full(n, v, np.float32)

    t = {"wte.weight": rnd(shape.vocab, d), "wpe.weight": rnd(n_positions, d),
         "ln_f.weight": const(d, 1.0), "ln_f.bias": const(d, 0.0)}
    for i in range(shape.n_layers):
        p = f"h.{i}"
        t.update({f"{p}.ln_1.weight": const(d, 1.0), f"{p}.ln_1.bias": const(d, 0.0),
                  f"{p}.ln_2.weight": const(d, 1.0), f"{p}.ln_2.bias": const(d, 0.0),
                  f"{p}.attn.c_attn.weight": rnd(d, 3 * d), f"{p}.attn.c_attn.bias": const(3 * d, 0.0),
                  f"{p}.attn.c_proj.weight": rnd(d, d), f"{p}.attn.c_proj.bias": const(d, 0.0),
                  f"{p}.mlp.c_fc.weight": rnd(d, f), f"{p}.mlp.c_fc.bias": const(f, 0.0),
                  f"{p}.mlp.c_proj.weight": rnd(f, d), f"{p}.mlp.c_proj.bias": const(d, 0.0)})
    store = TensorStore({k: (v, "F32") for k, v in t.items()}, source=f"random GPT-2 {shape.name}")
    config = GPT2Config(vocab_size=shape.vocab, n_positions=n_positions, n_embd=d, n_layer=shape.n_layers,
                        n_head=shape.n_heads, n_inner=f)
    return GPT2(config, store)


# --- measuring ------------------------------------------------------------------------------

def _one_pass(model, tokens, all_logits, collect: bool):
    """(wall ms, records or None) of one forward pass over `tokens` from position 0."""
    cache = model.new_cache(len(tokens))
    raws = []
    if collect:
        perf.add_collector(raws.append, level=perf.TRACE)
    try:
        with perf.context(phase="forward"):
            t0 = perf.clock()
            model.forward(tokens, cache, pos=0, all_logits=all_logits)
            wall = (perf.clock() - t0) * 1e3
    finally:
        if collect:
            perf.remove_collector(raws.append)
    return wall, (normalize(raws)[0] if collect else None)


def measure(model, shape: Shape, ctx: int, passes: int, plain_passes: int, all_logits: bool, bar=None) -> dict:
    """Time one configuration: a warm-up pass, `passes` traced passes, `plain_passes` untraced."""
    tokens = np.random.default_rng(ctx).integers(0, shape.vocab, ctx)
    _one_pass(model, tokens, all_logits, collect=True)  # compiles kernels for these shapes, pages in weights
    if bar is not None:
        bar.update(1)
    walls, fwd, records = [], [], []
    for _ in range(passes):
        wall, recs = _one_pass(model, tokens, all_logits, collect=True)
        walls.append(wall)
        fwd.append(next(r.dur_ms for r in recs if r.op == "model"))
        records += recs
        if bar is not None:
            bar.update(1)
    plain = []
    for _ in range(plain_passes):
        plain.append(_one_pass(model, tokens, all_logits, collect=False)[0])
        if bar is not None:
            bar.update(1)
    labels = aggregate.label_table(records)
    cats = aggregate.category_table(records)
    total = sum(v["ms"] for v in labels.values()) or 1.0
    glue = cats.get(aggregate.GLUE, 0.0)
    op_ms = (total - glue) / passes
    matmul = sum(v["ms"] for k, v in labels.items() if k.startswith("matmul"))
    # Q·Kᵀ, softmax and P·V run fused in one tiled kernel (nn/attention_prefill.py): one event
    sdpa = sum(r.dur_ms for r in records if r.name == "attention::sdpa")
    mm_flops, sm_flops = shape.attention_flops(ctx)
    top = sorted(labels.items(), key=lambda kv: -kv[1]["ms"])
    shares = block_shares(records)
    return {
        "config": f"{shape.name}_ctx{ctx}", "size": shape.name, "ctx": ctx, "passes": passes,
        "python_ms": statistics.fmean(walls), "python_min_ms": min(walls),
        "plain_ms": statistics.fmean(plain) if plain else None,
        "forward_ms": statistics.fmean(fwd), "op_ms": op_ms, "glue_ms": glue / passes,
        "matmul_pct": 100 * matmul / total, "sdpa_pct": 100 * sdpa / total,
        "other_ops_pct": 100 * (total - matmul - sdpa - glue) / total, "glue_pct": 100 * glue / total,
        "top_ops": [{"op": k, "count": v["calls"] / passes, "total_ms": v["ms"] / passes,
                     "mean_us": 1e3 * v["ms"] / v["calls"] if v["calls"] else 0.0} for k, v in top],
        "sdpa_ms": sdpa / passes, "flop_ratio_pct": 100 * sm_flops / mm_flops,
        "sdpa_gflop_s": (mm_flops + sm_flops) / (sdpa / passes / 1e3) / 1e9 if sdpa else None,
        "gflop_s": 2 * (shape.params - shape.vocab * shape.d_model) * ctx / (statistics.fmean(walls) / 1e3) / 1e9,
        **shares,
    }


def block_shares(records) -> dict:
    """Shares (%) of the forward passes' time: attention's core (everything in attention but its
    projections), attention's projections, and the feed-forward blocks."""
    forward = sum(r.dur_ms for r in records if r.op == "model") or 1.0
    attention = [r for r in records if r.op == "attention"]
    projections = sum(c.dur_ms for r in attention for c in r.children if c.name.startswith("linear"))
    core = sum(r.dur_ms for r in attention) - projections
    ffn = sum(r.dur_ms for r in records if r.op == "feed_forward")
    return {"attention_core_pct": 100 * core / forward, "attention_proj_pct": 100 * projections / forward,
            "ffn_pct": 100 * ffn / forward}


# --- the report -------------------------------------------------------------------------------------

def _span(values, fmt="{:.0f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _table(headers, rows, align=None):
    doc = Doc("x")
    doc.table(headers, rows, align or "l" + "r" * (len(headers) - 1))
    return render_md(doc).split("\n", 2)[2].strip("\n")


def render(results: list, shapes: dict, skipped: list, meta: dict) -> str:
    out = ["# pyml forward-pass sweep", "",
           f"{meta['machine']} · {meta['threads']} threads · {meta['passes']} traced passes per configuration "
           f"(+1 warm-up, +{meta['plain_passes']} untraced) · vocab {meta['vocab']:,} · random float32 weights · "
           f"one prefill of `ctx` tokens from position 0, logits for the last position only.", "",
           "## Model specifications", "",
           _table(["Size", "d_model", "d_ff", "num_layers", "num_heads", "Params"],
                  [[s.name, s.d_model, s.d_ff, s.n_layers, s.n_heads, f"{s.params / 1e6:,.0f}M"]
                   for s in shapes.values()]), ""]
    if skipped:
        out += ["Skipped:", ""] + [f"- {line}" for line in skipped] + [""]
    if not results:
        return "\n".join(out + ["No configuration ran."]) + "\n"
    out += ["## (a) Forward pass time: Python wall clock vs summed op time", "",
            _table(["config", "python_ms", "untraced_ms", "forward_span_ms", "op_ms", "glue_ms", "op %", "GFLOP/s"],
                   [[r["config"], f"{r['python_ms']:.2f}", f"{r['plain_ms']:.2f}" if r["plain_ms"] else "—",
                     f"{r['forward_ms']:.2f}", f"{r['op_ms']:.2f}", f"{r['glue_ms']:.2f}",
                     f"{100 * r['op_ms'] / r['python_ms']:.1f}", f"{r['gflop_s']:.1f}"] for r in results]), "",
            "*python_ms*: `perf_counter` around `model.forward` with every op traced; *untraced_ms*: the same "
            "with instrumentation off; *forward_span_ms*: the `model::forward` span; *op_ms*: the time inside "
            "op spans (matmuls, norms, softmax, …); *glue_ms*: the rest of the span — Python and NumPy work "
            "between ops, and the timing itself. GFLOP/s counts the linear layers (2·params·tokens).", ""]
    ratios = [r["op_ms"] / r["python_ms"] for r in results]
    over = [r["python_ms"] / r["plain_ms"] - 1 for r in results if r["plain_ms"]]
    out += [f"**Answer:** the op spans account for {_span([100 * x for x in ratios])}% of the "
            f"Python wall clock (mean {100 * statistics.fmean(ratios):.0f}%); the rest is glue between ops."
            + (f" Tracing every op makes a pass {100 * statistics.fmean(over):+.1f}% slower on average than "
               f"untraced." if over else ""), ""]

    out += ["## (b) Top op by cumulative time per forward pass", "",
            _table(["config", "top_op", "count", "total_ms", "mean_us"],
                   [[r["config"], r["top_ops"][0]["op"], f"{r['top_ops'][0]['count']:.0f}",
                     f"{r['top_ops'][0]['total_ms']:.3f}", f"{r['top_ops'][0]['mean_us']:.1f}"] for r in results],
                   "llrrr"), ""]
    tops = {r["top_ops"][0]["op"] for r in results}
    out += [f"**Answer:** the op with the most cumulative time is {', '.join(f'`{t}`' for t in sorted(tops))}"
            f" ({'in every configuration' if len(tops) == 1 else 'depending on the configuration'}); "
            f"count is calls per forward pass (one per layer for a projection).", ""]

    out += ["## (c) Top 5 ops per configuration", "",
            _table(["config", "op", "count", "total_ms", "mean_us"],
                   [[r["config"], o["op"], f"{o['count']:.0f}", f"{o['total_ms']:.3f}", f"{o['mean_us']:.1f}"]
                    for r in results for o in r["top_ops"][:5]], "llrrr"), ""]

    out += ["## (d) Matrix multiplication vs everything else (forward only)", "",
            _table(["config", "matmul %", "attention kernel %", "other ops %", "glue %"],
                   [[r["config"], f"{r['matmul_pct']:.1f}", f"{r['sdpa_pct']:.1f}", f"{r['other_ops_pct']:.1f}",
                     f"{r['glue_pct']:.1f}"] for r in results]), "",
            "*matmul*: the linear projections; *attention kernel*: Q·Kᵀ, softmax and P·V, fused in one tiled "
            "kernel (`attention::sdpa`); *other ops*: norms, GELU, RoPE, KV cache writes, embedding; *glue*: "
            "time between ops. pyml is inference-only, so there is no training-step column.", ""]

    out += ["## (e) Softmax vs matrix multiplication inside self-attention", "",
            _table(["config", "attention kernel ms", "flop_ratio_%", "attention GFLOP/s"],
                   [[r["config"], f"{r['sdpa_ms']:.3f}", f"{r['flop_ratio_pct']:.2f}",
                     f"{r['sdpa_gflop_s']:.1f}" if r["sdpa_gflop_s"] else "—"] for r in results]),
            "",
            "flop_ratio_% = softmax FLOPs / matmul FLOPs × 100, with per layer Q·Kᵀ and P·V = 2 · 2 · n_heads · "
            f"T² · d_head FLOPs and softmax = {SOFTMAX_FLOPS_PER_SCORE} · n_heads · T² (max, subtract, exp, sum, "
            f"divide per score), so the ratio is {SOFTMAX_FLOPS_PER_SCORE}/(4 · d_head) whatever T is. "
            "Attention GFLOP/s counts both over the fused kernel's time. The output projection is a linear layer "
            "and is counted with the projections, not here.", ""]
    out += attention_share_section(results)
    flops = _span([r["flop_ratio_pct"] for r in results], "{:.1f}")
    out += [f"**Answer:** softmax has {flops}% of the attention matmuls' FLOPs. Its time can no longer be "
            "taken apart from theirs: the three run fused, tile by tile, with the softmax computed online "
            "(flash-attention style), so the [heads, T, T] scores never reach memory — which is where an "
            "unfused softmax spends its time (it streams T² scores through several passes, bound by memory "
            "bandwidth, not arithmetic).", ""]
    return "\n".join(out) + "\n"


def attention_share_section(results: list) -> list:
    out = ["## (f) Attention against the feed-forward block, by context length", "",
           _table(["config", "attention core %", "attention projections %", "feed-forward %"],
                  [[r["config"], f"{r['attention_core_pct']:.1f}", f"{r['attention_proj_pct']:.1f}",
                    f"{r['ffn_pct']:.1f}"] for r in results]), "",
           "Shares of the forward pass. *attention core*: Q·Kᵀ, softmax, P·V and the KV cache (it grows as T² "
           "in a prefill); *projections*: q/k/v/o (grow as T, like the feed-forward block).", ""]
    answers = []
    for size in dict.fromkeys(r["size"] for r in results):
        rows = [r for r in results if r["size"] == size]
        over = [r["ctx"] for r in rows if r["attention_core_pct"] > r["ffn_pct"]]
        answers.append(f"{size}: from {over[0]} tokens" if over else
                       f"{size}: not up to {rows[-1]['ctx']} tokens (core {rows[-1]['attention_core_pct']:.0f}% vs "
                       f"FFN {rows[-1]['ffn_pct']:.0f}% there)")
    out += ["**Answer:** attention's core takes more time than the feed-forward block — " + "; ".join(answers)
            + ".", ""]
    return out


# --- the command ------------------------------------------------------------------------------------

def _names(text, allowed, kind):
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in allowed]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown {kind} {', '.join(bad) or repr(text)}: use "
                                         f"{', '.join(map(str, allowed))}")
    return out


def _contexts(text):
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--contexts takes comma-separated token counts >= 1, got {text!r}")
    return out


def build_parser():
    p = Parser(prog="pyml-sweep", description="Forward passes over GPT-style model sizes and context lengths "
                "(random weights, no sampling): time per pass, top ops, matmul share, softmax vs matmul.")
    p.add_argument("--sizes", type=lambda s: _names(s, list(SIZES), "size"), default=list(DEFAULT_SIZES),
                   help=f"comma-separated, of {', '.join(SIZES)} (default {','.join(DEFAULT_SIZES)})")
    p.add_argument("--contexts", type=_contexts,
                   default=list(DEFAULT_CONTEXTS),
                   help=f"comma-separated token counts (default {','.join(map(str, DEFAULT_CONTEXTS))}; "
                        f"--all: {', '.join(map(str, CONTEXTS))})")
    p.add_argument("--all", action="store_true", help="every size and context (those that fit in memory)")
    p.add_argument("--passes", type=int, default=3, help="traced passes per configuration (default 3)")
    p.add_argument("--plain-passes", type=int, default=1, help="untraced passes per configuration (default 1)")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary size (default GPT-2's 50257)")
    p.add_argument("--all-logits", action="store_true", help="project every position to logits, not just the last")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--out", metavar="DIR", default="pyml-sweep", help="where sweep.md and sweep.json go "
                   "(default ./pyml-sweep)")
    p.add_argument("--ray", action="store_true", help="run each configuration as a Ray task with --threads threads "
                   '(default: a node\'s cores; needs pip install "pyml[ray]"; docs/scaling.md)')
    p.add_argument("--address", default=None,
                   help="with --ray: a Ray cluster's address (default: RAY_ADDRESS, else a local instance)")
    return p


def run(args) -> int:
    if args.passes < 1 or args.plain_passes < 0:
        raise PymlError("--passes must be at least 1 and --plain-passes at least 0")
    check_ray_only(args, "address")
    check_output_folder(args.out, "--out")
    # Ray is reached (or found missing) before any output
    with _ray_runner().session(args.address) if args.ray else nullcontext():
        return _sweep(args)


def _sweep(args) -> int:
    sizes = list(SIZES) if args.all else args.sizes
    contexts = list(CONTEXTS) if args.all else sorted(args.contexts)
    shapes = {n: Shape(n, *SIZES[n], vocab=args.vocab) for n in sizes}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = Grid(shapes, contexts, args.passes, args.plain_passes, args.all_logits)
    bar = tqdm(total=len(sizes) * len(contexts) * grid.per_config, unit="pass", file=sys.stderr, desc="sweep")
    measure_grid = _measure_on_ray if args.ray else _measure_here
    results, threads = measure_grid(args, grid, bar)
    bar.close()
    return _write(args, out, results, shapes, grid.skipped, threads)


@dataclass
class Grid:
    """The sweep's configurations, and the lines saying which of them were skipped."""
    shapes: dict
    contexts: list
    passes: int
    plain_passes: int
    all_logits: bool
    skipped: list = field(default_factory=list)

    @property
    def n_positions(self) -> int:
        return max(self.contexts)

    @property
    def per_config(self) -> int:
        return 1 + self.passes + self.plain_passes

    def fitting(self, shape: Shape, bar) -> list:
        """The contexts whose pass fits in the available memory now; a skip line for each other."""
        avail = available_memory()
        need = {c: shape.weight_bytes(self.n_positions) + shape.pass_bytes(c, self.all_logits) for c in self.contexts}
        fits = [c for c in self.contexts if avail is None or 1.2 * need[c] < avail]
        for c in self.contexts:
            if c not in fits:
                self.skipped.append(f"{shape.name} ctx={c}: needs ~{need[c] / 2**30:.1f} GiB with a 20% margin "
                                    f"over {1.2 * need[c] / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available")
                bar.write(f"pyml-sweep: skip {self.skipped[-1]}", file=sys.stderr)
                bar.update(self.per_config)
        return fits


def _measure_here(args, grid: Grid, bar) -> tuple[list, int]:
    """One size after another in this process, each model built once for all its contexts."""
    runtime = RuntimeConfig(args.threads if args.threads is not None else RuntimeConfig().threads).apply()
    runtime.warmup_thread_pool()
    results = []
    for name, shape in grid.shapes.items():
        fits = grid.fitting(shape, bar)
        if not fits:
            continue
        bar.set_description(f"building {name}")
        model = build_gpt2(shape, grid.n_positions)
        for c in fits:
            bar.set_description(f"{name} ctx={c}")
            results.append(measure(model, shape, c, grid.passes, grid.plain_passes, grid.all_logits, bar))
        del model
    return results, runtime.threads


def measure_point(shape: Shape, ctx: int, n_positions: int, passes: int, plain_passes: int, all_logits: bool,
                  threads: int) -> dict:
    """One configuration on its own, as a Ray task runs it: its threads, its model, its measurement."""
    RuntimeConfig(threads).apply().warmup_thread_pool()
    model = build_gpt2(shape, n_positions)
    return measure(model, shape, ctx, passes, plain_passes, all_logits)


def _measure_on_ray(args, grid: Grid, bar) -> tuple[list, int]:
    """The grid's points as Ray tasks, one each with --threads threads; results in grid order."""
    ray_runner = _ray_runner()
    threads = args.threads or ray_runner.node_cpus()
    points = [(shape, c, grid.n_positions, grid.passes, grid.plain_passes, grid.all_logits, threads)
              for shape in grid.shapes.values() for c in grid.fitting(shape, bar)]
    results = [None] * len(points)
    for i, result in ray_runner.run_tasks(measure_point, points, threads):
        results[i] = result
        bar.update(grid.per_config)
    return results, threads


def _ray_runner():
    # Deferred: `import ray` costs ~1.0 s, and only --ray needs it.
    from pyml.cli import ray_runner
    return ray_runner


def _write(args, out: Path, results, shapes, skipped, threads: int) -> int:
    mach = machine_info()
    meta = {"machine": f"{mach['cpu']} ({mach['usable_cores']} cores)", "threads": threads,
            "passes": args.passes, "plain_passes": args.plain_passes, "vocab": args.vocab,
            "all_logits": args.all_logits, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": sys.argv, "machine_info": mach}
    text = render(results, shapes, skipped, meta)
    (out / "sweep.md").write_text(text)
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "results": results, "skipped": skipped},
                                               indent=1, default=str) + "\n")
    print(out / "sweep.md")
    print(out / "sweep.json")
    if results and plots.matplotlib_available():
        print(out / plots.attention_share_plot(results, out)[0])
    elif results:
        print(f"pyml-sweep: {plots.MATPLOTLIB_MISSING}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_command("pyml-sweep", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
