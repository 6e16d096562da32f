"""Oracle outputs that are slow to make, kept on disk between test runs.

Reading Gemma 3's GGUF with the gguf package (GGUFReader parses its 262,144-token vocabulary one
field part at a time) and transformers' GGUF tokenizer converter take ~15 s each on 2 cores, in
every run; transformers' model of a GGUF file 15-40 s. Their results depend only on the file and
the libraries' versions, so they are made once per machine and kept under the pyml cache beside the
models (PYML_CACHE or ~/.cache/pyml, test-oracles/<kind>/): the oracle is still gguf's or
transformers' own output, only not recomputed. A changed file (size, mtime) or library version
makes a new entry. Kinds: gguf-metadata and gguf-tensors (gguf's reader), gguf-tokenizer and
hf-gguf-model (transformers'; the models are float32 checkpoints, ~0.5 GB for SmolLM2, ~1.1 GB for
Gemma 3 270M).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np


def folder(kind: str, source: Path, library: str | tuple[str, ...]) -> Path:
    """The entry for `kind` made from `source` by `library` (at its installed version; a tuple: the
    libraries that all have a hand in it, each at its version)."""
    stat = source.stat()
    libraries = (library,) if isinstance(library, str) else library
    key = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|" + "|".join(f"{n}=={version(n)}" for n in libraries)
    root = os.environ.get("PYML_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pyml")
    return Path(root) / "test-oracles" / kind / hashlib.sha1(key.encode()).hexdigest()[:20]


def kept(kind: str, source: Path, library: str, make, save, load):
    """load(folder) if the entry exists, else make(), saved with save(value, folder) and returned.
    The entry appears whole or not at all (written aside, then renamed): workers may race."""
    entry = folder(kind, source, library)
    if entry.is_dir():
        return load(entry)
    value = make()
    entry.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".new-", dir=entry.parent))
    try:
        save(value, scratch)
        os.rename(scratch, entry)
    except OSError:  # another worker's entry got there first, or a read-only cache
        shutil.rmtree(scratch, ignore_errors=True)
    return value


def kept_pickle(kind: str, source: Path, library: str, make):
    """kept() for a picklable value."""
    def save(value, entry):
        (entry / "value.pkl").write_bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    return kept(kind, source, library, make, save, lambda entry: pickle.loads((entry / "value.pkl").read_bytes()))


def gguf_tensors(path: Path) -> dict:
    """{name: tensor} of a GGUF file as gguf.GGUFReader lists them, each with the reader's
    tensor_type, shape (GGUF's order, fastest first) and data: a read-only view of the file's
    memory map where the reader put it. The reader's table is kept (kind gguf-tensors): to make it,
    it parses every metadata field first, a 262,144-token vocabulary one part at a time (~15 s)."""
    def read():
        return [{"name": t.name, "tensor_type": int(t.tensor_type), "shape": [int(n) for n in t.shape],
                 "offset": int(t.data_offset), "dims": t.data.shape, "dtype": t.data.dtype.str}
                for t in gguf.GGUFReader(path).tensors]
    mapped = np.memmap(path, mode="r")  # as the reader maps the file
    tensors = {}
    for t in kept_pickle("gguf-tensors", Path(path), "gguf", read):
        dtype = np.dtype(t["dtype"])
        data = mapped[t["offset"]:t["offset"] + int(np.prod(t["dims"])) * dtype.itemsize].view(dtype).reshape(t["dims"])
        tensors[t["name"]] = SimpleNamespace(name=t["name"], tensor_type=gguf.GGMLQuantizationType(t["tensor_type"]),
                                             shape=t["shape"], data=data)
    return tensors
