"""built_once: a cache file or folder built by one process, whole, even when several build it at once."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from pyml.cli.built_once import built_once


def _slow_folder(folder: Path, tag: str):
    folder.mkdir()
    for i in range(20):  # long enough for the other process to be building too
        (folder / f"part{i}").write_text(tag)
        time.sleep(0.005)


def _build_in_process(out: str, tag: str, queue):
    queue.put(str(built_once(Path(out), lambda p: _slow_folder(p, tag))))


def test_a_file_is_built_once_and_rebuilt_when_stale(tmp_path):
    out, calls = tmp_path / "m.gguf", []

    def build(path):
        calls.append(path)
        path.write_text(f"build {len(calls)}")
    assert built_once(out, build) == out and out.read_text() == "build 1"
    assert built_once(out, build) == out and len(calls) == 1
    built_once(out, build, stale=True)
    assert out.read_text() == "build 2"
    assert calls[0] != out and calls[0].parent == out.parent  # built under another name beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_folder_left_half_built_is_built_again(tmp_path):
    out = tmp_path / "standin"
    out.mkdir()
    (out / "config.json").write_text("half")  # an interrupted build: no .complete
    built_once(out, lambda p: _slow_folder(p, "new"))
    assert (out / ".complete").exists() and not (out / "config.json").exists()
    assert {f.read_text() for f in out.glob("part*")} == {"new"}


def test_a_failed_build_leaves_nothing(tmp_path):
    out = tmp_path / "standin"

    def fail(path):
        path.mkdir()
        (path / "x").write_text("x")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        built_once(out, fail)
    assert list(tmp_path.iterdir()) == []


def test_two_processes_building_one_folder_both_get_a_whole_one(tmp_path):
    out = tmp_path / "standin"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_process, args=(str(out), tag, queue)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    got = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == [str(out)] * 2
    tags = {f.read_text() for f in out.glob("part*")}
    assert len(tags) == 1 and len(list(out.glob("part*"))) == 20  # one builder's folder, all of it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["standin"]
