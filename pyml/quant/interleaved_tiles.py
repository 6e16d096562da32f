"""The x8 GEMM's walk over the activation rows, written once for its four forms (8 rows on 256-bit
vectors, interleaved_gemm.py; 16 on 512-bit ones, interleaved_pairs.py; each for the legacy types
and for Q4_K): 4 rows at a time, each block's staged codes loaded once for the 4 (8 independent
dot chains in flight), then the rows left one at a time. A form is its vector width's `zeros` and
`store` and two functions of its block:

    shared(kind, data, b) -> what the 4 rows share of block b (its codes, Q8_0's corrections)
    dot(kind, data, s, b, y, yd, yoff, ys, acc) -> acc + activation row y's products with block b

`data` a tuple of the arrays the form made once per call (staged codes, tables, the group). Numba
needs a function per form (its callees are constants of the compiled code), so token_tiles makes
one; the compiled loop is the one each form had written out.
"""

from __future__ import annotations

import numba


def token_tiles(zeros, store, shared, dot, rest=None):
    """The tile loop of one form (module doc), a Numba function:
    (kind, data, xq [T, nb*32], xd [T, nb], xs [T, nb], xoff [T, nb], out [T, R], col) -> None,
    out[t, col:col + the width's lanes] = the rows' dots for every activation row t."""
    if rest is None:
        @numba.njit
        def rest(kind, data, y, yd, ys, yoff, out_row, col):  # one row, block by block
            acc = zeros()
            for b in range(yd.size):
                acc = dot(kind, data, shared(kind, data, b), b, y, yd[b], yoff, ys[b], acc)
            store(out_row, col, acc)

    @numba.njit
    def tiles(kind, data, xq, xd, xs, xoff, out, col):
        numba.literally(kind)
        T, nb = xd.shape
        for t in range(0, T - 3, 4):
            y0, y1, y2, y3 = xq[t], xq[t + 1], xq[t + 2], xq[t + 3]
            f0, f1, f2, f3 = xoff[t], xoff[t + 1], xoff[t + 2], xoff[t + 3]
            a0, a1, a2, a3 = zeros(), zeros(), zeros(), zeros()
            for b in range(nb):
                s = shared(kind, data, b)
                a0 = dot(kind, data, s, b, y0, xd[t, b], f0, xs[t, b], a0)
                a1 = dot(kind, data, s, b, y1, xd[t + 1, b], f1, xs[t + 1, b], a1)
                a2 = dot(kind, data, s, b, y2, xd[t + 2, b], f2, xs[t + 2, b], a2)
                a3 = dot(kind, data, s, b, y3, xd[t + 3, b], f3, xs[t + 3, b], a3)
            store(out[t], col, a0)
            store(out[t + 1], col, a1)
            store(out[t + 2], col, a2)
            store(out[t + 3], col, a3)
        for t in range(T - T % 4, T):
            rest(kind, data, xq[t], xd[t], xs[t], xoff[t], out[t], col)

    return tiles


def code_scratch(load, store, width: int):
    """(put, get) for a GEMM's scratch of staged codes, 8 vectors of `width` bytes a block (block b
    at 8 width b): put(st, b, v) stores block b's 8-tuple v, get(st, b) loads it back."""

    @numba.njit
    def put(st, b, v):
        for n in range(8):
            store(st, 8 * width * b + width * n, v[n])

    @numba.njit
    def get(st, b):
        c = 8 * width * b
        return (load(st, c), load(st, c + width), load(st, c + 2 * width), load(st, c + 3 * width),
                load(st, c + 4 * width), load(st, c + 5 * width), load(st, c + 6 * width), load(st, c + 7 * width))

    return put, get
