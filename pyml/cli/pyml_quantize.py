"""pyml-quantize: rewrite a GGUF file's weights in another type (q8_0, q4_0, q4_1, f16, f32).

Metadata (architecture, hyper-parameters, tokenizer, chat template) is copied as is;
every 2-D weight whose rows fit the target's block size is converted, through
float32 one tensor at a time, with pyml's quantizers (bit-compatible with ggml's
reference ones); 1-D tensors (norms, biases) stay float32 as llama.cpp keeps them.
The output is written with the `gguf` package's writer, so any GGUF reader loads it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from tqdm import tqdm

from pyml import quant
from pyml.cli.built_once import built_once
from pyml.cli.main import Parser, run_command
from pyml.core.errors import PymlError
from pyml.nlp.loaders import hub
from pyml.nlp.loaders.gguf import GGUFFile
from pyml.quant import QuantType

TARGETS = {"q8_0": QuantType.Q8_0, "q4_0": QuantType.Q4_0, "q4_1": QuantType.Q4_1,
           "f16": QuantType.F16, "f32": QuantType.F32}
# general.file_type values (llama.cpp's LLAMA_FTYPE_*) so other tools report the type right
FILE_TYPES = {QuantType.F32: 0, QuantType.F16: 1, QuantType.Q4_0: 2, QuantType.Q4_1: 3, QuantType.Q8_0: 7}


def quantize_gguf(src, dst, target: QuantType, progress: bool = True):
    GGUFFile(src)  # validates the input before anything is written
    reader = GGUFReader(src, "r")
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(FILE_TYPES[target])
    block = quant.traits_of(target).block_size
    for t in tqdm(reader.tensors, desc=f"quantizing to {target.name}", unit="tensor", file=sys.stderr,
                  disable=not progress):
        qtype = QuantType(int(t.tensor_type))
        ne = [int(n) for n in t.shape]
        if len(ne) < 2 or ne[0] % block:  # norms, biases, odd rows: copied unchanged
            data = np.asarray(t.data)  # quantized: (rows, row_bytes), which the writer maps back to ne
            writer.add_tensor(t.name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
            continue
        f32 = quant.dequantize(np.asarray(t.data).reshape(math.prod(ne[1:]), -1), qtype, ne[0])
        out = quant.quantize(f32, target)
        writer.add_tensor(t.name, out.reshape(list(reversed(ne))[:-1] + [out.shape[-1]]),
                          raw_dtype=target if out.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return Path(dst)


def requantized(src: Path, kind: str) -> Path:
    """`src` rewritten as `kind` (q8_0, q4_0, ...) beside the model cache, built once and reused."""
    out = Path(hub.cache_dir()) / "models" / f"{Path(src).stem}.{kind.upper()}.pyml.gguf"
    stale = out.exists() and out.stat().st_mtime < Path(src).stat().st_mtime
    return built_once(out, lambda path: quantize_gguf(src, path, TARGETS[kind], progress=sys.stderr.isatty()),
                      stale)


def build_parser() -> Parser:
    p = Parser(prog="pyml-quantize", description=__doc__.split("\n")[0])
    p.add_argument("src", help="input GGUF file or known model name (smollm2-135m)")
    p.add_argument("dst", help="output GGUF file")
    p.add_argument("--type", required=True, choices=sorted(TARGETS))
    return p


def run(args) -> int:
    src = hub.resolve_gguf(args.src)
    if Path(args.dst).resolve() == Path(src).resolve():
        raise PymlError("the output would overwrite the input")
    quantize_gguf(src, args.dst, TARGETS[args.type], progress=sys.stderr.isatty())
    print(f"pyml-quantize: wrote {args.dst} ({args.type})", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_command("pyml-quantize", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
