"""The library entry point: `pyml.load_model(...)` and the LanguageModel it returns."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyml.core import perf
from pyml.core.errors import ModelFormatError, PymlError, UnsupportedError
from pyml.core.runtime import RuntimeConfig
from pyml.nlp.generator import GenerationResult, Generator
from pyml.nlp.sampling import SamplingConfig

_perf = perf.get("pyml.nlp.load")
DEFAULT_MODEL = "smollm2-135m"


@dataclass
class LanguageModel:
    model: object           # a DecoderModel
    tokenizer: object       # pyml.nlp.tokenizer.Tokenizer, or None
    source: str
    load_s: float
    runtime: RuntimeConfig
    chat_template: str | None = None

    @property
    def config(self):
        return self.model.config

    def new_cache(self, max_len: int | None = None):
        return self.model.new_cache(max_len)

    def forward(self, token_ids, cache=None, all_logits: bool = False) -> np.ndarray:
        """Logits (NumPy) for token_ids appended to `cache` (a fresh one if None)."""
        if cache is None:
            cache = self.new_cache(len(token_ids))
        return self.model.forward(token_ids, cache, all_logits=all_logits)

    def encode(self, text: str) -> list:
        if self.tokenizer is None:
            raise PymlError(f"{self.source}: no tokenizer found beside the model")
        return self.tokenizer.encode(text)

    def generate(self, prompt: str | list, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int | None = None,
                 on_text=None, result: GenerationResult | None = None) -> GenerationResult:
        """Generate from a prompt (text, or token ids); `on_text(str)` streams decoded text."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        sampling = SamplingConfig(temperature, top_k, top_p, repetition_penalty, seed)
        stream = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
        pieces = []
        stop = self.tokenizer.eos_ids if self.tokenizer is not None else ()

        def on_token(tok):
            if stream is not None and tok not in stop:  # the stop token ends the text, it is not part of it
                text = stream.push(tok)
                if text:
                    pieces.append(text)
                    if on_text is not None:
                        on_text(text)

        result = result if result is not None else GenerationResult(ids)
        try:
            Generator(self.model, self.tokenizer).generate(ids, max_tokens, sampling, stop_ids=stop,
                                                           on_token=on_token, result=result)
        finally:
            if stream is not None:
                tail = stream.flush()
                if tail:
                    pieces.append(tail)
                    if on_text is not None:
                        on_text(tail)
            result.text = "".join(pieces)
        return result


def _load_safetensors(name_or_dir: str):
    from pyml.nlp import hub
    from pyml.nlp.loaders.safetensors import load_tensors, read_config
    from pyml.nlp.models import HF_ARCHITECTURES
    directory = Path(hub.resolve_safetensors(name_or_dir))
    cfg = read_config(directory)
    model_type = cfg.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise UnsupportedError(f"{directory / 'config.json'}: model_type {model_type!r} is not supported "
                               f"(supported: {', '.join(sorted(HF_ARCHITECTURES))})")
    config_cls, model_cls = HF_ARCHITECTURES[model_type]
    try:  # a config.json of the right keys but absurd values (strings, zero heads) is bad input too
        config = config_cls.from_hf(cfg, source=str(directory / "config.json"))
    except (ValueError, TypeError, ZeroDivisionError, KeyError) as e:
        raise ModelFormatError(f"{directory / 'config.json'}: {type(e).__name__}: {e}") from None
    store = load_tensors(directory)
    model = model_cls(config, store)
    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        from pyml.nlp.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_file(directory / "tokenizer.json")
    return model, tokenizer, str(directory), getattr(tokenizer, "chat_template", None)


def _load_gguf(name_or_path: str):
    from pyml.nlp import hub
    from pyml.nlp.loaders.gguf import load_gguf_model
    return load_gguf_model(Path(hub.resolve_gguf(name_or_path)))


def load_model(source: str | None = None, *, gguf: str | None = None, safetensors: str | None = None,
               threads: int | None = None, warmup: bool = True, lm_head_quant: str | None = None
               ) -> LanguageModel:
    """Load a model: `safetensors=` a directory or hub id, `gguf=` a file or short name.

    `source` alone is guessed: a directory means safetensors, anything else GGUF.
    With neither, the default model (SmolLM2-135M-Instruct) is used.
    """
    if source is not None:
        if gguf or safetensors:
            raise PymlError("pass the model once: source, gguf= or safetensors=")
        if Path(source).is_dir():
            safetensors = source
        else:
            gguf = source
    if gguf is None and safetensors is None:
        gguf = DEFAULT_MODEL
    runtime = RuntimeConfig(threads if threads is not None else RuntimeConfig().threads, warmup).apply()
    t0 = perf.clock()
    with perf.context(phase="load"), _perf.debug("model::load", "{}", gguf or safetensors, op="load"):
        if safetensors is not None:
            model, tokenizer, where, template = _load_safetensors(safetensors)
        else:
            model, tokenizer, where, template = _load_gguf(gguf)
        if lm_head_quant:
            from pyml.nlp.head import quantize_head
            quantize_head(model, lm_head_quant)
        model.pack_weights()
    load_s = perf.clock() - t0
    _perf.logger.debug("%s", model.describe())
    # Every matmul of a model runs in pyml.quant's Numba kernels; NumPy's BLAS does only the
    # attention's small batched matmuls of a prefill. With more threads its workers spin after
    # each call and take the cores from the Numba kernels (SmolLM2 Q4_1 pp128: 1.40 s -> 0.75 s).
    runtime.set_blas_threads(1)
    if warmup:
        with perf.context(phase="warmup"):
            from pyml import quant
            runtime.warmup_thread_pool(steps=[*quant.warmup_steps(), lambda: _warm_forward(model)])
    # A loaded model is millions of long-lived Python objects (Gemma's 262K-token vocabulary in
    # the metadata and tokenizer): each full collection of the cyclic GC walks them all, a 78 ms
    # pause in the middle of a 25 ms decode step. Frozen, they are never walked again.
    gc.collect()
    gc.freeze()
    return LanguageModel(model, tokenizer, where, load_s, runtime, template)


def _warm_forward(model):
    """One short prefill and one decode step: pages in the weights, compiles the kernels the
    model's real array kinds need, and starts every thread, before anything is measured."""
    cache = model.new_cache(4)
    model.forward([0, 0], cache)
    model.forward([0], cache)
