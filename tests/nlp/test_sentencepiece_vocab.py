"""SentencePiece GGUF vocabularies encoded by Google's `sentencepiece` (pyml/nlp/sentencepiece_vocab.py).

Three oracles, none of them our encoder: the same rules as a `tokenizers` BPE
(tests/nlp/tokenizers_spm.py: how pyml encoded these files before), the `protobuf` reader with
sentencepiece's own schema for the ModelProto we write, and - in the `peer` tier, with the bench
extra's llama-cpp-python, which has no wheel on the package index and so is compiled on install -
llama.cpp's own tokenizer (`vocab_only`). transformers' GGUF tokenizer is compared in
test_tokenizer.py; its converter matches runs of spaces differently from llama.cpp, so it cannot
stand in for llama.cpp on this corpus.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from sentencepiece import sentencepiece_model_pb2

from pyml.nlp.loaders.gguf import GGUFFile
from pyml.nlp.sentencepiece_vocab import model_proto
from pyml.nlp.tokenizer import Tokenizer

from tests.nlp.test_tokenizer import BYTE_TOKENS, GEMMA3_SPECIALS, PROMPTS, spm_metadata, texts
from tests.nlp.tokenizers_spm import tokenizers_spm

DOCS = Path(__file__).resolve().parents[2] / "docs"
HARD = [
    "a" + " " * 39 + "b", " " * 70, "\t" * 40 + "x", "x\n\n\n\n\n\n\ny", "  \t \n\n  x  ", "\r\n\r\n",
    "\u3000wide space", "ꙮ𓀀", "\x00\x01\x7f", "🤗" * 5, "👩‍👩‍👧‍👦🇫🇷", "한국어 텍스트", "Ελληνικά", "עברית", "ไทย",
    "नमस्ते", "0", "00000000", "3.14e-10", "<0x41>", "<unused5>x", " <start_of_turn>",
    "<start_of_turn><end_of_turn>", "<eos><bos><pad>", "<start_of_turn", "start_of_turn>", "<start_of_image>",
    "[multimodal]",
]


def gemma_corpus():
    """The hard cases, the test prompts and every paragraph of the docs (tables, code, math)."""
    paragraphs = [p for doc in sorted(DOCS.glob("*.md")) for p in doc.read_text(encoding="utf-8").split("\n\n")]
    return PROMPTS + GEMMA3_SPECIALS + HARD + paragraphs


@pytest.fixture(scope="module")
def gemma3_file(gemma3_gguf):
    return GGUFFile(gemma3_gguf)


@pytest.fixture(scope="module")
def gemma3(gemma3_file):
    return Tokenizer.from_gguf_metadata(gemma3_file.metadata)


def test_gemma3_ids_match_the_tokenizers_build(gemma3, gemma3_file):
    reference = tokenizers_spm(gemma3_file.metadata)
    corpus = gemma_corpus()
    assert len(corpus) > 300
    for text in corpus:
        ids = gemma3.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        if "\u2581" not in text:  # a written "▁" reads back as a space, in llama.cpp too
            assert gemma3.decode(ids) == text
        assert gemma3.encode(text) == [2, *ids]  # BOS
    assert gemma3.encode("") == [2] and gemma3.encode("", add_special_tokens=False) == []


@pytest.mark.peer
def test_gemma3_ids_match_llamacpp(gemma3, gemma3_gguf):
    llama_cpp = pytest.importorskip("llama_cpp", reason='llama.cpp is the bench extra\'s peer: pip install ".[bench]"')
    llama = llama_cpp.Llama(str(gemma3_gguf), vocab_only=True, verbose=False)
    for text in gemma_corpus():
        ids = gemma3.encode(text, add_special_tokens=False)
        assert ids == llama.tokenize(text.encode("utf-8"), add_bos=False, special=True), text


CHAT = [{"role": "user", "content": "Hi  there\n\tok?"}, {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "日本語 🤗"}]


def test_gemma3_chat_template_tokens(gemma3, gemma3_file):
    ids = gemma3.encode(gemma3.apply_chat_template(CHAT))
    # the template writes <bos> itself: pyml keeps one (test_tokenizer.py), llama.cpp would add a second
    assert ids.count(105) == 4 and ids.count(106) == 3 and ids[0] == 2 and ids.count(2) == 1
    assert gemma3.decode(ids, skip_special_tokens=True) == gemma3.decode(
        [i for i in ids if i not in (2, 105, 106)])
    text = gemma3.decode(ids)  # the special tokens are atomic: every turn's text between them is the rules'
    reference = tokenizers_spm(gemma3_file.metadata)
    assert ids == reference.encode(text, add_special_tokens=False).ids


@pytest.mark.peer
def test_gemma3_chat_template_tokens_match_llamacpp(gemma3, gemma3_gguf):
    llama_cpp = pytest.importorskip("llama_cpp", reason='llama.cpp is the bench extra\'s peer: pip install ".[bench]"')
    llama = llama_cpp.Llama(str(gemma3_gguf), vocab_only=True, verbose=False)
    prompt = gemma3.apply_chat_template(CHAT)
    assert gemma3.encode(prompt) == llama.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)


# --- the ModelProto, read back by protobuf with sentencepiece's schema ---
def test_model_proto_reads_back_with_the_sentencepiece_schema():
    long_piece = "\u2581" + "é" * 70   # 143 bytes: the lengths take two bytes
    pieces = ["<unk>", "<s>", *BYTE_TOKENS[:2], "a", long_piece, "x" * 200, ""]
    scores = [0.0, 0.0, 0.0, 0.0, -1.5, -2.25, 3e-8, -1e30]
    types = [2, 3, 6, 6, 1, 1, 4, 5]
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto(pieces, scores, types, unk_id=0, byte_fallback=True))
    assert [p.piece for p in proto.pieces] == pieces
    assert [p.score for p in proto.pieces] == pytest.approx(np.float32(scores).tolist(), rel=0)
    assert [p.type for p in proto.pieces] == types
    spec = proto.trainer_spec
    assert (spec.model_type, spec.vocab_size, spec.byte_fallback) == (spec.BPE, len(pieces), True)
    assert (spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id) == (0, -1, -1, -1)
    norm = proto.normalizer_spec
    assert (norm.name, norm.add_dummy_prefix, norm.remove_extra_whitespaces, norm.escape_whitespaces) == \
        ("identity", False, False, False)
    assert not norm.precompiled_charsmap


# --- small hand-made vocabularies ---
def test_spm_tie_goes_to_the_leftmost_pair():
    """llama.cpp and sentencepiece: of two pairs whose merges score the same, the left one first."""
    tok = Tokenizer.from_gguf_metadata(spm_metadata({"a": -1, "b": -1, "c": -1, "bc": -5, "ab": -5},
                                                    add_space_prefix=False))
    assert texts(tok, tok.encode("abc", add_special_tokens=False)) == ["ab", "c"]
    assert texts(tok, tok.encode("cabc", add_special_tokens=False)) == ["c", "ab", "c"]


def test_spm_user_defined_tokens_are_whole_and_followed_by_a_space_prefix():
    metadata = spm_metadata({"\u2581": -1, "H": -2, "i": -3, "\u2581H": -4, "\u2581Hi": -5, "  ": -9})
    metadata["tokenizer.ggml.token_type"][-1] = 4  # "  " user-defined, as Gemma's whitespace runs
    tok = Tokenizer.from_gguf_metadata(metadata)
    reference = tokenizers_spm(metadata)
    for text in ["Hi  Hi", "  Hi", "Hi  ", "Hi     Hi", "</s>Hi", "Hi</s>  Hi<s>", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
    assert texts(tok, tok.encode("Hi  Hi", add_special_tokens=False)) == ["▁Hi", "  ", "▁Hi"]


def test_spm_unknown_characters_without_byte_pieces():
    """No <0xNN> pieces: a run of characters outside the vocabulary is one unknown token, as
    sentencepiece and Hugging Face's Llama tokenizers (fuse_unk) give (llama.cpp stops with an
    error: its byte_to_token finds no piece); with no unknown token either, they are left out."""
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": np.array([0, 0, 0, -1, -1, -2], np.float32),
                "tokenizer.ggml.token_type": np.array([2, 3, 3, 1, 1, 1], np.int32),
                "tokenizer.ggml.add_space_prefix": False}
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert texts(tok, tok.encode("abé", add_special_tokens=False)) == ["ab", "<unk>"]
    assert texts(tok, tok.encode("éé", add_special_tokens=False)) == ["<unk>"]
    assert texts(tok, tok.encode("éaéb", add_special_tokens=False)) == ["<unk>", "a", "<unk>", "b"]
    metadata["tokenizer.ggml.token_type"][0] = 3  # <unk> a control token, as Gemma's
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert texts(tok, tok.encode("éaéb<unk>", add_special_tokens=False)) == ["a", "b", "<unk>"]
    assert tok.vocab_size == len(tokens)


def random_vocabulary(rng: random.Random, alphabet: str, n_merged: int) -> dict:
    """Pieces built as SentencePiece BPE builds them: each new one two old ones joined, distinct scores."""
    pieces = {c: -float(i) for i, c in enumerate(alphabet)}
    while len(pieces) < len(alphabet) + n_merged:
        joined = rng.choice(list(pieces)) + rng.choice(list(pieces))
        if len(joined) <= 6:
            pieces.setdefault(joined, -len(alphabet) - rng.random() * 1000)
    return pieces


@pytest.mark.parametrize("seed", range(4))
def test_spm_random_vocabularies_match_the_tokenizers_build(seed):
    rng = random.Random(seed)
    alphabet = "ab\u2581cé"
    metadata = spm_metadata(random_vocabulary(rng, alphabet, 60), add_space_prefix=bool(seed % 2))
    tok = Tokenizer.from_gguf_metadata(metadata)
    reference = tokenizers_spm(metadata)
    for _ in range(300):
        text = "".join(rng.choice("ab cé\nx</s>") for _ in range(rng.randrange(0, 30)))
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        if not seed % 2 or "<s>" not in text and "</s>" not in text:  # a prefix after a special stays
            assert tok.decode(ids) == text


def test_spm_odd_vocabularies_load():
    """sentencepiece takes no empty piece and byte fallback only with all 256 byte pieces: an empty
    token is kept (never produced, decoded as nothing) and a partial byte set gives <unk> instead."""
    metadata = spm_metadata({"a": -1, "b": -2, "": -3, "ab": -4}, add_space_prefix=False)
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert texts(tok, tok.encode("abé", add_special_tokens=False)) == ["ab", "<0xC3>", "<0xA9>"]
    assert tok._vocab.text(261) == "" and tok.decode([261]) == ""
    metadata = spm_metadata({"a": -1, "b": -2, "ab": -4}, add_space_prefix=False)
    metadata["tokenizer.ggml.token_type"][3] = 1  # <0x00> a normal token: 255 byte pieces
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert texts(tok, tok.encode("abé", add_special_tokens=False)) == ["ab", "<unk>"]
