"""Hypothesis strategies: hostile GGUF and safetensors files, built by breaking valid ones.

Each GGUF example starts from a small valid llama file (tests/fuzz/gguf_build.py) and
applies one to four structure-aware mutations from the list the issue names: magic,
version, counts and string lengths up to 2^64-1, unknown value types, nested arrays,
duplicate names, offsets and sizes past the end or overlapping, misaligned data,
dims that overflow, n_dims > 4, rows that are not whole blocks, hyperparameters of
the wrong type or range; then maybe a truncation or a few flipped bytes.
"""

from __future__ import annotations

import copy
import json
import struct
from functools import lru_cache

import numpy as np
from hypothesis import strategies as st

from tests.fuzz import gguf_build as gb

EDGE_U64 = [0, 1, 2, 3, 31, 32, 33, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1,
            2**48, 2**62, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1]
u64s = st.one_of(st.sampled_from(EDGE_U64), st.integers(0, 2**64 - 1), st.integers(0, 4096))
u32s = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 8, 12, 13, 255, 2**16, 2**31, 2**32 - 1]),
                 st.integers(0, 2**32 - 1))
GGML_TYPES = [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 24, 30, 39, 40, 41, 99, 2**31]
SIZE_KEYS = ["llama.embedding_length", "llama.block_count", "llama.attention.head_count",
             "llama.attention.head_count_kv", "llama.feed_forward_length", "llama.context_length",
             "llama.rope.dimension_count", "llama.vocab_size", "tokenizer.ggml.eos_token_id",
             "tokenizer.ggml.bos_token_id", "general.alignment"]


@lru_cache(maxsize=None)
def _base(kind: str) -> gb.Spec:
    if kind == "kquant":
        return gb.tiny_llama_spec(hidden=256, n_heads=4, n_kv_heads=2, ffn=256, weight_type=12, embed_type=14)
    return gb.tiny_llama_spec(weight_type={"q4_0": 2, "q4_1": 3, "q8_0": 8, "f16": 1}[kind])


def _values(vtype):
    if vtype in (gb.F32, gb.F64):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if vtype == gb.F32 else 64)
    if vtype == gb.BOOL:
        return st.booleans()
    if vtype == gb.STRING:
        return st.one_of(st.text(max_size=8), st.binary(max_size=8))
    return st.integers(-(2**63), 2**64 - 1)


# --- one mutation each: draw(data, spec) changes the spec in place ---------------------------
def m_magic(data, s):
    s.magic = data.draw(st.sampled_from([b"GGUF", b"GGUG", b"FUGG", b"\0\0\0\0", b"GGML", b"gguf"]))


def m_version(data, s):
    s.version = data.draw(st.one_of(st.sampled_from([0, 1, 2, 3, 4, 2**16, 2**24 * 3, 2**32 - 1]), u32s))


def m_counts(data, s):
    if data.draw(st.booleans()):
        s.n_kv = data.draw(st.one_of(u64s, st.just(len(s.kvs) + 1), st.just(max(0, len(s.kvs) - 1))))
    else:
        s.n_tensors = data.draw(st.one_of(u64s, st.just(len(s.tensors) + 1), st.just(max(0, len(s.tensors) - 1))))


def m_key_length(data, s):
    kv = data.draw(st.sampled_from(s.kvs))
    kv.key_len = data.draw(u64s)


def m_string_length(data, s):
    t = data.draw(st.sampled_from(s.tensors))
    t.name_len = data.draw(u64s)


def m_value_type(data, s):
    """A key of a type it should not have, or of a type that does not exist."""
    kv = data.draw(st.sampled_from(s.kvs))
    vtype = data.draw(st.one_of(st.integers(0, 12), st.integers(13, 2**32 - 1)))
    kv.vtype = vtype
    kv.value = (data.draw(st.binary(max_size=16)) if vtype > 12 else
                gb.Array(gb.U8, [1, 2]) if vtype == gb.ARRAY else data.draw(_values(vtype)))


def m_size_key(data, s):
    key = data.draw(st.sampled_from(SIZE_KEYS))
    vtype = data.draw(st.sampled_from([gb.U32, gb.I32, gb.U64, gb.I64, gb.F32, gb.STRING, gb.BOOL, gb.U8]))
    value = data.draw(st.one_of(st.sampled_from([0, 1, 2, 3, 15, 17, 63, 65, 2**31, -1]), _values(vtype))) \
        if vtype not in (gb.STRING, gb.F32, gb.BOOL) else data.draw(_values(vtype))
    if vtype in (gb.F32,) and isinstance(value, int):
        value = float(value)
    for kv in s.kvs:
        if kv.key == key:
            kv.vtype, kv.value = vtype, value
            return
    s.kvs.append(gb.KV(key, vtype, value))


def m_array(data, s):
    """A metadata array with a hostile item type, count or nesting."""
    item = data.draw(st.one_of(st.integers(0, 12), st.integers(13, 2**32 - 1)))
    if item == gb.ARRAY:
        items = [gb.Array(gb.U8, [1])]
    elif item in gb.SCALAR_FORMATS or item == gb.STRING:
        items = data.draw(st.lists(_values(item), max_size=4))
    else:
        items = []
    arr = gb.Array(item, items, count=data.draw(st.one_of(st.none(), u64s)))
    if data.draw(st.booleans()):
        s.kvs.append(gb.KV(data.draw(st.sampled_from(["x.array", "tokenizer.ggml.tokens",
                                                        "tokenizer.ggml.token_type", "tokenizer.ggml.merges"])),
                           gb.ARRAY, arr))
    else:
        s.kvs.insert(data.draw(st.integers(0, len(s.kvs))), gb.KV("x.array", gb.ARRAY, arr))


def m_duplicate(data, s):
    if data.draw(st.booleans()):
        s.tensors.append(copy.deepcopy(data.draw(st.sampled_from(s.tensors))))
    else:
        s.kvs.append(copy.deepcopy(data.draw(st.sampled_from(s.kvs))))


def m_offset(data, s):
    t = data.draw(st.sampled_from(s.tensors))
    other = data.draw(st.sampled_from(s.tensors))
    t.offset = data.draw(st.one_of(u64s, st.just(other.offset), st.just(t.offset + 1), st.just(t.offset + 16),
                                   st.just(len(s.data)), st.just(len(s.data) - 32), st.just(2**64 - 32)))


def m_dims(data, s):
    t = data.draw(st.sampled_from(s.tensors))
    t.dims = data.draw(st.lists(st.one_of(u64s, st.sampled_from([1, 16, 32, 48, 64, 256, 257])),
                                min_size=0, max_size=6))
    if data.draw(st.booleans()):
        t.n_dims = data.draw(st.one_of(st.integers(0, 8), u32s))


def m_type(data, s):
    t = data.draw(st.sampled_from(s.tensors))
    t.ggml_type = data.draw(st.one_of(st.sampled_from(GGML_TYPES), u32s))


def m_alignment(data, s):
    for kv in s.kvs:
        if kv.key == "general.alignment":
            if kv.vtype not in (gb.U8, gb.I8, gb.U16, gb.I16, gb.U32, gb.I32, gb.U64, gb.I64):
                kv.vtype = gb.U32  # m_value_type may have made it an array or a string: an integer's bytes need an integer type
            kv.value = data.draw(st.sampled_from([0, 1, 3, 8, 16, 64, 2**20, 2**31, 2**32 - 1]))
    if data.draw(st.booleans()):
        s.alignment = data.draw(st.sampled_from([1, 8, 64]))


def m_tokenizer(data, s):
    key = data.draw(st.sampled_from(["tokenizer.ggml.model", "tokenizer.ggml.pre", "general.architecture"]))
    value = data.draw(st.sampled_from(["gpt2", "llama", "bert", "", "gemma3", "\udcff".encode("utf-8", "surrogatepass"),
                                       b"\xff\xfe"]))
    for kv in s.kvs:
        if kv.key == key:
            kv.vtype, kv.value = gb.STRING, value


MUTATIONS = [m_magic, m_version, m_counts, m_key_length, m_string_length, m_value_type, m_size_key,
             m_array, m_duplicate, m_offset, m_dims, m_type, m_alignment, m_tokenizer]


@st.composite
def gguf_files(draw, mutations=MUTATIONS):
    """A Case: the bytes of a hostile GGUF file and how they were made."""
    data = _Drawer(draw)
    s = copy.deepcopy(_base(draw(st.sampled_from(["q4_0", "q4_1", "q8_0", "f16", "kquant"]))))
    names = []
    for m in draw(st.lists(st.sampled_from(mutations), min_size=1, max_size=4)):
        m(data, s)
        names.append(m.__name__)
    raw = s.encode()
    tail = draw(st.sampled_from(["none", "none", "truncate", "flip"]))
    if tail == "truncate":
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif tail == "flip" and raw:
        buf = bytearray(raw)
        for _ in range(draw(st.integers(1, 4))):
            buf[draw(st.integers(0, len(buf) - 1))] = draw(st.integers(0, 255))
        raw = bytes(buf)
    return Case(raw, "+".join(names) + ("" if tail == "none" else f"+{tail}"))


class Case(bytes):
    """The bytes of a generated file; its repr is the recipe and size, not 100 KB of bytes."""

    def __new__(cls, raw: bytes, what: str):
        obj = super().__new__(cls, raw)
        obj.what = what
        return obj

    def __repr__(self):
        return f"<{self.what}: {len(self)} bytes>"


class _Drawer:
    """Lets the mutations above call data.draw(strategy) inside a composite strategy."""

    def __init__(self, draw):
        self.draw = draw


# --- safetensors ----------------------------------------------------------------------------
ST_DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"]


def safetensors_bytes(header, data: bytes = b"", header_len: int | None = None, raw_header: bytes | None = None):
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", (len(h) if header_len is None else header_len) & (2**64 - 1)) + h + data


def valid_safetensors_header():
    """A small valid header of tensors of every dtype, packed back to back, and its data size."""
    header, offset = {}, 0
    for i, dtype in enumerate(ST_DTYPES):
        shape = [2, 3] if i % 2 else [5]
        n = int(np.prod(shape)) * {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2,
                                   "I8": 1, "U8": 1, "BOOL": 1}[dtype]
        header[f"t{i}.{dtype.lower()}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    return header, offset


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6))
json_any = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=3),
                                                         st.dictionaries(st.text(max_size=4), c, max_size=3)),
                        max_leaves=8)


@st.composite
def safetensors_files(draw):
    """A Case: the bytes of a hostile safetensors file and how they were made."""
    header, size = valid_safetensors_header()
    header = copy.deepcopy(header)
    names = list(header)
    what = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["dtype", "shape", "offsets", "entry", "top", "metadata", "overlap",
                                     "extra", "data_size"]))
        what.append(kind)
        name = draw(st.sampled_from(names))
        if not isinstance(header.get(name), dict):  # an earlier step replaced the entry
            header[name] = {}
        if kind == "dtype":
            dtypes = ST_DTYPES + ["F8_E4M3", "U64", "f32", ""]
            header[name]["dtype"] = draw(st.one_of(st.sampled_from(dtypes), json_any))
        elif kind == "shape":
            header[name]["shape"] = draw(st.one_of(
                st.lists(st.one_of(st.integers(-2, 2**64), st.sampled_from([0, 1, 10**12])), max_size=70), json_any))
        elif kind == "offsets":
            header[name]["data_offsets"] = draw(st.one_of(
                st.lists(st.one_of(st.integers(-(2**64), 2**65), st.sampled_from([0, size, size + 1])),
                         max_size=3), json_any))
        elif kind == "entry":
            header[name] = draw(json_any)
        elif kind == "top":
            header = draw(json_any)
            break
        elif kind == "metadata":
            header["__metadata__"] = draw(json_any)
        elif kind == "overlap":
            other = header.get(draw(st.sampled_from(names)))
            header[name]["data_offsets"] = other.get("data_offsets") if isinstance(other, dict) else None
        elif kind == "extra":
            header[draw(st.text(max_size=6))] = {"dtype": "F32", "shape": [draw(st.integers(0, 4))],
                                                  "data_offsets": [size, size + 4 * draw(st.integers(0, 4))]}
        elif kind == "data_size":
            size = draw(st.sampled_from([0, size - 1, size + 1, size // 2]))
    data = b"\x01" * max(0, size)
    header_len = draw(st.one_of(st.none(), st.none(), st.none(), st.sampled_from(EDGE_U64)))
    raw = safetensors_bytes(header, data, header_len)
    if draw(st.integers(0, 9)) == 0:
        raw = raw[:draw(st.integers(0, len(raw)))]
        what.append("truncate")
    return Case(raw, "+".join(what))
