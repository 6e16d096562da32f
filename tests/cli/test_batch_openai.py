"""pyml-batch on files in OpenAI's batch format (`{"custom_id", "method", "url", "body"}` a line, as
OpenAI's Batch API and vLLM's run_batch read them): each reply is the format's output line, its body
a chat.completion / text_completion that the openai package's own models accept, its text the
library's greedy answer to the same prompt; what a line asks beyond one text reply is refused by
name in that line's output; resuming keys on custom_id."""

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from pyml.cli import pyml_batch
from tests.cli.test_batch import read_output, tiny, tiny_lm  # noqa: F401 (fixtures)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def request(custom_id, url, body, **extra):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def run(tiny, tmp_path, lines, *flags) -> tuple[int, list]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code = pyml_batch.main([str(src), "--out", str(out), "-m", str(tiny), "-n", "6", "-t", "1", *flags])
    return code, read_output(out)


@pytest.mark.parametrize("batch", ["1", "3"])
def test_openai_lines_get_the_replies_pyml_serve_gives(tiny, tiny_lm, tmp_path, batch):
    ids = tiny_lm.encode("The cat")
    code, lines = run(tiny, tmp_path, [
        request("chat-1", "/v1/chat/completions", {"model": "gpt-4o-mini", "messages": CHAT, "max_tokens": 5,
                                                   "temperature": 0}),
        json.dumps({"id": "pyml", "prompt": "Hello there"}),
        request("text-1", "/v1/completions", {"prompt": "Hello there", "temperature": 0}),  # -n 6: the flag's
        request("ids-1", "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0, "seed": 3}),
    ], "--batch", batch)
    assert code == 0
    chat, mine, text, by_ids = lines
    assert mine["id"] == "pyml" and mine["tokens"] == tiny_lm.generate("Hello there", 6).tokens  # its own format
    for line, custom_id, prompt, n, model in ((chat, "chat-1", tiny_lm.chat_prompt(CHAT), 5, ChatCompletion),
                                              (text, "text-1", "Hello there", 6, Completion),
                                              (by_ids, "ids-1", ids, 4, Completion)):
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["custom_id"] == custom_id and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200
        reply = model.model_validate(line["response"]["body"])
        expected = tiny_lm.generate(prompt, n, temperature=0)
        got = reply.choices[0].message.content if model is ChatCompletion else reply.choices[0].text
        assert got == expected.text and reply.choices[0].finish_reason == "length"
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(expected.prompt_tokens), n)
        assert reply.model == tiny.name  # the model that answered, whatever the line named


@pytest.mark.parametrize("body, url, param, says", [
    ({"messages": CHAT, "n": 2}, "/v1/chat/completions", "n", "'n' is not run by pyml-batch"),
    ({"messages": CHAT, "stream": True}, "/v1/chat/completions", "stream", "'stream' is not run by pyml-batch"),
    ({"messages": CHAT, "logprobs": True}, "/v1/chat/completions", "logprobs", "'logprobs' is not run"),
    ({"prompt": "x", "logprobs": 0}, "/v1/completions", "logprobs", "'logprobs' is not run"),
    ({"prompt": "x", "echo": True}, "/v1/completions", "echo", "'echo' is not run"),
    ({"messages": CHAT, "response_format": {"type": "json_object"}}, "/v1/chat/completions", "response_format",
     "'response_format' is not run"),
    ({"messages": CHAT, "tools": []}, "/v1/chat/completions", "tools", "'tools' is not run"),
    ({"prompt": "x", "suffix": "y"}, "/v1/completions", "suffix", "'suffix' is not supported by pyml: no such field"),
    ({"prompt": ["a", "b"]}, "/v1/completions", "prompt", "a batch file has one a line"),
    ({"prompt": "x", "temperature": 5}, "/v1/completions", "temperature", "'temperature' is out of range"),
    ({"messages": []}, "/v1/chat/completions", "messages", "'messages' must be a non-empty list"),
    ({"prompt": "x"}, "/v1/embeddings", None, '"url" must be one of /v1/chat/completions, /v1/completions'),
    ("x", "/v1/completions", None, '"body" must be a JSON object'),
])
def test_what_a_line_asks_beyond_one_text_reply_is_refused_in_its_own_output(tiny, tmp_path, body, url, param, says):
    code, (line, fine) = run(tiny, tmp_path, [request("bad", url, body),
                                              request("fine", "/v1/completions", {"prompt": "x"})])
    assert code == 1  # a line failed; every line is still written
    assert line["custom_id"] == "bad" and line["response"]["status_code"] == 400
    error = line["response"]["body"]["error"]
    assert says in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    assert fine["response"]["status_code"] == 200


@pytest.mark.parametrize("extra, says", [({"method": "GET"}, '"method" must be "POST"'),
                                         ({"priority": 1}, "unknown field priority")])
def test_a_request_line_that_is_not_openais_format_is_named(tiny, tmp_path, extra, says):
    code, (line,) = run(tiny, tmp_path, [request("x", "/v1/completions", {"prompt": "x"}, **extra)])
    assert code == 1 and says in line["response"]["body"]["error"]["message"]


@pytest.mark.parametrize("batch", ["1", "3"])
def test_a_max_tokens_past_the_context_is_refused_as_pyml_serve_refuses_it(tiny, tiny_lm, tmp_path, batch):
    """An OpenAI line whose own max_tokens cannot fit after its prompt gets pyml-serve's 400
    (context_length_exceeded), not a reply cut at the window; without max_tokens (the flag's -n), or in
    pyml's own format, generation runs to the window as pyml-infer's does."""
    ctx = tiny_lm.model.max_positions
    n_prompt = len(tiny_lm.encode("Hello there"))
    code, (refused, fits, own) = run(tiny, tmp_path, [
        request("long", "/v1/completions", {"prompt": "Hello there", "max_tokens": ctx}),
        request("fits", "/v1/completions", {"prompt": "Hello there", "max_tokens": ctx - n_prompt, "temperature": 0}),
        json.dumps({"id": "own", "prompt": "Hello there", "max_tokens": ctx}),
    ], "--batch", batch)
    assert code == 1
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"] == {
        "message": f"max_tokens {ctx} + the prompt's {n_prompt} tokens exceed the context size of {ctx}",
        "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded"}
    reply = Completion.model_validate(fits["response"]["body"])
    assert reply.usage.completion_tokens == ctx - n_prompt
    assert own["stop_reason"] == "context" and len(own["tokens"]) == ctx - n_prompt + 1  # the last from the full cache


def test_a_custom_id_that_is_not_a_string_is_a_pyml_error_line(tiny, tmp_path):
    code, (line,) = run(tiny, tmp_path, [json.dumps({"custom_id": 7, "method": "POST", "url": "/v1/completions",
                                                     "body": {"prompt": "x"}})])
    assert code == 1 and line == {"line": 1, "error": '"custom_id" must be a non-empty string (OpenAI\'s batch format)'}


def test_resume_keys_on_custom_id_and_reruns_the_failed(tiny, tmp_path, capsys):
    lines = [request("a", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
             request("b", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})]
    code, first = run(tiny, tmp_path, lines)
    assert code == 0 and [o["custom_id"] for o in first] == ["a", "b"]
    out = tmp_path / "out.jsonl"
    failed = {**first[1], "response": {"status_code": 500, "request_id": "req_x", "body": {"error": {"message": "x"}}}}
    out.write_text(json.dumps(first[0]) + "\n" + json.dumps(failed) + "\n")
    capsys.readouterr()
    code, again = run(tiny, tmp_path, lines)
    assert code == 0 and [o["custom_id"] for o in again] == ["a", "b"] and again[0] == first[0]
    assert again[1]["response"]["status_code"] == 200
    assert "1 prompts done, 0 errors, 1 already done" in capsys.readouterr().err
