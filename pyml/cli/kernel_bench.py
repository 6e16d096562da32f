"""Kernel benchmark: GB/s of the T == 1 kernels and GFLOP/s at T == 128, per weight type.

    python -m pyml.cli.kernel_bench [--threads 1,2] [--types Q4_0,Q6_K] [--shapes 5632x2048,2048x5632]

T == 1 cycles through enough copies of each matrix (>= 256 MB) that weights come from
memory, not cache, as in a real model; GB/s = stored weight bytes / time (best of several
rounds). Baselines printed first: a streaming byte-sum (the memory ceiling for a kernel
that reads its weights once) and NumPy/BLAS float32 GEMM at T == 128.
"""

from __future__ import annotations

import argparse
import sys
import time

import numba
import numpy as np
from numba import prange

from threadpoolctl import threadpool_limits

from pyml import quant
from pyml.cli.main import Parser, run_command
from pyml.quant import FLOAT_TYPES, QuantType

_COPY_BYTES = 256 << 20


@numba.njit(parallel=True, cache=True)
def _stream_sum(a, out):  # the memory-bandwidth ceiling: read every byte once
    for r in prange(a.shape[0]):
        s = np.uint32(0)
        for i in range(a.shape[1]):
            s += a[r, i]
        out[r] = s


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
    return raw.reshape(rows, -1)


_clock = time.perf_counter


def _best(fn, rounds):
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = _clock()
        fn()
        best = min(best, _clock() - t)
    return best


def gemv_gbs(qtype, rows, n_cols, exact=False, rounds=6, rng=None) -> float:
    rng = rng or np.random.default_rng(0)
    w = _weights(rng, qtype, rows, n_cols)
    copies = [w] + [w.copy() for _ in range(max(1, _COPY_BYTES // w.nbytes) - 1)]
    for c in copies:
        c.flags.writeable = False  # as a GGUF memory map
    x = rng.standard_normal((1, n_cols), np.float32)
    out = np.empty((1, rows), np.float32)

    def run():
        for c in copies:
            quant.matmul(x, c, qtype, n_cols, out=out, exact=exact)
    return w.nbytes * len(copies) / _best(run, rounds) / 1e9


def gemm_gflops(qtype, rows, n_cols, T=128, exact=False, rounds=3, rng=None) -> float:
    rng = rng or np.random.default_rng(0)
    w = _weights(rng, qtype, rows, n_cols)
    w.flags.writeable = False
    x = rng.standard_normal((T, n_cols), np.float32)
    out = np.empty((T, rows), np.float32)
    return 2.0 * T * rows * n_cols / _best(lambda: quant.matmul(x, w, qtype, n_cols, out=out, exact=exact),
                                           rounds) / 1e9


def call_overhead_us(qtype=QuantType.Q4_1, n=576, rounds=2000) -> tuple[float, float]:
    """(µs per matmul of a cache-resident n x n GEMV, µs of that which is bandwidth at 20 GB/s)."""
    rng = np.random.default_rng(0)
    w = _weights(rng, qtype, n, n)
    w.flags.writeable = False
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


def run(args) -> int:
    threads = [int(t) for t in args.threads.split(",")]
    qtypes = [QuantType[t] for t in args.types.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    quant.warmup()
    time.sleep(1.0)  # let BLAS workers started by the warm-up go idle
    rng = np.random.default_rng(0)
    big = rng.integers(0, 255, (8192, 32768), dtype=np.uint8)  # 256 MB
    sums = np.empty(big.shape[0], np.uint32)
    a = rng.standard_normal((args.T, 2048), np.float32)
    b = rng.standard_normal((5632, 2048), np.float32)
    global _clock
    for n in threads:
        numba.set_num_threads(n)
        limits = threadpool_limits(n)
        _clock = time.thread_time if (args.cpu_time and n == 1) else time.perf_counter
        # Numba kernels first, BLAS last: OpenBLAS's workers keep spinning after a call and
        # would slow whatever Numba kernel is timed next (docs/performance.md, "No BLAS in a forward pass").
        ceiling = big.nbytes / _best(lambda: _stream_sum(big, sums), 5) / 1e9
        us, bw_us = call_overhead_us()
        rows = {}
        for qtype in qtypes:
            for r, c in shapes:
                rows[qtype, r, c] = [gemv_gbs(qtype, r, c, rng=rng), None, gemm_gflops(qtype, r, c, args.T, rng=rng), None]
                if args.exact and qtype not in FLOAT_TYPES:
                    rows[qtype, r, c][1] = gemv_gbs(qtype, r, c, exact=True, rng=rng)
        if args.exact:  # the exact T > 1 path is BLAS on decoded tiles
            for (qtype, r, c), row in rows.items():
                if qtype not in FLOAT_TYPES:
                    row[3] = gemm_gflops(qtype, r, c, args.T, exact=True, rng=rng)
        blas = 2.0 * args.T * 2048 * 5632 / _best(lambda: a @ b.T, 5) / 1e9

        print(f"== {n} thread(s){' (CPU time)' if _clock is time.thread_time else ''}")
        print(f"memory ceiling (stream sum of 256 MB): {ceiling:6.1f} GB/s")
        print(f"BLAS float32 GEMM [{args.T}x2048]x[2048x5632]: {blas:6.1f} GFLOP/s")
        print(f"Q4_1 576x576 GEMV: {us:.1f} µs per call ({bw_us:.1f} µs of it is weight bytes at 20 GB/s)")
        print(f"{'type':6s} {'shape':>10s} {'T=1 GB/s':>9s}" + (f" {'exact':>6s}" if args.exact else "")
              + f" {'T=' + str(args.T) + ' GFLOP/s':>14s}" + (f" {'exact':>6s}" if args.exact else ""))
        for (qtype, r, c), (gbs, gbs_x, gfl, gfl_x) in rows.items():
            line = f"{qtype.name:6s} {r:>5d}x{c:<5d} {gbs:9.1f}"
            if args.exact:
                line += f" {gbs_x:6.1f}" if gbs_x is not None else f" {'':6s}"
            line += f" {gfl:14.1f}"
            if args.exact and gfl_x is not None:
                line += f" {gfl_x:6.1f}"
            print(line, flush=True)
        limits.unregister()
    return 0


def main(argv=None) -> int:
    return run_command("kernel_bench", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
