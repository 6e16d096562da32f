"""What a parsed GGUF keeps resident: the header's pages are given back once the metadata is read,
and small tensors (norm weights) are read into memory of their own rather than mapped, so the
kernel's fault-around does not hold 64 KiB of the file for each 2 KB vector. The file is written
by gguf-py's GGUFWriter and read back by gguf-py's GGUFReader as the oracle of its contents.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

from pyml.core.mapping import _mapping_of
from pyml.nlp.loaders.gguf import SMALL_TENSOR_BYTES, GGUFFile
from pyml.nlp.tokenizer import Tokenizer
from tests.fuzz import gguf_build as gb

ROOT = Path(__file__).resolve().parents[2]


def _write(path, n_strings: int):
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"token-{i:08d}" for i in range(n_strings)])
    writer.add_tensor("small.weight", rng.standard_normal(576).astype(np.float32))
    writer.add_tensor("large.weight", rng.standard_normal((64, SMALL_TENSOR_BYTES // 4 // 64 * 2)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _resident_bytes(path) -> int:
    """Bytes of `path`'s mappings in this process's resident set (/proc/self/smaps)."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                current = head[5] if len(head) > 5 else None
            elif head and head[0] == "Rss:" and current == str(path):
                total += int(head[1]) * 1024
    return total


def test_small_tensors_are_read_and_large_ones_mapped(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, n_strings=10)
    want = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    f = GGUFFile(path)
    small, large = f.tensors["small.weight"][0], f.tensors["large.weight"][0]
    assert small.nbytes < SMALL_TENSOR_BYTES <= large.nbytes
    assert np.array_equal(small, want["small.weight"]) and np.array_equal(large, want["large.weight"])
    assert _mapping_of(small) is None and not small.flags.writeable  # its own bytes, read-only
    assert _mapping_of(large) is not None and not large.flags.writeable


def test_the_header_pages_leave_the_resident_set_once_parsed(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, n_strings=100_000)  # a 2 MB vocabulary, like a real model's
    f = GGUFFile(path)
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 100_000
    assert f.metadata["tokenizer.ggml.tokens"][-1] == "token-00099999"
    # of the 2 MB header, at most one fault-around window (64 KiB) near the data stays mapped
    assert _resident_bytes(path) <= 64 * 1024
    assert np.array_equal(f.tensors["large.weight"][0][:1], np.asarray(gguf.GGUFReader(path).tensors[1].data)[:1])


_MEASURE_LOAD = """
import resource, sys
from pyml.nlp.loaders.gguf import GGUFFile
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
f = GGUFFile(sys.argv[1])
blob = f.metadata["x.unused_blob"]
assert blob.dtype == "uint8" and blob.shape == (60_000_000,) and int(blob[12_345_678]) == 12_345_678 % 251
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


class _RawArrayKV:
    """A metadata array of u8 written as raw bytes (the test's builder would loop over 60M items)."""

    def __init__(self, key: str, data: bytes):
        self.key, self.data = key, data

    def encode(self) -> bytes:
        return gb.gguf_string(self.key) + gb.u32(gb.ARRAY) + gb.u32(gb.U8) + gb.u64(len(self.data)) + self.data


def test_a_large_metadata_array_is_held_at_most_twice_its_bytes(tmp_path):
    """A 60 MB u8 array nobody reads: gguf-py's list of it took 1.1 GB; a view takes none."""
    spec = gb.tiny_llama_spec()
    blob = (np.arange(60_000_000) % 251).astype(np.uint8).tobytes()
    spec.kvs.append(_RawArrayKV("x.unused_blob", blob))
    path = tmp_path / "blob.gguf"
    path.write_bytes(spec.encode())
    del blob, spec
    out = subprocess.run([sys.executable, "-c", _MEASURE_LOAD, str(path)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    grown_kb = int(out.stdout)
    assert grown_kb < 2 * 60_000_000 // 1024, grown_kb  # the bound: <= 2x the array's bytes


def test_tokenizer_arrays_are_read_from_the_views(tmp_path):
    """scores and token types arrive as NumPy views: the tokenizer built from them still encodes."""
    spec = gb.tiny_llama_spec()
    path = tmp_path / "tiny.gguf"
    path.write_bytes(spec.encode())
    f = GGUFFile(path)
    types = f.metadata["tokenizer.ggml.token_type"]
    assert isinstance(types, np.ndarray) and not types.flags.writeable and types.tolist() == [1] * 256 + [3]
    tok = Tokenizer.from_gguf_metadata(f.metadata, source=str(path))
    assert tok.decode(tok.encode("héllo")) == "héllo" and tok.eos_id == 256
