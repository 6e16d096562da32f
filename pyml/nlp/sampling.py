"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, the
repetition, frequency and presence penalties, and OpenAI's logit_bias.

Nothing here sorts the whole vocabulary: greedy is an argmax, top-k an
argpartition, and top-p widens a partial sort until the kept mass reaches p —
on a 262K-token vocabulary a full sort costs more than some models' layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from pyml.core.errors import PymlError


class SamplingError(PymlError):
    """A sampling option out of its range: `field` is SamplingConfig's name for it and `rule` the rest
    of the message, so that each caller names the option as it is given there (the library's
    argument, a flag, a JSON field)."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"{field} {rule}")
        self.field, self.rule = field, rule


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0      # 0 = greedy
    top_k: int = 0                # 0 = off
    top_p: float = 1.0            # 1 = off
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_p: float = 0.0            # 0 = off; else drop tokens less likely than min_p x the likeliest
    frequency_penalty: float = 0.0  # OpenAI's: logit -= frequency x count, over the tokens seen so far
    presence_penalty: float = 0.0   # logit -= presence once a token has been seen
    logit_bias: dict | None = None  # token id -> added to its logit first, in [-100, 100]; -100 bans it

    def __post_init__(self):
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingError("seed", f"must be an integer >= 0, got {self.seed!r}")  # NumPy's generators refuse others
        if not 0 <= self.temperature < math.inf:  # inf flattens every logit to 0: uniform noise
            raise SamplingError("temperature", f"must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise SamplingError("repetition_penalty", f"must be > 0 and finite, got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise SamplingError("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # OpenAI's range
                raise SamplingError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
                raise PymlError(f"logit_bias: {token!r} is not a token id (an integer >= 0)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise PymlError(f"logit_bias[{token}] must be a number in [-100, 100], got {bias!r}")

    def check_vocab(self, vocab: int) -> None:
        """One clear error if logit_bias names a token outside a vocabulary of `vocab` ids."""
        if bad := sorted(t for t in (self.logit_bias or {}) if t >= vocab):
            raise PymlError(f"logit_bias: token id {bad[0]} is outside the model's vocabulary of {vocab} tokens")
        if sum(b <= -100 for b in (self.logit_bias or {}).values()) >= vocab:
            raise PymlError("logit_bias bans every token of the vocabulary: nothing is left to choose")


def check_sampling(options: dict, spell) -> None:
    """Refuse the sampling options among `options` (other keys ignored) that SamplingConfig would, in
    one line naming the option as spell(SamplingConfig's field name) spells it: --top-p for a flag,
    "top_p" (quoted) for a JSON field, top_p for the library's argument."""
    known = {f.name for f in fields(SamplingConfig)}
    try:
        SamplingConfig(**{k: v for k, v in options.items() if k in known})
    except SamplingError as e:
        raise PymlError(f"{spell(e.field)} {e.rule}") from None


class Sampler:
    """`constraint` (constrained.py's, or None): forbids tokens before any other filter sees the
    logits, and advances on the token chosen."""

    def __init__(self, config: SamplingConfig, constraint=None):
        self.config, self.constraint = config, constraint
        self.rng = np.random.default_rng(config.seed)
        bias = config.logit_bias or {}
        self.bias_ids = np.fromiter(bias, np.int64, len(bias))
        # -100 bans the token outright (OpenAI: "should result in a ban"), whatever its logit
        self.bias = np.array([-np.inf if b <= -100 else b for b in bias.values()], np.float32)

    def __call__(self, logits: np.ndarray, history=()) -> int:
        if self.constraint is None:
            return self._choose(logits, history)
        token = self._choose(self.constraint.apply(logits), history)
        self.constraint.accept(token)
        return token

    def _choose(self, logits: np.ndarray, history) -> int:
        logits = self.penalised(logits, history)
        if self.config.temperature == 0.0:
            return int(np.argmax(logits))
        ids, probs = self.distribution(logits)
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def penalised(self, logits: np.ndarray, history=()) -> np.ndarray:
        """The logits after logit_bias and the repetition, frequency and presence penalties of `history`."""
        c = self.config
        if len(self.bias_ids):  # first, as llama.cpp's sampler chain: the penalties see biased logits
            logits = logits.astype(np.float32, copy=True)
            logits[self.bias_ids] += self.bias
        if c.repetition_penalty != 1.0 and len(history):
            logits = logits.copy()
            seen = np.unique(np.asarray(history, dtype=np.int64))
            vals = logits[seen]
            logits[seen] = np.where(vals > 0, vals / c.repetition_penalty, vals * c.repetition_penalty)
        if (c.frequency_penalty or c.presence_penalty) and len(history):
            logits = logits.astype(np.float32, copy=True)
            seen, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
            logits[seen] -= c.frequency_penalty * counts + c.presence_penalty
        return logits

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, probs): the tokens a temperature > 0 draw may choose from penalised logits, and
        their probabilities after temperature, top-k, min-p and top-p (summing to 1)."""
        c = self.config
        ids = np.arange(logits.shape[0])
        if 0 < c.top_k < logits.shape[0]:
            ids = np.argpartition(logits, -c.top_k)[-c.top_k:]
        scaled = logits[ids].astype(np.float64) / c.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if c.min_p > 0.0:
            keep = probs >= c.min_p * probs.max()
            ids, probs = ids[keep], probs[keep] / probs[keep].sum()
        if c.top_p < 1.0:
            ids, probs = _top_p(ids, probs, c.top_p)
        return ids, probs


def _top_p(ids: np.ndarray, probs: np.ndarray, p: float):
    """The smallest set of most likely tokens whose mass reaches p, renormalised."""
    n = len(probs)
    k = min(n, 64)
    while True:
        top = np.argpartition(probs, -k)[-k:] if k < n else np.arange(n)
        top = top[np.argsort(-probs[top], kind="stable")]
        cum = np.cumsum(probs[top])
        if cum[-1] >= p or k == n:
            keep = top[:int(np.searchsorted(cum, p)) + 1]
            kept = probs[keep]
            return ids[keep], kept / kept.sum()
        k = min(n, 4 * k)
