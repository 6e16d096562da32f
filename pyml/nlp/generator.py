"""Generation: prefill the prompt in one forward pass, then one cached decode step per token.

`Generator.stream` yields the token ids as they are chosen; `generate` is its one consumer that
collects them. A `PromptCache` keeps a KV cache with the ids it holds, so the next prompt that
starts with them (a conversation's history) prefills only its new tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from pyml.core import perf
from pyml.core.errors import PymlError, UnsupportedError, check_text, was_interrupted
from pyml.nlp.logprobs import check_top, prompt_logprobs, token_logprob
from pyml.nlp.models.base import DecoderModel
from pyml.nlp.sampling import Sampler, SamplingConfig
from pyml.nlp.speculative import SpeculativeConfig, Speculator
from pyml.nn import KVCache

_perf = perf.get("pyml.nlp.generator")


@dataclass
class GenerationResult:
    prompt_tokens: list
    tokens: list = field(default_factory=list)     # generated ids
    text: str = ""
    prefill_s: float = 0.0                          # the engine's time: perf's drains taken out
    decode_s: list = field(default_factory=list)    # seconds per decode step, the same
    prefill_log_s: float = 0.0                      # perf's drains (records, [perf] lines, their write)
    decode_log_s: float = 0.0                       # in the prefill / the steps and the final flush
    stop_reason: str = ""                           # eos | stop | max_tokens | context | interrupted | cancelled
    cached_tokens: int = 0                          # prompt tokens whose KV came from a PromptCache
    context_shifts: int = 0                         # times the full cache dropped half its history
    drafted: int = 0                                # speculative decoding: tokens proposed, and kept
    accepted: int = 0
    logprobs: list | None = None                    # TokenLogprob per generated token, when asked for
    prompt_logprobs: list | None = None             # TokenLogprob per prompt token after the first (echo)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens that went through the prefill pass (the cached ones did not)."""
        return len(self.prompt_tokens) - self.cached_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * float(np.mean(self.decode_s)) if self.decode_s else 0.0

    @property
    def log_ms_per_token(self) -> float:
        """What making and writing the steps' records and `[perf]` lines cost, per decode step."""
        return 1e3 * self.decode_log_s / len(self.decode_s) if self.decode_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return len(self.decode_s) / sum(self.decode_s) if self.decode_s else 0.0

    def timings(self) -> dict:
        """The figures llama-server reports with each response (its `timings` object), in its
        meanings: `predicted_n` counts the tokens generated (the first, which the prefill's logits
        gave, included), `predicted_ms` is the decode steps' time after that first token, and the
        per-token figures divide it by the steps (llama-server's `n_gen - 1`)."""
        prompt_ms, predicted_ms = self.prefill_s * 1e3, sum(self.decode_s) * 1e3
        prompt_n, predicted_n = self.prefilled_tokens, len(self.tokens)
        return {
            "cache_n": self.cached_tokens,
            "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": self.prefill_tok_s,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": self.decode_ms_per_token,
            "predicted_per_second": self.decode_tok_s,
            **({"draft_n": self.drafted, "draft_n_accepted": self.accepted} if self.drafted else {}),
        }

    @property
    def acceptance(self) -> float:
        """The share of speculative drafts the target kept."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self) -> str:
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (f"prompt {len(self.prompt_tokens)} tokens{cached}, generated {len(self.tokens)} tokens | "
                f"prefill {self.prefill_s * 1e3:.1f} ms ({self.prefill_tok_s:.1f} tok/s) | "
                f"decode {self.decode_ms_per_token:.2f} ms/token ({self.decode_tok_s:.1f} tok/s)"
                + (f" | drafted {self.drafted}, accepted {self.accepted} ({100 * self.acceptance:.0f}%)"
                   if self.drafted else ""))


def reusable_prefix(held: list, prompt_ids: list) -> int:
    """How many leading prompt tokens a cache holding `held` already has, short of the last two:
    the last prompt token's logits choose the first new token, so it is run again, and the one
    before it with it, because a pass of one token is a decode step, whose attention (f32) is not
    the prefill's where that runs in bf16 (float_compute): a prompt the cache held whole would
    otherwise get other first logits than the same prompt prefilled (a batch's repeated prompt)."""
    n = 0
    for h, new in zip(held, prompt_ids[:-2]):
        if h != new:
            break
        n += 1
    return n


class PromptCache:
    """A KV cache and the token ids whose keys and values it holds, in order."""

    def __init__(self, kv: KVCache):
        self.kv, self.tokens = kv, []

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    def reusable(self, prompt_ids: list) -> int:
        """How many leading prompt tokens are already cached, short of the last two (reusable_prefix)."""
        n = reusable_prefix(self.tokens, prompt_ids)
        # a sliding-window ring may have overwritten the positions a prefill from n needs
        return n if n == 0 or self.kv.resumable(n) else 0

    def reset(self) -> None:
        self.tokens = []
        self.kv.length = 0


MAX_STOP_CHARS = 1_000_000  # per stop string: its match table costs ~0.3 s and 4 MB to build


class _StopMatcher:
    """One stop string as a Knuth-Morris-Pratt automaton fed the text a character at a time: its
    state is the longest prefix of the stop string that the text seen so far ends with. Each
    character costs amortised O(1), so a stop string of 300,000 characters costs no more per
    piece than a short one (slicing every prefix on every piece made it quadratic)."""

    def __init__(self, stop: str):
        self.stop, self.state = stop, 0
        self.fail = array("i", [0]) * len(stop)  # fail[i]: longest proper border of stop[:i + 1]
        k = 0
        for i in range(1, len(stop)):
            c = stop[i]
            while k and stop[k] != c:
                k = self.fail[k - 1]
            if stop[k] == c:
                k += 1
            self.fail[i] = k

    def feed(self, text: str) -> int:
        """Where in `text` the first whole match ends (-1 if none); the state follows the text."""
        stop, fail, k = self.stop, self.fail, self.state
        for i, c in enumerate(text):
            while k and stop[k] != c:
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
                if k == len(stop):
                    self.state = 0
                    return i
        self.state = k
        return -1


class StopStrings:
    """Ends the text at the first stop string. Text that could be the start of one is held back
    until the next pieces show it is not, so a stop string is never shown, even in part.

    Only the held text is kept (at most the longest stop string, less one character), and each
    character of the text passes each stop string's automaton once: time linear in the text.
    """

    def __init__(self, stops: Iterable[str] = ()):
        stops = [s for s in stops if s]
        for s in stops:
            check_text(s, "a stop string")
            if len(s) > MAX_STOP_CHARS:
                raise PymlError(f"a stop string of {len(s):,} characters is longer than the limit of "
                                f"{MAX_STOP_CHARS:,} ({s[:20]!r}...)")
        self.matchers = [_StopMatcher(s) for s in stops]
        self.pending, self.hit = "", False

    def push(self, text: str) -> str:
        """The part of `text` (after what was held) that can be shown now."""
        if not self.matchers:
            return text
        held_before = len(self.pending)
        self.pending += text
        # a match that ends in `text` starts inside `pending`: what came before it was held
        starts = [held_before + end - len(m.stop) + 1 for m in self.matchers if (end := m.feed(text)) >= 0]
        if starts:
            shown, self.pending, self.hit = self.pending[:min(starts)], "", True
            self._reset()
            return shown
        split = len(self.pending) - max(m.state for m in self.matchers)
        shown, self.pending = self.pending[:split], self.pending[split:]
        return shown

    def flush(self) -> str:
        """What was held back, once the text has ended without a stop string."""
        shown, self.pending = self.pending, ""
        self._reset()
        return shown

    def _reset(self) -> None:
        for m in self.matchers:
            m.state = 0


def check_prompt(model: DecoderModel, prompt_ids, max_new_tokens: int) -> list[int]:
    """The prompt as a list of ints, once it is known to be one the model can start from."""
    prompt_ids = [int(t) for t in prompt_ids]
    if max_new_tokens < 0:
        raise PymlError(f"max_tokens must be >= 0, got {max_new_tokens}")
    if not prompt_ids:
        raise PymlError("the prompt is empty (no tokens to start from)")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and not all(0 <= t < vocab for t in prompt_ids):
        bad = next(t for t in prompt_ids if not 0 <= t < vocab)
        raise PymlError(f"prompt token id {bad} is outside the model's vocabulary of {vocab} tokens")
    return prompt_ids


class Generator:
    def __init__(self, model: DecoderModel):
        self.model = model

    def generate(self, prompt_ids, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                 stop_ids=(), on_token=None, cache: KVCache | PromptCache | None = None,
                 result: GenerationResult | None = None,
                 speculative: SpeculativeConfig | None = None) -> GenerationResult:
        """Generate up to `max_new_tokens` after `prompt_ids`; `on_token(id)` sees each token chosen.

        `result` may be passed in so a caller still holds the partial result after Ctrl-C.
        """
        result = result if result is not None else GenerationResult(list(prompt_ids))
        for token in self.stream(prompt_ids, max_new_tokens, sampling, stop_ids, cache, result,
                                 speculative=speculative):
            if on_token is not None:
                on_token(token)
        return result

    def stream(self, prompt_ids, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
               stop_ids=(), cache: KVCache | PromptCache | None = None,
               result: GenerationResult | None = None, ctx_size: int | None = None,
               context_shift: bool = False, n_keep: int = 0, cancelled=None, constraint=None,
               logprobs: int | None = None, echo: bool = False,
               speculative: SpeculativeConfig | None = None) -> Iterator[int]:
        """The generated ids, one at a time, filling `result` as they come.

        Stops at a stop id, at max_new_tokens, or when the cache is full (stop reason "context").
        With `context_shift`, a full cache instead keeps its first `n_keep` tokens and drops the
        oldest half of the rest, as llama.cpp's context shift does. `ctx_size`: the positions of
        the cache made when none is given (default: prompt + max_new_tokens, within the model's
        window). The prompt is checked here, before the first token is asked for. Closing the
        iterator ends the generation; so does `cancelled()` turning true, checked before each
        decode step (stop reason "cancelled"): a server's request whose client left or ran out of time.
        `constraint` (constrained.py's Constraint): the tokens must match its grammar.
        `logprobs`: None, or how many top log-probabilities go with each generated token's own in
        `result.logprobs` (0: its own only; nlp/logprobs.py). `echo`: `result.prompt_logprobs` holds
        the prompt's tokens' log-probabilities (with `logprobs`' top); the whole prompt is prefilled
        then, none of it taken from a PromptCache: a cached position has no logits.
        `speculative`: draft and verify several tokens a step (nlp/speculative.py); the same tokens
        when greedy, the same distribution when sampling (not with a constraint, logprobs or echo:
        refused by name).
        """
        prompt_ids = check_prompt(self.model, prompt_ids, max_new_tokens)
        if ctx_size is not None and ctx_size < 1:
            raise PymlError(f"--ctx-size must be >= 1, got {ctx_size}")
        if n_keep < 0:
            raise PymlError(f"--keep must be >= 0, got {n_keep}")
        if logprobs is not None:
            check_top(logprobs)
        sampling.check_vocab(self.model.config.vocab_size)
        if cache is not None:
            window, what = cache.max_len, "the context size"
        elif ctx_size is not None:
            window, what = min(ctx_size, self.model.max_positions), "the context size"
        else:
            window, what = self.model.max_positions, "the model's context window"
        if len(prompt_ids) > window:
            raise PymlError(f"the prompt is {len(prompt_ids)} tokens, longer than {what} of {window}")
        if cache is None:
            cache = self.model.new_cache(ctx_size if ctx_size is not None else len(prompt_ids) + max_new_tokens)
        prompt_cache = cache if isinstance(cache, PromptCache) else None
        res = result if result is not None else GenerationResult(prompt_ids)
        res.prompt_tokens = prompt_ids
        res.cached_tokens = prompt_cache.reusable(prompt_ids) if prompt_cache is not None and not echo else 0
        res.logprobs = [] if logprobs is not None else None
        shift = n_keep if context_shift else None
        kv = prompt_cache.kv if prompt_cache is not None else cache
        speculator = None
        if speculative is not None:
            if constraint is not None or logprobs is not None or echo:
                raise UnsupportedError("speculative decoding is not done with a grammar/JSON schema or logprobs/echo")
            speculator = Speculator(self.model, speculative, kv.max_len, res)
        return self._run(prompt_ids, max_new_tokens, Sampler(sampling, constraint), set(stop_ids), cache, res, shift,
                         cancelled, logprobs, echo, speculator)

    def _run(self, prompt_ids, max_new_tokens, sampler, stop_ids, cache, res, n_keep, cancelled, top, echo,
             speculator=None):
        prompt_cache = cache if isinstance(cache, PromptCache) else None
        kv = prompt_cache.kv if prompt_cache is not None else cache
        if max_new_tokens == 0 and not echo:
            res.stop_reason = "max_tokens"
            return
        history = list(prompt_ids)  # every token so far: what the sampler's penalties see
        start = res.cached_tokens
        cached = list(prompt_ids[:start])  # the tokens whose keys and values the cache holds, in order
        # A top-level span's end may drain perf's buffer (records and [perf] lines, about once a
        # second): that time is not the engine's, so it is taken out of the pass and kept apart.
        drained = perf.drain_seconds
        try:
            t0, d0 = perf.clock(), drained()
            with perf.context(phase="prefill", step=0), \
                    _perf.debug("generator::prefill", "tokens={}", len(prompt_ids) - start, op="generator") as span:
                if echo:  # every position's logits, a chunk at a time
                    res.prompt_logprobs, logits = prompt_logprobs(self.model, prompt_ids, kv, top or 0)
                else:
                    logits = self.model.forward(prompt_ids[start:], kv, pos=start)
                cached = list(prompt_ids)
                if max_new_tokens == 0:  # echo alone: the prompt scored, nothing generated
                    res.stop_reason = "max_tokens"
                    return
                with span.part("sample"):
                    token = sampler(logits, history)
                if top is not None:
                    with span.part("logprobs"):
                        res.logprobs.append(token_logprob(logits, token, top))
            made = drained() - d0
            res.prefill_s, res.prefill_log_s = perf.clock() - t0 - made, res.prefill_log_s + made
            step, chosen = 0, [token]  # a speculative step chooses several
            while True:
                token = chosen.pop(0)
                res.tokens.append(token)
                history.append(token)
                yield token
                if token in stop_ids:
                    res.stop_reason = "eos"
                    break
                if len(res.tokens) >= max_new_tokens:
                    res.stop_reason = "max_tokens"
                    break
                if chosen:  # already chosen, its time already counted
                    continue
                if cancelled is not None and cancelled():
                    res.stop_reason = "cancelled"
                    break
                step += 1
                t0, d0 = perf.clock(), drained()
                if len(cached) >= kv.max_len:
                    if n_keep is None or len(cached) - min(n_keep, len(cached)) < 2:
                        res.stop_reason = "context"
                        break
                    cached = self._shift_context(kv, cached, n_keep, step)
                    res.context_shifts += 1
                pos = len(cached)
                with perf.context(phase="decode", step=step), \
                        _perf.debug("generator::decode_step", "token={}", pos, op="generator") as span:
                    if speculator is not None:
                        chosen = speculator.step(token, kv, cached, history, sampler, max_new_tokens - len(res.tokens))
                    else:
                        with span.part("model"):
                            logits = self.model.forward([token], kv, pos=pos)
                            cached.append(token)
                        with span.part("sample"):
                            chosen = [sampler(logits, history)]
                        if top is not None:
                            with span.part("logprobs"):
                                res.logprobs.append(token_logprob(logits, chosen[0], top))
                made = drained() - d0
                res.decode_s += [(perf.clock() - t0 - made) / len(chosen)] * len(chosen)  # per token chosen
                res.decode_log_s += made
        except Exception as e:  # noqa: BLE001 - Ctrl-C inside a Numba call can surface as a SystemError it
            # caused, and one inside a span's or a compile's cleanup as whatever that cleanup then raised
            if was_interrupted(e):
                raise KeyboardInterrupt from None
            raise
        finally:
            if prompt_cache is not None:
                prompt_cache.tokens = cached
            d0 = perf.drain_seconds()
            perf.flush()  # the steps' records and [perf] lines are made after them: all of them now,
            # in order, however the generation ended (its end, an error, Ctrl-C, the iterator closed)
            if res.decode_s:
                res.decode_log_s += perf.drain_seconds() - d0
            else:
                res.prefill_log_s += perf.drain_seconds() - d0

    def _shift_context(self, kv, cached: list, n_keep: int, step: int) -> list:
        """Keep the first n_keep tokens and the newer half of the rest; return the tokens now cached.

        llama.cpp rotates the kept keys to their new positions in place; here the kept tokens are
        run again (one prefill of about half the cache), which is exact for every architecture and
        cache type (GPT-2's learned positions, ring buffers, quantized caches) at the price of that
        prefill, paid once per max_len/2 generated tokens.
        """
        n_keep = min(n_keep, len(cached))
        n_discard = (len(cached) - n_keep) // 2
        kept = cached[:n_keep] + cached[n_keep + n_discard:]
        with perf.context(phase="decode", step=step), \
                _perf.debug("generator::context_shift", "kept={} dropped={}", len(kept), n_discard, op="generator"):
            kv.length = 0
            self.model.forward(kept, kv, pos=0)
        return kept
