"""Constrained decoding: the output must match a JSON schema or a grammar (GBNF or Lark).

The engine is llguidance (docs/structured-output.md has the measurements that chose it over
xgrammar and outlines-core): a schema compiles in about a millisecond because the token masks
are computed lazily, one step at a time, in ~10-20 us on a 49K or 262K vocabulary.

A `Constraint` is one generation's matcher: `apply(logits)` gives the logits with every token the
grammar forbids at -inf (the sampler calls it before temperature, top-k, top-p and min-p), and
`accept(token)` advances it on the token chosen. Once the grammar is complete only the
end-of-generation tokens stay allowed, so the generation ends there.
"""

from __future__ import annotations

import json
import threading
import weakref

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.nlp.tokenizer import Tokenizer

_perf = perf.get("pyml.nlp.constrained")

# JSON mode (OpenAI's {"type": "json_object"}): any JSON object
JSON_OBJECT_SCHEMA = {"type": "object"}
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar text: bounds what a request can make us compile
# llguidance's default limits bound one step's lexer and parser work: a hostile grammar ends in
# an error (a PymlError here), never a hang
LIMITS = llguidance.LLParserLimits()


class _Wrapped:
    """pyml's tokenizer as llguidance's TokenizerWrapper reads one: each token's bytes, the end ids,
    and an encoder (used for the grammar's literal text)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.eos_token_id = min(tokenizer.eos_ids)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # the wrapper probes with bytes: say we take text only
            raise TypeError("text only")
        return self.tokenizer.encode(text, add_special_tokens=False)


_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vocabularies_lock = threading.Lock()


def grammar_vocabulary(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`, built once per tokenizer (0.3 s for 49K tokens, 2.5 s for 262K)."""
    if tokenizer is None:
        raise PymlError("constrained output needs the model's tokenizer, and none was found beside the model")
    with _vocabularies_lock:
        vocab = _vocabularies.get(tokenizer)
        if vocab is None:
            if not tokenizer.eos_ids:
                raise PymlError("constrained output needs an end-of-generation token; this tokenizer has none")
            with _perf.debug("constrained::vocabulary", "tokens={}", tokenizer.vocab_size, op="constrained"):
                vocab = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(tokenizer)),
                                               eos_token=sorted(tokenizer.eos_ids))
            _vocabularies[tokenizer] = vocab
        return vocab


def schema_grammar(schema, what: str = "the JSON schema") -> str:
    """llguidance's grammar for a JSON schema (a dict, or its JSON text); compact JSON, no free
    whitespace: a small model left free to indent may indent until max_tokens."""
    if isinstance(schema, str):
        _check_size(schema, what)
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise PymlError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise PymlError(f"{what} must be a JSON object, got {type(schema).__name__}")
    _check_size(json.dumps(schema), what)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def text_grammar(text: str, what: str = "the grammar") -> str:
    """llguidance's grammar for a GBNF (llama.cpp's, with `root ::= ...`) or Lark grammar text."""
    if not isinstance(text, str) or not text.strip():
        raise PymlError(f"{what} is empty")
    _check_size(text, what)
    try:
        lark = any_to_lark(text)  # GBNF is converted; Lark passes through
    except Exception as e:  # the converter's own parse errors are of several kinds
        raise PymlError(f"{what} does not parse as GBNF or Lark: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise PymlError(f"{what} is {len(text):,} characters; at most {MAX_GRAMMAR_CHARS:,} are allowed")


class Constraint:
    """One generation's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, tokenizer: Tokenizer, grammar: str, what: str = "the grammar"):
        vocab = grammar_vocabulary(tokenizer)
        error = llguidance.LLMatcher.validate_grammar(grammar, vocab, limits=LIMITS)
        if error and not error.startswith("WARNING"):
            raise PymlError(f"{what} is not usable: {error.strip().splitlines()[0]}")
        self.grammar, self.what, self.vocab = grammar, what, vocab
        self.matcher = llguidance.LLMatcher(vocab, grammar, log_level=0, limits=LIMITS)
        self._check()
        self.n_vocab = tokenizer.vocab_size
        self.eos_ids = np.asarray(sorted(tokenizer.eos_ids), dtype=np.int64)
        self.bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        # the first step's mask now: a grammar past the parser's limits is refused here, before a
        # request queues, not in the middle of a batched step
        self._fill()
        self._first_ready = True

    @classmethod
    def from_options(cls, tokenizer: Tokenizer, json_schema=None, grammar: str | None = None) -> Constraint | None:
        """The constraint `lm.generate(json_schema=..., grammar=...)` asks for, or None for free text."""
        if json_schema is not None and grammar is not None:
            raise PymlError("give a JSON schema or a grammar, not both")
        if json_schema is not None:
            return cls(tokenizer, schema_grammar(json_schema), "the JSON schema")
        if grammar is not None:
            return cls(tokenizer, text_grammar(grammar), "the grammar")
        return None

    def fresh(self) -> Constraint:
        """The same grammar from its start (another choice of one request)."""
        twin = object.__new__(Constraint)
        twin.__dict__.update(self.__dict__)
        twin.matcher = llguidance.LLMatcher(self.vocab, self.grammar, log_level=0, limits=LIMITS)
        twin.bits = np.zeros_like(self.bits)
        twin._fill()
        twin._first_ready = True
        return twin

    def _fill(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)  # drops the GIL
        self._check()

    def allowed(self) -> np.ndarray:
        """[n_vocab] bool: the tokens the grammar allows next."""
        with _perf.debug("constrained::mask", "vocab={}", self.n_vocab, op="constrained"):
            if self._first_ready:
                self._first_ready = False
            else:
                self._fill()
            return np.unpackbits(self.bits.view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with the forbidden tokens at -inf (rows past the tokenizer's
        vocabulary, an embedding's padding, are forbidden too)."""
        allowed = self.allowed()
        out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
        n = min(self.n_vocab, logits.shape[0])
        np.copyto(out[:n], logits[:n], where=allowed[:n])
        if not np.isfinite(out).any():  # a forbidden-everything state would make the sampler divide by 0
            out[self.eos_ids[self.eos_ids < logits.shape[0]]] = 0.0
        return out

    def accept(self, token: int) -> None:
        if self.matcher.is_stopped() and token in self.eos_ids:
            return  # the end token after a complete match
        self.matcher.consume_token(int(token))
        self._check()

    @property
    def complete(self) -> bool:
        """The text so far is a whole match (an end token would be allowed now)."""
        return self.matcher.is_accepting()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise PymlError(f"{self.what}: {self.matcher.get_error().strip().splitlines()[0]}")
