"""pyml-chat: a multi-turn conversation in the terminal, in the model's chat template.

The conversation's KV cache is kept between turns (a PromptCache), so each turn prefills only
its new tokens. Commands: /reset (forget the conversation), /stats (the last reply's timings),
/exit. Ctrl-C stops the reply, not the session. When stdin is not a terminal, each line is one
user turn and only the replies go to stdout.
"""

from __future__ import annotations

import sys

from pyml.cli.main import Parser, run_command, say
from pyml.cli.options import (add_model_options, add_sampling_options, add_speculative_options, check_speculative,
                              model_options, sampling_options, speculative_options)
from pyml.cli.request_profile import profile_summary, recording, split_line
from pyml.core import perf
from pyml.core.errors import was_interrupted
from pyml.core.version import __version__
from pyml.nlp.api import LanguageModel, load_model
from pyml.nlp.generator import GenerationResult

HELP = "commands: /reset forgets the conversation, /stats shows the last reply's timings, /exit ends"


def build_parser() -> Parser:
    p = Parser(prog="pyml-chat", description="Chat with a model in the terminal. " + HELP)
    add_model_options(p)
    add_sampling_options(p, max_tokens=512, ctx_size=4096)
    add_speculative_options(p)
    p.add_argument("--verbose", action="store_true", help="add the attention/FFN/head split to each timing line")
    p.add_argument("--log", metavar="LEVEL", default=None, help="log level (or env PYML_LOG / LOG)")
    p.add_argument("--version", action="version", version=f"pyml {__version__}")
    return p


class Chat:
    def __init__(self, lm: LanguageModel, args, out=None):
        self.lm, self.args, self.out = lm, args, out or sys.stdout
        self.options = dict(sampling_options(args), **speculative_options(args, lm))
        self.cache = lm.new_prompt_cache(min(args.ctx_size, lm.model.max_positions))
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.history = list(self.system)
        self.last: GenerationResult | None = None
        self.last_line = ""

    def reset(self):
        self.history = list(self.system)
        self.cache.reset()

    def turn(self, text: str) -> None:
        """Answer one user message, streaming the reply; Ctrl-C ends the reply early."""
        messages = self.history + [{"role": "user", "content": text}]
        ids = self.lm.encode(self.lm.chat_prompt(messages))
        room = self.cache.max_len - len(ids)
        if room < 1:
            say(f"pyml-chat: the conversation is {len(ids)} tokens, the context size is {self.cache.max_len}: "
                f"/reset to start again")
            return
        options = dict(self.options, max_tokens=min(self.options["max_tokens"], room))
        result, records = GenerationResult(ids), []
        with recording(records, self.args.verbose):
            try:
                for event in self.lm.stream(ids, cache=self.cache, result=result, **options):
                    self.out.write(event.text)
                    self.out.flush()
            except BaseException as e:  # Ctrl-C, or an error it caused: the reply so far
                if not was_interrupted(e):
                    raise
                result.stop_reason = "interrupted"
        self.out.write("\n")
        self.out.flush()
        self.history = messages + [{"role": "assistant", "content": result.text}]
        self.last = result
        line = timing_line(result)
        if self.args.verbose and result.decode_s:
            line += " | " + split_line(profile_summary(records))
        self.last_line = line
        say(line)


def timing_line(result: GenerationResult) -> str:
    cached = f" ({result.cached_tokens} cached)" if result.cached_tokens else ""
    end = " | interrupted" if result.stop_reason == "interrupted" else ""
    if result.drafted:
        end = f" | drafted {result.drafted}, accepted {result.accepted} ({100 * result.acceptance:.0f}%)" + end
    return (f"[prompt {result.prefilled_tokens} tokens{cached} in {result.prefill_s * 1e3:.0f} ms | "
            f"generated {len(result.tokens)} tokens, {result.decode_tok_s:.1f} tok/s{end}]")


def run(args) -> int:
    perf.configure(args.log)
    sampling_options(args)  # bad options fail before the model loads
    check_speculative(args)
    lm = load_model(**model_options(args))
    chat = Chat(lm, args)
    interactive = sys.stdin.isatty()
    if interactive:
        say(f"pyml-chat: {lm.source} ({HELP})")
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            break
        if not interactive and not line:
            break
        text = line.strip()
        if text in ("/exit", "/quit", "/bye"):
            break
        if text == "/reset":
            chat.reset()
            say("pyml-chat: conversation reset")
        elif text == "/stats":
            say(chat.last_line or "pyml-chat: no reply yet")
        elif text.startswith("/"):
            say(f"pyml-chat: unknown command {text.split()[0]} ({HELP})")
        elif text:
            chat.turn(text)
    if interactive:
        sys.stdout.write("\n")
    return 0


def main(argv=None) -> int:
    return run_command("pyml-chat", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
