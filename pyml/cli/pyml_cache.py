"""pyml-cache: see, fill and free what pyml keeps on disk beside the models.

    pyml-cache info     the packed-weights cache's files (docs/performance.md, "Cold start"):
                        size, the model each was packed from, current or stale; the compiled
                        kernels' folders (files, size, functions compiled from these sources); the
                        models' folder
    pyml-cache warm [-m MODEL]
                        compile (or load) every kernel a model's load, prefill and decode use, so
                        that its first real run starts at once; packs its weights too
    pyml-cache clear    delete the packed-weights cache files (the next load of each model packs
                        it again); the models and Numba's compiled kernels are left alone
"""

from __future__ import annotations

import sys

from pyml.cli.main import Parser, run_command
from pyml.cli.options import add_model_options, model_options
from pyml.core import compiles, isa, jit
from pyml.nlp.api import load_model
from pyml.nlp.loaders import hub, packed_cache


def build_parser() -> Parser:
    p = Parser(prog="pyml-cache", description="Show, fill or free what pyml caches: packed weights, kernels.")
    p.add_argument("action", choices=("info", "warm", "clear"),
                   help="info: list the caches; warm: compile a model's kernels ahead of its first run; "
                        "clear: delete the packed-weights files")
    add_model_options(p)
    return p


def run(args) -> int:
    if args.action == "warm":
        return warm(args)
    if args.action == "clear":
        files, freed = packed_cache.clear()
        print(f"packed-weights cache {packed_cache.folder()}: {files} file(s) deleted, {freed / 1e6:.1f} MB freed")
        return 0
    entries = packed_cache.entries()
    total = sum(e["bytes"] for e in entries)
    print(f"packed-weights cache {packed_cache.folder()}: {len(entries)} file(s), {total / 1e6:.1f} MB")
    for e in entries:
        print(f"  {e['bytes'] / 1e6:8.1f} MB  {e['state']:<10}  {e['model'] or '?'}  ({e['path'].name})")
    for folder in jit.kernel_cache_folders():
        k = jit.kernel_cache_entries(folder)
        print(f"kernels {folder}: {k['files']} file(s), {k['bytes'] / 1e6:.1f} MB, "
              f"{k['current']} function(s) compiled from these sources for {isa.ISA}")
    print(f"models: {hub.cache_dir() / 'models'}")
    return 0


def warm(args) -> int:
    """Load the model (its decode step's kernels), then warm the prefill's: what a first
    `pyml-infer` would otherwise compile while the user waits."""
    before_kernels, before_s = compiles.kernels() + compiles.elsewhere(), compiles.seconds()
    lm = load_model(**model_options(args))
    lm.warm_up(prefill=True)
    # with 2+ threads a helper process compiles the prefill's kernels meanwhile: counted as well
    n, secs = compiles.kernels() + compiles.elsewhere() - before_kernels, compiles.seconds() - before_s
    what = f"compiled {n} kernels in {secs:.1f} s" if n else "every kernel was already compiled"
    print(f"pyml-cache warm: {lm.source}: {what}; load {lm.load_s:.2f} s, warm-up {lm.warmup_s:.2f} s "
          f"({isa.ISA})")
    return 0


def main(argv=None) -> int:
    return run_command("pyml-cache", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
