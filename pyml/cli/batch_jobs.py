"""pyml-batch's jobs: the input lines read into jobs, one job run on a loaded model, and the
output written in input order and resumed from.

An input line is `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [...]}`, with any of
OVERRIDES beside it (they replace the command's flags for that line). An output line is
`{"id", "text", "tokens", "stop_reason", "timings"}` or, for a line that could not be read or
run, `{"id" (when the line had one), "line", "error"}`: a bad line never stops the batch.

A line may also be a request of OpenAI's batch format (as OpenAI's Batch API and vLLM's run_batch
read them): `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions",
"body"}`, the body checked as pyml-serve checks one (serve_requests.parse). Its output line is that
format's: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`,
the body the reply pyml-serve would give, or `{"error": {...}}` with a 4xx/5xx status_code.
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pyml.cli.openai_objects import FINISH, choice, envelope, new_id, usage
from pyml.cli.serve_requests import SHAPES, TOOLS, RequestError, check_context, parse
from pyml.cli.serve_structured import template_messages
from pyml.core.errors import PymlError
from pyml.nlp.sampling import check_sampling

# per-line overrides of the command's flags, with the JSON types each accepts
_NUMBER = (int, float)
OVERRIDES = {"max_tokens": int, "temperature": _NUMBER, "top_k": int, "top_p": _NUMBER, "min_p": _NUMBER,
             "repetition_penalty": _NUMBER, "seed": int, "stop": list, "system": str, "chat": bool}
_KEYS = {"id", "prompt", "messages", *OVERRIDES}

OPENAI_URLS = {"/v1/chat/completions": True, "/v1/completions": False}  # a batch request's url -> chat
_OPENAI_KEYS = {"custom_id", "method", "url", "body"}
# body fields that ask for more than one text reply: accepted only at the value that asks for none
_ONE_TEXT_REPLY = {"stream": (False,), "n": (1,), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,)}
_NOT_IN_BATCH = SHAPES | TOOLS | {"stream_options", "cache_prompt", "pyml"}


@dataclass(frozen=True)
class Job:
    """One input line to generate from: its id, its line number, and everything it asks for."""
    id: object
    line: int
    prompt: str | list | None = None                # text, or token ids (an OpenAI completions request's)
    messages: tuple | None = None
    options: dict = field(default_factory=dict)   # the command's sampling options, with the line's overrides
    chat: bool = False
    system: str | None = None
    openai: str | None = None                      # the url of a line in OpenAI's batch format (id: its custom_id)
    max_tokens_given: bool = False                 # an OpenAI line's own max_tokens: refused if it cannot fit

    @property
    def size(self) -> int:
        """How long the prompt is, in characters: the scheduler starts the longest first."""
        text = self.prompt if self.prompt is not None else "".join(str(m.get("content", "")) for m in self.messages)
        return len(text) + (len(self.system) if self.system else 0)


class LineError(PymlError):
    """A line that cannot run; `custom_id` when the line is in OpenAI's batch format (its output line
    is then that format's)."""

    def __init__(self, message: str, custom_id: str | None = None, param: str | None = None):
        super().__init__(message)
        self.custom_id, self.param = custom_id, param


def error_line(line: int, message: str, job_id=None) -> dict:
    out = {"id": job_id} if job_id is not None else {}
    return {**out, "line": line, "error": message}


def openai_line(custom_id: str, status: int, body: dict) -> dict:
    """An output line of OpenAI's batch format."""
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex[:24]}", "body": body},
            "error": None}


def openai_error(custom_id: str, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return openai_line(custom_id, status, {"error": {"message": message, "type": kind, "param": param, "code": code}})


def job_error(job: Job, message: str, status: int = 400) -> dict:
    """The output line of a job that could not run, in its line's format."""
    return openai_error(job.id, message, status) if job.openai else error_line(job.line, message, job.id)


def failed(out: dict) -> bool:
    """Whether an output line says its input line did not run."""
    return out["response"]["status_code"] != 200 if "custom_id" in out else "error" in out


def output_id(out: dict):
    """The input line's id an output line answers (an OpenAI line's custom_id)."""
    return out["custom_id"] if "custom_id" in out else out.get("id")


def output_tokens(out: dict) -> int:
    """The tokens an output line's reply generated."""
    if "custom_id" in out:
        return 0 if failed(out) else out["response"]["body"]["usage"]["completion_tokens"]
    return len(out.get("tokens", ()))


def parse_line(text: str, line: int, defaults: dict, chat: bool = False, system: str | None = None) -> Job:
    """A Job from one input line, or PymlError saying what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise PymlError(f"not a JSON object ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise PymlError(f"expected a JSON object, got {type(obj).__name__}")
    if "custom_id" in obj:
        return _openai_job(obj, line, defaults)
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
        if key == "max_tokens" and value < 0:  # named as the line names it, not as the flag is spelt
            raise PymlError(f"\"max_tokens\" must be >= 0, got {value}")
        if key == "chat":
            chat = value
        elif key == "system":
            system = value
        else:
            options[key] = value
    check_sampling(options, lambda name: f"\"{name}\"")  # named as the line names it
    return Job(obj["id"], line, prompt, tuple(messages) if messages is not None else None, options, chat, system)


def _openai_job(obj: dict, line: int, defaults: dict) -> Job:
    """A Job from a request of OpenAI's batch format. The body's fields replace the command's flags,
    as a pyml line's do; what it asks beyond one text reply (a stream, n > 1, log-probabilities, a
    JSON shape or tools) is refused by name. Its `model` is taken as given: the reply names the
    model that answered."""
    custom_id = obj["custom_id"]
    if not isinstance(custom_id, str) or not custom_id:
        raise PymlError("\"custom_id\" must be a non-empty string (OpenAI's batch format)")
    try:
        if unknown := sorted(set(obj) - _OPENAI_KEYS):
            raise PymlError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                            f"(a request of OpenAI's batch format has {', '.join(sorted(_OPENAI_KEYS))})")
        if obj.get("method", "POST") != "POST":
            raise PymlError(f"\"method\" must be \"POST\", got {obj['method']!r}")
        url, body = obj.get("url"), obj.get("body")
        if url not in OPENAI_URLS:
            raise PymlError(f"\"url\" must be one of {', '.join(OPENAI_URLS)}, got {url!r}")
        if not isinstance(body, dict):
            raise PymlError("\"body\" must be a JSON object: the request")
        for key, value in body.items():
            if value is None:
                continue
            if key in _NOT_IN_BATCH or (key in _ONE_TEXT_REPLY and not any(
                    type(value) is type(v) and value == v for v in _ONE_TEXT_REPLY[key])):
                raise RequestError(f"'{key}' is not run by pyml-batch: it writes one text reply a line "
                                   "(pyml-serve answers this request)", key, code="unsupported_parameter")
        messages = []
        reqs = parse({k: v for k, v in body.items() if k != "model"}, OPENAI_URLS[url], "",
                     lambda checked: messages.extend(checked) or "")
        if len(reqs) > 1:
            raise RequestError("'prompt' is a list of several prompts: a batch file has one a line", "prompt")
    except RequestError as e:
        raise LineError(e.message, custom_id, e.param) from None
    except PymlError as e:
        raise LineError(str(e), custom_id) from None
    req, options = reqs[0], dict(defaults)
    given = {k for k, v in body.items() if v is not None} | ({"repetition_penalty"} if "repeat_penalty" in body else set())
    if given & {"max_tokens", "max_completion_tokens"}:
        options["max_tokens"] = req.max_tokens
    if "stop" in given:
        options["stop"] = req.stop
    options.update({k: v for k, v in req.sampling.items() if k in given})
    prompt = None if messages else (req.prompt_ids if req.prompt_ids is not None else req.prompt)
    return Job(custom_id, line, prompt, tuple(messages) if messages else None, options, openai=url,
               max_tokens_given="max_tokens" in given or "max_completion_tokens" in given)


def read_jobs(path, defaults: dict, chat: bool = False, system: str | None = None) -> tuple[list, list]:
    """(jobs, errors) from an input file: errors are (line number, output line) of the lines that
    cannot run."""
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
        except LineError as e:
            errors.append((n, error_line(n, str(e)) if e.custom_id is None else
                           openai_error(e.custom_id, str(e), param=e.param)))
            continue
        except PymlError as e:
            errors.append((n, error_line(n, str(e))))
            continue
        key = id_key(job.id)
        if key in seen:
            errors.append((n, job_error(job, f"id {job.id!r} repeats the id of line {seen[key]}")))
            continue
        seen[key] = n
        jobs.append(job)
    return jobs, errors


def id_key(job_id) -> str:
    """Ids compare as JSON: 1 and "1" are different ids."""
    return json.dumps(job_id)


# --- one job ------------------------------------------------------------------------------------

def _prompt(lm, job: Job) -> str | list:
    if job.messages is not None or job.chat or job.system is not None:
        messages = list(job.messages) if job.messages is not None else [{"role": "user", "content": job.prompt}]
        if job.system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": job.system})
        return lm.chat_prompt(template_messages(messages))
    return job.prompt


def _output(lm, job: Job, result) -> dict:
    if job.openai:  # the reply pyml-serve would give
        chat = OPENAI_URLS[job.openai]
        body = envelope(chat, False, new_id(chat), int(time.time()), Path(lm.source).name,
                        [choice(chat, result.text, FINISH.get(result.stop_reason, "stop"))])
        body.update(usage=usage([result]), timings=result.timings())
        return openai_line(job.id, 200, body)
    return {"id": job.id, "text": result.text, "tokens": result.tokens, "stop_reason": result.stop_reason,
            "timings": result.timings()}


def _refusal(lm, job: Job, ids: list) -> dict | None:
    """The error line of an OpenAI-format line whose own max_tokens does not fit the context after its
    prompt: pyml-serve's 400 for the same request (check_context), not a reply cut at the window."""
    if not job.max_tokens_given:
        return None
    try:
        check_context(len(ids), job.options["max_tokens"], job.options.get("ctx_size") or lm.model.max_positions)
    except RequestError as e:
        return openai_error(job.id, e.message, e.status, e.param, e.code)
    return None


def _prompt_ids(lm, job: Job) -> list:
    prompt = _prompt(lm, job)
    return lm.encode(prompt) if isinstance(prompt, str) else prompt


def run_job(lm, job: Job, speculative: dict | None = None) -> dict:
    """The output line of one job on a loaded LanguageModel (an error line if it cannot run);
    `speculative`: LanguageModel.generate's speculative keyword (pyml-batch --lookup-ngram), or none."""
    try:
        ids = _prompt_ids(lm, job)
        if (refused := _refusal(lm, job, ids)) is not None:
            return refused
        result = lm.generate(ids, **job.options, **(speculative or {}))
    except PymlError as e:
        return job_error(job, str(e))
    except Exception as e:  # one line's failure is that line's output, never the batch's end
        return job_error(job, f"internal error: {type(e).__name__}: {e}", 500)
    return _output(lm, job, result)


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
            prompt = _prompt_ids(lm, job)
            if (refused := _refusal(lm, job, prompt)) is not None:
                yield job, refused
                continue
            lm.stream_batch([prompt], ctx_size=shared.get("ctx_size"), options=[ask]).close()  # checks it all
        except PymlError as e:
            yield job, job_error(job, str(e))
            continue
        ready.append(job)
        prompts.append(prompt)
        options.append(ask)
    if not ready:
        return
    for index, event in lm.stream_batch(prompts, batch=batch, ctx_size=shared.get("ctx_size"), options=options,
                                        **(speculative or {})):
        if event.result is not None:
            yield ready[index], _output(lm, ready[index], event.result)


# --- the output file ----------------------------------------------------------------------------

_RESULT_KEYS, _ERROR_KEYS = {"id", "text", "tokens", "stop_reason", "timings"}, {"id", "line", "error"}
_OPENAI_OUTPUT_KEYS = {"id", "custom_id", "response", "error"}


def _is_output_line(obj) -> bool:
    """A line pyml-batch writes: a result or an error line, nothing else."""
    if isinstance(obj, dict) and set(obj) == _OPENAI_OUTPUT_KEYS:
        return isinstance(obj["response"], dict) and isinstance(obj["response"].get("status_code"), int)
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
        if not failed(obj) and id_key(output_id(obj)) not in done:
            done.add(id_key(output_id(obj)))
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
