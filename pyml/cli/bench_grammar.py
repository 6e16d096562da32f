"""The structured-output measurements of docs/structured-output.md, one command each.

    python -m pyml.cli.bench_grammar engines MODEL.gguf [xgrammar,llguidance,outlines-core]
        per grammar engine: vocabulary setup, schema compile, per-token mask time over a
        valid instance of a nested schema (objects, arrays, enums, $ref), on MODEL's tokenizer
    python -m pyml.cli.bench_grammar step MODEL.gguf [rounds]
        decode ms/token with and without a JSON schema (alternating rounds, medians), and the
        mask's own cost per step (mask + apply + advance, replayed on the tokens generated)

xgrammar and outlines-core are not pyml dependencies: install them to compare (pip install
xgrammar outlines-core); the engines command skips any that is missing.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time

import numpy as np

from pyml.nlp.api import build_gguf, load_model
from pyml.nlp.constrained import Constraint, schema_grammar

SCHEMA = {
    "$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "country": {"enum": ["FR", "DE", "US", "JP"]}},
        "required": ["street", "city", "country"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "home": {"$ref": "#/$defs/address"},
        "offices": {"type": "array", "items": {"$ref": "#/$defs/address"}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "number"}}},
    "required": ["name", "age", "role", "home", "offices", "tags", "scores"],
    "additionalProperties": False}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "role": "admin",
            "home": {"street": "12 St James's Square", "city": "London", "country": "US"},
            "offices": [{"street": "1 Rue de Rivoli", "city": "Paris", "country": "FR"},
                        {"street": "Unter den Linden 5", "city": "Berlin", "country": "DE"}],
            "tags": ["math", "engines", "poetry"], "scores": [3.5, 99, -1.25]}


def _bit(bits: np.ndarray, token: int) -> bool:
    return bool((bits.reshape(-1)[token >> 5] >> (token & 31)) & 1)


def _llguidance(tok, vocab, eos):
    def compile_schema():
        c = Constraint(tok, schema_grammar(SCHEMA))
        return lambda: (c.matcher.unsafe_compute_mask_ptr(c.bits.ctypes.data, c.bits.nbytes), c.bits)[1], c.accept
    compile_schema()  # the vocabulary, built once per tokenizer
    return compile_schema


def _xgrammar(tok, vocab, eos):
    # an optional peer: imported only when it is measured
    import xgrammar as xgr
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_schema():
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                  separators=(",", ":")))
        bitmask = xgr.allocate_token_bitmask(1, len(vocab))
        return lambda: (matcher.fill_next_token_bitmask(bitmask), bitmask.numpy())[1], matcher.accept_token
    return compile_schema


def _outlines_core(tok, vocab, eos):
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    by_bytes: dict = {}
    for i, b in enumerate(vocab):
        if i not in eos and b:
            by_bytes.setdefault(b, []).append(i)
    vocabulary = outlines_core.Vocabulary(eos[0], by_bytes)

    def compile_schema():
        guide = outlines_core.Guide(outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""),
                                                        vocabulary))
        bits = np.zeros((len(vocab) + 31) // 32, dtype=np.int32)
        return lambda: (guide.write_mask_into(bits.ctypes.data, bits.size, 4), bits)[1], guide.advance
    return compile_schema


ENGINES = {"llguidance": ("llguidance", _llguidance), "xgrammar": ("xgrammar", _xgrammar),
           "outlines-core": ("outlines_core", _outlines_core)}


def engines(path: str, names: list) -> None:
    tok = build_gguf(path).tokenizer
    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    eos = sorted(tok.eos_ids)
    ids = tok.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)
    print(f"# {path}: vocabulary {len(vocab)}, instance {len(ids)} tokens")
    print("| engine | vocabulary setup ms | schema compile ms | mask median us | p90 us | max us |")
    print("|---|---|---|---|---|---|")
    for name in names:
        module, setup = ENGINES[name]
        if importlib.util.find_spec(module) is None:
            print(f"| {name} | not installed | | | | |")
            continue
        t0 = time.perf_counter()
        compile_schema = setup(tok, vocab, eos)
        t1 = time.perf_counter()
        mask, accept = compile_schema()
        t2 = time.perf_counter()
        times = []
        for token in ids + [None]:
            s = time.perf_counter()
            bits = mask()
            times.append(time.perf_counter() - s)
            assert token is None or _bit(bits, token), (name, token, vocab[token])
            if token is not None:
                accept(token)
        assert any(_bit(bits, e) for e in eos), name
        us = np.array(times) * 1e6
        print(f"| {name} | {1e3 * (t1 - t0):.0f} | {1e3 * (t2 - t1):.1f} | {np.median(us):.0f} | "
              f"{np.percentile(us, 90):.0f} | {us.max():.0f} |")


def step(path: str, rounds: int) -> None:
    lm = load_model(gguf=path)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "city", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 24}, "city": {"type": "string", "maxLength": 24},
                             "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 6}}}
    prompt = lm.chat_prompt([{"role": "user", "content": "Describe a person as JSON."}])
    free, shaped, generated = [], [], []
    for r in range(rounds):  # alternating, so a change of machine load falls on both alike
        b = lm.generate(prompt, 48, json_schema=schema, temperature=1.0, seed=r)
        a = lm.generate(prompt, len(b.tokens), temperature=1.0, seed=r)  # as many steps, at the same positions
        free.append(a.decode_ms_per_token)
        shaped.append(b.decode_ms_per_token)
        generated.append(b.tokens)
        print(f"round {r}: {len(b.tokens)} tokens with the schema, {len(a.tokens)} free; "
              f"ms/token free {free[-1]:.2f}, with the schema {shaped[-1]:.2f}", flush=True)
    # the controlled view: the forward pass alone on the generated tokens, with and without the
    # mask's work between steps (alternating), and the mask's own cost
    mask_ms, forward_ms = [], {True: [], False: []}
    ids = lm.encode(prompt)
    for r, tokens in enumerate(generated * 2):
        masked = r % 2 == 1
        cache = lm.new_cache(len(ids) + len(tokens) + 1)
        lm.model.forward(ids, cache, pos=0)
        c = Constraint(lm.tokenizer, schema_grammar(schema)) if masked else None
        for pos, t in enumerate(tokens, start=len(ids)):
            s = time.perf_counter()
            logits = lm.model.forward([t], cache, pos=pos)
            forward_ms[masked].append(1e3 * (time.perf_counter() - s))
            if c is not None:
                s = time.perf_counter()
                c.apply(logits)
                c.accept(t)
                mask_ms.append(1e3 * (time.perf_counter() - s))
    f, g, m = statistics.median(free), statistics.median(shaped), statistics.median(mask_ms)
    print(f"decode ms/token, median of {rounds} alternating rounds: free {f:.2f}, with the schema {g:.2f} "
          f"({100 * (g / f - 1):+.1f}%)")
    fw, fm = statistics.median(forward_ms[False]), statistics.median(forward_ms[True])
    print(f"forward pass alone, median: {fw:.2f} ms, with the mask's work between steps {fm:.2f} ms")
    print(f"mask + apply + advance per step: median {m:.3f} ms, p90 {np.percentile(mask_ms, 90):.3f} ms "
          f"({100 * m / fw:.1f}% of a forward pass)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in ("engines", "step"):
        print(__doc__)
        return 2
    if argv[0] == "engines":
        engines(argv[1], (argv[2] if len(argv) > 2 else "llguidance,xgrammar,outlines-core").split(","))
    else:
        step(argv[1], int(argv[2]) if len(argv) > 2 else 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
