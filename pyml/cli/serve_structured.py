"""pyml-serve's structured output and tool calls: the request fields that shape a reply
(`response_format`, llama-server's `grammar` and `json_schema`, `tools`, `tool_choice`), checked
and turned into a grammar for constrained.py; and the tool calls of a finished reply, as OpenAI
sends them. docs/structured-output.md describes what each field does here."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pyml.cli.serve_requests import RequestError, unsupported
from pyml.core.errors import PymlError
from pyml.nlp.constrained import JSON_OBJECT_SCHEMA, schema_grammar, text_grammar
from pyml.nlp.tool_calls import ToolCall, parse_tool_calls

MAX_TOOLS = 128  # OpenAI's limit
TOOL_CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class Structured:
    """What shape a request's reply must take."""
    grammar: str | None = None      # llguidance's grammar the output must match (None: free text)
    param: str | None = None        # the request field the grammar came from (named in its errors)
    tools: list | None = None       # the offered functions' specs, as the client sent them
    tool_choice: str = "none"       # none | auto | required | function (one named tool)
    tool_name: str | None = None    # tool_choice "function": its name
    parallel_tool_calls: bool = True

    @property
    def tool_names(self) -> list:
        return [t["function"]["name"] for t in self.tools or ()]

    @property
    def calls_tools(self) -> bool:
        return self.tool_choice != "none"


def parse_structured(body: dict, chat: bool) -> Structured:
    """The Structured a request body asks for; a field pyml cannot honour is a RequestError."""
    out = Structured()
    shapes = [k for k in ("response_format", "grammar", "json_schema") if body.get(k) is not None]
    shapes = [k for k in shapes if not (k == "response_format" and body[k] == {"type": "text"})]
    if len(shapes) > 1:
        raise RequestError(f"'{shapes[0]}' and '{shapes[1]}' both shape the reply: give one", shapes[1])
    if shapes:
        out.param = shapes[0]
        out.grammar = _grammar(shapes[0], body[shapes[0]])
    if chat:
        _tools(body, out)
    elif body.get("tools") is not None or body.get("tool_choice") is not None:
        raise unsupported("tools" if body.get("tools") is not None else "tool_choice",
                          "it belongs to /v1/chat/completions")
    return out


def _grammar(field: str, value) -> str:
    try:
        if field == "grammar":
            if not isinstance(value, str):
                raise RequestError("'grammar' must be a string (GBNF, as llama-server's, or Lark)", field)
            return text_grammar(value, "'grammar'")
        if field == "json_schema":
            return schema_grammar(value, "'json_schema'")
        if not isinstance(value, dict):
            raise RequestError("'response_format' must be an object", field)
        kind = value.get("type")
        if kind == "json_object":
            return schema_grammar(JSON_OBJECT_SCHEMA)
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict):
                raise RequestError("'response_format.json_schema' must be an object with a 'schema'", field)
            if not isinstance(spec.get("strict", False), (bool, type(None))):
                raise RequestError("'response_format.json_schema.strict' must be a boolean", field)
            # strict or not, the schema is enforced token by token: a reply always validates
            schema = spec.get("schema")
            return schema_grammar(JSON_OBJECT_SCHEMA if schema is None else schema,
                                  "'response_format.json_schema.schema'")
        raise RequestError(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}"[:200],
                           field)
    except PymlError as e:
        raise RequestError(str(e), field) from None


def _tools(body: dict, out: Structured) -> None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    out.parallel_tool_calls = parallel is not False
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise RequestError("'tool_choice' needs 'tools' to choose from", "tool_choice")
        return
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} functions", "tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or name in names:
            raise RequestError(f"tools[{i}].function.name must be a unique non-empty string of at most 64 "
                               "characters", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.add(name)
    out.tools = tools
    if choice is None or choice in TOOL_CHOICES:
        out.tool_choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        out.tool_choice, out.tool_name = "function", choice["function"].get("name")
        if out.tool_name not in names:
            raise RequestError(f"'tool_choice' names the function {str(out.tool_name)[:64]!r}, which is not "
                               "among 'tools'", "tool_choice")
    else:
        raise RequestError("'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", "tool_choice")
    if out.tool_choice in ("required", "function"):
        if out.grammar is not None:
            raise RequestError(f"'tool_choice' {out.tool_choice} shapes the reply as a tool call: it cannot "
                               f"take '{out.param}' too", out.param)
        out.param = "tools"
        try:
            out.grammar = schema_grammar(_call_schema(out), "the tool's parameters")
        except PymlError as e:
            raise RequestError(str(e), "tools") from None


def _parameters(out: Structured, name: str) -> dict:
    fn = next(t["function"] for t in out.tools if t["function"]["name"] == name)
    return fn.get("parameters") or EMPTY_PARAMETERS


def _call_schema(out: Structured) -> dict:
    """A named tool: its arguments alone (so they stream as they come); required: one call of any
    offered tool, as {"name", "arguments"}."""
    if out.tool_choice == "function":
        return _parameters(out, out.tool_name)
    return {"anyOf": [{"type": "object", "properties": {"name": {"enum": [n]}, "arguments": _parameters(out, n)},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for n in out.tool_names]}


def tool_prompt(messages: list, tools: list) -> list:
    """The conversation for a chat template that does not render tools: the offer as a system
    message (what to call and how), earlier calls and results as text the template can show."""
    offer = ("You can call these functions. To call one, reply with only a JSON object "
             "{\"name\": <function name>, \"arguments\": <its arguments>}.\n"
             + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools))
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
                     for c in m["tool_calls"]]
            m = {"role": "assistant", "content": "\n".join(json.dumps(c, ensure_ascii=False) for c in calls)}
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"The function returned: {m['content']}"}
        out.append(m)
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + offer}] + out[1:]
    return [{"role": "system", "content": offer}] + out


def template_messages(messages: list) -> list:
    """The conversation as chat templates read it: a call's arguments as an object (OpenAI's API
    carries them as JSON text; the templates of Qwen, Llama 3 and Mistral write them with tojson)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _arguments(value):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value if value is not None else {}


def reply_calls(structured: Structured, text: str, complete: bool) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a finished reply. A named tool's reply is its arguments; a cut-off
    one (max_tokens) is no call, but text."""
    if structured.tool_choice == "function":
        return ("", [ToolCall(structured.tool_name, text)]) if complete else (text, [])
    content, calls = parse_tool_calls(text, structured.tool_names)
    if calls and not structured.parallel_tool_calls:
        calls = calls[:1]
    return content, calls


CALL_OPENERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{")  # how a reply that is a call begins
CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]")  # where a call may begin after some text


class HeldCalls:
    """tool_choice auto, streamed: the text that cannot be part of a tool call goes out as it
    comes; from where a call may begin (a reply opening like one, or a family's call marker
    after some text) it is held until the reply ends and can be read whole. `hold_all`
    (tool_choice required: the reply is a call) holds everything."""

    def __init__(self, hold_all: bool = False):
        self.held, self.holding, self.told = "", hold_all, False

    def push(self, text: str) -> str:
        """What of `text` can be sent now as content."""
        if self.holding:
            self.held += text
            return ""
        text, self.held = self.held + text, ""
        if not self.told:  # the reply's start decides whether it may be a call
            start = text.lstrip()
            if not start or any(o.startswith(start) for o in CALL_OPENERS):
                self.held = text  # too short to tell
                return ""
            if start.startswith(CALL_OPENERS):
                self.held, self.holding = text, True
                return ""
            self.told = True
        found = [i for i in (text.find(m) for m in CALL_MARKERS) if i >= 0]
        if found:
            self.held, self.holding = text[min(found):], True
            return text[:min(found)]
        keep = max((k for m in CALL_MARKERS for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def end(self) -> str:
        """The text held at the reply's end: maybe calls, maybe the content's last piece."""
        held, self.held = self.held, ""
        return held


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_objects(calls: list[ToolCall], streamed: bool) -> list:
    """OpenAI's `message.tool_calls`; a streamed delta's carry their index too."""
    return [{**({"index": i} if streamed else {}), "id": call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]
