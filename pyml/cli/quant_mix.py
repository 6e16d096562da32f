"""Which type each tensor gets in a K-quant mix (q4_k_m, ...): llama-quantize's rules.

A port of llama_tensor_get_type in llama.cpp's src/llama-quant.cpp for the K-quant file types,
without an imatrix, for dense (not mixture-of-experts) models other than Falcon and 70B:
    - tensors that are kept: 1-D, names not ending in "weight", norms, position embeddings;
    - the output matrix (and the token embedding when it is tied to it): Q6_K, or Q8_0 when its
      rows do not divide the type's block;
    - attention V and FFN down at higher types in some layers (use_more_bits: the first and last
      eighth, and every third layer between), attention output and QKV for the Q2_K/Q3_K mixes;
    - the fallback when a row does not divide 256 (SmolLM2's 576): Q2_K/Q3_K -> Q4_0,
      Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when even 32 does not divide it.
The counters (which attention V this is) run over the tensors in llama.cpp's order (llama_order).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gguf.constants import GGML_QUANT_SIZES

from pyml.quant import QuantType

Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = QuantType.Q2_K, QuantType.Q3_K, QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K

# mix -> (the type most tensors get, general.file_type: llama.cpp's LLAMA_FTYPE_MOSTLY_*)
MIXES = {"q2_k": (Q2_K, 10), "q3_k_s": (Q3_K, 11), "q3_k_m": (Q3_K, 12), "q3_k_l": (Q3_K, 13),
         "q4_k_s": (Q4_K, 14), "q4_k_m": (Q4_K, 15), "q5_k_s": (Q5_K, 16), "q5_k_m": (Q5_K, 17),
         "q6_k": (Q6_K, 18)}
FALLBACK = {Q2_K: QuantType.Q4_0, Q3_K: QuantType.Q4_0, Q4_K: QuantType.Q5_0, Q5_K: QuantType.Q5_1,
            Q6_K: QuantType.Q8_0}
# substrings of names llama-quantize never quantizes (those that occur in the architectures pyml reads)
KEPT = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight", "token_types.weight")


def llama_order(names: list[str]) -> list[str]:
    """The order llama.cpp's loader keeps weights in (weight_name_comparer): by layer number, the
    tensors outside a layer first, then by name. The mix's counters and the output file follow it."""
    def key(name):
        m = re.match(r"blk\.([+-]?\d+)\.", name)
        return (int(m.group(1)) if m else -1, name)
    return sorted(names, key=key)


def category(name: str) -> str:
    """tensor_get_category: the role a tensor's name gives it."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                      ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                      ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                      ("ffn_down", "ffn_down")):
        if part in name:
            return cat
    return "other"


def quantizable(name: str, n_dims: int) -> bool:
    """tensor_allows_quantization: 2-D (or 3-D) weights, not norms, not the embeddings of positions."""
    return n_dims >= 2 and name.endswith("weight") and not any(k in name for k in KEPT)


def block_of(qtype: QuantType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    # C's integer arithmetic; when i_layer - n/8 < 0 the first test has already answered
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


@dataclass
class MixPlan:
    """The running state of llama-quantize's choice over one file (quantize_state_impl)."""
    mix: str
    n_layers: int   # {arch}.block_count
    n_gqa: int      # query heads per key/value head
    n_attention_wv: int
    tied_embeddings: bool
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    fallbacks: list = field(default_factory=list)  # (name, wanted, got)

    @classmethod
    def for_file(cls, mix: str, names: list[str], n_layers: int, n_heads: int, n_kv_heads: int) -> "MixPlan":
        cats = [category(n) for n in names]
        return cls(mix, n_layers, max(1, n_heads // max(1, n_kv_heads)), cats.count("attn_v"),
                   "output" not in cats)

    def type_for(self, name: str, n_cols: int, n_dims: int, stored: QuantType) -> QuantType:
        """The type `name` (rows of n_cols) is written in; `stored` when it is kept as it is."""
        if not quantizable(name, n_dims):
            return stored
        wanted = self._by_role(name, n_cols, MIXES[self.mix][0])
        return self._fallback(name, n_cols, wanted)

    def _by_role(self, name: str, n_cols: int, t: QuantType) -> QuantType:
        mix, cat = self.mix, category(name)
        if cat == "output" or (self.tied_embeddings and cat == "token_embd"):
            return QuantType.Q8_0 if n_cols % block_of(t) else Q6_K
        if cat == "attn_v":
            i, n = self.i_attention_wv, self.n_attention_wv
            self.i_attention_wv += 1
            if mix == "q2_k":
                return Q4_K if self.n_gqa >= 4 else Q3_K
            if mix == "q3_k_m":
                return Q5_K if i < 2 else Q4_K
            if mix == "q3_k_l":
                return Q5_K
            if mix in ("q4_k_m", "q5_k_m") and use_more_bits(i, n):
                return Q6_K
            if mix == "q4_k_s" and i < 4:
                return Q5_K
            return t
        if cat == "ffn_down":
            i, n = self.i_ffn_down, self.n_layers
            self.i_ffn_down += 1
            if mix == "q2_k":
                return Q3_K
            if mix == "q3_k_m":
                return Q5_K if i < n // 16 else Q4_K
            if mix == "q3_k_l":
                return Q5_K
            if mix in ("q4_k_m", "q5_k_m") and use_more_bits(i, n):
                return Q6_K
            if mix == "q4_k_s" and i < n // 8:
                return Q5_K
            return t
        if cat == "attn_output":
            return {"q2_k": Q3_K, "q3_k_m": Q4_K, "q3_k_l": Q5_K}.get(mix, t)
        return t

    def _fallback(self, name: str, n_cols: int, t: QuantType) -> QuantType:
        if n_cols % block_of(t) == 0:
            return t
        got = FALLBACK.get(t, t)
        if n_cols % block_of(got):
            got = QuantType.F16
        self.fallbacks.append((name, t, got))
        return got
