"""The plots survive what real runs produce."""

import pytest

from pyml.report import aggregate, plots

pytest.importorskip("matplotlib")


def test_layer_plot_survives_a_mean_rounded_outside_min_max(monkeypatch, tmp_path):
    # Five equal 0.013 ms steps average to 0.013000000000000001 > max: the min-max bar's upper length
    # came out -1.7e-18 and matplotlib refused the whole plot (a CI failure on a real profiled run).
    durations = [0.013] * 5
    mean = sum(durations) / len(durations)
    assert mean > max(durations)
    row = {"layer": 0, "mean": mean, "min": min(durations), "max": max(durations)}
    monkeypatch.setattr(aggregate, "step_breakdowns", lambda run: [])
    monkeypatch.setattr(aggregate, "layer_stats", lambda run, phase: [dict(row)])
    written = plots.write_plots(object(), tmp_path)
    assert [name for name, _ in written] == ["layers.png"]
    assert (tmp_path / "layers.png").stat().st_size > 0
