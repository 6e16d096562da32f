"""The per-family tool-call formats (pyml/nlp/tool_calls.py), on replies written as each family's
chat template and model card show them."""

import json

import pytest

from pyml.nlp.tool_calls import ToolCall, parse_tool_calls

NAMES = {"get_weather", "get_time"}
PARIS = json.dumps({"city": "Paris"})


@pytest.mark.parametrize("text, content, calls", [
    # Hermes / Qwen 2.5 / Qwen 3
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [ToolCall("get_weather", PARIS)]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.",
     [ToolCall("get_weather", PARIS), ToolCall("get_time", "{}")]),
    # Mistral v3 and v11
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [ToolCall("get_weather", PARIS)]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [ToolCall("get_weather", PARIS)]),
    # Llama 3.x (parameters), with python_tag, two calls
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [ToolCall("get_weather", PARIS)]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     "", [ToolCall("get_weather", PARIS), ToolCall("get_time", "{}")]),
    # arguments given as JSON text
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', "", [ToolCall("get_weather", PARIS)]),
])
def test_each_familys_format_is_read(text, content, calls):
    assert parse_tool_calls(text, NAMES) == (content, calls)


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    '{"name": "launch_rockets", "arguments": {}}',           # not an offered tool
    '{"city": "Paris"}',                                     # JSON, but no call
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": ',  # cut off
    '[TOOL_CALLS]get_weather[ARGS]{"city": ',
    '{"name": "get_weather", "arguments": [1]}',             # arguments not an object
])
def test_text_that_is_not_a_call_stays_text(text):
    assert parse_tool_calls(text, NAMES) == (text, [])

