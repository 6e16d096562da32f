"""pyml-bench --batch 1,4,16: many sequences through one model, llama-batched-bench's table.

For each batch size B: B prompts of `n_prompt` tokens prefilled in one batched pass (PP), then
`n_gen` decode steps of B rows each (TG), in a KVPool of B sequences (DecoderModel.forward_batch;
B = 1 is the one-sequence path a single generation takes). Reported: prefill tokens/s over all
sequences, decode tokens/s over all sequences and per sequence, and the aggregate decode against
B = 1's. The batch sizes take turns within each repetition (the machine is shared and noisy); the
table gives medians.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from pyml.nlp.api import load_model


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


def batch_table(models: dict, names: list, threads: int, batches: list, n_prompt: int, n_gen: int,
                reps: int) -> str:
    lines = [f"pyml-bench --batch: {threads} threads, PP {n_prompt} tokens a sequence, TG {n_gen} steps "
             f"(medians of {reps})", "",
             "| model | B | PP t/s (all sequences) | TG t/s (all sequences) | TG t/s (a sequence) | TG vs B=1 |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in names:
        model = models[name]
        lm = load_model(threads=threads, **{model.kind: str(model.locate())})
        rng = np.random.default_rng(0)
        for B in batches:  # warm: each size's kernels and first calls
            _one(lm.model, B, n_prompt, 2, rng)
        times = {B: [] for B in batches}
        for r in range(reps):
            for B in batches[r % len(batches):] + batches[:r % len(batches)]:
                times[B].append(_one(lm.model, B, n_prompt, n_gen, rng))
        base = None
        for B in batches:
            pp = statistics.median(B * n_prompt / p for p, _ in times[B])
            tg = statistics.median(B * n_gen / d for _, d in times[B])
            base = tg if B == 1 else base
            vs = f"{tg / base:.2f}x" if base else "-"
            lines.append(f"| {name} | {B} | {pp:.1f} | {tg:.1f} | {tg / B:.1f} | {vs} |")
    return "\n".join(lines) + "\n"
