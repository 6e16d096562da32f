"""Fixtures of the core tests."""

import contextlib
import io
import logging

import numpy as np
import pytest

from pyml.core import perf


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


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


@contextlib.contextmanager
def _lines_at(spec):
    stream = io.StringIO()
    root = logging.getLogger("pyml")
    saved = list(root.handlers)
    root.handlers[:] = []
    try:
        perf.configure(spec, stream=stream)
        yield stream
    finally:
        root.handlers[:] = saved
        perf.configure("")


@pytest.fixture
def lines_at():
    """`with lines_at("trace") as stream:` pyml's [perf] lines at that level go to `stream` inside
    the block (pyml's handlers and levels as they were after it)."""
    return _lines_at
