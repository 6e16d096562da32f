"""pyml-serve's event loop only does I/O: a chat template that takes a second to render (or a
tokenizer that takes a second to encode) does not hold up /health or the other requests.

The server runs in this process (uvicorn on a thread, 127.0.0.1, the OS's port) around a tiny
model whose template and tokenizer are slowed on purpose: a loop that ran them itself would
answer /health only after them."""

import http.client
import json
import threading
import time

import pytest
import uvicorn

from pyml.cli.pyml_serve import listening_socket
from pyml.cli.serve_app import Limits, Server
from pyml.cli.standins import write_gpt2
from pyml.nlp.api import load_model

HOST = "127.0.0.1"
SLOW_S = 1.0


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    lm = load_model(safetensors=str(write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny", n_positions=256)),
                    threads=1)
    render, encode = lm.chat_prompt, lm.encode

    def slow_render(messages, tools=None):
        time.sleep(SLOW_S * len(messages))
        return render(messages, tools)

    def slow_encode(text):
        if "slow" in text:
            time.sleep(SLOW_S)
        return encode(text)

    lm.chat_prompt, lm.encode = slow_render, slow_encode
    server = Server(lm, "tiny", 256, limits=Limits(threads=1, timeout=SLOW_S * 3))
    sock = listening_socket(HOST, 0)
    runner = uvicorn.Server(uvicorn.Config(server.app(), log_level="warning"))
    thread = threading.Thread(target=runner.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    port = sock.getsockname()[1]
    deadline = time.monotonic() + 30
    while not runner.started:
        assert time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.02)
    yield port
    runner.should_exit = True
    thread.join(timeout=10)


def request(port, method, path, body=None):
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "slow to tokenize", "max_tokens": 2})])
def test_health_answers_while_a_request_is_rendered_and_tokenized(slow_server, path, body):
    answer = {}
    slow = threading.Thread(target=lambda: answer.setdefault("slow", request(slow_server, "POST", path, body)))
    t0 = time.monotonic()
    slow.start()
    time.sleep(0.2)  # the slow request is now being prepared
    worst = 0.0
    while slow.is_alive() and time.monotonic() - t0 < SLOW_S - 0.2:
        t1 = time.monotonic()
        assert request(slow_server, "GET", "/health")[0] == 200
        worst = max(worst, time.monotonic() - t1)
        time.sleep(0.02)
    slow.join(timeout=30)
    assert answer["slow"][0] == 200 and time.monotonic() - t0 >= SLOW_S  # it really was slow
    assert 0 < worst < 0.25, worst


def test_a_request_whose_preparation_runs_past_the_timeout_is_answered_504(slow_server):
    """The clock runs from arrival: a template that outlasts --timeout (3 s here) gets a 504 then,
    not when the template is done (4 s: one second a message)."""
    t0 = time.monotonic()
    status, data = request(slow_server, "POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}] * 4, "max_tokens": 2})
    took = time.monotonic() - t0
    assert status == 504 and json.loads(data)["error"]["code"] == "timeout"
    assert 3 * SLOW_S - 0.1 < took < 4 * SLOW_S - 0.2, took
