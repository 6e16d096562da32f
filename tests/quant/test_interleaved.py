"""The 8-row interleaved layout (pyml/quant/interleaved.py): packing is lossless, the layout is the documented one, and
the packed kernels match the gguf package's dequantize + float64 matmul like the file-layout ones."""

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.quant import QuantType
from pyml.quant import interleaved_triples
from pyml.quant.interleaved_gemm import interleaved_kernels
from pyml.quant.interleaved_rows import ROWS_MAX
from pyml.quant.interleaved_triples import SIGNED_KINDS
from tests.quant.helpers import make_weights, odd_cols, q8_activation
from tests.quant.test_matmul import RTOL, _q8_error_bound, _ref

LEGACY = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0]
PACKABLE = LEGACY + [QuantType.Q4_K]
TRIPLES = [QuantType(k) for k in SIGNED_KINDS]


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [8, 9, 33, 257])
def test_pack_is_lossless(rng, qtype, rows):
    n_cols = odd_cols(qtype)
    raw = make_weights(rng, qtype, rows, n_cols)
    packed = quant.pack(raw, qtype, n_cols)
    ts = gguf.constants.GGML_QUANT_SIZES[qtype][1]
    superblock = 1184 if qtype == QuantType.Q4_K else 8 * ts  # Q4_K's scales one per byte: 1184 > 8 * 144
    assert packed.rows == rows
    assert packed.nbytes == (rows // 8) * (raw.shape[1] // ts) * superblock + (rows % 8) * raw.shape[1]
    assert packed.groups.shape[0] == rows // 8 and packed.tail.shape[0] == rows % 8
    np.testing.assert_array_equal(packed.unpack(), raw)
    np.testing.assert_array_equal(quant.dequantize(packed, qtype, n_cols), gguf.quants.dequantize(raw, qtype))
    ids = [0, rows - 1, rows // 2]
    np.testing.assert_array_equal(quant.dequantize_rows(packed, qtype, n_cols, ids),
                                  gguf.quants.dequantize(raw[ids], qtype))


def test_q4k_layout_is_the_documented_one():
    """Q4_K superblocks byte by byte: d and dmin of the 8 rows side by side, group j's 6-bit scales
    and mins one byte per row (gguf's own unpacking is the oracle), then chunk k of pair p holding
    code bytes 32p + 4k .. 32p + 4k + 3 of each row."""
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (8, 2 * 144), dtype=np.uint8)  # one group, 2 superblocks
    sb = quant.pack(raw, QuantType.Q4_K, 512).groups.reshape(2, 1184)
    for b in range(2):
        block = raw[:, 144 * b:144 * (b + 1)]  # [row, byte]
        np.testing.assert_array_equal(sb[b, 0:16], block[:, 0:2].reshape(16))
        np.testing.assert_array_equal(sb[b, 16:32], block[:, 2:4].reshape(16))
        sc, mn = gguf.quants.Q4_K.get_scale_min(block[:, 4:16])  # [row, group]
        np.testing.assert_array_equal(sb[b, 32:96].reshape(8, 8), sc.reshape(8, 8).T)
        np.testing.assert_array_equal(sb[b, 96:160].reshape(8, 8), mn.reshape(8, 8).T)
        for p in range(4):
            for k in range(8):
                for r in range(8):
                    got = sb[b, 160 + 256 * p + 32 * k + 4 * r:160 + 256 * p + 32 * k + 4 * r + 4]
                    np.testing.assert_array_equal(got, block[r, 16 + 32 * p + 4 * k:16 + 32 * p + 4 * k + 4])


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda q: q.name)
def test_layout_is_the_documented_one(qtype):
    """The module doc's layout, byte by byte: the fp16 fields of the 8 rows side by side, then (Q5)
    the fifth bits, then code byte j of row r at 32 * (j // 4) + 4 * r + j % 4."""
    bs, ts = gguf.constants.GGML_QUANT_SIZES[qtype]
    n_fields = 2 if qtype in (QuantType.Q4_1, QuantType.Q5_1) else 1
    q5 = qtype in (QuantType.Q5_0, QuantType.Q5_1)
    code_at = 2 * n_fields + (4 if q5 else 0)
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (8, 2 * ts), dtype=np.uint8)  # one group, 2 blocks
    sb = quant.pack(raw, qtype, 64).groups.reshape(2, 8 * ts)
    for b in range(2):
        block = raw[:, b * ts:(b + 1) * ts]  # [row, byte]
        for f in range(n_fields):
            np.testing.assert_array_equal(sb[b, 16 * f:16 * f + 16], block[:, 2 * f:2 * f + 2].reshape(16))
        at = 16 * n_fields
        if q5:
            qh = block[:, 2 * n_fields:2 * n_fields + 4].copy().view("<u4")[:, 0]  # [row]
            for r in range(8):
                for i in range(4):
                    for n in range(8):
                        value = 16 * (n % 2) + 4 * (n // 2) + i
                        assert (sb[b, at + 4 * r + i] >> n) & 1 == (qh[r] >> value) & 1
            at += 32
        for r in range(8):
            for j in range(ts - code_at):
                assert sb[b, at + 32 * (j // 4) + 4 * r + j % 4] == block[r, code_at + j]


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [8, 41, 257])  # 41: pairs of groups (the 512-bit GEMM), an odd group, a tail row
@pytest.mark.parametrize("T", [1, 3, 4, 5, ROWS_MAX, ROWS_MAX + 1, 34])  # 2..ROWS_MAX: the GEMM (a prefill's rows)
def test_packed_matmul(rng, qtype, rows, T):
    n_cols = odd_cols(qtype)
    raw = make_weights(rng, qtype, rows, n_cols)
    packed = quant.pack(raw, qtype, n_cols)
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    ref, scale, w = _ref(x, raw, qtype, n_cols)
    y = quant.matmul(x, packed, qtype, n_cols)
    assert y.shape == (T, rows) and y.dtype == np.float32
    assert np.all(np.abs(y - q8_activation(x) @ w.T) <= RTOL * scale)
    assert np.all(np.abs(y - ref) <= _q8_error_bound(x, w) + RTOL * scale)
    np.testing.assert_array_equal(quant.matmul(x, packed, qtype, n_cols, exact=True),
                                  quant.matmul(x, raw, qtype, n_cols, exact=True))


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("T", [2, 5, ROWS_MAX])
def test_a_few_rows_give_each_row_the_gemv_bits(rng, qtype, T):
    """interleaved_rows.py (a batched decode step's product, a verify pass's) dots every row as the
    GEMV does one, so a sequence decoded in a batch gets the bits it gets alone; 41 rows: groups
    and a tail row in the file's layout; 2 threads share out 5 groups in 8 chunks (on the avx512 paths
    groups 0 and 2, 1 and 3 as pairs on 512-bit vectors, group 4 alone)."""
    n_cols = odd_cols(qtype)
    packed = quant.pack(make_weights(rng, qtype, 41, n_cols), qtype, n_cols)
    x = rng.standard_normal((T, n_cols)).astype(np.float32) * rng.uniform(0.1, 10, (T, 1)).astype(np.float32)
    with quant.decode_rows():
        batched = quant.matmul(x, packed, qtype, n_cols)
    for t in range(T):
        np.testing.assert_array_equal(batched[t], quant.matmul(x[t:t + 1], packed, qtype, n_cols)[0], err_msg=f"row {t}")


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_largest_codes_and_activations_do_not_overflow(qtype, fill):
    """Every code at an end of its range (0, or 15 / 31, or -128 for Q8_0; Q4_K scales and mins 63)
    against activations of +-127: the 16-bit lane sums reach their bounds (module doc; the AVX2
    triples recentre the codes, so 0 is as far out as 15) and must not saturate or come out wrapped.
    The triples' GEMM runs here whatever the CPU's path."""
    bs, ts = gguf.constants.GGML_QUANT_SIZES[qtype]
    n_blocks = 256 // bs
    raw = np.full((24, n_blocks * ts), 0x80 if qtype == QuantType.Q8_0 else fill, np.uint8)  # 256 columns
    for b in range(n_blocks):
        raw[:, b * ts:b * ts + 2] = np.array([0.01], np.float16).view(np.uint8)
        if qtype in (QuantType.Q4_1, QuantType.Q5_1, QuantType.Q4_K):
            raw[:, b * ts + 2:b * ts + 4] = np.array([-0.05], np.float16).view(np.uint8)
        if qtype == QuantType.Q4_K:
            raw[:, b * ts + 4:b * ts + 16] = 0xFF  # scales and mins 63
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    packed = quant.pack(raw, qtype, 256)
    for sign in (1.0, -1.0):
        x = np.full((5, 256), sign, np.float32)  # every block quantizes to +-127 exactly
        for T in (1, 5):
            want = x[:T].astype(np.float64) @ w.T
            np.testing.assert_allclose(quant.matmul(x[:T], packed, qtype, 256), want, rtol=1e-6)
            if qtype in TRIPLES:
                got = np.zeros((T, 24), np.float32)
                interleaved_kernels(qtype).gemm_triples(packed.groups, x[:T], got)
                np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("qtype", TRIPLES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [8, 16, 24, 57])  # units of 1, 2 and 3 groups; 57: three units and a tail row
def test_the_avx2_triples_give_the_same_bits_as_every_path(rng, qtype, rows):
    """interleaved_triples.py's GEMM without VNNI (three groups per activation quad, codes recentred as the
    signed operand) against the one this CPU dispatches to: the same integers and float ops, so the
    same floats, bit for bit (tests/core/test_isa.py checks the paths it runs the same way)."""
    n_cols = 768 if qtype == QuantType.Q4_K else 608  # 24 and 19 blocks: more than one CHUNK of them
    assert n_cols // 32 > interleaved_triples.CHUNK
    packed = quant.pack(make_weights(rng, qtype, rows, n_cols), qtype, n_cols)
    for T in (1, 4, 19):
        x = rng.standard_normal((T, n_cols)).astype(np.float32) * rng.uniform(0.1, 10, (T, 1)).astype(np.float32)
        # the GEMM this CPU dispatches to, called directly: matmul would send one row to the GEMV (whose
        # Q4_K float ops round differently), and none in a batch to the triples
        want = interleaved_kernels(qtype).gemm(packed.groups, x, np.full((T, rows), np.nan, np.float32))
        got = np.full((T, rows), np.nan, np.float32)
        interleaved_kernels(qtype).gemm_triples(packed.groups, x, got)
        np.testing.assert_array_equal(got[:, :rows - rows % 8], want[:, :rows - rows % 8])
        assert np.isnan(got[:, rows - rows % 8:]).all()  # a unit of fewer than 3 groups stores only its own


def test_only_the_x8_types_with_8_rows_pack(rng):
    assert quant.pack(make_weights(rng, QuantType.Q4_0, 7, 96), QuantType.Q4_0, 96) is None
    assert quant.pack(make_weights(rng, QuantType.F16, 16, 96), QuantType.F16, 96) is None
    assert quant.pack(make_weights(rng, QuantType.Q6_K, 16, 768), QuantType.Q6_K, 768) is None


def test_packed_weights_must_be_used_as_packed(rng):
    packed = quant.pack(make_weights(rng, QuantType.Q4_0, 8, 96), QuantType.Q4_0, 96)
    with pytest.raises(ValueError, match="packed Q4_0"):
        quant.matmul(np.zeros((1, 96), np.float32), packed, QuantType.Q4_1, 96)
    with pytest.raises(ValueError, match="columns"):
        quant.matmul(np.zeros((1, 64), np.float32), packed, QuantType.Q4_0, 96)
