"""A GGUF's SentencePiece vocabulary ("llama") encoded by Google's `sentencepiece` library.

The GGUF keeps what SentencePiece's own model file keeps - each piece's text, score and type -
so we write those into a ModelProto (the format `tokenizer.model` files use) and load it with
`SentencePieceProcessor`: its BPE merges, over and over, the adjacent pair whose concatenation
is the best-scored piece (the leftmost on a tie), as llama.cpp's llm_tokenizer_spm does, and
spells what no piece covers as `<0xNN>` bytes. It holds one copy of the vocabulary (Gemma 3's
262,144 pieces: ~48 MiB, against ~78 MiB for the same rules as a `tokenizers` BPE with 513,511
merges) and loads in ~0.05 s after ~0.4 s of writing the proto.

What SentencePiece does not do the way llama.cpp reads a GGUF is done here, around it:
- control and user-defined tokens are matched whole in the raw text, the longest first, before
  anything else (llama.cpp's tokenizer_st_partition), by a `tokenizers` added-token matcher; in
  the proto they are typed CONTROL, which SentencePiece never matches in text nor merges into;
- each stretch of text between them gets the space prefix (when the file asks for it) and its
  spaces written as "▁" here, so the proto's normalizer is the identity.
"""

from __future__ import annotations

import numpy as np
from gguf import TokenType
from sentencepiece import SentencePieceProcessor
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Matcher
from tokenizers import models as _models

from pyml.core.errors import ModelFormatError

SPACE = "\u2581"  # SentencePiece's visible space, "▁"
# texts of pieces the proto needs and the file has not (U+FFFE is no character: no vocabulary has it)
_UNKNOWN_PIECE = "\ufffepyml-unk"   # the unknown piece, when the file types none UNKNOWN
_EMPTY_PIECE = "\ufffepyml-empty-"  # + id: a token whose text is empty

# ModelProto fields (sentencepiece_model.proto), as tag bytes: field number << 3 | wire type
_TRAINER_SPEC, _NORMALIZER_SPEC = b"\x12", b"\x1a"  # fields 2, 3: length-delimited (field 1, the pieces: model_proto)
_BPE = 2  # TrainerSpec.model_type


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, value: int) -> bytes:
    """A varint field; a negative int32 is written as protobuf does, in ten bytes."""
    return _varint(tag << 3) + _varint(value if value >= 0 else value + (1 << 64))


def model_proto(texts, scores, types, unk_id: int, byte_fallback: bool) -> bytes:
    """A serialised ModelProto: every piece (text, score, type), BPE, identity normalizer.

    `types` are SentencePiece's piece types (the same numbers as gguf.TokenType). Each piece is
    `0A len(msg) 0A len(text) text 15 score(f32) 18 type`, its lengths varints; the pieces are laid
    out with NumPy, all at once (a loop over Gemma 3's 262,144 pieces took ~0.5 s of every load)."""
    raws = [t.encode("utf-8") for t in texts]
    n_text = np.fromiter(map(len, raws), np.int64, len(raws))
    n_msg = 1 + _varint_sizes(n_text) + n_text + 7  # the text's field, then 15 + f32 and 18 + one-byte type
    size = 1 + _varint_sizes(n_msg) + n_msg
    at = np.zeros(len(raws) + 1, np.int64)
    np.cumsum(size, out=at[1:])
    out = np.empty(int(at[-1]), np.uint8)
    at = at[:-1]
    out[at] = 0x0A  # field 1 (pieces), length-delimited
    text_at = _put_varint(out, at + 1, n_msg)
    out[text_at] = 0x0A  # the piece's field 1 (piece), length-delimited
    text_at = _put_varint(out, text_at + 1, n_text)
    joined = np.frombuffer(b"".join(raws), np.uint8)
    first = np.zeros(len(raws), np.int64)
    np.cumsum(n_text[:-1], out=first[1:])
    out[np.arange(joined.size) + np.repeat(text_at - first, n_text)] = joined
    tail = text_at + n_text
    out[tail] = 0x15  # field 2 (score), fixed32
    out[tail[:, None] + np.arange(1, 5)] = np.asarray(scores, "<f4").view(np.uint8).reshape(-1, 4)
    out[tail + 5] = 0x18  # field 3 (type), varint of one byte: 1 .. 6
    out[tail + 6] = np.asarray(types, np.uint8)
    trainer = (_field(3, _BPE) + _field(4, len(texts)) + _field(35, int(byte_fallback))
               + _field(40, unk_id) + _field(41, -1) + _field(42, -1) + _field(43, -1))
    # identity, no dummy prefix, extra whitespace kept, spaces not escaped: all done by the caller
    normalizer = b"\x0a\x08identity" + _field(3, 0) + _field(4, 0) + _field(5, 0)
    return b"".join((out.tobytes(), _TRAINER_SPEC, _varint(len(trainer)), trainer,
                     _NORMALIZER_SPEC, _varint(len(normalizer)), normalizer))


def _varint_sizes(values: np.ndarray) -> np.ndarray:
    """How many bytes each non-negative value takes as a varint (7 bits a byte)."""
    sizes = np.ones(values.shape, np.int64)
    for bits in range(7, 64, 7):
        sizes += values >= (1 << bits)
    return sizes


def _put_varint(out: np.ndarray, at: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Writes each value as a varint at its offset; returns the offsets just past them."""
    left = values.copy()
    more = np.ones(values.shape, bool)
    while more.any():
        byte = left & 0x7F
        left >>= 7
        out[at[more]] = (byte | np.where(left > 0, 0x80, 0))[more]
        at = at + more
        more &= left > 0
    return at


class SentencePieceEncoder:
    """Text -> ids for a GGUF SentencePiece vocabulary; id -> the text the file stores."""

    def __init__(self, texts, scores, types, space_prefix: bool, source: str):
        n = len(texts)
        # plain ints: comparing an int with an enum member is ~10x slower, over 262,144 tokens
        normal, byte, control, unknown = (int(TokenType.NORMAL), int(TokenType.BYTE), int(TokenType.CONTROL),
                                          int(TokenType.UNKNOWN))
        whole = {control, int(TokenType.USER_DEFINED), unknown}
        unk_id = next((i for i, k in enumerate(types) if k == unknown), None)
        # SentencePiece merges into NORMAL pieces only and reads BYTE ones (<0xNN>) for the
        # fallback; every other token is one SentencePiece never produces (CONTROL), but for one UNKNOWN
        piece_types = [k if k == normal or k == byte and _is_byte_piece(t) else control
                       for t, k in zip(texts, types)]
        # it takes no empty piece: a stand-in text for one, never matched (CONTROL), never decoded
        self._empty = frozenset(i for i, t in enumerate(texts) if not t)
        if self._empty:
            texts = [t or f"{_EMPTY_PIECE}{i}" for i, t in enumerate(texts)]
            for i in self._empty:
                piece_types[i] = control
        if unk_id is None:  # SentencePiece needs one: an extra piece, dropped from what encode gives
            texts, scores, unk_id = [*texts, _UNKNOWN_PIECE], [*scores, 0.0], n
            piece_types.append(unknown)
        else:
            piece_types[unk_id] = unknown
        # byte fallback needs all 256 byte pieces; without them an unknown character is <unk>
        byte_fallback = piece_types.count(byte) == 256
        if not byte_fallback:
            piece_types = [control if k == byte else k for k in piece_types]
        proto = model_proto(texts, scores, piece_types, unk_id, byte_fallback)
        del piece_types
        self._processor = SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(proto)
        except (RuntimeError, OSError) as e:
            raise ModelFormatError(f"{source}: sentencepiece refuses the vocabulary ({e})") from None
        self._n = n
        self._space_prefix = space_prefix
        # the whole-matched tokens: an added-token matcher over a model that calls any other
        # stretch of text `n` (a word-level model with one word, never matched)
        matched = np.flatnonzero(np.isin(np.asarray(types[:n], np.int64), list(whole)))
        special = {texts[i]: i for i in matched.tolist() if texts[i]}
        self._text_id = n
        self._matcher = None
        if special:
            stretch = "\x00pyml-text"
            self._matcher = _Matcher(_models.WordLevel({**special, stretch: n}, unk_token=stretch))
            self._matcher.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, its control and user-defined tokens matched whole."""
        if self._matcher is None:
            return self._encode_stretches([text])[0] if text else []
        found = self._matcher.encode(text, add_special_tokens=False)
        stretches = [text[a:b] for i, (a, b) in zip(found.ids, found.offsets) if i == self._text_id]
        pieces = iter(self._encode_stretches(stretches))
        ids = []
        for i in found.ids:
            if i == self._text_id:
                ids += next(pieces)
            else:
                ids.append(i)
        return ids

    def _encode_stretches(self, stretches: list) -> list:
        """Each stretch between whole-matched tokens: the space prefix, "▁" for spaces, then BPE."""
        prefix = SPACE if self._space_prefix else ""
        encode, n = self._processor.EncodeAsIds, self._n
        # one call per stretch: a list in one call would run on a pool of new threads
        return [[i for i in encode(prefix + s.replace(" ", SPACE)) if i < n] for s in stretches]

    def id_to_token(self, token_id: int) -> str | None:
        """The token's text as the file stores it (None outside the vocabulary)."""
        if not 0 <= token_id < self._n:
            return None
        return "" if token_id in self._empty else self._processor.id_to_piece(token_id)


def _is_byte_piece(text: str) -> bool:
    """"<0x0A>": a byte piece as SentencePiece spells it."""
    return len(text) == 6 and text.startswith("<0x") and text.endswith(">") and all(
        c in "0123456789ABCDEF" for c in text[3:5])
