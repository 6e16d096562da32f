"""OpenVINO GenAI as a pyml-bench peer: the same weights, exported by optimum-intel at the
matching precision, measured through `openvino_genai.LLMPipeline` with token ids in.

optimum-intel (the exporter) pins transformers < 5.6 and needs torchvision, which cannot share
an environment with this project's test oracles (transformers 5.x, torch 2.13.0 alone), so the
export runs once per model file in an environment of its own under ~/.cache/pyml/peers/openvino;
pyml's bench extra holds only openvino-genai (no torch), which runs the exported model.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from pyml.cli.built_once import built_once
from pyml.core.errors import PymlError
from pyml.nlp.loaders.hub import cache_dir

# The exporter's environment. torch is pinned exactly (any other version pulls a CUDA build), and
# torchvision (which optimum-intel requires) to the release that asks for that torch; it is then
# removed again: its compiled ops are built for PyPI's CUDA torch, and with the CPU build they
# make `import transformers.models.llama` fail ("operator torchvision::nms does not exist").
# Text models never need it. transformers stops at 5.0: optimum-intel 2.2.0 refuses to export
# Gemma 3 with a later one ("Maximum required is 5.0").
EXPORT_REQUIREMENTS = ["torch==2.13.0", "torchvision==0.28.0", "transformers>=4.51,<5.1",
                       "optimum-intel[openvino]==2.2.0", "accelerate", "gguf"]

# GGUF weight type -> optimum-cli's compression at the matching precision (int8 per channel,
# int4 in groups of 32 as the ggml 4-bit blocks, fp16, or none).
WEIGHT_FORMATS = {
    "Q8_0": ["--weight-format", "int8"],
    "Q4_0": ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0", "--sym"],
    "Q4_1": ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"],
    "Q4_K_M": ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"],
    "F16": ["--weight-format", "fp16"],
    "F32": ["--weight-format", "fp32"],
}

# Run in the exporter's environment: a GGUF is dequantized to float32 by transformers and saved
# as a Hugging Face directory first; a directory is exported as it is.
_TO_HF = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
src, name, out = sys.argv[1:4]
kw = {"gguf_file": name} if name else {}
AutoModelForCausalLM.from_pretrained(src, dtype="float32", **kw).save_pretrained(out)
AutoTokenizer.from_pretrained(src, **kw).save_pretrained(out)
"""


def peer_root() -> Path:
    return cache_dir() / "peers" / "openvino"


def _python() -> Path:
    return peer_root() / "venv" / "bin" / "python"


def _run(cmd, what: str):
    print(f"pyml-bench: openvino: {what}", file=sys.stderr, flush=True)
    done = subprocess.run([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no message)"]
        raise PymlError(f"openvino: {what} failed: {tail[0]}")


def export_environment() -> Path:
    """The exporter's Python, made on first use (about 2 GB of wheels from the package index)."""
    python = _python()
    done = peer_root() / "venv" / ".complete"  # holds the requirements it was made with
    if not done.exists() or done.read_text() != "\n".join(EXPORT_REQUIREMENTS):
        _run([sys.executable, "-m", "venv", peer_root() / "venv"], "making the export environment")
        _run([python, "-m", "pip", "install", "-q", *EXPORT_REQUIREMENTS],
             "installing optimum-intel into it (once; a few minutes)")
        _run([python, "-m", "pip", "uninstall", "-q", "-y", "torchvision"], "removing torchvision")
        done.write_text("\n".join(EXPORT_REQUIREMENTS))
    return python


def exported(path: Path, quant: str) -> Path:
    """The OpenVINO IR of a model file or directory at the precision matching `quant`, exported once."""
    if quant not in WEIGHT_FORMATS:
        raise PymlError(f"openvino: no matching precision for {quant}")
    out = peer_root() / "models" / f"{path.stem if path.is_file() else path.name}-{quant.lower()}"

    def export(folder):
        python = export_environment()
        hf = folder.with_name(folder.name + ".hf")
        try:
            source = path
            if path.is_file():
                _run([python, "-c", _TO_HF, path.parent, path.name, hf], f"dequantizing {path.name} with transformers")
                source = hf
            cli = python.parent / "optimum-cli"
            _run([cli, "export", "openvino", "--model", source, "--task", "text-generation-with-past",
                  *WEIGHT_FORMATS[quant], folder], f"exporting {path.name} ({' '.join(WEIGHT_FORMATS[quant][1:])})")
        finally:
            shutil.rmtree(hf, ignore_errors=True)
    return built_once(out, export)
