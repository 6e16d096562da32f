"""Fixtures for the quant tests (helpers live in helpers.py)."""

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
