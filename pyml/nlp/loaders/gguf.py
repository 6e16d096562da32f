"""GGUF files: metadata, tokenizer and tensors, through the `gguf` package's reader.

The reader memory-maps the file; each tensor is a read-only view. Quantized
tensors stay in ggml's block layout as uint8 (rows, row_bytes) — the matmul
kernels read them in place, so memory stays close to the file size.

A GGUF file is untrusted input. Before the reader walks the header, the counts
it would loop over are checked against what the file could possibly hold; after,
every tensor's type, shape and byte range are checked against the file, so no
kernel ever reads past the mapping.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from pyml import quant
from pyml.core.errors import ModelFormatError, UnsupportedError
from pyml.nlp.loaders.store import TensorStore
from pyml.quant import QuantType

MAGIC = b"GGUF"
_MIN_KV_BYTES = 8 + 4 + 1          # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


def _precheck(path: Path, size: int):
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24:
        raise ModelFormatError(f"{path}: truncated ({size} bytes; a GGUF header needs 24)")
    if head[:4] != MAGIC:
        raise ModelFormatError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {MAGIC!r})")
    for order in "<>":
        version, n_tensors, n_kv = struct.unpack(order + "IQQ", head[4:24])
        if version in (2, 3):
            break
    else:
        raise UnsupportedError(f"{path}: GGUF version {struct.unpack('<I', head[4:8])[0]} (supported: 2, 3)")
    if n_kv > (size - 24) // _MIN_KV_BYTES:
        raise ModelFormatError(f"{path}: header claims {n_kv} metadata entries, more than a "
                               f"{size}-byte file can hold")
    if n_tensors > (size - 24) // _MIN_TENSOR_INFO_BYTES:
        raise ModelFormatError(f"{path}: header claims {n_tensors} tensors, more than a "
                               f"{size}-byte file can hold")


def _reader_class():
    from gguf import GGUFReader, GGUFValueType

    class Reader(GGUFReader):
        """GGUFReader with bounds-checked, vectorised metadata arrays.

        The stock reader parses an array element by element, each through a NumPy
        memmap slice: ~12 s for Gemma's 262K-entry vocabulary, and an endless loop
        when a hostile header claims 2^60 elements that each read as zero bytes.
        Here a numeric array is one view, a string array one pass over memoryview
        slices, and every length is checked against the file first.
        """

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):  # a plain ndarray view: memmap subclass slicing is 3x slower
            self._plain = mapped.view(np.ndarray)
            self._bytes = memoryview(self._plain)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            size = len(self._plain)
            if orig_offs + 12 > size:
                raise ValueError(f"array header at offset {orig_offs} runs past the end of the file")
            item_type = self._get(orig_offs, np.uint32)
            count = self._get(orig_offs + 4, np.uint64)
            n, offs = int(count[0]), orig_offs + 12
            sub = GGUFValueType(int(item_type[0]))
            np_type = self.gguf_scalar_to_np.get(sub)
            if np_type is not None:
                if offs + n * np.dtype(np_type).itemsize > size:
                    raise ValueError(f"array of {n} {sub.name} at offset {orig_offs} runs past the end of the file")
                values = self._get(offs, np_type, n)
                return 12 + int(values.nbytes), [item_type, count, values], [2], [GGUFValueType.ARRAY, sub]
            if sub != GGUFValueType.STRING:
                raise ValueError(f"array of {sub.name} at offset {orig_offs} is not supported")
            if n > (size - offs) // 8:
                raise ValueError(f"array of {n} strings at offset {orig_offs} cannot fit in the file")
            mv, parts = self._bytes, [item_type, count]
            for _ in range(n):
                if offs + 8 > size:
                    raise ValueError(f"string at offset {offs} runs past the end of the file")
                length = int.from_bytes(mv[offs:offs + 8], "little")
                if offs + 8 + length > size:
                    raise ValueError(f"string of {length} bytes at offset {offs} runs past the end of the file")
                parts.append(mv[offs:offs + 8])
                parts.append(mv[offs + 8:offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(3, len(parts), 2)), [GGUFValueType.ARRAY, sub]

    return Reader


def _value(field):
    v = field.contents()
    if isinstance(v, list) and v and not isinstance(v[0], (str, list)):
        return np.asarray(v)
    return v


class GGUFFile:
    """A parsed, validated GGUF file: `metadata` (key -> Python value) and its tensors."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"{self.path}: no such file")
        size = os.path.getsize(self.path)
        _precheck(self.path, size)
        try:
            reader = _reader_class()(self.path, "r")
        except (ValueError, IndexError, KeyError, struct.error, OverflowError, TypeError,
                UnicodeDecodeError, MemoryError) as e:
            raise ModelFormatError(f"{self.path}: corrupt GGUF header ({type(e).__name__}: {e})") from None
        try:
            self.metadata = {name: _value(f) for name, f in reader.fields.items()}
        except (ValueError, IndexError, UnicodeDecodeError, TypeError) as e:
            raise ModelFormatError(f"{self.path}: corrupt metadata ({type(e).__name__}: {e})") from None
        self.tensors = {}
        for t in reader.tensors:
            self.tensors[t.name] = self._tensor(t, size)
        self.file_size = size

    def _tensor(self, t, file_size: int):
        where = f"{self.path}: tensor {t.name!r}"
        if t.name in self.tensors:
            raise ModelFormatError(f"{where}: appears twice")
        qtype = QuantType(int(t.tensor_type))
        if not quant.is_supported(qtype):
            raise UnsupportedError(f"{where}: quantization type {qtype.name} is not supported")
        ne = [int(n) for n in t.shape]  # innermost first
        if not 1 <= len(ne) <= 4 or any(n <= 0 for n in ne):
            raise ModelFormatError(f"{where}: bad dimensions {ne}")
        fmt = quant.FORMATS[qtype]
        cols, rows = ne[0], int(np.prod(ne[1:], dtype=np.uint64))
        if cols % fmt.block_size:
            raise ModelFormatError(f"{where}: row length {cols} is not a multiple of the {qtype.name} "
                                   f"block size {fmt.block_size}")
        nbytes = rows * (cols // fmt.block_size) * fmt.type_size
        if int(t.data_offset) + nbytes > file_size or t.data.nbytes != nbytes:
            raise ModelFormatError(f"{where}: {nbytes} bytes at offset {int(t.data_offset)} run past the end "
                                   f"of the {file_size}-byte file")
        data = np.asarray(t.data)
        if qtype == QuantType.BF16:
            data = data.view(np.uint16)
        shape = tuple(reversed(ne))  # numpy order: (…, rows, cols)
        if data.dtype == np.uint8 and qtype not in (QuantType.I8,):
            data = data.reshape(rows, -1)
            shape = (rows, cols) if len(ne) > 1 else (cols,)
        else:
            data = data.reshape(shape)
        return data, qtype.name, shape

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def require(self, key: str):
        if key not in self.metadata:
            raise ModelFormatError(f"{self.path}: required metadata key {key!r} is missing")
        return self.metadata[key]

    def store(self, name_map) -> TensorStore:
        """The tensors under Hugging Face names; `name_map(gguf_name) -> hf name`."""
        store = TensorStore(dict(self.tensors), source=str(self.path))
        store.rename(name_map)
        return store


def load_gguf_model(path: Path):
    """(model, tokenizer, source, chat template) for a GGUF file."""
    from pyml.nlp.models import GGUF_ARCHITECTURES
    from pyml.nlp.tokenizer import Tokenizer
    f = GGUFFile(path)
    arch = f.require("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedError(f"{path}: architecture {arch!r} is not supported "
                               f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")
    config_cls, model_cls = GGUF_ARCHITECTURES[arch]
    config = config_cls.from_gguf(f)
    model = model_cls(config, f.store(model_cls.gguf_name), rope_style=model_cls.gguf_rope_style)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
    except ModelFormatError:
        raise
    except (KeyError, ValueError, TypeError) as e:
        raise ModelFormatError(f"{path}: cannot build the tokenizer from its metadata ({e})") from None
    return model, tokenizer, str(path), f.get("tokenizer.chat_template")
