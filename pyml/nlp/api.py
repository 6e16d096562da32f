"""The library entry point: `load_model(...)`, the LanguageModel it returns, and the one place
that builds a model from a file (loaders read files; the architectures compose layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import operator
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pyml import quant
from pyml.core import compiles, derived, isa, perf
from pyml.core.errors import ModelFormatError, PymlError, UnsupportedError
from pyml.core.runtime import RuntimeConfig, return_free_heap
from pyml.nlp import compile_helper
from pyml.nlp.batch_generator import BatchGenerator
from pyml.nlp.generator import GenerationResult, Generator, PromptCache, StopStrings, check_prompt
from pyml.nlp.loaders import hub, packed_cache
from pyml.nlp.loaders.gguf import GGUFFile, check_hyperparameters
from pyml.nlp.loaders.safetensors import load_tensors, read_config
from pyml.nlp.logprobs import Score, check_top, prompt_logprobs
from pyml.nlp.models import GGUF_ARCHITECTURES, HF_ARCHITECTURES, GPT2Config
from pyml.nlp.models.base import DecoderConfig, DecoderModel
from pyml.nlp.constrained import Constraint
from pyml.nlp.sampling import SamplingConfig
from pyml.nlp.speculative import SpeculativeConfig
from pyml.nlp.tokenizer import Tokenizer
from pyml.nn import KVCache
from pyml.nn.fused import ROWS_REGION_MIN
from pyml.nn.kv_cache import DEFAULT_KV_TYPE, check_kv_type
from pyml.quant import QuantType

_perf = perf.get("pyml.nlp.load")
DEFAULT_MODEL = "smollm2-135m"
ModelConfig = GPT2Config | DecoderConfig  # what `LanguageModel.config` may be (the families derive from it)
BATCH_DEFAULT = 16  # sequences a step when stream_batch is not told
HEAD_TYPES = {"q8_0": QuantType.Q8_0, "q4_0": QuantType.Q4_0}  # --lm-head-quant


@dataclass(frozen=True)
class StreamEvent:
    """One step of `LanguageModel.stream`: a piece of text that can be shown now; the last
    event has `result` set (the whole GenerationResult, with its timings and stop reason)."""
    text: str
    result: GenerationResult | None = None


@dataclass
class LanguageModel:
    model: DecoderModel
    tokenizer: Tokenizer | None
    source: str
    load_s: float
    runtime: RuntimeConfig
    chat_template: str | None = None
    warmup_s: float = 0.0  # seconds spent warming up: load_model's decode step, then the first prefill's
    compile_s: float = 0.0  # seconds spent compiling kernels (a first run's, or after an edit): not in the two above
    _prefill_cold: bool = field(default=False, repr=False)  # the prefill kernels are still to be loaded
    _batch_warm: int = field(default=0, repr=False)  # rows of the batched steps warm_batch has run: 0, 2 or more
    load_options: dict = field(default_factory=dict, repr=False)  # load_model's, for a compile helper
    _helper: object = field(default=None, repr=False, compare=False)  # compile_helper's process, while it runs
    _warm_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def warm_up(self, prefill: bool = False, cold: bool = False) -> None:
        """Load (or, on a first run, compile) the kernels of one decode step, or with `prefill` of a
        multi-token forward pass, and start the threads, before anything is timed.

        load_model warms the decode step only; the prefill's kernels (the x8 GEMMs, tiled attention,
        the row-wise norm, RoPE and activation) load before the first prompt of more than one token
        (`stream`, `forward`), so a run that never prefills more than one token never loads them
        (SmolLM2 Q4_1: 4 kernels, 4 MB of model memory, ~40 ms of CPU). `cold`: warm the prefill
        even of a model loaded without a warm-up (compile_helper's)."""
        with self._warm_lock:
            if prefill and not (self._prefill_cold or cold):
                return
            t0 = perf.clock()
            label = f"{Path(self.source).name}'s {'prefill' if prefill else 'decode step'}"
            # on a first run the prefill's kernels compile in a helper process meanwhile (compile_helper)
            helped = (not prefill and self._prefill_cold and self.load_options
                      and compile_helper.enabled(self.runtime.threads))
            cancel = None
            if helped:
                cancel = compiles.when_compiling(
                    lambda: setattr(self, "_helper", compile_helper.start(self.load_options)))
            try:
                with compiles.showing(label, _compile_key(self.source, "prefill" if prefill else "load")) as compiled, \
                        perf.context(phase="warmup"):
                    self.runtime.warmup_thread_pool(steps=[lambda: _warm_forward(self.model, prefill)])
                    if prefill and self._helper is not None:  # its last compiles end before anything is timed
                        with (compiles.waiting("the prefill's kernels") if self._helper.poll() is None
                              else contextlib.nullcontext()):
                            compiles.add_elsewhere(compile_helper.finish(self._helper))
                        self._helper = None
            finally:
                if cancel is not None:
                    cancel()
            self.compile_s += compiled.seconds
            self.warmup_s += perf.clock() - t0 - compiled.seconds
            if prefill:
                self._prefill_cold = False

    def warm_batch(self, slots: int) -> None:
        """Load the kernels of the steps a batch of `slots` sequences runs (stream_batch's, pyml-serve's
        --parallel) before anything is timed: DecoderModel.warm_batch, once. After the prefill's
        warm-up (its prompt rows take the prefill's kernels). Nothing for a model loaded without a
        warm-up (load_model's `warmup`: the first steps then show what it costs)."""
        self.warm_up(prefill=True)
        rows = ROWS_REGION_MIN if slots >= ROWS_REGION_MIN else 2  # the steps of more rows take the same kernels
        with self._warm_lock:
            if slots < 2 or not self.runtime.warmup or self._batch_warm >= rows:
                return
            t0 = perf.clock()
            with compiles.showing(f"{Path(self.source).name}'s batched steps",
                                  _compile_key(self.source, "batch")) as compiled, perf.context(phase="warmup"):
                self.runtime.warmup_thread_pool(steps=[lambda: self.model.warm_batch(rows)])
            self.compile_s += compiled.seconds
            self.warmup_s += perf.clock() - t0 - compiled.seconds
            self._batch_warm = rows

    def _before_forward(self, n_tokens: int) -> None:
        if n_tokens > 1 and self._prefill_cold:
            self.warm_up(prefill=True)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def new_cache(self, max_len: int | None = None, kv_type: str | None = None) -> KVCache:
        return self.model.new_cache(max_len, kv_type)

    def new_prompt_cache(self, max_len: int | None = None) -> PromptCache:
        """A KV cache that remembers its tokens: pass it as `cache=` to every turn of a
        conversation and each turn prefills only what the last one had not seen."""
        return PromptCache(self.new_cache(max_len))

    def forward(self, token_ids, cache=None, all_logits: bool = False) -> np.ndarray:
        """Logits (NumPy) for token_ids appended to `cache` (a fresh one if None)."""
        if cache is None:
            cache = self.new_cache(len(token_ids))
        self._before_forward(len(token_ids))
        return self.model.forward(token_ids, cache, all_logits=all_logits)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS / EOS as the model asks unless add_special_tokens is false."""
        return self._tokenizer().encode(text, add_special_tokens)

    def _prompt_ids(self, prompt, what: str = "the prompt") -> list[int]:
        """Text encoded as `encode` does; token ids taken as they are."""
        return self.encode(prompt) if isinstance(prompt, str) else as_token_ids(prompt, what)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer().decode([int(i) for i in ids], skip_special_tokens)

    def chat_prompt(self, messages: list, tools: list | None = None) -> str:
        """The prompt text of `messages` ({"role", "content"} dicts) in the model's chat template;
        `tools` (OpenAI's function specs) reach the template as its `tools`."""
        return self._tokenizer().apply_chat_template(messages, template=self.chat_template, tools=tools)

    def stream(self, prompt: str | list, max_tokens: int = 64, *, stop=(), cache: PromptCache | None = None,
               result: GenerationResult | None = None, ctx_size: int | None = None, context_shift: bool = False,
               n_keep: int = 0, cancelled=None, json_schema=None, grammar: str | None = None,
               constraint: Constraint | None = None, logprobs: int | None = None, echo: bool = False,
               speculative: SpeculativeConfig | None = None,
               **sampling) -> Iterator[StreamEvent]:
        """Generate from a prompt (text, or token ids), yielding text as it becomes final.

        `stop`: strings that end the text (never shown, not even in part); `cache`: a PromptCache
        whose tokens the prompt may start with; `ctx_size`: positions of the cache made when none
        is given; `context_shift`: a full cache keeps its first `n_keep` tokens and drops the oldest
        half of the rest instead of stopping; `cancelled()`: asked before each decode step, true
        ends the generation (stop reason "cancelled"); `json_schema` (a dict or its JSON text) or
        `grammar` (GBNF or Lark text): the text generated must match it (constrained.py), as must
        a prebuilt `constraint`'s; `speculative`: draft and verify several tokens a step
        (nlp/speculative.py; a draft model must tokenize as this one does); `sampling`: SamplingConfig's fields (temperature,
        top_k, top_p, min_p, repetition_penalty, frequency_penalty, presence_penalty, seed).
        `logprobs`: each generated token's log-probability, with that many likeliest tokens, in
        `result.logprobs` (as each token's event comes); `echo`: the prompt's in `result.prompt_logprobs`.
        The prompt and the options are checked here, before the first event is asked for.
        """
        ids = self._prompt_ids(prompt)
        if speculative is not None and isinstance(speculative.draft_model, LanguageModel):
            self._check_draft(speculative.draft_model)
        if json_schema is not None or grammar is not None:
            if constraint is not None:
                raise PymlError("give a constraint, or a JSON schema or grammar to build one, not both")
            constraint = Constraint.from_options(self._tokenizer(), json_schema, grammar)
        self._before_forward(2 if context_shift else len(ids))  # a shift re-prefills what it keeps
        result = result if result is not None else GenerationResult(ids)
        eos = self.tokenizer.eos_ids if self.tokenizer is not None else ()
        tokens = Generator(self.model).stream(ids, max_tokens, SamplingConfig(**sampling), stop_ids=eos,
                                              cache=cache, result=result, ctx_size=ctx_size,
                                              context_shift=context_shift, n_keep=n_keep, cancelled=cancelled,
                                              constraint=constraint, logprobs=logprobs, echo=echo,
                                              speculative=speculative)
        return self._text_events(tokens, result, eos, StopStrings(stop))

    def _check_draft(self, draft: "LanguageModel") -> None:
        """One line when a draft model's tokens are not this model's (ids mean other text)."""
        sample = "Speculative decoding: the draft's ids must mean the same text, 123 + 4 = 127.\n\t<b>é</b>"
        if self.tokenizer is not None and draft.tokenizer is not None and draft.encode(sample) != self.encode(sample):
            raise PymlError("the draft model's tokenizer is not the target's: it splits text into other tokens")

    def _text_events(self, tokens: Iterator[int], result: GenerationResult, eos, stops: StopStrings):
        text_out = TextOut(self.tokenizer, result, eos, stops)
        try:
            for token in tokens:
                text = text_out.push(token)
                if text:
                    yield StreamEvent(text)
                if text_out.stopped:
                    break
            else:
                text = text_out.end()
                if text:
                    yield StreamEvent(text)
        finally:
            tokens.close()  # a consumer that stops early (a closed connection) frees the model here
            text_out.close()
        yield StreamEvent("", result)

    def generate(self, prompt: str | list, max_tokens: int = 64, *, on_text=None, stop=(),
                 cache: PromptCache | None = None, result: GenerationResult | None = None,
                 logprobs: int | None = None, echo: bool = False, **sampling) -> GenerationResult:
        """`stream`, collected: the GenerationResult; `on_text(str)` sees each piece of text."""
        for event in self.stream(prompt, max_tokens, stop=stop, cache=cache, result=result, logprobs=logprobs,
                                 echo=echo, **sampling):
            if event.text and on_text is not None:
                on_text(event.text)
        return event.result

    def score(self, text: str | list, continuation: str | list | None = None, *, top_logprobs: int = 1) -> Score:
        """Each token's log-probability given the ones before it, for `text` (text or ids), or for
        `continuation` after the context `text` (`Score.logprob`: its log-likelihood; `is_greedy`).
        Text is encoded as `encode` does; a continuation without special tokens (no second BOS)."""
        context = self._prompt_ids(text, "the text")
        if continuation is None:
            more = []
        else:
            more = (self._tokenizer().encode(continuation, add_special_tokens=False)
                    if isinstance(continuation, str) else as_token_ids(continuation, "the continuation"))
        ids = check_prompt(self.model, context + more, 0)
        if len(ids) > self.model.max_positions:
            raise PymlError(f"the text is {len(ids)} tokens, longer than the model's context window of "
                            f"{self.model.max_positions}")
        top = max(1, check_top(top_logprobs))  # at least the likeliest: is_greedy reads it
        self._before_forward(len(ids))
        logprobs, _ = prompt_logprobs(self.model, ids, self.new_cache(len(ids)), top)
        return Score(ids, logprobs, len(context) if more else 0)

    def stream_batch(self, prompts: list, max_tokens: int = 64, *, batch: int | None = None, stop=(),
                     ctx_size: int | None = None, options: list | None = None,
                     speculative: SpeculativeConfig | None = None, **sampling) -> Iterator[tuple[int, StreamEvent]]:
        """Generate from many prompts at once (text, or token ids each), `batch` sequences a step
        (default: all of them, at most 16), a prompt joining as another ends: (prompt index, event)
        as text becomes final, each prompt's last event with its `result`. Options as `stream`'s,
        for every prompt, or per prompt in `options` (a dict each: max_tokens, stop and sampling
        fields that replace the shared ones, and `json_schema` or `grammar` as `stream`'s); with a
        `seed`, prompt i samples from seed + i. `speculative`: prompt lookup (a SpeculativeConfig without
        a draft model) drafting for every sequence, verified in one batched step (BatchGenerator).
        Every prompt and option is checked before the first step."""
        if not prompts:
            return iter(())
        if any("speculative" in o for o in options or ()):
            raise UnsupportedError("speculative decoding is one setting for the whole batch (stream_batch's "
                                   "`speculative`), not a per-prompt option")
        if options is not None and len(options) != len(prompts):
            raise PymlError(f"{len(options)} option sets for {len(prompts)} prompts")
        ids = [self._prompt_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        asks = [{"max_tokens": max_tokens, "stop": stop, **sampling, **(options[i] if options else {})}
                for i in range(len(ids))]
        longest = max(len(i) + a["max_tokens"] for i, a in zip(ids, asks))
        eos = self.tokenizer.eos_ids if self.tokenizer is not None else ()
        slots = min(len(ids), BATCH_DEFAULT if batch is None else batch)  # no slot that no prompt could fill
        self._before_forward(max(len(i) for i in ids))
        if slots > 1:
            self.warm_batch(slots)
        max_len = ctx_size if ctx_size is not None else min(longest, self.model.max_positions)
        gen = BatchGenerator(self.model, slots, max_len, speculative=speculative)
        requests, stops = [], []
        for i, (prompt, ask) in enumerate(zip(ids, asks)):
            shape = {k: ask.get(k) for k in ("json_schema", "grammar")}
            constraint = Constraint.from_options(self._tokenizer(), **shape) if any(
                v is not None for v in shape.values()) else None
            config = SamplingConfig(**{k: v for k, v in ask.items() if k not in ("max_tokens", "stop", *shape)})
            if config.seed is not None and options is None:
                config = dataclasses.replace(config, seed=config.seed + i)
            stops.append(StopStrings(ask["stop"]))
            requests.append(gen.submit(prompt, ask["max_tokens"], config, stop_ids=eos, constraint=constraint))
        return self._batch_events(gen, requests, eos, stops)

    def _batch_events(self, gen: BatchGenerator, requests: list, eos, stops: list):
        outs = {id(r): TextOut(self.tokenizer, r.result, eos, s) for r, s in zip(requests, stops)}
        ended = set()

        def end(r):  # its last text and its result
            out = outs[id(r)]
            if not out.stopped:
                text = out.end()
                if text:
                    yield r.index, StreamEvent(text)
            out.close()
            ended.add(id(r))
            yield r.index, StreamEvent("", r.result)

        try:
            for r in [r for r in requests if r.done]:  # max_tokens 0: ended before a step
                yield from end(r)
            while gen.busy:
                running = list(gen.running)
                chosen = gen.step()
                last = {id(r): i for i, (r, _) in enumerate(chosen)}  # a speculative step chooses several
                for i, (r, token) in enumerate(chosen):
                    if id(r) in ended:  # tokens a speculative step chose past its stop string
                        continue
                    out = outs[id(r)]
                    text = out.push(token)
                    if text:
                        yield r.index, StreamEvent(text)
                    if out.stopped:
                        r.cancel()  # its slot is freed at the next step; the reason stays "stop"
                    if out.stopped or (r.done and last[id(r)] == i):
                        yield from end(r)
                # a sequence whose cache filled left at the step's start, choosing nothing ("context")
                for r in running:
                    if r.done and id(r) not in ended:
                        yield from end(r)
        finally:
            for r in requests:
                r.cancel()
            gen.step()  # the cancelled leave: nothing is left running

    def generate_batch(self, prompts: list, max_tokens: int = 64, *, batch: int | None = None, stop=(),
                       ctx_size: int | None = None, options: list | None = None,
                       speculative: SpeculativeConfig | None = None, **sampling) -> list[GenerationResult]:
        """`stream_batch`, collected: a GenerationResult per prompt, in the prompts' order."""
        results = [None] * len(prompts)
        for index, event in self.stream_batch(prompts, max_tokens, batch=batch, stop=stop, ctx_size=ctx_size,
                                               options=options, speculative=speculative, **sampling):
            if event.result is not None:
                results[index] = event.result
        return results

    def chat(self, messages: list, max_tokens: int = 256, *, stream: bool = False, **options):
        """Answer a conversation: `generate` (or, with stream=True, `stream`) on its chat-template prompt."""
        run = self.stream if stream else self.generate
        return run(self.chat_prompt(messages), max_tokens, **options)

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise PymlError(f"{self.source}: no tokenizer found beside the model")
        return self.tokenizer


def as_token_ids(seq, what: str) -> list[int]:
    """A sequence of token ids as a list of ints, or PymlError naming `what` when it is not one."""
    try:
        return [operator.index(t) for t in seq]
    except TypeError:
        raise PymlError(f"{what} must be text or a sequence of token ids (integers), got "
                        f"{type(seq).__name__}") from None


class TextOut:
    """The text of one generation as its tokens come: decoded a token at a time, held back where
    it could be the start of a stop string, ended by one (stop reason "stop"); the end token ends
    the text without being part of it. `result.text` is what was shown, once closed."""

    def __init__(self, tokenizer, result: GenerationResult, eos, stops: StopStrings):
        self.decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self.result, self.eos, self.stops, self.shown, self.stopped = result, eos, stops, [], False

    def push(self, token: int) -> str:
        if self.decoder is None or token in self.eos:
            return ""
        text = self.stops.push(self.decoder.push(token))
        self.shown.append(text)
        if self.stops.hit:
            self.result.stop_reason, self.stopped = "stop", True
        return text

    def end(self) -> str:
        """What was held back, once the tokens have ended without a stop string."""
        text = self.stops.push(self.decoder.flush()) + self.stops.flush() if self.decoder is not None else ""
        self.shown.append(text)
        return text

    def close(self) -> None:
        self.result.text = "".join(self.shown)


class Built(NamedTuple):
    """What a model file holds, built: the model, its tokenizer (or None), where it came from."""
    model: DecoderModel
    tokenizer: Tokenizer | None
    source: str
    chat_template: str | None


def _architecture(table: dict, name, where: str, what: str):
    """(config class, model class) for an architecture name, or one clear error."""
    if name not in table:
        raise UnsupportedError(f"{where}: {what} {name!r} is not supported (supported: {', '.join(sorted(table))})")
    return table[name]


def build_safetensors(directory: Path) -> Built:
    """The model of a Hugging Face directory (config.json, *.safetensors, tokenizer.json)."""
    directory = Path(directory)
    cfg = read_config(directory)
    where = str(directory / "config.json")
    config_cls, model_cls = _architecture(HF_ARCHITECTURES, cfg.get("model_type"), where, "model_type")
    try:  # a config.json of the right keys but absurd values (strings, zero heads) is bad input too
        config = config_cls.from_hf(cfg, source=where)
    except (ValueError, TypeError, ZeroDivisionError, KeyError) as e:
        raise ModelFormatError(f"{where}: {type(e).__name__}: {e}") from None
    store = load_tensors(directory)
    model = model_cls(config, store)
    store.check_all_used(model_cls.known_unused)  # nothing in the file is silently ignored
    tokenizer = Tokenizer.from_file(directory / "tokenizer.json") if (directory / "tokenizer.json").is_file() else None
    return Built(model, tokenizer, str(directory), getattr(tokenizer, "chat_template", None))


def build_gguf(path: Path, with_tokenizer: bool = True) -> Built:
    """The model (and tokenizer) a GGUF file describes."""
    f = GGUFFile(path)
    arch = f.require("general.architecture")
    config_cls, model_cls = _architecture(GGUF_ARCHITECTURES, arch, str(path), "architecture")
    check_hyperparameters(f, arch)
    try:
        config = config_cls.from_gguf(f, arch)
        head_dim = getattr(config, "head_dim", 2)
        if head_dim % 2:  # RoPE rotates pairs of values: an odd head would be read one past its end
            raise ModelFormatError(f"{path}: head dimension {head_dim} is odd (RoPE needs pairs)")
        store = f.store(model_cls.gguf_name)
        model = model_cls(config, store, rope_style=model_cls.gguf_rope_style)
        store.check_all_used(model_cls.known_unused)  # nothing in the file is silently ignored
    except ModelFormatError as e:  # a config's own check (n_heads vs n_kv_heads, ...): name the file
        if str(path) in str(e):
            raise
        raise ModelFormatError(f"{path}: {e}") from None
    except (ValueError, TypeError, ZeroDivisionError, OverflowError, KeyError, IndexError) as e:
        # metadata that passed the checks above but still cannot describe a model
        raise ModelFormatError(f"{path}: the metadata does not describe a valid {arch} model "
                               f"({type(e).__name__}: {e})") from None
    if not with_tokenizer:
        return Built(model, None, str(path), None)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(f.metadata, source=str(path))
    except ModelFormatError:
        raise
    except (KeyError, ValueError, TypeError) as e:
        raise ModelFormatError(f"{path}: cannot build the tokenizer from its metadata ({e})") from None
    if tokenizer.vocab_size > config.vocab_size:  # a prompt could then index past the embedding
        raise ModelFormatError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model's "
                               f"embedding only {config.vocab_size} rows")
    return Built(model, tokenizer, str(path), f.get("tokenizer.chat_template"))


def build_packed(build, source: Path, lm_head_quant: str | None = None, float_compute: str = "f32") -> Built:
    """`build()`, its head re-stored (--lm-head-quant) and its weights packed (bf16 blocks of float
    weights as `float_compute` says), every load-time copy taken from the packed-weights cache or
    written into it (loaders/packed_cache.py)."""
    files = packed_cache.model_files(source)
    options = f"lm_head_quant={str(lm_head_quant).lower()}" if lm_head_quant else ""
    for attempt in (1, 2):
        provider = packed_cache.open_for(files, options, reuse=attempt == 1)
        try:
            with derived.using(provider):
                built = build()
                if lm_head_quant:
                    quantize_head(built.model, lm_head_quant)
                built.model.pack_weights(float_compute)
        except packed_cache.Stale as e:  # the file holds other arrays than this model asks for (a Reader:
            _perf.logger.warning("packed-weights cache %s: %s; rebuilding it", provider.path, e)
            continue  # attempt 1 only: the second writes a new file or packs in memory, never reads)
        except BaseException:
            if isinstance(provider, packed_cache.Writer):
                provider.abort()
            raise
        break
    if isinstance(provider, packed_cache.Writer):
        provider.commit()
    _perf.logger.debug("packed weights: %s %s", type(provider).__name__.lower(), getattr(provider, "path", "memory"))
    return built


def check_head_quant(kind: str, type_name: str, row_len: int) -> QuantType:
    """--lm-head-quant `kind` for a head stored as `type_name` (F32, Q8_0, ...) with rows of
    `row_len` values: the type to store it as, or a PymlError saying why not (pyml-report asks
    this before it suggests the option)."""
    qtype = HEAD_TYPES.get(str(kind).lower())
    if qtype is None:
        raise PymlError(f"--lm-head-quant {kind!r}: use one of {', '.join(HEAD_TYPES)}")
    stored = QuantType.__members__.get(str(type_name).upper())
    if stored not in quant.FLOAT_TYPES:
        raise PymlError(f"--lm-head-quant {kind}: the output head is already stored as {type_name}; "
                        f"the option re-stores float (F32/F16/BF16) heads only")
    block = quant.traits_of(qtype).block_size
    if row_len % block:
        raise PymlError(f"--lm-head-quant {kind}: the head's rows have {row_len} values, "
                        f"not a multiple of the {qtype.name} block of {block}")
    return qtype


def quantize_head(model: DecoderModel, kind: str) -> None:
    """--lm-head-quant: store a float output head as Q8_0 / Q4_0 blocks at load.

    The head is the one matrix read whole on every decode step whatever the prompt: Gemma 3's
    [262144 x 1152] is 1.21 GB in F32, 604 MB in BF16, 321 MB in Q8_0, 170 MB in Q4_0; decode is
    bound by the bytes it reads. The embedding keeps its own float weight even when the head is
    tied to it: a lookup reads one row, and quantizing it would only add error."""
    head = model.lm_head
    w = head.weight
    qtype = check_head_quant(kind, w.type_name, w.shape[1])
    with _perf.debug("head::quantize", "{} {}->{}", list(w.shape), w.type_name, qtype.name,
                     module=head.name, op="quantize"):
        model.lm_head = head.requantize(qtype)
    before, after = w.nbytes, model.lm_head.weight.nbytes
    _perf.logger.debug("lm_head: %s -> %s at load: %s -> %s bytes read per decode step (%.1f MB saved)",
                       w.type_name, qtype.name, f"{before:,}", f"{after:,}", (before - after) / 1e6)


def check_float_compute(mode: str) -> str:
    """load_model's float_compute, checked; bf16 asked of a CPU without it is said in one warning line
    (the ISA path names what is missing) and runs as f32."""
    mode = str(mode).lower()
    if mode not in quant.FLOAT_COMPUTE:
        raise PymlError(f"float compute {mode!r}: use one of {', '.join(quant.FLOAT_COMPUTE)}")
    if mode == "bf16" and not quant.BF16_AVAILABLE:
        _perf.logger.warning("--float-compute bf16 is unavailable on ISA path %s (it needs avx512_bf16); "
                             "float weights compute in f32", isa.ISA)
    return mode


def guess_format(source: str) -> str:
    """"safetensors" or "gguf" for a model named by a path, a known name or a hub id: a directory,
    a Hugging Face alias (gpt2) or an owner/name id that is no file means safetensors; a file, a
    known GGUF name or anything else, GGUF (whose error then lists the known names)."""
    path = Path(source).expanduser()
    if str(source).startswith("hf:"):  # a GGUF in a hub repo (hub.resolve_gguf)
        return "gguf"
    if path.is_dir() or str(source).lower() in hub.HF_ALIASES:
        return "safetensors"
    repo_like = "/" in str(source) and not str(source).startswith((".", "/", "~"))
    if repo_like and not path.exists() and not str(source).lower().endswith(".gguf"):
        return "safetensors"
    return "gguf"


def load_model(source: str | None = None, *, gguf: str | None = None, safetensors: str | None = None,
               threads: int | None = None, warmup: bool = True, lm_head_quant: str | None = None,
               kv_type: str = DEFAULT_KV_TYPE, float_compute: str = "auto") -> LanguageModel:
    """Load a model: `safetensors=` a directory or hub id, `gguf=` a file (a split model: its first
    shard), a short name or `hf:ORG/REPO[:QUANT]` (docs/hub.md).

    `source` alone is guessed (`guess_format`). With none, the default model (SmolLM2-135M-Instruct).
    `kv_type`: how the KV caches of its generations are stored, f16 (default, as llama.cpp), f32
    or q8_0 (docs/performance-journal.md, "Attention and the KV cache"). `float_compute`: what float weights'
    prefill GEMMs compute in, auto (bf16 for F16/BF16 weights where the CPU has AVX-512 BF16, else
    f32), f32 or bf16 (quant.float_compute; docs/performance-journal.md, "--float-compute bf16").
    """
    float_compute = check_float_compute(float_compute)
    if source is not None:
        if gguf or safetensors:
            raise PymlError("pass the model once: source, gguf= or safetensors=")
        if guess_format(source) == "safetensors":
            safetensors = source
        else:
            gguf = source
    if gguf is None and safetensors is None:
        gguf = DEFAULT_MODEL
    runtime = RuntimeConfig(threads if threads is not None else RuntimeConfig().threads, warmup).apply()
    source = gguf or safetensors
    # one compile display for the load and its warm-up: a first run compiles in both
    with compiles.showing(Path(source).name, _compile_key(source, "load")) as compiled:
        t0 = perf.clock()
        with perf.context(phase="load"), _perf.debug("model::load", "{}", source, op="load"):
            if safetensors is not None:
                where = hub.resolve_safetensors(safetensors)
                built = build_packed(lambda: build_safetensors(where), where, lm_head_quant, float_compute)
            else:
                where = hub.resolve_gguf(gguf)
                built = build_packed(lambda: build_gguf(where), where, lm_head_quant, float_compute)
            model = built.model
            model.kv_type = check_kv_type(kv_type, model.head_dim)
        load_compile_s = compiled.seconds  # the packing kernels, on a first run
        load_s = perf.clock() - t0 - load_compile_s
        _perf.logger.debug("%s", model.describe())
        runtime.set_blas_threads(1)  # docs/performance.md, "No BLAS in a forward pass"
        # A loaded model is millions of long-lived Python objects (Gemma's 262K-token vocabulary in
        # the metadata and tokenizer): each full collection of the cyclic GC walks them all, a 78 ms
        # pause in the middle of a 25 ms decode step. Frozen, they are never walked again. The heap
        # the tokenizer's build freed goes back to the system before the warm-up pages in the weights,
        # or the two would add up in the peak (Gemma 270M: 84 MB).
        gc.collect()
        gc.freeze()
        freed = return_free_heap()
        _perf.logger.debug("load: %.1f MB of freed heap given back to the system", freed / 1e6)
        lm = LanguageModel(model, built.tokenizer, built.source, load_s, runtime, built.chat_template,
                           compile_s=load_compile_s, _prefill_cold=warmup,
                           load_options={"gguf" if safetensors is None else "safetensors": str(where),
                                         "threads": runtime.threads, "lm_head_quant": lm_head_quant,
                                         "kv_type": kv_type, "float_compute": float_compute})
        if warmup:
            # the model's own decode step warms exactly the kernels it uses (a third of quant.warmup()'s
            # 0.55 s went to types SmolLM2 never touches); the prefill's wait for a prompt that needs them
            lm.warm_up()
    return lm


def _compile_key(source: str, step: str) -> str:
    """Which kernels a compile display estimates from: the model, the step ("load", "prefill",
    "batch"), the instruction set."""
    return f"{source}|{step}|{isa.ISA}"


def _warm_forward(model: DecoderModel, prefill: bool):
    """One decode step, or a two-token prefill: pages in the weights, loads the kernels the model's
    real array kinds need, and starts every thread, before anything is measured."""
    cache = model.new_cache(2)
    model.forward([0, 0] if prefill else [0], cache)
