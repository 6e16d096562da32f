"""Fixtures of the core tests."""

import pytest

from pyml.core import perf


@pytest.fixture
def records():
    """Every perf record (trace level and up) made while the test runs, in end order."""
    got = []
    perf.add_collector(got.append)
    yield got
    perf.remove_collector(got.append)
