"""The engines pyml-bench runs side by side: pyml, and its peers on the same file and threads.

Each engine loads a model once, then `pp(tokens)` times one forward pass over a prompt and
`tg(first, n)` n single-token decode steps (as llama-bench: a token per step, no sampling),
both in seconds. The peers' packages are bench extras, imported only when asked for.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pyml.cli.bench_models import BenchModel
from pyml.core.errors import PymlError
from pyml.nlp.api import load_model


class PymlEngine:
    name = "pyml"

    def __init__(self, model: BenchModel, path: Path, threads: int):
        self.lm = load_model(threads=threads, warmup=True, **{model.kind: str(path)})
        self.vocab = self.lm.model.lm_head.out_features

    def pp(self, tokens) -> float:
        cache = self.lm.new_cache(len(tokens))
        t0 = time.perf_counter()
        self.lm.model.forward(tokens, cache)
        return time.perf_counter() - t0

    def tg(self, first: int, n: int) -> float:
        cache, forward = self.lm.new_cache(n + 1), self.lm.model.forward
        token = int(np.argmax(forward([first], cache)))
        t0 = time.perf_counter()
        for _ in range(n):
            token = int(np.argmax(forward([token], cache)))
        return time.perf_counter() - t0

    def close(self):
        self.lm = None


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, model: BenchModel, path: Path, threads: int):
        if model.kind != "gguf":
            raise PymlError("llama.cpp runs GGUF files only")
        from llama_cpp import Llama  # a bench extra, imported only when it is a peer
        self.llm = Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512,
                         verbose=False)
        self.vocab = self.llm.n_vocab()

    def pp(self, tokens) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(list(tokens))
        return time.perf_counter() - t0

    def tg(self, first: int, n: int) -> float:
        self.llm.reset()
        self.llm.eval([first])
        t0 = time.perf_counter()
        for _ in range(n):
            self.llm.eval([first])  # llama-bench feeds a token per step without sampling
        return time.perf_counter() - t0

    def close(self):
        self.llm.close() if hasattr(self.llm, "close") else None
        self.llm = None


class TransformersEngine:
    name = "transformers"

    def __init__(self, model: BenchModel, path: Path, threads: int):
        import torch  # a test/bench extra (~1.5 s to import), imported only when it is a peer
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(threads)
        self.torch = torch
        if model.kind == "gguf":
            self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        self.model.eval()
        self.vocab = self.model.config.get_text_config().vocab_size

    def pp(self, tokens) -> float:
        with self.torch.inference_mode():
            ids = self.torch.tensor([list(tokens)])
            t0 = time.perf_counter()
            self.model(ids)
            return time.perf_counter() - t0

    def tg(self, first: int, n: int) -> float:
        torch = self.torch
        with torch.inference_mode():
            out = self.model(torch.tensor([[first]]), use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(n):
                out = self.model(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return time.perf_counter() - t0

    def close(self):
        self.model = None


ENGINES = {"pyml": PymlEngine, "llama.cpp": LlamaCppEngine, "transformers": TransformersEngine}
