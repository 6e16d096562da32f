"""Tokenizer from GGUF metadata and tokenizer.json, against transformers' own GGUF converter.

transformers builds a Hugging Face tokenizer from the same GGUF file by its own code
(integrations/gguf), so it is an independent oracle for the ids. Where it and llama.cpp
disagree, we follow llama.cpp (the reference for what a GGUF means) and a test says so.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from pyml.core.errors import ModelFormatError, PymlError, UnsupportedError
from pyml.nlp.tokenizer import Tokenizer
from tests import oracle_cache

PROMPTS = [
    "Hello", "Hello world", "The capital of France is",
    " leading space", "  two leading spaces", "trailing space ", "trailing spaces   ", "a  b   c    d",
    "line one\nline two\n\nline four", "tab\tseparated\tvalues", "\t\tindented\n    four spaces",
    "windows\r\nline end", "\n", " ", "",
    "2024", "The year 1999 had 365 days and 8760 hours", "pi = 3.14159265358979", "1234567890123",
    "Hello, world! How's it going? I'm fine; you're great -- aren't we?", "(a+b)*[c/d]{e}<f>",
    "def square(x):\n    return x ** 2  # why not\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "https://example.com/path?q=1&lang=en#frag", "user@example.org",
    "emoji 🤗 and 👩‍👩‍👧‍👦 family and 🇫🇷 flag", "😀😃😄",
    "日本語のテキストです。", "中文文本测试，包括标点。", "Привет, как дела?", "مرحبا بالعالم", "Ünïcödé café naïve ẞ",
    "mixed 日本 and English 123 и русский",
]
SMOLLM2_SPECIALS = ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
                    "text<|endoftext|>more text", "<|im_end|>"]
GEMMA3_SPECIALS = ["<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
                   "text<end_of_turn>more", "<start_of_turn>", "a\n\n\nb"]


def read_metadata(path: Path) -> dict:
    """GGUF metadata as pyml's loader gives it: strings, scalars, lists of str, numpy arrays
    (gguf's reader, kept on disk between runs: tests/oracle_cache.py)."""
    def read():
        metadata = {}
        for name, field in GGUFReader(path).fields.items():
            value = field.contents()
            if isinstance(value, list) and value and not isinstance(value[0], str):
                value = np.asarray(value)
            metadata[name] = value
        return metadata
    return oracle_cache.kept_pickle("gguf-metadata", Path(path), "gguf", read)


def transformers_tokenizer(path: Path):
    """transformers' tokenizer converted from the GGUF file (kept on disk between runs as the
    converter wrote it, tests/oracle_cache.py: Gemma 3's conversion takes ~15 s)."""
    transformers = pytest.importorskip("transformers")
    return oracle_cache.kept(
        "gguf-tokenizer", Path(path), "transformers",
        lambda: transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name),
        lambda tokenizer, entry: tokenizer.save_pretrained(entry),
        lambda entry: transformers.AutoTokenizer.from_pretrained(str(entry)))


@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_gguf):
    return read_metadata(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2(smollm2_metadata):
    return Tokenizer.from_gguf_metadata(smollm2_metadata)


@pytest.fixture(scope="module")
def smollm2_oracle(smollm2_gguf):
    """transformers' tokenizer for the file, with SmolLM2's own pre-tokenizer.

    transformers' GGUF converter does not know `tokenizer.ggml.pre = smollm` and splits with
    GPT-2's regex only; SmolLM2's tokenizer.json and llama.cpp first cut digits one by one.
    We give the oracle that step back (tokenizers' Digits), so it matches the real model.
    """
    from tokenizers import pre_tokenizers
    oracle = transformers_tokenizer(smollm2_gguf)
    oracle.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return oracle


@pytest.fixture(scope="module")
def gemma3_metadata(gemma3_gguf):
    return read_metadata(gemma3_gguf)


@pytest.fixture(scope="module")
def gemma3(gemma3_metadata):
    return Tokenizer.from_gguf_metadata(gemma3_metadata)


@pytest.fixture(scope="module")
def gemma3_oracle(gemma3_gguf):
    return transformers_tokenizer(gemma3_gguf)


# --- SmolLM2: byte-level BPE, pre = smollm ---
@pytest.mark.parametrize("text", PROMPTS + SMOLLM2_SPECIALS)
def test_smollm2_ids_match_transformers(smollm2, smollm2_oracle, text):
    ids = smollm2.encode(text)
    assert ids == smollm2_oracle.encode(text)
    assert smollm2.decode(ids) == smollm2_oracle.decode(ids) == text


def test_smollm2_cuts_digits_one_by_one_as_llamacpp(smollm2, smollm2_metadata):
    """"x  0": llama.cpp's smollm pre-tokenizer cuts "0" off first, so the two spaces stay one
    token; transformers' converter (GPT-2 regex only) splits " ", " 0" -> x, Ġ, Ġ, 0."""
    tokens = smollm2_metadata["tokenizer.ggml.tokens"]
    assert [tokens[i] for i in smollm2.encode("x  0")] == ["x", "ĠĠ", "0"]
    assert [tokens[i] for i in smollm2.encode("12345")] == ["1", "2", "3", "4", "5"]


def test_transformers_converter_alone_differs_on_digits(smollm2, smollm2_oracle):
    from tokenizers import pre_tokenizers
    backend = smollm2_oracle.backend_tokenizer
    ours = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # the converter's
    try:
        assert len(smollm2_oracle.encode("x  0")) == 4 != len(smollm2.encode("x  0"))
    finally:
        backend.pre_tokenizer = ours


def test_smollm2_hand_checked_ids(smollm2, smollm2_metadata):
    tokens = smollm2_metadata["tokenizer.ggml.tokens"]
    assert smollm2.encode("Hello") == [tokens.index("Hello")]
    assert smollm2.encode("Hello world") == [tokens.index("Hello"), tokens.index("Ġworld")]
    assert smollm2.encode("<|im_start|>") == [tokens.index("<|im_start|>")] == [1]
    assert smollm2.encode("\n") == [tokens.index("Ċ")]


def test_smollm2_special_ids(smollm2):
    assert smollm2.vocab_size == 49152
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.add_bos) == (1, 2, False)
    assert smollm2.eos_ids == {0, 2}  # <|endoftext|> and <|im_end|> both end generation
    assert smollm2.bos_token == "<|im_start|>" and smollm2.eos_token == "<|im_end|>"
    assert smollm2.decode(smollm2.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"


# --- Gemma 3: SentencePiece BPE with byte fallback, add_bos ---
@pytest.mark.parametrize("text", PROMPTS + GEMMA3_SPECIALS)
def test_gemma3_ids_match_transformers(gemma3, gemma3_oracle, text):
    ids = gemma3.encode(text)
    assert ids == gemma3_oracle.encode(text)
    assert gemma3.decode(ids) == gemma3_oracle.decode(ids)
    plain = gemma3.decode(ids, skip_special_tokens=True)
    assert plain == gemma3_oracle.decode(ids, skip_special_tokens=True)
    if text in PROMPTS:
        assert plain == text


def test_gemma3_hand_checked_ids(gemma3, gemma3_metadata):
    tokens = gemma3_metadata["tokenizer.ggml.tokens"]
    assert gemma3.encode("Hello") == [2, tokens.index("Hello")]            # no space prefix in Gemma
    assert gemma3.encode("Hello world", add_special_tokens=False) == [tokens.index("Hello"), tokens.index("▁world")]
    assert gemma3.encode("\n", add_special_tokens=False) == [tokens.index("\n")] == [107]  # user-defined
    assert gemma3.encode("<start_of_turn>", add_special_tokens=False) == [105]
    # a character missing from the vocabulary falls back to its UTF-8 bytes
    assert [tokens[i] for i in gemma3.encode("ꙮ", add_special_tokens=False)] == ["<0xEA>", "<0x99>", "<0xAE>"]


def test_gemma3_whitespace_runs_are_matched_whole_as_llamacpp(gemma3, gemma3_metadata):
    """Gemma's runs of spaces are user-defined tokens: llama.cpp matches them in the text
    before any merge, the longest first (39 spaces = 31 + 8). transformers' converter renames
    them "▁▁..." and merges, giving 16 + 23 -- we follow llama.cpp."""
    tokens = gemma3_metadata["tokenizer.ggml.tokens"]
    ids = gemma3.encode("a" + " " * 39 + "b", add_special_tokens=False)
    assert [tokens[i] for i in ids] == ["a", " " * 31, " " * 8, "b"]


def test_gemma3_special_ids_and_bos(gemma3):
    assert gemma3.vocab_size == 262144
    assert (gemma3.bos_id, gemma3.eos_id, gemma3.add_bos) == (2, 1, True)
    assert gemma3.eos_ids == {1, 106}  # <eos> and <end_of_turn>
    assert gemma3.encode("hi", add_special_tokens=False) == gemma3.encode("hi")[1:]
    # a prompt whose chat template already wrote <bos> keeps a single BOS (transformers would add a second)
    assert gemma3.encode("<bos>hi") == gemma3.encode("hi")


# --- streaming ---
STREAM_TEXT = "Héllo 世界! Привет 🤗👩‍👩‍👧 ꙮ𓀀 مرحبا\n\tdone"


def _stream(tokenizer, ids, **kw):
    stream = tokenizer.stream_decoder(**kw)
    chunks = [stream.push(i) for i in ids]
    return chunks, stream.flush()


def test_smollm2_stream_reproduces_decode(smollm2):
    ids = smollm2.encode(STREAM_TEXT)
    chunks, tail = _stream(smollm2, ids)
    assert "".join(chunks) + tail == smollm2.decode(ids) == STREAM_TEXT
    assert not any("\ufffd" in c for c in chunks)  # nothing released before it was whole


def test_gemma3_stream_reproduces_decode(gemma3):
    ids = gemma3.encode(STREAM_TEXT)
    chunks, tail = _stream(gemma3, ids, skip_special_tokens=True)
    assert "".join(chunks) + tail == gemma3.decode(ids, skip_special_tokens=True) == STREAM_TEXT
    assert not any("\ufffd" in c for c in chunks)


def test_stream_holds_a_split_character_until_whole(smollm2):
    ids = smollm2.encode("🤗")  # 'ðŁ' '¤' 'Ĺ': F0 9F | A4 | 97
    assert len(ids) == 3
    chunks, tail = _stream(smollm2, ids)
    assert chunks == ["", "", "🤗"] and tail == ""


def test_stream_holds_byte_fallback_pieces(gemma3):
    ids = gemma3.encode("aꙮb", add_special_tokens=False)  # a, <0xEA>, <0x99>, <0xAE>, b
    chunks, tail = _stream(gemma3, ids)
    assert chunks == ["a", "", "", "ꙮ", "b"] and tail == ""


def test_stream_flush_shows_invalid_trailing_bytes(smollm2):
    ids = smollm2.encode("ok🤗")[:-2]  # "ok" then only the first two bytes of the emoji
    chunks, tail = _stream(smollm2, ids)
    assert "".join(chunks) == "ok" and tail == "\ufffd"
    assert smollm2.decode(ids) == "ok\ufffd"
    assert smollm2.token_bytes(ids[-1]) == b"\xf0\x9f"


# --- small hand-made vocabularies: the rules themselves ---
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def spm_metadata(pieces: dict, add_space_prefix=True, **extra) -> dict:
    """A SentencePiece ('llama') vocabulary: <unk> <s> </s>, the 256 bytes, then `pieces` (text -> score)."""
    tokens = ["<unk>", "<s>", "</s>", *BYTE_TOKENS, *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": np.array([0.0, 0.0, 0.0, *[0.0] * 256, *pieces.values()], np.float32),
            "tokenizer.ggml.token_type": np.array(types, np.int32),
            "tokenizer.ggml.add_space_prefix": add_space_prefix, **extra}


def texts(tokenizer, ids):
    return [tokenizer._vocab.text(i) for i in ids]


def test_spm_merges_the_best_scored_pair_first():
    """llama.cpp: of the adjacent pairs, merge the one whose result has the highest score."""
    pieces = {"a": -1, "b": -1, "c": -1, "▁": -1}
    left_first = Tokenizer.from_gguf_metadata(spm_metadata({**pieces, "ab": -5, "bc": -6}, add_space_prefix=False))
    right_first = Tokenizer.from_gguf_metadata(spm_metadata({**pieces, "ab": -6, "bc": -5}, add_space_prefix=False))
    assert texts(left_first, left_first.encode("abc", add_special_tokens=False)) == ["ab", "c"]
    assert texts(right_first, right_first.encode("abc", add_special_tokens=False)) == ["a", "bc"]


def test_spm_space_prefix_and_first_space_stripped_on_decode():
    tok = Tokenizer.from_gguf_metadata(spm_metadata(
        {"▁": -1, "H": -2, "i": -3, "▁H": -4, "▁Hi": -5, "!": -6}))
    ids = tok.encode("Hi Hi!")
    assert texts(tok, ids) == ["<s>", "▁Hi", "▁Hi", "!"]  # add_bos defaults on for SentencePiece
    assert tok.decode(ids) == "<s> Hi Hi!"
    assert tok.decode(ids, skip_special_tokens=True) == " Hi Hi!"  # llama.cpp: a skipped BOS keeps the space
    assert tok.decode(ids[1:]) == "Hi Hi!"                           # the prefix space SentencePiece added
    chunks, tail = _stream(tok, ids[1:])
    assert chunks == ["Hi", " Hi", "!"] and tail == ""
    # after a special token the text gets a space prefix again, as in llama.cpp
    assert texts(tok, tok.encode("Hi</s>Hi", add_special_tokens=False)) == ["▁Hi", "</s>", "▁Hi"]


def test_spm_byte_fallback_for_unknown_characters():
    tok = Tokenizer.from_gguf_metadata(spm_metadata({"▁": -1, "a": -2}, add_space_prefix=False))
    ids = tok.encode("aé", add_special_tokens=False)
    assert texts(tok, ids) == ["a", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "aé"


def byte_level_metadata(pre: str, merges=(), extra_tokens=()) -> dict:
    from pyml.nlp.tokenizer import BYTE_OF_CHAR
    alphabet = sorted(BYTE_OF_CHAR, key=BYTE_OF_CHAR.get)
    merged = ["".join(m.split(" ")) for m in merges]
    tokens = [*alphabet, *merged, *extra_tokens]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": list(merges),
            "tokenizer.ggml.token_type": np.array([1] * (len(tokens) - len(extra_tokens)) + [3] * len(extra_tokens))}


@pytest.mark.parametrize("pre, expected", [
    ("llama-bpe", ["123", "45"]),   # \p{N}{1,3}
    ("qwen2", ["1", "2", "3", "4", "5"]),
    ("smollm", ["1", "2", "3", "4", "5"]),
    ("gpt2", ["12345"]),
])
def test_byte_level_pre_tokenizers_split_numbers_like_llamacpp(pre, expected):
    merges = ["1 2", "12 3", "4 5", "123 45"]
    tok = Tokenizer.from_gguf_metadata(byte_level_metadata(pre, merges))
    assert texts(tok, tok.encode("12345")) == expected


def test_llama3_takes_a_whole_word_from_the_vocabulary_before_merging():
    """llama.cpp sets ignore_merges for llama3-style vocabularies: a word that is a token is one id."""
    for pre, expected in [("llama-bpe", ["abc"]), ("gpt2", ["a", "b", "c"])]:
        tok = Tokenizer.from_gguf_metadata(byte_level_metadata(pre, extra_tokens=[]) | {
            "tokenizer.ggml.tokens": byte_level_metadata(pre)["tokenizer.ggml.tokens"] + ["abc"],
            "tokenizer.ggml.token_type": None})
        assert texts(tok, tok.encode("abc")) == expected
    assert Tokenizer.from_gguf_metadata(byte_level_metadata("llama-bpe", ["a b"])).add_bos  # llama.cpp default


def test_byte_level_control_tokens_are_atomic_and_decode_as_text():
    tok = Tokenizer.from_gguf_metadata(byte_level_metadata("gpt2", ["Ġ w"], extra_tokens=["<|end|>"]))
    ids = tok.encode("a<|end|> w")
    assert texts(tok, ids) == ["a", "<|end|>", "Ġw"]
    assert tok.decode(ids) == "a<|end|> w" and tok.decode(ids, skip_special_tokens=True) == "a w"
    assert tok.eos_ids == {ids[1]}  # "<|end|>" ends a turn (llama.cpp's list)


@pytest.mark.parametrize("change, error, words", [
    ({"tokenizer.ggml.model": "bert"}, UnsupportedError, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.pre": "no-such-pre"}, UnsupportedError, "tokenizer.ggml.pre"),
    ({"tokenizer.ggml.tokens": None}, ModelFormatError, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.merges": ["Ġw"]}, ModelFormatError, "tokenizer.ggml.merges"),
    ({"tokenizer.ggml.merges": ["x yz"]}, ModelFormatError, "merges"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a"], "tokenizer.ggml.token_type": None}, ModelFormatError,
     "appears twice"),
    ({"tokenizer.ggml.token_type": np.array([1, 1])}, ModelFormatError, "tokenizer.ggml.token_type"),
])
def test_bad_metadata_raises_one_line_errors(change, error, words):
    metadata = {**byte_level_metadata("gpt2", ["Ġ w"]), **change}
    with pytest.raises(error) as raised:
        Tokenizer.from_gguf_metadata(metadata, source="model.gguf")
    message = str(raised.value)
    assert words in message and "model.gguf" in message and "\n" not in message


def test_spm_without_scores_is_a_format_error():
    metadata = spm_metadata({"a": -1})
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata(metadata)


def test_spm_scores_past_float32_are_a_format_error():
    """SentencePiece keeps float32 scores: a finite one past its range (a float64 array may hold it)
    is named, not rounded to infinity; an infinite one was and is taken as it is."""
    metadata = spm_metadata({"a": -1, "b": -2, "ab": -3})
    scores = np.array(metadata["tokenizer.ggml.scores"], np.float64)
    scores[-1] = -1e39
    with pytest.raises(ModelFormatError, match=r"tokenizer.ggml.scores holds -1e\+39, past float32's range"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.scores": scores})
    scores[-1] = -np.inf
    tok = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.scores": scores})
    assert tok.encode("ab", add_special_tokens=False)


def test_token_id_outside_vocabulary():
    tok = Tokenizer.from_gguf_metadata(byte_level_metadata("gpt2"))
    with pytest.raises(ModelFormatError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


# --- Hugging Face layout ---
def test_from_file_smollm2(tmp_path, smollm2, smollm2_oracle):
    smollm2_oracle.save_pretrained(tmp_path)  # tokenizer.json (+ config, chat template)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    for text in PROMPTS + SMOLLM2_SPECIALS:
        assert tok.encode(text) == smollm2.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.eos_ids) == (1, 2, False, {0, 2})
    assert tok.chat_template == smollm2.chat_template


def test_from_file_gemma3_reads_bos_from_the_post_processor(tmp_path, gemma3, gemma3_oracle):
    gemma3_oracle.save_pretrained(tmp_path)
    tok = Tokenizer.from_file(tmp_path)  # the directory works too
    for text in PROMPTS + GEMMA3_SPECIALS:
        assert tok.encode(text) == gemma3.encode(text)
        assert tok.decode(tok.encode(text)) == gemma3.decode(gemma3.encode(text))
    assert (tok.bos_id, tok.add_bos, tok.eos_ids) == (2, True, {1, 106})


def test_from_file_byte_tokenizer_with_unused_ids(tmp_path):
    """Like the random-weight stand-ins: 256 byte tokens, ids 256..298 unused, EOS at 299."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from pyml.nlp.tokenizer import BYTE_OF_CHAR
    backend = Backend(models.BPE(vocab={**BYTE_OF_CHAR, "<|endoftext|>": 299}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.encode("hé") == [ord("h"), 0xC3, 0xA9]
    assert tok.decode(tok.encode("hé 🤗")) == "hé 🤗"
    assert tok.eos_id == 299 and 299 in tok.eos_ids and not tok.add_bos


def test_from_file_errors(tmp_path):
    with pytest.raises(ModelFormatError, match="no such tokenizer file"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(PymlError, match="tokenizer.json"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")


def test_gguf_tokenizer_keeps_no_python_list_of_its_tokens(tmp_path):
    """The token texts live in the backend once built (issue 17: Gemma's 262K strings were 25 MB of
    Python objects kept beside the backend's own): nothing reachable from the Tokenizer is a
    Python sequence with an entry per token, and every token still decodes to its stored text."""
    from pyml.cli.standins import write_llama_gguf
    from pyml.nlp.loaders.gguf import GGUFFile

    f = GGUFFile(write_llama_gguf(tmp_path / "m.gguf", "llama-tiny", "q8_0"))
    texts = list(f.metadata["tokenizer.ggml.tokens"])
    tok = Tokenizer.from_gguf_metadata(f.metadata)
    seen, todo, lists = set(), [tok], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple, dict, set)) and len(obj) >= len(texts):
            lists.append(type(obj).__name__)
        todo.extend(gc.get_referents(obj))
    assert not lists
    assert [tok._vocab.text(i) for i in range(len(texts))] == texts
    assert tok.vocab_size == len(texts)
