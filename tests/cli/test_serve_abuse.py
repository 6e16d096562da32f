"""pyml-serve probed as an attacker or a careless client would (issue 35): what it does not
implement is refused by name, bad input is a 4xx (a hypothesis fuzz campaign finds no 5xx),
and the edges hold: API key, Host allowlist, JSON-only bodies, body size and read timeouts,
the worker's thread count.

Servers are real processes on 127.0.0.1 (tests/cli/test_serve.py's fixtures); every loop is bounded."""

import http.client
import json
import re
import socket
import time
from pathlib import Path

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyml
from pyml.cli.serve_requests import AS_DEFAULT, HONOURED, IGNORED, TOKEN_FIELDS
from pyml.cli import options, pyml_serve
from pyml.cli.standins import write_gpt2
from pyml.core.errors import PymlError
from tests.cli.test_infer import in_process
from tests.cli.test_serve import HOST, serving

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny", n_positions=256)


@pytest.fixture(scope="module")
def server(tiny):
    with serving(tiny) as served:
        yield served


def error_of(status_and_data):
    status, data = status_and_data
    return status, json.loads(data)["error"]


# --- refused by name --------------------------------------------------------------------------
REFUSED = [  # (endpoint body, field, value): what OpenAI's API would honour and pyml does not
    (COMPLETION, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (CHAT, "echo", True), (CHAT, "n", 5), (CHAT, "functions", [{"name": "f"}]),  # n: beyond --parallel 4
    (CHAT, "function_call", "auto"), (CHAT, "modalities", ["audio"]),
    (CHAT, "prediction", {"type": "content", "content": "x"}), (CHAT, "reasoning_effort", "low"),
    (CHAT, "made_up_field", 1), (CHAT, "prompt", "a completions field"),
    (COMPLETION, "best_of", 3), (COMPLETION, "suffix", "x"), (COMPLETION, "top_logprobs", 2),
    (COMPLETION, "messages", []),
]


@pytest.mark.parametrize("body, name, value", REFUSED, ids=[f"{n}={v!r}"[:40] for _, n, v in REFUSED])
def test_what_pyml_does_not_honour_is_refused_by_name(server, body, name, value):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, err = error_of(server.request("POST", path, {**body, name: value}))
    assert status == 400
    assert (err["param"], err["code"], err["type"]) == (name, "unsupported_parameter", "invalid_request_error")
    assert name in err["message"]


def test_message_fields_and_options_pyml_does_not_honour_are_refused_by_name(server):
    for message, param in (({"role": "user", "content": "hi", "name": "bob"}, "messages[0].name"),
                           ({"role": "user", "content": "hi", "tool_calls": []}, "messages[0].tool_calls")):
        status, err = error_of(server.request("POST", "/v1/chat/completions", {**CHAT, "messages": [message]}))
        assert (status, err["param"], err["code"]) == (400, param, "unsupported_parameter")
    for body, param in (({**CHAT, "pyml": {"profil": True}}, "pyml.profil"),
                        ({**CHAT, "stream": True, "stream_options": {"include_obfuscation": True}},
                         "stream_options.include_obfuscation")):
        status, err = error_of(server.request("POST", "/v1/chat/completions", body))
        assert (status, err["param"], err["code"]) == (400, param, "unsupported_parameter")


def test_the_openai_client_sees_a_refused_field_as_a_bad_request(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=30, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:  # the legacy functions: tools replace them
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=2,
                                       extra_body={"functions": [{"name": "f", "parameters": {}}]})
    assert e.value.body["param"] == "functions" and e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError, match="tools"):  # tools belong to chat
        client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                  extra_body={"tools": [{"type": "function", "function": {"name": "f"}}]})


def test_ignored_fields_are_accepted_and_each_is_documented(server):
    harmless = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                "safety_identifier": "s", "prompt_cache_key": "k"}
    assert set(harmless) == IGNORED
    defaults = {name: values[0] for name, values in AS_DEFAULT.items()}  # asking for what pyml does anyway
    status, data = server.request("POST", "/v1/chat/completions", {**CHAT, **harmless, **defaults})
    assert status == 200, data
    docs = (ROOT / "docs" / "serving.md").read_text()
    ignored_section = docs[docs.index("#### Accepted and ignored"):]
    for name in IGNORED:
        assert f"`{name}`" in ignored_section, f"docs/serving.md does not say why '{name}' is ignored"
    for name in AS_DEFAULT:
        assert f"`{name}: " in ignored_section, f"docs/serving.md does not say which '{name}' is accepted"


# --- bad input is a 4xx -----------------------------------------------------------------------
def test_input_errors_are_4xx_and_say_what_is_wrong(server):
    cases = [
        (b'{"model": "tiny", "prompt": "hi \\ud800", "max_tokens": 2}', "lone surrogate"),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', "lone surrogate"),
        (b'{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}', "lone surrogate"),
        (b'{"prompt": "hi", "\\ud800": 1}', "not supported"),
        (b'{"model": "\\ud800", "prompt": "hi"}', "does not exist"),
        (json.dumps({**COMPLETION, "seed": -1}).encode(), "seed"),
        (json.dumps({**COMPLETION, "seed": 2**70}).encode(), "seed"),
        (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deep"),
        (b'{"prompt": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001, "nests too deep"),
        (json.dumps({**COMPLETION, "stop": "x" * 401}).encode(), "at most 400"),
    ]
    for raw, said in cases:
        path = "/v1/chat/completions" if b"messages" in raw[:20] else "/v1/completions"
        status, err = error_of(server.request("POST", path, raw=raw))
        assert 400 <= status < 500 and said in err["message"], (raw[:60], status, err)
    assert server.request("POST", "/v1/completions", COMPLETION)[0] == 200


def json_values(max_leaves=12):
    scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
               | st.text(max_size=20))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=max_leaves)


FIELDS = sorted(HONOURED[True] | HONOURED[False] | IGNORED | set(AS_DEFAULT))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                           "content": st.text(max_size=30) | json_values(4)}), max_size=3)
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values(6), max_size=8) | \
    st.fixed_dictionaries({"messages": messages, "max_tokens": st.integers(-2, 4)},
                          optional={"stop": json_values(3), "seed": st.integers(-5, 2**66),
                                    "temperature": st.floats(), "stream": st.booleans(),
                                    "logprobs": json_values(2), "top_k": json_values(1)}) | \
    st.fixed_dictionaries({"prompt": st.text(max_size=40) | json_values(3), "max_tokens": st.integers(-2, 4)},
                          optional={"stop": json_values(3), "n": json_values(1), "min_p": json_values(1)})


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=bodies, chat=st.booleans())
def test_fuzz_no_request_body_gives_a_5xx(server, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = json.dumps(body, allow_nan=True).encode()  # ASCII: a lone surrogate travels as its \u escape
    status, data = server.request("POST", path, raw=raw, timeout=30)
    assert status < 500, (body, status, data[:300])


token_bodies = st.dictionaries(st.sampled_from(sorted(set().union(*TOKEN_FIELDS.values()))) | st.text(max_size=6),
                               json_values(4), max_size=5) | \
    st.fixed_dictionaries({"content": st.text(max_size=40)},
                          optional={"add_special": json_values(1), "with_pieces": json_values(1)}) | \
    st.fixed_dictionaries({"tokens": st.lists(st.integers(-2**70, 2**70) | st.integers(0, 300), max_size=8)}) | \
    st.fixed_dictionaries({"messages": messages})


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=token_bodies, path=st.sampled_from(sorted(TOKEN_FIELDS)))
def test_fuzz_no_token_endpoint_body_gives_a_5xx(server, body, path):
    raw = json.dumps(body, allow_nan=True).encode()
    status, data = server.request("POST", path, raw=raw, timeout=30)
    assert status < 500, (path, body, status, data[:300])


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_fuzz_no_byte_string_gives_a_5xx(server, raw):
    assert server.request("POST", "/v1/chat/completions", raw=raw, timeout=30)[0] < 500


# --- the edges: key, Host, content type, body size, slow clients -----------------------------
def test_the_api_key_guards_everything_but_health(tiny):
    with serving(tiny, "--api-key", "s3cret") as served:
        assert served.request("GET", "/health")[0] == 200
        for method, path, body in (("GET", "/metrics", None), ("GET", "/v1/models", None), ("GET", "/props", None),
                                   ("POST", "/v1/completions", COMPLETION), ("POST", "/tokenize", {"content": "hi"}),
                                   ("POST", "/detokenize", {"tokens": [1]}),
                                   ("POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}]})):
            assert served.request(method, path, body)[0] == 401
            assert served.request(method, path, body, headers={"Authorization": "Bearer s3cre"})[0] == 401
            assert served.request(method, path, body, headers={"Authorization": "Bearer s3cret"})[0] == 200
        client = openai.OpenAI(base_url=served.base + "/v1", api_key="s3cret", timeout=30, max_retries=0)
        # the client's key is accepted: a reply (sampled at the API's default temperature of 1, so the
        # random model may end it with its end token before the second)
        reply = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert reply.usage.prompt_tokens == 2 and reply.usage.completion_tokens <= 2
        assert reply.choices[0].finish_reason in ("length", "stop")


def test_a_loopback_server_answers_only_loopback_host_names(server):
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost"):
        assert server.request("GET", "/v1/models", headers={"Host": host})[0] == 200, host
    for host in (f"evil.example:{port}", "attacker.test", f"127.0.0.1.nip.io:{port}", ""):
        status, err = error_of(server.request("GET", "/v1/models", headers={"Host": host}))
        assert status == 421 and err["code"] == "misdirected_request", host


def test_only_json_bodies_are_read(server):
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        status, err = error_of(server.request("POST", "/v1/completions", COMPLETION, headers={"Content-Type": kind}))
        assert status == 415 and err["code"] == "unsupported_media_type", kind
    ok = server.request("POST", "/v1/completions", COMPLETION,
                        headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok[0] == 200


def send_raw(port, head: bytes, timeout=10) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=timeout)
    sock.sendall(head)
    return sock


def read_status(sock) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split()[1]) if data else 0


def test_bodies_past_max_body_are_refused_before_being_read(tiny):
    with serving(tiny, "--max-body", "1000") as served:
        big = json.dumps({**COMPLETION, "prompt": "x" * 2000}).encode()
        status, err = error_of(served.request("POST", "/v1/completions", raw=big))
        assert status == 413 and err["code"] == "request_too_large"
        status, err = error_of(served.request("POST", "/tokenize", {"content": "x" * 2000}))
        assert status == 413 and err["code"] == "request_too_large"
        # no Content-Length (chunked): refused as the bytes read pass the limit
        sock = send_raw(served.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        with sock:
            sock.sendall(b"%x\r\n%s\r\n" % (len(big), big))
            assert read_status(sock) == 413
        assert served.request("POST", "/v1/completions", COMPLETION)[0] == 200


def test_slow_clients_are_cut_off_after_the_read_timeout(tiny):
    with serving(tiny, "--read-timeout", "1") as served:
        t0 = time.monotonic()
        half_headers = send_raw(served.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow_body = send_raw(served.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        with half_headers, slow_body:
            assert half_headers.recv(100) == b""  # closed without an answer
            assert read_status(slow_body) == 408
        assert time.monotonic() - t0 < 5
        assert served.request("POST", "/v1/completions", COMPLETION)[0] == 200


# --- threads, defaults, metrics -------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2])
def test_the_worker_thread_runs_with_the_threads_asked_for(tiny, threads):
    with serving(tiny, "-t", str(threads)) as served:
        health = json.loads(served.request("GET", "/health")[1])
        assert health["threads"] == threads  # numba.get_num_threads() read inside the worker thread
        banner = next(line for line in served.said if "on http://" in line)
        assert re.search(rf"threads {threads}\b", banner), banner
        assert served.request("POST", "/v1/completions", {**COMPLETION, "prompt": "a longer prompt"})[0] == 200


def test_the_default_max_tokens_is_the_servers_bound(tiny):
    with serving(tiny, "-n", "5") as served:
        status, data = served.request("POST", "/v1/completions", {"prompt": "Once upon", "temperature": 0})
        usage = json.loads(data)["usage"]
        assert status == 200 and usage["completion_tokens"] <= 5


def request_seconds_count(server) -> float:
    text = server.request("GET", "/metrics")[1].decode()
    return float(re.search(r"^pyml_request_seconds_count (\S+)$", text, re.M).group(1))


def test_every_completion_request_is_counted_in_the_latency_histogram(server):
    before = request_seconds_count(server)
    server.request("POST", "/v1/completions", COMPLETION)  # 200, whole
    server.request("POST", "/v1/completions", {**COMPLETION, "stream": True})  # 200, streamed
    server.request("POST", "/v1/completions", {**COMPLETION, "seed": -1})  # 400
    server.request("POST", "/v1/completions", COMPLETION, headers={"Content-Type": "text/plain"})  # 415
    assert request_seconds_count(server) - before == 4


def test_a_stream_keeps_its_connection_answerable(server):
    """Keep-alive still works with the header deadline armed between requests."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=10)
    try:
        for _ in range(3):
            conn.request("POST", "/v1/completions", json.dumps(COMPLETION), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2
    finally:
        conn.close()


def test_a_template_that_refuses_the_conversation_is_a_400_in_one_line(tmp_path):
    model = write_gpt2(tmp_path, "gpt2-tiny", n_positions=256)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages:\\nthis model was not trained with them') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    with serving(model) as served:
        system = {**CHAT, "messages": [{"role": "system", "content": "Be brief."}, *CHAT["messages"]]}
        status, err = error_of(served.request("POST", "/v1/chat/completions", system))
        assert status == 400 and err["param"] == "messages"
        assert err["message"] == (f"the chat template of {model.name}: "
                                  "no system messages: this model was not trained with them")
        assert served.request("POST", "/v1/chat/completions", CHAT)[0] == 200


@pytest.mark.parametrize("flags, said", [(["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
                                         (["--timeout", "0"], "--timeout must be > 0 seconds, got 0"),
                                         (["--read-timeout", "-1"], "--read-timeout must be > 0 seconds, got -1"),
                                         (["--max-body", "0"], "--max-body must be >= 1, got 0"),
                                         (["-n", "0"], "--max-tokens must be >= 1, got 0"),
                                         (["--port", "99999"], "--port must be 0-65535, got 99999"),
                                         (["--timeout", "inf"], "--timeout must be finite: every request is bounded"),
                                         (["--host", ""], "--host is empty: give an address (127.0.0.1: this machine "
                                                          "only; 0.0.0.0: every interface)"),
                                         (["--api-key", ""], "--api-key is empty: give the key, or leave it out for "
                                                             "a server without one")])
def test_a_limit_out_of_range_is_one_line_and_exit_2(tmp_path, flags, said):
    # main(argv) in this process (a refusal comes before any model or socket); test_serve.py's
    # test_a_port_in_use_is_one_line_before_the_model_loads runs the command itself
    done = in_process("-m", str(tmp_path / "never-loaded.gguf"), "--port", "0", *flags, main=pyml_serve.main)
    assert done.returncode == 2 and done.stderr.splitlines() == [f"pyml-serve: error: {said}"]


def test_an_empty_api_key_in_the_environment_is_refused(tmp_path, monkeypatch):
    # an exported but empty PYML_API_KEY made "Bearer " alone the key
    monkeypatch.setenv("PYML_API_KEY", "")
    done = in_process("-m", str(tmp_path / "never-loaded.gguf"), "--port", "0", main=pyml_serve.main)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "pyml-serve: error: PYML_API_KEY is empty: give the key, or leave it out for a server without one"]


def test_a_parallel_whose_cache_could_outgrow_the_memory_is_refused(tiny):
    """Clients decide how long their sequences get: --parallel x --ctx-size sequences of keys and values
    that the machine could not hold are refused at start, in one line whose figure is checked by hand
    (at least layers x (k, v) x heads x head_dim x positions x 2 bytes a sequence: f16, before padding)."""
    parallel = 10**7
    done = in_process("-m", str(tiny), "--port", "0", "--parallel", str(parallel), main=pyml_serve.main)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    said = re.fullmatch(rf"pyml-serve: error: --parallel {parallel}: {parallel} sequences of 256 positions could hold "
                        r"([\d.]+) GB of keys and values, more than this machine's [\d.]+ GB of memory; "
                        r"lower --parallel or --ctx-size", line)
    assert said, line
    config = json.loads((tiny / "config.json").read_text())
    least = parallel * config["n_layer"] * 2 * config["n_embd"] * 256 * 2 / 1e9  # heads x head_dim = n_embd
    assert least - 0.05 <= float(said.group(1)) <= 2 * least  # said to 0.1 GB


def test_a_parallel_that_could_outgrow_the_free_memory_is_said(tiny, monkeypatch, capsys):
    lm = pyml.load_model(tiny, warmup=False)
    one = lm.new_cache(256).nbytes
    monkeypatch.setattr(options, "memory", lambda: {"MemTotal": 100 * one, "MemAvailable": 10 * one})

    def check(n):
        options.check_kv_memory(lm, 256, n, f"--parallel {n}", "lower --parallel or --ctx-size", "pyml-serve")
    check(10)  # fits what is free: nothing said
    assert capsys.readouterr().err == ""
    check(11)
    assert "pyml-serve: warning: 11 sequences of 256 positions could hold" in capsys.readouterr().err
    with pytest.raises(PymlError, match="--parallel 101: 101 sequences"):
        check(101)
