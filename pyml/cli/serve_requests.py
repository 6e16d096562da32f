"""pyml-serve's request bodies: OpenAI's chat and completion fields, checked, turned into what
LanguageModel.stream takes. Every bad field is a RequestError naming it (a 4xx, never a 500), and
every field pyml does not honour is refused by name (`unsupported_parameter`), never ignored:
a client asking for JSON or a tool call must not proceed on free text."""

from __future__ import annotations

from dataclasses import dataclass, field

from pyml.cli.main import one_line
from pyml.core.errors import PymlError
from pyml.nlp.sampling import SamplingConfig

ROLES = {"system", "developer", "user", "assistant", "tool"}  # OpenAI's "developer" is a system message
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 400  # per stop string: text that could begin one is held back, so it bounds that too
MAX_SEED = 2**64 - 1  # plenty; numpy would take any size (and hash a huge one slowly)
MAX_TOP_LOGPROBS = {True: 20, False: 5}  # chat's top_logprobs, completions' logprobs: OpenAI's limits
MAX_LOGIT_BIAS = 1024  # entries of a logit_bias (OpenAI's own limit is lower: 300)

SAMPLING = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repeat_penalty",
            "frequency_penalty", "presence_penalty", "seed"}
COMMON = {"model", "max_tokens", "max_completion_tokens", "stop", "stream", "stream_options", "n",
          "cache_prompt", "pyml", "logit_bias", "logprobs"} | SAMPLING
SHAPES = {"response_format", "grammar", "json_schema"}  # structured output (serve_structured.py)
TOOLS = {"tools", "tool_choice", "parallel_tool_calls"}
HONOURED = {True: COMMON | SHAPES | TOOLS | {"messages", "top_logprobs"},
            False: COMMON | SHAPES | {"prompt", "echo"}}  # chat, completions
# OpenAI fields that change nothing pyml does: accepted and ignored (docs/serving.md says why each)
IGNORED = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
# fields pyml does not implement, accepted only at the value that asks for what pyml does anyway
AS_DEFAULT = {"best_of": (1,), "functions": ([],), "function_call": ("none",)}
MESSAGE_FIELDS = {"role", "content", "tool_calls", "tool_call_id"}  # the template renders them


class RequestError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type, the parameter at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        message, param = _sendable(message), _sendable(param)  # a client's bytes may be echoed here
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def check_context(n_prompt: int, max_tokens: int | None, ctx_size: int) -> None:
    """A prompt of n_prompt tokens and max_tokens more (None: the room left) in a context of ctx_size,
    or the request's refusal (400 context_length_exceeded): pyml-serve's, and pyml-batch's for an
    OpenAI-format line, where OpenAI's own API refuses too rather than generate less than asked."""
    if n_prompt > ctx_size:
        raise RequestError(f"the prompt is {n_prompt} tokens, longer than the context size of {ctx_size}",
                           code="context_length_exceeded")
    if max_tokens is not None and n_prompt + max_tokens > ctx_size:
        raise RequestError(f"max_tokens {max_tokens} + the prompt's {n_prompt} tokens exceed the context size "
                           f"of {ctx_size}", "max_tokens", code="context_length_exceeded")
    if n_prompt >= ctx_size:
        raise RequestError(f"the prompt is {n_prompt} tokens and fills the context size of {ctx_size}: no room "
                           "to generate", code="context_length_exceeded")


@dataclass
class Request:
    """One checked request: the prompt (text), the options, and what the client asked of the server."""
    prompt: str
    max_tokens: int | None
    sampling: dict
    stop: list = field(default_factory=list)
    stream: bool = False
    profile: bool = False
    cache_prompt: bool = True
    include_usage: bool = False
    n: int = 1                      # completions of the prompt (choices), run together (--parallel)
    structured: object = None       # serve_structured.Structured: the reply's shape (JSON, tool calls)
    constraint: object = None       # constrained.Constraint the tokens must match (None: free text)
    prompt_ids: list | None = None  # completions: a prompt given as token ids (then `prompt` is its text)
    logprobs: int | None = None     # None: none asked; else each token's, with this many likeliest
    echo: bool = False              # completions: the prompt goes first in the text (and its logprobs)


MAX_CHOICES = 16  # `n`: a request's completions at most (each takes a sequence of the batch)


def _sendable(text: str | None) -> str | None:
    """`text` that encodes as UTF-8 (a lone surrogate from the client is written as its escape)."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _name(key) -> str:
    """A client's field name, fit to quote in an error: escaped, and short."""
    text = repr(key)
    return text if len(text) <= 64 else text[:60] + "...'"


def unsupported(name: str, why: str) -> RequestError:
    return RequestError(f"'{name}' is not supported by pyml: {why}", name, code="unsupported_parameter")


def check_fields(body: dict, chat: bool) -> None:
    """Every field is honoured, ignored on purpose (IGNORED), or asks for the default (AS_DEFAULT)."""
    for key, value in body.items():
        if key in HONOURED[chat] or key in IGNORED:
            continue
        if key in AS_DEFAULT:
            if value is None or any(value == v and type(value) is type(v) for v in AS_DEFAULT[key]):
                continue
            raise unsupported(key, "pyml has no best_of or the legacy functions here "
                                   "(tools and tool_choice replace them)")
        if key in HONOURED[not chat]:
            raise unsupported(key, f"it belongs to /v1/{'completions' if chat else 'chat/completions'}")
        raise unsupported(_sendable(key)[:64], "no such field here")


def _text(value: str, param: str, where: str) -> str:
    """`value`, if it is Unicode text (JSON's \\ud800 escapes make lone surrogates, which are not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{where} is not valid Unicode text: a lone surrogate "
                           f"{value[e.start]!r} at character {e.start}", param) from None
    return value


def _get(body: dict, name: str, kinds, default=None, check=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise RequestError(f"'{name}' must be {what or kinds.__name__}, got a boolean", name)
    if not isinstance(value, kinds):
        raise RequestError(f"'{name}' must be {what or getattr(kinds, '__name__', kinds)}, "
                           f"got {type(value).__name__}", name)
    if check is not None and not check(value):
        raise RequestError(f"'{name}' is out of range: {value!r} ({what})", name)
    return value


def _number(body, name, default, check, what):
    return _get(body, name, (int, float), default, check, what)


def parse(body, chat: bool, model_id: str, chat_prompt) -> list[Request]:
    """The Requests of a decoded JSON body: one, or one per prompt of a completions request's list
    (same options); `chat_prompt(messages)` renders a conversation."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_fields(body, chat)
    _check_model(body, model_id)
    prompts = [(chat_prompt(_messages(body)), None)] if chat else _prompts(body.get("prompt"))
    logprobs, echo = _logprobs(body, chat), _get(body, "echo", bool, False, what="a boolean")
    least = 0 if echo else 1  # echo with max_tokens 0: the prompt scored, nothing generated (OpenAI's too)
    max_tokens = _get(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                      int, None, lambda n: n >= least, f"an integer >= {least}")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' must be a string or a list of up to {MAX_STOP_STRINGS} strings", "stop")
    for i, text in enumerate(stop):
        if len(text) > MAX_STOP_CHARS:
            raise RequestError(f"stop string {i} is {len(text)} characters; at most {MAX_STOP_CHARS} are "
                               "allowed", "stop")
        _text(text, "stop", f"stop string {i}")
    sampling = dict(
        temperature=float(_number(body, "temperature", 1.0, lambda t: 0 <= t <= 2, "a number in [0, 2]")),
        top_p=float(_number(body, "top_p", 1.0, lambda p: 0 < p <= 1, "a number in (0, 1]")),
        top_k=_get(body, "top_k", int, 0, lambda k: k >= 0, "an integer >= 0"),
        min_p=float(_number(body, "min_p", 0.0, lambda p: 0 <= p <= 1, "a number in [0, 1]")),
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0, lambda r: 0 < r <= 10,
                                         "a number in (0, 10]")),
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, lambda f: -2 <= f <= 2,
                                        "a number in [-2, 2]")),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, lambda f: -2 <= f <= 2,
                                       "a number in [-2, 2]")),
        seed=_get(body, "seed", int, None, lambda n: 0 <= n <= MAX_SEED, f"an integer in [0, {MAX_SEED}]"),
        logit_bias=_logit_bias(body))
    if "repeat_penalty" in body:  # llama-server's name
        sampling["repetition_penalty"] = float(_number(body, "repeat_penalty", 1.0, lambda r: 0 < r <= 10,
                                                       "a number in (0, 10]"))
    n = _get(body, "n", int, 1, lambda n: 1 <= n <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]")
    try:
        SamplingConfig(**sampling)
    except PymlError as e:
        raise RequestError(one_line(e)) from None
    options = _get(body, "pyml", dict, {}, what="an object")
    stream_options = _get(body, "stream_options", dict, {}, what="an object")
    for where, given, known in (("pyml", options, {"profile"}), ("stream_options", stream_options, {"include_usage"})):
        if unknown := set(given) - known:
            key = _sendable(str(sorted(unknown, key=str)[0]))[:64]
            raise unsupported(f"{where}.{key}", f"{where} takes only {', '.join(sorted(known))}")
    shared = dict(max_tokens=max_tokens, stop=stop,
                  stream=_get(body, "stream", bool, False, what="a boolean"),
                  profile=_get(options, "profile", bool, False, what="a boolean"),
                  cache_prompt=_get(body, "cache_prompt", bool, True, what="a boolean"),
                  include_usage=_get(stream_options, "include_usage", bool, False, what="a boolean"), n=n,
                  logprobs=logprobs, echo=echo)
    return [Request(prompt=prompt, prompt_ids=ids, sampling=dict(sampling), **shared) for prompt, ids in prompts]


def _check_model(body: dict, model_id: str) -> None:
    model = _get(body, "model", str, None, what="a string")
    if model not in (None, "", model_id):
        raise RequestError(f"the model {_name(model)} does not exist: this server serves '{model_id}'",
                           "model", status=404, code="model_not_found")


# --- llama-server's token endpoints: /tokenize, /detokenize, /apply-template ---
TOKEN_FIELDS = {"/tokenize": {"model", "content", "add_special", "parse_special", "with_pieces"},
                "/detokenize": {"model", "tokens"}, "/apply-template": {"model", "messages"}}


def parse_token_request(body, path: str, model_id: str) -> dict:
    """A checked body of one of llama-server's token endpoints: {"content", "add_special",
    "with_pieces"} for /tokenize, {"tokens"} for /detokenize (ids; their range is the server's to
    check), {"messages"} for /apply-template. Every other field is refused by name."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key in body:
        if key not in TOKEN_FIELDS[path]:
            raise unsupported(_sendable(str(key))[:64], f"{path} takes {', '.join(sorted(TOKEN_FIELDS[path]))}")
    _check_model(body, model_id)
    if path == "/apply-template":
        return {"messages": _messages(body)}
    if path == "/detokenize":
        tokens = body.get("tokens")
        if not (tokens == [] or _are_token_ids(tokens)):
            raise RequestError("'tokens' must be a list of token ids", "tokens")
        return {"tokens": tokens}
    content = body.get("content")
    if not isinstance(content, str):
        raise RequestError("'content' must be a string", "content")
    if not _get(body, "parse_special", bool, True, what="a boolean"):
        raise unsupported("parse_special", "pyml's tokenizer always reads a special token written in the text "
                                           "as that token")
    return {"content": _text(content, "content", "'content'"),
            "add_special": _get(body, "add_special", bool, False, what="a boolean"),
            "with_pieces": _get(body, "with_pieces", bool, False, what="a boolean")}


def _prompts(prompt) -> list[tuple[str, list | None]]:
    """The completions prompts: text or token ids (as lm-evaluation-harness sends them), one or a list:
    a string, [ids], or a list of strings and [ids] (OpenAI's batched form, each its own choices).
    Ids give ("", ids): the server decodes them."""
    if _are_token_ids(prompt):
        return [("", prompt)]
    if not (isinstance(prompt, list) and prompt):
        return [_one_prompt(prompt, "'prompt'")]
    return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]


def _are_token_ids(value) -> bool:
    """A non-empty list of integers (JSON's true and false are not)."""
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _one_prompt(prompt, where: str) -> tuple[str, list | None]:
    if _are_token_ids(prompt):
        return "", prompt
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(f"{where} must be a non-empty string or a non-empty list of token ids", "prompt")
    return _text(prompt, "prompt", where), None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many likeliest tokens go with each token's log-probability; None when none are asked.
    Chat: `logprobs` true, `top_logprobs` 0..20; completions: `logprobs` 0..5 (OpenAI's legacy API)."""
    limit = MAX_TOP_LOGPROBS[chat]
    if not chat:
        return _get(body, "logprobs", int, None, lambda n: 0 <= n <= limit, f"an integer in [0, {limit}]")
    top = _get(body, "top_logprobs", int, None, lambda n: 0 <= n <= limit, f"an integer in [0, {limit}]")
    if not _get(body, "logprobs", bool, False, what="a boolean"):
        if top:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def _logit_bias(body: dict) -> dict | None:
    """{token id: bias} from OpenAI's {"id as a string": number}; the values' range is SamplingConfig's
    to check, the ids' range the server's (it knows the vocabulary)."""
    given = _get(body, "logit_bias", dict, None, what="an object")
    if not given:
        return None
    if len(given) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' has {len(given)} entries; at most {MAX_LOGIT_BIAS} are allowed", "logit_bias")
    bias = {}
    for key, value in given.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
            raise RequestError(f"'logit_bias' key {_name(key)} is not a token id (a decimal integer)", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestError(f"'logit_bias' value for {key} must be a number in [-100, 100]", "logit_bias")
        bias[int(key)] = float(value)
    return bias


def _messages(body: dict) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        if extra := [k for k in m if k not in MESSAGE_FIELDS and m[k] is not None]:
            raise unsupported(f"messages[{i}].{_sendable(str(extra[0]))[:64]}",
                              "a message has a role, a text content, an assistant's tool calls or a tool result's id "
                              "(no names or audio)")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role {_name(role)} is not one of {', '.join(sorted(ROLES))}",
                               "messages")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", "messages",
                                   code="unsupported_parameter")
            content = "".join(p["text"] for p in content)
        tool_calls = m.get("tool_calls")
        if content is None and role == "assistant" and tool_calls:
            content = ""  # a turn that only called tools
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string", "messages")
        _text(content, "messages", f"messages[{i}].content")
        message = {"role": "system" if role == "developer" else role, "content": content}
        if tool_calls is not None:
            if role != "assistant":
                raise unsupported(f"messages[{i}].tool_calls", "only an assistant's message carries tool calls")
            if not _are_tool_calls(tool_calls):
                raise RequestError(f"messages[{i}].tool_calls must be an assistant's list of "
                                   "{\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}", "messages")
            message["tool_calls"] = tool_calls
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):  # OpenAI's rule too
            raise RequestError(f"messages[{i}] is a tool result: it needs the 'tool_call_id' of the call it answers",
                               "messages")
        if m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise RequestError(f"messages[{i}].tool_call_id must be a string", "messages")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _are_tool_calls(calls) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)
