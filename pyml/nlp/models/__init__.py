"""One file per architecture; this table maps a checkpoint's declared type to it."""

from pyml.nlp.models.gpt2 import GPT2, GPT2Config
from pyml.nlp.models.llama import Llama, LlamaConfig

# Hugging Face config.json `model_type` -> (config class, model class)
HF_ARCHITECTURES = {
    "gpt2": (GPT2Config, GPT2),
    "llama": (LlamaConfig, Llama),
}

# GGUF `general.architecture` -> (config class, model class)
GGUF_ARCHITECTURES = {
    "llama": (LlamaConfig, Llama),
}
