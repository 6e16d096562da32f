"""GGUF files byte by byte, including the ones no well-behaved writer would produce.

`build()` serialises a header exactly as described — counts, lengths, types and
offsets may all lie — so tests and the fuzzers can hand the loader any file.
`tiny_llama()` writes a small valid llama GGUF (through gguf-py's own writer) that
pyml loads and runs; the seeds of the fuzz campaign are built from it and from the
headers of the real model files.

Layout (GGUF v3, little-endian): magic, u32 version, u64 n_tensors, u64 n_kv; each
kv: string key, u32 value type, value; each tensor info: string name, u32 n_dims,
u64 dims[n_dims] (innermost first), u32 ggml type, u64 offset (from the data start);
padding to `general.alignment` (default 32); the data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR_FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?",
                  U64: "Q", I64: "q", F64: "d"}
_MASK = {"B": 0xFF, "b": 0xFF, "H": 0xFFFF, "h": 0xFFFF, "I": 0xFFFFFFFF, "i": 0xFFFFFFFF,
         "Q": (1 << 64) - 1, "q": (1 << 64) - 1}
_UNSIGNED = {"b": "B", "h": "H", "i": "I", "q": "Q"}


def u32(n: int) -> bytes:
    return struct.pack("<I", n & 0xFFFFFFFF)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n & ((1 << 64) - 1))


def gguf_string(s, length: int | None = None) -> bytes:
    """u64 length + bytes; `length` may claim more (or fewer) bytes than follow."""
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return u64(len(b) if length is None else length) + b


def scalar(vtype: int, value) -> bytes:
    fmt = SCALAR_FORMATS[vtype]
    if fmt in _MASK and isinstance(value, int):  # any integer fits: it wraps like a C cast
        return struct.pack("<" + _UNSIGNED.get(fmt, fmt), value & _MASK[fmt])
    return struct.pack("<" + fmt, value)


def value_bytes(vtype: int, value) -> bytes:
    """A value of type vtype; an ARRAY value is Array(item_type, items[, count])."""
    if vtype == STRING:
        return gguf_string(value)
    if vtype == ARRAY:
        return value.encode()
    if vtype in SCALAR_FORMATS:
        return scalar(vtype, value)
    return bytes(value)  # an unknown type: the raw bytes that follow it


@dataclass
class Array:
    item_type: int
    items: list
    count: int | None = None  # claimed element count (default: len(items))

    def encode(self) -> bytes:
        n = len(self.items) if self.count is None else self.count
        return u32(self.item_type) + u64(n) + b"".join(value_bytes(self.item_type, v) for v in self.items)


@dataclass
class KV:
    key: str | bytes
    vtype: int
    value: object
    key_len: int | None = None  # claimed key length

    def encode(self) -> bytes:
        return gguf_string(self.key, self.key_len) + u32(self.vtype) + value_bytes(self.vtype, self.value)


@dataclass
class TensorInfo:
    name: str | bytes
    dims: list            # innermost first, as GGUF stores them
    ggml_type: int
    offset: int = 0       # from the start of the data section
    n_dims: int | None = None   # claimed number of dims (default: len(dims))
    name_len: int | None = None

    def encode(self) -> bytes:
        n = len(self.dims) if self.n_dims is None else self.n_dims
        return (gguf_string(self.name, self.name_len) + u32(n) + b"".join(u64(d) for d in self.dims)
                + u32(self.ggml_type) + u64(self.offset))


@dataclass
class Spec:
    kvs: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    data: bytes = b""
    version: int = 3
    magic: bytes = b"GGUF"
    n_tensors: int | None = None  # claimed counts (default: the real ones)
    n_kv: int | None = None
    alignment: int = 32           # the padding actually written before the data

    def encode(self) -> bytes:
        head = (self.magic + u32(self.version)
                + u64(len(self.tensors) if self.n_tensors is None else self.n_tensors)
                + u64(len(self.kvs) if self.n_kv is None else self.n_kv))
        body = head + b"".join(kv.encode() for kv in self.kvs) + b"".join(t.encode() for t in self.tensors)
        pad = (-len(body)) % self.alignment if self.alignment > 0 else 0
        return body + b"\0" * pad + self.data


def build(kvs=(), tensors=(), data: bytes = b"", **options) -> bytes:
    return Spec(list(kvs), list(tensors), data, **options).encode()


def quant_bytes(ggml_type: int, shape_innermost_first, rng=None) -> bytes:
    """Bytes of a tensor of this type: float types hold N(0, 0.02) values, quant blocks valid scales."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    rng = rng or np.random.default_rng(0)
    ne = list(shape_innermost_first)
    values = (rng.standard_normal(int(np.prod(ne))) * 0.02).astype(np.float32).reshape(ne[::-1])
    qtype = Q(ggml_type)
    if qtype == Q.F32:
        return values.tobytes()
    if qtype == Q.F16:
        return values.astype(np.float16).tobytes()
    try:
        return gguf.quants.quantize(values, qtype).tobytes()
    except NotImplementedError:  # no quantizer in gguf-py (k-quants): random blocks, finite f16 scales
        block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
        n_blocks = values.size // block
        raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
        raw[:, :4] = np.frombuffer(np.full(2 * n_blocks, 0.01, np.float16).tobytes(), np.uint8).reshape(-1, 4)
        if qtype == Q.Q6_K:  # its f16 scale is the last two bytes
            raw[:, -2:] = np.frombuffer(np.full(n_blocks, 0.01, np.float16).tobytes(), np.uint8).reshape(-1, 2)
        return raw.tobytes()


def byte_level_vocab():
    """GPT-2's byte-level tokens (every byte one token) and an end-of-text token."""
    from pyml.nlp.tokenizer import BYTE_OF_CHAR
    chars = {b: ch for ch, b in BYTE_OF_CHAR.items()}
    return [chars[b] for b in range(256)] + ["<|endoftext|>"]


def tiny_llama_spec(hidden: int = 64, n_heads: int = 4, n_kv_heads: int = 2, ffn: int = 128,
                    n_layers: int = 1, context: int = 64, weight_type: int = 2, embed_type: int = 8,
                    alignment: int = 32, seed: int = 0) -> Spec:
    """A small valid llama GGUF as a Spec (so tests can break one field of it).

    weight_type / embed_type are ggml type ids (2 = Q4_0, 3 = Q4_1, 8 = Q8_0, 12 = Q4_K, 14 = Q6_K).
    """
    rng = np.random.default_rng(seed)
    tokens = byte_level_vocab()
    vocab = len(tokens)
    head_dim = hidden // n_heads
    kvs = [KV("general.architecture", STRING, "llama"),
           KV("general.alignment", U32, alignment),
           KV("llama.embedding_length", U32, hidden), KV("llama.block_count", U32, n_layers),
           KV("llama.attention.head_count", U32, n_heads), KV("llama.attention.head_count_kv", U32, n_kv_heads),
           KV("llama.feed_forward_length", U32, ffn), KV("llama.context_length", U32, context),
           KV("llama.rope.dimension_count", U32, head_dim),
           KV("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
           KV("tokenizer.ggml.model", STRING, "gpt2"), KV("tokenizer.ggml.pre", STRING, "default"),
           KV("tokenizer.ggml.tokens", ARRAY, Array(STRING, tokens)),
           KV("tokenizer.ggml.token_type", ARRAY, Array(I32, [1] * 256 + [3])),
           KV("tokenizer.ggml.merges", ARRAY, Array(STRING, [])),
           KV("tokenizer.ggml.eos_token_id", U32, vocab - 1)]
    shapes = [("token_embd.weight", [hidden, vocab], embed_type), ("output_norm.weight", [hidden], 0)]
    for i in range(n_layers):
        p = f"blk.{i}."
        shapes += [(p + "attn_norm.weight", [hidden], 0), (p + "ffn_norm.weight", [hidden], 0),
                   (p + "attn_q.weight", [hidden, n_heads * head_dim], weight_type),
                   (p + "attn_k.weight", [hidden, n_kv_heads * head_dim], weight_type),
                   (p + "attn_v.weight", [hidden, n_kv_heads * head_dim], weight_type),
                   (p + "attn_output.weight", [n_heads * head_dim, hidden], weight_type),
                   (p + "ffn_gate.weight", [hidden, ffn], weight_type),
                   (p + "ffn_up.weight", [hidden, ffn], weight_type),
                   (p + "ffn_down.weight", [ffn, hidden], weight_type)]
    tensors, data = [], bytearray()
    for name, dims, qtype in shapes:
        norm = name.endswith("norm.weight")
        raw = np.ones(dims, np.float32).tobytes() if norm else quant_bytes(qtype, dims, rng)
        data += b"\0" * ((-len(data)) % alignment)
        tensors.append(TensorInfo(name, dims, qtype, len(data)))
        data += raw
    return Spec(kvs, tensors, bytes(data), alignment=alignment)


def tiny_llama(path=None, **options) -> bytes:
    """The bytes of a small valid llama GGUF (written to `path` too, when given)."""
    data = tiny_llama_spec(**options).encode()
    if path is not None:
        Path(path).write_bytes(data)
    return data


def real_header_spec(path, n_tokens: int = 300, data_bytes: int = 4096) -> Spec:
    """A real model file's metadata and tensor infos, arrays cut to `n_tokens` entries and the data
    section cut to `data_bytes` (so most tensors run past the end: a seed, not a loadable model)."""
    from gguf import GGUFReader, GGUFValueType
    r = GGUFReader(path)
    kvs = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        t = f.types[0]
        if t == GGUFValueType.ARRAY:
            sub = f.types[1]
            items = [f.parts[i] for i in f.data[:n_tokens]]
            if sub == GGUFValueType.STRING:
                items = [bytes(p) for p in items]
            else:
                items = [p.tolist()[0] for p in items]
            kvs.append(KV(name, ARRAY, Array(int(sub), items)))
        elif t == GGUFValueType.STRING:
            kvs.append(KV(name, STRING, bytes(f.parts[-1])))
        else:
            kvs.append(KV(name, int(t), f.parts[-1].tolist()[0]))
    tensors = [TensorInfo(t.name, [int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset - r.data_offset))
               for t in r.tensors]
    data = bytes(np.asarray(r.data[r.data_offset:r.data_offset + data_bytes]))
    return Spec(kvs, tensors, data, alignment=int(r.alignment))
