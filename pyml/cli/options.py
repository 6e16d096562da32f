"""The options every model command shares, spelled as llama.cpp and ollama users expect them.

    -m/--model FILE|NAME|HUB_ID|DIR  (--gguf / --safetensors to name the format)   -t/--threads
    -p/--prompt, -f/--file, or the prompt on stdin; -n/--max-tokens; --temp; --system; --stop; ...
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from pathlib import Path

from pyml.cli.main import say
from pyml.core.errors import PymlError, check_text
from pyml.nlp.api import DEFAULT_MODEL, LanguageModel, load_model
from pyml.nlp.sampling import check_sampling
from pyml.nlp.speculative import MAX_DRAFT, SpeculativeConfig
from pyml.nn.kv_cache import DEFAULT_KV_TYPE
from pyml.quant import BF16_AVAILABLE, FLOAT_COMPUTE
from pyml.report.machine import memory
from pyml.nn.attention_kernels import KV_TYPES

DEFAULT_PROMPT = "The capital of France is"


def add_model_options(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("-m", "--model", metavar="MODEL",
                     help=f"a GGUF file, a known name ({DEFAULT_MODEL}, gemma3-270m, qwen2.5-0.5b, ...), "
                          f"hf:ORG/REPO[:QUANT], a Hugging Face hub id (gpt2) or a model directory; the format "
                          f"is guessed (default {DEFAULT_MODEL})")
    src.add_argument("--safetensors", metavar="NAME_OR_DIR",
                     help="Hugging Face model directory, or hub id (gpt2 = openai-community/gpt2)")
    src.add_argument("--gguf", metavar="PATH_OR_NAME",
                     help="GGUF file (split: its first shard), hf:ORG/REPO[:QUANT], or a known name")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--kv-type", choices=list(KV_TYPES), default=DEFAULT_KV_TYPE,
                   help=f"how the KV cache is stored (default {DEFAULT_KV_TYPE}, as llama.cpp; f32 is exact, "
                        f"q8_0 a quarter of f32's bytes: docs/performance-journal.md)")
    p.add_argument("--float-compute", choices=list(FLOAT_COMPUTE), default="auto",
                   help="what F16/BF16/F32 weights' prefill GEMMs compute in: bf16 (vdpbf16ps, weights and "
                        "activations rounded to bf16, float32 sums; ~2x f32's speed), f32 (exact up to summation "
                        "order), or auto (default: bf16 for F16/BF16 weights, f32 for F32). bf16 needs AVX-512 "
                        f"BF16 ({'this CPU has it' if BF16_AVAILABLE else 'this CPU lacks it: f32 only'}); "
                        "decode always streams the stored weights. Accuracy: docs/performance-journal.md")


def model_options(args: argparse.Namespace) -> dict:
    """load_model's keyword arguments for the model the options name."""
    return dict(source=args.model, gguf=args.gguf, safetensors=args.safetensors, threads=args.threads,
                kv_type=args.kv_type, float_compute=args.float_compute)


def add_sampling_options(p: argparse.ArgumentParser, max_tokens: int, ctx_size: int | None = None) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=max_tokens,
                   help=f"tokens to generate (default {max_tokens})")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the likeliest (0 = off)")
    p.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the reply at TEXT (not printed); may be given several times")
    p.add_argument("--system", metavar="TEXT", default=None, help="a system message (uses the chat template)")
    p.add_argument("-c", "--ctx-size", type=int, default=ctx_size, metavar="N",
                   help="positions of the KV cache (default: " + (str(ctx_size) if ctx_size else
                        "the prompt + --max-tokens") + ", within the model's window)")
    p.add_argument("--context-shift", action="store_true",
                   help="when the cache is full, drop the oldest half of the history (after --keep tokens) "
                        "and go on, instead of stopping")
    p.add_argument("--keep", type=int, default=0, metavar="N",
                   help="tokens at the start of the cache a context shift never drops (default 0)")


def sampling_options(args: argparse.Namespace) -> dict:
    """LanguageModel.stream's keyword arguments for the sampling options."""
    if args.max_tokens < 0:
        raise PymlError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if args.seed is not None and args.seed < 0:
        raise PymlError(f"--seed must be >= 0, got {args.seed}")
    for stop in args.stop:
        check_text(stop, "--stop")
        if not stop:
            raise PymlError("--stop is empty: give the text to end the reply at")
    if args.system is not None:
        check_text(args.system, "--system")
    options = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
                   ctx_size=args.ctx_size, context_shift=args.context_shift, n_keep=args.keep)
    check_sampling(options, lambda name: "--" + name.replace("_", "-"))
    return options


def check_output_file(path, what: str) -> Path:
    """An output file's path, refused in one line before any work when it cannot be one: a folder, or
    in a folder that does not exist (a typo's, not one to make)."""
    path = Path(path)
    if path.is_dir():
        raise PymlError(f"{what}: a folder; give the output file's path")
    if not path.parent.is_dir():
        raise PymlError(f"{what}: no folder {path.parent} to write it in")
    return path


def check_output_folder(path, what: str) -> Path:
    """An output folder (made later, with its parents), refused in one line before any work when it
    cannot be made: a file on its way, or a folder this process may not write into."""
    path = Path(path)
    for there in (path, *path.parents):
        if there.exists():
            if not there.is_dir():
                raise PymlError(f"{what} {path}: {there} is a file, not a folder")
            if not os.access(there, os.W_OK | os.X_OK):
                raise PymlError(f"{what} {path}: cannot write into {there}")
            break
    return path


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (the same tokens when greedy, the same distribution "
                             "when sampling; docs/speculative.md)")
    g.add_argument("--lookup-ngram", type=int, default=0, metavar="N",
                   help="draft from the prompt and the text so far: the continuation of the first earlier "
                        "occurrence of the newest N..2 tokens (0 = off; 4 is a good start)")
    g.add_argument("--draft-model", metavar="MODEL", default=None,
                   help="draft with a smaller model of the same tokenizer (a file or name, as -m)")
    g.add_argument("--draft-max", type=int, default=None, metavar="K",
                   help=f"with --lookup-ngram or --draft-model: tokens drafted per step at most, 1..{MAX_DRAFT} "
                        f"(default {MAX_DRAFT}; fewer after rejections)")


def _draft_max(args: argparse.Namespace) -> int:
    return MAX_DRAFT if args.draft_max is None else args.draft_max


def check_speculative(args: argparse.Namespace) -> None:
    """Bad speculative options fail here, before any model loads."""
    if args.lookup_ngram or args.draft_model is not None:
        SpeculativeConfig(lookup_ngram=args.lookup_ngram, draft_max=_draft_max(args),
                          draft_model=object() if args.draft_model is not None else None)
    elif args.draft_max is not None:  # nothing drafts: it would be ignored
        raise PymlError("--draft-max without --lookup-ngram or --draft-model is not implemented: it bounds the "
                        "drafts of speculative decoding, which is off")


def speculative_options(args: argparse.Namespace, target: LanguageModel) -> dict:
    """LanguageModel.stream's `speculative` keyword (empty without the options); loads --draft-model
    with the target's threads and KV type."""
    if not args.lookup_ngram and args.draft_model is None:
        return {}
    draft = None
    if args.draft_model is not None:
        draft = load_model(args.draft_model, threads=args.threads, kv_type=args.kv_type)
    return {"speculative": SpeculativeConfig(lookup_ngram=args.lookup_ngram, draft_max=_draft_max(args),
                                             draft_model=draft)}


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    given = p.add_mutually_exclusive_group()
    given.add_argument("-p", "--prompt", default=None,
                       help=f"prompt text (default: stdin when it is not a terminal, else {DEFAULT_PROMPT!r})")
    given.add_argument("-f", "--file", metavar="FILE", default=None, help="read the prompt from FILE (- = stdin)")


def read_prompt(args: argparse.Namespace, stdin=None) -> str:
    """The prompt: -p, else -f, else what stdin holds when it is not a terminal, else the default.
    Bytes that are not UTF-8, wherever they come from, are refused by name."""
    stdin = stdin if stdin is not None else sys.stdin
    if args.prompt is not None:
        return check_text(args.prompt, "the prompt (-p)")
    if args.file == "-":
        return _read_stdin(stdin)
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise PymlError(f"--file {args.file}: {e.strerror if isinstance(e, OSError) else e}") from None
    if stdin is not None and not stdin.closed and not stdin.isatty():
        text = _read_stdin(stdin)
        if text.strip():
            return text
    return DEFAULT_PROMPT


def _read_stdin(stdin) -> str:
    try:  # strict UTF-8 raises here; under the C locale Python decodes with surrogateescape instead
        return check_text(stdin.read(), "the prompt on stdin")
    except UnicodeDecodeError as e:
        raise PymlError(f"the prompt on stdin is not UTF-8 ({e.reason} at byte {e.start})") from None


def profiling(directory: str | None):
    """--profile DIR: a context recording every perf event into DIR and writing the reports when it
    closes (its value is the Profile, or None without the option)."""
    if directory is None:
        return nullcontext()
    # Deferred: the report package costs ~30 ms of a ~0.65 s import, and only --profile needs it.
    from pyml.report.capture import profile
    return profile(directory, report=True, argv=sys.argv)


def check_kv_memory(lm: LanguageModel, ctx: int, sequences: int, flag: str, lower: str, prog: str) -> None:
    """Refuse `sequences` sequences of `ctx` positions whose keys and values could outgrow the
    machine's memory (`flag` is what asked for them, `lower` what to change) - the cache commits its
    pages as sequences fill, so without this the run dies later, out of memory; say so when they
    could outgrow what is free now."""
    worst = sequences * lm.new_cache(ctx).nbytes
    mem = memory()
    total, available = mem.get("MemTotal"), mem.get("MemAvailable")
    held = (f"{sequences} sequence{'s' * (sequences > 1)} of {ctx} positions could hold {worst / 1e9:.1f} GB of "
            "keys and values")
    if total is not None and worst > total:
        raise PymlError(f"{flag}: {held}, more than this machine's {total / 1e9:.1f} GB of memory; {lower}")
    if available is not None and worst > available:
        say(f"{prog}: warning: {held}; {available / 1e9:.1f} GB of memory is free now")


def check_ray_only(args, *dests: str) -> None:
    """Refuse by name a Ray setting (`dests`: --workers, --address) given without --ray, where the
    run stays in this process and would ignore it."""
    for dest in dests:
        if getattr(args, dest) is not None and not args.ray:
            raise PymlError(f"--{dest} without --ray is not implemented: it sets up Ray's workers (add --ray); "
                            "this process runs the work itself")
