"""DecoderModel: embed, run the blocks, normalise, project to the vocabulary.

Architectures differ in their embedding (GPT-2 adds learned positions, Gemma
scales by sqrt(d)), their blocks and their head; the forward pass and its
`[perf] model::forward` breakdown are the same for all of them.
"""

from __future__ import annotations

import numpy as np

from collections import Counter
from dataclasses import dataclass

from pyml import quant
from pyml.core import perf, runtime
from pyml.core.errors import ModelFormatError
from pyml.nn import KVCache
from pyml.nn.batch import Batch, claim_rows, sequence_rows
from pyml.nn.fused import FusedStep
from pyml.nn.kv_cache import DEFAULT_KV_TYPE, KVPool
from pyml.quant.interleaved_rows import ROWS_MAX

_perf = perf.get("pyml.nlp.model")


@dataclass(frozen=True)
class DecoderConfig:
    """The sizes every decoder-only config has; architectures add their own fields after these."""
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ModelFormatError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")


def prompt_pieces(T: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of the passes that cut a prompt of T tokens into pieces of at most `size`
    (> 2), none of one token: a pass of one token is a decode step, whose attention is f32 where a
    prefill's is bf16 (float_compute), so the last token's numbers would depend on where the cuts fell."""
    cuts = list(range(0, T, size)) + [T]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] == 1 and size > 2:
        cuts[-2] -= 1  # the last two pieces: size - 1 and 2
    return list(zip(cuts, cuts[1:]))


class DecoderModel:
    """Subclasses set: config, embed_tokens (Embedding), blocks, final_norm, lm_head (Linear),
    n_kv_heads, head_dim, max_positions; and may override `embed`."""

    arch = "decoder"
    logit_softcap: float | None = None
    # Positions per forward pass of a long prompt. Its activations ([T, width] float32 each: the
    # gate/up output alone is 48 MiB for SmolLM2 at 4096 tokens) are what a one-pass prefill held
    # beyond the weights and the cache; 512 keeps the GEMMs' tiles full (llama.cpp's default ubatch).
    ubatch: int = 512
    # tensors a file may hold that the model does not read: name regex -> why that is safe
    known_unused: dict = {}
    kv_type: str = DEFAULT_KV_TYPE  # the stored type of the caches new_cache makes (load_model's kv_type=)
    float_compute: str = "f32"  # what pack_weights was asked for (load_model's float_compute=)

    def embed(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:  # [T], their positions -> [T, d]
        return self.embed_tokens(tokens)

    def new_cache(self, max_len: int | None = None, kv_type: str | None = None) -> KVCache:
        """A KV cache for `max_len` positions (default: the whole context window), stored as
        `kv_type` (f32, f16, q8_0; default the model's kv_type); sliding-window layers get a ring."""
        n = self.max_positions if max_len is None else min(max_len, self.max_positions)
        return KVCache(len(self.blocks), self.n_kv_heads, self.head_dim, n, kv_type or self.kv_type,
                       windows=[block.attn.window for block in self.blocks])

    def forward(self, tokens, cache: KVCache, pos: int | None = None, all_logits: bool = False,
                head: bool = True) -> np.ndarray | None:
        """Logits for the last position [vocab] (or every position [T, vocab] with `all_logits`).

        Tokens are written to `cache` at positions pos .. pos+T-1 (default: after
        what the cache holds). `head=False` only fills the cache and returns None.
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        pos = cache.length if pos is None else pos
        T = tokens.shape[0]
        if T > self.ubatch:  # a long prompt in micro-batches, as llama.cpp's ubatch
            # the head (Gemma 3: 262144 x 640) only after the last one unless every position's logits are asked for
            parts = [self.forward(tokens[a:z], cache, pos + a, all_logits, head and (all_logits or z == T))
                     for a, z in prompt_pieces(T, self.ubatch)]
            return np.concatenate(parts) if all_logits else parts[-1]
        with runtime.kernel_lock(), \
                _perf.debug("model::forward", "tokens={} pos={}", T, pos, op="model", module="model") as span:
            with span.part("embedding"):
                x = self.embed(tokens, np.arange(pos, pos + T))
            with span.part("layers"):
                # a decode step, or a verify pass's rows as decode steps (quant.every_row_decodes(), the
                # attention's test too: a prompt of T tokens is never taken for one): compiled
                step = self._fused_step() if T == 1 or (T <= ROWS_MAX and quant.every_row_decodes()) else None
                if step is not None and T == 1:  # one call per run of like blocks
                    x = step(x, pos, cache)
                else:
                    y = step.rows(x, *sequence_rows(cache, pos, T)) if step is not None else None
                    if y is not None:
                        x = y
                    else:
                        for block in self.blocks:
                            x = block(x, pos, cache)
            if not head:
                cache.length = pos + T
                return None
            logits = self._head(x if all_logits else x[-1:], span)
        cache.length = pos + T
        return logits if all_logits else logits[0]

    def new_pool(self, n_seqs: int, max_len: int | None = None, kv_type: str | None = None) -> KVPool:
        """The KV caches of up to `n_seqs` sequences decoded together (forward_batch), each of
        `max_len` positions (default: the context window), committed to memory as they fill."""
        n = self.max_positions if max_len is None else min(max_len, self.max_positions)
        return KVPool(n_seqs, len(self.blocks), self.n_kv_heads, self.head_dim, n, kv_type or self.kv_type,
                      windows=[block.attn.window for block in self.blocks])

    def forward_batch(self, pool: KVPool, rows: list, all_logits: bool = False) -> np.ndarray | list:
        """Next-token logits [len(rows), vocab] of several sequences in one pass: rows are (sequence
        of `pool`, token ids, position of the first), each sequence at most once; one-token rows
        (decode) and longer ones (a prompt or a chunk of one) may be mixed. The projections run
        over all the rows at once; each sequence attends to its own cache (nn/batch.py).
        With `all_logits`, a list: each row's logits of every one of its tokens [len(tokens), vocab]."""
        batch = Batch(pool, rows)
        if len(batch.segments) == 1:  # one sequence: its own pass (a decode step's fused path)
            seq, tokens, pos = rows[0]
            logits = self.forward(tokens, pool.sequence(seq), pos, all_logits)
            return [logits] if all_logits else logits[None]
        n_layers = len(self.blocks)
        # the decode rows (first in the pass) get their GEMV's bits, the prompts' rows the GEMM's: the
        # bits each sequence gets alone (quant.decode_rows)
        with runtime.kernel_lock(), quant.decode_rows(batch.n_decode), \
                _perf.debug("model::forward", "tokens={} batch={}", len(batch), len(batch.segments), op="model",
                            module="model") as span:
            for seq, end in zip(batch.decode_seqs.tolist(), batch.decode_ends.tolist()):
                pool.sequence(seq).claim_layers(range(n_layers), end - 1)  # prefill rows claim as they write
            with span.part("embedding"):
                x = self.embed(batch.tokens, batch.positions)
            with span.part("layers"):
                step = self._fused_step() if batch.n_decode == len(batch) <= ROWS_MAX else None
                y = step.rows(x, pool, batch.decode_seqs, batch.decode_ends) if step is not None else None
                if y is not None:
                    x = y
                else:
                    for block in self.blocks:
                        x = block(x, None, batch)
            with quant.decode_rows(batch.n_decode if all_logits else True):  # a row per sequence: its GEMV alone
                logits = self._head(x if all_logits else x[batch.last_rows], span)
        for seq, pos, n in batch.segments:
            pool.sequence(seq).length = pos + n
        if all_logits:  # the pass's rows are the segments' tokens in turn, in batch.order's order
            parts = np.split(logits, batch.last_rows[:-1] + 1)
            out = [None] * len(rows)
            for place, i in enumerate(batch.order):
                out[i] = parts[place]
            return out
        if batch.in_order:  # a decode step's rows: already in the order given
            return logits
        out = np.empty_like(logits)
        out[batch.order] = logits  # back in the order the rows were given
        return out

    def verify_batch(self, pool: KVPool, rows: list) -> list | None:
        """Speculative verify passes of several sequences in one compiled batched step: rows are
        (sequence of `pool`, token ids, position of the first), each token a decode row - it attends
        up to its own position and its products get its GEMV's bits, as a decode step of it alone
        (FusedStep.rows). Returns each row's logits [len(tokens), vocab], in order; None, with
        nothing written, where the compiled step cannot take the pass (more than ROWS_MAX tokens,
        a block off the fused path, spans on): then decode without drafts."""
        tokens = np.concatenate([np.asarray(t, np.int64).reshape(-1) for _, t, _ in rows])
        step = self._fused_step() if len(tokens) <= ROWS_MAX else None
        if step is None or not step.takes_rows():
            return None
        positions = np.concatenate([np.arange(pos, pos + len(t)) for _, t, pos in rows])
        seqs = np.concatenate([np.full(len(t), seq, np.int64) for seq, t, _ in rows])
        with runtime.kernel_lock(), quant.decode_rows(), \
                _perf.debug("model::forward", "tokens={} verify={}", len(tokens), len(rows), op="model",
                            module="model") as span:
            for seq, t, pos in rows:
                claim_rows(pool.sequence(seq), pos, len(t))
            with span.part("embedding"):
                x = self.embed(tokens, positions)
            with span.part("layers"):
                x = step.rows(x, pool, seqs, positions + 1)
            logits = self._head(x, span)
        for seq, t, pos in rows:
            pool.sequence(seq).length = pos + len(t)
        return np.split(logits, np.cumsum([len(t) for _, t, _ in rows])[:-1])

    def warm_batch(self, rows: int) -> None:
        """Runs each kind of pass a batch takes once, through a pool of its own: a prompt's rows beside
        a decode row (the layers one by one), a decode step of `rows` rows and one of two (with
        fused.ROWS_REGION_MIN rows: the rows region and decode_rows). Their kernels load here, not in
        a generation's first steps (SmolLM2: 0.3 s and 33 ms in a process's first 16-row and 4-row
        steps)."""
        rows = max(rows, 2)
        pool = self.new_pool(rows, 4)
        self.forward_batch(pool, [(0, [0, 0], 0), (1, [0], 0)])
        self.forward_batch(pool, [(0, [0], 2), (1, [0], 1)] + [(s, [0], 0) for s in range(2, rows)])
        if rows > 2:
            self.forward_batch(pool, [(0, [0], 3), (1, [0], 2)])

    def _head(self, x: np.ndarray, span) -> np.ndarray:
        """Logits of the rows x: the final norm, the head, Gemma's logit softcap (parts of `span`)."""
        with span.part("norm"):
            x = self.final_norm(x)
        with span.part("projection"):
            logits = self.lm_head(x)
            if self.logit_softcap:
                logits = np.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def _fused_step(self):
        """The blocks' FusedStep, made on the first decode step (after load has packed the weights);
        None when a block is not one the fused kernels implement."""
        step = self.__dict__.get("_step")
        if step is None:
            fused = [block.fused() for block in self.blocks]
            ordered = all(block.index == i for i, block in enumerate(self.blocks))
            step = FusedStep(self.blocks, fused) if ordered and all(f is not None for f in fused) else False
            self._step = step
        return step or None

    def linears(self) -> list:
        """Every Linear of a forward pass: the blocks' projections, then the head."""
        return [lin for b in self.blocks for lin in b.linears()] + [self.lm_head]

    def pack_weights(self, float_compute: str = "f32") -> int:
        """Re-lay the weights of every Linear that has a faster layout (Linear.pack); returns how many.
        The head gets no bf16 blocks (`float_compute`): a generation runs it on the last token only.
        The prefill's attention computes as quant.attention_compute(float_compute) says."""
        self.float_compute = float_compute
        attention = quant.attention_compute(float_compute, {lin.weight.qtype for lin in self.linears()[:-1]})
        for b in self.blocks:
            b.attn.prefill_bf16 = attention == "bf16"
        return sum(lin.pack(float_compute) for b in self.blocks for lin in b.linears()) + self.lm_head.pack()

    def describe(self) -> str:
        """One line for the debug log: architecture, sizes and weight storage."""
        linears = self.linears()
        types = Counter(lin.weight.type_name for lin in linears)
        fusions = sum(1 for lin in linears if lin.name.endswith(("qkv_proj", "gate_up_proj")))
        packed = sum(1 for lin in linears if isinstance(lin.weight.data, quant.Packed))
        bf16 = sum(1 for lin in linears if lin.prefill_weight is not None)
        return (f"{self.arch}: layers={len(self.blocks)} linears={len(linears)} "
                f"types={dict(types)} fusions={fusions} packed_x8={packed} "
                f"float_compute={self.float_compute} prefill_bf16={bf16} "
                f"attention={'bf16' if any(b.attn.prefill_bf16 for b in self.blocks) else 'f32'}")

