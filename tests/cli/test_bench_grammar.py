"""bench_grammar's engine comparison: it walks a valid instance of its schema through each
engine's masks (asserting every token of it is allowed) and prints one row per engine."""

import importlib.util

from pyml.cli import bench_grammar


def test_the_engine_table_walks_the_instance(smollm2_gguf, capsys):
    bench_grammar.engines(str(smollm2_gguf), ["llguidance", "xgrammar"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| llguidance") or line.startswith("| xgrammar")]
    assert len(rows) == 2
    assert all(cell.strip() for cell in rows[0].split("|")[1:-1])  # every figure of the installed engine
    if importlib.util.find_spec("xgrammar") is None:
        assert "not installed" in rows[1]


def test_no_command_prints_the_usage():
    assert bench_grammar.main([]) == 2
