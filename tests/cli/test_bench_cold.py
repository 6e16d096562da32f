"""pyml-bench --cold's parts on a small stand-in: fresh-process figures, and two processes sharing
the model's pages (the packed-weights cache and the GGUF are file mappings, not private copies)."""

from __future__ import annotations

import pytest

from pyml.cli import bench_cold
from pyml.cli.standins import write_llama_gguf


@pytest.mark.deep  # a benchmark table of fresh processes; the load they time: tests/nlp/test_packed_cache.py
def test_one_shot_figures_hang_together(tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", "llama-tiny", "q4_0")
    m = bench_cold.one_shot("pyml", path, 4, threads=1)
    assert 0 < m["start"] < m["first_token"] < m["wall"]
    assert m["import"] > 0 and m["load"] > 0 and m["warmup"] > 0
    assert 0 < m["rss_imports"] < m["peak"] and m["model_memory"] == m["peak"] - m["rss_imports"]
    added = m["added_files"] + m["added_libraries"] + m["added_heap"]
    assert m["added_files"] > 0 and abs(added - m["model_memory"]) < 0.25 * m["model_memory"], m


@pytest.mark.deep  # a benchmark table of fresh processes; the load they time: tests/nlp/test_packed_cache.py
def test_a_second_process_shares_the_models_pages(tmp_path, monkeypatch):
    monkeypatch.setenv("PYML_PACKED_CACHE", str(tmp_path / "packed"))
    path = write_llama_gguf(tmp_path / "m.gguf", "llama-tiny", "q4_0")
    bench_cold.one_shot("pyml", path, 1, threads=1)  # packs it: the cache file exists from here on
    shared = bench_cold.sharing(path, 4, threads=1)
    (_, alone), [(_, first), (_, second)] = shared["alone"], shared["both"]
    (cache_file,) = (tmp_path / "packed").glob("*.pyml-packed")
    assert alone >= 0.7 * cache_file.stat().st_size  # the packed weights are read from the file's pages
    # each of two processes counts half of every shared page: together, what one alone did
    assert first + second <= alone * 1.1 + 16384, shared
    assert abs(first - second) <= alone * 0.1 + 16384, shared
