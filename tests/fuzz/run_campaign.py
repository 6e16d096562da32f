"""The long fuzz campaign: coverage-guided (atheris / libFuzzer) on the GGUF and safetensors loaders.

    python tests/fuzz/run_campaign.py --target gguf --minutes 10
    python tests/fuzz/run_campaign.py --target safetensors --minutes 10
    python tests/fuzz/run_campaign.py --target gguf-model --minutes 10   # load, then run the model

Seeds: the small valid files of gguf_build / strategies, a sample of hypothesis-generated
hostile files, and the headers of the real model files when they are in the cache.
libFuzzer mutates them byte by byte, guided by the branches it reaches in gguf-py and
pyml's loaders. Every input goes through harness.check: an input that breaks a property is
saved to tests/fuzz/corpus/<kind>/ (replayed by test_fuzz_corpus.py) and the campaign goes
on; a hard crash (a segfault) stops it with the input saved by libFuzzer as crash-*.
With --model the Numba kernels run with bounds checks (NUMBA_BOUNDSCHECK=1), so a read
past a weight buffer is an IndexError, a finding, not a silent wrong answer.

At the end one line of figures: inputs run, seconds, findings (docs/reliability.md cites them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPUS = HERE / "corpus"


def seeds(target: str, out: Path, n_generated: int = 200):
    """Write the starting corpus for `target` into out/."""
    from hypothesis import HealthCheck, given, settings

    from tests.fuzz import gguf_build as gb
    from tests.fuzz import strategies as sx
    out.mkdir(parents=True, exist_ok=True)
    made = []
    if target.startswith("gguf"):
        for name, opts in {"q4_0": dict(weight_type=2), "q4_1": dict(weight_type=3), "q8_0": dict(weight_type=8),
                           "f16": dict(weight_type=1),
                           "kquant": dict(hidden=256, ffn=256, weight_type=12, embed_type=14)}.items():
            made.append((f"seed-{name}.gguf", gb.tiny_llama(**opts)))
        cache = Path(os.environ.get("PYML_CACHE", Path.home() / ".cache" / "pyml")) / "models"
        for real in ("SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"):
            if (cache / real).is_file():
                made.append((f"seed-real-{real}", gb.real_header_spec(cache / real).encode()))
        strategy = sx.gguf_files()
    else:
        header, size = sx.valid_safetensors_header()
        made.append(("seed-valid.safetensors", sx.safetensors_bytes(header, b"\x01" * size)))
        strategy = sx.safetensors_files()
    generated = []

    @settings(max_examples=n_generated, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        generated.append(bytes(case))

    collect()
    made += [(f"gen-{i:04d}", raw) for i, raw in enumerate(generated)]
    for name, raw in made:
        (out / name).write_bytes(raw)
    return len(made)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=["gguf", "gguf-model", "safetensors"], default="gguf")
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--workdir", default=None, help="working corpus (default: a fresh temporary directory)")
    p.add_argument("--figures", default=None, help="append the run's figures as one JSON line to this file")
    args, libfuzzer_args = p.parse_known_args(argv)
    model = args.target == "gguf-model"
    if model:
        os.environ["NUMBA_BOUNDSCHECK"] = "1"
        os.environ["NUMBA_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "pyml-fuzz-numba-boundscheck")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    import atheris

    # instrument gguf-py and pyml for coverage: they must be first imported inside this block.
    # Not pyml.core / pyml.quant (atheris excludes exact module names): Numba cannot compile
    # bytecode that atheris has rewritten.
    jitted = [f"pyml.{p.parent.name}" + ("" if p.stem == "__init__" else f".{p.stem}")
              for d in ("core", "quant") for p in (ROOT / "pyml" / d).glob("*.py")]
    with atheris.instrument_imports(include=["gguf", "pyml"], exclude=jitted):
        import gguf  # noqa: F401
        import pyml.nlp.loaders.gguf  # noqa: F401
        import pyml.nlp.loaders.safetensors  # noqa: F401
        import pyml.nlp.models  # noqa: F401
        import pyml.nlp.tokenizer  # noqa: F401
        from tests.fuzz import harness

    kind = "safetensors" if args.target == "safetensors" else "gguf"
    suffix = ".safetensors" if kind == "safetensors" else ".gguf"
    work = Path(args.workdir or tempfile.mkdtemp(prefix=f"pyml-fuzz-{args.target}-"))
    n_seeds = seeds(args.target, work)
    findings_dir = CORPUS / kind
    findings_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="pyml-fuzz-input-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    input_path = scratch / f"input{suffix}"

    # compile every kernel once before the clock starts (the JIT is not what is being timed)
    if model:
        from tests.fuzz.gguf_build import tiny_llama
        for opts in (dict(weight_type=2), dict(weight_type=3), dict(weight_type=8), dict(weight_type=1),
                     dict(hidden=256, ffn=256, weight_type=12, embed_type=14)):
            tiny_llama(input_path, **opts)
            harness.check(input_path, model=True)
        harness.SLOW_S = 10.0

    stats = {"target": args.target, "inputs": 0, "accepted": 0, "rejected": 0, "findings": 0, "seeds": n_seeds}
    t0 = time.time()
    budget = args.minutes * 60

    def one_input(data: bytes):
        if time.time() - t0 > budget:
            report()
            os._exit(0)  # libFuzzer's own exit skips atexit handlers
        stats["inputs"] += 1
        input_path.write_bytes(data)
        try:
            outcome = harness.check(input_path, model=model)
            stats["accepted" if outcome == "ok" else "rejected"] += 1
        except Exception as e:  # noqa: BLE001 - a finding: keep it and go on
            stats["findings"] += 1
            digest = hashlib.sha1(data).hexdigest()[:16]
            target = findings_dir / f"found-{args.target}-{digest}{suffix}"
            if not target.exists():
                target.write_bytes(data)
                print(f"\nFINDING {target.name}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
        if stats["inputs"] % 5000 == 0:
            print(f"[campaign] {stats} after {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    def report():
        stats["seconds"] = round(time.time() - t0, 1)
        line = json.dumps(stats)
        print(f"[campaign] done: {line}", file=sys.stderr, flush=True)
        if args.figures:
            with open(args.figures, "a") as f:
                f.write(line + "\n")

    atheris.Setup([sys.argv[0], str(work),
                   f"-artifact_prefix={findings_dir}/crash-{args.target}-", "-rss_limit_mb=4096",
                   f"-timeout={120 if model else 30}",  # in model mode a new kernel signature compiles first
                   "-max_len=400000", "-print_final_stats=1", *libfuzzer_args], one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
