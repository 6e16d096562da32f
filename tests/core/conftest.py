"""Fixtures of the core tests."""

import pytest

from pyml.core import perf


@pytest.fixture
def every_step(monkeypatch):
    """Drain the perf buffer whenever a top-level span ends (as a reader asking after every step
    would), not once a second: tests read records and lines as each step ends."""
    monkeypatch.setattr(perf, "DRAIN_EVERY_S", 0.0)


@pytest.fixture
def records(every_step):
    """Every perf record (trace level and up) made while the test runs, in end order (drained
    when a top-level span ends)."""
    got = []
    perf.add_collector(got.append)
    yield got
    perf.remove_collector(got.append)
