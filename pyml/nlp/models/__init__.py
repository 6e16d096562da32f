"""One file per architecture; this table maps a checkpoint's declared type to it."""

from pyml.nlp.models.gemma3 import Gemma3, Gemma3Config, Gemma3MultimodalConfig
from pyml.nlp.models.gpt2 import GPT2, GPT2Config
from pyml.nlp.models.llama import Llama, LlamaConfig
from pyml.nlp.models.mistral import Mistral
from pyml.nlp.models.phi3 import Phi3, Phi3Config
from pyml.nlp.models.qwen2 import Qwen2, Qwen2Config
from pyml.nlp.models.qwen3 import Qwen3, Qwen3Config

# Hugging Face config.json `model_type` -> (config class, model class)
HF_ARCHITECTURES = {
    "gpt2": (GPT2Config, GPT2),
    "llama": (LlamaConfig, Llama),
    "mistral": (LlamaConfig, Mistral),
    "qwen2": (Qwen2Config, Qwen2),
    "qwen3": (Qwen3Config, Qwen3),
    "phi3": (Phi3Config, Phi3),
    "gemma3_text": (Gemma3Config, Gemma3), "gemma3": (Gemma3MultimodalConfig, Gemma3),  # the latter refuses
}

# GGUF `general.architecture` -> (config class, model class)
GGUF_ARCHITECTURES = {
    "llama": (LlamaConfig, Llama),          # Llama 1-3.x and Mistral (the converter writes both as llama)
    "qwen2": (Qwen2Config, Qwen2),
    "qwen3": (Qwen3Config, Qwen3),
    "phi3": (Phi3Config, Phi3),
    "gemma3": (Gemma3Config, Gemma3),
}
