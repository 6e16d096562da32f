"""Hostile model files, one per kind of lie a header can tell: each refused in one line naming the
file, the tensor or key, and what was expected — never a crash, a hang or a large allocation.

These are also the regression cases for what the fuzzers found (docs/reliability.md lists them).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pyml.core.errors import ModelFormatError, PymlError, UnsupportedError
from pyml.nlp.api import build_gguf
from pyml.nlp.loaders.gguf import GGUFFile
from pyml.nlp.loaders.safetensors import load_tensors
from tests.fuzz import gguf_build as gb
from tests.fuzz.strategies import safetensors_bytes, valid_safetensors_header
from pyml.cli import pyml_infer
from tests.cli.test_infer import ROOT, in_process, one_line_error

BASE = gb.tiny_llama_spec()


def spec(change) -> gb.Spec:
    s = copy.deepcopy(BASE)
    change(s)
    return s


def tensor(s, name) -> gb.TensorInfo:
    return next(t for t in s.tensors if t.name == name)


def set_kv(key, vtype, value):
    def change(s):
        for kv in s.kvs:
            if kv.key == key:
                kv.vtype, kv.value = vtype, value
                return
        s.kvs.append(gb.KV(key, vtype, value))
    return change


def setattr_of(name, **values):
    def change(s):
        for k, v in values.items():
            setattr(tensor(s, name), k, v)
    return change


Q = "blk.0.attn_q.weight"
GGUF_CASES = {
    # name: (how the file lies, error class, words the message must hold)
    "bad magic": (lambda s: setattr(s, "magic", b"GGUG"), ModelFormatError, ["not a GGUF file"]),
    "version 4": (lambda s: setattr(s, "version", 4), UnsupportedError, ["GGUF version 4"]),
    "kv count 2^64-1": (lambda s: setattr(s, "n_kv", 2**64 - 1), ModelFormatError,
                        ["18446744073709551615 metadata entries"]),
    "tensor count 2^64-1": (lambda s: setattr(s, "n_tensors", 2**64 - 1), ModelFormatError,
                            ["18446744073709551615 tensors"]),
    "key length 2^64-1": (lambda s: setattr(s.kvs[3], "key_len", 2**64 - 1), ModelFormatError,
                          ["string of 18446744073709551615 bytes", "past the end"]),
    "tensor name length 2^64-1": (setattr_of(Q, name_len=2**64 - 1), ModelFormatError,
                                  ["string of 18446744073709551615 bytes"]),
    "unknown value type": (lambda s: s.kvs.append(gb.KV("x.odd", 77, b"\0" * 8)), ModelFormatError,
                           ["'x.odd'", "unknown value type 77"]),
    "array of unknown type": (lambda s: s.kvs.append(gb.KV("x.arr", gb.ARRAY, gb.Array(99, []))),
                              ModelFormatError, ["'x.arr'", "unknown value type 99"]),
    "nested array": (lambda s: s.kvs.append(gb.KV("x.nest", gb.ARRAY, gb.Array(gb.ARRAY, [gb.Array(gb.U8, [1])]))),
                     ModelFormatError, ["'x.nest'", "arrays of arrays"]),
    "array count 2^64-1": (lambda s: s.kvs.append(gb.KV("x.big", gb.ARRAY, gb.Array(gb.U32, [1], count=2**64 - 1))),
                           ModelFormatError, ["'x.big'", "18446744073709551615 UINT32", "past the end"]),
    "string array count 2^63": (lambda s: s.kvs.append(gb.KV("x.s", gb.ARRAY, gb.Array(gb.STRING, ["a"], count=2**63))),
                                ModelFormatError, ["'x.s'", "cannot fit"]),
    "string array with invalid UTF-8": (lambda s: s.kvs.append(gb.KV("x.u", gb.ARRAY, gb.Array(gb.STRING, ["a", b"\xff"]))),
                                        ModelFormatError, ["'x.u'", "not valid UTF-8"]),
    "string array's last string past the end": (
        lambda s: s.kvs.append(gb.KV("x.t", gb.ARRAY, gb.Array(gb.STRING, ["a", "b"], count=3))), ModelFormatError,
        ["string", "past the end"]),
    "duplicate key": (lambda s: s.kvs.append(copy.deepcopy(s.kvs[2])), ModelFormatError,
                      ["'llama.embedding_length' appears twice"]),
    "duplicate tensor": (lambda s: s.tensors.append(copy.deepcopy(tensor(s, Q))), ModelFormatError,
                         [f"'{Q}' appears twice"]),
    "offset past the end": (setattr_of(Q, offset=2**40), ModelFormatError, [Q, "past the end"]),
    "offset wrapping around 2^64": (setattr_of(Q, offset=2**64 - 64), ModelFormatError, [Q, "past the end"]),
    "overlapping tensors": (lambda s: setattr(tensor(s, Q), "offset", tensor(s, "blk.0.attn_k.weight").offset),
                            ModelFormatError, ["overlap", Q, "blk.0.attn_k.weight"]),
    "misaligned data": (lambda s: setattr(tensor(s, Q), "offset", tensor(s, Q).offset + 4), ModelFormatError,
                        [Q, "not a multiple of the alignment 32"]),
    "dims that overflow 64 bits": (setattr_of(Q, dims=[2**32, 2**32, 2**32]), ModelFormatError, [Q, "past the end"]),
    "n_dims 5": (setattr_of(Q, dims=[64, 1, 1, 1, 64]), ModelFormatError, [Q, "5 dimensions (expected 1 to 4)"]),
    "n_dims 2^32-1": (setattr_of(Q, n_dims=2**32 - 1), ModelFormatError, [Q, "4294967295 dimensions"]),
    "a zero dimension": (setattr_of(Q, dims=[64, 0]), ModelFormatError, [Q, "at least 1"]),
    "row not whole blocks": (setattr_of(Q, dims=[48, 64]), ModelFormatError,
                             [Q, "row length 48 is not a multiple of the Q4_0 block size 32"]),
    "unknown ggml type": (setattr_of(Q, ggml_type=99), ModelFormatError, [Q, "unknown ggml type 99"]),
    "unsupported ggml type": (setattr_of(Q, ggml_type=16), UnsupportedError, [Q, "IQ2_XXS is not supported"]),
    "alignment not a power of two": (set_kv("general.alignment", gb.U32, 48), ModelFormatError, ["alignment"]),
    "truncated data": (lambda s: setattr(s, "data", s.data[:-100]), ModelFormatError,
                       ["blk.0.ffn_down.weight", "past the end"]),
}
GGUF_MODEL_CASES = {
    "size key of type string": (set_kv("llama.embedding_length", gb.STRING, "64"),
                                ["llama.embedding_length", "integer from 1"]),
    "zero heads": (set_kv("llama.attention.head_count", gb.U32, 0), ["llama.attention.head_count", "got 0"]),
    "zero kv heads": (set_kv("llama.attention.head_count_kv", gb.U32, 0), ["head_count_kv", "got 0"]),
    "negative context": (set_kv("llama.context_length", gb.I32, -5), ["llama.context_length", "got -5"]),
    "context 2^62": (set_kv("llama.context_length", gb.U64, 2**62), ["llama.context_length"]),
    "epsilon as an array": (set_kv("llama.attention.layer_norm_rms_epsilon", gb.ARRAY, gb.Array(gb.F32, [1.0])),
                            ["layer_norm_rms_epsilon", "finite number"]),
    "epsilon NaN": (set_kv("llama.attention.layer_norm_rms_epsilon", gb.F32, float("nan")),
                    ["layer_norm_rms_epsilon", "finite number"]),
    "vocab smaller than the tokenizer": (set_kv("llama.vocab_size", gb.U32, 10),
                                         ["model.embed_tokens.weight", "[257, 64]", "[10, 64]"]),
    "tokenizer scores missing": (set_kv("tokenizer.ggml.model", gb.STRING, "llama"), ["tokenizer.ggml.scores"]),
    "token types past int32": (set_kv("tokenizer.ggml.token_type", gb.ARRAY, gb.Array(gb.I64, [2**40] * 257)),
                               ["tokenizer", "int32"]),
    "token types of type string": (set_kv("tokenizer.ggml.token_type", gb.ARRAY, gb.Array(gb.STRING, ["a"] * 257)),
                                   ["tokenizer"]),
}


def assert_one_line_naming(error, path, needles):
    """The error is one line that names the file and says each of `needles`."""
    msg = str(error)
    assert "\n" not in msg and str(path) in msg, msg
    for n in needles:
        assert n in msg, msg


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_hostile_gguf_header(tmp_path, case):
    change, error, needles = GGUF_CASES[case]
    path = tmp_path / "m.gguf"
    path.write_bytes(spec(change).encode())
    with pytest.raises(error) as e:
        build_gguf(path)
    assert_one_line_naming(e.value, path, needles)


@pytest.mark.parametrize("case", list(GGUF_MODEL_CASES))
def test_hostile_gguf_hyperparameters(tmp_path, case):
    change, needles = GGUF_MODEL_CASES[case]
    path = tmp_path / "m.gguf"
    path.write_bytes(spec(change).encode())
    with pytest.raises(PymlError) as e:
        build_gguf(path)
    assert_one_line_naming(e.value, path, needles)


def test_odd_head_dim_is_refused_before_rope_reads_past_the_head(tmp_path):
    # head_dim 15: RoPE rotates pairs (i, i + 8) and would write one float past each head
    path = tmp_path / "odd.gguf"
    gb.tiny_llama(path, hidden=60, n_heads=4, weight_type=0, embed_type=0)
    with pytest.raises(ModelFormatError, match="head dimension 15 is odd"):
        build_gguf(path)


def test_the_valid_base_file_loads_and_real_files_pass_the_new_checks(tmp_path, smollm2_gguf):
    path = tmp_path / "ok.gguf"
    path.write_bytes(BASE.encode())
    model, tokenizer, _, _ = build_gguf(path)
    assert model.forward([1, 2], model.new_cache(4)).shape == (257,)
    f = GGUFFile(smollm2_gguf)  # alignment, overlap and range checks hold on a real file
    assert len(f.tensors) == 272


# --- safetensors ---------------------------------------------------------------------------
HEADER, SIZE = valid_safetensors_header()
NAME = next(iter(HEADER))  # "t0.f32", shape [5]


def st_case(change=None, raw_header=None, data=None, header_len=None):
    h = copy.deepcopy(HEADER)
    if change:
        h = change(h) or h
    return safetensors_bytes(h, b"\x01" * SIZE if data is None else data, header_len, raw_header)


def entry(**values):
    def change(h):
        h[NAME].update(values)
    return change


ST_CASES = {
    "header length 2^64-1": (dict(header_len=2**64 - 1), ["header length 18446744073709551615"]),
    "header not JSON": (dict(raw_header=b"{not json"), ["not valid JSON"]),
    "header a list": (dict(raw_header=b"[1, 2]"), ["header is not a JSON object"]),
    "header a string": (dict(raw_header=b'"weights"'), ["header is not a JSON object"]),
    "deeply nested JSON": (dict(raw_header=b"[" * 100000 + b"]" * 100000), ["not valid JSON"]),
    "a 5000-digit integer": (dict(raw_header=b'{"a": {"dtype": "F32", "shape": [' + b"1" * 5000 + b"]}}"),
                             ["not valid JSON"]),
    "duplicate tensor name": (dict(raw_header=b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
                                              b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'),
                              ["'a' appears twice"]),
    "entry not an object": (dict(change=lambda h: h.update({NAME: [1]})), [NAME, "not an object"]),
    "unknown dtype": (dict(change=entry(dtype="F8_E4M3")), [NAME, "unknown dtype 'F8_E4M3'"]),
    "dtype of the wrong JSON type": (dict(change=entry(dtype=["F32"])), [NAME, "unknown dtype"]),
    "negative dim": (dict(change=entry(shape=[-5])), [NAME, "non-negative integers"]),
    "boolean dims": (dict(change=entry(shape=[True, True])), [NAME, "non-negative integers"]),
    "rank 70": (dict(change=entry(shape=[1] * 70)), [NAME, "at most 8"]),
    "offsets not a pair": (dict(change=entry(data_offsets=[0])), [NAME, "data_offsets"]),
    "offsets past the buffer": (dict(change=entry(data_offsets=[SIZE, SIZE + 20])), [NAME, "outside"]),
    "offsets reversed": (dict(change=entry(data_offsets=[20, 0])), [NAME, "outside"]),
    "size disagreeing with shape": (dict(change=entry(shape=[6])), [NAME, "expected 24"]),
    "overlapping tensors": (dict(change=lambda h: h.update(
        {"copy": {"dtype": "F32", "shape": [5], "data_offsets": list(h[NAME]["data_offsets"])}})), ["overlap"]),
    "metadata not an object": (dict(change=lambda h: h.update({"__metadata__": 3})), ["__metadata__"]),
    "truncated file": (dict(data=b"\x01" * (SIZE // 2)), ["outside"]),
}


@pytest.mark.parametrize("case", list(ST_CASES))
def test_hostile_safetensors_header(tmp_path, case):
    kwargs, needles = ST_CASES[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(st_case(**kwargs))
    with pytest.raises(ModelFormatError) as e:
        load_tensors(tmp_path)
    assert_one_line_naming(e.value, path, needles)


def test_unaligned_safetensors_tensor_is_read_correctly(tmp_path):
    # legal: a 1-byte tensor first puts the float32 one at an odd offset
    import numpy as np
    h = {"b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
         "w": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}
    (tmp_path / "model.safetensors").write_bytes(safetensors_bytes(h, b"\x07" + np.float32([1.5, -2]).tobytes()))
    w = load_tensors(tmp_path).tensors["w"][0]
    assert w.flags.aligned and w.tolist() == [1.5, -2.0]


def test_shard_index_cannot_point_outside_the_directory(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "/etc/passwd"}}))
    with pytest.raises(ModelFormatError, match="not a file name"):
        load_tensors(tmp_path)


# --- a header that claims 10^12 elements in a 1 KB file --------------------------------------
_MEASURE = textwrap.dedent("""
    import resource, sys, time
    sys.path.insert(0, {root!r})
    from pyml.core.errors import PymlError
    from pyml.nlp.loaders.gguf import GGUFFile
    from pyml.nlp.loaders.safetensors import load_tensors
    from pathlib import Path
    load = (lambda p: GGUFFile(p)) if {kind!r} == "gguf" else (lambda p: load_tensors(Path(p).parent))
    try:  # warm every import and code path on a first call
        load({path!r})
    except PymlError:
        pass
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        load({path!r})
        print("accepted")
    except PymlError as e:
        print("refused", time.perf_counter() - t0,
              resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, str(e), sep="\\t")
""")


def _claims_1e12(kind: str, directory: Path) -> Path:
    if kind == "gguf":
        path = directory / "huge.gguf"
        path.write_bytes(gb.build([gb.KV("general.architecture", gb.STRING, "llama")],
                                  [gb.TensorInfo("token_embd.weight", [10**6, 10**6], 0, 0)], b"\0" * 512))
    else:
        path = directory / "model.safetensors"
        path.write_bytes(safetensors_bytes({"w": {"dtype": "F32", "shape": [10**6, 10**6],
                                                  "data_offsets": [0, 4 * 10**12]}}, b"\0" * 512))
    assert path.stat().st_size <= 1024
    return path


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_a_claimed_1e12_element_tensor_fails_fast_with_little_memory(tmp_path, kind):
    path = _claims_1e12(kind, tmp_path)
    code = _MEASURE.format(root=str(ROOT), kind=kind, path=str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    verdict, seconds, grown_kb, msg = out.strip().split("\t")
    assert verdict == "refused"
    # the issue asks for under a second; 2 s of slack for a loaded shared machine (it takes ~1 ms)
    assert float(seconds) < 2.0
    assert int(grown_kb) < 20 * 1024  # peak RSS grows by less than 20 MB (4 TB were claimed)
    assert "past the end" in msg or "outside" in msg


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_cli_refuses_a_claimed_1e12_element_tensor_in_one_line(tmp_path, kind):
    path = _claims_1e12(kind, tmp_path)
    if kind == "gguf":
        proc = in_process("--gguf", str(path), "--no-warmup")
        one_line_error(proc, str(path), "token_embd.weight", "past the end")
    else:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 512, "n_embd": 64,
                                                          "n_layer": 1, "n_head": 4, "n_positions": 32}))
        proc = in_process("--safetensors", str(tmp_path), "--no-warmup")
        one_line_error(proc, str(path), "'w'", "outside")


@pytest.mark.parametrize("case", ["misaligned data", "nested array", "unsupported ggml type"])
def test_cli_bad_gguf_exits_2_with_one_line(tmp_path, case):
    change, _, needles = GGUF_CASES[case]
    path = tmp_path / "m.gguf"
    path.write_bytes(spec(change).encode())
    one_line_error(in_process("--gguf", str(path), "--no-warmup"), str(path), *needles)


def test_cli_bad_gguf_hyperparameter_exits_2(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(spec(set_kv("llama.attention.head_count", gb.U32, 0)).encode())
    one_line_error(in_process("--gguf", str(path), "--no-warmup"), str(path), "head_count", "got 0")


def test_cli_internal_error_exits_1_in_one_line_and_debug_shows_the_traceback(monkeypatch):
    """A bug inside pyml (here: an injected RuntimeError) is exit 1, one line; --debug lets it through
    (a process then prints its traceback: tests/cli/test_infer.py::test_debug_flag_shows_the_traceback)."""
    def broken(*a, **k):
        raise RuntimeError("injected fault")
    monkeypatch.setattr(pyml_infer, "load_model", broken)
    line = one_line_error(in_process("--gguf", "x"), "internal error", "RuntimeError: injected fault", "--debug", code=1)
    assert line.startswith("pyml-infer: ")
    with pytest.raises(RuntimeError, match="injected fault"):
        in_process("--gguf", "x", "--debug")


# --- checkpoints whose config.json / tokenizer.json disagree with the tensors ----------------------

@pytest.fixture
def tiny_gpt2(tmp_path):
    from pyml.cli.standins import write_byte_tokenizer, write_gpt2
    d = write_gpt2(tmp_path / "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=32)
    write_byte_tokenizer(d, 300)
    return d


def _edit_config(d, **values):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(values)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("values, needle", [({"n_head": "two"}, "config.json"), ({"n_head": 0}, "config.json"),
                                            ({"n_embd": 31}, "config.json")])
def test_absurd_config_values_are_one_line_errors(tiny_gpt2, values, needle):
    import pyml
    _edit_config(tiny_gpt2, **values)
    with pytest.raises(ModelFormatError, match=needle):
        pyml.load_model(safetensors=str(tiny_gpt2), warmup=False)


def test_tokenizer_larger_than_the_embedding_fails_on_the_token_not_at_load(tiny_gpt2):
    """Real checkpoints ship tokenizers with a few more entries than embedding rows (added special
    tokens the text model never sees), so the load accepts them; a prompt that reaches such an id
    is refused by the embedding in one line instead of reading past it."""
    from pyml.cli.standins import write_byte_tokenizer
    import pyml
    write_byte_tokenizer(tiny_gpt2, 400)
    lm = pyml.load_model(safetensors=str(tiny_gpt2), warmup=False)
    assert lm.generate("ok", max_tokens=1).tokens
    with pytest.raises(PymlError, match="token id 399 is outside the vocabulary of 300"):
        lm.forward([5, 399])


@pytest.mark.parametrize("bad", [-1, 300, 2**40])
def test_token_ids_outside_the_vocabulary_are_refused(tiny_gpt2, bad):
    import pyml
    lm = pyml.load_model(safetensors=str(tiny_gpt2), warmup=False)
    with pytest.raises(PymlError, match=f"token id {bad} is outside the vocabulary of 300"):
        lm.forward([5, bad])


def test_odd_rotary_dims_are_refused():
    from pyml.nn.rope import RoPE
    with pytest.raises(ModelFormatError, match="rotary dims"):
        RoPE(head_dim=7, base=10000.0)
    with pytest.raises(ModelFormatError, match="rotary dims"):
        RoPE(head_dim=8, base=10000.0, rotary_dim=10)


@pytest.mark.parametrize("bad", [-1, 300])
def test_a_single_token_id_outside_the_vocabulary_is_refused(tiny_gpt2, bad):
    """A decode step's one id takes the embedding's row path (Weight.row): the same refusal."""
    import pyml
    lm = pyml.load_model(safetensors=str(tiny_gpt2), warmup=False)
    with pytest.raises(PymlError, match=f"token id {bad} is outside the vocabulary of 300"):
        lm.forward([bad])
