"""write_reports: every report of one run into a directory.

Markdown/HTML: report, modules, jitter; JSON: one report.json with every table; always
trace.json (Chrome / Perfetto), and the plots when matplotlib is importable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pyml.report import chrome, findings, pages
from pyml.report.plots import MATPLOTLIB_MISSING, matplotlib_available, write_plots
from pyml.report.doc import render_html, render_md
from pyml.report.records import ReportInputError, Run, load_run
from pyml.report.timing import measure_timing_overhead

FORMATS = ("md", "json", "html")


def _out_dir(run: Run, out) -> Path:
    if out is not None:
        return Path(out)
    src = Path(run.source)
    return src if src.is_dir() else src.with_name(src.stem + "-report")


def write_reports(source, out_dir=None, formats=("md",), plots: bool = True, layer: int | None = None,
                  top: int = 30, log=sys.stderr) -> list:
    """Write the reports for a run (a Run, or a path for load_run); returns the files written.

    Markdown/HTML: report, modules, jitter; JSON: one report.json with every table.
    Always: trace.json, and the plots when matplotlib is importable (else one line to `log`).
    """
    run = source if isinstance(source, Run) else load_run(source)
    for f in formats:
        if f not in FORMATS:
            raise ReportInputError(f"unknown report format {f!r}: use {', '.join(FORMATS)}")
    out = _out_dir(run, out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportInputError(f"cannot write reports into {out}: {e.strerror}") from None
    timing, timing_src = pages.timing_of(run)
    if timing is None:
        timing = measure_timing_overhead(with_lines=run.kind == "log")
        timing_src = "measured on this machine when the report was written, not during the run"
    written = []
    pngs = []
    if plots:
        if matplotlib_available():
            pngs = write_plots(run, out)
            written += [out / name for name, _ in pngs]
        elif log is not None:
            print(MATPLOTLIB_MISSING, file=log)
    ranking = findings.bottlenecks(run, timing)  # once: every page names the same first bottleneck
    docs = {"report": pages.report_page(run, layer, timing, timing_src, pngs, ranking),
            "modules": pages.modules_page(run, top, ranking), "jitter": pages.jitter_page(run, ranking)}
    for fmt in formats:
        if fmt == "json":
            path = out / "report.json"
            path.write_text(json.dumps(pages.report_json(run, layer, timing, ranking), indent=1, default=str) + "\n")
            written.append(path)
            continue
        render = render_md if fmt == "md" else render_html
        for name, doc in docs.items():
            path = out / f"{name}.{fmt}"
            path.write_text(render(doc))
            written.append(path)
    path = out / "trace.json"
    chrome.write_chrome_trace(run, path)
    written.append(path)
    return written
