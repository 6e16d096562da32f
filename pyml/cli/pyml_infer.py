"""pyml-infer: generate text from a model and say where the time went."""

from __future__ import annotations

import sys
from contextlib import nullcontext

from pyml.cli.main import Parser, run_command, say
from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.core.version import __version__
from pyml.nlp.api import load_model
from pyml.nlp.generator import GenerationResult
from pyml.report.profile import profile


def build_parser() -> Parser:
    p = Parser(prog="pyml-infer", description="Generate text with a decoder-only language model on the CPU.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--safetensors", metavar="NAME_OR_DIR",
                     help="Hugging Face model directory, or hub id (gpt2 = openai-community/gpt2)")
    src.add_argument("--gguf", metavar="PATH_OR_NAME",
                     help="GGUF file, or a known name (smollm2-135m, gemma3-270m); default smollm2-135m")
    p.add_argument("--prompt", default="The capital of France is", help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--lm-head-quant", choices=["q8_0", "q4_0"], default=None,
                   help="quantize a float output head at load")
    p.add_argument("--log", metavar="LEVEL", default=None,
                   help="log level or filters: debug, trace, pyml.nn=trace,pyml=debug (or env LOG)")
    p.add_argument("--no-warmup", action="store_true", help="skip warm-up (shows its effect)")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="record every perf event into DIR (events.jsonl, run.json) and write the reports")
    p.add_argument("--version", action="version", version=f"pyml {__version__}")
    return p


def run(args) -> int:
    perf.configure(args.log)
    if args.max_tokens < 0:
        raise PymlError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    ctx = profile(args.profile, report=True, argv=sys.argv) if args.profile else nullcontext()
    with ctx as prof:
        code = _generate(args, prof)
    if prof is not None:
        say(f"pyml-infer: profile in {args.profile}: " + ", ".join(p.name for p in prof.written))
    return code


def _generate(args, prof) -> int:
    lm = load_model(gguf=args.gguf, safetensors=args.safetensors, threads=args.threads,
                    warmup=not args.no_warmup, lm_head_quant=args.lm_head_quant)
    if prof is not None:
        prof.set_model(lm)
    prompt = args.prompt
    if args.chat:
        prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  template=lm.chat_template)
    ids = lm.tokenizer.encode(prompt) if lm.tokenizer is not None else None
    if ids is None:
        raise PymlError(f"{lm.source}: no tokenizer beside the model, cannot encode the prompt")
    result = GenerationResult(ids)
    out = sys.stdout

    def on_text(text):
        out.write(text)
        out.flush()

    interrupted = False
    try:
        lm.generate(ids, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                    on_text=on_text, result=result)
    except KeyboardInterrupt:
        interrupted, result.stop_reason = True, "interrupted"
    if prof is not None:
        prof.set_result(result)
    out.write("\n")
    out.flush()
    if result.stop_reason == "context":
        say(f"pyml-infer: stopped at the context window ({lm.model.max_positions} tokens)")
    say(f"[{result.summary()} | load {lm.load_s * 1e3:.0f} ms | threads {lm.runtime.threads}"
        f"{' | interrupted' if interrupted else ''}]")
    return 130 if interrupted else 0


def main(argv=None) -> int:
    return run_command("pyml-infer", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
