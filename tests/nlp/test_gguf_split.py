"""Split GGUF files (`<name>-00001-of-0000N.gguf`) load as one model, every shard checked.

The shards are written by gguf-py's own GGUFWriter with split_max_tensors (the layout
llama.cpp's gguf-split writes too: all metadata in the first shard, split.no / split.count /
split.tensors.count in each), from a single-file model: the split model must hold the same
tensors and give the same logits as the file it was split from.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import pyml
from pyml.cli import pyml_infer
from pyml.core.errors import ModelFormatError
from pyml.nlp.loaders.gguf import GGUFFile
from tests.fuzz import gguf_build


def split_copy(source: Path, target: Path, max_tensors: int) -> list:
    """`source` rewritten as shards of at most `max_tensors` tensors; the shard paths, in order."""
    reader = gguf.GGUFReader(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents(),
                             split_max_tensors=max_tensors)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(target.parent.glob(target.stem + "-*-of-*.gguf"))


def tiny_llama_with_a_merge(path: Path, monkeypatch):
    """The fuzz corpus's tiny llama with one merge ("Ġ Ġ" -> "ĠĠ"): gguf-py writes no empty arrays."""
    tokens = gguf_build.byte_level_vocab()
    tokens = [*tokens[:256], "ĠĠ", *tokens[256:]]
    monkeypatch.setattr(gguf_build, "byte_level_vocab", lambda: tokens)
    spec = gguf_build.tiny_llama_spec(n_layers=2)
    for kv in spec.kvs:
        if kv.key == "tokenizer.ggml.token_type":
            kv.value = gguf_build.Array(gguf_build.I32, [1] * 257 + [3])
        elif kv.key == "tokenizer.ggml.merges":
            kv.value = gguf_build.Array(gguf_build.STRING, ["Ġ Ġ"])
    path.write_bytes(spec.encode())


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    single = tmp_path / "single.gguf"
    tiny_llama_with_a_merge(single, monkeypatch)
    shards = split_copy(single, tmp_path / "split" / "tiny.gguf", max_tensors=5)
    return single, shards


def test_split_model_reads_as_one_set_of_tensors(split_model):
    single, shards = split_model
    assert [s.name for s in shards] == [f"tiny-0000{n}-of-00004.gguf" for n in (1, 2, 3, 4)]
    whole, split = GGUFFile(single), GGUFFile(shards[0])
    assert split.paths == shards
    assert split.tensors.keys() == whole.tensors.keys()
    for name, (data, type_name, shape) in whole.tensors.items():
        got = split.tensors[name]
        assert (got[1], got[2]) == (type_name, shape) and np.array_equal(got[0], data), name
        assert not got[0].flags.owndata and not got[0].flags.writeable, name  # a view of the mapping
    assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")}.keys() == \
        whole.metadata.keys()
    assert split.metadata["split.count"] == 4 and split.metadata["split.tensors.count"] == len(whole.tensors)


def test_split_model_gives_the_logits_of_the_single_file(split_model):
    single, shards = split_model
    ids = [5, 70, 101, 32, 9]
    want = pyml.load_model(gguf=str(single), warmup=False).forward(ids, all_logits=True)
    got = pyml.load_model(gguf=str(shards[0]), warmup=False).forward(ids, all_logits=True)
    np.testing.assert_array_equal(got, want)


def test_split_model_must_be_loaded_from_the_first_shard(split_model):
    _, shards = split_model
    with pytest.raises(ModelFormatError, match="shard 00002 of 4; a split model loads from its first shard, "
                                               "tiny-00001-of-00004.gguf"):
        GGUFFile(shards[1])


def test_missing_shard_is_named(split_model):
    _, shards = split_model
    shards[2].unlink()
    with pytest.raises(ModelFormatError, match=r"tiny-00003-of-00004.gguf: missing \(shard 3 of the 4"):
        GGUFFile(shards[0])


def test_renamed_shards_are_refused(split_model, tmp_path):
    _, shards = split_model
    renamed = shards[0].rename(tmp_path / "model.gguf")
    with pytest.raises(ModelFormatError, match="split.count says 4 shards, but the file is not named"):
        GGUFFile(renamed)
    swapped = tmp_path / "split" / "tiny-00001-of-00004.gguf"
    shards[1].rename(swapped)  # shard 2 where shard 1 belongs
    shards[3].rename(shards[1])
    with pytest.raises(ModelFormatError, match="a split model loads from its first shard"):
        GGUFFile(swapped)


def test_a_hostile_later_shard_is_checked_like_a_file(split_model):
    _, shards = split_model
    data = shards[2].read_bytes()
    shards[2].write_bytes(data[:len(data) - 40])  # its last tensor runs past the end
    with pytest.raises(ModelFormatError, match=r"tiny-00003-of-00004.gguf: tensor .* past the end"):
        GGUFFile(shards[0])
    shards[2].write_bytes(b"GGUF" + data[4:40])
    with pytest.raises(ModelFormatError, match="tiny-00003-of-00004.gguf"):
        GGUFFile(shards[0])


def test_duplicate_tensor_across_shards_is_refused(split_model):
    _, shards = split_model
    shards[2].write_bytes(shards[1].read_bytes())  # shard 2's tensors again, and split.no 1 where 2 belongs
    with pytest.raises(ModelFormatError, match="tiny-00003-of-00004.gguf: tensor .* appears twice"):
        GGUFFile(shards[0])


def test_split_model_from_a_faked_hub(split_model, tmp_path, monkeypatch):
    """hf:ORG/REPO of a split model: every shard downloaded beside the first, loaded as one."""
    import huggingface_hub
    from huggingface_hub.hf_api import RepoFile
    from pyml.nlp.loaders import hub
    single, shards = split_model
    served = {f"Q4_0/{s.name.replace('tiny', 'Tiny-Q4_0')}": s.read_bytes() for s in shards}
    monkeypatch.setattr(huggingface_hub, "list_repo_tree", lambda repo, **kw: [
        RepoFile(path=p, size=len(d), oid="0") for p, d in served.items()])

    def download(repo, filename, **kwargs):
        target = tmp_path / "hf" / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(served[filename])
        return str(target)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(hub, "_reachable", lambda endpoint: True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    lm = pyml.load_model(gguf="hf:someone/Tiny-GGUF", warmup=False)
    assert lm.source.endswith("Q4_0/Tiny-Q4_0-00001-of-00004.gguf")
    ids = [1, 2, 3]
    want = pyml.load_model(gguf=str(single), warmup=False).forward(ids)
    np.testing.assert_array_equal(lm.forward(ids), want)
    # and through the command line, as a user types it
    assert pyml_infer.main(["--gguf", "hf:someone/Tiny-GGUF:q4_0", "--prompt", "hi", "--max-tokens", "2",
                            "--no-warmup"]) == 0


def test_cli_offline_hub_spec_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert pyml_infer.main(["--gguf", "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("pyml-infer: error: hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF: HF_HUB_OFFLINE is set and the file is "
                   "not in the Hugging Face cache; download the .gguf elsewhere and pass its path "
                   "(--gguf /path/to/model.gguf)")
