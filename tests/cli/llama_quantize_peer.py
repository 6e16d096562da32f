"""Files written by llama.cpp's own quantizer (llama_model_quantize through llama-cpp-python), built once
into the model cache: the oracle for pyml-quantize's K-quant mixes. Peer tests only (CI has no llama_cpp)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyml.cli.built_once import built_once
from pyml.nlp.loaders import hub


def llama_quantized(src: Path, kind: str) -> Path:
    """`src` (F16/F32 GGUF) quantized by llama-quantize's code as `kind` (q4_k_m, ...), no imatrix."""
    out = Path(hub.cache_dir()) / "models" / f"{Path(src).stem}.{kind.upper()}.llama.gguf"

    def build(path: Path):
        llama_cpp = pytest.importorskip("llama_cpp", reason='llama.cpp is the bench extra\'s peer: pip install ".[bench]"')
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
        params.nthread = 1  # a shared machine; the result does not depend on it
        if llama_cpp.llama_model_quantize(str(src).encode(), str(path).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize failed for {kind}")

    return built_once(out, build, out.exists() and out.stat().st_mtime < Path(src).stat().st_mtime)
