"""pyml-serve --parallel N: requests run together, one batched step at a time (BatchWorker).

The same server process as test_serve.py's, started with --parallel 4 on the GPT-2 stand-in. The
oracle is the same requests one at a time on the same server (greedy): continuous batching must
not change a text. A client that leaves frees its slot, a request beyond the slots waits for one,
malformed requests are still 4xx, and a per-request profile names the batched steps it shared.
"""

import json

import openai
import pytest

import pyml
from pyml.cli import serve_load
from pyml.cli.request_profile import batched_profile, profile_summary, recording
from pyml.cli.serve_worker import JobQueue, QueueFull
from pyml.cli.standins import write_gpt2
from pyml.report.aggregate import ATTN_CORE
from tests.cli.test_serve import (check_a_client_that_leaves_frees_the_model, check_concurrent_streams_equal_one_at_a_time,
                                  check_conversation_reuses_its_cached_prefix, generated_tokens, malformed, start_server,
                                  stop_server, stream_then_leave, wait_idle)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny", n_positions=256)
    served = start_server(path, "--parallel", "4")
    served.model_path = path
    yield served
    stop_server(served)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=60, max_retries=0)


def test_health_says_how_many_run_at_once(server):
    assert json.loads(server.request("GET", "/health")[1])["parallel"] == 4


def test_sixteen_concurrent_streams_on_four_slots_equal_the_same_requests_one_at_a_time(client):
    check_concurrent_streams_equal_one_at_a_time(client)


def test_whole_streamed_stopped_and_seeded_replies_as_alone(client):
    chat = [{"role": "user", "content": "Say hello"}]
    whole = client.chat.completions.create(model="tiny", messages=chat, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=chat, max_tokens=12, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    timings = whole.model_extra["timings"]
    assert timings["predicted_n"] == whole.usage.completion_tokens and timings["prompt_n"] > 0
    full = client.completions.create(model="tiny", prompt="The cat", max_tokens=20, temperature=0).choices[0].text
    stop = full[6:9]
    cut = client.completions.create(model="tiny", prompt="The cat", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model="tiny", prompt="The cat", max_tokens=10, temperature=1.0, seed=7)
            .choices[0].text for _ in range(2))
    assert a == b


def test_a_per_request_profile_under_batching_names_the_steps_it_shared(client):
    """Two choices of one profiled request decode in the same batched steps: the profile gives the
    usual split of the request's share of them (all of each step here) and says what it shared."""
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, n=2, extra_body={"pyml": {"profile": True}})
    prof = r.model_extra["pyml"]["profile"]
    assert prof["decode_steps"] == r.model_extra["timings"]["predicted_n"] - 1 == 5
    assert set(prof["split"]) == {"attention", "ffn", "head", "sampling", "other"}
    assert prof["split"]["attention"]["ms"] > 0 and prof["split"]["ffn"]["ms"] > 0
    assert prof["batch"]["steps"] == 5 and prof["batch"]["mean_sequences"] == prof["batch"]["max_sequences"] == 2
    assert 0 < prof["decode_ms"] <= r.model_extra["timings"]["predicted_ms"]


def test_a_batched_profile_is_the_requests_share_of_each_step(tmp_path):
    """The request's share of a step, by hand: a quarter of the rows' work, half of the attention over
    the caches (1 of its rows in a step of 4 rows over 2 sequences)."""
    lm = pyml.load_model(write_gpt2(tmp_path, "gpt2-tiny", n_positions=64))
    records = []
    with recording(records):
        lm.generate("Hi", max_tokens=4, temperature=0)
    whole = profile_summary(records)
    steps = {r["step"] for r in records if r["phase"] == "decode"}
    part = batched_profile(records, {step: (1, 4, 2) for step in steps})
    cats = whole["categories"]
    per_seq = sum(v["ms"] for c, v in cats.items() if c == ATTN_CORE)
    want = per_seq / 2 + (whole["decode_ms"] - per_seq) / 4
    assert part["decode_steps"] == whole["decode_steps"] == len(steps) == 3
    assert part["decode_ms"] == pytest.approx(want, rel=1e-6, abs=1e-3)


def test_a_client_that_leaves_mid_stream_frees_its_slot_or_its_prompts_slots(tmp_path):
    served = start_server(write_gpt2(tmp_path, "gpt2-tiny", n_positions=1024, n_embd=256, n_layer=4),
                          "--parallel", "3")
    try:
        check_a_client_that_leaves_frees_the_model(served)
        check_a_client_that_leaves_a_list_of_prompts_frees_every_slot(served)
    finally:
        stop_server(served)


def check_a_client_that_leaves_a_list_of_prompts_frees_every_slot(server):
    """Three prompts streaming on three slots; the client leaves after the first chunk: all three
    stop (the server is idle at once, and they made fewer tokens together than one prompt's 1000)."""
    generated = generated_tokens(server)
    stream_then_leave(server, {"model": "tiny", "prompt": ["Long story", "Another one", "And a third"],
                               "max_tokens": 1000, "temperature": 0})
    wait_idle(server, within=5)
    assert 1 <= generated_tokens(server) - generated < 1000


def test_a_hundred_malformed_requests_get_a_4xx_and_the_server_keeps_answering(server, client):
    for kind, body in malformed():
        if isinstance(body, dict) and body.get("n") == 2:
            continue  # n = 2 is a good request here (test_n_choices)
        path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        status, data = (server.request("POST", path, raw=body) if kind == "raw" else server.request("POST", path, body))
        assert 400 <= status < 500, (body, status, data)
    r = client.completions.create(model="tiny", prompt="Still here", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_a_conversation_reuses_its_slots_cached_prefix(client):
    check_conversation_reuses_its_cached_prefix(client)


def test_n_choices_whole_and_streamed(client):
    """n = 3: one prefill, three choices sampled apart (choice i from seed + i): reproducible, the
    streamed choices equal the whole ones, usage counts the prompt once and every choice's tokens."""
    ask = dict(model="tiny", prompt="The cat", max_tokens=8, temperature=1.0, seed=5, n=3)
    whole = client.completions.create(**ask)
    again = client.completions.create(**ask)
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert [c.index for c in whole.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert whole.usage.completion_tokens == 3 * 8
    streamed = ["", "", ""]
    finishes = {}
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert streamed == texts and finishes == {0: "length", 1: "length", 2: "length"}
    alone = client.completions.create(**{**ask, "n": 1, "seed": 6})
    assert alone.choices[0].text == texts[1]  # choice 1 is the prompt alone with seed + 1


def test_a_list_of_prompts_gets_each_prompts_choices_as_alone(client, server):
    """OpenAI's batched form: prompt p's choice j is choice p x n + j and is the prompt's text alone
    (greedy); usage sums the prompts'; streamed choices equal the whole ones; a list of one is one."""
    tokenizer = pyml.load_model(server.model_path).tokenizer
    prompts = ["The cat", "A dog runs to the", tokenizer.encode("Once upon")]
    ask = dict(model="tiny", max_tokens=8, temperature=0)
    alone = [client.completions.create(**ask, prompt=p) for p in prompts]
    whole = client.completions.create(**ask, prompt=prompts, n=2)
    by_index = {c.index: c for c in whole.choices}
    assert sorted(by_index) == list(range(6))
    assert [by_index[i].text for i in range(6)] == [a.choices[0].text for a in alone for _ in range(2)]
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert whole.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    assert [t["predicted_n"] for t in whole.model_extra["timings"]] == \
        [a.model_extra["timings"]["predicted_n"] for a in alone]  # one a prompt
    streamed, finishes, usage, ids = [""] * 6, {}, None, set()
    for chunk in client.completions.create(**ask, prompt=prompts, n=2, stream=True,
                                           stream_options={"include_usage": True}):
        assert not (chunk.choices and chunk.usage)  # usage comes alone, in the last chunk
        usage, ids = chunk.usage or usage, ids | {chunk.id}
        for c in chunk.choices:
            streamed[c.index] += c.text or ""
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert streamed == [by_index[i].text for i in range(6)] and set(finishes.values()) == {"length"}
    assert usage.completion_tokens == whole.usage.completion_tokens and len(ids) == 1
    one = client.completions.create(**ask, prompt=["The cat"])
    assert [c.text for c in one.choices] == [alone[0].choices[0].text]


def test_a_bad_prompt_of_a_list_is_named_and_nothing_runs(server):
    before = generated_tokens(server)
    ask = {"model": "tiny", "max_tokens": 4}
    for prompt, says in ((["fine", ""], "prompt[1] must be a non-empty string"),
                         (["fine", [1, 10**9]], "prompt[1]: "),
                         (["fine", "word " * 400], "prompt[1]: the prompt is"),
                         (["x"] * 33, "list of 33 prompts; this server takes at most 32")):
        status, data = server.request("POST", "/v1/completions", {**ask, "prompt": prompt})
        assert status == 400 and says in json.loads(data)["error"]["message"], data
    assert generated_tokens(server) == before


def test_a_list_of_prompts_queues_whole_or_not_at_all():
    """The queue takes a request's prompts together: with room for one, two prompts are refused (a
    503) and the one waiting job stays alone; a half-queued request could not be answered."""
    queue = JobQueue(2)
    queue.put("waiting")
    with pytest.raises(QueueFull, match=r"1 requests are waiting.*2 prompts would take 2.*--max-queue 2"):
        queue.put("a", "b")
    assert len(queue) == 1
    queue.put("a")
    assert [queue.get_nowait() for _ in range(3)] == ["waiting", "a", None]


def test_the_queue_takes_a_burst_the_free_slots_will_take_beside_its_limit():
    """A burst reaches the queue before the worker moves it into free slots: with three slots free and
    a limit of two, five requests are taken, the sixth refused; a job taken uses its slot up at once
    (put never counts it twice), and the worker says again what it has free after each step."""
    queue = JobQueue(2)
    queue.set_free_slots(3)
    for job in "abcde":
        queue.put(job)
    with pytest.raises(QueueFull, match=r"^2 requests are waiting for the model, the most this server queues \(--max-queue 2\)"):
        queue.put("f")
    assert [queue.get_nowait() for _ in range(3)] == ["a", "b", "c"] and queue.free_slots == 0
    with pytest.raises(QueueFull):
        queue.put("f")
    queue.set_free_slots(1)  # a step ended one sequence
    queue.put("f")
    assert len(queue) == 3


def test_a_burst_of_many_choices_takes_the_free_slots_by_its_choices():
    """n = 4 requests against four free slots: the first takes them all, so two more wait (the
    limit) and a fourth is refused; beside one free slot an n = 4 request is still taken (the
    worker takes a job while a slot is free), leaving the queue's two places to what follows."""
    queue = JobQueue(2, slots_of=len)  # a job here: a string of its n choices
    queue.set_free_slots(4)
    for job in ("aaaa", "bbbb", "cccc"):
        queue.put(job)
    with pytest.raises(QueueFull, match=r"^2 requests are waiting"):
        queue.put("dddd")
    assert queue.get_nowait() == "aaaa" and queue.free_slots == 0
    queue.set_free_slots(1)
    queue.put("e")
    with pytest.raises(QueueFull):
        queue.put("f")
    assert [queue.get_nowait() for _ in range(4)] == ["bbbb", "cccc", "e", None]


def test_n_beyond_the_slots_is_refused_by_name(server):
    status, data = server.request("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 5})
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == "n" and "--parallel 5" in err["message"]


def test_serve_load_reports_throughput_and_the_p50_p99_of_first_text_and_latency(server, capsys):
    """serve_load, the load test docs/serving.md's figures come from, against this server: 4 clients of
    8 streamed requests; its percentiles checked by hand on fixed values."""
    assert serve_load.p50_p99([3.0]) == (3.0, 3.0)
    assert serve_load.p50_p99([1.0, 2.0]) == pytest.approx((1.5, 1.99))
    assert serve_load.p50_p99([float(v) for v in range(1, 101)]) == pytest.approx((50.5, 99.01))
    r = serve_load.run_level(server.port, clients=4, requests=8, max_tokens=8, timeout=60)
    assert r["requests"] == 8 and r["tokens_per_s"] > 0 and r["requests_per_s"] > 0
    assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["latency_p99_s"] and r["latency_p50_s"] <= r["latency_p99_s"]
    assert serve_load.main(["--port", str(server.port), "--clients", "1,2", "--requests", "2", "--max-tokens", "4"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == serve_load.TABLE_HEAD.splitlines()[0] and len(table) == 4
    assert [row.split("|")[1].strip() for row in table[2:]] == ["1", "2"]
    assert all(len(row.split("|")) == 11 for row in table)
    # --rounds: the levels in turn, then the medians and each round's ratios (checked by hand below)
    assert serve_load.main(["--port", str(server.port), "--clients", "1,2", "--requests", "2", "--max-tokens", "4",
                            "--rounds", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [row.split("|")[1].strip() for row in out[2:6]] == ["1", "2", "1", "2"]
    assert out[6].startswith("tokens/s over 2 rounds, median (range): 1 client ") and \
        out[7].startswith("2 clients against 1, each round: ") and len(out) == 8
    rounds = [[{"clients": 1, "tokens_per_s": 100.0}, {"clients": 16, "tokens_per_s": 350.0}],
              [{"clients": 1, "tokens_per_s": 120.0}, {"clients": 16, "tokens_per_s": 300.0}],
              [{"clients": 1, "tokens_per_s": 80.0}, {"clients": 16, "tokens_per_s": 320.0}]]
    assert serve_load.summary(rounds) == [
        "tokens/s over 3 rounds, median (range): 1 client 100.0 (80.0-120.0); 16 clients 320.0 (300.0-350.0)",
        "16 clients against 1, each round: 3.50x 2.50x 4.00x (median 3.50x)"]
    assert serve_load.main(["--port", str(server.port), "--rounds", "0"]) == 2
    assert "--rounds must be at least 1, not 0" in capsys.readouterr().err
    # the prompts share the chat template's start: one client's later requests prefill only what differs
    # when they let the server reuse its slot's prompt, the whole prompt each when they say cache_prompt false
    whole = serve_load.run_level(server.port, clients=1, requests=3, max_tokens=2, timeout=60)
    reused = serve_load.run_level(server.port, clients=1, requests=3, max_tokens=2, timeout=60, cache_prompt=True)
    assert 0 < reused["prefilled_per_request"] < whole["prefilled_per_request"]
    # no server: one line naming the address, not a traceback
    for burst in ([], ["--give-up", "1"]):  # the abandoned burst too (it was an internal error)
        assert serve_load.main(["--port", "1", "--clients", "1", *burst]) == 2
        err = capsys.readouterr().err
        assert err.startswith("serve_load: error: no pyml-serve answers on 127.0.0.1:1") and "Traceback" not in err
