"""Generation: prefill the prompt in one forward pass, then one cached decode step per token."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pyml.core import perf
from pyml.core.errors import PymlError, was_interrupted
from pyml.nlp.sampling import Sampler, SamplingConfig

_perf = perf.get("pyml.nlp.generator")


@dataclass
class GenerationResult:
    prompt_tokens: list
    tokens: list = field(default_factory=list)     # generated ids
    text: str = ""
    prefill_s: float = 0.0
    decode_s: list = field(default_factory=list)    # seconds per decode step
    stop_reason: str = ""                           # eos | max_tokens | context | interrupted

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * float(np.mean(self.decode_s)) if self.decode_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return len(self.decode_s) / sum(self.decode_s) if self.decode_s else 0.0

    def summary(self) -> str:
        return (f"prompt {len(self.prompt_tokens)} tokens, generated {len(self.tokens)} tokens | "
                f"prefill {self.prefill_s * 1e3:.1f} ms ({self.prefill_tok_s:.1f} tok/s) | "
                f"decode {self.decode_ms_per_token:.2f} ms/token ({self.decode_tok_s:.1f} tok/s)")


class Generator:
    def __init__(self, model, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer

    def generate(self, prompt_ids, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                 stop_ids=(), on_token=None, cache=None, result: GenerationResult | None = None):
        """Generate up to `max_new_tokens` after `prompt_ids`.

        `on_token(id)` is called as each token is chosen (streaming). Stops at a
        stop id, at max_new_tokens, or when the context window is full. `result`
        may be passed in so a caller still holds the partial result after Ctrl-C.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        if max_new_tokens < 0:
            raise PymlError(f"--max-tokens must be >= 0, got {max_new_tokens}")
        if not prompt_ids:
            raise PymlError("the prompt is empty (no tokens to start from)")
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is not None and not all(0 <= t < vocab for t in prompt_ids):
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise PymlError(f"prompt token id {bad} is outside the model's vocabulary of {vocab} tokens")
        window = self.model.max_positions
        if len(prompt_ids) > window:
            raise PymlError(f"the prompt is {len(prompt_ids)} tokens, longer than the model's "
                            f"context window of {window}")
        if cache is None:
            cache = self.model.new_cache(len(prompt_ids) + max_new_tokens)
        sampler, stop_ids = Sampler(sampling), set(stop_ids)
        res = result if result is not None else GenerationResult(prompt_ids)
        res.prompt_tokens = prompt_ids
        history = list(prompt_ids)
        if max_new_tokens == 0:
            res.stop_reason = "max_tokens"
            return res

        try:
            return self._run(prompt_ids, max_new_tokens, sampler, stop_ids, on_token, cache, res, history)
        except SystemError as e:  # Ctrl-C inside a Numba call can surface as a SystemError it caused
            if was_interrupted(e):
                raise KeyboardInterrupt from None
            raise

    def _run(self, prompt_ids, max_new_tokens, sampler, stop_ids, on_token, cache, res, history):
        t0 = perf.clock()
        with perf.context(phase="prefill", step=0), \
                _perf.debug("generator::prefill", "tokens={}", len(prompt_ids), op="generator") as span:
            logits = self.model.forward(prompt_ids, cache, pos=0)
            with span.part("sample"):
                token = sampler(logits, history)
        res.prefill_s = perf.clock() - t0
        step = 0
        while True:
            res.tokens.append(token)
            history.append(token)
            if on_token is not None:
                on_token(token)
            if token in stop_ids:
                res.stop_reason = "eos"
                break
            if len(res.tokens) >= max_new_tokens:
                res.stop_reason = "max_tokens"
                break
            pos = len(history) - 1
            if pos >= cache.max_len:
                res.stop_reason = "context"
                break
            step += 1
            t0 = perf.clock()
            with perf.context(phase="decode", step=step), \
                    _perf.debug("generator::decode_step", "token={}", pos, op="generator") as span:
                with span.part("model"):
                    logits = self.model.forward([token], cache, pos=pos)
                with span.part("sample"):
                    token = sampler(logits, history)
            res.decode_s.append(perf.clock() - t0)
        return res

