"""Speculative decoding: a cheap drafter proposes up to k tokens, one forward pass of the target
over the k + 1 positions (the prefill kernels) checks them all, and the KV caches are rolled back
past the rejected ones. Several tokens per read of the weights, the same output.

Greedy: the longest prefix of the draft that matches the target's own choice at each position is
kept, then the target's choice after it, so the tokens are those of plain decoding. Sampling: the
rejection rule of Leviathan et al. (2023) and Chen et al. (2023): draft token d, drawn from the
drafter's distribution q, is kept with probability min(1, p(d) / q(d)) under the target's
distribution p; the first one refused is replaced by a draw from norm(max(0, p - q)); if all are
kept, one more is drawn from p. Each token is then distributed exactly as p. A prompt-lookup
draft is deterministic (q puts all its mass on d): d is kept with probability p(d), a refusal
draws from p without d.

Drafters: PromptLookup (the continuation of the first earlier occurrence of the newest n-gram of
the prompt and the text so far, as transformers' prompt_lookup_num_tokens) and DraftModel (a smaller model with the same vocabulary and its own KV cache, kept
holding a prefix of the target's tokens). `Speculator.step` is the generator's decode step when
speculation is on (nlp/generator.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyml.core import perf
from pyml import quant
from pyml.core.errors import PymlError
from pyml.nn.attention import FEW_QUERIES
from pyml.quant.interleaved_rows import ROWS_MAX
from pyml.nn.kv_cache import RING_SLACK

_perf = perf.get("pyml.nlp.speculative")

# A verify pass of k + 1 positions gives each position a decode step's bits only up to this many
# rows (its matmuls inside quant.decode_rows(): 2 .. ROWS_MAX rows; nn/attention.py: FEW_QUERIES);
# past it the GEMM and the tiled attention round otherwise and greedy output would drift.
MAX_DRAFT = min(ROWS_MAX, FEW_QUERIES) - 1
assert MAX_DRAFT < RING_SLACK  # the pass must also fit a sliding-window ring's slack


@dataclass(frozen=True)
class SpeculativeConfig:
    """lookup_ngram: prompt lookup matching the newest n-grams of up to this many tokens (0: off);
    draft_model: a DecoderModel (or an LM) drafting instead; draft_max: tokens proposed per step at
    most; adaptive: draft less while drafting does not pay, and (a draft model, a batch's
    sequences) shrink k after refusals (Throttle)."""
    lookup_ngram: int = 0
    draft_max: int = MAX_DRAFT
    draft_model: object = None
    adaptive: bool = True

    def __post_init__(self):
        if not 1 <= self.draft_max <= MAX_DRAFT:
            raise PymlError(f"--draft-max must be in 1..{MAX_DRAFT}, got {self.draft_max}")
        if self.lookup_ngram < 0:
            raise PymlError(f"--lookup-ngram must be >= 0, got {self.lookup_ngram}")
        if (self.lookup_ngram > 0) == (self.draft_model is not None):
            raise PymlError("speculative decoding takes one drafter: --lookup-ngram N or --draft-model MODEL")


# Prompt lookup drafts only from a match of at least this many tokens (unless --lookup-ngram 1):
# replaying SmolLM2 Q8_0's greedy outputs of pyml-bench --spec's prompts through the drafter, a
# one-token match's proposals kept 0.39 (free chat) to 0.66 (summarise) tokens each - less than a
# verify pass's extra rows cost - where two- and three-token matches kept 1.2-3.6
# (docs/speculative.md, "Choosing the drafts").
LOOKUP_MIN_NGRAM = 2


class PromptLookup:
    """Proposals from the tokens so far: for n = ngram .. LOOKUP_MIN_NGRAM, the tokens that followed
    the first earlier occurrence of the newest n tokens (transformers' rule: where text is copied,
    the prompt holds the original; in pyml-bench --spec's runs on SmolLM2 Q8_0, --lookup-ngram 4, the
    first occurrence kept 180 of 261 drafts on edit-code and 51 of 111 on summarise, the last 152 of
    255 and 45 of 103).
    Indexes are kept up to date as tokens
    arrive, so a proposal costs O(ngram) whatever the length of the text."""

    def __init__(self, ngram: int):
        self.ngram = ngram
        self.min_n = min(ngram, LOOKUP_MIN_NGRAM)
        self.index = [dict() for _ in range(ngram + 1)]  # index[n][n-gram tuple] -> where its continuation starts
        self.seen = 0  # tokens whose n-grams ending there are indexed (their continuation known)

    def _catch_up(self, tokens: list) -> None:
        # an n-gram ending at i - 1 is indexed once token i (its continuation) exists
        for i in range(max(self.seen, 1), len(tokens)):
            for n in range(1, min(self.ngram, i) + 1):
                self.index[n].setdefault(tuple(tokens[i - n:i]), i)
        self.seen = len(tokens)

    def propose(self, tokens: list, k: int) -> list:
        if len(tokens) < self.seen:  # the text was cut (a context shift): index it again
            self.index, self.seen = [dict() for _ in range(self.ngram + 1)], 0
        self._catch_up(tokens)
        for n in range(min(self.ngram, len(tokens)), self.min_n - 1, -1):
            start = self.index[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class DraftModel:
    """A smaller model drafting k tokens by plain decode steps on its own KV cache, which always
    holds a prefix of the target's tokens (rolled back with it after each verification)."""

    def __init__(self, model, max_len: int):
        self.model = model
        self.kv = model.new_cache(max_len)
        self.cached = []  # the token ids whose keys and values self.kv holds

    def propose(self, tokens: list, k: int, sampler, history: list) -> tuple[list, list]:
        """(draft ids, their draft distributions as full-vocabulary arrays or None when greedy)."""
        n = len(self.cached)
        if self.cached != tokens[:n]:  # the target's cache was rebuilt (a context shift): start over
            n, self.cached = 0, []
            self.kv.rollback(0)
        k = min(k, self.kv.max_len - len(tokens))  # the draft model's window may be the shorter
        if k < 1:
            return [], []
        logits = self.model.forward(tokens[n:], self.kv, pos=n)
        self.cached = list(tokens)
        draft, dists, seen = [], [], list(history)
        for i in range(k):
            logits = sampler.penalised(logits, seen)
            if sampler.config.temperature == 0.0:
                token, q = int(np.argmax(logits)), None
            else:
                ids, probs = sampler.distribution(logits)
                q = np.zeros(logits.shape[0])
                q[ids] = probs
                token = int(ids[sampler.rng.choice(len(ids), p=probs)])
            draft.append(token)
            dists.append(q)
            seen.append(token)
            if i + 1 < k:
                logits = self.model.forward([token], self.kv, pos=len(self.cached))
                self.cached.append(token)
        return draft, dists

    def keep(self, length: int) -> None:
        """The target kept its first `length` tokens: forget the draft's beyond them."""
        if length < len(self.cached):
            self.cached = self.cached[:length]
            self.kv.rollback(length)


def check_vocabularies(target, draft) -> None:
    """One line when the draft model's token ids cannot stand for the target's."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise PymlError(f"the draft model's vocabulary ({dv} tokens) is not the target's ({tv} tokens): "
                        "a draft model must share the target's tokenizer")


def accept_sampled(p_dists: list, draft: list, q_dists: list, rng) -> tuple[list, int]:
    """The rejection rule: p_dists[i] the target's distribution (full vocabulary) after the first
    i drafts (len(draft) + 1 of them), q_dists[i] the draft's for draft[i] (None: the draft was
    certain). Returns (tokens chosen, drafts kept); every token is distributed as p."""
    for i, d in enumerate(draft):
        p, q = p_dists[i], q_dists[i]
        q_d = 1.0 if q is None else q[d]
        if rng.random() * q_d < p[d]:  # kept with probability min(1, p(d) / q(d))
            continue
        residual = p.copy()
        if q is None:
            residual[d] = 0.0
        else:
            residual = np.maximum(residual - q, 0.0)
        total = residual.sum()
        # p(d) < q(d) leaves mass elsewhere unless float rounding ate it: then p itself
        residual = residual / total if total > 0 else p
        return draft[:i] + [int(rng.choice(len(residual), p=residual))], i
    p = p_dists[len(draft)]
    return list(draft) + [int(rng.choice(len(p), p=p))], len(draft)


class Throttle:
    """How much to draft. k: after a step that kept a of k drafts, k becomes a + 1 (or 2k when all
    were kept), within 1 .. draft_max, where drafting costs per token (a draft model's steps) or a
    pass's rows are shared (a batch's sequences) - `sizes_k`. One sequence's prompt lookup keeps k
    at draft_max: a proposal costs nothing to make, its length is its match's, and the next one
    comes from another match, so a refusal says little about it (docs/speculative.md, "Choosing the
    drafts"). And drafting is skipped for a while when a speculative step has cost more per token
    than a plain step (free text, where lookups seldom hit): the pause doubles each time it does
    not pay (up to 64 steps) and ends when it pays again. A plain step is timed every PLAIN_EVERY
    steps, so the comparison follows the cache's growing depth."""

    PLAIN_EVERY = 64

    def __init__(self, draft_max: int, adaptive: bool, sizes_k: bool = True):
        self.k, self.k_max, self.adaptive, self.sizes_k = draft_max, draft_max, adaptive, sizes_k
        self.plain_s = None   # seconds per token of a plain step (moving average)
        self.skip, self.pause, self.since_plain = 0, 1, 0

    def wants_draft(self) -> bool:
        if not self.adaptive:
            return True
        if self.plain_s is None or self.since_plain >= self.PLAIN_EVERY:
            return False
        if self.skip:
            self.skip -= 1
            return False
        return True

    def plain(self, seconds: float) -> None:
        self.since_plain = 0
        self.plain_s = seconds if self.plain_s is None else 0.8 * self.plain_s + 0.2 * seconds

    def speculated(self, seconds: float, produced: int, drafted: int, kept: int) -> None:
        self.since_plain += 1
        if not self.adaptive:
            return
        if self.sizes_k:
            self.k = min(self.k_max, 2 * self.k) if kept == drafted else max(1, kept + 1)
        if self.plain_s is not None and seconds / produced > self.plain_s:
            self.skip, self.pause = self.pause, min(64, 2 * self.pause)
        else:
            self.pause = 1


class Speculator:
    """The decode step with speculation: draft, verify in one forward pass, roll back."""

    def __init__(self, model, config: SpeculativeConfig, max_len: int, result):
        self.model, self.config, self.result = model, config, result
        draft_model = getattr(config.draft_model, "model", config.draft_model)  # an LM or its DecoderModel
        if draft_model is not None:
            check_vocabularies(model, draft_model)
            self.drafter = DraftModel(draft_model, max_len)
        else:
            self.drafter = PromptLookup(config.lookup_ngram)
        self.throttle = Throttle(config.draft_max, config.adaptive, sizes_k=draft_model is not None)

    def step(self, token: int, kv, cached: list, history: list, sampler, budget: int) -> list:
        """Feed `token` (chosen, not yet cached) and return the tokens chosen after it (at least
        one; the last not yet cached), extending `cached` with what the cache now holds.
        `budget`: tokens still wanted (a step returns no more)."""
        pos = len(cached)
        k = min(self.throttle.k, budget - 1, kv.max_len - pos - 1)
        t0 = perf.clock()
        draft, q_dists = [], []
        if k >= 1 and self.throttle.wants_draft():
            with _perf.debug("speculative::draft", "k={}", k, op="speculative"):
                if isinstance(self.drafter, DraftModel):
                    draft, q_dists = self.drafter.propose(cached + [token], k, sampler, history)
                else:
                    draft = self.drafter.propose(history, k)
                    q_dists = [None] * len(draft)
        if not draft:
            logits = self.model.forward([token], kv, pos=pos)
            cached.append(token)
            chosen = [sampler(logits, history)]
            self.throttle.plain(perf.clock() - t0)
            return chosen
        with _perf.debug("speculative::verify", "pos={} draft={}", pos, len(draft), op="speculative") as span:
            with quant.decode_rows():  # each row's matmuls its GEMV's bits, as its decode step's
                rows = self.model.forward([token] + draft, kv, pos=pos, all_logits=True)  # [k + 1, vocab]
            with span.part("accept"):
                chosen, kept = accept(rows, draft, q_dists, history, sampler)
        cached += [token] + draft[:kept]
        if kept < len(draft):
            kv.rollback(len(cached))
        if isinstance(self.drafter, DraftModel):
            self.drafter.keep(len(cached))
        self.result.drafted += len(draft)
        self.result.accepted += kept
        self.throttle.speculated(perf.clock() - t0, len(chosen), len(draft), kept)
        return chosen


def accept(rows: np.ndarray, draft: list, q_dists: list, history: list, sampler) -> tuple[list, int]:
    """(tokens chosen, drafts kept) from a verify pass's rows [len(draft) + 1, vocab]: greedy, the
    longest prefix the target agrees with and then its own choice; sampled, the rejection rule
    (accept_sampled). q_dists: the drafter's distributions (None: a point mass, prompt lookup)."""
    # row i's logits come after the first i drafts: the penalties see those too
    if sampler.config.temperature == 0.0:  # the longest prefix the target agrees with, then its own choice
        for i in range(len(draft) + 1):
            choice = sampler(rows[i], history + draft[:i])
            if i == len(draft) or choice != draft[i]:
                return draft[:i] + [choice], i
    p_dists = []
    for i in range(len(draft) + 1):
        ids, probs = sampler.distribution(sampler.penalised(rows[i], history + draft[:i]))
        p = np.zeros(rows.shape[1])
        p[ids] = probs
        p_dists.append(p)
    return accept_sampled(p_dists, draft, q_dists, sampler.rng)
