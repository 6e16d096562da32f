"""pyml-bench --spec: decode tokens/s with prompt-lookup speculative decoding against plain decoding.

Three chat prompts - summarise a text, edit code (both mostly copied from the prompt, where lookups
hit) and free chat (where they seldom do: adaptive k must back off) - each generated greedily with
and without `--lookup-ngram`, the two turn about within every repetition (the machine is shared and
noisy); the table gives medians of decode tok/s, their ratio, the acceptance rate, and whether the
tokens were identical (they must be: greedy speculation changes nothing but the speed).
"""

from __future__ import annotations

import statistics
import time

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


class LlamaCppLookup:
    """llama.cpp beside pyml: the same file through llama-cpp-python, plain and with its prompt-lookup
    drafter (LlamaPromptLookupDecoding: the newest max_ngram_size tokens matched in the prompt and the
    text so far, num_pred_tokens drafted, verified in one llama_decode; its loop is Python, as pyml's).
    Decode tok/s from the streamed tokens' times after the first (the first waits for the prefill)."""

    def __init__(self, path: str, threads: int, ngram: int, draft_max: int):
        from llama_cpp import Llama  # a bench extra, imported only when it is a peer
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        common = dict(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
        self.plain = Llama(**common)
        self.lookup = Llama(**common, draft_model=LlamaPromptLookupDecoding(max_ngram_size=ngram,
                                                                              num_pred_tokens=draft_max))

    @staticmethod
    def _run(llm, prompt: str, n_gen: int) -> tuple[float, str]:
        stamps, text = [], []
        for chunk in llm.create_completion(prompt, max_tokens=n_gen, temperature=0.0, stream=True):
            stamps.append(time.perf_counter())
            text.append(chunk["choices"][0]["text"])
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
        return rate, "".join(text)

    def rates(self, prompt: str, n_gen: int, reps: int) -> tuple[float, float, bool]:
        """(plain tok/s, lookup tok/s: medians of reps alternating runs, whether the texts were the same)."""
        plain, lookup, same = [], [], True
        for rep in range(reps):
            order = [False, True] if rep % 2 == 0 else [True, False]
            for speculative in order:
                self.plain.reset()
                self.lookup.reset()
                rate, text = self._run(self.lookup if speculative else self.plain, prompt, n_gen)
                (lookup if speculative else plain).append(rate)
                if speculative:
                    spec_text = text
                else:
                    plain_text = text
            same = same and spec_text == plain_text
        return statistics.median(plain), statistics.median(lookup), same


def spec_table(models: dict, names: list, threads: int, n_gen: int, reps: int, ngram: int = 4,
               draft_max: int = MAX_DRAFT, peers: tuple = (), draft: str | None = None) -> str:
    """The table; with `draft` (a name of `models`), that model drafts instead of prompt lookup."""
    peer = "llama.cpp" in peers
    how = (f"a draft model ({draft}, --draft-max {draft_max}, adaptive k)" if draft else
           f"prompt lookup (--lookup-ngram {ngram} --draft-max {draft_max}, paused while it does not pay)")
    kind = "draft" if draft else "lookup"
    lines = [f"## Speculative decoding: {how} vs plain, greedy, {n_gen} tokens, {threads} threads, median of "
             f"{reps} alternating runs\n",
             f"| model | prompt | plain tok/s | {kind} tok/s | speed-up | accepted / drafted | identical |"
             + (" llama.cpp plain | llama.cpp lookup | its speed-up | its identical |" if peer else ""),
             "|---|---|---:|---:|---:|---:|:---:|" + ("---:|---:|---:|:---:|" if peer else "")]
    drafter = load_model(gguf=str(models[draft].locate()), threads=threads) if draft else None
    spec = (SpeculativeConfig(draft_model=drafter, draft_max=draft_max) if draft else
            SpeculativeConfig(lookup_ngram=ngram, draft_max=draft_max))
    for name in names:
        path = str(models[name].locate())
        lm = load_model(gguf=path, threads=threads)
        other = LlamaCppLookup(path, threads, ngram, draft_max) if peer else None
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
            row = (f"| {name} | {label} | {p:.1f} | {s:.1f} | {s / p:.2f}x | {accepted} / {drafted} | "
                   f"{'yes' if same else 'NO'} |")
            if other is not None:
                lp, ls, lsame = other.rates(prompt, n_gen, reps)
                row += f" {lp:.1f} | {ls:.1f} | {ls / lp:.2f}x | {'yes' if lsame else 'NO'} |"
            lines.append(row)
    return "\n".join(lines) + "\n"
