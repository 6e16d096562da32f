"""The packed-weights cache: later loads map what the first one packed (the same bytes), and a
changed model file, a new packer, a truncated or corrupt cache file or a folder that cannot be
written are each handled as docs/performance-journal.md ("Cold start") says."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import zlib

import numpy as np
import pytest
from gguf import GGUFReader

from pyml import load_model, quant
from pyml.cli.standins import write_gpt2, write_llama_gguf
from pyml.core import derived
from pyml.core.mapping import _mapping_of
from pyml.nlp.api import build_gguf, check_float_compute
from pyml.nlp.loaders import packed_cache
from pyml.quant import interleaved

IDS = [1, 5, 9, 33, 7]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "packed"
    monkeypatch.setenv("PYML_PACKED_CACHE", str(folder))
    return folder


@pytest.fixture
def tiny_q4(tmp_path):
    return write_llama_gguf(tmp_path / "llama-tiny.gguf", "llama-tiny", "q4_0")


def load(path):
    return load_model(gguf=str(path), threads=1, warmup=False)


def reference_logits(path):
    """Logits of the model packed in process memory (no cache in play): what every load must give
    (load_model's float compute, auto: the prefill's attention as a load computes it)."""
    model = build_gguf(path, with_tokenizer=False).model
    model.pack_weights(check_float_compute("auto"))
    return model.forward(IDS, model.new_cache(8))


def cache_files(folder):
    return sorted(folder.glob(f"*{packed_cache.SUFFIX}"))


def _backing_path(array) -> str | None:
    """The path /proc/self/maps gives for the mapping that holds the array's first byte."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) > 5 else None
    return None


def packed_arrays(lm):
    return [lin.weight.data.groups for lin in lm.model.linears() if isinstance(lin.weight.data, quant.Packed)]


def test_second_load_maps_the_cache_and_packs_nothing(cache, tiny_q4, monkeypatch):
    first = load(tiny_q4)
    (path,) = cache_files(cache)
    assert all(_backing_path(g) == str(path) for g in packed_arrays(first))  # filled straight into the file

    def no_packing(*args, **kwargs):
        raise AssertionError("a cached load re-packed a weight")

    monkeypatch.setattr(interleaved, "_relay", no_packing)
    monkeypatch.setattr(np, "concatenate", no_packing)  # nor concatenated Q/K/V or gate/up
    second = load(tiny_q4)
    monkeypatch.undo()
    groups = packed_arrays(second)
    assert len(groups) == len(second.model.linears())
    assert all(_backing_path(g) == str(path) and not g.flags.writeable for g in groups)
    np.testing.assert_array_equal(second.forward(IDS), reference_logits(tiny_q4))


def test_cached_bytes_are_the_files_blocks(cache, tiny_q4):
    """Unpacked again, each cached matrix is the GGUF's own blocks as the gguf package reads them."""
    load(tiny_q4)
    lm = load(tiny_q4)
    tensors = {t.name: np.asarray(t.data) for t in GGUFReader(str(tiny_q4)).tensors}
    down = lm.model.blocks[1].ffn.down
    np.testing.assert_array_equal(down.weight.data.unpack(), tensors["blk.1.ffn_down.weight"])
    qkv = lm.model.blocks[0].attn.qkv.weight.data.unpack()
    parts = [tensors[f"blk.0.attn_{x}.weight"] for x in "qkv"]
    np.testing.assert_array_equal(qkv, np.concatenate(parts))


def test_changed_model_file_is_repacked(cache, tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", "llama-tiny", "q4_0", seed=0)
    load(path)
    stamp = os.stat(path).st_mtime_ns
    write_llama_gguf(path, "llama-tiny", "q4_0", seed=1)  # the same name, other weights
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    lm = load(path)
    np.testing.assert_array_equal(lm.forward(IDS), reference_logits(path))
    (file,) = cache_files(cache)
    index, _ = packed_cache.read_index(file)
    assert index["identity"]["files"][0][2] == stamp + 10**9


def test_new_packer_version_repacks(cache, tiny_q4, monkeypatch):
    load(tiny_q4)
    (file,) = cache_files(cache)
    monkeypatch.setattr(interleaved, "LAYOUT_VERSION", interleaved.LAYOUT_VERSION + 1)
    relays = []
    real = interleaved._relay
    monkeypatch.setattr(interleaved, "_relay", lambda *a, **k: (relays.append(1), real(*a, **k)))
    lm = load(tiny_q4)
    assert relays, "a cache made by another packer version was read"
    assert packed_cache.read_index(file)[0]["identity"]["packer"] == interleaved.LAYOUT_VERSION
    np.testing.assert_array_equal(lm.forward(IDS), reference_logits(tiny_q4))


def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def _flip_index_byte(path):
    with open(path, "r+b") as f:
        _, offset, length, _ = packed_cache.HEADER.unpack(f.read(packed_cache.HEADER.size))
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0x20]))


def _huge_index_claim(path):
    """A header claiming an index of 2^62 bytes: refused from the sizes, nothing allocated."""
    with open(path, "r+b") as f:
        f.write(packed_cache.HEADER.pack(packed_cache.MAGIC, 64, 1 << 62, 0))


def _array_past_the_data(path):
    """A well-formed index (right checksum) whose first array lies past the end of the data."""
    _rewrite_index(path, lambda arrays, end: arrays[next(iter(arrays))].__setitem__(0, end))


def _other_shape(path):
    """A well-formed index whose arrays are of other shapes than the model asks for."""
    def halve(arrays, end):
        for entry in arrays.values():
            entry[2][0] //= 2
    _rewrite_index(path, halve)


def _rewrite_index(path, change):
    with open(path, "r+b") as f:
        _, offset, length, _ = packed_cache.HEADER.unpack(f.read(packed_cache.HEADER.size))
        f.seek(offset)
        index = json.loads(f.read(length))
        change(index["arrays"], offset)
        raw = json.dumps(index).encode()
        f.seek(offset)
        f.write(raw)
        f.truncate(offset + len(raw))
        f.seek(0)
        f.write(packed_cache.HEADER.pack(packed_cache.MAGIC, offset, len(raw), zlib.crc32(raw)))


@pytest.mark.parametrize("damage, said", [(_truncate, "truncated"), (_flip_index_byte, "checksum"),
                                          (_huge_index_claim, "truncated or corrupt"),
                                          (_array_past_the_data, "outside the data"),
                                          (_other_shape, "holds no")],
                         ids=["truncated", "index-bit-flip", "huge-index-claim", "array-past-data", "other-shape"])
def test_damaged_cache_file_is_rebuilt_never_read(cache, tiny_q4, damage, said, caplog):
    load(tiny_q4)
    (file,) = cache_files(cache)
    damage(file)
    with caplog.at_level(logging.WARNING):
        lm = load(tiny_q4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and said in warnings[0] and str(file) in warnings[0], warnings
    np.testing.assert_array_equal(lm.forward(IDS), reference_logits(tiny_q4))
    packed_cache.read_index(file)  # rebuilt whole
    assert all(_backing_path(g) == str(file) for g in packed_arrays(load(tiny_q4)))


def _flip_array_byte(path, which: int = 0):
    """One byte in the middle of an array changed, the index left as written (a stray write)."""
    index, _ = packed_cache.read_index(path)
    at, dtype, shape, _ = [e for e in index["arrays"].values() if np.prod(e[2])][which]
    middle = at + int(np.prod(shape)) * np.dtype(dtype).itemsize // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("which", [0, -1])
def test_a_changed_array_byte_is_a_warning_and_a_rebuild_never_other_logits(cache, tiny_q4, which, caplog):
    load(tiny_q4)
    (file,) = cache_files(cache)
    _flip_array_byte(file, which)
    with caplog.at_level(logging.WARNING):
        lm = load(tiny_q4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "does not match its checksum" in warnings[0] and str(file) in warnings[0]
    np.testing.assert_array_equal(lm.forward(IDS), reference_logits(tiny_q4))  # garbage before: silently
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = load(tiny_q4)  # the rebuilt file is whole: mapped, no warning
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert all(_backing_path(g) == str(file) for g in packed_arrays(again))


def test_a_file_swapped_after_its_index_was_read_is_never_mapped(cache, tiny_q4, monkeypatch, caplog):
    """The index and the arrays come through one descriptor: a file renamed over the cache file in
    between (another process rebuilding it, or anyone) leaves this load reading the file it checked."""
    load(tiny_q4)
    (file,) = cache_files(cache)
    garbage = file.with_name("garbage")
    garbage.write_bytes(file.read_bytes())
    _flip_array_byte(garbage, 0)
    read = packed_cache.read_index_from

    def read_then_swap(fd):
        found = read(fd)
        os.replace(garbage, file)
        return found
    monkeypatch.setattr(packed_cache, "read_index_from", read_then_swap)
    with caplog.at_level(logging.WARNING):
        lm = load(tiny_q4)
    # mapped by its name, the swapped file's changed array would fail its checksum: a warning
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    np.testing.assert_array_equal(lm.forward(IDS), reference_logits(tiny_q4))


@pytest.mark.parametrize("danger", ["writable by others", "owned by another user"])
def test_a_cache_folder_others_could_write_is_not_used(cache, tiny_q4, danger, monkeypatch, caplog):
    load(tiny_q4)
    files = {f: f.read_bytes() for f in cache_files(cache)}
    if danger == "writable by others":
        cache.chmod(0o777)
    else:
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    monkeypatch.setattr(packed_cache, "_warned", set())
    with caplog.at_level(logging.WARNING):
        lm = load(tiny_q4)
        load(tiny_q4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and danger in warnings[0] and "packing in memory" in warnings[0], warnings
    assert all(_mapping_of(g) is None for g in packed_arrays(lm))
    assert {f: f.read_bytes() for f in cache_files(cache)} == files  # neither read nor rewritten
    np.testing.assert_array_equal(lm.forward(IDS), reference_logits(tiny_q4))
    cache.chmod(0o755)


def test_a_cache_file_others_can_write_is_rebuilt_not_read(cache, tiny_q4, caplog):
    load(tiny_q4)
    (file,) = cache_files(cache)
    file.chmod(0o666)
    with caplog.at_level(logging.WARNING):
        lm = load(tiny_q4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "writable by others; rebuilding it" in warnings[0], warnings
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    np.testing.assert_array_equal(lm.forward(IDS), reference_logits(tiny_q4))


def test_a_new_cache_folder_is_private_whatever_the_umask(cache, tiny_q4, caplog):
    old = os.umask(0o002)  # group-writable by default, as on systems with a group per user
    try:
        with caplog.at_level(logging.WARNING):
            load(tiny_q4)
            lm = load(tiny_q4)
    finally:
        os.umask(old)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert all(_backing_path(g) == str(f) for g in packed_arrays(lm) for f in cache_files(cache))


def test_folder_that_cannot_be_written_packs_in_memory_with_one_warning(tmp_path, tiny_q4, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache folder would be inside a regular file: no folder can be made there
    monkeypatch.setenv("PYML_PACKED_CACHE", str(blocker / "packed"))
    monkeypatch.setattr(packed_cache, "_warned", set())
    with caplog.at_level(logging.WARNING):
        lm = load(tiny_q4)
        load(tiny_q4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "packing in memory" in warnings[0], warnings
    assert all(_mapping_of(g) is None for g in packed_arrays(lm))
    np.testing.assert_array_equal(lm.forward(IDS), reference_logits(tiny_q4))


@pytest.fixture
def read_only_cache(cache, monkeypatch):
    """The cache folder made read-only (mode 0555; for root, whom modes do not stop, the file system
    answers as a read-only mount would: EROFS on creating a file there)."""
    real_open = open

    def refusing_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and os.path.dirname(os.fspath(file)) == str(cache):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    def make_read_only():
        cache.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        monkeypatch.setattr(packed_cache, "open", refusing_open, raising=False)
        monkeypatch.setattr(packed_cache, "_warned", set())

    yield make_read_only
    cache.chmod(0o755)


@pytest.mark.parametrize("before", ["empty", "current", "stale"])
def test_read_only_cache_folder(cache, tiny_q4, read_only_cache, before, caplog):
    """A current cache file in a read-only folder is still read (no warning); with none, or a stale
    one (which stays as it was), the model packs in memory, said in one warning line."""
    cache.mkdir(parents=True)
    if before != "empty":
        load(tiny_q4)
    if before == "stale":
        stamp = os.stat(tiny_q4).st_mtime_ns + 10**9
        os.utime(tiny_q4, ns=(stamp, stamp))
    files = {f: f.read_bytes() for f in cache_files(cache)}
    read_only_cache()
    with caplog.at_level(logging.WARNING):
        lm = load(tiny_q4)
        load(tiny_q4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if before == "current":
        assert warnings == [] and all(_backing_path(g) in map(str, files) for g in packed_arrays(lm))
    else:
        assert len(warnings) == 1 and "cannot be written" in warnings[0] and "packing in memory" in warnings[0]
        assert all(_mapping_of(g) is None for g in packed_arrays(lm))
    assert {f: f.read_bytes() for f in cache_files(cache)} == files  # nothing written, nothing removed
    np.testing.assert_array_equal(lm.forward(IDS), reference_logits(tiny_q4))


def test_gpt2_transposed_and_float_fusions_are_cached(cache, tmp_path):
    """GPT-2's Conv1D copies (out, in) and a float model's fused Q/K/V are derived arrays too."""
    gpt2 = write_gpt2(tmp_path / "gpt2", "gpt2-tiny", n_positions=32)
    first = load_model(safetensors=str(gpt2), threads=1, warmup=False).forward(IDS)
    lm = load_model(safetensors=str(gpt2), threads=1, warmup=False)
    (file,) = cache_files(cache)
    weights = [lin.weight.data for lin in lm.model.linears()[:-1]]  # the head is the tied embedding
    assert weights and all(_backing_path(w) == str(file) for w in weights)
    np.testing.assert_array_equal(lm.forward(IDS), first)

    llama = write_llama_gguf(tmp_path / "f32.gguf", "llama-tiny", "f32")
    load(llama)
    lm = load(llama)
    qkv = lm.model.blocks[0].attn.qkv.weight.data
    assert qkv.dtype == np.float32 and _backing_path(qkv).endswith(packed_cache.SUFFIX)
    np.testing.assert_array_equal(lm.forward(IDS), reference_logits(llama))


def test_lm_head_quant_has_a_cache_file_of_its_own(cache, tmp_path):
    llama = write_llama_gguf(tmp_path / "f32.gguf", "llama-tiny", "f32")
    plain = load(llama).forward(IDS)
    load_model(gguf=str(llama), threads=1, warmup=False, lm_head_quant="q8_0")
    assert len(cache_files(cache)) == 2
    np.testing.assert_array_equal(load(llama).forward(IDS), plain)


def test_a_name_asked_for_twice_is_never_cached(cache, tiny_q4):
    """Two different arrays under one key: a later load must not hand the first out for both."""
    files = [tiny_q4]
    writer = packed_cache.open_for(files)
    with derived.using(writer):
        first = derived.array("twice", (4,), np.float32, lambda out: out.fill(1))
        second = derived.array("twice", (4,), np.float32, lambda out: out.fill(2))
        kept = derived.array("once", (4,), np.float32, lambda out: out.fill(5))
    writer.commit()
    assert first[0] == 1 and second[0] == 2
    reader = packed_cache.open_for(files)
    assert isinstance(reader, packed_cache.Reader)
    with derived.using(reader):
        again = derived.array("twice", (4,), np.float32, lambda out: out.fill(3))
        cached = derived.array("once", (4,), np.float32, lambda out: out.fill(6))
    assert again[0] == 3  # made again, not read
    assert cached[0] == 5 and _backing_path(cached) == str(reader.path)
