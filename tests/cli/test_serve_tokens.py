"""pyml-serve's token endpoints, as llama-server has them: POST /tokenize, /detokenize and
/apply-template, and GET /props, on the real SmolLM2 file, against transformers' tokenizer and chat
template read from the same GGUF (an independent conversion of its vocabulary, merges and
template) and gguf-py's reading of its metadata. The server is a real process on 127.0.0.1."""

import json

import pytest

from tests.cli.test_serve import serving
from tests.nlp.test_chat import CONVERSATIONS
from tests.nlp.test_tokenizer import read_metadata, transformers_tokenizer

TEXTS = ["Hello world", "  spaced\tand\nlines  ", "🤗 日本語 and ᚠᛇᚻ", "<|im_start|>user\nHi<|im_end|>"]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    with serving(smollm2_gguf) as served:
        yield served


@pytest.fixture(scope="module")
def oracle(smollm2_gguf):
    return transformers_tokenizer(smollm2_gguf)


def post(server, path, body):
    status, data = server.request("POST", path, body)
    return status, json.loads(data)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_and_detokenize_as_transformers(server, oracle, text):
    for add_special in (False, True):
        status, body = post(server, "/tokenize", {"content": text, "add_special": add_special})
        assert status == 200, body
        assert body["tokens"] == oracle.encode(text, add_special_tokens=add_special)
    status, body = post(server, "/detokenize", {"tokens": oracle.encode(text)})
    assert status == 200 and body["content"] == oracle.decode(oracle.encode(text)) == text


def test_pieces_are_text_or_the_bytes_of_part_of_a_character(server, oracle):
    """llama-server's with_pieces: each token's piece, a string, or a list of byte values when the
    token holds part of a character (the emoji and the runes here are split across tokens)."""
    text = TEXTS[2]
    status, body = post(server, "/tokenize", {"content": text, "with_pieces": True})
    assert status == 200, body
    assert [t["id"] for t in body["tokens"]] == oracle.encode(text)
    pieces = [t["piece"] for t in body["tokens"]]
    assert any(isinstance(p, list) for p in pieces) and any(isinstance(p, str) for p in pieces)
    assert b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in pieces) == text.encode()


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_apply_template_is_the_chat_prompt_as_transformers_renders_it(server, oracle, messages):
    status, body = post(server, "/apply-template", {"messages": messages})
    assert status == 200, body
    assert body["prompt"] == oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("path, body, status, says", [
    ("/tokenize", {"content": "x", "parse_special": False}, 400, "'parse_special' is not supported"),
    ("/tokenize", {"text": "x"}, 400, "/tokenize takes add_special, content, model, parse_special, with_pieces"),
    ("/tokenize", {"content": 5}, 400, "'content' must be a string"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, 400, "'add_special' must be a boolean"),
    ("/tokenize", {"content": "\ud800"}, 400, "'content' is not valid Unicode text"),
    ("/tokenize", {"content": "x", "model": "other"}, 404, "the model 'other' does not exist"),
    ("/tokenize", [], 400, "the request body must be a JSON object"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "token id 49152 is outside the vocabulary of 49152 tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "token id -1 is outside the vocabulary"),
    ("/detokenize", {"tokens": [True]}, 400, "'tokens' must be a list of token ids"),
    ("/detokenize", {"tokens": "1 2"}, 400, "'tokens' must be a list of token ids"),
    ("/apply-template", {"messages": []}, 400, "'messages' must be a non-empty list"),
    ("/apply-template", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, 400,
     "/apply-template takes messages, model"),
])
def test_a_bad_body_is_a_4xx_naming_what_is_wrong(server, path, body, status, says):
    got, answer = post(server, path, body)
    assert got == status and says in answer["error"]["message"], answer
    assert "/" not in answer["error"]["message"].replace(path, "")  # no file path of the server's


def test_props_gives_the_context_the_slots_the_defaults_and_the_chat_template(server, smollm2_gguf):
    status, data = server.request("GET", "/props")
    props = json.loads(data)
    assert status == 200 and props["total_slots"] == 4 and props["model_alias"] == "tiny"
    metadata = read_metadata(smollm2_gguf)
    assert props["chat_template"] == metadata["tokenizer.chat_template"]
    assert props["default_generation_settings"]["n_ctx"] == min(4096, metadata["llama.context_length"])
    params = props["default_generation_settings"]["params"]
    assert params["n_predict"] == 1024 and params["temperature"] == 1.0 and params["top_p"] == 1.0
    assert props["eos_token"] == "<|im_end|>"
