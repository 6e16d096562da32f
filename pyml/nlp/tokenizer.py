"""Text <-> token ids, through the `tokenizers` library.

Two sources build the same `Tokenizer`:

- `from_file(tokenizer.json)`: the Hugging Face layout, read by `tokenizers` as is;
  tokenizer_config.json / special_tokens_map.json beside it give BOS/EOS, add_bos and the
  chat template.
- `from_gguf_metadata(metadata)`: a GGUF file has no tokenizer.json, only llama.cpp's
  `tokenizer.ggml.*` keys. We rebuild the tokenizer from them the way llama.cpp's
  llama-vocab.cpp reads them (llama.cpp is the reference for what a GGUF means):
  `gpt2` is byte-level BPE (file merges, pre-tokenizer regexes chosen by `tokenizer.ggml.pre`),
  `llama` is SentencePiece BPE (the best-scored adjacent pair merged first, spaces as "▁",
  `<0xNN>` byte fallback), encoded by Google's `sentencepiece` (sentencepiece_vocab.py).
  Control and user-defined tokens are matched whole in the text.

Encoding runs in `tokenizers` (or `sentencepiece`). Decoding is ours, token by token
(`token_bytes`), so that `decode` and the streaming `StreamDecoder` are one code path and agree
by construction.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path

import numpy as np
from gguf import TokenType
from tokenizers import AddedToken, Regex, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers import models as _models

from pyml.core.errors import ModelFormatError, UnsupportedError, check_text
from pyml.nlp.chat import CHATML_TEMPLATE, apply_chat_template, fallback_chat_template
from pyml.nlp.sentencepiece_vocab import SPACE, SentencePieceEncoder

# --- pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe applies them (one after the other) ---
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp spells (?i:'s|...) out as ASCII classes: no Unicode case folding ("'ſ" is not "'s")
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken (Nemo, Small 3, Ministral): tokenizer.json's own regex, whose Unicode case classes
# the `tokenizers` regex engine has (llama.cpp's engine does not, and approximates them)
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
_SMOLLM_SPLITS = (r"\p{N}", _GPT2_SPLIT)  # digits one by one, then GPT-2's words

BPE_PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> regexes
    "default": _DEFAULT_SPLITS,
    "gpt-2": (_GPT2_SPLIT,), "gpt2": (_GPT2_SPLIT,), "phi-2": (_GPT2_SPLIT,), "mpt": (_GPT2_SPLIT,),
    "olmo": (_GPT2_SPLIT,),
    "smollm": _SMOLLM_SPLITS, "starcoder": _SMOLLM_SPLITS, "refact": _SMOLLM_SPLITS,
    "codeshell": _SMOLLM_SPLITS, "command-r": _SMOLLM_SPLITS, "exaone": _SMOLLM_SPLITS,
    "llama3": (_LLAMA3_SPLIT,), "llama-v3": (_LLAMA3_SPLIT,), "llama-bpe": (_LLAMA3_SPLIT,),
    "falcon3": (_LLAMA3_SPLIT,), "dbrx": (_LLAMA3_SPLIT,), "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,), "deepseek-r1-qwen": (_QWEN2_SPLIT,), "stablelm2": (_QWEN2_SPLIT,),
    "megrez": (_QWEN2_SPLIT,), "tekken": (_TEKKEN_SPLIT,),
}
# llama.cpp: these vocabularies take a word that is a token whole, before any merge, and add BOS
_LLAMA3_STYLE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "tekken"}

# Tokens that end a turn (llama.cpp's end-of-generation list, by text): generation stops at any.
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                     "<|eom_id|>", "<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def _byte_level_alphabet() -> dict:
    """GPT-2's printable stand-in character for each byte -> that byte (its bytes_to_unicode, inverted)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_in = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in stand_in:
            stand_in[b], extra = chr(256 + extra), extra + 1
    return {ch: b for b, ch in stand_in.items()}


BYTE_OF_CHAR = _byte_level_alphabet()


@dataclass(frozen=True)
class Vocabulary:
    """Every token's text and llama.cpp token type, and how a normal token spells its bytes.

    The texts are the backend's own (`id_to_token`, held by `tokenizers` or `sentencepiece` in
    C++/Rust): a Python list of them was 25 MB of str objects for Gemma 3's 262,144 tokens, beside
    the same strings in the backend; the types an int32 array."""
    backend: _Backend | SentencePieceEncoder  # its id_to_token: token id -> the text the file stores
    types: np.ndarray       # int32 [n_vocab], gguf.TokenType values
    byte_level: bool        # GPT-2 byte alphabet; else SentencePiece ("▁" = space, <0xNN> = byte)
    strip_first_space: bool  # decode drops the space SentencePiece put before the first word

    def text(self, token_id: int) -> str:
        """The token's text as stored ("" for an id no token has)."""
        return self.backend.id_to_token(token_id) or ""


class Tokenizer:
    """Encode text to ids and decode ids to text for one model."""

    def __init__(self, backend: _Backend | SentencePieceEncoder, vocab: Vocabulary, *, bos_id=None, eos_id=None,
                 unk_id=None, pad_id=None, eos_ids=(), add_bos=False, add_eos=False, chat_template=None,
                 source="tokenizer"):
        self._backend = backend      # tokenizers.Tokenizer (no post-processor) or SentencePieceEncoder
        self._vocab = vocab
        self._piece_cache: dict = {}
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = bos_id, eos_id, unk_id, pad_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.eos_ids = frozenset(i for i in (eos_id, *eos_ids) if i is not None)
        self.chat_template = chat_template
        self.source = source

    # --- construction ---
    @classmethod
    def from_gguf_metadata(cls, metadata: dict, source: str = "GGUF metadata") -> Tokenizer:
        """Rebuild the tokenizer a GGUF describes from its `tokenizer.ggml.*` keys."""
        model = metadata.get("tokenizer.ggml.model")
        texts = _string_list(metadata, "tokenizer.ggml.tokens", source)
        n = len(texts)
        types = _number_list(metadata, "tokenizer.ggml.token_type", n, source, int) or [TokenType.NORMAL] * n
        type_ids = _type_array(types)  # each within int32, checked before anything reads them
        if model == "gpt2":
            pre = metadata.get("tokenizer.ggml.pre") or "default"
            backend = _byte_level_bpe(texts, _string_list(metadata, "tokenizer.ggml.merges", source), pre, source)
            vocab = Vocabulary(backend, type_ids, byte_level=True, strip_first_space=False)
            defaults = dict(bos=None, eos=None, unk=None, add_bos=pre in _LLAMA3_STYLE)
        elif model == "llama":
            scores = _number_list(metadata, "tokenizer.ggml.scores", n, source, float)
            if scores is None:
                raise ModelFormatError(f"{source}: tokenizer.ggml.scores is missing; a SentencePiece "
                                       f"vocabulary needs one score per token")
            wide = np.asarray(scores, np.float64)
            past = wide[np.isfinite(wide) & (np.abs(wide) > np.finfo(np.float32).max)]
            if past.size:  # SentencePiece keeps float32 scores
                raise ModelFormatError(f"{source}: tokenizer.ggml.scores holds {past[0]:g}, past float32's range")
            space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
            _check_unique(texts, source)
            backend = SentencePieceEncoder(texts, scores, types, space_prefix, source)
            vocab = Vocabulary(backend, type_ids, byte_level=False, strip_first_space=space_prefix)
            defaults = dict(bos=1, eos=2, unk=0, add_bos=True)  # llama.cpp's SPM defaults
        else:
            raise UnsupportedError(f"{source}: tokenizer.ggml.model {model!r} is not supported "
                                   f"(supported: gpt2, llama)")
        if model == "gpt2":  # the SentencePiece encoder matches its whole tokens itself
            _add_special_tokens(backend, texts, types)

        def token_id(key, default):
            value = metadata.get(f"tokenizer.ggml.{key}", default)
            return int(value) if value is not None and 0 <= int(value) < n else None

        bos, eos = token_id("bos_token_id", defaults["bos"]), token_id("eos_token_id", defaults["eos"])
        eot = token_id("eot_token_id", None)
        arch = metadata.get("general.architecture", "")
        eog = _end_of_generation_ids(texts)
        del texts, types  # the backend holds the texts from here on
        return cls(backend, vocab, bos_id=bos, eos_id=eos, unk_id=token_id("unknown_token_id", defaults["unk"]),
                   pad_id=token_id("padding_token_id", None), eos_ids=(eot, *eog),
                   add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", defaults["add_bos"])),
                   add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
                   chat_template=metadata.get("tokenizer.chat_template") or fallback_chat_template(arch),
                   source=source)

    @classmethod
    def from_file(cls, path, config: dict | None = None) -> Tokenizer:
        """A Hugging Face tokenizer.json (or the directory holding it).

        tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
        generation_config.json beside it are read when present; `config` is the model's
        config.json (its bos/eos ids are the last fallback).
        """
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ModelFormatError(f"{path}: no such tokenizer file")
        try:
            text = path.read_text(encoding="utf-8")
            spec = json.loads(text)
            backend = _Backend.from_str(text)  # the file's own text, not `spec` dumped again (5fb09d6 measured it)
        except Exception as e:  # json's ValueError, or the plain Exception tokenizers raises on a bad spec
            raise ModelFormatError(f"{path}: not a tokenizers JSON file ({e})") from None
        folder = path.parent
        tok_config = {**_read_json(folder / "special_tokens_map.json"), **_read_json(folder / "tokenizer_config.json")}
        model_config = config if config is not None else _read_json(folder / "config.json")
        vocab = _vocabulary_from_spec(spec, backend, path)

        def special_id(name):  # the token named in tokenizer_config, else the id in config.json
            value = tok_config.get(f"{name}_token")
            text = value.get("content") if isinstance(value, dict) else value
            if isinstance(text, str) and backend.token_to_id(text) is not None:
                return backend.token_to_id(text)
            value = model_config.get(f"{name}_token_id")
            return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None

        bos, eos = special_id("bos"), special_id("eos")
        # what the tokenizer.json's post-processor would add, unless the config says otherwise
        plain, marked = (backend.encode("a", add_special_tokens=flag).ids for flag in (False, True))
        add_bos = tok_config.get("add_bos_token", bos is not None and marked[:1] == [bos] != plain[:1])
        add_eos = tok_config.get("add_eos_token", eos is not None and marked[-1:] == [eos] != plain[-1:])
        backend.post_processor = None  # encode() adds BOS/EOS itself, so they are never added twice
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        stop_ids = generation_eos if isinstance(generation_eos, list) else [generation_eos]
        return cls(backend, vocab, bos_id=bos, eos_id=eos, unk_id=special_id("unk"), pad_id=special_id("pad"),
                   eos_ids=(*[i for i in stop_ids if isinstance(i, int)], *_end_of_generation_ids(map(vocab.text, range(len(vocab.types))))),
                   add_bos=bool(add_bos), add_eos=bool(add_eos),
                   chat_template=_chat_template_beside(folder, tok_config), source=str(path))

    # --- encoding ---
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in the text (`<|im_start|>`) become one id.

        With add_special_tokens, BOS/EOS are added as the model asks (add_bos/add_eos), except
        that a text already starting with BOS (a chat template that writes `<bos>`) keeps one.
        """
        check_text(text, "the text to tokenize")
        if isinstance(self._backend, SentencePieceEncoder):
            ids = self._backend.encode(text)
        else:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    # --- decoding ---
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a control token: its text), before any UTF-8 decoding."""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._piece_cache[token_id] = self._spell(token_id)
        return piece

    def _spell(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ModelFormatError(f"{self.source}: token id {token_id} is outside the vocabulary "
                                   f"of {self.vocab_size} tokens")
        text, kind = self._vocab.text(token_id), int(self._vocab.types[token_id])
        if kind in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN):
            return text.encode("utf-8")  # stored as plain text, not in the vocabulary's spelling
        if kind == TokenType.UNUSED:
            return b""
        if kind == TokenType.BYTE:  # "<0x0A>"
            return bytes([int(text[3:5], 16)])
        if self._vocab.byte_level:
            return bytes(BYTE_OF_CHAR[c] for c in text) if all(c in BYTE_OF_CHAR for c in text) \
                else text.encode("utf-8")
        return text.replace(SPACE, " ").encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        """A control (or unknown) token, which decode(skip_special_tokens=True) leaves out."""
        return int(self._vocab.types[token_id]) in (TokenType.CONTROL, TokenType.UNKNOWN)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 show as U+FFFD."""
        stream = self.stream_decoder(skip_special_tokens)
        return "".join(stream.push(i) for i in ids) + stream.flush()

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)

    # --- chat ---
    def apply_chat_template(self, messages: list, template: str | None = None,
                            add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """The prompt text for `messages` in this model's chat format (or `template`); `tools`:
        the function specs a template renders (None: none)."""
        own = template is None or template == self.chat_template
        source = ("the given chat template" if not own else f"the chat template of {self._model_name()}"
                  if self.chat_template else "the built-in ChatML template")
        return apply_chat_template(template or self.chat_template or CHATML_TEMPLATE, messages,
                                   bos_token=self.bos_token, eos_token=self.eos_token,
                                   add_generation_prompt=add_generation_prompt, source=source, tools=tools)

    def _model_name(self) -> str:
        """The model file's or folder's name (not its path: a server's 400 answer says it too)."""
        path = Path(self.source)
        return path.parent.name if path.name == "tokenizer.json" else path.name

    # --- properties ---
    @property
    def vocab_size(self) -> int:
        return len(self._vocab.types)

    @property
    def bos_token(self) -> str:
        return self._vocab.text(self.bos_id) if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._vocab.text(self.eos_id) if self.eos_id is not None else ""

    def __repr__(self):
        return (f"Tokenizer({self.source}, {self.vocab_size} tokens, bos={self.bos_id}, "
                f"eos={sorted(self.eos_ids)}, add_bos={self.add_bos})")


class StreamDecoder:
    """Decodes ids one at a time: `push(id)` returns the text that became complete, valid UTF-8.

    A character split across tokens (byte-level pieces, SentencePiece `<0xNN>` bytes) is held
    until its last byte arrives; `flush()` returns what is left, invalid bytes as U+FFFD.
    The pushes plus the flush always equal `Tokenizer.decode` of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # llama.cpp's detokenize: SentencePiece wrote a space before the first word, so the first
        # piece loses one leading space -- unless the first token is a BOS being skipped.
        self._strip_space = tokenizer._vocab.strip_first_space
        self._first = True

    def push(self, token_id: int) -> str:
        tokenizer, first = self._tokenizer, self._first
        self._first = False
        if self._skip_special and tokenizer.is_special(token_id):
            if first and token_id == tokenizer.bos_id:
                self._strip_space = False
            return ""
        piece = tokenizer.token_bytes(token_id)
        if first and self._strip_space and piece.startswith(b" "):
            piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# --- building the backend from GGUF metadata ---
def _byte_level_bpe(texts, merges, pre: str, source: str) -> _Backend:
    if pre not in BPE_PRE_TOKENIZERS:
        raise UnsupportedError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported "
                               f"(supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))})")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelFormatError(f"{source}: tokenizer.ggml.merges entry {merge!r} is not 'left right'")
        pairs.append((left, right))
    model = _bpe(texts, pairs, source, ignore_merges=pre in _LLAMA3_STYLE)
    backend = _Backend(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in BPE_PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return backend


def _check_unique(texts, source):
    """A text twice is refused (llama.cpp refuses such a file too)."""
    if len(set(texts)) == len(texts):
        return
    first = {}
    for i, text in enumerate(texts):
        if first.setdefault(text, i) != i:
            raise ModelFormatError(f"{source}: token {text!r} appears twice in tokenizer.ggml.tokens "
                                   f"(ids {first[text]} and {i})")


def _bpe(texts, pairs, source, **options):
    _check_unique(texts, source)
    vocab = {text: i for i, text in enumerate(texts)}
    try:
        return _models.BPE(vocab=vocab, merges=pairs, **options)
    except Exception as e:  # tokenizers raises plain Exception for a merge of unknown tokens
        raise ModelFormatError(f"{source}: merges do not fit the vocabulary ({e})") from None


def _add_special_tokens(backend: _Backend, texts, types):
    """Control tokens as special tokens and user-defined ones as added tokens: both whole in the text."""
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(texts, types)
               if k in (TokenType.CONTROL, TokenType.UNKNOWN) and t]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(texts, types)
            if k == TokenType.USER_DEFINED and t]
    backend.add_special_tokens(control)  # each text is in the vocabulary, so each keeps its id
    backend.add_tokens(user)


def _type_array(types) -> np.ndarray:
    try:
        wide = np.array(types, np.int64)
    except OverflowError:
        wide = None
    if wide is None or wide.size and (wide.min() < -2**31 or wide.max() >= 2**31):
        raise ValueError("a token type is outside the int32 range")
    return wide.astype(np.int32)


def _end_of_generation_ids(texts) -> list:
    wanted = set(END_OF_GENERATION)
    return [i for i, t in enumerate(texts) if t in wanted]


def _string_list(metadata, key, source) -> list:
    value = metadata.get(key)
    if not isinstance(value, (list, tuple)) or not all(map(isinstance, value, repeat(str))):
        raise ModelFormatError(f"{source}: {key} is missing or not a string array")
    return list(value)


def _number_list(metadata, key, n, source, kind):
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.dtype.kind in ("iu" if kind is int else "f"):
        values = value.tolist()  # already `kind`s, without a call an item (~0.1 s a list for Gemma 3)
    else:
        values = [kind(v) for v in value]
    if len(values) != n:
        raise ModelFormatError(f"{source}: {key} has {len(values)} entries, expected one per token ({n})")
    return values


# --- reading a Hugging Face tokenizer.json ---
def _vocabulary_from_spec(spec: dict, backend: _Backend, path) -> Vocabulary:
    """Token texts and types for tokenizer.json, and the spelling its decoder implies."""
    model_vocab = backend.get_vocab(with_added_tokens=False)
    n = 1 + max([*model_vocab.values(), *(t["id"] for t in spec.get("added_tokens") or [])], default=-1)
    texts, types = [""] * n, [TokenType.UNUSED] * n  # ids nobody uses decode to nothing
    for text, i in model_vocab.items():
        texts[i], types[i] = text, TokenType.NORMAL
    model = spec.get("model") or {}
    if model.get("byte_fallback"):
        for i, text in enumerate(texts):
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                types[i] = TokenType.BYTE
    for added in spec.get("added_tokens") or []:
        i = added["id"]
        if 0 <= i < n:
            texts[i] = added["content"]
            types[i] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    decoders = _decoder_steps(spec.get("decoder"))
    kinds = {d.get("type") for d in decoders}
    types = _type_array(types)
    if "ByteLevel" in kinds:
        return Vocabulary(backend, types, byte_level=True, strip_first_space=False)
    if kinds & {"Metaspace", "Replace", "ByteFallback"}:
        strip = any(d.get("type") == "Strip" and d.get("start") for d in decoders) or any(
            d.get("type") == "Metaspace" and (d.get("add_prefix_space") or d.get("prepend_scheme") in
                                              ("always", "first")) for d in decoders)
        return Vocabulary(backend, types, byte_level=False, strip_first_space=strip)
    raise UnsupportedError(f"{path}: decoder {sorted(k for k in kinds if k)} is not supported "
                           f"(supported: ByteLevel, or SentencePiece's Metaspace/Replace/ByteFallback)")


def _decoder_steps(decoder) -> list:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for d in decoder.get("decoders", []) for step in _decoder_steps(d)]
    return [decoder]


def _chat_template_beside(folder: Path, tok_config: dict) -> str | None:
    if (folder / "chat_template.jinja").is_file():  # newer repos keep it in its own file
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
    return value if isinstance(value, dict) else {}

