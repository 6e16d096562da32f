"""pyml-cache info / clear on a real cache folder."""

from __future__ import annotations

import os

import pytest

from pyml import load_model
from pyml.cli import pyml_cache
from pyml.cli.standins import write_llama_gguf


def test_info_lists_files_and_says_stale_then_clear_frees_them(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "packed"
    monkeypatch.setenv("PYML_PACKED_CACHE", str(folder))
    a = write_llama_gguf(tmp_path / "a.gguf", "llama-tiny", "q4_0")
    b = write_llama_gguf(tmp_path / "b.gguf", "llama-tiny", "q8_0")
    for path in (a, b):
        load_model(gguf=str(path), threads=1, warmup=False)
    os.utime(b, ns=(1, 1))  # b changed since it was packed
    (folder / "junk.gguf.0.pyml-packed").write_bytes(b"not a cache file")

    assert pyml_cache.main(["info"]) == 0
    out = capsys.readouterr().out
    files = sorted(folder.iterdir())
    total = sum(f.stat().st_size for f in files)
    assert f"3 file(s), {total / 1e6:.1f} MB" in out
    lines = {line.split()[-2]: line for line in out.splitlines() if line.startswith("  ")}
    assert "current" in lines[str(a.resolve())]
    assert "stale" in lines[str(b.resolve())]
    assert "unusable" in out

    assert pyml_cache.main(["clear"]) == 0
    assert f"3 file(s) deleted, {total / 1e6:.1f} MB freed" in capsys.readouterr().out
    assert not list(folder.iterdir())


def test_info_checks_every_array_and_says_damaged(tmp_path, monkeypatch, capsys):
    from tests.nlp.test_packed_cache import _flip_array_byte
    folder = tmp_path / "packed"
    monkeypatch.setenv("PYML_PACKED_CACHE", str(folder))
    model = write_llama_gguf(tmp_path / "a.gguf", "llama-tiny", "q4_0")
    load_model(gguf=str(model), threads=1, warmup=False)
    (file,) = folder.iterdir()
    _flip_array_byte(file)
    assert pyml_cache.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "damaged (array" in out and "does not match its checksum" in out  # 'current' before


def test_a_wrong_action_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        pyml_cache.main(["purge"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice" in err[0]
