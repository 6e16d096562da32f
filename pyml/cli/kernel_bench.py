"""Kernel benchmark: GB/s of the T == 1 kernels and GFLOP/s at T == 128, per weight type.

    python -m pyml.cli.kernel_bench [--threads 1,2] [--types Q4_0,Q6_K] [--shapes 5632x2048,2048x5632]

T == 1 cycles through enough copies of each matrix (>= 256 MB) that weights come from
memory, not cache, as in a real model; GB/s = stored weight bytes / time (best of several
rounds). Baselines printed first: a streaming read (report/machine.py's, the memory ceiling for a kernel
that reads its weights once), the core's float32 FMA, int8 dot-product and (on the avx512_bf16
path) bf16 dot-product peaks (independent chains of the instruction, nothing loaded), of which
each GEMM's rate is given as a share, and NumPy/BLAS float32 GEMM at T == 128. On the avx512_bf16
path each float type also gets a "bf16" row: its GEMM through --float-compute bf16's blocks
(quant/bf16_gemm.py), a share of the bf16 peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numba
import numpy as np

from threadpoolctl import threadpool_limits

from pyml import quant
from pyml.cli.main import Parser, run_command
from pyml.core.errors import PymlError
from pyml.quant import FLOAT_TYPES, QuantType
from pyml.core.isa import BF16, ZMM
from pyml.quant.bf16_gemm import dpbf16_regs
from pyml.report.machine import read_bandwidth
from pyml.core.simd512 import (add_i32x16, as_i8x64, dpbusd16, f32x16, fma16, load_u8x32_pair, store_f32x16, to_f32x16,
                               zeros_f32x16, zeros_i32x16)
from pyml.core.simd import HAVE_VNNI, add, fma, hsum, load_f32x8, load_u8x32, to_f32, zeros_i32x8
from pyml.core.simd_int import add_i16, add_i32, as_i8, dpbusd, i16_halves, maddubs, sum_pairs

INT8_INSTRUCTION = "vpdpbusd" if HAVE_VNNI else "vpmaddubsw"

_COPY_BYTES = 256 << 20


def _weights(rng, qtype, rows, n_cols):
    if qtype == QuantType.F32:
        return rng.standard_normal((rows, n_cols), np.float32)
    if qtype in (QuantType.F16, QuantType.BF16):
        return quant.quantize(rng.standard_normal((rows, n_cols), np.float32), qtype)
    fmt = quant.traits_of(qtype)
    raw = rng.integers(0, 256, (rows, n_cols // fmt.block_size, fmt.type_size), dtype=np.uint8)
    scale_at = 208 if qtype == QuantType.Q6_K else 0  # valid fp16 scales (d, and dmin/m after it)
    raw[:, :, scale_at:scale_at + 2] = np.array([0.01], np.float16).view(np.uint8)
    if qtype in (QuantType.Q4_1, QuantType.Q5_1, QuantType.Q4_K, QuantType.Q5_K):
        raw[:, :, 2:4] = np.array([0.01], np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    if fmt.interleaved is not None:  # as a model holds them: re-laid 8 rows at a time at load
        return quant.pack(raw, qtype, n_cols)
    return raw


_clock = time.perf_counter


def _best(fn, rounds):
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = _clock()
        fn()
        best = min(best, _clock() - t)
    return best


@numba.njit(cache=True)
def _fma_chains(n, x):  # 12 independent FMA chains (latency 4 x 2 pipes needs >= 8): the float32 peak
    c = load_f32x8(x, 8)
    a0, a1, a2, a3 = load_f32x8(x, 0), load_f32x8(x, 0), load_f32x8(x, 0), load_f32x8(x, 0)
    a4, a5, a6, a7 = load_f32x8(x, 0), load_f32x8(x, 0), load_f32x8(x, 0), load_f32x8(x, 0)
    a8, a9, a10, a11 = load_f32x8(x, 0), load_f32x8(x, 0), load_f32x8(x, 0), load_f32x8(x, 0)
    for _ in range(n):
        a0, a1, a2, a3 = fma(a0, c, c), fma(a1, c, c), fma(a2, c, c), fma(a3, c, c)
        a4, a5, a6, a7 = fma(a4, c, c), fma(a5, c, c), fma(a6, c, c), fma(a7, c, c)
        a8, a9, a10, a11 = fma(a8, c, c), fma(a9, c, c), fma(a10, c, c), fma(a11, c, c)
    return hsum(add(add(add(a0, a1), add(a2, a3)), add(add(add(a4, a5), add(a6, a7)), add(add(a8, a9),
                                                                                        add(a10, a11)))))


@numba.njit(cache=True)
def _int8_chains(n, q):  # 12 independent vpdpbusd chains, the instruction the VNNI kernels use
    a, b = load_u8x32(q, 0), as_i8(load_u8x32(q, 32))
    s0, s1, s2, s3 = zeros_i32x8(), zeros_i32x8(), zeros_i32x8(), zeros_i32x8()
    s4, s5, s6, s7 = zeros_i32x8(), zeros_i32x8(), zeros_i32x8(), zeros_i32x8()
    s8, s9, s10, s11 = zeros_i32x8(), zeros_i32x8(), zeros_i32x8(), zeros_i32x8()
    for _ in range(n):
        s0, s1, s2, s3 = dpbusd(s0, a, b), dpbusd(s1, a, b), dpbusd(s2, a, b), dpbusd(s3, a, b)
        s4, s5, s6, s7 = dpbusd(s4, a, b), dpbusd(s5, a, b), dpbusd(s6, a, b), dpbusd(s7, a, b)
        s8, s9, s10, s11 = dpbusd(s8, a, b), dpbusd(s9, a, b), dpbusd(s10, a, b), dpbusd(s11, a, b)
    t = add_i32(add_i32(add_i32(s0, s1), add_i32(s2, s3)), add_i32(add_i32(s4, s5), add_i32(s6, s7)))
    return hsum(to_f32(add_i32(t, add_i32(add_i32(s8, s9), add_i32(s10, s11)))))


def _chains16(op):
    """A kernel running 12 independent chains of the 512-bit dot `op` (latency x pipes needs >= 8)."""
    @numba.njit(cache=True)
    def chains(n, a, b, z):
        s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11 = z, z, z, z, z, z, z, z, z, z, z, z
        for _ in range(n):
            s0, s1, s2, s3 = op(s0, a, b), op(s1, a, b), op(s2, a, b), op(s3, a, b)
            s4, s5, s6, s7 = op(s4, a, b), op(s5, a, b), op(s6, a, b), op(s7, a, b)
            s8, s9, s10, s11 = op(s8, a, b), op(s9, a, b), op(s10, a, b), op(s11, a, b)
        return s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11
    return chains


@numba.njit
def _fma16_into(acc, a, b):
    return fma16(a, b, acc)


_dpbusd16_chains, _dpbf16_chains, _fma16_chains = _chains16(dpbusd16), _chains16(dpbf16_regs), _chains16(_fma16_into)


@numba.njit(cache=True)
def _maddubs_chains(n, q):
    """The AVX2 path's int8 peak: 12 vpmaddubsw per iteration (32 u8 x i8 products each, pairs
    summed into 16 bits), added into 16-bit sums with vpaddw, as the 4-bit kernels do before one
    vpmaddwd per 8 (blocks32.py, interleaved.py). q: uint8 [896], read as 24 unsigned operands
    (bytes 0-767) and 4 signed ones.

    Within 16 ymm registers, as an AVX2-only CPU has: 4 loop-invariant signed operands, 3 unsigned
    ones loaded anew each iteration (from 8 x 3 distinct places: with loop-invariant inputs LLVM
    hoists the vpmaddubsw out of the loop, and with inputs one iteration's loads repeat in the next it
    shares products across unrolled iterations), 4 sums. The version before this one kept 12 sums
    and 12 operands live: compiled for AVX2 alone (core/isa.py) it spilled, and read 132-232 GOP/s
    where this one reads 374 on Zen 4 (the older one's 378 with AVX-512's 32 registers)."""
    b0, b1, b2, b3 = (as_i8(load_u8x32(q, 768)), as_i8(load_u8x32(q, 800)), as_i8(load_u8x32(q, 832)),
                      as_i8(load_u8x32(q, 864)))
    z = i16_halves(0, 0)
    s0, s1, s2, s3 = z, z, z, z
    for i in range(n):
        k = 96 * (i & 7)
        a0, a1, a2 = load_u8x32(q, k), load_u8x32(q, k + 32), load_u8x32(q, k + 64)
        s0 = add_i16(add_i16(add_i16(s0, maddubs(a0, b0)), maddubs(a1, b1)), maddubs(a2, b2))
        s1 = add_i16(add_i16(add_i16(s1, maddubs(a0, b1)), maddubs(a1, b2)), maddubs(a2, b3))
        s2 = add_i16(add_i16(add_i16(s2, maddubs(a0, b2)), maddubs(a1, b3)), maddubs(a2, b0))
        s3 = add_i16(add_i16(add_i16(s3, maddubs(a0, b3)), maddubs(a1, b0)), maddubs(a2, b1))
    return hsum(to_f32(sum_pairs(add_i16(add_i16(s0, s1), add_i16(s2, s3)))))


@numba.njit(cache=True)
def _int8_chains16(n, q):  # vpdpbusd on 512-bit vectors (the avx512_vnni GEMMs')
    sums = _dpbusd16_chains(n, load_u8x32_pair(q, q, 0), as_i8x64(load_u8x32_pair(q, q, 32)), zeros_i32x16())
    out, t = np.empty(16, np.float32), zeros_i32x16()
    for s in sums:  # every chain feeds the result, or LLVM drops it
        t = add_i32x16(t, s)
    store_f32x16(out, 0, to_f32x16(t))
    return out.sum()


@numba.njit
def _total16(sums):  # every chain feeds the result, or LLVM drops it
    one, t = f32x16(1.0), zeros_f32x16()
    for v in sums:
        t = fma16(v, one, t)
    out = np.empty(16, np.float32)
    store_f32x16(out, 0, t)
    return out.sum()


@numba.njit(cache=True)
def _bf16_chains(n, x):  # vdpbf16ps on zmm (32 bf16 products each): the bf16 peak
    return _total16(_dpbf16_chains(n, f32x16(x[0]), f32x16(x[1]), zeros_f32x16()))


@numba.njit(cache=True)
def _fp32_chains16(n, s):  # vfmadd231ps on zmm (the float panels' on the 512-bit paths)
    return _total16(_fma16_chains(n, f32x16(s), f32x16(s), zeros_f32x16()))


def bf16_peak(rounds: int = 5, n: int = 4_000_000) -> float | None:
    """GFLOP/s of one core's vdpbf16ps (a bf16 product and its add count 2, as a float FMA), or None
    off the avx512_bf16 path."""
    if not BF16:
        return None
    x = np.full(2, 1e-7, np.float32)
    return 12 * 32 * 2 * n / _best(lambda: _bf16_chains(n, x), rounds) / 1e9


def compute_peaks(rounds: int = 5, n: int = 4_000_000) -> tuple[float, float]:
    """(float32 GFLOP/s, int8 GOP/s) one core reaches with nothing to wait for: the ceilings the GEMMs'
    rates are shares of (an int8 multiply-add counts 2 ops, as a float FMA). Each the better of 256
    and, on the paths with 512-bit kernels, 512 bits (the same on Zen 4, which splits a 512-bit op
    in two halves; twice on CPUs with two 512-bit pipes, where a 256-bit peak would flatter the
    kernels by half)."""
    x = np.full(16, 1e-7, np.float32)
    q = np.ones(896, np.uint8)  # _maddubs_chains reads 896 bytes, the others the first 64
    fp32 = 12 * 8 * 2 * n / _best(lambda: _fma_chains(n, x), rounds) / 1e9
    chains = _int8_chains if HAVE_VNNI else _maddubs_chains
    int8 = 12 * 32 * 2 * n / _best(lambda: chains(n, q), rounds) / 1e9
    if ZMM:
        int8 = max(int8, 12 * 64 * 2 * n / _best(lambda: _int8_chains16(n, q), rounds) / 1e9)
        one = np.float32(1e-7)
        fp32 = max(fp32, 12 * 16 * 2 * n / _best(lambda: _fp32_chains16(n, one), rounds) / 1e9)
    return fp32, int8


def gemv_gbs(qtype, rows, n_cols, exact=False, rounds=6, rng=None) -> float:
    rng = rng or np.random.default_rng(0)
    w = _weights(rng, qtype, rows, n_cols)
    copies = [w] + [_copy(w) for _ in range(max(1, _COPY_BYTES // w.nbytes) - 1)]
    x = rng.standard_normal((1, n_cols), np.float32)
    out = np.empty((1, rows), np.float32)

    def run():
        for c in copies:
            quant.matmul(x, c, qtype, n_cols, out=out, exact=exact)
    return w.nbytes * len(copies) / _best(run, rounds) / 1e9


def _copy(w):
    if isinstance(w, np.ndarray):
        w = w.copy()
        w.flags.writeable = False  # as a GGUF memory map
        return w
    return dataclasses.replace(w, groups=_copy(w.groups), tail=_copy(w.tail))


def gemm_gflops(qtype, rows, n_cols, T=128, exact=False, rounds=3, rng=None, bf16=False) -> float:
    """GFLOP/s of one GEMM; `bf16`: a float type through --float-compute bf16's blocks."""
    rng = rng or np.random.default_rng(0)
    w = _weights(rng, qtype, rows, n_cols)
    if isinstance(w, np.ndarray):
        w.flags.writeable = False
    if bf16:
        w = quant.pack_bf16(w, qtype, n_cols)
    x = rng.standard_normal((T, n_cols), np.float32)
    out = np.empty((T, rows), np.float32)
    return 2.0 * T * rows * n_cols / _best(lambda: quant.matmul(x, w, qtype, n_cols, out=out, exact=exact),
                                           rounds) / 1e9


def call_overhead_us(qtype=QuantType.Q4_1, n=576, rounds=2000) -> tuple[float, float]:
    """(µs per matmul of a cache-resident n x n GEMV, µs of that which is bandwidth at 20 GB/s)."""
    rng = np.random.default_rng(0)
    w = _weights(rng, qtype, n, n)
    x = rng.standard_normal((1, n), np.float32)
    out = np.empty((1, n), np.float32)
    for _ in range(100):
        quant.matmul(x, w, qtype, n, out=out)
    times = []
    for _ in range(rounds):
        t = _clock()
        quant.matmul(x, w, qtype, n, out=out)
        times.append(_clock() - t)
    return float(np.median(times)) * 1e6, w.nbytes / 20e9 * 1e6


def build_parser() -> Parser:
    ap = Parser(prog="python -m pyml.cli.kernel_bench", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K,F16,BF16,F32")
    ap.add_argument("--shapes", default="5632x2048,2048x5632")
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--exact", action="store_true", help="also time the exact (float activation) path")
    ap.add_argument("--cpu-time", action="store_true",
                    help="with 1 thread, time by the thread's CPU time: robust on a machine shared with other jobs")
    return ap


def _options(args) -> tuple[list[int], list[QuantType], list[tuple[int, int]]]:
    """(threads, types, shapes) from the flags; a PymlError naming the first bad one."""
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        raise PymlError(f"--threads {args.threads}: expected counts such as 1,2") from None
    names = {q.name: q for q in QuantType}
    unknown = [t for t in args.types.split(",") if t not in names]
    if unknown:
        raise PymlError(f"--types: no weight type {unknown[0]!r} (types: {', '.join(names)})")
    qtypes = [names[t] for t in args.types.split(",")]
    try:
        shapes = [(int(r), int(c)) for r, c in (s.split("x") for s in args.shapes.split(","))]
    except ValueError:
        raise PymlError(f"--shapes {args.shapes}: expected rows x columns such as 5632x2048,2048x5632") from None
    if min(threads + [args.T] + [v for shape in shapes for v in shape]) < 1:
        raise PymlError(f"--threads {args.threads}, --T {args.T}, --shapes {args.shapes}: every count must be >= 1")
    for qtype in qtypes:
        bs = quant.traits_of(qtype).block_size
        for r, c in shapes:
            if c % bs:
                raise PymlError(f"--shapes {r}x{c}: {qtype.name} needs columns in a multiple of its block of {bs}")
    return threads, qtypes, shapes


def run(args) -> int:
    threads, qtypes, shapes = _options(args)
    quant.warmup()
    time.sleep(1.0)  # let BLAS workers started by the warm-up go idle
    rng = np.random.default_rng(0)
    a = rng.standard_normal((args.T, 2048), np.float32)
    b = rng.standard_normal((5632, 2048), np.float32)
    global _clock
    for n in threads:
        numba.set_num_threads(n)
        limits = threadpool_limits(n)
        _clock = time.thread_time if (args.cpu_time and n == 1) else time.perf_counter
        # Numba kernels first, BLAS last: OpenBLAS's workers keep spinning after a call and
        # would slow whatever Numba kernel is timed next (docs/performance.md, "No BLAS in a forward pass").
        ceiling = read_bandwidth(0.25, reps=5) / 1e9  # the probe a profile's report measures against
        us, bw_us = call_overhead_us()
        rows = {}
        for qtype in qtypes:
            for r, c in shapes:
                rows[qtype, r, c] = [gemv_gbs(qtype, r, c, rng=rng), None, gemm_gflops(qtype, r, c, args.T, rng=rng), None]
                if args.exact and qtype not in FLOAT_TYPES:
                    rows[qtype, r, c][1] = gemv_gbs(qtype, r, c, exact=True, rng=rng)
                if BF16 and qtype in FLOAT_TYPES:  # the prefill of --float-compute bf16 (T > 1 only)
                    rows[qtype, r, c, "bf16"] = [None, None, gemm_gflops(qtype, r, c, args.T, rng=rng, bf16=True),
                                                 None]
        if args.exact:  # the exact T > 1 path is BLAS on decoded tiles
            for (qtype, r, c, *_), row in rows.items():
                if qtype not in FLOAT_TYPES:
                    row[3] = gemm_gflops(qtype, r, c, args.T, exact=True, rng=rng)
        fp32_peak, int8_peak = compute_peaks()
        bf16 = bf16_peak()
        blas = 2.0 * args.T * 2048 * 5632 / _best(lambda: a @ b.T, 5) / 1e9

        print(f"== {n} thread(s){' (CPU time)' if _clock is time.thread_time else ''}")
        print(f"memory ceiling (a read of 256 MB): {ceiling:6.1f} GB/s")
        print(f"compute peak per core: float32 FMA {fp32_peak:6.1f} GFLOP/s, int8 dot ({INT8_INSTRUCTION}) "
              f"{int8_peak:6.1f} GOP/s" + (f", bf16 dot (vdpbf16ps) {bf16:6.1f} GFLOP/s" if bf16 else "")
              + f"; x{n} threads for the ceilings below")
        print(f"BLAS float32 GEMM [{args.T}x2048]x[2048x5632]: {blas:6.1f} GFLOP/s "
              f"({100 * blas / (n * fp32_peak):.0f}% of the float32 peak)")
        print(f"Q4_1 576x576 GEMV: {us:.1f} µs per call ({bw_us:.1f} µs of it is weight bytes at 20 GB/s)")
        print(f"{'type':9s} {'shape':>10s} {'T=1 GB/s':>9s}" + (f" {'exact':>6s}" if args.exact else "")
              + f" {'T=' + str(args.T) + ' GFLOP/s':>14s} {'% of peak':>9s}" + (f" {'exact':>6s}" if args.exact else ""))
        for (qtype, r, c, *compute), (gbs, gbs_x, gfl, gfl_x) in rows.items():
            name = qtype.name + (" bf16" if compute else "")
            line = f"{name:9s} {r:>5d}x{c:<5d} " + (f"{gbs:9.1f}" if gbs is not None else f"{'':9s}")
            if args.exact:
                line += f" {gbs_x:6.1f}" if gbs_x is not None else f" {'':6s}"
            peak = n * (bf16 if compute else fp32_peak if qtype in FLOAT_TYPES else int8_peak)
            line += f" {gfl:14.1f} {100 * gfl / peak:8.0f}%"
            if args.exact and gfl_x is not None:
                line += f" {gfl_x:6.1f}"
            print(line, flush=True)
        limits.unregister()
    return 0


def main(argv=None) -> int:
    return run_command("kernel_bench", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
