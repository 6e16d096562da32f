"""What a report suggests a user run, checked before it is said.

A suggestion is an option (or a command) pyml accepts for *this* model and *this* run: each is
asked of the check pyml itself runs when the option is given (--lm-head-quant:
nlp.api.check_head_quant; -t: core.runtime.RuntimeConfig), is never what the run already used,
and carries its expected gain worked out from the run's measured figures. When the run was a
`pyml-infer` command (run.json "command"), the suggestion is that command with the option
changed and its --profile pointed at a new directory, ready to run and to `pyml-report compare`.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from pyml.core.errors import PymlError
from pyml.core.runtime import RuntimeConfig
from pyml.nlp.api import check_head_quant
from pyml.quant import QuantType, traits_of

# the spellings of the options a report may change (pyml/cli/options.py, pyml_infer.py)
_SPELLINGS = {"--threads": ("-t", "--threads"), "--lm-head-quant": ("--lm-head-quant",),
              "--temperature": ("--temperature", "--temp"), "--no-warmup": ("--no-warmup",),
              "--profile": ("--profile",), "--model": ("-m", "--model", "--gguf", "--safetensors")}
_FLAGS = {"--no-warmup"}  # options without a value
_INFER = ("pyml-infer", "pyml_infer.py")


def _option_at(argv, i):
    """(canonical option, number of argv items it takes) for argv[i], or (None, 1)."""
    word = argv[i]
    name = word.split("=", 1)[0]
    for canon, spellings in _SPELLINGS.items():
        if name in spellings:
            return canon, 1 if ("=" in word or canon in _FLAGS) else 2
    return None, 1


def infer_args(command) -> list | None:
    """The arguments of a pyml-infer command line (run.json "command"), or None for another one."""
    if not command or Path(str(command[0])).name not in _INFER:
        return None
    return [str(a) for a in command[1:]]


def option_value(args, option: str):
    """The value `option` has in `args` (True for a flag), or None when it is not given."""
    i = 0
    while i < len(args):
        canon, n = _option_at(args, i)
        if canon == option:
            if option in _FLAGS:
                return True
            return args[i].split("=", 1)[1] if "=" in args[i] else (args[i + 1] if i + 1 < len(args) else None)
        i += n
    return None


def with_options(args, changes: dict) -> list:
    """`args` with each option of `changes` removed and, unless its value is None, given anew."""
    out, i = [], 0
    while i < len(args):
        canon, n = _option_at(args, i)
        if canon not in changes:
            out.extend(args[i:i + n])
        i += n
    for option, value in changes.items():
        if value is True:
            out.append(option)
        elif value is not None:
            out += [option, str(value)]
    return out


def suggestion(run, text: str, changes: dict, tag: str, gain_ms: float | None = None) -> dict:
    """A suggestion to change options; `tag` names the new profile directory (DIR-tag)."""
    args = infer_args(run.info.get("command"))
    argv = None
    if args is not None:
        profile = option_value(args, "--profile")
        if profile:
            changes = {**changes, "--profile": f"{str(profile).rstrip('/')}-{tag}"}
        argv = ["pyml-infer", *with_options(args, changes)]
    return _said(text, [argv] if argv else [], gain_ms, {k: v for k, v in changes.items() if k != "--profile"})


def _said(text, commands, gain_ms, changes=None) -> dict:
    """commands: argv lists, run one after the other."""
    return {"text": text, "changes": changes or {}, "commands": commands,
            "command": " && ".join(shlex.join(c) for c in commands) or None, "gain_ms": gain_ms}


def ms(x) -> str:
    return f"{x:.3f} ms" if x < 1 else f"{x:.2f} ms"


# --- the suggestions ------------------------------------------------------------------------

def head_quant(run, head: dict | None, step_ms: float) -> list:
    """--lm-head-quant q8_0 / q4_0, where pyml accepts it for this head, with the time it should save:
    the head's measured ms per step x the bytes it would stop reading, at the same GB/s."""
    model = run.info.get("model") or {}
    stored = (model.get("lm_head") or {}).get("dtype") or (head or {}).get("dtype")
    row_len = (model.get("lm_head") or {}).get("in") or (head or {}).get("in")
    if not stored or not row_len or not head or not head.get("calls"):
        return []
    ms_per_call = head["ms"] / head["calls"]
    before = _bytes_per_weight(stored)
    out = []
    for kind in ("q8_0", "q4_0"):
        try:
            qtype = check_head_quant(kind, stored, row_len)
        except PymlError:
            continue
        t = traits_of(qtype)
        after = t.type_size / t.block_size
        if before is None or after >= before:
            continue
        gain = ms_per_call * (1 - after / before)
        out.append(suggestion(run, f"Store the head as {qtype.name} at load (`--lm-head-quant {kind}`): "
                                   f"{before / after:.1f}x fewer bytes per token; at the head's measured speed "
                                   f"about {ms(gain)} less per decode step ({100 * gain / step_ms:.0f}%)",
                              {"--lm-head-quant": kind}, f"head-{kind}", gain))
    return out


def _bytes_per_weight(type_name: str) -> float | None:
    q = QuantType.__members__.get(str(type_name).upper())
    if q is None:
        return None
    t = traits_of(q)
    return t.type_size / t.block_size


def threads(run, n: int, text: str, gain_ms: float | None = None) -> list:
    """-t n, as pyml would run it (RuntimeConfig's check and its cap), unless the run used as many."""
    try:
        want = RuntimeConfig(n, warmup=False).threads
    except PymlError:
        return []
    if want == run.info.get("threads"):
        return []
    return [suggestion(run, text.format(n=want), {"--threads": want}, f"t{want}", gain_ms)]


def warm_up(run, text: str, gain_ms: float) -> list:
    """Drop --no-warmup, when the run had it."""
    if run.info.get("warmup") is not False:
        return []
    return [suggestion(run, text, {"--no-warmup": None}, "warm", gain_ms)]


def greedy(run, text: str, gain_ms: float) -> list:
    """--temperature 0, when the run's command sampled (a run whose options are not known is not told)."""
    args = infer_args(run.info.get("command"))
    if args is None:
        return []
    try:
        temperature = float(option_value(args, "--temperature") or 0.0)
    except ValueError:
        return []
    if temperature == 0:
        return []
    return [suggestion(run, text, {"--temperature": 0}, "greedy", gain_ms)]


def quantize_weights(run, kind: str, text: str, gain_ms: float) -> list:
    """pyml-quantize SRC DST --type kind (then the run on DST): for a GGUF source only, what
    pyml-quantize reads."""
    source = (run.info.get("model") or {}).get("source")
    if not source or not str(source).lower().endswith(".gguf") or not Path(source).is_file():
        return []
    dst = str(Path(source).with_name(Path(source).stem + f"-{kind}.gguf"))
    commands = [["pyml-quantize", str(source), dst, "--type", kind]]
    args = infer_args(run.info.get("command"))
    if args is not None:
        profile = option_value(args, "--profile")
        changes = {"--model": dst, **({"--profile": f"{str(profile).rstrip('/')}-{kind}"} if profile else {})}
        commands.append(["pyml-infer", *with_options(args, changes)])
    return [_said(text, commands, gain_ms)]
