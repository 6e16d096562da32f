"""Hugging Face checkpoints: config.json plus one or more *.safetensors files.

The file format is an 8-byte little-endian header length, a JSON header mapping
tensor names to {dtype, shape, data_offsets}, then the raw data. We validate the
header ourselves and memory-map the data with NumPy instead of going through
safetensors' numpy API, because that API copies every tensor into memory and has
no bfloat16: here each tensor is a zero-copy read-only view (bfloat16 as its
uint16 bits), and nothing is allocated because a header claims it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from pyml.core.errors import ModelFormatError
from pyml.nlp.loaders.store import TensorStore

# safetensors dtype -> (numpy dtype for the view, internal type name)
DTYPES = {
    "F32": (np.float32, "F32"), "F16": (np.float16, "F16"), "BF16": (np.uint16, "BF16"),
    "F64": (np.float64, "F64"), "I64": (np.int64, "I64"), "I32": (np.int32, "I32"),
    "I16": (np.int16, "I16"), "I8": (np.int8, "I8"), "U8": (np.uint8, "U8"), "BOOL": (np.bool_, "BOOL"),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit
MAX_RANK = 8  # NumPy refuses more than 64 dimensions; no checkpoint has more than 5


def _unique_keys(pairs):
    """json object_pairs_hook: a name given twice is an error, not "the last one wins"."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r} appears twice")
        obj[key] = value
    return obj


def _is_int(v) -> bool:
    return type(v) is int  # not bool, not float


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{directory}: no config.json (expected a Hugging Face model directory)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return config


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
            raise ModelFormatError(f"{index}: not a safetensors index ({e})") from None
        for n in names:  # a shard is a file beside the index, never a path elsewhere
            if not isinstance(n, str) or Path(n).name != n or n in (".", ".."):
                raise ModelFormatError(f"{index}: shard name {n!r} is not a file name in {directory}")
        files = [directory / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelFormatError(f"{index}: shard(s) missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{directory}: no *.safetensors files")
    return files


def parse_header(path: Path, file_size: int) -> tuple[dict, int]:
    """(header entries, data offset), validated against the file size."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise ModelFormatError(f"{path}: truncated (no safetensors header)")
        n = int.from_bytes(raw_len, "little")
        if n > min(MAX_HEADER_BYTES, file_size - 8):
            raise ModelFormatError(f"{path}: header length {n} runs past the end of the {file_size}-byte file")
        try:
            header = json.loads(f.read(n), object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError, UnicodeDecodeError) as e:  # ValueError: JSON, huge ints, twins
            raise ModelFormatError(f"{path}: header is not valid JSON ({_short(e)})") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: header is not a JSON object")
    if not isinstance(header.pop("__metadata__", {}), dict):
        raise ModelFormatError(f"{path}: __metadata__ is not a JSON object")
    data_start, data_size = 8 + n, file_size - 8 - n
    spans = []
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ModelFormatError(f"{where}: entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ModelFormatError(f"{where}: unknown dtype {_short(dtype)} (expected one of {', '.join(DTYPES)})")
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK and all(_is_int(d) and d >= 0 for d in shape)):
            raise ModelFormatError(f"{where}: shape {_short(shape)} is not a list of at most {MAX_RANK} "
                                   f"non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise ModelFormatError(f"{where}: data_offsets {_short(offsets)} is not [begin, end]")
        begin, end = offsets
        expected = math.prod(shape) * np.dtype(DTYPES[dtype][0]).itemsize
        if not 0 <= begin <= end <= data_size:
            raise ModelFormatError(f"{where}: data_offsets {offsets} outside the {data_size}-byte data section")
        if end - begin != expected:
            raise ModelFormatError(f"{where}: {end - begin} bytes of data for shape {shape} {dtype} "
                                   f"(expected {expected})")
        if end > begin:
            spans.append((begin, end, name))
    spans.sort()
    for (_, a_end, a), (b_begin, _, b) in zip(spans, spans[1:]):
        if b_begin < a_end:
            raise ModelFormatError(f"{path}: tensors {a!r} and {b!r} overlap (data offsets {b_begin} to {a_end})")
    return header, data_start


def _short(value, limit: int = 80) -> str:
    text = str(value) if isinstance(value, Exception) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load_tensors(directory: Path) -> TensorStore:
    """Every tensor of a checkpoint directory as a read-only memory-mapped view."""
    tensors = {}
    for path in safetensors_files(directory):
        size = os.path.getsize(path)
        header, data_start = parse_header(path, size)
        if not header:
            continue
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            np_dtype, type_name = DTYPES[info["dtype"]]
            begin, end = info["data_offsets"]
            view = mm[data_start + begin:data_start + end].view(np_dtype).reshape(info["shape"])
            if not view.flags.aligned:  # legal in safetensors (after an odd-sized U8 tensor); kernels want aligned
                view = view.copy()
            if name in tensors:
                raise ModelFormatError(f"{path}: tensor {name!r} appears in more than one shard")
            tensors[name] = (view, type_name)
    return TensorStore(tensors, source=str(directory))
