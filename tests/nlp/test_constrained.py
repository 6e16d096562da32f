"""Constrained decoding (pyml/nlp/constrained.py) on the real tokenizers of SmolLM2 (49K tokens)
and Gemma 3 (262K).

Oracles: the allowed set of a small grammar is worked out here from each token's bytes, by hand
(a token is allowed iff its bytes continue one of the grammar's strings); generated JSON is checked
by the jsonschema library, never by the engine that made it."""

import json
import re

import jsonschema
import numpy as np
import pytest

from pyml.core.errors import PymlError
from pyml.nlp.api import build_gguf, load_model
from pyml.nlp.constrained import Constraint, schema_grammar, text_grammar
from pyml.nlp.sampling import Sampler, SamplingConfig

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
          "$defs": {"day": {"enum": ["mon", "tue", "wed"]}},
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "days": {"type": "array", "items": {"$ref": "#/$defs/day"}, "minItems": 1, "maxItems": 3}}}
WORDS = ("yes", "no", "maybe")


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(gguf=str(smollm2_gguf), threads=1)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_the_mask_is_exactly_the_tokens_that_continue_the_grammar(which, request):
    """Each step's allowed tokens are those whose bytes can continue the grammar's text: the oracle
    matches every token's bytes with Python's re. (Where the grammar forces the next bytes,
    llguidance allows only their canonical tokens, so the grammars here never force any.)"""
    tok = build_gguf(request.getfixturevalue(f"{which}_gguf"), with_tokenizer=True).tokenizer
    pieces = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    plain = [i for i in range(tok.vocab_size) if pieces[i] and not tok.is_special(i)]

    def allowed_by(pattern) -> set:
        return {i for i in plain if re.fullmatch(pattern, pieces[i])}

    words = Constraint(tok, text_grammar('root ::= "yes" | "no" | "maybe"'))
    assert set(np.flatnonzero(words.allowed()).tolist()) == allowed_by(rb"y(e(s)?)?|no?|m(a(y(b(e)?)?)?)?")

    c = Constraint(tok, text_grammar('root ::= [a-c]+ "."'))
    assert set(np.flatnonzero(c.allowed()).tolist()) == allowed_by(rb"[a-c]+\.?")
    c.accept(tok.encode("a", add_special_tokens=False)[0])
    assert set(np.flatnonzero(c.allowed()).tolist()) == allowed_by(rb"[a-c]*\.?")
    c.accept(pieces.index(b"."))
    assert set(np.flatnonzero(c.allowed()).tolist()) == set(tok.eos_ids)
    assert c.complete


def test_generate_with_a_json_schema_validates_at_temperature_1(smollm2):
    prompt = smollm2.chat_prompt([{"role": "user", "content": "Plan a trip as JSON."}])
    for seed in range(4):
        r = smollm2.generate(prompt, 60, json_schema=SCHEMA, temperature=1.0, top_k=50, min_p=0.05, seed=seed)
        assert r.stop_reason == "eos", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_generate_with_a_gbnf_grammar(smollm2):
    r = smollm2.generate("Pick:", 8, grammar='root ::= ("red" | "blue") "!"', temperature=1.0, seed=0)
    assert r.text in ("red!", "blue!") and r.stop_reason == "eos"
    lark = smollm2.generate("Pick:", 8, grammar='start: "up" | "down"', temperature=0)
    assert lark.text in ("up", "down")


def test_no_constraint_leaves_greedy_decoding_unchanged(smollm2):
    """The hook is off without a constraint: the same tokens as a sampler without one."""
    free = smollm2.generate("The capital of France is", 8)
    logits = smollm2.forward(smollm2.encode("The capital of France is"))
    assert free.tokens[0] == Sampler(SamplingConfig())(logits) == int(np.argmax(logits))


@pytest.mark.parametrize("bad, said", [
    ({"json_schema": "{nope"}, "not valid JSON"),
    ({"json_schema": [1]}, "must be a JSON object"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "not both"),
    ({"grammar": "root ::= ("}, "does not parse"),
    ({"grammar": "   "}, "empty"),
    ({"json_schema": {"type": "no-such-type"}}, "JSON schema"),
    ({"grammar": "x" * 300_000}, "at most"),
])
def test_bad_schemas_and_grammars_are_one_clear_error(smollm2, bad, said):
    with pytest.raises(PymlError, match=said):
        smollm2.generate("hi", 4, **bad)


def test_a_constraint_forbids_padding_rows_past_the_vocabulary(smollm2):
    c = Constraint(smollm2.tokenizer, schema_grammar({"type": "integer"}))
    logits = np.zeros(smollm2.tokenizer.vocab_size + 64, dtype=np.float32)
    out = c.apply(logits)
    assert np.isneginf(out[smollm2.tokenizer.vocab_size:]).all() and np.isfinite(out).any()
    assert logits.max() == 0  # the caller's logits are left as they were


def test_a_batch_takes_a_schema_per_prompt(smollm2):
    """generate_batch: each prompt's own constraint (or none), stepping together."""
    prompts = [smollm2.chat_prompt([{"role": "user", "content": f"Trip {i} as JSON."}]) for i in range(2)]
    results = smollm2.generate_batch(prompts + ["Pick:"], 60, temperature=1.0, seed=5,
                                     options=[{"json_schema": SCHEMA}, {"json_schema": SCHEMA},
                                              {"grammar": 'root ::= "up" | "down"', "max_tokens": 4}])
    for r in results[:2]:
        assert r.stop_reason == "eos", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert results[2].text in ("up", "down")


def test_a_grammar_past_the_parsers_limits_is_refused_when_built(smollm2):
    """One clear error before generation starts (a request is refused before it queues), in bounded time."""
    with pytest.raises(PymlError, match="Too many items"):
        Constraint(smollm2.tokenizer, text_grammar("root ::= " + " ".join(['("a"|"b")?'] * 3000)))
