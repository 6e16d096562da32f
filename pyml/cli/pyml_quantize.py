"""pyml-quantize: rewrite a GGUF file's weights in another type: one type for every weight (q8_0,
q4_0, q4_1, f16, f32), or a K-quant mix (q2_k, q3_k_s/m/l, q4_k_s/m, q5_k_s/m, q6_k) with
llama-quantize's per-tensor types (quant_mix.py).

Metadata (architecture, hyper-parameters, tokenizer, chat template) is copied as is;
weights are converted through float32 one tensor at a time, with pyml's quantizers
(bit-compatible with ggml's reference ones, what llama-quantize runs without an imatrix);
1-D tensors (norms, biases) are copied as llama.cpp keeps them.
The output is written with the `gguf` package's writer, so any GGUF reader loads it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from pyml import quant
from pyml.cli.built_once import built_once
from pyml.cli.main import Parser, run_command, say
from pyml.cli.options import check_output_file
from pyml.cli.quant_mix import MIXES, MixPlan, llama_order
from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.core.progress import bar
from pyml.nlp.loaders import hub
from pyml.nlp.loaders.gguf import GGUFFile, read_checked
from pyml.quant import QuantType, kquantizers, quantizers

TARGETS = {"q8_0": QuantType.Q8_0, "q4_0": QuantType.Q4_0, "q4_1": QuantType.Q4_1,
           "f16": QuantType.F16, "f32": QuantType.F32}
# general.file_type values (llama.cpp's LLAMA_FTYPE_*) so other tools report the type right
FILE_TYPES = {QuantType.F32: 0, QuantType.F16: 1, QuantType.Q4_0: 2, QuantType.Q4_1: 3, QuantType.Q8_0: 7}
# the quantizers the traits table does not carry yet: the K-quants, and Q5_0/Q5_1 (the mixes' fallbacks)
ROW_QUANTIZERS = {QuantType.Q2_K: kquantizers.quantize_q2_k, QuantType.Q3_K: kquantizers.quantize_q3_k,
                  QuantType.Q4_K: kquantizers.quantize_q4_k, QuantType.Q5_K: kquantizers.quantize_q5_k,
                  QuantType.Q6_K: kquantizers.quantize_q6_k, QuantType.Q5_0: quantizers.quantize_q5_0,
                  QuantType.Q5_1: quantizers.quantize_q5_1}
FLOATS = (QuantType.F32, QuantType.F16, QuantType.BF16)
KINDS = sorted(TARGETS) + list(MIXES)

_perf = perf.get("pyml.cli.quantize")


def quantize_rows(f32: np.ndarray, qtype: QuantType) -> np.ndarray:
    """float32 [R, n] -> the stored rows of `qtype`."""
    if qtype not in ROW_QUANTIZERS:
        return quant.quantize(f32, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    return ROW_QUANTIZERS[qtype](np.ascontiguousarray(f32, np.float32),
                                 np.empty((f32.shape[0], f32.shape[1] // block * size), np.uint8))


class _OneType:
    """Every weight whose rows fit the block in `target` (the single-type kinds), the rest kept."""

    def __init__(self, target: QuantType):
        self.target, self.fallbacks = target, []

    def type_for(self, name, n_cols, n_dims, stored):
        return self.target if n_dims >= 2 and n_cols % quant.traits_of(self.target).block_size == 0 else stored


def _plan(reader: GGUFReader, kind: str):
    if kind in TARGETS:
        return _OneType(TARGETS[kind]), FILE_TYPES[TARGETS[kind]]
    arch = reader.fields["general.architecture"].contents()
    meta = {k: reader.fields[f"{arch}.{k}"].contents() for k in ("block_count", "attention.head_count")}
    kv = reader.fields.get(f"{arch}.attention.head_count_kv")
    heads = meta["attention.head_count"]
    kv_heads = kv.contents() if kv is not None else heads
    if isinstance(heads, list) or isinstance(kv_heads, list):  # per-layer head counts: layer 0's, as n_gqa()
        heads, kv_heads = np.ravel(heads)[0], np.ravel(kv_heads)[0]
    plan = MixPlan.for_file(kind, [t.name for t in reader.tensors], int(meta["block_count"]), int(heads),
                            int(kv_heads))
    return plan, MIXES[kind][1]


def quantize_gguf(src, dst, kind: str, progress: bool = True, allow_requantize: bool = False):
    """Write `src` as `kind` (a name in KINDS) to `dst`; returns (dst, {tensor name: type written})."""
    GGUFFile(src)  # validates the input (its tensors, its shards) before anything is written
    reader = read_checked(src)  # gguf-py's reader, the vocabulary parsed in one pass
    plan, file_type = _plan(reader, kind)
    by_name = {t.name: t for t in reader.tensors}
    tensors = [by_name[n] for n in llama_order(list(by_name))]  # llama-quantize's order, its counters'
    chosen = {}
    for t in tensors:  # every type first: a refusal comes before any writing
        ne, stored = [int(n) for n in t.shape], QuantType(int(t.tensor_type))
        chosen[t.name] = plan.type_for(t.name, ne[0], len(ne), stored)
        if kind in MIXES and chosen[t.name] != stored and stored not in FLOATS and not allow_requantize:
            raise PymlError(f"{t.name} is stored as {stored.name}: quantizing it again to {chosen[t.name].name} "
                            f"loses more than quantizing its F16/F32 original (pass --allow-requantize to do it)")
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(file_type)
    with bar(total=len(reader.tensors), desc=f"quantizing to {kind}", unit="tensor", quiet=not progress) as shown:
        for t in tensors:
            _write_tensor(writer, t, chosen[t.name])
            shown.update()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return Path(dst), chosen


def _write_tensor(writer: GGUFWriter, t, target: QuantType):
    qtype, ne = QuantType(int(t.tensor_type)), [int(n) for n in t.shape]
    with _perf.debug("quantize::tensor", "{} [{}] {}->{}", t.name, ",".join(map(str, ne)), qtype.name,
                     target.name):
        if target == qtype:  # norms, biases, kept tensors: copied unchanged
            data = np.asarray(t.data)  # quantized: (rows, row_bytes), which the writer maps back to ne
            writer.add_tensor(t.name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
            return
        f32 = quant.dequantize(np.asarray(t.data).reshape(math.prod(ne[1:]), -1), qtype, ne[0])
        out = quantize_rows(f32, target)
        writer.add_tensor(t.name, out.reshape(list(reversed(ne))[:-1] + [out.shape[-1]]),
                          raw_dtype=target if out.dtype == np.uint8 else None)


def requantized(src: Path, kind: str) -> Path:
    """`src` rewritten as `kind` (q8_0, q4_0, ...) beside the model cache, built once and reused."""
    out = Path(hub.cache_dir()) / "models" / f"{Path(src).stem}.{kind.upper()}.pyml.gguf"
    stale = out.exists() and out.stat().st_mtime < Path(src).stat().st_mtime
    return built_once(out, lambda path: quantize_gguf(src, path, kind, progress=sys.stderr.isatty()),
                      stale)


def build_parser() -> Parser:
    p = Parser(prog="pyml-quantize", description=__doc__.split("\n")[0])
    p.add_argument("src", help="input GGUF file or known model name (smollm2-135m)")
    p.add_argument("dst", help="output GGUF file")
    p.add_argument("--type", required=True, choices=KINDS,
                   help="one type for every weight, or a K-quant mix with llama-quantize's per-tensor types")
    p.add_argument("--allow-requantize", action="store_true",
                   help="let a K-quant mix quantize tensors that are already quantized (as llama-quantize's flag)")
    p.add_argument("--log", metavar="LEVEL", default=None,
                   help="log level (or env PYML_LOG / LOG): debug prints a quantize::tensor line per tensor")
    return p


def run(args) -> int:
    perf.configure(args.log)
    src = hub.resolve_gguf(args.src)
    dst = check_output_file(args.dst, args.dst)
    if dst.resolve() == Path(src).resolve():
        raise PymlError("the output would overwrite the input")
    chosen = {}

    def write(path):  # beside dst, renamed over it once whole: a killed run leaves no half file under its name
        chosen.update(quantize_gguf(src, path, args.type, progress=sys.stderr.isatty(),
                                    allow_requantize=args.allow_requantize)[1])
    try:
        built_once(dst, write, stale=True)
    except OSError as e:
        raise PymlError(f"{dst}: cannot write it: {e.strerror}") from None
    counts = {}
    for qtype in chosen.values():
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    types = ", ".join(f"{n} {name}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    say(f"pyml-quantize: wrote {args.dst} ({args.type}: {types})")  # after the [perf] lines
    return 0


def main(argv=None) -> int:
    return run_command("pyml-quantize", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
