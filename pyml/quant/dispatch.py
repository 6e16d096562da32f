"""The matmul dispatch: y = x @ W.T for every weight type and layout, through the traits table's
row (traits.py) and nothing else; and what else reads a weight by its type (dequantize, pack,
quantize, warm-up).

A quantized weight matrix is the raw GGUF tensor data: uint8 (rows, row_bytes), a run of blocks
per row (blocks32.py and kquants.py document each block layout beside its kernels). Float weights
are (rows, n_cols) float32 / float16 / uint16 bfloat16 bits. Arrays may be read-only memory maps;
the matmul path never copies a weight matrix nor decodes it whole (the exact path at T > 1
decodes ~4 MB tiles).

matmul(x, raw, qtype, n_cols) for x [T, n_cols]:
  quantized W, T == 1   the type's GEMV, parallel over output rows, int8 activations;
  quantized W, T > 1    the type's GEMM in register tiles (each kernel module documents its
                        own), parallel over chunks of rows, int8 activations;
  exact=True, T > 1     ~4 MB tiles of W decoded to float32, each through BLAS;
  F16 / BF16 / F32 W    a streaming GEMV for T == 1; for T > 1 floats.py's register-tiled GEMM
                        with float32 FMAs (weights widened on the fly);
  bf16 blocks (float W) pack_bf16() (--float-compute bf16, the avx512_bf16 path): weights and
                        activations rounded to bf16, vdpbf16ps into float32 sums (bf16_gemm.py);
                        models use them for T > 1 only;
  interleaved W         pack() re-lays the types whose traits say so 8 rows at a time
                        (interleaved.py): GEMV and GEMM then serve 8 rows per instruction;
                        2 .. ROWS_MAX rows (a batched decode step, a verify pass) take
                        interleaved_rows.py, and on the file's layout KernelSet.gemv_rows: the
                        weights read once, each row the bits of its GEMV;
                        models pack their Linears at load.
Why pyml's own kernels and not BLAS at T > 1: docs/performance.md, "No BLAS in a forward pass".

Int8 activations make a result a step function of x: two computations that differ by float
rounding only (e.g. reordered sums upstream) can flip a code and differ by ~1e-3 relative per
layer, a few % of the logit range after 30 layers. Tests that compare two runs of a model to
1e-4 should use exact=True.

Accuracy. The int8-activation paths quantize each activation row once per call to int8 with a
float32 scale per 32 values and dot the blocks in integers, as ggml does (its vec_dot_type).
Their extra error is the activations' rounding, bounded by sum_j |w_j| * d_j / 2 (d_j = the
scale of x's block holding j): the same order as ggml's own Q8 activations, and below the
weights' quantization error (tests/quant/test_matmul.py holds every type to it). `exact=True`
dots the decoded weights with the float32 activation instead. Float weights are always exact
in this sense.

Threads: kernels never read the thread count; callers set it with numba.set_num_threads.
Weights reach the kernels as read-only arrays (a writable one gets a read-only view), so each
kernel is compiled once, not once per array kind. Call warmup() once: it compiles (or loads from
Numba's on-disk cache) every kernel, so that no compilation lands in a measured step.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

from pyml.core.isa import BF16 as BF16_AVAILABLE
from pyml.quant import bf16_gemm, ggml_grids, interleaved
from pyml.quant.bf16_gemm import BF16Packed
from pyml.quant.floats import to_f32
from pyml.quant.ggml_types import QuantType
from pyml.quant.interleaved import Packed
from pyml.quant.interleaved_rows import ROWS_MAX, chunks_for, rows_kernel, serves
from pyml.quant.traits import FLOAT_TYPES, TRAITS, Traits, row_bytes, traits_of

_TILE_BYTES = 4 << 20  # float32 tile handed to BLAS: big enough to amortise the call, fits L3
_rows = threading.local()  # per calling thread: whether 2..ROWS_MAX rows are decode rows (decode_rows())


class decode_rows:
    """`with quant.decode_rows(n):` the first n rows of each matmul inside (True: every row) are decode
    rows - one new token of a sequence each, a batched decode step's or a verify pass's - and each gets
    the bits of its GEMV alone (interleaved_rows.py, KernelSet.gemv_rows, ROWS_MAX rows a call); the
    rows after them take the GEMM, as a prompt's prefill alone does. The GEMMs are row-invariant
    (tests/quant/test_row_invariance.py), so every sequence of a batch gets the bits it gets alone."""

    def __init__(self, n: bool | int = True):
        self.n = n

    def __enter__(self):
        self.saved, _rows.n = getattr(_rows, "n", 0), self.n
        return self

    def __exit__(self, *exc):
        _rows.n = self.saved
        return False


def decode_row_count(T: int) -> int:
    """How many of a T-row matmul's first rows are decode rows here (decode_rows()); T == 1: 1."""
    n = getattr(_rows, "n", 0)
    return T if n is True or T == 1 else min(int(n), T)


def every_row_decodes() -> bool:
    """Whether every row here is a decode row (`quant.decode_rows()` with no count: a speculative
    verify pass's positions), not only a batch's first n (forward_batch's decode_rows(n))."""
    return getattr(_rows, "n", 0) is True


def as_decode_rows(T: int) -> bool:
    """Whether every row of a T-row matmul here (T > 1) gives each row its GEMV's bits (decode_rows())."""
    return T > 1 and decode_row_count(T) == T


_F32, _U16 = np.dtype(np.float32), np.dtype(np.uint16)


def _kernel_dtype(t: Traits) -> np.dtype:
    """What the kernels take: F16 as its uint16 bits (Numba has no float16), else the stored dtype."""
    return _U16 if t.dtype.itemsize == 2 else t.dtype


def _as_stored(raw: np.ndarray, qtype, n_cols: int) -> np.ndarray:
    """The weight array as the kernels take it (zero-copy): 2-D, C-contiguous, right dtype.

    F16 weights may come as float16 or uint16 bits, BF16 as uint16 bits or raw bytes (a GGUF
    reader's uint8 [rows, 2 * n_cols]); the kernels read both as uint16."""
    t = traits_of(qtype)
    dtype = _kernel_dtype(t)
    # dtypes compare with == : a memory map's dtype is equal to, not always the same object as, np.uint8's
    w = raw if dtype != _U16 or raw.dtype == dtype else raw.view(np.uint16)
    flags = w.flags
    if n_cols % t.block_size:
        raise ValueError(f"{t.name} weights with {n_cols} columns: not a multiple of its block of {t.block_size}")
    stored_cols = n_cols if t.is_float else n_cols // t.block_size * t.type_size
    if w.dtype != dtype or w.ndim != 2 or not flags.c_contiguous or w.shape[1] != stored_cols:
        raise ValueError(f"{t.name} weights with {n_cols} columns must be a C-contiguous {dtype} array "
                         f"(rows, {stored_cols}); got {raw.dtype} {raw.shape}")
    if flags.writeable:  # one array kind for the kernels: Numba compiles read-only and writable apart
        w = w.view()
        w.flags.writeable = False
    return w


def kernel_view(raw: np.ndarray, qtype, n_cols: int) -> np.ndarray:
    """A stored (not packed) weight as the kernels take it, for code that calls a KernelSet from
    its own kernels (nn/fused.py): 2-D, C-contiguous, read-only, F16/BF16 as uint16 bits."""
    return _as_stored(raw, qtype, n_cols)


def dequantize(raw: np.ndarray, qtype, n_cols: int) -> np.ndarray:
    """float32 (rows, n_cols): the whole matrix decoded (tests, small tensors)."""
    w = _as_stored(_file_layout(raw), qtype, n_cols)
    out = np.empty((w.shape[0], n_cols), np.float32)
    return traits_of(qtype).kernels.dequant_tile(w, 0, out)


def dequantize_rows(raw: np.ndarray, qtype, n_cols: int, row_ids) -> np.ndarray:
    """float32 (len(row_ids), n_cols): only the requested rows are read (embedding lookups)."""
    w = _as_stored(_file_layout(raw), qtype, n_cols)
    ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise IndexError(f"row ids must be in [0, {w.shape[0]}), got {ids.min()}..{ids.max()}")
    out = np.empty((ids.size, n_cols), np.float32)
    return traits_of(qtype).kernels.dequant_rows(w, ids, out)


def row_reader(raw, qtype, n_cols: int):
    """A function token id -> float32 [1, n_cols], dequantize_rows' row: the weight's view and
    kernel found once. A decode step's embedding lookup runs on the caches the step's weights
    have just flushed, where each of dequantize_rows' array conversions and checks costs 5-20 µs
    (the lookup took 60-110 µs through it, 40-75 through this)."""
    if isinstance(raw, Packed):  # the file's layout is a copy of the whole matrix: per call
        return lambda i: dequantize_rows(raw, qtype, n_cols, [i])
    w = _as_stored(raw, qtype, n_cols)
    kernel = traits_of(qtype).kernels.dequant_rows

    def read(i: int) -> np.ndarray:
        if not 0 <= i < w.shape[0]:
            raise IndexError(f"row ids must be in [0, {w.shape[0]}), got {i}")
        return kernel(w, np.full(1, i, np.int64), np.empty((1, n_cols), np.float32))

    return read


def matmul(x: np.ndarray, raw, qtype, n_cols: int, out: np.ndarray | None = None,
           exact: bool = False) -> np.ndarray:
    """y = x @ W.T: x float32 [T, n_cols] -> [T, rows], reading W's blocks in place.

    `raw` is the stored matrix, or a Packed one (pack()). `out` (float32 [T, rows],
    C-contiguous) is written and returned, so callers can reuse a buffer. `exact` selects
    float32 activations for quantized weights (see the module doc); inside ggml_activations(), x is
    first rounded as llama.cpp's CPU backend rounds it for this type (ggml_grids.py), then exact.
    """
    if ggml_grids.active() and not isinstance(raw, BF16Packed):
        x, exact = ggml_grids.round_as_ggml(x, traits_of(qtype).ggml_activation), True
    if isinstance(raw, BF16Packed):
        if raw.kind != int(qtype) or raw.n_cols != n_cols:
            raise ValueError(f"bf16 blocks of {QuantType(raw.kind).name} weights of {raw.n_cols} columns used as "
                             f"{getattr(qtype, 'name', qtype)} of {n_cols}")
        x, out = _prepare(x, raw.rows, n_cols, out)
        return bf16_gemm.matmul(x, raw, out)
    if not exact and as_decode_rows(x.shape[0]) and x.shape[0] > ROWS_MAX:  # decode rows, ROWS_MAX a call
        x, out = _prepare(x, raw.rows if isinstance(raw, Packed) else raw.shape[0], n_cols, out)
        for t in range(0, x.shape[0], ROWS_MAX):
            matmul(x[t:t + ROWS_MAX], raw, qtype, n_cols, out[t:t + ROWS_MAX])
        return out
    if isinstance(raw, Packed):
        if not exact:
            return _matmul_packed(x, raw, qtype, n_cols, out)
        raw = raw.unpack()  # the exact kernels read the file's layout: tests, never a model's hot path
    w = _as_stored(raw, qtype, n_cols)
    x, out = _prepare(x, w.shape[0], n_cols, out)
    kernels = traits_of(qtype).kernels
    if x.shape[0] == 1:
        (kernels.gemv_exact if exact else kernels.gemv)(w, x[0], out[0])
    elif as_decode_rows(x.shape[0]) and not exact:  # a batched decode step: each row the bits of its GEMV alone
        kernels.gemv_rows(w, x, out)
    elif exact and qtype not in FLOAT_TYPES:
        _matmul_tiles(x, w, n_cols, out, lambda r0, tile: kernels.dequant_tile(w, r0, tile))
    else:
        kernels.gemm(w, x, out)
    return out


def _prepare(x, rows: int, n_cols: int, out):
    """x as the kernels take it (float32, C-contiguous, writable) and the output buffer."""
    xf = x.flags
    if x.dtype != _F32 or x.ndim != 2 or not (xf.c_contiguous and xf.writeable):
        x = np.array(x, dtype=np.float32, order="C", ndmin=2)  # kernels are compiled for writable f32
    T = x.shape[0]
    if x.shape[1] != n_cols:
        raise ValueError(f"x has {x.shape[1]} columns, the weights {n_cols}")
    if out is None:
        out = np.empty((T, rows), np.float32)
    elif out.shape != (T, rows) or out.dtype != _F32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be float32 C-contiguous {(T, rows)}, got {out.dtype} {out.shape}")
    return x, out


def pack(raw: np.ndarray, qtype, n_cols: int, key: str | None = None) -> Packed | None:
    """The matrix re-laid 8 rows at a time (interleaved.py) where its
    traits say the type has that layout and it has 8 rows or more; otherwise None. One copy of
    the blocks, a derived array under `key` (core/derived.py: a packed-weights cache keeps it)."""
    if not packs(qtype, raw.shape[0]):
        return None
    return interleaved.pack(_as_stored(raw, qtype, n_cols), int(qtype), n_cols, key)


def packs(qtype, rows: int) -> bool:
    """Whether pack() re-lays a matrix of this type with `rows` rows."""
    return traits_of(qtype).interleaved is not None and rows >= 8


def packed_from_cache(key: str, qtype, shape) -> Packed | None:
    """What `pack(raw, qtype, shape[1], key)` would return, if the packed-weights cache holds it."""
    rows, n_cols = shape
    return interleaved.packed_from_cache(key, int(qtype), rows, n_cols) if packs(qtype, rows) else None


FLOAT_COMPUTE = ("auto", "f32", "bf16")  # --float-compute; docs/performance-journal.md, "--float-compute bf16"
_AUTO_BF16 = frozenset({QuantType.F16, QuantType.BF16})  # auto: bf16 for these where the CPU has it


def float_compute(mode: str, qtype) -> str:
    """What a prefill (T > 1) with float weights of `qtype` computes in under `mode` (FLOAT_COMPUTE):
    "bf16" (vdpbf16ps, bf16_gemm.py) or "f32" (floats.py). bf16 needs the avx512_bf16 ISA path;
    without it every mode is f32. auto: bf16 for F16/BF16 weights, f32 for F32 (the accuracy measured
    against transformers decided it: docs/performance-journal.md, "--float-compute bf16")."""
    if mode not in FLOAT_COMPUTE:
        raise ValueError(f"float compute {mode!r}: use one of {', '.join(FLOAT_COMPUTE)}")
    if qtype not in FLOAT_TYPES or not BF16_AVAILABLE or mode == "f32":
        return "f32"
    return "bf16" if mode == "bf16" or qtype in _AUTO_BF16 else "f32"


def attention_compute(mode: str, qtypes) -> str:
    """What a prefill's attention (QK^T and PV) computes in under float-compute `mode`, for a model whose
    weights are of `qtypes`: "bf16" (vdpbf16ps, nn/attention_prefill.py) or "f32", as float_compute decides
    for weights: bf16 needs the avx512_bf16 path; auto is bf16 unless every weight is F32 (a float32 file
    asks for float32 accuracy; a quantized or 16-bit one already carries a larger error than bf16's
    rounding of q, k, v and the probabilities: docs/performance-journal.md, "Gemma 3's prefill attention")."""
    if mode not in FLOAT_COMPUTE:
        raise ValueError(f"float compute {mode!r}: use one of {', '.join(FLOAT_COMPUTE)}")
    if not BF16_AVAILABLE or mode == "f32":
        return "f32"
    return "bf16" if mode == "bf16" or any(t != QuantType.F32 for t in qtypes) else "f32"


def pack_bf16(raw: np.ndarray, qtype, n_cols: int, key: str | None = None) -> BF16Packed:
    """Float weights as bf16 blocks for the prefill GEMM (bf16_gemm.py), a derived array under `key`."""
    kind = int(qtype)
    return bf16_gemm.pack(_as_stored(raw, qtype, n_cols), kind, n_cols, lambda rows: to_f32(rows, kind), key)


def _file_layout(raw):
    return raw.unpack() if isinstance(raw, Packed) else raw


def _matmul_packed(x, p: Packed, qtype, n_cols: int, out):
    if p.kind != int(qtype) or p.n_cols != n_cols:
        raise ValueError(f"packed {QuantType(p.kind).name} weights of {p.n_cols} columns used as "
                         f"{getattr(qtype, 'name', qtype)} of {n_cols}")
    x, out = _prepare(x, p.rows, n_cols, out)
    T, head = x.shape[0], 8 * p.groups.shape[0]
    t = traits_of(qtype)  # t.kernels for the tail rows, kept in the file's layout
    if T == 1:
        t.interleaved.gemv(p.groups, x[0], out[0])
        if p.tail.shape[0]:
            t.kernels.gemv(p.tail, x[0], out[0, head:])
    elif as_decode_rows(T):  # a batched decode step: each row the bits of its GEMV alone (interleaved_rows.py)
        rows_kernel(p.kind)(p.groups, x, out, chunks_for(numba.get_num_threads()))
        for r in range(T if p.tail.shape[0] else 0):
            t.kernels.gemv(p.tail, x[r], out[r, head:])
    else:
        t.interleaved.gemm(p.groups, x, out)
        if p.tail.shape[0]:
            out[:, head:] = t.kernels.gemm(p.tail, x, np.empty((T, p.tail.shape[0]), np.float32))
    return out


_scratch = threading.local()  # per calling thread: the float32 tile buffer, reused across calls


def _tile_buffer(n_floats: int) -> np.ndarray:
    """A float32 buffer of at least n_floats, kept between calls: a fresh 4 MB array would be
    page-faulted in on every matmul, which costs as much as a small GEMM."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n_floats:
        buf = _scratch.buf = np.empty(n_floats, np.float32)
    return buf


def _matmul_tiles(x, w, n_cols, out, decode):
    """out = x @ W.T with W decoded tile by tile into a float32 scratch, each tile through BLAS;
    the decoding runs on one thread (docs/performance.md, "No BLAS in a forward pass")."""
    T, rows = x.shape[0], w.shape[0]
    tile = max(8, min(rows, _TILE_BYTES // (4 * n_cols)))
    buf = _tile_buffer(tile * (n_cols + T))
    scratch = buf[:tile * n_cols].reshape(tile, n_cols)
    part = buf[tile * n_cols:tile * (n_cols + T)].reshape(T, tile)
    if tile == rows:  # one tile: BLAS writes straight into out
        np.matmul(x, decode(0, scratch).T, out=out)
        return
    for r0 in range(0, rows, tile):
        n = min(tile, rows - r0)
        np.matmul(x, decode(r0, scratch[:n]).T, out=part[:, :n])
        out[:, r0:r0 + n] = part[:, :n]


def quantize(x: np.ndarray, qtype) -> np.ndarray:
    """float32 (rows, n_cols) -> stored weights: uint8 blocks (bit-exact with ggml's reference
    quantizers), float32, float16, or uint16 bf16 bits, for the types whose traits have a quantizer."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize takes a 2-D matrix, got shape {x.shape}")
    t = traits_of(qtype)
    if t.quantize is None:
        can = ", ".join(q.name for q, tr in TRAITS.items() if tr.quantize is not None)
        raise ValueError(f"quantize supports {can}; not {t.name}")
    out = np.empty((x.shape[0], row_bytes(qtype, x.shape[1]) // t.dtype.itemsize), t.dtype)
    return t.quantize(x, out)


def warmup() -> None:
    """Compile (or load from Numba's disk cache) every kernel; see warmup_steps."""
    for step in warmup_steps():
        step()


def warmup_steps() -> list:
    """warmup() as one callable per weight type (so a caller can show progress): every type,
    T == 1 and T > 1, int8 and exact paths, quantizers; weights given read-only and writable
    (both reach the kernels read-only, see _as_stored), activations float32 and writable as
    matmul passes them."""
    return [lambda qtype=qtype: _warm_type(qtype) for qtype in TRAITS]


def _warm_type(qtype) -> None:
    rng = np.random.default_rng(0)
    n_cols = 256
    x1, x3 = rng.standard_normal((1, n_cols), np.float32), rng.standard_normal((3, n_cols), np.float32)
    x_gemm = rng.standard_normal((ROWS_MAX + 1, n_cols), np.float32)  # past the few rows' kernels: the GEMM
    t = traits_of(qtype)
    if t.is_float:
        stored = quantize(rng.standard_normal((3, n_cols), np.float32), qtype)
    else:
        stored = np.zeros((9, row_bytes(qtype, n_cols)), np.uint8)  # 9: an interleaved group and a tail
    for writable in (True, False):
        w = stored.copy()
        w.flags.writeable = writable
        for weights in (w, pack(w, qtype, n_cols)):
            for exact in (False, True):
                if weights is not None:
                    for x, rows in ((x1, False), (x3, True), (x3, False), (x_gemm, False)):
                        with decode_rows(rows):  # the GEMV, a batched decode's few rows, the GEMM
                            matmul(x, weights, qtype, n_cols, exact=exact)
        dequantize(w, qtype, n_cols)
        dequantize_rows(w, qtype, n_cols, [1])
    if t.quantize is not None and not t.is_float:
        quantize(x3, qtype)
