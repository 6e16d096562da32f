"""Preallocated key/value cache in a stored type (f32, f16, q8_0), one set of arrays per layer.

The layout is the attention kernels' (nn/attention_kernels.py): keys in tiles of 8 positions x
head_dim with the positions in vector lanes, values [n_kv_heads, slots, head_dim]; q8_0 adds an
fp16 scale per 32 values. Position p lives in slot p % slots. A full layer has a slot for every
position; a sliding-window layer keeps a ring (as mlx-lm's RotatingKVCache) of its window plus
RING_SLACK slots, enough for a prefill piece of RING_SLACK + 1 queries to see its whole window.
A head_dim that is not a multiple of 16 is stored zero-padded to one. Nothing is reallocated
per token.

f16 is the default, as llama.cpp's: half the bytes of f32 for a decode step to read, with
errors documented in docs/performance-journal.md ("Attention and the KV cache").
"""

from __future__ import annotations

import mmap

import numpy as np

from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.nn.attention_kernels import BLOCK, KV_TYPES, QBLOCK, read_kv, write_kv

_perf = perf.get("pyml.nn.kv_cache")
UPDATE_SPAN = ("kv_cache::update", "layer={} pos={} {}")  # layer, pos, kv type

DEFAULT_KV_TYPE = "f16"
RING_SLACK = 256  # slots beyond the window a sliding layer's ring keeps (the prefill piece - 1)
_NO_SCALES = np.ones((1, 1, 1, 1), np.float32)  # the float types' scale arrays: never read


def check_kv_type(kv_type: str, head_dim: int) -> str:
    if kv_type not in KV_TYPES:
        raise PymlError(f"unknown KV cache type {kv_type!r}: choose one of {', '.join(KV_TYPES)}")
    if kv_type == "q8_0" and head_dim % QBLOCK:
        raise PymlError(f"KV cache type q8_0 needs a head_dim that is a multiple of {QBLOCK}, "
                        f"this model's is {head_dim}")
    return kv_type


def layer_slots(max_len: int, windows: list) -> list:
    """Slots per layer: every position, or a sliding window's ring of window + RING_SLACK."""
    full = -(-max_len // BLOCK) * BLOCK
    return [min(full, -(-(w + RING_SLACK) // BLOCK) * BLOCK) if w else full for w in windows]


def _zeros_as_written(shape: tuple, dtype) -> np.ndarray:
    """Zeros whose pages the system supplies 4 KiB at a time as they are first written: an anonymous
    mapping. (np.zeros asks for huge pages past 4 MiB, and a huge page's first write zeroes 2 MiB: a
    pool of 16 x 4096 positions took 10 ms a layer to write a new sequence's first 39 positions.)"""
    count = int(np.prod(shape))
    buffer = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize))
    return np.frombuffer(buffer, dtype, count).reshape(shape)


def allocate(c, lead: tuple) -> tuple:
    """(k, v, k_scale, v_scale): a list per layer of zeroed arrays in the attention kernels' layout
    for the sizes of `c` (a KVCache or KVPool), with `lead` axes in front (a pool's sequences).
    A pool's pages are committed as its sequences fill (_zeros_as_written), not n x positions up front."""
    code = KV_TYPES[c.kv_type]
    dim = -(-c.head_dim // (2 * BLOCK)) * 2 * BLOCK  # the kernels step through hd 16 at a time: zero padding
    nkv = c.n_kv_heads
    zeros = _zeros_as_written if lead else np.zeros
    k = [zeros(lead + (nkv, n // BLOCK, dim, BLOCK), code) for n in c.slots]
    v = [zeros(lead + (nkv, n, dim), code) for n in c.slots]
    if c.kv_type == "q8_0":
        k_scale = [zeros(lead + (nkv, n // BLOCK, c.head_dim // QBLOCK, BLOCK), np.uint16) for n in c.slots]
        v_scale = [zeros(lead + (nkv, n, c.head_dim // QBLOCK), np.uint16) for n in c.slots]
    else:  # never read: one of the right rank per sequence
        k_scale = v_scale = [np.ones(lead + _NO_SCALES.shape, np.float32) if lead else _NO_SCALES] * c.n_layers
    return k, v, k_scale, v_scale


def layer_addresses(c) -> np.ndarray:
    """int64 [n_layers, 4]: the data addresses of each layer's layer() arrays of `c` (a KVCache or KVPool)."""
    return np.array([[a.ctypes.data for a in c.layer(i)] for i in range(c.n_layers)], np.int64)


class KVCache:
    """Keys and values of `n_layers` layers for positions 0 .. max_len-1.

    windows: per layer, None (every position kept) or the sliding window (a ring of
    window + RING_SLACK slots, when that is less than max_len).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, kv_type: str = DEFAULT_KV_TYPE,
                 windows=None, arrays=None):
        self.kv_type = check_kv_type(kv_type, head_dim)
        self.n_layers, self.n_kv_heads, self.head_dim, self.max_len = n_layers, n_kv_heads, head_dim, max_len
        windows = list(windows) if windows is not None else [None] * n_layers
        self.windows = windows
        self.slots = layer_slots(max_len, windows)
        # arrays: (k, v, k_scale, v_scale) lists of views a KVPool gives one of its sequences
        self.k, self.v, self.k_scale, self.v_scale = arrays or allocate(self, ())
        self._addresses = None
        self.length = 0  # positions filled (advanced by the model after a forward pass)
        self.written = [0] * n_layers  # per layer, the end of the positions last written
        self._rings = {i for i in range(n_layers) if self.is_ring(i)}

    @property
    def nbytes(self) -> int:
        arrays = self.k + self.v + (self.k_scale + self.v_scale if self.kv_type == "q8_0" else [])
        return sum(a.nbytes for a in arrays)

    def bytes_per_position(self, layer: int) -> float:
        """Bytes the layer stores per cached position (keys, values and their scales, padding
        included): what a decode step reads per position it attends to."""
        arrays = [self.k[layer], self.v[layer]]
        if self.kv_type == "q8_0":
            arrays += [self.k_scale[layer], self.v_scale[layer]]
        return sum(a.nbytes for a in arrays) / self.slots[layer]

    def snapshot(self):
        """What a later restore() needs to return the cache to this moment: the ring layers' arrays
        (writes past `length` overwrite their old positions; a full layer's are only appended to)."""
        rings = [i for i in range(self.n_layers) if self.is_ring(i)]
        return (self.length, list(self.written),
                {i: [a.copy() for a in (self.k[i], self.v[i], self.k_scale[i], self.v_scale[i])] for i in rings})

    def restore(self, snapshot) -> None:
        """Back to what the cache held at snapshot() (a benchmark repeating work at one depth)."""
        self.length, written, rings = snapshot
        self.written = list(written)
        for i, arrays in rings.items():
            for dst, src in zip((self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]), arrays):
                dst[...] = src

    def rollback(self, length: int) -> None:
        """Forget the positions from `length` on (a speculative step's rejected drafts); the next
        write there overwrites them. Every stored type keeps each position apart (a q8_0 scale
        covers 32 values of one position), so nothing else changes. A ring's writes past `length`
        overwrote the slots of positions one ring back, older than any later query's window while
        the rollback is at most RING_SLACK positions; claim() refuses a write that needs them."""
        if not 0 <= length <= self.length:
            raise PymlError(f"cannot roll the KV cache back to {length}: it holds {self.length} positions")
        with _perf.debug("kv_cache::rollback", "from={} to={}", self.length, length, op="kv_cache"):
            self.length = length

    def is_ring(self, layer: int) -> bool:
        """Whether the layer keeps only its last slots positions (a sliding window's ring)."""
        return self.slots[layer] < self.max_len

    def resumable(self, pos: int) -> bool:
        """Whether a forward pass may start at `pos` after what was written: a ring has
        overwritten positions older than its slots, and a sliding layer resuming at pos needs
        the window-1 positions before it (a PromptCache reusing a short prefix of a long
        history must prefill from 0 when this is False)."""
        return all(self._holds_window(i, pos) for i in range(self.n_layers))

    def _holds_window(self, layer: int, pos: int) -> bool:
        """resumable() for one layer: the others may already be further on in the same pass."""
        end = self.written[layer]
        return (pos >= end or pos == 0 or not self.is_ring(layer)
                or pos - self.windows[layer] + 1 >= end - self.slots[layer])

    def layer(self, layer: int):
        """(keys, k_scale, values, v_scale): the arrays the attention kernels take."""
        return self.k[layer], self.k_scale[layer], self.v[layer], self.v_scale[layer]

    def addresses(self) -> np.ndarray:
        """int64 [n_layers, 4]: the data addresses of each layer's layer() arrays, for compiled code
        that walks the layers (nn/fused.py's FusedStep); the arrays are never reallocated."""
        if self._addresses is None:
            self._addresses = layer_addresses(self)
        return self._addresses

    def claim(self, layer: int, pos: int, T: int = 1) -> None:
        """Check that positions pos .. pos+T-1 may be written to the layer and note them written; the
        caller writes them (update() does; a fused decode step inside its attention kernel)."""
        if pos + T > self.max_len:
            raise PymlError(f"KV cache full: position {pos + T} exceeds its {self.max_len} slots")
        if not self._holds_window(layer, pos):
            raise PymlError(f"layer {layer}'s sliding-window ring no longer holds the positions before {pos}: "
                            f"prefill from position 0")
        self.written[layer] = pos + T

    def claim_layers(self, layers: range, pos: int) -> None:
        """claim(layer, pos) for each of a range of layers (a decode step's run): only the ring
        layers are checked one by one (claim() looped over SmolLM2's 30 layers cost 5-7 µs of a
        step, on the caches its weights had just flushed)."""
        if pos + 1 > self.max_len:
            raise PymlError(f"KV cache full: position {pos + 1} exceeds its {self.max_len} slots")
        for layer in self._rings.intersection(layers):
            if not self._holds_window(layer, pos):
                raise PymlError(f"layer {layer}'s sliding-window ring no longer holds the positions before "
                                f"{pos}: prefill from position 0")
        self.written[layers.start:layers.stop] = [pos + 1] * len(layers)

    def update(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray):
        """Write k, v [T, n_kv_heads, head_dim] float32 at positions pos .. pos+T-1, converted to the
        stored type (a ring layer keeps the last of them when T exceeds its slots)."""
        T = k.shape[0]
        self.claim(layer, pos, T)
        with _perf.trace(*UPDATE_SPAN, layer, pos, self.kv_type, layer=layer,
                         op="kv_cache"):
            skip = max(0, T - self.slots[layer])
            write_kv(np.ascontiguousarray(k[skip:], np.float32), np.ascontiguousarray(v[skip:], np.float32),
                     pos + skip, *self.layer(layer))

    def view(self, layer: int, end: int, start: int = 0):
        """Keys and values of positions start .. end-1 as float32 [n_kv_heads, end-start, head_dim]
        copies (dequantized); a ring layer holds only its last slots positions."""
        if self.is_ring(layer) and start < end - self.slots[layer]:
            raise PymlError(f"layer {layer} keeps positions from {end - self.slots[layer]} on, not {start}")
        shape = (self.n_kv_heads, end - start, self.head_dim)
        keys, values = np.empty(shape, np.float32), np.empty(shape, np.float32)
        read_kv(*self.layer(layer), start, end, keys, values)
        return keys, values


class KVPool:
    """The caches of up to `n_seqs` sequences in one allocation per layer ([n_seqs, ...] arrays, as
    llama.cpp's unified KV cache): sequence s is a KVCache over the views [s] (`sequence(s)`), with
    its own length and rings, and a batched step's attention reaches every sequence of a layer
    through one array (attention_kernels.attend_decode_batch). Pages are committed as sequences
    fill (allocate), so a pool sized for 16 long sequences costs what its sequences hold."""

    def __init__(self, n_seqs: int, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 kv_type: str = DEFAULT_KV_TYPE, windows=None):
        if n_seqs < 1:
            raise PymlError(f"a KV pool holds at least one sequence, not {n_seqs}")
        self.kv_type = check_kv_type(kv_type, head_dim)
        self.n_seqs, self.n_layers, self.n_kv_heads, self.head_dim, self.max_len = (
            n_seqs, n_layers, n_kv_heads, head_dim, max_len)
        self.windows = list(windows) if windows is not None else [None] * n_layers
        self.slots = layer_slots(max_len, self.windows)
        self.k, self.v, self.k_scale, self.v_scale = allocate(self, (n_seqs,))
        self._seqs = [None] * n_seqs
        self._addresses = None

    def layer(self, layer: int):
        """(keys, k_scale, values, v_scale) of every sequence: [n_seqs, ...] each."""
        return self.k[layer], self.k_scale[layer], self.v[layer], self.v_scale[layer]

    def addresses(self) -> np.ndarray:
        """As KVCache.addresses, of the [n_seqs, ...] arrays (a batched step's compiled driver, nn/fused.py)."""
        if self._addresses is None:
            self._addresses = layer_addresses(self)
        return self._addresses

    def sequence(self, s: int) -> KVCache:
        """Sequence s's cache (the same object each time: its length and rings are its own)."""
        if not 0 <= s < self.n_seqs:
            raise PymlError(f"sequence {s} is not in this pool of {self.n_seqs}")
        if self._seqs[s] is None:
            views = tuple([a[s] for a in arrays] for arrays in (self.k, self.v, self.k_scale, self.v_scale))
            cache = KVCache(self.n_layers, self.n_kv_heads, self.head_dim, self.max_len, self.kv_type,
                            self.windows, arrays=views)
            self._seqs[s] = cache
        return self._seqs[s]

    def clear(self, s: int) -> None:
        """Sequence s holds nothing (its slots are overwritten by whatever is written next)."""
        cache = self.sequence(s)
        cache.length, cache.written = 0, [0] * self.n_layers

    def copy(self, src: int, dst: int) -> None:
        """Sequence dst holds what src holds (a shared prompt: n > 1 completions of one prefill)."""
        a, b = self.sequence(src), self.sequence(dst)
        q8 = self.kv_type == "q8_0"
        for layer in range(self.n_layers):
            n = min(a.written[layer], self.slots[layer])  # a ring's every slot once it has wrapped
            tiles = -(-n // BLOCK)  # keys (and their scales) are stored in tiles of BLOCK positions
            for arrays, end in ((self.k, tiles), (self.v, n)) + (((self.k_scale, tiles), (self.v_scale, n)) if q8 else ()):
                arrays[layer][dst][:, :end] = arrays[layer][src][:, :end]
        b.length, b.written = a.length, list(a.written)
