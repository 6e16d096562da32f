"""Log-probabilities of tokens: what OpenAI's `logprobs` / `top_logprobs` / `echo` return and what a
log-likelihood evaluation (lm-evaluation-harness) sums.

They come from the logits the model gives (Gemma's final softcapping included), before anything the
sampler does to them (penalties, logit_bias, temperature, top-k/top-p/min-p): the model's own
distribution, as llama-server's `n_probs` and OpenAI's logprobs report it. The softmax is taken in
float64 (float32's exp sum over a 262K-token vocabulary loses the 1e-4 the oracle test asks for on
unlikely tokens), and the top n by a partition, never a sort of the vocabulary.

A prompt's own log-probabilities (echo, `LanguageModel.score`) need the logits of every prompt
position, not only the last: `prompt_logprobs` runs the prefill in chunks of rows whose logits fit
`MAX_LOGIT_FLOATS`, each chunk's turned into log-probabilities and dropped before the next, so a
2,048-token prompt on a 262K vocabulary never holds its 2 GB of logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.nlp.models.base import DecoderModel, prompt_pieces

_perf = perf.get("pyml.nlp.generator")
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; the completions API's is 5 (pyml-serve checks it)
MAX_LOGIT_FLOATS = 1 << 22  # a prompt's logits held at once while scoring it: 16 MB of float32


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model, and the `top` most likely tokens at its
    position as (id, logprob) pairs, likeliest first (empty unless asked for)."""
    token: int
    logprob: float
    top: tuple = ()


def check_top(n: int, limit: int = MAX_TOP_LOGPROBS) -> int:
    """`n` if it is a count of top log-probabilities pyml gives (0 .. limit), else one clear error."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= limit:
        raise PymlError(f"top_logprobs must be an integer in [0, {limit}], got {n!r}")
    return int(n)


def log_softmax(logits: np.ndarray) -> np.ndarray:  # [..., vocab] -> [..., vocab] float64
    # float64: a float32 sum of exp over 262K terms loses the digits a KL divergence of 1e-4 needs
    # (perplexity.py and kl_divergence.py use this one too)
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def top_of(logprobs: np.ndarray, n: int) -> tuple:  # [vocab] -> n (id, logprob), likeliest first
    if n <= 0:
        return ()
    n = min(n, logprobs.shape[0])
    ids = np.argpartition(logprobs, -n)[-n:]
    ids = ids[np.lexsort((ids, -logprobs[ids]))]  # likeliest first; ties by id, as a stable sort would
    return tuple((int(i), float(logprobs[i])) for i in ids)


def token_logprob(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """`token`'s log-probability under one position's logits [vocab], with the `top` likeliest."""
    lp = log_softmax(logits)
    return TokenLogprob(int(token), float(lp[token]), top_of(lp, top))


def rows_logprobs(logits: np.ndarray, tokens, top: int = 0) -> list[TokenLogprob]:
    """Row i's log-probability of tokens[i], for logits [T, vocab]."""
    lp = log_softmax(logits)
    return [TokenLogprob(int(t), float(row[t]), top_of(row, top)) for row, t in zip(lp, tokens)]


def chunk_rows(vocab: int) -> int:
    """Prompt positions whose logits are held at once while scoring (at least one)."""
    return max(1, MAX_LOGIT_FLOATS // max(1, vocab))


def prompt_logprobs(model: DecoderModel, ids: list, cache, top: int = 0) -> tuple[list, np.ndarray]:
    """Prefill `ids` into an empty `cache` keeping every position's logits: the log-probability of
    each prompt token after the first given the ones before it (len(ids) - 1 entries), and the
    last position's logits [vocab] (what chooses the first generated token)."""
    out, step = [], chunk_rows(model.config.vocab_size)
    with _perf.debug("generator::prompt_logprobs", "tokens={} top={}", len(ids), top, op="generator"):
        for start, end in prompt_pieces(len(ids), step):  # no chunk of one token: it would be a decode step
            chunk = ids[start:end]
            logits = model.forward(chunk, cache, pos=start, all_logits=True)  # [len(chunk), vocab]
            nexts = ids[start + 1:start + 1 + len(chunk)]  # what each row predicts; the last row's is not here
            out += rows_logprobs(logits[:len(nexts)], nexts, top)
    return out, logits[-1]


@dataclass(frozen=True)
class Score:
    """A text's tokens under the model (`LanguageModel.score`): `logprobs[i]` is tokens[i + 1]'s (the
    first token has none: nothing comes before it), each with its position's likeliest token first in
    `top`. The last `len(tokens) - context` tokens are the continuation whose likelihood is asked."""
    tokens: list
    logprobs: list
    context: int

    @property
    def continuation(self) -> list:
        """The continuation's TokenLogprobs (every token after the first, without a context)."""
        return self.logprobs[max(0, self.context - 1):]

    @property
    def logprob(self) -> float:
        """The continuation's log-likelihood: the sum of its tokens' log-probabilities."""
        return float(sum(t.logprob for t in self.continuation))

    @property
    def is_greedy(self) -> bool:
        """Whether greedy decoding from the context would have produced the continuation."""
        return all(t.top and t.top[0][0] == t.token for t in self.continuation)
