"""pyml-batch's jobs: the input lines read into jobs, one job run on a loaded model, and the
output written in input order and resumed from.

An input line is `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [...]}`, with any of
OVERRIDES beside it (they replace the command's flags for that line). An output line is
`{"id", "text", "tokens", "stop_reason", "timings"}` or, for a line that could not be read or
run, `{"id" (when the line had one), "line", "error"}`: a bad line never stops the batch.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from pyml.core.errors import PymlError

# per-line overrides of the command's flags, with the JSON types each accepts
_NUMBER = (int, float)
OVERRIDES = {"max_tokens": int, "temperature": _NUMBER, "top_k": int, "top_p": _NUMBER, "min_p": _NUMBER,
             "repetition_penalty": _NUMBER, "seed": int, "stop": list, "system": str, "chat": bool}
_KEYS = {"id", "prompt", "messages", *OVERRIDES}


@dataclass(frozen=True)
class Job:
    """One input line to generate from: its id, its line number, and everything it asks for."""
    id: object
    line: int
    prompt: str | None = None
    messages: tuple | None = None
    options: dict = field(default_factory=dict)   # the command's sampling options, with the line's overrides
    chat: bool = False
    system: str | None = None

    @property
    def size(self) -> int:
        """How long the prompt is, in characters: the scheduler starts the longest first."""
        text = self.prompt if self.prompt is not None else "".join(str(m.get("content", "")) for m in self.messages)
        return len(text) + (len(self.system) if self.system else 0)


def error_line(line: int, message: str, job_id=None) -> dict:
    out = {"id": job_id} if job_id is not None else {}
    return {**out, "line": line, "error": message}


def parse_line(text: str, line: int, defaults: dict, chat: bool = False, system: str | None = None) -> Job:
    """A Job from one input line, or PymlError saying what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise PymlError(f"not a JSON object ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise PymlError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise PymlError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                        f"(use id, prompt or messages, and {', '.join(OVERRIDES)})")
    if "id" not in obj or isinstance(obj["id"], (dict, list)) or obj["id"] is None:
        raise PymlError("no \"id\" (a string or a number)")
    if ("prompt" in obj) == ("messages" in obj):
        raise PymlError("give exactly one of \"prompt\" (a string) and \"messages\" (a list)")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if prompt is not None and not isinstance(prompt, str):
        raise PymlError("\"prompt\" must be a string")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise PymlError("\"messages\" must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    options = dict(defaults)
    for key, kind in OVERRIDES.items():
        if key not in obj:
            continue
        value = obj[key]
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise PymlError(f"\"{key}\" has the wrong type ({type(value).__name__})")
        if key == "stop" and not all(isinstance(s, str) for s in value):
            raise PymlError("\"stop\" must be a list of strings")
        if key == "chat":
            chat = value
        elif key == "system":
            system = value
        else:
            options[key] = value
    return Job(obj["id"], line, prompt, tuple(messages) if messages is not None else None, options, chat, system)


def read_jobs(path, defaults: dict, chat: bool = False, system: str | None = None) -> tuple[list, list]:
    """(jobs, errors) from an input file: errors are output lines for the lines that cannot run."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise PymlError(f"{path}: {e.strerror if isinstance(e, OSError) else e}") from None
    jobs, errors, seen = [], [], {}
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            job = parse_line(text, n, defaults, chat, system)
        except PymlError as e:
            errors.append(error_line(n, str(e)))
            continue
        key = id_key(job.id)
        if key in seen:
            errors.append(error_line(n, f"id {job.id!r} repeats the id of line {seen[key]}", job.id))
            continue
        seen[key] = n
        jobs.append(job)
    return jobs, errors


def id_key(job_id) -> str:
    """Ids compare as JSON: 1 and "1" are different ids."""
    return json.dumps(job_id)


# --- one job ------------------------------------------------------------------------------------

def _prompt(lm, job: Job) -> str:
    if job.messages is not None or job.chat or job.system is not None:
        messages = list(job.messages) if job.messages is not None else [{"role": "user", "content": job.prompt}]
        if job.system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": job.system})
        return lm.chat_prompt(messages)
    return job.prompt


def _output(job: Job, result) -> dict:
    return {"id": job.id, "text": result.text, "tokens": result.tokens, "stop_reason": result.stop_reason,
            "timings": result.timings()}


def run_job(lm, job: Job, speculative: dict | None = None) -> dict:
    """The output line of one job on a loaded LanguageModel (an error line if it cannot run);
    `speculative`: LanguageModel.generate's speculative keyword (pyml-batch --lookup-ngram), or none."""
    try:
        result = lm.generate(_prompt(lm, job), **job.options, **(speculative or {}))
    except PymlError as e:
        return error_line(job.line, str(e), job.id)
    except Exception as e:  # one line's failure is that line's output, never the batch's end
        return error_line(job.line, f"internal error: {type(e).__name__}: {e}", job.id)
    return _output(job, result)


BATCH_ONLY = ("ctx_size", "context_shift", "n_keep")  # the options a batch shares (not per line)


def run_jobs_batched(lm, jobs: list, batch: int, speculative: dict | None = None):
    """(job, output line) of every job, `batch` sequences a step on one model (LanguageModel.stream_batch),
    as each ends. A line that cannot run (its prompt, its options) is its own error line first.
    `speculative`: stream_batch's speculative keyword (pyml-batch --lookup-ngram), or none."""
    shared = {k: v for k, v in (jobs[0].options if jobs else {}).items() if k in BATCH_ONLY}
    if shared.get("context_shift"):
        raise PymlError("--context-shift is not available with --batch > 1: each sequence stops at a full cache")
    ready, prompts, options = [], [], []
    for job in jobs:
        ask = {k: v for k, v in job.options.items() if k not in BATCH_ONLY}
        try:
            prompt = lm.encode(_prompt(lm, job))
            lm.stream_batch([prompt], ctx_size=shared.get("ctx_size"), options=[ask]).close()  # checks it all
        except PymlError as e:
            yield job, error_line(job.line, str(e), job.id)
            continue
        ready.append(job)
        prompts.append(prompt)
        options.append(ask)
    if not ready:
        return
    for index, event in lm.stream_batch(prompts, batch=batch, ctx_size=shared.get("ctx_size"), options=options,
                                        **(speculative or {})):
        if event.result is not None:
            yield ready[index], _output(ready[index], event.result)


# --- the output file ----------------------------------------------------------------------------

_RESULT_KEYS, _ERROR_KEYS = {"id", "text", "tokens", "stop_reason", "timings"}, {"id", "line", "error"}


def _is_output_line(obj) -> bool:
    """A line pyml-batch writes: a result or an error line, nothing else."""
    return isinstance(obj, dict) and (set(obj) == _RESULT_KEYS or set(obj) in (_ERROR_KEYS, _ERROR_KEYS - {"id"}))


def resume(path) -> set:
    """The ids an earlier run finished in `path`, keeping only their lines there.

    Error lines and a last line cut short (a run that was killed while writing) are dropped, so
    those jobs run again and no id appears twice in the file. A file that holds anything else is
    not an earlier run's output: it is refused, never rewritten. A symbolic link is followed (its
    target is rewritten), and the file keeps its permissions.
    """
    path = Path(os.path.realpath(path))  # a symlink's target is what gets rewritten, the link stays
    try:
        status = path.stat()
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise PymlError(f"--out {path}: {e.strerror}") from None
    if not stat.S_ISREG(status.st_mode):
        raise PymlError(f"--out {path}: not a regular file")
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise PymlError(f"--out {path}: {e.strerror}") from None
    kept, done = [], set()
    for number, raw in enumerate(lines[:-1], 1):  # the last piece has no newline: empty, or cut short
        try:
            obj = json.loads(raw.decode("utf-8")) if raw.strip() else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = False
        if obj is None:
            continue
        if not _is_output_line(obj):
            raise PymlError(f"--out {path}: line {number} is not a line pyml-batch writes; not resuming into "
                            f"(nor overwriting) a file that is not its own output")
        if "error" not in obj and id_key(obj["id"]) not in done:
            done.add(id_key(obj["id"]))
            kept.append(raw + b"\n")
    if len(kept) < len(lines) - 1 or lines[-1]:
        _rewrite(path, b"".join(kept), status)
    return done


def _rewrite(path: Path, data: bytes, status: os.stat_result) -> None:
    """Replace the file's bytes whole (a crash leaves the old or the new file), keeping its mode."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            os.fchmod(f.fileno(), stat.S_IMODE(status.st_mode))  # not the umask's default: 0600 stays 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PymlError(f"--out {path}: cannot rewrite it: {e.strerror}") from None


class OrderedWriter:
    """Appends output lines in input order: a line that completes early waits for those before it."""

    def __init__(self, path, order: list[int]):
        self.order = order            # the input line numbers still to be written, in order
        self.next = 0
        self.pending: dict[int, dict] = {}
        try:
            self.file = open(path, "a", encoding="utf-8")
        except OSError as e:
            raise PymlError(f"--out {path}: {e.strerror}") from None

    def add(self, line: int, out: dict) -> None:
        self.pending[line] = out
        while self.next < len(self.order) and self.order[self.next] in self.pending:
            obj = self.pending.pop(self.order[self.next])
            self.file.write(json.dumps(obj, ensure_ascii=False) + "\n")
            self.next += 1
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
