"""Many generations at once: sequences join and leave a running batch between steps.

A BatchGenerator holds a KVPool of `slots` sequences. Each `step` is one DecoderModel.forward_batch
over every running sequence: a decoding sequence contributes its last token, a new one a chunk of
its prompt (at most `prefill_chunk` prompt tokens a step over all of them, so that the running
streams are never held up for a whole long prompt; one or two more where a chunk would otherwise
leave a prompt token alone in a pass, which alone it never is). Requests beyond the free slots wait in order
(up to `max_waiting`); a finished or cancelled request frees its slot for the next at once. This is
continuous batching as llama-server, vLLM and mlx-lm's server do it, on one model instance.

Each slot remembers the tokens its cache holds when its request ends: a new request goes to the
free slot whose tokens its prompt starts with the most of (the next turn of a conversation), and
prefills only the rest (`cached_tokens`), as a PromptCache does for one sequence.

Each Request keeps its own GenerationResult: its prefill time is the wall time of the steps that
carried its prompt, each decode step's the wall time of the step that chose its token - what its
client waited, the other sequences' rows included.

With `speculative` (prompt lookup), a step where every running sequence decodes is a verify pass of
them all: each sequence's last token and the drafts its own prompt lookup proposes, every token a
decode row of one compiled batched step (DecoderModel.verify_batch, at most ROWS_MAX rows: drafts are
trimmed to fit), each sequence then keeping the drafts its target agrees with (nlp/speculative.py's
rule) - the tokens of decoding without drafts, several a step where the text repeats its input.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator

from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.nlp.generator import GenerationResult, check_prompt, reusable_prefix
from pyml.nlp.logprobs import check_top, chunk_rows, rows_logprobs, token_logprob
from pyml.nlp.models.base import DecoderModel
from pyml.nlp.sampling import Sampler, SamplingConfig
from pyml.nlp.speculative import PromptLookup, SpeculativeConfig, Throttle, accept
from pyml.quant.interleaved_rows import ROWS_MAX

_perf = perf.get("pyml.nlp.generator")
_spec_perf = perf.get("pyml.nlp.speculative")  # a verify step's drafting, as the one-sequence speculator's
PREFILL_CHUNK = 256  # prompt tokens a step takes over all joining sequences


class Request:
    """One sequence of a BatchGenerator: its prompt, limits, sampler and result."""

    def __init__(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingConfig, stop_ids, index: int,
                 constraint=None):
        self.prompt, self.max_new_tokens, self.stop_ids = prompt_ids, max_new_tokens, set(stop_ids)
        self.sampler, self.index = Sampler(sampling, constraint), index
        self.result = GenerationResult(list(prompt_ids))
        self.history = list(prompt_ids)  # what the sampler's penalties see
        self.slot = None
        self.fed = 0  # positions of the sequence in its cache
        self.followers = []  # n > 1: the other choices, which start from this one's prefill
        self.reuse = True
        self.top = None  # None, or each chosen token's log-probability is kept with this many likeliest
        self.echo = False  # the prompt's own log-probabilities into result.prompt_logprobs (its whole prompt prefilled)
        self.done = False
        self._cancel = False
        self.lookup = self.throttle = None  # speculative: this sequence's drafter and its adaptive k

    def cancel(self) -> None:
        """End the request at the next step (stop reason "cancelled"): its client left."""
        self._cancel = True

    def _finish(self, reason: str) -> None:
        self.result.stop_reason = self.result.stop_reason or reason  # a stop string's "stop" stays
        self.done = True


class BatchGenerator:
    def __init__(self, model: DecoderModel, slots: int, max_len: int | None = None, kv_type: str | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, max_waiting: int | None = None,
                 speculative: SpeculativeConfig | None = None):
        if slots < 1:
            raise PymlError(f"--batch must be >= 1, got {slots}")
        if speculative is not None and speculative.draft_model is not None:
            raise PymlError("a draft model drafts for one sequence at a time: with several sequences a step "
                            "only prompt lookup (--lookup-ngram) drafts")
        self.speculative = speculative
        # whether drafting pays is a question about the whole step (every sequence's tokens for its
        # time): one Throttle times it; each sequence's own Throttle only sizes its drafts (its k)
        self.throttle = Throttle(speculative.draft_max, speculative.adaptive) if speculative is not None else None
        if prefill_chunk < 1:
            raise PymlError(f"the prefill chunk must be >= 1 token, got {prefill_chunk}")
        self.model, self.prefill_chunk, self.max_waiting = model, prefill_chunk, max_waiting
        self.pool = model.new_pool(slots, max_len, kv_type)
        self.free = list(range(slots))  # the longest free first: a slot without reuse takes the oldest
        self.held = [[] for _ in range(slots)]  # per slot: the tokens whose keys and values it holds
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._submitted = 0
        self.steps = 0  # batched forwards so far: the `step` stamped on their perf records
        self.last_shape = (0, 0)  # the last forward's (rows, sequences): a profile's share of a step

    def submit(self, prompt_ids, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
               stop_ids=(), reuse: bool = True, constraint=None, logprobs: int | None = None,
               echo: bool = False) -> Request:
        """Queue a generation; it joins the batch at the first step with a free slot. `reuse`: it may
        start from a slot's cached tokens (False: its whole prompt is prefilled); `constraint`
        (constrained.py's): the grammar its tokens must match; `logprobs` and `echo`: as
        Generator.stream's, into the request's result (echo with max_new_tokens 0: the prompt scored)."""
        return self._queue(prompt_ids, max_new_tokens, [sampling], stop_ids, reuse, constraint, logprobs, echo)[0]

    def submit_choices(self, prompt_ids, max_new_tokens: int, n: int, sampling: SamplingConfig = SamplingConfig(),
                       stop_ids=(), reuse: bool = True, constraint=None, logprobs: int | None = None,
                       echo: bool = False) -> list[Request]:
        """n completions of one prompt (OpenAI's `n`): the prompt prefilled once, its cache copied to
        the other n - 1 sequences (KVPool.copy), each then sampling on its own - with a seed, choice i
        from seed + i. The n join together, when n slots are free."""
        if not 1 <= n <= self.pool.n_seqs:
            raise PymlError(f"n={n} completions need as many sequences at once: this batch has {self.pool.n_seqs}")
        seeds = [sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i)
                 for i in range(n)]
        return self._queue(prompt_ids, max_new_tokens, seeds, stop_ids, reuse, constraint, logprobs, echo)

    def _queue(self, prompt_ids, max_new_tokens, samplings, stop_ids, reuse, constraint=None,
               logprobs=None, echo=False) -> list[Request]:
        """The checked prompt's requests (one per sampling), queued as one group."""
        prompt_ids = check_prompt(self.model, prompt_ids, max_new_tokens)
        if len(prompt_ids) > self.pool.max_len:
            what = "the model's context window" if self.pool.max_len == self.model.max_positions else "the context size"
            raise PymlError(f"the prompt is {len(prompt_ids)} tokens, longer than {what} of {self.pool.max_len}")
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise PymlError(f"{len(self.waiting)} requests are already waiting for a slot (the limit)")
        if logprobs is not None:
            check_top(logprobs)
        requests = []
        for i, sampling in enumerate(samplings):
            sampling.check_vocab(self.model.config.vocab_size)
            # each choice walks the grammar on its own
            own = constraint if i == 0 or constraint is None else constraint.fresh()
            request = Request(prompt_ids, max_new_tokens, sampling, stop_ids, self._submitted, own)
            request.reuse, request.echo = reuse and not echo, echo  # echo scores every prompt token
            if logprobs is not None:
                request.top, request.result.logprobs = logprobs, []
            if self.speculative is not None:
                request.lookup = PromptLookup(self.speculative.lookup_ngram)
                # alone in the batch (one slot), a sequence's rows are its own: k as Speculator's lookup keeps it
                request.throttle = Throttle(self.speculative.draft_max, self.speculative.adaptive,
                                            sizes_k=self.pool.n_seqs > 1)
            self._submitted += 1
            requests.append(request)
        if max_new_tokens == 0 and not echo:
            for request in requests:
                request._finish("max_tokens")
        else:
            requests[0].followers = requests[1:]
            self.waiting.append(requests[0])
        return requests

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def run(self) -> Iterator[tuple[Request, int]]:
        """(request, token) as each is chosen, until every submitted request has ended."""
        while self.busy:
            yield from self.step()

    def step(self) -> list[tuple[Request, int]]:
        """One pass over the running sequences (after admitting waiting ones): the tokens it chose."""
        self._leave([r for r in self.running if r._cancel], "cancelled")
        for request in [r for r in self.waiting if r._cancel]:
            self.waiting.remove(request)
            for r in [request, *request.followers]:
                r._finish("cancelled")
        while self.waiting and len(self.free) > len(self.waiting[0].followers):
            leader = self.waiting.popleft()
            self._admit(leader)
            for r in leader.followers:  # parked in a slot until the leader's prompt is in the cache
                r.slot = self.free.pop()
                self.held[r.slot] = []
        # a decoding sequence whose cache is full has chosen its last token (as Generator's "context")
        self._leave([r for r in self.running if len(r.prompt) <= r.fed >= self.pool.max_len], "context")
        if not self.running:
            self.last_shape = (0, 0)
            return []
        rows, budget = [], self.prefill_chunk
        if any(r.echo and r.fed < len(r.prompt) for r in self.running):  # every row's logits kept this step
            budget = min(budget, chunk_rows(self.model.config.vocab_size))
        for r in self.running:
            if r.fed < len(r.prompt):  # still prefilling: a chunk of the prompt, within the step's budget
                left = len(r.prompt) - r.fed
                n = min(left, budget)
                if n == 0:
                    continue
                # no prompt token in a one-token chunk of its own unless its whole prefill is that one
                # token: a one-token row is a decode row, whose attention (f32, attend_decode_batch) is
                # not the prefill's (bf16 where float_compute is bf16), and alone the token would have
                # been in a longer pass (DecoderModel.forward's micro-batches keep to the same rule), so
                # the chunk takes one token or two past the budget instead
                while n < left and (n == 1 or left - n == 1) and len(r.prompt) - r.result.cached_tokens > 1:
                    n += 1
                budget = max(0, budget - n)
                rows.append((r, r.prompt[r.fed:r.fed + n]))
            else:
                rows.append((r, [r.result.tokens[-1]]))
        every_row_decodes = all(r.fed >= len(r.prompt) for r in self.running) and len(rows) == len(self.running)
        if self.speculative is not None and every_row_decodes and self.throttle.wants_draft():
            chosen = self._speculative_step()
            if chosen is not None:
                return chosen
        # a step where any sequence decodes is a decode step to that sequence (its time per token);
        # only a step of prompt chunks alone is prefill
        decoding = sum(1 for r, _ in rows if r.fed >= len(r.prompt))
        scoring = any(r.echo and r.fed < len(r.prompt) for r, _ in rows)
        self.steps, self.last_shape = self.steps + 1, (sum(len(t) for _, t in rows), len(rows))
        t0, d0 = perf.clock(), perf.drain_seconds()
        with perf.context(phase="decode" if decoding else "prefill", step=self.steps), \
                _perf.debug("generator::batch_step", "rows={} seqs={} decoding={}", sum(len(t) for _, t in rows),
                            len(rows), decoding, op="generator"):
            logits = self.model.forward_batch(self.pool, [(r.slot, tokens, r.fed) for r, tokens in rows],
                                              all_logits=scoring)
        made = perf.drain_seconds() - d0
        elapsed = perf.clock() - t0 - made
        if self.throttle is not None and every_row_decodes:
            self.throttle.plain(elapsed / len(rows))  # seconds per token of a step without drafts
        chosen = []
        for (r, tokens), row in zip(rows, logits):
            prefilling = r.fed < len(r.prompt)
            if scoring:  # row: [len(tokens), vocab]
                if r.echo and prefilling:  # each prompt token after the first, given the ones before it
                    nexts = r.prompt[r.fed + 1:r.fed + 1 + len(tokens)]
                    r.result.prompt_logprobs = (r.result.prompt_logprobs or []) + rows_logprobs(
                        row[:len(nexts)], nexts, r.top or 0)
                row = row[-1]
            r.fed += len(tokens)
            if prefilling:
                r.result.prefill_s += elapsed
                r.result.prefill_log_s += made
                if r.fed < len(r.prompt):
                    continue  # more of the prompt next step: these logits choose nothing
            else:
                r.result.decode_s.append(elapsed)
                r.result.decode_log_s += made
            choices, r.followers = ([r, *r.followers] if prefilling else [r]), []
            for choice in choices:
                if choice is not r:  # the leader's prompt is cached: a copy of it, the same logits
                    self._follow(r, choice)
                if choice.max_new_tokens == 0:  # echo alone: the prompt scored, nothing generated
                    self._leave([choice], "max_tokens")
                    continue
                token = choice.sampler(row, choice.history)
                if choice.top is not None:
                    choice.result.logprobs.append(token_logprob(row, token, choice.top))
                choice.result.tokens.append(token)
                choice.history.append(token)
                chosen.append((choice, token))
                if token in choice.stop_ids:
                    self._leave([choice], "eos")
                elif len(choice.result.tokens) >= choice.max_new_tokens:
                    self._leave([choice], "max_tokens")
        return chosen

    def _speculative_step(self) -> list | None:
        """A verify pass over every running sequence (all decoding), or None where this step decodes
        without drafts: a sequence still prefilling, one that wants log-probabilities, a grammar or
        echo (as Generator's speculation refuses them), no drafts, or a pass the compiled step cannot
        take. Each sequence: its last token and its drafts, trimmed so that the pass has at most
        ROWS_MAX rows (the longest cut first)."""
        running = self.running
        if any(r.fed < len(r.prompt) or r.top is not None or r.echo or r.sampler.constraint is not None
               for r in running):
            return None
        drafts = []
        with _spec_perf.debug("speculative::draft", "seqs={}", len(running), op="speculative"):
            for r in running:
                k = min(r.throttle.k, r.max_new_tokens - len(r.result.tokens) - 1, self.pool.max_len - r.fed - 1)
                drafts.append(r.lookup.propose(r.history, k) if k >= 1 else [])
        while len(running) + sum(map(len, drafts)) > ROWS_MAX:
            longest = max(range(len(drafts)), key=lambda i: len(drafts[i]))
            drafts[longest] = drafts[longest][:-1]
        if not any(drafts):
            return None
        self.steps, self.last_shape = self.steps + 1, (len(running) + sum(map(len, drafts)), len(running))
        t0, d0 = perf.clock(), perf.drain_seconds()
        with perf.context(phase="decode", step=self.steps), \
                _perf.debug("generator::batch_step", "rows={} seqs={} decoding={} drafted={}", self.last_shape[0],
                            len(running), len(running), sum(map(len, drafts)), op="generator"):
            rows = self.model.verify_batch(self.pool, [(r.slot, [r.result.tokens[-1]] + d, r.fed)
                                                       for r, d in zip(running, drafts)])
        if rows is None:
            return None
        made = perf.drain_seconds() - d0
        elapsed = perf.clock() - t0 - made
        chosen, kept_total = [], 0
        for r, draft, row in zip(list(running), drafts, rows):
            picked, kept = accept(row, draft, [None] * len(draft), r.history, r.sampler)
            kept_total += kept
            r.fed += 1 + kept
            if kept < len(draft):
                self.pool.sequence(r.slot).rollback(r.fed)
            r.result.drafted += len(draft)
            r.result.accepted += kept
            r.result.decode_s += [elapsed / len(picked)] * len(picked)  # per token chosen, as Generator's
            r.result.decode_log_s += made
            if draft:  # its next k (never timed: no plain figure of its own, so only the kept count speaks)
                r.throttle.speculated(0.0, len(picked), len(draft), kept)
            for token in picked:
                r.result.tokens.append(token)
                r.history.append(token)
                chosen.append((r, token))
                if token in r.stop_ids:
                    self._leave([r], "eos")
                    break
                if len(r.result.tokens) >= r.max_new_tokens:
                    self._leave([r], "max_tokens")
                    break
        self.throttle.speculated(elapsed, len(chosen), sum(map(len, drafts)), kept_total)
        return chosen

    def _follow(self, leader: Request, r: Request) -> None:
        self.pool.copy(leader.slot, r.slot)
        r.fed, r.result.cached_tokens = leader.fed, leader.result.cached_tokens
        r.result.prefill_s, r.result.prefill_log_s = leader.result.prefill_s, leader.result.prefill_log_s
        r.result.prompt_logprobs = leader.result.prompt_logprobs
        self.running.append(r)

    def _admit(self, r: Request) -> None:
        """Into the free slot that holds the longest start of its prompt (its last two tokens are
        run again: reusable_prefix)."""
        best, reused = self.free[0], 0
        for slot in self.free if r.reuse else ():
            n = reusable_prefix(self.held[slot], r.prompt)
            if n > reused and self.pool.sequence(slot).resumable(n):
                best, reused = slot, n
        self.free.remove(best)
        r.slot, r.fed, r.result.cached_tokens = best, reused, reused
        self.pool.sequence(best).length = reused
        self.held[best] = []
        self.running.append(r)

    def _leave(self, requests: list, reason: str) -> None:
        for r in requests:
            for parked in r.followers:  # a leader that leaves before its prompt is in: its choices too
                self.free.append(parked.slot)
                parked._finish(reason)
            r.followers = []
            self.running.remove(r)
            self.held[r.slot] = (r.prompt + r.result.tokens)[:r.fed]  # what its cache holds, in order
            self.free.append(r.slot)
            r._finish(reason)
