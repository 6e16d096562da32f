"""Reports from perf records: where the time of a run went.

    import pyml
    with pyml.profile("prof/") as prof: ...       # capture.py: events.jsonl, run.json
    from pyml.report import write_reports
    write_reports("prof/")            # a pyml.profile directory, an events.jsonl, or a LOG=trace log

capture   - pyml.profile: a collector writing every perf record of a run, and run.json
timing    - what the timing itself costs (stated in every report); machine - what a run ran on
records   - loading events.jsonl / parsing saved logs into one list of records (old_logs: the
            lines of logs written before the context tail existed)
aggregate - the numbers (self time per op, module, layer, step; bandwidth; consistency)
findings  - ranked bottlenecks with mitigations, the jitter verdict
pages     - report.md, modules.md, jitter.md as documents; doc renders them to md or html
chrome    - trace.json for Perfetto; plots - PNGs; compare - two runs side by side
writer    - write_reports: all of the above for one run

The package reaches a model only through its public API; advice.py alone asks pyml.nlp and
pyml.quant what the CLI would accept, so that a suggested flag is one that runs.
"""

from pyml.report.capture import Profile, profile
from pyml.report.records import ReportInputError, Run, load_run
from pyml.report.writer import FORMATS, write_reports

__all__ = ["profile", "Profile", "load_run", "write_reports", "Run", "ReportInputError", "FORMATS"]
