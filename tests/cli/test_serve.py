"""pyml-serve as clients use it: the real openai client, raw HTTP, 16 concurrent streams,
malformed requests, a disconnect mid-stream, and memory over many requests.

The server is a real process on 127.0.0.1, started and stopped by the fixture; the model is a
tiny random-weight GPT-2 so every request takes milliseconds. Every loop is bounded."""

import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from pyml.cli.standins import write_gpt2

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


class Served:
    def __init__(self, proc, port, model_id):
        self.proc, self.port, self.model_id = proc, port, model_id
        self.base = f"http://{HOST}:{port}"

    def request(self, method, path, body=None, raw: bytes | None = None, timeout=30, headers=None):
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            self.last_headers = dict(resp.getheaders())
            return resp.status, resp.read()
        finally:
            conn.close()

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


SERVE = [sys.executable, str(ROOT / "bin" / "pyml-serve")]


def serve_env() -> dict:
    """This checkout on the server's path, and LOG unset (its [perf] lines are not the tests' subject)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    env.pop("LOG", None)
    return env


def _said(proc) -> list[str]:
    """The server's stderr lines as they come, read by a thread (a full pipe would stall the server)."""
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return lines


def start_server(model: Path, *flags: str):
    """pyml-serve on a port the OS picks (--port 0), learnt from the line the server says: a port
    picked here and handed over could be taken by another test's server in between. `flags` come
    after the defaults (-t 1), so they can replace them."""
    proc = subprocess.Popen([*SERVE, "-m", str(model), "--port", "0", "-t", "1", "--alias", "tiny", *flags],
                            env=serve_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said = _said(proc)
    # a bound, not a timing: on a cold kernel cache the server compiles its model's kernels first
    deadline = time.monotonic() + 600
    port = None
    while time.monotonic() < deadline and port is None:
        assert proc.poll() is None, "".join(said) or "pyml-serve exited without a word"
        port = next((int(m.group(1)) for line in said if (m := re.search(rf"on http://{HOST}:(\d+) ", line))), None)
        time.sleep(0.1)
    served = Served(proc, port, "tiny")
    served.said = said
    while port is not None and time.monotonic() < deadline:
        assert proc.poll() is None, "".join(said)
        try:
            if served.request("GET", "/health", timeout=2)[0] == 200:
                return served
        except OSError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail(f"pyml-serve did not answer /health within 600 s: {''.join(said)}")


def stop_server(served: Served):
    served.proc.terminate()
    try:
        served.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.proc.wait(timeout=5)


@contextlib.contextmanager
def serving(model: Path, *flags: str):
    """start_server(model, *flags) for the length of a with block."""
    served = start_server(model, *flags)
    try:
        yield served
    finally:
        stop_server(served)


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    """The socket is bound first: the error names the port, not the (missing) model."""
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([*SERVE, "-m", str(tmp_path / "missing.gguf"), "--port", str(port)], env=serve_env(),
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"pyml-serve: error: cannot listen on {HOST}:{port}: Address already in use"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = start_server(write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny", n_positions=256))
    yield served
    stop_server(served)


@pytest.fixture
def wide_server(tmp_path):
    """A model wide enough that a decode step takes milliseconds: a 1,000-token reply outlasts a disconnect."""
    served = start_server(write_gpt2(tmp_path, "gpt2-tiny", n_positions=1024, n_embd=256, n_layer=4))
    yield served
    stop_server(served)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=60, max_retries=0)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]


# --- the openai client ------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completion(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    timings = r.model_extra["timings"]
    # llama-server's meanings: every token generated, its rate over the decode steps after the first
    assert timings["predicted_n"] == r.usage.completion_tokens
    assert timings["predicted_per_second"] == pytest.approx(1e3 * (timings["predicted_n"] - 1) / timings["predicted_ms"])
    assert timings["prompt_n"] + timings["cache_n"] == r.usage.prompt_tokens


def test_chat_stream_equals_the_whole_reply(client):
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].model_extra["timings"]["predicted_n"] == whole.model_extra["timings"]["predicted_n"]


def test_completions_whole_and_streamed(client):
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, stream=True))
    assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 10


def test_stop_strings_and_seeded_sampling(client):
    full = client.completions.create(model="tiny", prompt="The cat", max_tokens=20, temperature=0).choices[0].text
    stop = full[6:9]
    cut = client.completions.create(model="tiny", prompt="The cat", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model="tiny", prompt="The cat", max_tokens=10, temperature=1.0, seed=7,
                                      extra_body={"min_p": 0.05, "top_k": 40}).choices[0].text for _ in range(2))
    assert a == b


def test_a_conversation_reuses_its_cached_prefix(client):
    check_conversation_reuses_its_cached_prefix(client)


def check_conversation_reuses_its_cached_prefix(client):
    first = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    follow = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "again"}]
    again = client.chat.completions.create(model="tiny", messages=follow, max_tokens=6, temperature=0)
    assert again.model_extra["timings"]["cache_n"] >= first.usage.prompt_tokens - 1
    assert again.usage.prompt_tokens_details.cached_tokens == again.model_extra["timings"]["cache_n"]
    cold = client.chat.completions.create(model="tiny", messages=follow, max_tokens=6, temperature=0,
                                          extra_body={"cache_prompt": False})
    assert cold.model_extra["timings"]["cache_n"] == 0
    assert cold.choices[0].message.content == again.choices[0].message.content


def test_a_request_can_ask_for_its_profile(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                       extra_body={"pyml": {"profile": True}})
    prof = r.model_extra["pyml"]["profile"]
    assert prof["decode_steps"] == r.model_extra["timings"]["predicted_n"] - 1 == 5
    assert set(prof["split"]) == {"attention", "ffn", "head", "sampling", "other"}
    assert abs(sum(v["pct"] for v in prof["split"].values()) - 100) < 1
    assert prof["split"]["attention"]["ms"] > 0 and prof["split"]["ffn"]["ms"] > 0
    assert prof["top_ops"] and prof["top_ops"][0]["ms"] >= prof["top_ops"][-1]["ms"]
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    assert "pyml" not in (plain.model_extra or {})


# --- concurrency ------------------------------------------------------------------------------
def check_concurrent_streams_equal_one_at_a_time(client, n: int = 16):
    prompts = [f"Story {'#' * i} {i}:" for i in range(n)]

    def run(prompt):
        # greedy; the penalty over the prompt's tokens makes each prompt lead somewhere else
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           frequency_penalty=2.0)
        return "".join(c.choices[0].text for c in stream)

    one_at_a_time = [run(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        together = list(pool.map(run, prompts, timeout=90))
    assert together == one_at_a_time
    assert len(set(one_at_a_time)) > 1  # the prompts really lead to different texts


def test_sixteen_concurrent_streams_equal_the_same_requests_one_at_a_time(client):
    check_concurrent_streams_equal_one_at_a_time(client)


def generated_tokens(server) -> float:
    for line in server.request("GET", "/metrics")[1].decode().splitlines():
        if line.startswith("pyml_generated_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no pyml_generated_tokens_total")


def test_a_client_that_leaves_mid_stream_frees_the_model(wide_server):
    check_a_client_that_leaves_frees_the_model(wide_server)


def health(server) -> dict:
    status, data = server.request("GET", "/health", timeout=5)
    assert status == 200
    return json.loads(data)


def wait_idle(server, within: float) -> float:
    """Seconds until /health says busy 0 and queue 0; fails after `within`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        h = health(server)
        if h["busy"] == 0 and h["queue"] == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    pytest.fail(f"not idle within {within} s: {health(server)}")


def check_a_client_that_leaves_frees_the_model(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=60, max_retries=0)
    before = generated_tokens(server)
    stream_then_leave(server, {"model": "tiny", "prompt": "Long story", "max_tokens": 1000, "temperature": 0})
    r = client.completions.create(model="tiny", prompt="Next", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    wait_idle(server, within=30)  # beside --parallel slots the abandoned one may still be ending
    abandoned = generated_tokens(server) - before - 3
    assert 1 <= abandoned < 900, abandoned  # it stopped soon after the client left, not at 1000


def test_health_counts_the_sequences_of_the_running_batch(wide_server):
    """/health's `running` and pyml_running_sequences: a streamed n = 2 request runs two sequences
    side by side (a reply of 1,000 tokens: seconds here); once its client has left, none."""
    conn = http.client.HTTPConnection(HOST, wide_server.port, timeout=30)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"model": "tiny", "prompt": "Long story", "max_tokens": 1000, "n": 2, "temperature": 0, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()
    assert resp.fp.readline().startswith(b"data: ")  # both choices were admitted together: both run now
    h = health(wide_server)
    metrics = wide_server.request("GET", "/metrics")[1].decode()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert (h["busy"], h["running"]) == (1, 2), h
    assert re.search(r"^pyml_running_sequences 2\.0$", metrics, re.M), "two sequences should be counted"
    wait_idle(wide_server, within=30)
    assert health(wide_server)["running"] == 0


def stream_then_leave(server, body: dict) -> None:
    """Ask for a streamed completion and leave (close the socket) once its first chunk came."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the size of the first chunk
    assert resp.fp.readline().startswith(b"data: ")  # it has started
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


# --- bad requests -----------------------------------------------------------------------------
def malformed():
    good = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [("raw", b"{not json"), ("raw", b""), ("raw", b"\xff\xfe"), ("raw", b"[1, 2]"), ("raw", b"null")]
    bad_fields = {"max_tokens": [-1, 0, 10**9, "2", 2.5, True], "messages": [[], "hi", [{}], [{"role": "x", "content": "a"}],
                  [{"role": "user"}], [{"role": "user", "content": 5}], [{"role": "tool", "content": "a"}], None],
                  "temperature": [-1, 3, "hot"], "top_p": [0, 1.5], "top_k": [-3, 1.5], "min_p": [2, -0.1],
                  "stop": [5, [1], ["a"] * 5], "model": ["no-such-model", 12], "seed": ["x", 1.5], "n": [5],
                  "frequency_penalty": [5], "presence_penalty": [-3], "stream": ["yes"], "pyml": ["x"],
                  "repetition_penalty": [0, -1]}
    for name, values in bad_fields.items():
        for v in values:
            cases.append(("chat", {**good, name: v}))
    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for v in (None, 5, "", ["a", 5], ["a", ""], {"x": 1}):
        cases.append(("completion", {**completion, "prompt": v}))
    cases.append(("completion", {**completion, "prompt": "word " * 400}))  # longer than the context
    while len(cases) < 100:  # the same kinds again, with other values
        i = len(cases)
        cases.append(("chat", {**good, "max_tokens": -i}))
        cases.append(("completion", {**completion, "temperature": 10 + i}))
    return cases[:100]


def test_a_hundred_malformed_requests_get_a_4xx_and_the_server_keeps_answering(server, client):
    cases = malformed()
    assert len(cases) == 100
    for kind, body in cases:
        path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        status, data = (server.request("POST", path, raw=body) if kind == "raw" else
                        server.request("POST", path, body))
        assert 400 <= status < 500, (body, status, data)
        err = json.loads(data)["error"]
        assert err["message"] and err["type"], (body, data)
    status, data = server.request("POST", "/v1/completions", {"prompt": "word " * 400, "max_tokens": 2})
    assert status == 400 and "context size of 256" in json.loads(data)["error"]["message"]
    assert server.request("GET", "/no/such/path")[0] == 404
    assert server.request("GET", "/v1/chat/completions")[0] == 405
    assert client.completions.create(model="tiny", prompt="still here", max_tokens=2).usage.completion_tokens == 2


def test_the_openai_client_sees_bad_requests_as_its_own_errors(client):
    with pytest.raises(openai.BadRequestError, match="context size of 256"):
        client.completions.create(model="tiny", prompt="word " * 400, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)


# --- health, metrics, memory ------------------------------------------------------------------
def test_health_and_metrics(server, client):
    status, data = server.request("GET", "/health")
    assert status == 200 and json.loads(data)["status"] == "ok"
    client.completions.create(model="tiny", prompt="count me", max_tokens=4)
    deadline = time.monotonic() + 5  # the answer is sent as the batch ends its last step: idle soon after
    while json.loads(server.request("GET", "/health")[1])["busy"]:
        assert time.monotonic() < deadline, "busy long after the only request was answered"
        time.sleep(0.01)
    text = server.request("GET", "/metrics")[1].decode()
    assert re.search(r"^pyml_busy 0\.0$", text, re.M), "pyml_busy should be 0 once idle"
    assert re.search(r"^pyml_running_sequences 0\.0$", text, re.M), "no sequence runs once idle"
    assert json.loads(server.request("GET", "/health")[1])["running"] == 0
    for name in ("pyml_requests_total", "pyml_generated_tokens_total", "pyml_queue_length",
                 "pyml_request_seconds_bucket", "pyml_time_to_first_token_seconds_bucket",
                 "pyml_decode_tokens_per_second"):
        assert name in text, name


def test_memory_stays_flat_over_500_requests(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    deadline = time.monotonic() + 90
    for i in range(500):
        if i == 50:
            after_50 = server.rss_kb()
        assert server.request("POST", "/v1/chat/completions", {**body, "seed": i})[0] == 200
        assert time.monotonic() < deadline, f"500 requests took over 90 s (at {i})"
    after_500 = server.rss_kb()
    assert after_500 <= after_50 * 1.05, (after_50, after_500)
