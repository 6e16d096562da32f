"""Mistral (7B v0.1-v0.3, and the small models of its layout): Llama with a sliding attention window.

HF `model_type` "mistral" (modeling_mistral.py): the Llama block, plus `sliding_window` when
set (v0.1: 4096; v0.2 and later: null), which LlamaConfig reads and Attention masks.
GGUF: the converter writes Mistral as `general.architecture = llama` (conversion/llama.py
registers MistralForCausalLM on LlamaModel), with the Llama Q/K row permutation; it writes no
sliding-window key, so a v0.1 GGUF attends to the whole context, as llama.cpp does.
"""

from pyml.nlp.models.llama import Llama


class Mistral(Llama):
    arch = "mistral"
