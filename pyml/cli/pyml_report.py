"""pyml-report: reports from a profile directory or a saved `LOG=trace` log; `compare A B`.

    pyml-report prof/                      # report.md modules.md jitter.md trace.json *.png into prof/
    pyml-report run.log --format html      # from a saved stderr log, into run-report/
    pyml-report compare cold/ warm/        # two runs side by side, to stdout
"""

from __future__ import annotations

import argparse
import json
import sys

from pyml.cli.main import Parser, run_command
from pyml.core.errors import PymlError
from pyml.report import FORMATS, load_run, write_reports
from pyml.report.compare import compare
from pyml.report.doc import render_html, render_md


def _formats(text: str) -> tuple:
    out = tuple(f.strip() for f in text.split(",") if f.strip())
    bad = [f for f in out if f not in FORMATS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown format {','.join(bad) or text!r}: use {', '.join(FORMATS)}")
    return out


def report_parser() -> Parser:
    p = Parser(prog="pyml-report", description="Where the time went: reports from a pyml profile directory "
                "(pyml.profile / pyml-infer --profile) or a saved LOG=trace stderr log. "
                "`pyml-report compare A B` puts two runs side by side.")
    p.add_argument("source", metavar="DIR_OR_LOG", help="profile directory, events.jsonl, or a saved log")
    p.add_argument("--out", metavar="DIR", help="where to write (default: the profile directory, or "
                   "LOGNAME-report/ beside a log)")
    p.add_argument("--format", type=_formats, default=("md",), metavar="md|json|html",
                   help="report formats, comma-separated (default md); trace.json and plots are always written")
    p.add_argument("--layer", type=int, default=None, help="layer for the per-op breakdown (default: the middle one)")
    p.add_argument("--top", type=int, default=30, help="modules listed in modules.md (default 30)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return p


def compare_parser() -> Parser:
    p = Parser(prog="pyml-report compare", description="Two runs side by side (cold vs warm, before vs after, "
                "two quant types): total measured time and its change, hotspots, per-module deltas.")
    p.add_argument("a", metavar="A", help="the first run (BEFORE): profile directory or saved log")
    p.add_argument("b", metavar="B", help="the second run (AFTER)")
    p.add_argument("--labels", default="BEFORE,AFTER", help="names of the two runs (default BEFORE,AFTER)")
    p.add_argument("--format", choices=["md", "json", "html"], default="md")
    p.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--top", type=int, default=20, help="rows per table (default 20)")
    return p


def run_report(args) -> int:
    run = load_run(args.source)
    written = write_reports(run, args.out, formats=args.format, plots=not args.no_plots, layer=args.layer,
                            top=args.top)
    for path in written:
        print(path)
    return 0


def run_compare(args) -> int:
    labels = tuple(x.strip() for x in args.labels.split(","))
    if len(labels) != 2 or not all(labels):
        raise PymlError(f"--labels takes two names separated by a comma, got {args.labels!r}")
    doc, numbers = compare(load_run(args.a), load_run(args.b), labels, args.top)
    if args.format == "json":
        text = json.dumps(numbers, indent=1, default=str) + "\n"
    else:
        text = (render_md if args.format == "md" else render_html)(doc)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(text)
        except OSError as e:
            raise PymlError(f"cannot write {args.out}: {e.strerror}") from None
        print(args.out)
    else:
        sys.stdout.write(text)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return run_command("pyml-report compare", run_compare, compare_parser().parse_args(argv[1:]))
    return run_command("pyml-report", run_report, report_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
