"""One file per architecture; this table maps a checkpoint's declared type to it."""

from pyml.nlp.models.gpt2 import GPT2, GPT2Config

# Hugging Face config.json `model_type` -> (config class, model class)
HF_ARCHITECTURES = {
    "gpt2": (GPT2Config, GPT2),
}

# GGUF `general.architecture` -> (config class, model class)
GGUF_ARCHITECTURES = {}
