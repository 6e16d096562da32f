"""pyml-report: reports from a profile directory or a saved `LOG=trace` log; `compare A B`.

    pyml-report prof/                      # report.md modules.md jitter.md trace.json *.png into prof/
    pyml-report run.log --format html      # from a saved stderr log, into run-report/
    pyml-report compare cold/ warm/        # two runs side by side, to stdout
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from pyml.core.errors import PymlError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        self.exit(2, f"{self.prog}: error: {message}\n")


def _formats(text: str) -> tuple:
    from pyml.nlp.report import FORMATS
    out = tuple(f.strip() for f in text.split(",") if f.strip())
    bad = [f for f in out if f not in FORMATS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown format {','.join(bad) or text!r}: use {', '.join(FORMATS)}")
    return out


def report_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pyml-report", description="Where the time went: reports from a pyml profile directory "
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
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def compare_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pyml-report compare", description="Two runs side by side (cold vs warm, before vs after, "
                "two quant types): total measured time and its change, hotspots, per-module deltas.")
    p.add_argument("a", metavar="A", help="the first run (BEFORE): profile directory or saved log")
    p.add_argument("b", metavar="B", help="the second run (AFTER)")
    p.add_argument("--labels", default="BEFORE,AFTER", help="names of the two runs (default BEFORE,AFTER)")
    p.add_argument("--format", choices=["md", "json", "html"], default="md")
    p.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--top", type=int, default=20, help="rows per table (default 20)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def run_report(args) -> int:
    from pyml.nlp.report import load_run, write_reports
    run = load_run(args.source)
    written = write_reports(run, args.out, formats=args.format, plots=not args.no_plots, layer=args.layer,
                            top=args.top)
    for path in written:
        print(path)
    return 0


def run_compare(args) -> int:
    from pyml.nlp.report import load_run
    from pyml.nlp.report.compare import compare
    from pyml.nlp.report.doc import render_html, render_md
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
        args, fn, prog = compare_parser().parse_args(argv[1:]), run_compare, "pyml-report compare"
    else:
        args, fn, prog = report_parser().parse_args(argv), run_report, "pyml-report"
    try:
        return fn(args)
    except PymlError as e:
        if args.debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an internal error: still one line unless --debug
        if args.debug:
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {e} (run with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
