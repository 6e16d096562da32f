"""The GGUF-metadata tokenizers of the Llama 3, Qwen2/Qwen3, Mistral (SPM and tekken) and Phi-3
families against an independent oracle: transformers' PreTrainedTokenizerFast on a tokenizer.json
in the family's real format (its pre-tokenizer regex as the model's own tokenizer.json spells
it, its normalizer, its BPE options), trained on a small corpus by the `tokenizers` library.

The GGUF metadata is what llama.cpp's converter writes from such a tokenizer: the token texts
in id order, token types, `left right` merges (byte-level) or per-token scores (SentencePiece:
a merged piece scores minus its merge rank; no merges are stored, pyml rebuilds them).
"""

from __future__ import annotations

import json

import pytest
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend
from tokenizers import models as bpe_models

from pyml.core.errors import UnsupportedError
from pyml.nlp.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
    "I'm sure you're right; they'll say it's what we'd've done. DON'T, WON'T, I'M, He'S",
    "Numbers: 1 12 123 1234 12345 3.14159 1,000,000 2024-06-01 0x1F 007",
    "北京欢迎你。東京は日本の首都です。안녕하세요 세계",
    "Emoji: 👍🏽 🎉🎉 🇫🇷 ❤️ — and “quotes” … ¿qué? naïve café résumé",
    "line one\nline two\n\n\nline five\r\nwindows line\ttab\t\tdouble tab",
    "   leading spaces, trailing spaces   ",
    "multiple     spaces   between    words",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    "snake_case camelCase PascalCase SCREAMING_CASE kebab-case path/to/file.txt http://example.com/a?b=c",
    "a/b//c ///d \\ back\\slash {\"json\": [1, 2, 3]} <tag attr='v'>text</tag>",
    "Ünïcödé ÀÉÎÕÜ ß ﬁ ǅ ǈ Ⅻ ½ ² ٣ ४",
    "",
    " ",
    "\n",
]

# each family's pre-tokenizer regex as its real tokenizer.json spells it (not as pyml does)
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

BYTE_LEVEL_FAMILIES = {
    # pre: (regex, ignore_merges, NFC normalizer, special tokens (the first is BOS, the second EOS), BOS added)
    "llama-bpe": (LLAMA3_REGEX, True, False, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                                               "<|start_header_id|>", "<|end_header_id|>"], True),
    "qwen2": (QWEN2_REGEX, False, True, ["<|endoftext|>", "<|im_end|>", "<|im_start|>"], False),
    "tekken": (TEKKEN_REGEX, True, False, ["<s>", "</s>", "[INST]", "[/INST]"], True),
}


def transformers_oracle(backend: Backend):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def train_byte_level(regex: str, ignore_merges: bool, nfc: bool, specials: list) -> Backend:
    """A byte-level BPE tokenizer in the family's tokenizer.json format.

    Its merges are learnt over whole space-separated words, so that tokens cross the boundaries the
    family's regex draws (digit runs, case changes, contractions, punctuation): reading it with
    another family's regex then gives other ids, which a test of the regex needs."""
    backend = Backend(bpe_models.BPE(ignore_merges=ignore_merges))
    if nfc:
        backend.normalizer = normalizers.NFC()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?\S+|\s+"), behavior="isolated"), byte_level])
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 4, trainer)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False), byte_level])
    backend.decoder = decoders.ByteLevel()
    return backend


def byte_level_gguf_metadata(backend: Backend, pre: str, specials: list) -> dict:
    """What convert_hf_to_gguf's _set_vocab_gpt2 writes for this tokenizer."""
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    texts = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in texts] == list(range(len(texts)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": texts,
            "tokenizer.ggml.token_type": [TokenType.CONTROL if t in specials else TokenType.NORMAL for t in texts],
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": vocab[specials[0]], "tokenizer.ggml.eos_token_id": vocab[specials[1]]}


@pytest.fixture(scope="module", params=sorted(BYTE_LEVEL_FAMILIES))
def byte_level_family(request):
    pre = request.param
    regex, ignore_merges, nfc, specials, adds_bos = BYTE_LEVEL_FAMILIES[pre]
    backend = train_byte_level(regex, ignore_merges, nfc, specials)
    metadata = byte_level_gguf_metadata(backend, pre, specials)
    if adds_bos:  # the family's tokenizer.json post-processor puts BOS first
        backend.post_processor = processors.TemplateProcessing(
            single=f"{specials[0]} $A", special_tokens=[(specials[0], backend.token_to_id(specials[0]))])
    family_tokenizer_json[pre] = backend.to_str()
    return pre, Tokenizer.from_gguf_metadata(metadata, source=pre), transformers_oracle(backend), specials


family_tokenizer_json = {}


def family_texts(specials):
    chat = f"{specials[-1]}user\nHello, how are you?{specials[1]}\n{specials[-1]}assistant\n"
    return [*CORPUS, "".join(CORPUS), chat, f"{specials[0]}text after BOS", f"no space{specials[1]}after"]


def assert_same_ids(family, tokenizer, oracle, texts):
    for text in texts:
        assert tokenizer.encode(text, add_special_tokens=False) == \
            oracle.encode(text, add_special_tokens=False), (family, text)


def test_byte_level_families_encode_as_transformers(byte_level_family):
    pre, tokenizer, oracle, specials = byte_level_family
    assert_same_ids(pre, tokenizer, oracle, family_texts(specials))


def test_byte_level_families_add_bos_as_their_post_processor(byte_level_family):
    pre, tokenizer, oracle, specials = byte_level_family
    assert tokenizer.add_bos == BYTE_LEVEL_FAMILIES[pre][4] and not tokenizer.add_eos
    for text in ("Hello world", "12345 北京"):
        assert tokenizer.encode(text) == oracle.encode(text), (pre, text)


def test_byte_level_families_decode_as_transformers(byte_level_family):
    pre, tokenizer, oracle, specials = byte_level_family
    for text in family_texts(specials):
        ids = oracle.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == oracle.decode(ids) == text, (pre, text)


def test_byte_level_families_from_tokenizer_json(byte_level_family, tmp_path):
    """The same tokenizer from the Hugging Face side (tokenizer.json + tokenizer_config.json)."""
    pre, from_gguf, oracle, specials = byte_level_family
    (tmp_path / "tokenizer.json").write_text(family_tokenizer_json[pre], encoding="utf-8")
    bos = specials[0] if BYTE_LEVEL_FAMILIES[pre][4] else None  # Qwen2's config has bos_token null
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": specials[1]}))
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tokenizer.add_bos == from_gguf.add_bos and tokenizer.eos_id == from_gguf.eos_id
    assert tokenizer.bos_id == (from_gguf.bos_id if bos else None)
    for text in family_texts(specials):
        want = oracle.encode(text)
        if bos and want[:2] == [want[0]] * 2:
            want = want[1:]  # a text that starts with BOS keeps one (transformers would add a second)
        assert tokenizer.encode(text) == want == from_gguf.encode(text), (pre, text)
        assert tokenizer.decode(oracle.encode(text, add_special_tokens=False)) == text


def test_byte_level_digits_are_grouped_as_each_family_says(byte_level_family):
    """The one place the families' regexes visibly differ: llama3 takes digits 3 at a time,
    qwen2 and tekken one at a time (checked on the oracle's own pre-tokenizer)."""
    pre, tokenizer, oracle, _ = byte_level_family
    words = [w for w, _ in oracle.backend_tokenizer.pre_tokenizer.pre_tokenize_str("12345")]
    assert words == (["123", "45"] if pre == "llama-bpe" else list("12345"))
    ids = tokenizer.encode("12345", add_special_tokens=False)
    assert "".join(tokenizer.decode([i]) for i in ids) == "12345"
    assert all(len(tokenizer.decode([i])) <= (3 if pre == "llama-bpe" else 1) for i in ids)


# --- SentencePiece BPE: Mistral v0.1-v0.3 and Phi-3 (tokenizer.ggml.model "llama") ---
SPM_SPECIALS = {"mistral": ["[INST]", "[/INST]"], "phi3": ["<|user|>", "<|assistant|>", "<|end|>"]}


def train_sentencepiece_bpe(extra_specials: list):
    """A Llama-2/Mistral-format tokenizer.json (Prepend + Replace normalizer, no pre-tokenizer, BPE with
    byte fallback, <0xNN> byte tokens after <unk> <s> </s>), and its merges in rank order."""
    trainer_backend = Backend(bpe_models.BPE())
    trainer_backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # words, for training
    trainer_backend.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=500, show_progress=False))
    trained = json.loads(trainer_backend.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    texts = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    texts += sorted(trained["vocab"], key=trained["vocab"].get)
    texts += extra_specials
    vocab = {t: i for i, t in enumerate(texts)}
    backend = Backend(bpe_models.BPE(vocab={t: i for t, i in vocab.items() if t not in extra_specials},
                                     merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ["<unk>", "<s>", "</s>", *extra_specials]])
    return backend, texts, merges


def sentencepiece_gguf_metadata(texts: list, merges: list, extra_specials: list, **extra) -> dict:
    """What the converter writes for a SentencePiece model: texts, scores (a merged piece: minus its
    merge rank, as sentencepiece scores BPE pieces), types; no merges."""
    rank = {a + b: r for r, (a, b) in enumerate(merges)}
    types, scores = [], []
    for i, text in enumerate(texts):
        if text == "<unk>":
            types.append(TokenType.UNKNOWN)
        elif text in ("<s>", "</s>") or text in extra_specials:
            types.append(TokenType.CONTROL)
        elif 3 <= i < 259:
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
        scores.append(-float(rank[text]) if text in rank else -1e6 - i)
    return {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": texts,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **extra}


@pytest.fixture(scope="module", params=sorted(SPM_SPECIALS))
def spm_family(request):
    specials = SPM_SPECIALS[request.param]
    backend, texts, merges = train_sentencepiece_bpe(specials)
    add_bos = request.param == "mistral"  # Phi-3's tokenizer_config says add_bos_token false
    metadata = sentencepiece_gguf_metadata(texts, merges, specials, **{"tokenizer.ggml.add_bos_token": add_bos})
    return request.param, Tokenizer.from_gguf_metadata(metadata), transformers_oracle(backend), specials


def spm_texts(specials):
    turn = f"{specials[0]} What is 2+2?{specials[1]} It is 4.{specials[-1]}"
    return [*CORPUS, "".join(CORPUS), turn, f"{specials[0]}\nno space after a special{specials[-1]}"]


def test_sentencepiece_families_encode_as_transformers(spm_family):
    family, tokenizer, oracle, specials = spm_family
    assert_same_ids(family, tokenizer, oracle, spm_texts(specials))


def test_sentencepiece_families_decode_as_transformers(spm_family):
    family, tokenizer, oracle, specials = spm_family
    for text in CORPUS:
        ids = oracle.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == oracle.decode(ids), (family, text)


def test_sentencepiece_add_bos_flag_is_honoured(spm_family):
    family, tokenizer, _, _ = spm_family
    ids = tokenizer.encode("Hello")
    assert (ids[0] == 1) == (family == "mistral") and tokenizer.add_bos == (family == "mistral")
    assert 2 in tokenizer.eos_ids
    if family == "phi3":
        assert tokenizer.encode("<|end|>", add_special_tokens=False) == [tokenizer.vocab_size - 1]
        assert tokenizer.vocab_size - 1 in tokenizer.eos_ids  # <|end|> ends a Phi-3 turn


def test_unknown_pre_tokenizer_is_refused_by_name():
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": ["a"],
                "tokenizer.ggml.merges": []}
    with pytest.raises(UnsupportedError, match="tokenizer.ggml.pre 'qwen35' is not supported"):
        Tokenizer.from_gguf_metadata(metadata)
