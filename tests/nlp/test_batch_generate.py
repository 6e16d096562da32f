"""Many generations at once (BatchGenerator, LanguageModel.generate_batch / stream_batch) against
each prompt generated alone (LanguageModel.generate, itself checked against transformers): the
same texts, tokens and stop reasons, with prompts queueing for slots, joining as others end,
prompts prefilled in chunks, stop strings, seeds, cancellation and a full cache."""

import pytest

import pyml
from pyml.core.errors import PymlError
from pyml.nlp.batch_generator import BatchGenerator
from pyml.nlp.sampling import SamplingConfig

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "2 + 2 ="]


@pytest.fixture(scope="module")
def lm(smollm2_gguf):
    return pyml.load_model(gguf=str(smollm2_gguf), threads=2)


def alone(lm, prompt, max_tokens, **options):
    return lm.generate(prompt, max_tokens, **options)


@pytest.mark.parametrize("batch", [2, 16])
def test_batch_texts_are_the_texts_alone(lm, batch):
    """Five prompts on two slots: three wait, each joins as one ends (different lengths, positions)."""
    got = lm.generate_batch(PROMPTS, 12, batch=batch)
    for prompt, result in zip(PROMPTS, got):
        ref = alone(lm, prompt, 12)
        assert (result.tokens, result.text, result.stop_reason) == (ref.tokens, ref.text, ref.stop_reason), prompt
        assert result.prefill_s > 0 and len(result.decode_s) == len(result.tokens) - 1


def test_a_seeded_batch_samples_as_each_prompt_alone_with_its_seed(lm):
    """Prompt i samples from seed + i: reproducible, and the same as that prompt alone with that seed."""
    options = dict(temperature=0.9, top_p=0.95, seed=7)
    first = lm.generate_batch(PROMPTS[:3], 10, **options)
    again = lm.generate_batch(PROMPTS[:3], 10, **options)
    assert [r.tokens for r in first] == [r.tokens for r in again]
    for i, (prompt, result) in enumerate(zip(PROMPTS[:3], first)):
        assert result.tokens == alone(lm, prompt, 10, **{**options, "seed": 7 + i}).tokens


def test_a_stop_string_ends_its_own_sequence_only(lm):
    got = lm.generate_batch(PROMPTS[:2], 16, stop=["."])
    for prompt, result in zip(PROMPTS[:2], got):
        ref = alone(lm, prompt, 16, stop=["."])
        assert (result.text, result.stop_reason) == (ref.text, ref.stop_reason)
    assert got[0].stop_reason == "stop" and "." not in got[0].text


def test_a_prompt_prefilled_in_chunks_across_steps_gives_the_same_tokens(lm):
    """A 3-token prefill budget a step: a long prompt takes several steps beside running decodes."""
    ids = [lm.encode(p) for p in PROMPTS]
    gen = BatchGenerator(lm.model, 3, max_len=64, prefill_chunk=3)
    requests = [gen.submit(i, 8, stop_ids=lm.tokenizer.eos_ids) for i in ids]
    list(gen.run())
    for prompt, r in zip(PROMPTS, requests):
        assert r.result.tokens == alone(lm, prompt, 8).tokens
    assert not gen.busy and sorted(gen.free) == [0, 1, 2]


def test_a_prompt_the_batch_holds_whole_gets_the_logits_of_its_prefill(lm):
    """The same prompt three times on one slot: the second and third start from the slot's cache,
    which holds all of it. Its last two tokens are run again, not just the last: a one-token pass
    is a decode step, whose attention (f32) is not the prefill's (bf16 on an avx512_bf16 CPU), and
    its first logits moved by up to 0.6 (a repeated prompt of pyml-batch's 64 got other texts).
    Each choice's log-probabilities equal the prompt's alone, bit for bit."""
    ids = lm.encode(lm.chat_prompt([{"role": "user", "content": "Write a short poem about the sea."}]))
    gen = BatchGenerator(lm.model, 1, max_len=128)
    requests = [gen.submit(ids, 4, stop_ids=lm.tokenizer.eos_ids, logprobs=1) for _ in range(3)]
    list(gen.run())
    ref = lm.generate(ids, 4, logprobs=1)
    assert [r.result.cached_tokens for r in requests] == [0, len(ids) - 2, len(ids) - 2]
    for r in requests:
        assert r.result.logprobs == ref.logprobs


def test_no_prompt_token_is_a_pass_of_its_own(lm, monkeypatch):
    """A 3-token budget a step: a chunk that would leave a prompt's last token for a step of its own
    (a one-token row, a decode row) takes it along; one that the budget would cut to one token takes
    a second. Every prompt chunk has two tokens or more and each sequence's log-probabilities equal
    its prompt's alone, bit for bit."""
    ids = [lm.encode(p) for p in PROMPTS]
    chunks, forward_batch = [], lm.model.forward_batch

    def recorded(pool, rows, **kwargs):
        prompt_of = {r.slot: r.prompt for r in gen.running}
        chunks.extend(len(tokens) for slot, tokens, pos in rows if pos < len(prompt_of[slot]))  # prompt rows
        return forward_batch(pool, rows, **kwargs)

    gen = BatchGenerator(lm.model, 3, max_len=64, prefill_chunk=3)
    requests = [gen.submit(i, 6, stop_ids=lm.tokenizer.eos_ids, logprobs=1, reuse=False) for i in ids]
    monkeypatch.setattr(lm.model, "forward_batch", recorded)
    list(gen.run())
    assert chunks and min(chunks) >= 2, chunks
    for prompt, r in zip(ids, requests):
        assert r.result.logprobs == lm.generate(prompt, 6, logprobs=1).logprobs


def test_a_full_cache_ends_with_context_as_alone(lm):
    ids = lm.encode(PROMPTS[0])
    gen = BatchGenerator(lm.model, 2, max_len=len(ids) + 3)
    r = gen.submit(ids, 20)
    other = gen.submit(lm.encode(PROMPTS[1]), 2)
    list(gen.run())
    ref = lm.generate(ids, 20, ctx_size=len(ids) + 3)
    assert (r.result.tokens, r.result.stop_reason) == (ref.tokens, "context") and other.result.stop_reason == "max_tokens"


def test_a_full_cache_ends_a_streamed_batch_with_its_result(lm):
    """stream_batch (generate_batch, pyml-batch --batch) gives the last event of a sequence whose cache
    filled - it leaves at a step's start choosing nothing - the first and the last to run included."""
    ctx = len(lm.encode(PROMPTS[0])) + 3
    got = lm.generate_batch(PROMPTS[:3], 20, batch=2, ctx_size=ctx, options=[{}, {"max_tokens": 2}, {}])
    for prompt, result, n in zip(PROMPTS, got, (20, 2, 20)):
        ref = lm.generate(prompt, n, ctx_size=ctx)
        assert result is not None and (result.tokens, result.stop_reason) == (ref.tokens, ref.stop_reason), prompt
    assert [r.stop_reason for r in got] == ["context", "max_tokens", "context"]


def test_a_consumer_that_leaves_frees_every_slot(lm):
    events = lm.stream_batch(PROMPTS, 50, batch=2)
    for _ in zip(range(3), events):
        pass
    events.close()
    gen = BatchGenerator(lm.model, 2, max_len=64)
    r = gen.submit(lm.encode(PROMPTS[0]), 50)
    gen.step()
    r.cancel()
    gen.step()
    assert r.result.stop_reason == "cancelled" and not gen.busy and len(gen.free) == 2


def test_max_tokens_0_ends_before_a_step(lm):
    got = lm.generate_batch(PROMPTS[:2], 0)
    assert [(r.tokens, r.stop_reason) for r in got] == [([], "max_tokens")] * 2


@pytest.mark.parametrize("prompt, max_tokens, message", [
    ([], 4, "the prompt is empty"),
    ([10 ** 6], 4, "outside the model's vocabulary"),
    (list(range(70)), 4, "longer than the context size"),
    ([1, 2], -1, "^max_tokens must be >= 0, got -1"),  # the library's argument, not a flag's spelling
])
def test_a_bad_request_is_refused_in_one_line(lm, prompt, max_tokens, message):
    gen = BatchGenerator(lm.model, 2, max_len=64)
    with pytest.raises(PymlError, match=message):
        gen.submit(prompt, max_tokens)


def test_the_queue_is_bounded(lm):
    gen = BatchGenerator(lm.model, 1, max_len=64, max_waiting=2)
    for _ in range(2):
        gen.submit([1, 2], 4)
    with pytest.raises(PymlError, match="already waiting"):
        gen.submit([1, 2], 4)


def test_a_follow_up_reuses_the_slot_that_holds_its_start(lm):
    """The next turn of a conversation goes to the slot whose cache holds its start and prefills
    only the rest; its tokens are those of the whole prompt generated alone."""
    first_ids = lm.encode(PROMPTS[0])
    gen = BatchGenerator(lm.model, 3, max_len=64)
    first = gen.submit(first_ids, 6)
    other = gen.submit(lm.encode(PROMPTS[1]), 6)
    list(gen.run())
    follow = first_ids + first.result.tokens + lm.encode(" And")
    again = gen.submit(follow, 6)
    cold = gen.submit(follow, 6, reuse=False)
    list(gen.run())
    assert again.slot == first.slot and again.result.cached_tokens == len(first_ids) + 5  # the last token unfed
    assert cold.result.cached_tokens == 0 and other.result.cached_tokens == 0
    assert again.result.tokens == cold.result.tokens == alone(lm, follow, 6).tokens


def test_n_choices_share_one_prefill_and_are_reproducible_with_a_seed(lm):
    """n = 3 completions of one prompt: prefilled once, each choice then samples on its own (choice i
    from seed + i) - the same tokens as the prompt alone with that seed, and again on a second run."""
    ids = lm.encode(PROMPTS[0])
    sampling = SamplingConfig(temperature=0.9, seed=11)

    def run():
        gen = BatchGenerator(lm.model, 4, max_len=64)
        choices = gen.submit_choices(ids, 8, 3, sampling)
        other = gen.submit(lm.encode(PROMPTS[1]), 8)
        list(gen.run())
        return [c.result for c in choices], other.result

    first, other = run()
    again, _ = run()
    assert [r.tokens for r in first] == [r.tokens for r in again]
    for i, result in enumerate(first):
        assert result.tokens == alone(lm, ids, 8, temperature=0.9, seed=11 + i).tokens
        assert result.prefill_s == first[0].prefill_s  # one prefill, shared
    assert len({tuple(r.tokens) for r in first}) > 1  # the choices do differ
    assert other.tokens == alone(lm, PROMPTS[1], 8).tokens


def test_n_larger_than_the_batch_is_refused(lm):
    gen = BatchGenerator(lm.model, 2, max_len=64)
    with pytest.raises(PymlError, match="n=3 completions need as many sequences"):
        gen.submit_choices([1, 2], 4, 3)


def test_warm_batch_runs_once_and_not_for_a_model_loaded_without_a_warm_up(smollm2_gguf):
    """warm_batch's steps count in warmup_s, once for each kind (2 rows; the rows region's from
    ROWS_REGION_MIN slots); a model loaded with warmup=False is left cold, as its prefill is."""
    warm = pyml.load_model(gguf=str(smollm2_gguf), threads=2)
    warm.warm_batch(1)
    before = warm.warmup_s
    warm.warm_batch(4)
    after_two = warm.warmup_s
    warm.warm_batch(3)
    assert warm.warmup_s == after_two > before
    warm.warm_batch(16)
    after_region = warm.warmup_s
    warm.warm_batch(9)
    assert warm.warmup_s == after_region > after_two
    cold = pyml.load_model(gguf=str(smollm2_gguf), threads=2, warmup=False)
    cold.warm_batch(16)
    assert cold.warmup_s == 0.0
