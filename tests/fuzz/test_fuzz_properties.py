"""The bounded CI fuzz run: hypothesis generates hostile files; every one must pass harness.check.

Deterministic (derandomize, no example database), about a minute in all. The long,
coverage-guided campaign is run_campaign.py; what it finds lands in corpus/ and is
replayed by test_fuzz_corpus.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz import harness
from tests.fuzz.strategies import gguf_files, safetensors_files

def ci(max_examples):
    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])


def _check(tmp_path, raw, what, suffix, model=False):
    path = tmp_path / f"input{suffix}"
    path.write_bytes(raw)
    try:
        harness.check(path, model=model)
    except Exception as e:
        pytest.fail(f"{what}: {type(e).__name__}: {e}")


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Compile the kernels a tiny model needs once, so no example pays for the JIT."""
    import tempfile
    from pathlib import Path

    from tests.fuzz.gguf_build import tiny_llama
    with tempfile.TemporaryDirectory() as d:
        for wt in (2, 3, 8, 1):
            path = Path(d) / f"w{wt}.gguf"
            tiny_llama(path, weight_type=wt)
            harness.check(path, model=True)


@pytest.mark.deep  # a fuzz campaign; the refusals it explores: tests/reliability/test_hostile_files.py, test_fuzz_corpus.py
@ci(1500)
@given(gguf_files())
def test_gguf_loader_accepts_or_refuses_cleanly(tmp_path_factory, case):
    _check(tmp_path_factory.mktemp("g"), case, case.what, ".gguf")


@pytest.mark.deep  # a fuzz campaign; the refusals it explores: tests/reliability/test_hostile_files.py, test_fuzz_corpus.py
@ci(300)
@given(gguf_files())
def test_gguf_model_loads_and_runs_or_refuses_cleanly(tmp_path_factory, case):
    _check(tmp_path_factory.mktemp("m"), case, case.what, ".gguf", model=True)


@pytest.mark.deep  # a fuzz campaign; the refusals it explores: tests/reliability/test_hostile_files.py, test_fuzz_corpus.py
@ci(1500)
@given(safetensors_files())
def test_safetensors_loader_accepts_or_refuses_cleanly(tmp_path_factory, case):
    _check(tmp_path_factory.mktemp("s"), case, case.what, ".safetensors")
