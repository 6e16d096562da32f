"""KL divergence of a model's token distributions from a reference's, as llama-perplexity's
`--kl-divergence-base` / `--kl-divergence` report it (mean, percentiles, same top token, Δppl, RMS Δp).

The reference's side is saved per scored position as its top-K log-probabilities (ids and values),
the log of the mass left outside them, and the log-probability of the token that came (its NLL):
K x 8 bytes a position, where llama.cpp keeps every token's (2 bytes x the vocabulary: 98 KB a
position for SmolLM2, 512 KB for Gemma 3). The divergence is then computed over K + 1 outcomes,
the top K and "the rest" (Q's rest is exact: the log-sum of Q over every other token):

    KL_K = sum_{i in top} p_i log(p_i / q_i) + R_p log(R_p / R_q)

which is what the full KL(P || Q) becomes when the rest is merged into one outcome. Merging never
increases a divergence, and the difference is exactly R_p x KL(P_rest || Q_rest) of the two
distributions over the rest renormalised: 0 <= KL - KL_K <= R_p x KL(P_rest || Q_rest). With the
default K = 4096 (32 KB a position), R_p was 0.4% on average on SmolLM2 over Python's LICENSE.txt,
and the KLD 0.6% below the full-logit figure, for Q4_0 and Q8_0 alike (K = 256: R_p 4.7%, 7% low;
docs/perplexity.md). The run prints the mean R_p, the size of the bound's first factor.
llama.cpp's own file is approximate too: 16-bit log-probabilities, tokens below e^-16 dropped.
"""

from __future__ import annotations

import hashlib
import math
import zipfile
from dataclasses import dataclass

import numpy as np

from pyml.core.errors import PymlError
from pyml.nlp.logprobs import log_softmax
from pyml.nlp.perplexity import Estimate, PerplexityResult, mean_and_uncertainty, perplexity

FORMAT = "pyml-kld-base-1"
DEFAULT_TOP_K = 4096  # SmolLM2 Q4_0 and Q8_0 vs F32: KLD low by 0.6% (docs/perplexity.md)
_ARRAYS = {"tokens": np.int32, "top_ids": np.int32, "top_logp": np.float32, "log_rest": np.float32,
           "nll": np.float32}


def vocab_fingerprint(tokenizer) -> str:
    """A hash of every token's bytes: a base file is read only by a model with the same vocabulary."""
    h = hashlib.sha256()
    for i in range(tokenizer.vocab_size):
        h.update(tokenizer.token_bytes(i) + b"\0")
    return h.hexdigest()[:16]


@dataclass
class Base:
    """The reference's side: tokens [n_chunk * n_ctx] (as tokenized, BOS first), and per scored
    position (chunk after chunk) its top-K ids [N, K] / log-probs [N, K], log of the rest's mass [N]
    and NLL of the token that came [N]."""
    n_ctx: int
    vocab_size: int
    vocab: str
    tokens: np.ndarray
    top_ids: np.ndarray
    top_logp: np.ndarray
    log_rest: np.ndarray
    nll: np.ndarray

    def save(self, path) -> None:
        try:
            with open(path, "wb") as f:
                np.savez(f, format=np.array(FORMAT), n_ctx=np.int64(self.n_ctx),
                         vocab_size=np.int64(self.vocab_size), vocab=np.array(self.vocab),
                         **{name: getattr(self, name).astype(dtype) for name, dtype in _ARRAYS.items()})
        except OSError as e:
            raise PymlError(f"--kl-divergence-base {path}: {e.strerror}") from None

    @classmethod
    def load(cls, path) -> Base:
        """The file's arrays, every size checked against the file before anything is allocated, and
        every shape against the header (a file that is not one, or is damaged, is one error naming it)."""
        try:
            z = _read_npz(path)
        except FileNotFoundError:
            raise PymlError(f"--kl-divergence-base {path}: no such file") from None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
            raise PymlError(f"{path} is not a readable KL divergence base file ({e})") from None
        if str(z.get("format", "")) != FORMAT or any(k not in z for k in ("n_ctx", "vocab_size", "vocab", *_ARRAYS)):
            raise PymlError(f"{path} is not a pyml-perplexity KL divergence base file ({FORMAT})")
        base = cls(int(z["n_ctx"]), int(z["vocab_size"]), str(z["vocab"]), *(z[name] for name in _ARRAYS))
        base.check(path)
        return base

    def check(self, path) -> None:
        n_ctx, K = self.n_ctx, self.top_ids.shape[-1] if self.top_ids.ndim == 2 else -1
        per_chunk = n_ctx - 1 - n_ctx // 2
        n = len(self.tokens) // n_ctx if n_ctx >= 4 else 0
        ok = (n_ctx >= 4 and n >= 1 and len(self.tokens) == n * n_ctx and self.top_ids.ndim == 2 and K >= 1
              and self.top_ids.shape == self.top_logp.shape == (n * per_chunk, K)
              and self.log_rest.shape == self.nll.shape == (n * per_chunk,)
              and self.tokens.min() >= 0 and self.tokens.max() < self.vocab_size
              and self.top_ids.min() >= 0 and self.top_ids.max() < self.vocab_size)
        if not ok:
            raise PymlError(f"{path}: the KL divergence base file's arrays do not agree with its header (damaged?)")

    @property
    def n_chunks(self) -> int:
        return len(self.tokens) // self.n_ctx

    def check_model(self, lm, path) -> None:
        """One error if `lm` cannot be compared with this base: another vocabulary, or a context it lacks."""
        if lm.tokenizer is None:
            raise PymlError("the KL divergence needs the model's tokenizer")
        if self.vocab_size != lm.config.vocab_size or self.vocab != vocab_fingerprint(lm.tokenizer):
            raise PymlError(f"{path} was computed with another vocabulary ({self.vocab_size} tokens) than "
                            f"this model's ({lm.config.vocab_size} tokens): compare models of one tokenizer")
        if self.n_ctx > lm.model.max_positions:
            raise PymlError(f"{path} was computed with a context of {self.n_ctx}, longer than this model's "
                            f"{lm.model.max_positions} positions")


def top_k(logp: np.ndarray, k: int) -> tuple:
    """(ids [rows, k], their log-probs, log of the rest's mass [rows]), likeliest first."""
    k = min(k, logp.shape[-1])
    ids = np.argpartition(-logp, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logp, ids, axis=-1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    ids, vals = np.take_along_axis(ids, order, axis=-1), np.take_along_axis(vals, order, axis=-1)
    return ids, vals, _log_rest(logp, ids)


def _log_rest(logp: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log of the probability outside `ids`, summed over those tokens (not 1 - the top's sum, which
    cancels to nothing when the top holds nearly all of it)."""
    rest = logp.copy()
    np.put_along_axis(rest, ids, -np.inf, axis=-1)
    top = rest.max(axis=-1)
    finite = np.isfinite(top)
    out = np.full(len(logp), -np.inf)
    out[finite] = top[finite] + np.log(np.exp(rest[finite] - top[finite, None]).sum(axis=-1))
    return out


def save_base(lm, text: str | None, n_ctx: int, n_chunks: int | None, path, *, k: int = DEFAULT_TOP_K,
              seqs: int = 1, on_chunk=None, tokens=None) -> PerplexityResult:
    """Run the perplexity of the reference `lm` and save its top-K distributions to `path`."""
    if k < 1:
        raise PymlError(f"--kl-top-k must be at least 1, got {k}")
    pieces = []

    def keep(chunk, logits, targets):
        ids, vals, rest = top_k(log_softmax(logits), k)
        pieces.append((chunk, ids, vals, rest))

    result = perplexity(lm, text, n_ctx, n_chunks, tokens=tokens, seqs=seqs, on_rows=keep, on_chunk=on_chunk)
    pieces.sort(key=lambda p: p[0])  # stable: a chunk's pieces stay in order
    ids, vals, rest = (np.concatenate([p[i] for p in pieces]) for i in (1, 2, 3))
    toks = tokens if tokens is not None else lm.encode(text)
    Base(n_ctx, lm.config.vocab_size, vocab_fingerprint(lm.tokenizer),
         np.asarray(toks[:result.n_chunks * n_ctx]), ids, vals, rest, result.nll).save(path)
    return result


def kld_rows(logp_q: np.ndarray, top_ids: np.ndarray, top_logp: np.ndarray, log_rest: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row over the base's top-K and the rest merged (module docstring)."""
    lp = top_logp.astype(np.float64)
    lq = np.take_along_axis(logp_q, top_ids.astype(np.int64), axis=-1)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    rest_p = log_rest.astype(np.float64)
    has_rest = np.isfinite(rest_p)
    rest_q = _log_rest(logp_q[has_rest], top_ids[has_rest].astype(np.int64))
    kl[has_rest] += np.exp(rest_p[has_rest]) * (rest_p[has_rest] - rest_q)
    return kl


@dataclass
class KLDResult:
    """Per scored position: the KL divergence, Δp (p(token) under Q minus under the base), the two
    NLLs and whether the top token agrees."""
    ppl: PerplexityResult
    kld: np.ndarray
    p_diff: np.ndarray
    nll: np.ndarray
    nll_base: np.ndarray
    same_top: np.ndarray

    def stats(self, n: int | None = None) -> dict:
        """llama-perplexity's figures over the first `n` positions (all by default)."""
        return kl_stats(*(a[:n] for a in (self.kld, self.p_diff, self.nll, self.nll_base, self.same_top)))


def kl_divergence(lm, base: Base, *, seqs: int = 1, on_chunk=None, path="the base file") -> KLDResult:
    """Perplexity of `lm` over the base's chunks, and its divergence from the base, position by
    position; `on_chunk(i, stats)` gets kl_stats over the chunks done after each one."""
    base.check_model(lm, path)
    per_chunk = base.n_ctx - 1 - base.n_ctx // 2
    n = base.n_chunks * per_chunk
    kld, p_diff, nll, same = np.empty(n), np.empty(n), np.empty(n), np.zeros(n, bool)
    nll_base = base.nll.astype(np.float64)
    filled = np.zeros(base.n_chunks, np.int64)  # rows of each chunk done (with seqs > 1 they interleave)

    def compare(chunk, logits, targets):
        logp = log_softmax(logits)
        at = chunk * per_chunk + filled[chunk]
        rows = slice(at, at + len(logits))
        filled[chunk] += len(logits)
        kld[rows] = kld_rows(logp, base.top_ids[rows], base.top_logp[rows], base.log_rest[rows])
        token_logp = logp[np.arange(len(logp)), targets]
        nll[rows] = -token_logp
        p_diff[rows] = np.exp(token_logp) - np.exp(-nll_base[rows])
        same[rows] = logp.argmax(axis=-1) == base.top_ids[rows, 0]

    def chunk_done(i, _estimate):
        if on_chunk is not None:
            m = (i + 1) * per_chunk
            on_chunk(i, kl_stats(kld[:m], p_diff[:m], nll[:m], nll_base[:m], same[:m]))

    result = perplexity(lm, None, base.n_ctx, None, tokens=base.tokens, seqs=seqs, on_rows=compare,
                        on_chunk=chunk_done)
    return KLDResult(result, kld, p_diff, nll, nll_base, same)


def kl_stats(kld, p_diff, nll, nll_base, same_top) -> dict:
    """llama-perplexity's kl_divergence statistics (its formulas: mean_and_uncertainty, covariance)."""
    count = len(kld)
    log_ppl = mean_and_uncertainty(nll.sum(), (nll * nll).sum(), count)
    log_base = mean_and_uncertainty(nll_base.sum(), (nll_base * nll_base).sum(), count)
    cov = 0.0 if count < 10 else ((nll * nll_base).sum() / count - log_ppl[0] * log_base[0]) / (count - 1)
    ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_base[0])
    ppl_unc, base_unc = ppl * log_ppl[1], ppl_base * log_base[1]
    ratio = log_ppl[0] - log_base[0]
    ratio_unc = math.sqrt(max(0.0, log_ppl[1] ** 2 + log_base[1] ** 2 - 2 * cov))
    kl = mean_and_uncertainty(kld.sum(), (kld * kld).sum(), count)
    p2 = p_diff * p_diff
    mse = mean_and_uncertainty(p2.sum(), (p2 * p2).sum(), count)
    rms = math.sqrt(mse[0])
    top = float(same_top.mean())
    sorted_kld, sorted_dp = np.sort(kld), np.sort(p_diff)
    return dict(
        count=count, ppl=ppl, ppl_unc=ppl_unc, ppl_base=ppl_base, ppl_base_unc=base_unc,
        cor=cov / (log_ppl[1] * log_base[1]) if log_ppl[1] and log_base[1] else 0.0,
        ln_ratio=ratio, ln_ratio_unc=ratio_unc, ratio=math.exp(ratio), ratio_unc=math.exp(ratio) * ratio_unc,
        ppl_diff=ppl - ppl_base,
        ppl_diff_unc=math.sqrt(max(0.0, ppl_unc ** 2 + base_unc ** 2 - 2 * ppl * ppl_base * cov)),
        kld=kl[0], kld_unc=kl[1], kld_max=float(sorted_kld[-1]), kld_min=float(sorted_kld[0]),
        kld_median=float(np.median(kld)),
        kld_percentiles={q: percentile(sorted_kld, q / 100) for q in (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)},
        p_diff=float(p_diff.mean()), p_diff_unc=mean_and_uncertainty(p_diff.sum(), p2.sum(), count)[1],
        p_diff_max=float(sorted_dp[-1]), p_diff_min=float(sorted_dp[0]), p_diff_median=float(np.median(p_diff)),
        p_diff_percentiles={q: percentile(sorted_dp, q / 100)
                            for q in (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)},
        rms_dp=rms, rms_dp_unc=0.5 / rms * mse[1] if rms else 0.0,
        same_top=top, same_top_unc=math.sqrt(top * (1 - top) / (count - 1)) if count > 1 else 0.0)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's: linear between the two nearest of the sorted values."""
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    return float((1 - (p - i)) * sorted_values[i] + (p - i) * sorted_values[min(i + 1, len(sorted_values) - 1)])


def _read_npz(path) -> dict:
    """np.savez's arrays, each header's size checked against its member's before numpy allocates it
    (np.load allocates what a header declares, then reads): no allocation a damaged file asks for."""
    out = {}
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            name = info.filename.removesuffix(".npy")
            with zf.open(info) as f:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read_header(f, max_header_size=10000)
                if dtype.hasobject or math.prod(shape) * dtype.itemsize > info.file_size:
                    raise ValueError(f"{info.filename} declares more than it holds")
            with zf.open(info) as f:
                out[name] = np.lib.format.read_array(f, allow_pickle=False)
    return out
