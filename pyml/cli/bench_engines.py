"""The engines pyml-bench runs side by side: pyml, and its peers on the same file and threads.

Each engine loads a model once. `set_context(tokens, room)` fills a cache with a context of
`depth` tokens (untimed; in 512-token batches, as llama.cpp's default micro-batch) and leaves
`room` positions after it; then `pp(tokens)` times one forward pass over a prompt and
`tg(first, n)` n single-token decode steps (as llama-bench: a token per step, no sampling), both
in seconds, each starting again right after the context (the cache is rewound, not refilled).
The peers' packages are bench extras, imported only when asked for.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from pyml.cli.bench_models import BenchModel
from pyml.cli.bench_openvino import exported
from pyml.core.errors import PymlError
from pyml.nlp.api import load_model
from pyml.nn.kv_cache import DEFAULT_KV_TYPE

UBATCH = 512  # tokens per forward pass while filling a context (llama.cpp's default micro-batch)


class PymlEngine:
    name = "pyml"

    def __init__(self, model: BenchModel, path: Path, threads: int, float_compute: str = "auto",
                 kv_type: str = DEFAULT_KV_TYPE):
        self.lm = load_model(threads=threads, warmup=True, float_compute=float_compute, kv_type=kv_type,
                             **{model.kind: str(path)})
        self.lm.warm_up(prefill=True)  # pp calls the model itself: its kernels load here, not in a timed pass
        self.vocab = self.lm.model.lm_head.out_features
        self.set_context([], 2048)
        # float weights: what the prefill GEMMs compute in ("bf16" or "f32"; --float-compute)
        self.compute = ""
        if model.float_weights:
            self.compute = "f32" if self.lm.model.linears()[0].prefill_weight is None else "bf16"

    def set_context(self, tokens, room: int):
        self.cache = self.lm.new_cache(len(tokens) + room)
        for i in range(0, len(tokens), UBATCH):
            self.lm.model.forward(tokens[i:i + UBATCH], self.cache)
        self.context = self.cache.snapshot()

    def pp(self, tokens) -> float:
        self.cache.restore(self.context)
        t0 = time.perf_counter()
        self.lm.model.forward(tokens, self.cache)
        return time.perf_counter() - t0

    def tg(self, first: int, n: int) -> float:
        self.cache.restore(self.context)
        forward = self.lm.model.forward
        token = int(np.argmax(forward([first], self.cache)))
        t0 = time.perf_counter()
        for _ in range(n):
            token = int(np.argmax(forward([token], self.cache)))
        return time.perf_counter() - t0

    def close(self):
        self.lm = None


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python, its defaults (f16 KV cache, batch 512); `flash_attn` as
    llama-bench's -fa 1 (the faster setting at depth on CPU, so it is measured too)."""
    name = "llama.cpp"
    flash_attn = False

    def __init__(self, model: BenchModel, path: Path, threads: int, kv_type: str = DEFAULT_KV_TYPE):
        if model.kind != "gguf":
            raise PymlError("llama.cpp runs GGUF files only")
        if kv_type == "q8_0" and not self.flash_attn:
            raise PymlError("llama.cpp quantizes its V cache only with flash attention: --peers llama.cpp-fa")
        self.path, self.threads, self.kv_type = path, threads, kv_type
        self.llm, self.n_ctx = None, 0
        self.set_context([], 2048)
        self.vocab = self.llm.n_vocab()

    def set_context(self, tokens, room: int):
        n_ctx = len(tokens) + room
        if n_ctx > self.n_ctx:  # the context size is fixed when llama.cpp makes its context
            from llama_cpp import Llama  # a bench extra, imported only when it is a peer
            self.close()
            cache = ggml_type(self.kv_type)
            self.llm = Llama(str(self.path), n_threads=self.threads, n_threads_batch=self.threads, n_ctx=n_ctx,
                             n_batch=2048, n_ubatch=UBATCH, flash_attn=self.flash_attn, type_k=cache,
                             type_v=cache, verbose=False)
            self.n_ctx = n_ctx
        self.llm.reset()
        self.llm.eval(list(tokens))
        self.depth = len(tokens)

    def pp(self, tokens) -> float:
        self.llm.n_tokens = self.depth  # eval drops the cache after n_tokens first
        t0 = time.perf_counter()
        self.llm.eval(list(tokens))
        return time.perf_counter() - t0

    def tg(self, first: int, n: int) -> float:
        self.llm.n_tokens = self.depth
        self.llm.eval([first])
        t0 = time.perf_counter()
        for _ in range(n):
            self.llm.eval([first])  # llama-bench feeds a token per step without sampling
        return time.perf_counter() - t0

    def close(self):
        if self.llm is not None and hasattr(self.llm, "close"):
            self.llm.close()
        self.llm = None


class LlamaCppFlashEngine(LlamaCppEngine):
    name = "llama.cpp-fa"
    flash_attn = True


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
        self.context = []

    def set_context(self, tokens, room: int):
        self.context = list(tokens)

    def _past(self):  # transformers' caches grow in place: a fresh one for every timed run
        if not self.context:
            return None
        with self.torch.inference_mode():
            return self.model(self.torch.tensor([self.context]), use_cache=True).past_key_values

    def pp(self, tokens) -> float:
        past = self._past()
        with self.torch.inference_mode():
            ids = self.torch.tensor([list(tokens)])
            t0 = time.perf_counter()
            self.model(ids, past_key_values=past, use_cache=past is not None)
            return time.perf_counter() - t0

    def tg(self, first: int, n: int) -> float:
        torch = self.torch
        past = self._past()
        with torch.inference_mode():
            out = self.model(torch.tensor([[first]]), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(n):
                out = self.model(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return time.perf_counter() - t0

    def close(self):
        self.model = None


class OpenVINOEngine:
    """OpenVINO GenAI's LLMPipeline on the CPU plugin, on the same weights exported at the matching
    precision (cli/bench_openvino.py), token ids in. A prompt's time is its time to first token with
    one new token; decode its time per output token. The pipeline keeps no cache between calls,
    so only depth 0 is measured."""
    name = "openvino"
    supports_depth = False

    def __init__(self, model: BenchModel, path: Path, threads: int):
        import openvino  # a bench extra, imported only when it is a peer
        import openvino_genai
        ir = exported(path, model.quant)
        self.ov, self.genai = openvino, openvino_genai
        self.pipe = openvino_genai.LLMPipeline(str(ir), "CPU", INFERENCE_NUM_THREADS=threads)
        self.vocab = int(json.loads((ir / "config.json").read_text())["vocab_size"])
        # float weights: what the CPU plugin computes in ("bf16" where the CPU has AVX-512 BF16 or
        # AMX, else "f32"), the peak its rows are a share of
        self.compute = ""
        if model.float_weights:
            self.compute = openvino.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string()

    def set_context(self, tokens, room: int):
        if tokens:
            raise PymlError("openvino: a context already in the cache is not measured (depth 0 only)")

    def _generate(self, tokens, n_new: int):
        ids = np.asarray([tokens], np.int64)
        inputs = self.genai.TokenizedInputs(self.ov.Tensor(ids), self.ov.Tensor(np.ones_like(ids)))
        config = self.genai.GenerationConfig(max_new_tokens=n_new, min_new_tokens=n_new, ignore_eos=True)
        return self.pipe.generate(inputs, config).perf_metrics

    def pp(self, tokens) -> float:
        return self._generate(list(tokens), 1).get_ttft().mean / 1e3

    def tg(self, first: int, n: int) -> float:
        return self._generate([first], n + 1).get_tpot().mean * n / 1e3

    def close(self):
        self.pipe = None


def ggml_type(kv_type: str) -> int:
    """llama.cpp's id of a KV cache type (ggml_type: f32 0, f16 1, q8_0 8)."""
    import llama_cpp  # a bench extra, imported only when it is a peer
    return {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[kv_type]


KV_PEERS = ("llama.cpp", "llama.cpp-fa")  # the peers whose KV cache type --kv-type sets

ENGINES = {"pyml": PymlEngine, "llama.cpp": LlamaCppEngine, "llama.cpp-fa": LlamaCppFlashEngine,
           "transformers": TransformersEngine, "openvino": OpenVINOEngine}
