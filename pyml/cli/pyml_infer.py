"""pyml-infer: generate text from a model and say where the time went."""

from __future__ import annotations

import json
import sys

from pyml.cli.main import Parser, run_command, say
from pyml.cli.options import (add_model_options, add_prompt_options, add_sampling_options, add_speculative_options,
                              check_speculative, model_options, profiling, read_prompt, sampling_options,
                              speculative_options)
from pyml.core import perf
from pyml.core.errors import PymlError, was_interrupted
from pyml.core.version import __version__
from pyml.nlp.api import LanguageModel, load_model
from pyml.nlp.constrained import MAX_GRAMMAR_CHARS, Constraint, schema_grammar, text_grammar
from pyml.nlp.generator import GenerationResult


def build_parser() -> Parser:
    p = Parser(prog="pyml-infer", description="Generate text with a decoder-only language model on the CPU.")
    add_model_options(p)
    add_prompt_options(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_options(p, max_tokens=32)
    add_speculative_options(p)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", default=None,
                       help="the output must be JSON valid against this JSON schema (docs/structured-output.md)")
    shape.add_argument("--grammar", metavar="FILE", default=None,
                       help="the output must match this grammar (llama.cpp's GBNF, or Lark)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, tokens, stop reason, timings) instead of the text")
    p.add_argument("--lm-head-quant", choices=["q8_0", "q4_0"], default=None,
                   help="quantize a float output head at load")
    p.add_argument("--log", metavar="LEVEL", default=None,
                   help="log level or filters: debug, trace, pyml.nn=trace,pyml=debug (or env PYML_LOG / LOG)")
    p.add_argument("--no-warmup", action="store_true", help="skip warm-up (shows its effect)")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="record every perf event into DIR (events.jsonl, run.json) and write the reports")
    p.add_argument("--version", action="version", version=f"pyml {__version__}")
    return p


def run(args) -> int:
    perf.configure(args.log)
    options = sampling_options(args)
    check_speculative(args)
    prompt = read_prompt(args)
    grammar = read_grammar(args)  # a bad file is refused before the model loads
    ctx = profiling(args.profile)
    with ctx as prof:
        code = _generate(args, prompt, options, prof, grammar)
    if prof is not None:
        say(f"pyml-infer: {prof.outcome()}")
    return code


def read_grammar(args) -> tuple[str, str] | None:
    """--json-schema / --grammar FILE: (llguidance's grammar, what to call it in errors), or None."""
    flag, path = ("--json-schema", args.json_schema) if args.json_schema is not None else ("--grammar", args.grammar)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_GRAMMAR_CHARS + 1)  # a huge file is refused without reading it all
    except (OSError, UnicodeDecodeError) as e:
        raise PymlError(f"{flag} {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    what = f"{flag} {path}"
    return (schema_grammar(text, what) if flag == "--json-schema" else text_grammar(text, what)), what


def _generate(args, prompt: str, options: dict, prof, grammar: tuple[str, str] | None = None) -> int:
    lm = load_model(**model_options(args), warmup=not args.no_warmup, lm_head_quant=args.lm_head_quant)
    if prof is not None:
        prof.set_model(lm)
    if args.ctx_size is not None and args.ctx_size > lm.model.max_positions:  # the cache stops at the window
        say(f"pyml-infer: -c {args.ctx_size} is past the model's window of {lm.model.max_positions} positions; "
            f"using {lm.model.max_positions}")
    if args.chat or args.system is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt = lm.chat_prompt(system + [{"role": "user", "content": prompt}])
    options = dict(options, **speculative_options(args, lm))
    ids = lm.encode(prompt)
    if grammar is not None:
        options["constraint"] = Constraint(lm.tokenizer, *grammar)
    result = GenerationResult(ids)
    out = sys.stdout
    interrupted = False
    try:
        for event in lm.stream(ids, result=result, **options):
            if event.text and not args.json:
                out.write(event.text)
                out.flush()
    except BaseException as e:  # Ctrl-C, or an error it caused (a compile or a span cut short): the summary so far
        if not was_interrupted(e):
            raise
        interrupted, result.stop_reason = True, "interrupted"
    if prof is not None:
        prof.set_result(result)
    if args.json:
        json.dump(result_object(result, lm), out, ensure_ascii=False)
    out.write("\n")
    out.flush()
    if result.stop_reason == "context":
        size = args.ctx_size or lm.model.max_positions
        say(f"pyml-infer: stopped at the context size ({min(size, lm.model.max_positions)} tokens; "
            f"--context-shift goes on past it)")
    say(f"[{result.summary()}{_log_cost(result)} | {startup_summary(lm)} | threads {lm.runtime.threads}"
        f"{' | interrupted' if interrupted else ''}]")
    return 130 if interrupted else 0


def _log_cost(result: GenerationResult) -> str:
    """The stats line's second cost: beside the engine's decode figure (steps only), what making and
    writing the records and [perf] lines cost per step, when there were any (the prefill's lines are
    mostly made in a step's drain: a batch goes out a second after the last one)."""
    if not (result.decode_log_s or result.prefill_log_s):
        return ""
    return f" + logging {result.log_ms_per_token:.2f} ms/token"


def result_object(result: GenerationResult, lm: LanguageModel) -> dict:
    """--json: what was generated and how long it took, in one object. `timings` are the engine's;
    `logging` what the records and [perf] lines cost besides (0 with logging off)."""
    return {"model": lm.source, "text": result.text, "tokens": result.tokens,
            "prompt_tokens": len(result.prompt_tokens), "generated_tokens": len(result.tokens),
            "stop_reason": result.stop_reason, "context_shifts": result.context_shifts,
            "timings": result.timings(),
            "logging": {"prompt_ms": result.prefill_log_s * 1e3, "predicted_ms": result.decode_log_s * 1e3,
                        "predicted_per_token_ms": result.log_ms_per_token},
            "load_ms": lm.load_s * 1e3, "compile_ms": lm.compile_s * 1e3, "warmup_ms": lm.warmup_s * 1e3,
            "threads": lm.runtime.threads}


def startup_summary(lm: LanguageModel) -> str:
    """Load, kernel compiles and warm-up as three figures: a first run's minute of compiling is
    not a slow load."""
    first = " (first run only)" if lm.compile_s >= 0.05 else ""
    return f"load {lm.load_s:.2f} s | compile {lm.compile_s:.1f} s{first} | warm-up {lm.warmup_s:.2f} s"



def main(argv=None) -> int:
    return run_command("pyml-infer", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
