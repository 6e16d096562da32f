"""pyml-cache: see and free what pyml keeps on disk beside the models.

    pyml-cache info     the packed-weights cache's files (docs/performance.md, "Cold start"):
                        size, the model each was packed from, current or stale; and the folders
    pyml-cache clear    delete the packed-weights cache files (the next load of each model packs
                        it again); the models and Numba's compiled kernels are left alone
"""

from __future__ import annotations

import sys

from pyml.cli.main import Parser, run_command
from pyml.nlp.loaders import hub, packed_cache


def build_parser() -> Parser:
    p = Parser(prog="pyml-cache", description="Show or free the packed-weights cache.")
    p.add_argument("action", choices=("info", "clear"), help="info: list the cache files; clear: delete them")
    return p


def run(args) -> int:
    if args.action == "clear":
        files, freed = packed_cache.clear()
        print(f"packed-weights cache {packed_cache.folder()}: {files} file(s) deleted, {freed / 1e6:.1f} MB freed")
        return 0
    entries = packed_cache.entries()
    total = sum(e["bytes"] for e in entries)
    print(f"packed-weights cache {packed_cache.folder()}: {len(entries)} file(s), {total / 1e6:.1f} MB")
    for e in entries:
        print(f"  {e['bytes'] / 1e6:8.1f} MB  {e['state']:<10}  {e['model'] or '?'}  ({e['path'].name})")
    print(f"models: {hub.cache_dir() / 'models'}")
    return 0


def main(argv=None) -> int:
    return run_command("pyml-cache", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
