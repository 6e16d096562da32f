"""pyml-bench --batch 1,4,16: many sequences through one model, llama-batched-bench's table.

For each batch size B: B prompts of `n_prompt` tokens prefilled in one batched pass (PP), then
`n_gen` decode steps of B rows each (TG), in a KVPool of B sequences (DecoderModel.forward_batch;
B = 1 is the one-sequence path a single generation takes). Reported: prefill tokens/s over all
sequences, decode tokens/s over all sequences and per sequence, and the aggregate decode against
B = 1's. The batch sizes take turns within each repetition (the machine is shared and noisy); the
table gives medians. With `--peers llama.cpp`, llama.cpp's batched decode runs the same test beside
each size, turn about with pyml: llama-batched-bench's method through llama-cpp-python's `llama_batch`
(a context of n_seq_max = B sequences, one batch of B x n_prompt tokens, then n_gen batches of B).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from pyml.cli.bench_engines import ggml_type
from pyml.cli.options import check_kv_memory
from pyml.core.errors import PymlError
from pyml.nlp.api import load_model
from pyml.nn.kv_cache import DEFAULT_KV_TYPE


def _one(model, B: int, n_prompt: int, n_gen: int, rng) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one repetition at batch size B."""
    pool = model.new_pool(B, n_prompt + n_gen + 1)
    prompts = [[int(t) for t in rng.integers(3, model.config.vocab_size, n_prompt)] for _ in range(B)]
    t0 = time.perf_counter()
    logits = model.forward_batch(pool, [(s, prompts[s], 0) for s in range(B)])
    t1 = time.perf_counter()
    for step in range(n_gen):
        tokens = np.argmax(logits, axis=1)
        logits = model.forward_batch(pool, [(s, [int(tokens[s])], n_prompt + step) for s in range(B)])
    return t1 - t0, time.perf_counter() - t1


class LlamaBatched:
    """llama.cpp's batched decode (llama-batched-bench's loop) through llama-cpp-python's C API."""

    def __init__(self, path: str, threads: int, kv_type: str = DEFAULT_KV_TYPE):
        import llama_cpp  # a bench extra, imported only when it is a peer
        self.ll, self.threads, self.ctx, self.size = llama_cpp, threads, None, None
        self.cache_type = ggml_type(kv_type)  # flash attention on its default (auto): on, on a CPU
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise PymlError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def _context(self, B: int, n_ctx: int):
        if self.size == (B, n_ctx):
            self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
            return
        self.close_context()
        p = self.ll.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, max(512, n_ctx), 512, B
        p.n_threads = p.n_threads_batch = self.threads
        p.kv_unified = True  # llama-server's default (one buffer over the sequences)
        p.type_k = p.type_v = self.cache_type
        self.ctx = self.ll.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise PymlError(f"llama.cpp could not make a context of {n_ctx} tokens for {B} sequences")
        self.size = (B, n_ctx)
        self.batch = self.ll.llama_batch_init(n_ctx, 0, 1)  # one for the context's life, as llama-batched-bench

    def _decode(self, rows) -> None:
        """One llama_decode of rows (sequence, token, position, wants logits)."""
        batch = self.batch
        for i, (seq, token, pos, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(rows)
        if self.ll.llama_decode(self.ctx, batch) != 0:
            raise PymlError("llama.cpp's llama_decode failed")
        self.ll.llama_synchronize(self.ctx)

    def one(self, B: int, n_prompt: int, n_gen: int, rng) -> tuple[float, float]:
        """(prefill seconds, decode seconds), as _one measures pyml's."""
        self._context(B, B * (n_prompt + n_gen + 1))
        prompts = rng.integers(3, self.n_vocab, (B, n_prompt))
        t0 = time.perf_counter()
        self._decode([(s, int(prompts[s, i]), i, i == n_prompt - 1) for s in range(B) for i in range(n_prompt)])
        t1 = time.perf_counter()
        for step in range(n_gen):  # llama-batched-bench feeds a token per sequence without sampling
            self._decode([(s, int(prompts[s, 0]), n_prompt + step, True) for s in range(B)])
        return t1 - t0, time.perf_counter() - t1

    def close_context(self):
        if self.ctx is not None:
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
        self.ctx, self.size = None, None

    def close(self):
        self.close_context()
        self.ll.llama_model_free(self.model)


SPREAD = "; after a ratio, the range of the repetitions' own ratios"


def _ratio(runs: list, base_runs: list) -> str:
    """The ratio of two medians of rates, then, over more than one repetition, the range of the
    repetitions' own ratios (each the two runs of one repetition, close in time): on a shared machine
    whose speed drifts between runs, what shows whether a line a ratio has to reach is within noise."""
    text = f"{statistics.median(runs) / statistics.median(base_runs):.2f}x"
    if len(runs) > 1:
        each = [a / b for a, b in zip(runs, base_runs)]
        text += f" ({min(each):.2f}-{max(each):.2f})"
    return text


def batch_table(models: dict, names: list, threads: int, batches: list, n_prompt: int, n_gen: int,
                reps: int, peers: tuple = (), kv_type: str = DEFAULT_KV_TYPE) -> str:
    llama = "llama.cpp" in peers
    lines = [f"pyml-bench --batch: {threads} threads, {{kv}} KV cache, PP {n_prompt} tokens a sequence, "
             f"TG {n_gen} steps (medians of {reps}{'; llama.cpp in turn with pyml' if llama else ''}"
             f"{SPREAD if reps > 1 else ''})", "",
             "| model | B | PP t/s (all sequences) | TG t/s (all sequences) | TG t/s (a sequence) | TG vs B=1 |"
             + (" llama.cpp PP t/s | llama.cpp TG t/s | pyml/llama.cpp TG |" if llama else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if llama else "")]
    used = set()
    for name in names:
        model = models[name]
        path = str(model.locate())
        lm = load_model(threads=threads, kv_type=kv_type, **{model.kind: path})
        # the largest batch's sequences all reach n_prompt + n_gen + 1 positions
        check_kv_memory(lm, n_prompt + n_gen + 1, max(batches), f"--batch {max(batches)}", "lower --batch, -p or -n",
                        "pyml-bench")
        used.add(lm.model.kv_type)  # the header says the type the pools were made of
        peer = LlamaBatched(path, threads, kv_type) if llama else None
        engines = {"pyml": lambda B, n, rng: _one(lm.model, B, n_prompt, n, rng)}
        if peer:
            engines["llama.cpp"] = lambda B, n, rng: peer.one(B, n_prompt, n, rng)
        rng = np.random.default_rng(0)
        for B in batches:  # warm: each size's kernels and first calls
            for run in engines.values():
                run(B, 2, rng)
        times = {(e, B): [] for e in engines for B in batches}
        for r in range(reps):
            for B in batches[r % len(batches):] + batches[:r % len(batches)]:
                for e in (list(engines) if r % 2 == 0 else list(engines)[::-1]):  # engines alternate
                    times[e, B].append(engines[e](B, n_gen, rng))
        if peer:
            peer.close()
        decode = {key: [key[1] * n_gen / d for _, d in runs] for key, runs in times.items()}  # a repetition each
        base = None
        for B in batches:
            rate = {e: (statistics.median(B * n_prompt / p for p, _ in times[e, B]),
                        statistics.median(decode[e, B])) for e in engines}
            pp, tg = rate["pyml"]
            base = decode["pyml", B] if B == 1 else base
            vs = "-" if base is None else "1.00x" if B == 1 else _ratio(decode["pyml", B], base)
            line = f"| {name} | {B} | {pp:.1f} | {tg:.1f} | {tg / B:.1f} | {vs} |"
            if peer:
                lpp, ltg = rate["llama.cpp"]
                line += f" {lpp:.1f} | {ltg:.1f} | {_ratio(decode['pyml', B], decode['llama.cpp', B])} |"
            lines.append(line)
    lines[0] = lines[0].replace("{kv}", "/".join(sorted(used)))
    return "\n".join(lines) + "\n"
