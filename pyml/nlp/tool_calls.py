"""Tool calls in a model's generated text, in the formats the model families are trained to write.

- Hermes / Qwen 2.5 / Qwen 3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call.
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or (v11 templates)
  `[TOOL_CALLS]name[ARGS]{...}`.
- Llama 3.x: the whole reply is `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), calls separated by `;`. pyml's constrained fallback writes the same object
  with "arguments", which is read alike.

Only calls of the tools the request offered count: anything else stays text (a model that prints
JSON about something else has not called a tool).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI's API carries it


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_V11 = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")
_decoder = json.JSONDecoder()


def parse_tool_calls(text: str, names) -> tuple[str, list[ToolCall]]:
    """(the text outside the calls, the calls) of a reply; no calls: (text, [])."""
    names = set(names)
    if "<tool_call>" in text:
        calls = [_call(_json(body), names) for body in _HERMES.findall(text)]
        if calls and all(calls):
            return text[:text.index("<tool_call>")].strip(), calls
    if _MISTRAL_TAG in text:
        head, _, rest = text.partition(_MISTRAL_TAG)
        calls = _mistral(rest.strip(), names)
        if calls:
            return head.strip(), calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if body.startswith("{"):
        calls = [_call(part, names) for part in _split_objects(body)]
        if calls and all(calls):
            return "", calls
    return text, []


def _mistral(rest: str, names) -> list:
    if rest.startswith("["):
        items = _json(rest)
        calls = [_call(item, names) for item in items] if isinstance(items, list) else []
        return calls if calls and all(calls) else []
    calls = []
    while m := _MISTRAL_V11.match(rest):
        try:
            args, end = _decoder.raw_decode(rest, m.end())
        except ValueError:
            return []
        call = _call({"name": m.group(1), "arguments": args}, names)
        if call is None:
            return []
        calls.append(call)
        rest = rest[end:].lstrip().removeprefix(_MISTRAL_TAG).lstrip()
    return calls if not rest else []


def _split_objects(body: str) -> list:
    """`{...}; {...}` (Llama 3's separator) or one object: each object's value, None if not JSON."""
    objects, pos = [], 0
    while pos < len(body):
        try:
            value, pos = _decoder.raw_decode(body, pos)
        except ValueError:
            return [None]
        objects.append(value)
        pos = len(body) - len(body[pos:].lstrip().lstrip(";").lstrip())
    return objects


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(obj, names) -> ToolCall | None:
    """A ToolCall from {"name", "arguments"|"parameters"} naming an offered tool, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        args = _json(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
