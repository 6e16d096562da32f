"""--float-compute f32 / bf16 against transformers float32 on the real SmolLM2 F16 and F32 files.

    python -m tests.nlp.float_compute_accuracy [--prompts 4] [--tokens 32]

For each file and mode: the last-token logits of each prompt (max |diff| over the logit range,
top-1 agreement, and the rank transformers gives pyml's top token) and the greedy continuation of
`--tokens` tokens (how many leading tokens equal transformers' greedy ones). The KV cache is f32,
so the float compute is the only difference from the oracle's float32 arithmetic; decode steps
(T == 1) stream the stored weights in either mode, so a continuation differs only through what the
prefill left in the cache. Prints one Markdown table (docs/performance-journal.md, "--float-compute bf16").
"""

from __future__ import annotations

import argparse

import numpy as np

import pyml
from pyml.cli.pyml_quantize import requantized
from pyml.nlp.loaders import hub
from tests.conftest import hf_gguf_model, hf_logits
from tests.nlp.test_llama import PROMPTS

LONG = ("In the beginning of the nineteenth century, the city had grown along the river, and its "
        "merchants traded grain, wool and timber with the towns upstream. ") * 6


def greedy_hf(hf, ids: list, n: int) -> list:
    import torch
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    source = hub.resolve_gguf("smollm2-135m", quiet=True)
    prompts = PROMPTS + [LONG]
    print("| file | --float-compute | max abs logit diff / logit range (last token, per prompt) | top-1 same "
          "| greedy tokens equal to transformers' (of %d, per prompt) |" % args.tokens)
    print("|---|---|---|---|---|")
    for kind in ("f16", "f32"):
        path = requantized(source, kind)
        hf = hf_gguf_model(path)
        ref_logits, ref_tokens = [], []
        lm_any = pyml.load_model(gguf=str(path), warmup=False, float_compute="f32", kv_type="f32")
        encoded = [lm_any.encode(p) for p in prompts]
        for ids in encoded:
            ref_logits.append(hf_logits(hf, ids)[-1])
            ref_tokens.append(greedy_hf(hf, ids, args.tokens))
        for mode in ("f32", "bf16"):
            lm = pyml.load_model(gguf=str(path), warmup=False, float_compute=mode, kv_type="f32")
            errs, same, equal = [], 0, []
            for ids, ref, toks in zip(encoded, ref_logits, ref_tokens):
                got = lm.forward(ids)
                errs.append(float(np.abs(got - ref).max() / (ref.max() - ref.min())))
                same += int(got.argmax() == ref.argmax())
                gen = lm.generate(ids, max_tokens=args.tokens, temperature=0).tokens
                equal.append(next((i for i, (a, b) in enumerate(zip(gen, toks)) if a != b), min(len(gen), len(toks))))
            print(f"| {kind.upper()} | {mode} | {', '.join(f'{e:.2e}' for e in errs)} | {same}/{len(prompts)} "
                  f"| {', '.join(map(str, equal))} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
