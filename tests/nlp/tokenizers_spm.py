"""The oracle for pyml's SentencePiece encoder: the same GGUF vocabulary as a `tokenizers` BPE.

This is how pyml encoded SentencePiece GGUFs before it used Google's `sentencepiece` (kept here,
out of the product, because it is a second implementation of the rules by another library):
llama.cpp merges, over and over, the adjacent pair whose concatenation is the best-scored token;
a BPE model whose merges are every (left, right) split of every normal token, ranked by that
token's score, makes the same choices. Control, unknown and user-defined tokens are added tokens,
matched whole in the raw text; the space prefix is prepended to each stretch between them.
"""

from __future__ import annotations

import numpy as np
from gguf import TokenType
from tokenizers import AddedToken, normalizers
from tokenizers import Tokenizer as Backend
from tokenizers import models

SPACE = "\u2581"


def tokenizers_spm(metadata: dict) -> Backend:
    texts = list(metadata["tokenizer.ggml.tokens"])
    scores = [float(s) for s in metadata["tokenizer.ggml.scores"]]
    types = [int(t) for t in metadata["tokenizer.ggml.token_type"]]
    known = set(texts)
    keys, ids, cuts = [], [], []
    for i, (text, kind) in enumerate(zip(texts, types)):
        if kind != TokenType.NORMAL or len(text) < 2:
            continue
        for cut in range(1, len(text)):
            if text[:cut] in known and text[cut:] in known:
                keys.append(-scores[i])
                ids.append(i)
                cuts.append(cut)
    order = np.lexsort((np.array(cuts, np.int64), np.array(ids, np.int64), np.array(keys)))
    merges = [(texts[ids[j]][:cuts[j]], texts[ids[j]][cuts[j]:]) for j in order.tolist()]
    unk = next((t for t, k in zip(texts, types) if k == TokenType.UNKNOWN), None)
    backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(texts)}, merges=merges,
                                 byte_fallback=True, unk_token=unk))
    prefix = [normalizers.Prepend(SPACE)] if metadata.get("tokenizer.ggml.add_space_prefix", True) else []
    backend.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", SPACE)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(texts, types)
                                if k in (TokenType.CONTROL, TokenType.UNKNOWN) and t])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(texts, types)
                        if k == TokenType.USER_DEFINED and t])
    return backend
