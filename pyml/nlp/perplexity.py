"""Perplexity over a text, computed as llama.cpp's llama-perplexity computes it, so figures compare.

The text is tokenized once, BOS added as the model asks (llama.cpp's `common_tokenize(..., true)`),
and cut into chunks of `n_ctx` tokens (a tail shorter than a chunk is not scored; at least two
chunks are needed). Each chunk is a forward pass from an empty cache whose first token is replaced
by BOS when the model adds one. Only the second half of each chunk is scored: the logits at
positions n_ctx/2 .. n_ctx-2 predict the tokens after them, so every scored token has at least
n_ctx/2 tokens of context. The estimate after each chunk is exp(mean NLL), and its uncertainty
llama.cpp's: ppl x sqrt((mean(nll^2) - mean(nll)^2) / (count - 1)).

A chunk's first half is run without the head; its second half's logits come in pieces of at most
`LOGIT_FLOATS` floats over the pass's chunks (Gemma 3's 262K-token vocabulary: 64 rows), each turned into its rows'
scores and dropped. With `seqs` > 1 several chunks go through one pass (DecoderModel.forward_batch):
each projection a product over all their rows, as llama-perplexity's n_seq = n_batch / n_ctx.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from pyml.core import perf
from pyml.core.errors import PymlError

_perf = perf.get("pyml.nlp.perplexity")
LOGIT_FLOATS = 1 << 24  # a piece of a chunk's logits held at once: 64 MB of float32


@dataclass(frozen=True)
class Estimate:
    """exp(mean NLL) over `count` scored tokens, and llama.cpp's uncertainty of it."""
    ppl: float
    err: float
    count: int

    def final_line(self) -> str:
        """llama-perplexity's last line, byte for byte in its format, so scripts read either."""
        return f"Final estimate: PPL = {self.ppl:.4f} +/- {self.err:.5f}"


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple:
    """llama.cpp's (mean, standard error of the mean) from a sum and a sum of squares."""
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def estimate(nll: np.ndarray) -> Estimate:
    """The perplexity of scored tokens' negative log-likelihoods, as llama-perplexity's final line
    (whose uncertainty has no count > 10 condition: only a positive variance)."""
    nll = np.asarray(nll, np.float64)
    count = len(nll)
    mean = float(nll.sum()) / count
    var = float((nll * nll).sum()) / count - mean * mean
    ppl = math.exp(mean)
    return Estimate(ppl, ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0, count)


def text_tokens(lm, text: str) -> np.ndarray:
    """The text's ids as llama-perplexity tokenizes it: BOS first when the model adds one."""
    return np.asarray(lm.encode(text), np.int64)


def chunk_tokens(tokens: np.ndarray, n_ctx: int, n_chunks: int | None = None) -> np.ndarray:
    """[n_chunk, n_ctx] chunks of the text's tokens (a shorter tail is dropped), as llama.cpp cuts them."""
    if n_ctx < 4:
        raise PymlError(f"the context (-c) must be at least 4 tokens, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise PymlError(f"the text is {len(tokens)} tokens: perplexity with a context of {n_ctx} needs at least "
                        f"{2 * n_ctx} (two chunks)")
    n = len(tokens) // n_ctx if n_chunks is None or n_chunks < 0 else min(n_chunks, len(tokens) // n_ctx)
    if n < 1:
        raise PymlError(f"--chunks must be at least 1, got {n_chunks}")
    return np.asarray(tokens[:n * n_ctx], np.int64).reshape(n, n_ctx)


def first_scored(n_ctx: int) -> int:
    return n_ctx // 2


def chunk_inputs(chunk: np.ndarray, bos_id: int | None) -> np.ndarray:
    """The chunk as the model reads it: its first token replaced by BOS when the model adds one."""
    inputs = chunk.copy()
    if bos_id is not None:
        inputs[0] = bos_id
    return inputs


def chunk_logits(lm, chunks: np.ndarray, seqs: int = 1) -> Iterator[tuple]:
    """(chunk index, row of the first scored position, logits [rows, vocab]) for every chunk's scored
    positions n_ctx/2 .. n_ctx-2, chunk after chunk, in pieces; `seqs` chunks a pass."""
    n_chunk, n_ctx = chunks.shape
    first = first_scored(n_ctx)
    model = lm.model
    if n_ctx > model.max_positions:
        raise PymlError(f"the context (-c {n_ctx}) is longer than the model's {model.max_positions} positions")
    bos = lm.tokenizer.bos_id if lm.tokenizer is not None and lm.tokenizer.add_bos else None
    seqs = max(1, min(seqs, n_chunk))
    piece = max(1, min(n_ctx - 1 - first, LOGIT_FLOATS // (model.config.vocab_size * seqs)))
    lm.warm_up(prefill=True)
    pool = model.new_pool(seqs, n_ctx)  # one sequence: forward_batch runs it as its own pass
    for c0 in range(0, n_chunk, seqs):
        group = [chunk_inputs(chunks[c], bos) for c in range(c0, min(c0 + seqs, n_chunk))]
        # a top-level span a pass (its lines printed as each ends): the forward passes and the scoring
        with _perf.debug("perplexity::chunk", "chunks={}..{} n_ctx={}", c0, c0 + len(group) - 1, n_ctx,
                         op="perplexity"):
            for s in range(len(group)):
                pool.clear(s)
            # the first half only fills the caches: its logits are not scored
            model.forward_batch(pool, [(s, g[:first], 0) for s, g in enumerate(group)])
            for a in range(first, n_ctx - 1, piece):
                b = min(a + piece, n_ctx - 1)
                rows = model.forward_batch(pool, [(s, g[a:b], a) for s, g in enumerate(group)], all_logits=True)
                for s, logits in enumerate(rows):
                    yield c0 + s, a, logits

@dataclass
class PerplexityResult:
    estimate: Estimate
    n_ctx: int
    n_chunks: int
    running: list  # the estimate after each chunk, llama-perplexity's [i]ppl values
    nll: np.ndarray  # every scored token's negative log-likelihood, chunk after chunk


def perplexity(lm, text: str | None = None, n_ctx: int = 512, n_chunks: int | None = None, *,
               tokens: np.ndarray | None = None, seqs: int = 1,
               on_rows: Callable | None = None, on_chunk: Callable | None = None) -> PerplexityResult:
    """llama-perplexity's perplexity of `lm` over `text` (or its `tokens`) in chunks of `n_ctx`.

    `on_rows(chunk, logits, targets)` sees each piece of scored rows (the KL divergence's hook);
    `on_chunk(i, running)` is told each chunk's end with the running Estimate."""
    chunks = chunk_tokens(text_tokens(lm, text) if tokens is None else tokens, n_ctx, n_chunks)
    n_chunk = chunks.shape[0]
    per_chunk = n_ctx - 1 - first_scored(n_ctx)
    nll = np.empty((n_chunk, per_chunk), np.float64)
    done = np.zeros(n_chunk, np.int64)
    running = []
    for c, a, logits in chunk_logits(lm, chunks, seqs):
        targets = chunks[c, a + 1:a + 1 + len(logits)]
        row = a - first_scored(n_ctx)
        nll[c, row:row + len(logits)] = token_nll(logits, targets)
        if on_rows is not None:
            on_rows(c, logits, targets)
        done[c] += len(logits)
        while len(running) < n_chunk and done[len(running)] == per_chunk:
            running.append(estimate(nll[:len(running) + 1].ravel()))
            if on_chunk is not None:
                on_chunk(len(running) - 1, running[-1])
    return PerplexityResult(running[-1], n_ctx, n_chunk, running, nll.ravel())


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64."""
    x = np.asarray(logits, np.float64)
    top = x.max(axis=-1)
    lse = top + np.log(np.exp(x - top[:, None]).sum(axis=-1))
    return lse - x[np.arange(len(x)), targets]
