"""pyml-bench --cold: what a one-shot run pays before and around its first token, pyml beside
llama-cpp-python on the same file.

Each run is a fresh Python process (`python -c PROBE`: nothing imported before the clock starts)
that imports its engine, loads the model, warms up (pyml: load_model's decode step, and a
prefill's kernels before a prompt of more than one token), and streams `n_gen` greedy tokens from a short prompt, then exits. Measured:
- wall: spawn to exit, as a user's shell sees it (interpreter start-up included);
- first token: spawn to the first generated token;
- import / load / warm-up: the engine's own phases, seconds;
- peak RSS (VmHWM) and "model memory": the peak minus the RSS right after the imports, i.e.
  what loading and running the model cost beyond the engine's code; and where the RSS added
  since the imports sits at the end of the run (/proc/self/smaps): the model's file mappings
  (GGUF, packed-weights cache), shared libraries' pages (pyml: LLVM's object loader, through
  which Numba loads each cached kernel), heap and anonymous memory.
Engines alternate run by run (the machine is shared and noisy); the table gives medians.

Then the sharing check: two pyml processes on one model, alive at once; /proc/<pid>/smaps gives
each one's PSS (a shared page counts 1/n in each of the n processes that map it), in total
and for the model's own mappings (the GGUF file and its packed-weights cache file).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pyml.core.errors import PymlError
from pyml.nlp.loaders import packed_cache

# The probe runs in a fresh interpreter, so it may import nothing before it starts the clock:
# it is source text, not a function of this module (importing this module imports pyml).
PROBE = r'''
import json, sys, time
engine, path, n_gen, spawned, hold, threads = (sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]),
                                                sys.argv[5] == "hold", int(sys.argv[6]))
def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
def resident():  # RSS in bytes by kind of mapping: the model's files, shared libraries, heap and anonymous
    kinds, kind = {"files": 0, "libraries": 0, "heap": 0}, "heap"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                name = head[5] if len(head) > 5 else ""
                kind = ("files" if name.endswith((".gguf", ".pyml-packed")) else
                        "libraries" if name.startswith("/") else "heap")
            elif head and head[0] == "Rss:":
                kinds[kind] += int(head[1]) * 1024
    return kinds
t0 = time.time()
out = {"start": t0 - spawned}
if engine == "pyml":
    from pyml.nlp.api import load_model
    out["import"], out["rss_imports"] = time.time() - t0, status_kib("VmRSS") * 1024
    before = resident()
    t = time.time()
    lm = load_model(gguf=path, threads=threads)
    out["load"] = lm.load_s
    stream = (e for e in lm.stream("Hello", n_gen) if e.text or e.result)
else:
    from llama_cpp import Llama
    out["import"], out["rss_imports"] = time.time() - t0, status_kib("VmRSS") * 1024
    before = resident()
    t = time.time()
    llm = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    out["load"], out["warmup"] = time.time() - t, 0.0
    stream = llm.create_completion("Hello", max_tokens=n_gen, temperature=0.0, stream=True)
for i, _ in enumerate(stream):
    if i == 0:
        out["first_token"] = time.time() - spawned
if engine == "pyml":
    out["warmup"] = lm.warmup_s  # load_model's decode step, and the prefill's if the prompt needed one
out["peak"] = status_kib("VmHWM") * 1024
out.update({f"added_{k}": v - before[k] for k, v in resident().items()})  # at the end: the peak, give or take
print(json.dumps(out), flush=True)
if hold:
    sys.stdin.readline()
'''

ONE_SHOT_TOKENS = 16  # issue 17's one-shot run: `pyml-infer -p Hello -n 16`
ENGINE_NAMES = {"pyml": "pyml", "llama.cpp": "llama-cpp-python"}


def probe(engine: str, path: Path, n_gen: int, threads: int, hold: bool = False) -> tuple[subprocess.Popen, dict, float]:
    """Start one fresh process; returns it (still alive when `hold`), its figures, and the spawn time."""
    spawned = time.time()
    proc = subprocess.Popen([sys.executable, "-c", PROBE, engine, str(path), str(n_gen), repr(spawned),
                             "hold" if hold else "once", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        err = proc.communicate()[1].strip().splitlines()
        raise PymlError(f"cold-start probe of {engine} on {path.name} failed: {err[-1] if err else 'no output'}")
    return proc, json.loads(line), spawned


def one_shot(engine: str, path: Path, n_gen: int, threads: int) -> dict:
    proc, figures, spawned = probe(engine, path, n_gen, threads)
    proc.communicate()
    figures["wall"] = time.time() - spawned
    figures["model_memory"] = figures["peak"] - figures["rss_imports"]
    return figures


def pss(pid: int, model_files: list[str]) -> tuple[int, int]:
    """(total PSS, PSS of the mappings of `model_files`) of a process, in bytes."""
    total = model = 0
    current = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
                current = head[5] if len(head) > 5 else None
            elif head and head[0] == "Pss:":
                kib = int(head[1])
                total += kib
                if current in model_files:
                    model += kib
    return total * 1024, model * 1024


def sharing(path: Path, n_gen: int, threads: int) -> dict:
    """PSS of one pyml process on the model, then of each of two alive at once."""
    files = [str(Path(path).resolve()), str(packed_cache.cache_path(packed_cache.model_files(Path(path))))]
    first, _, _ = probe("pyml", path, n_gen, threads, hold=True)
    second = None
    try:
        alone = pss(first.pid, files)
        second, _, _ = probe("pyml", path, n_gen, threads, hold=True)
        both = [pss(first.pid, files), pss(second.pid, files)]
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.communicate("\n")
    return {"alone": alone, "both": both}


def run(models: dict, reps: int, n_gen: int, peers: list[str], threads: int) -> str:
    """The cold-start table for `models` ({name: GGUF path}) and the PSS check, as markdown."""
    engines = ["pyml", *peers]
    for name, path in models.items():  # a first load packs and compiles: not what a cold start measures
        one_shot("pyml", path, 1, threads)
    lines = ["| model | engine | wall (s) | first token (s) | import (s) | load (s) | warm-up (s) | "
             "RSS after imports (MB) | peak RSS (MB) | model memory (MB) | of it: model files | libraries | heap + anon |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for name, path in models.items():
        runs = {e: [] for e in engines}
        for rep in range(reps):
            for engine in engines if rep % 2 == 0 else engines[::-1]:
                runs[engine].append(one_shot(engine, path, n_gen, threads))
        medians = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for e, rs in runs.items()}
        for engine, m in medians.items():
            lines.append(f"| {name} | {ENGINE_NAMES[engine]} | {m['wall']:.2f} | {m['first_token']:.2f} | "
                         f"{m['import']:.2f} | {m['load']:.3f} | {m['warmup']:.3f} | {m['rss_imports'] / 1e6:.0f} | "
                         f"{m['peak'] / 1e6:.0f} | {m['model_memory'] / 1e6:.0f} | {m['added_files'] / 1e6:.0f} | "
                         f"{m['added_libraries'] / 1e6:.0f} | {m['added_heap'] / 1e6:.0f} |")
        if "llama.cpp" in medians:
            p, q = medians["pyml"], medians["llama.cpp"]
            ratios.append(f"{name}: wall {p['wall'] / q['wall']:.2f}x, model memory "
                          f"{p['model_memory'] / q['model_memory']:.2f}x llama-cpp-python's")
    out = "\n".join(lines) + "\n\n" + "".join(f"- {r}\n" for r in ratios)
    name, path = next(iter(models.items()))
    shared = sharing(path, n_gen, threads)
    (total1, model1), [(ta, ma), (tb, mb)] = shared["alone"], shared["both"]
    out += (f"\nTwo pyml processes on {name} (PSS, MB): one alone {total1 / 1e6:.0f} (model mappings "
            f"{model1 / 1e6:.0f}); two at once {ta / 1e6:.0f} + {tb / 1e6:.0f} (model mappings "
            f"{ma / 1e6:.0f} + {mb / 1e6:.0f}): the second adds {(ta + tb - total1) / 1e6:.0f} MB in all, "
            f"{(ma + mb - model1) / 1e6:.0f} MB of it for the model's pages.\n")
    return out


def cold(model_names: list[str], model_table: dict, reps: int, peers: list[str], threads: int, out_dir: Path,
         n_gen: int = ONE_SHOT_TOKENS) -> str:
    """pyml-bench --cold: the table for the GGUF models among `model_names`, written to cold.md."""
    if any(p != "llama.cpp" for p in peers):
        raise PymlError("--cold compares with llama.cpp only (--peers llama.cpp)")
    paths = {}
    for name in model_names:
        model = model_table[name]
        if model.kind != "gguf":
            raise PymlError(f"--cold runs GGUF models (llama-cpp-python reads those): {name} is {model.kind}")
        paths[name] = Path(model.locate())
    table = run(paths, reps, n_gen, peers, threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cold.md").write_text(table)
    return table
