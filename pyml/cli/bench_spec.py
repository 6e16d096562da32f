"""pyml-bench --spec: decode tokens/s with prompt-lookup speculative decoding against plain decoding.

Three chat prompts - summarise a text, edit code (both mostly copied from the prompt, where lookups
hit) and free chat (where they seldom do: adaptive k must back off) - each generated greedily with
and without `--lookup-ngram`, the two turn about within every repetition (the machine is shared and
noisy); the table gives medians of decode tok/s, their ratio, the acceptance rate, and whether the
tokens were identical (they must be: greedy speculation changes nothing but the speed).
"""

from __future__ import annotations

import statistics

from pyml.nlp.api import load_model
from pyml.nlp.speculative import MAX_DRAFT, SpeculativeConfig

CODE = ("def area(radius):\n    return 3.14159 * radius * radius\n\n\n"
        "def perimeter(radius):\n    return 2 * 3.14159 * radius\n\n\n"
        "def describe(radius):\n    print('area', area(radius))\n    print('perimeter', perimeter(radius))\n")
TEXT = ("The lighthouse at Point Reyes was built in 1870. Its first-order Fresnel lens, made in France, "
        "has 24 panels and weighs over two tons. For more than a century keepers climbed 300 steps each "
        "night to wind the clockwork that turned it. Fog is so common on the headland that the station "
        "once logged 2,000 hours of it in a single year, and the foghorn sounded for days on end. "
        "The light was automated in 1975 and the lens now turns only for visitors.")
PROMPTS = {
    "summarise-text": "Summarise this text in a few sentences:\n\n" + TEXT,
    "edit-code": "Rename the parameter radius to r in this code and show the whole code:\n\n" + CODE,
    "free-chat": "What should I pack for a week of hiking in the mountains?",
}


def _decode_tok_s(res) -> float:
    return len(res.decode_s) / sum(res.decode_s) if res.decode_s else 0.0


def spec_table(models: dict, names: list, threads: int, n_gen: int, reps: int, ngram: int = 4,
               draft_max: int = MAX_DRAFT) -> str:
    lines = [f"## Speculative decoding: prompt lookup (--lookup-ngram {ngram} --draft-max {draft_max}, adaptive k) "
             f"vs plain, greedy, {n_gen} tokens, {threads} threads, median of {reps} alternating runs\n",
             "| model | prompt | plain tok/s | lookup tok/s | speed-up | accepted / drafted | identical |",
             "|---|---|---:|---:|---:|---:|:---:|"]
    spec = SpeculativeConfig(lookup_ngram=ngram, draft_max=draft_max)
    for name in names:
        lm = load_model(gguf=str(models[name].locate()), threads=threads)
        for label, text in PROMPTS.items():
            prompt = lm.chat_prompt([{"role": "user", "content": text}])
            plain_s, spec_s, same, drafted, accepted = [], [], True, 0, 0
            for rep in range(reps):
                runs = [None, spec] if rep % 2 == 0 else [spec, None]  # who goes first alternates
                for speculative in runs:
                    res = lm.generate(prompt, n_gen, speculative=speculative, stop=())
                    if speculative is None:
                        plain_s.append(_decode_tok_s(res))
                        plain_tokens = res.tokens
                    else:
                        spec_s.append(_decode_tok_s(res))
                        spec_tokens, drafted, accepted = res.tokens, drafted + res.drafted, accepted + res.accepted
                same = same and spec_tokens == plain_tokens
            p, s = statistics.median(plain_s), statistics.median(spec_s)
            lines.append(f"| {name} | {label} | {p:.1f} | {s:.1f} | {s / p:.2f}x | {accepted} / {drafted} | "
                         f"{'yes' if same else 'NO'} |")
    return "\n".join(lines) + "\n"
