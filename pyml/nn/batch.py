"""Where the rows of a batched forward pass belong: several sequences of one KVPool in one pass.

A batched step stacks every sequence's new tokens into one [rows, d] activation, so that each
projection is one matrix product over all of them (the weights read once for every row); only
the attention is per sequence, over that sequence's own cache (Attention._batched). llama.cpp's
`llama_batch` (token, position, sequence id) is the model: here a sequence's rows are consecutive,
the one-token rows (decode) first, then the longer ones (prompt chunks), each as given.
"""

from __future__ import annotations

import numpy as np

from pyml.core.errors import PymlError


class Batch:
    """`rows`: (sequence, token ids, position of the first) for each sequence in the pass, each
    sequence at most once. `order` maps the rows' places in the pass back to `rows`' order."""

    def __init__(self, pool, rows: list):
        seqs = [seq for seq, _, _ in rows]
        if len(set(seqs)) != len(seqs):
            raise PymlError("a batched pass takes each sequence once: its tokens go in one row of the batch")
        if not rows or any(len(tokens) == 0 for _, tokens, _ in rows):
            raise PymlError("a batched pass needs at least one token for every sequence in it")
        self.pool = pool
        self.order = sorted(range(len(rows)), key=lambda i: len(rows[i][1]) != 1)  # decode rows first, stable
        self.in_order = self.order == list(range(len(rows)))  # the pass's rows are `rows` as given
        for seq, tokens, pos in rows:
            if pos < 0 or pos + len(tokens) > pool.max_len:
                raise PymlError(f"sequence {seq}: positions {pos} .. {pos + len(tokens) - 1} do not fit its "
                                f"{pool.max_len} cache slots")
        if all(len(tokens) == 1 for _, tokens, _ in rows):  # a decode step: no per-row array to make
            self._decode_only(rows)
            return
        segments = [(rows[i][0], np.asarray(rows[i][1], np.int64).reshape(-1), int(rows[i][2])) for i in self.order]
        self.tokens = np.concatenate([tokens for _, tokens, _ in segments])
        self.positions = np.concatenate([np.arange(pos, pos + len(tokens)) for _, tokens, pos in segments])
        n_decode = sum(len(tokens) == 1 for _, tokens, _ in segments)
        self.n_decode = n_decode  # rows 0 .. n_decode-1: one token of a sequence each
        self.decode_seqs = np.array([seq for seq, _, _ in segments[:n_decode]], np.int64)
        self.decode_ends = np.array([pos + 1 for _, _, pos in segments[:n_decode]], np.int64)
        self.prefill = []  # (first row, sequence, position, tokens) of the longer rows
        row = n_decode
        for seq, tokens, pos in segments[n_decode:]:
            self.prefill.append((row, seq, pos, len(tokens)))
            row += len(tokens)
        ends = np.cumsum([len(tokens) for _, tokens, _ in segments])
        self.last_rows = ends - 1  # each segment's last row: where its next-token logits come from
        self.segments = [(seq, pos, len(tokens)) for seq, tokens, pos in segments]

    def _decode_only(self, rows: list) -> None:
        """The fields above for rows of one token each, in the order given (a batched decode step
        makes one of these a step, on caches its weights have just flushed: ~0.1 ms of small arrays)."""
        seqs, positions = [seq for seq, _, _ in rows], [int(pos) for _, _, pos in rows]
        self.tokens = np.array([int(tokens[0]) for _, tokens, _ in rows], np.int64)
        self.positions = np.array(positions, np.int64)
        self.n_decode = len(rows)
        self.decode_seqs = np.array(seqs, np.int64)
        self.decode_ends = self.positions + 1
        self.prefill = []
        self.last_rows = np.arange(len(rows))
        self.segments = [(seq, pos, 1) for seq, pos in zip(seqs, positions)]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def cache(self, seq: int):
        return self.pool.sequence(seq)


class _OneSequence:
    """A KVCache seen as a pool of one sequence (KVPool.layer's [n_seqs, ...] arrays, its addresses)."""

    def __init__(self, cache):
        self.cache = cache

    def layer(self, layer: int) -> tuple:
        return tuple(a[None] for a in self.cache.layer(layer))

    def addresses(self) -> np.ndarray:
        return self.cache.addresses()


def sequence_rows(cache, pos: int, T: int) -> tuple:
    """(pool, seqs, ends) for FusedStep.rows: positions pos .. pos+T-1 of one KVCache as T decode rows
    (a speculative verify pass: each attends up to its own position, as its decode step would),
    claimed in every layer (the kernel writes them)."""
    claim_rows(cache, pos, T)
    return _OneSequence(cache), np.zeros(T, np.int64), np.arange(pos + 1, pos + T + 1, dtype=np.int64)


def claim_rows(cache, pos: int, T: int) -> None:
    """Positions pos .. pos+T-1 of one KVCache claimed in every layer: decode rows the compiled step
    writes (every row's keys and values before any row attends)."""
    for layer in range(cache.n_layers):
        cache.claim(layer, pos, T)
