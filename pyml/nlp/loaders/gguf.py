"""GGUF files: metadata, tokenizer and tensors, through the `gguf` package's reader.

The reader memory-maps the file; each tensor is a read-only view. Quantized
tensors stay in ggml's block layout as uint8 (rows, row_bytes) — the matmul
kernels read them in place, so memory stays close to the file size.

A GGUF file is untrusted input. Before the reader walks the header, the counts
it would loop over are checked against what the file could possibly hold; while it
reads, every length is checked before the bytes it claims are read; and before any
view of a tensor exists, its type, dims, alignment and byte range are checked against
the file and against the other tensors (no overlaps), so no kernel ever reads past
the mapping. Errors name the file and the key or tensor (docs/reliability.md).

A split model (llama.cpp's gguf-split, or gguf-py's writer with split_max_*) is shards named
`<prefix>-00001-of-0000N.gguf`, each a whole GGUF file: the first holds all the metadata, every
shard `split.no` (0-based, u16), `split.count` (u16) and `split.tensors.count` (i32, the total),
and its own tensors. Given the first shard, GGUFFile reads the others beside it, each checked
and memory-mapped as a file of its own, into one set of tensors.
"""

from __future__ import annotations

import math
import os
import re
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
from gguf.gguf_reader import ReaderField

from pyml import quant
from pyml.core.errors import ModelFormatError, UnsupportedError
from pyml.core.mapping import release_pages
from pyml.nlp.loaders.store import TensorStore
from pyml.quant import QuantType

MAGIC = b"GGUF"
_MIN_KV_BYTES = 8 + 4 + 1          # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
MAX_DIMS = 4

# The hyperparameters models read as `{arch}.<key>`, with the type the GGUF spec gives them.
# A string or an array where a count belongs, a zero or a negative count, would otherwise
# surface inside a model's from_gguf as a TypeError or a ZeroDivisionError, or size a buffer.
SIZE_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
             "attention.head_count", "attention.head_count_kv", "attention.key_length",
             "attention.value_length", "attention.sliding_window", "rope.dimension_count")
FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base",
              "rope.scale_linear", "rope.scaling.factor", "final_logit_softcapping")
MAX_SIZE = 2**31 - 1  # sizes are int32 in llama.cpp too
# A tensor smaller than this (norm weights, biases) is read into memory of its own instead of
# viewed in the mapping: each first read of a mapped page maps the kernel's fault-around window
# (64 KiB) with it, so SmolLM2's 61 norm vectors of 2.3 KB held 3.7 MB of the file resident
# (Gemma 3 270M's 109: ~7 MB) for 140 KB (224 KB) of data.
SMALL_TENSOR_BYTES = 64 * 1024
SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama_split_path
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


class _Bad(ValueError):
    """A header field that is wrong, said the way the user reads it (the file name is added)."""


class _Unsupported(_Bad):
    """A well-formed tensor of a type pyml has no kernels for."""


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


_VALUE_TYPES = {int(t) for t in GGUFValueType}
_U64_LITTLE, _U64_BIG = struct.Struct("<Q"), struct.Struct(">Q")  # a string's length, as the file orders bytes


class _Reader(GGUFReader):
    """GGUFReader with every read bounds-checked, vectorised metadata arrays, validated tensors.

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

    def _need(self, offs: int, n: int, what: str):
        if offs + n > len(self._plain):
            raise _Bad(f"{what} at offset {offs} needs {n} bytes, past the end of the "
                       f"{len(self._plain)}-byte file")

    def _get_str(self, offset):
        self._need(offset, 8, "string length")
        n = int(self._get(offset, np.uint64)[0])
        self._need(offset + 8, n, f"string of {n} bytes")
        return super()._get_str(offset)

    def _build_fields(self, offs, count):
        for _ in range(int(count)):
            orig_offs = offs
            key_len, key_data = self._get_str(offs)
            key = _utf8(key_data, f"metadata key at offset {offs}")
            offs += 8 + len(key_data)
            try:
                self._need(offs, 4, "value type")
                raw_type = self._get(offs, np.uint32)
                if int(raw_type[0]) not in _VALUE_TYPES:
                    raise _Bad(f"unknown value type {int(raw_type[0])}")
                size, parts, idxs, types = self._get_field_parts(offs + 4, int(raw_type[0]))
            except _Bad as e:
                raise _Bad(f"metadata key {key!r}: {e}") from None
            if key in self.fields:
                raise _Bad(f"metadata key {key!r} appears twice")
            kind = _StringArray if parts and isinstance(parts[-1], _Strings) else ReaderField
            self.fields[key] = kind(orig_offs, key, [key_len, key_data, raw_type, *parts], [i + 3 for i in idxs], types)
            offs += 4 + size
        return offs

    def _get_tensor_info_field(self, orig_offs):
        name_len, name_data = self._get_str(orig_offs)
        name = _utf8(name_data, f"tensor name at offset {orig_offs}")
        offs = orig_offs + 8 + len(name_data)
        self._need(offs, 4, f"tensor {name!r}: n_dims")
        n_dims = self._get(offs, np.uint32)
        if not 1 <= int(n_dims[0]) <= MAX_DIMS:
            raise _Bad(f"tensor {name!r}: {int(n_dims[0])} dimensions (expected 1 to {MAX_DIMS})")
        nd = int(n_dims[0])
        self._need(offs + 4, 8 * nd + 12, f"tensor {name!r}: dims, type and offset")
        dims = self._get(offs + 4, np.uint64, nd)
        raw_dtype = self._get(offs + 4 + 8 * nd, np.uint32)
        offset = self._get(offs + 8 + 8 * nd, np.uint64)
        return ReaderField(orig_offs, name, [name_len, name_data, n_dims, dims, raw_dtype, offset],
                           [1, 3, 4, 5])

    def _build_tensors(self, start_offs, fields):
        """Every tensor's type, dims, byte range, alignment checked against the file, once."""
        start_offs = int(start_offs)
        data_size = len(self._plain) - start_offs
        if fields and data_size < 0:
            raise _Bad(f"the data section would start at offset {start_offs}, past the end of the "
                       f"{len(self._plain)}-byte file")
        align, spans, names = int(self.alignment), [], set()
        for field in fields:
            _, _, _, dims, raw_dtype, offset = field.parts
            where = f"tensor {field.name!r}"
            if field.name in names:
                raise _Bad(f"{where} appears twice")
            names.add(field.name)
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise _Bad(f"{where}: unknown ggml type {int(raw_dtype[0])}") from None
            if not quant.is_supported(qtype):
                raise _Unsupported(f"{where}: quantization type {qtype.name} is not supported")
            ne = [int(d) for d in dims]  # Python ints: a product cannot wrap around
            if min(ne) < 1:
                raise _Bad(f"{where}: dimensions {ne} (each must be at least 1)")
            if ne[0] % block:
                raise _Bad(f"{where}: row length {ne[0]} is not a multiple of the {qtype.name} "
                           f"block size {block}")
            nbytes = math.prod(ne) // block * type_size
            begin = int(offset[0])
            if begin % align:
                raise _Bad(f"{where}: data offset {begin} is not a multiple of the alignment {align}")
            if begin + nbytes > data_size:
                raise _Bad(f"{where}: {ne} {qtype.name} needs {nbytes} bytes at data offset {begin}, "
                           f"past the end of the {max(data_size, 0)}-byte data section")
            if nbytes:
                spans.append((begin, begin + nbytes, field.name))
        spans.sort()
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise _Bad(f"tensors {a!r} and {b!r} overlap (data offsets {begin} to {end})")
        super()._build_tensors(start_offs, fields)

    def _get_field_parts(self, orig_offs, raw_type):
        size = len(self._plain)
        if raw_type != GGUFValueType.ARRAY:
            if raw_type != GGUFValueType.STRING:
                self._need(orig_offs, np.dtype(self.gguf_scalar_to_np[GGUFValueType(raw_type)]).itemsize,
                           GGUFValueType(raw_type).name)
            return super()._get_field_parts(orig_offs, raw_type)
        self._need(orig_offs, 12, "array header")
        item_type = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        n, offs = int(count[0]), orig_offs + 12
        if int(item_type[0]) not in _VALUE_TYPES:
            raise _Bad(f"array of unknown value type {int(item_type[0])}")
        sub = GGUFValueType(int(item_type[0]))
        np_type = self.gguf_scalar_to_np.get(sub)
        if np_type is not None:
            self._need(offs, n * np.dtype(np_type).itemsize, f"array of {n} {sub.name}")
            values = self._get(offs, np_type, n)
            return 12 + int(values.nbytes), [item_type, count, values], [2], [GGUFValueType.ARRAY, sub]
        if sub != GGUFValueType.STRING:  # llama.cpp's gguf reader refuses nested arrays too
            raise _Bad("arrays of arrays are not supported")
        if n > (size - offs) // 8:
            raise _Bad(f"array of {n} strings at offset {orig_offs} cannot fit in the {size}-byte file")
        # decoded here in one pass, straight to str: a memoryview per length and per text (the stock
        # reader's parts) was ~100 MB at once for Gemma's 262K tokens, and most of the parse time
        mv, strings = self._bytes, _Strings()
        length_at = (_U64_BIG if self.byte_order == "S" else _U64_LITTLE).unpack_from  # 1/3 faster than int.from_bytes
        append = strings.append
        try:
            for _ in range(n):
                if offs + 8 > size:
                    self._need(offs, 8, "string length")
                (length,) = length_at(mv, offs)
                offs += 8
                if offs + length > size:
                    self._need(offs, length, f"string of {length} bytes")
                append(str(mv[offs:offs + length], "utf-8"))
                offs += length
        except UnicodeDecodeError:
            raise _Bad("a string is not valid UTF-8") from None
        return offs - orig_offs, [item_type, count, strings], [], [GGUFValueType.ARRAY, sub]


class _Strings(list):
    """A metadata array of strings, decoded by _Reader as it parsed them."""


class _StringArray(ReaderField):
    """A ReaderField whose strings _Reader decoded already (its last part)."""

    def contents(self, index_or_slice=slice(None)):
        return self.parts[-1][index_or_slice]


def _utf8(data, what: str) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        raise _Bad(f"{what} is not valid UTF-8") from None


def _value(name, field):
    if field.types[:1] == [GGUFValueType.ARRAY] and field.types[-1] != GGUFValueType.STRING:
        # the array as _Reader parsed it: a read-only view of the file's bytes. gguf-py's contents()
        # makes a Python list of it first (~16x its bytes: a 60 MB u8 array took 1.1 GB)
        return field.parts[field.data[0]]
    try:
        return field.contents()
    except UnicodeDecodeError:
        raise _Bad(f"metadata key {name!r}: a string is not valid UTF-8") from None


def check_hyperparameters(f, arch: str):
    """The `{arch}.*` sizes are integers in 1..2^31-1 and the floats finite, before a config reads them."""
    for key in SIZE_KEYS:
        value = f.get(f"{arch}.{key}")
        if value is not None and (isinstance(value, (bool, np.bool_, str, list, np.ndarray, float))
                                  or not 1 <= int(value) <= MAX_SIZE):
            raise ModelFormatError(f"{f.path}: metadata {arch}.{key} must be an integer from 1 to {MAX_SIZE}, "
                                   f"got {_short(value)}")
    for key in FLOAT_KEYS:
        value = f.get(f"{arch}.{key}")
        if value is not None and (isinstance(value, (bool, np.bool_, str, list, np.ndarray))
                                  or not math.isfinite(float(value))):
            raise ModelFormatError(f"{f.path}: metadata {arch}.{key} must be a finite number, got {_short(value)}")
    tokens = f.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):
        raise ModelFormatError(f"{f.path}: metadata tokenizer.ggml.tokens must be an array of strings")


def _short(value) -> str:
    text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_checked(path) -> GGUFReader:
    """gguf-py's reader of `path` (its fields and tensors), every read bounds-checked and the
    vocabulary parsed in one pass (_Reader: Gemma 3's in well under a second, the stock reader's
    ~12 s); a corrupt or unsupported file is one ModelFormatError / UnsupportedError line."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file")
    _precheck(path, os.path.getsize(path))
    try:
        return _Reader(path, "r")
    except _Unsupported as e:
        raise UnsupportedError(f"{path}: {e}") from None
    except _Bad as e:
        raise ModelFormatError(f"{path}: {e}") from None
    except (ValueError, IndexError, KeyError, struct.error, OverflowError, TypeError,
            UnicodeDecodeError, MemoryError) as e:
        raise ModelFormatError(f"{path}: corrupt GGUF header ({type(e).__name__}: {e})") from None


class GGUFFile:
    """A parsed, validated GGUF file: `metadata` (key -> Python value) and its tensors."""

    def __init__(self, path):
        self.path = Path(path)
        self.tensors = {}
        self.metadata = self._read(self.path)
        self.paths = [self.path]
        self.file_size = os.path.getsize(self.path)
        count = self._split_key(self.metadata, self.path, SPLIT_COUNT, 0xFFFF)
        if count is not None and count > 1:
            self._read_shards(count)

    def _read(self, path: Path) -> dict:
        """One file's metadata; its tensors, checked, join self.tensors."""
        reader = read_checked(path)
        size = os.path.getsize(path)
        try:
            metadata = {name: _value(name, f) for name, f in reader.fields.items()}
        except _Bad as e:
            raise ModelFormatError(f"{path}: {e}") from None
        with open(path, "rb") as fh:
            for t in reader.tensors:
                self.tensors[t.name] = self._tensor(t, size, path, fh.fileno())
        # the header's pages (the vocabulary's strings, its scores) were read once, into `metadata`:
        # dropped from the resident set (Gemma 3 270M: 6.5 MB; the page cache keeps them)
        release_pages(reader.data[:reader.data_offset])
        return metadata

    def _read_shards(self, count: int):
        """Shards 2..count beside the first: each split.no in its place, the tensors counted."""
        name = SHARD_NAME.match(self.path.name)
        if not name or int(name["count"]) != count:
            raise ModelFormatError(f"{self.path}: {SPLIT_COUNT} says {count} shards, but the file is not named "
                                   f"<name>-00001-of-{count:05d}.gguf (a split model loads from its first shard)")
        if self._split_key(self.metadata, self.path, SPLIT_NO, 0xFFFF) != 0 or int(name["no"]) != 1:
            raise ModelFormatError(f"{self.path}: shard {name['no']} of {count}; a split model loads from its "
                                   f"first shard, {name['prefix']}-00001-of-{count:05d}.gguf")
        for no in range(1, count):
            shard = self.path.with_name(f"{name['prefix']}-{no + 1:05d}-of-{count:05d}.gguf")
            if not shard.is_file():
                raise ModelFormatError(f"{shard}: missing (shard {no + 1} of the {count} of {self.path.name})")
            found = self._split_key(self._read(shard), shard, SPLIT_NO, 0xFFFF)
            if found != no:
                raise ModelFormatError(f"{shard}: metadata {SPLIT_NO} is {found}, expected {no}")
            self.paths.append(shard)
            self.file_size += os.path.getsize(shard)
        expected = self._split_key(self.metadata, self.path, SPLIT_TENSORS, MAX_SIZE)
        if expected != len(self.tensors):
            raise ModelFormatError(f"{self.path}: metadata {SPLIT_TENSORS} is {expected}, but the {count} "
                                   f"shards hold {len(self.tensors)} tensors")

    @staticmethod
    def _split_key(metadata: dict, path: Path, key: str, largest: int):
        value = metadata.get(key)
        if value is not None and (isinstance(value, (bool, np.bool_, str, list, np.ndarray, float))
                                  or not 0 <= int(value) <= largest):
            raise ModelFormatError(f"{path}: metadata {key} must be an integer from 0 to {largest}, "
                                   f"got {_short(value)}")
        return None if value is None else int(value)

    def _tensor(self, t, file_size: int, path: Path, fd: int):
        where = f"{path}: tensor {t.name!r}"
        if t.name in self.tensors:
            raise ModelFormatError(f"{where}: appears twice")
        qtype = QuantType(int(t.tensor_type))
        if not quant.is_supported(qtype):
            raise UnsupportedError(f"{where}: quantization type {qtype.name} is not supported")
        ne = [int(n) for n in t.shape]  # innermost first
        if not 1 <= len(ne) <= 4 or any(n <= 0 for n in ne):
            raise ModelFormatError(f"{where}: bad dimensions {ne}")
        fmt = quant.traits_of(qtype)
        cols, rows = ne[0], math.prod(ne[1:])
        if cols % fmt.block_size:
            raise ModelFormatError(f"{where}: row length {cols} is not a multiple of the {qtype.name} "
                                   f"block size {fmt.block_size}")
        nbytes = rows * (cols // fmt.block_size) * fmt.type_size
        if int(t.data_offset) + nbytes > file_size or t.data.nbytes != nbytes:
            raise ModelFormatError(f"{where}: {nbytes} bytes at offset {int(t.data_offset)} run past the end "
                                   f"of the {file_size}-byte file")
        data = np.asarray(t.data)
        if nbytes < SMALL_TENSOR_BYTES:  # read, not mapped (SMALL_TENSOR_BYTES); read-only like a view
            raw = os.pread(fd, nbytes, int(t.data_offset))
            if len(raw) != nbytes:
                raise ModelFormatError(f"{where}: the file ended inside the tensor's {nbytes} bytes")
            data = np.frombuffer(raw, data.dtype).reshape(data.shape)
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

