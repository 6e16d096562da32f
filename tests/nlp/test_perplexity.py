"""Perplexity and KL divergence (pyml/nlp/perplexity.py, kl_divergence.py) against independent oracles:
transformers computing llama-perplexity's chunked perplexity on the same GGUF file, hand-checked
statistics, and the full-vocabulary KL divergence that the top-K base file approximates."""

import io
import math
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pyml.cli.pyml_quantize import requantized as requantized_file
from pyml.core.errors import PymlError
from pyml.nlp import kl_divergence as kld
from pyml.nlp import perplexity as ppl
from pyml.nlp.api import load_model
from pyml.nlp.logprobs import log_softmax
from tests.conftest import hf_gguf_model

# A long English text every CPython install carries (its history and licences): ~3,800 SmolLM2 tokens.
TEXT_FILE = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "LICENSE.txt"


@pytest.fixture(scope="module")
def text():
    if not TEXT_FILE.exists():  # a Python built without its LICENSE.txt: any long English text does
        return "\n".join(p.read_text() for p in sorted((Path(__file__).parents[2] / "docs").glob("*.md")))
    return TEXT_FILE.read_text()


# Every model here loads without load_model's warm-up, as pyml-perplexity does: perplexity runs prompts'
# passes only, and the warm-up is a decode step (a kernel to compile that nothing here uses).
@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(gguf=str(smollm2_gguf), warmup=False)


def oracle_ppl(hf, chunks: np.ndarray, bos: int | None) -> float:
    """llama-perplexity's method written out over transformers' logits of each whole chunk."""
    import torch
    nll = []
    n_ctx = chunks.shape[1]
    first = n_ctx // 2
    for chunk in chunks:
        inputs = chunk.copy()
        if bos is not None:
            inputs[0] = bos
        with torch.no_grad():
            logits = hf(torch.tensor(inputs[None])).logits[0].double()
        logp = torch.log_softmax(logits[first:n_ctx - 1], dim=-1)
        nll += (-logp[torch.arange(n_ctx - 1 - first), torch.tensor(chunk[first + 1:])]).tolist()
    return math.exp(np.mean(nll))


def test_the_uncertainty_is_llama_perplexitys():
    # nll 1, 2, 3: mean 2, mean of squares 14/3, variance 2/3; error e^2 * sqrt((2/3) / (3 - 1))
    est = ppl.estimate(np.array([1.0, 2.0, 3.0]))
    assert est.ppl == pytest.approx(math.e ** 2) and est.err == pytest.approx(math.e ** 2 * math.sqrt(1 / 3))
    assert est.final_line() == f"Final estimate: PPL = {math.e ** 2:.4f} +/- {math.e ** 2 * math.sqrt(1 / 3):.5f}"


def test_chunks_are_cut_as_llama_perplexity_cuts_them():
    tokens = np.arange(11)
    assert ppl.chunk_tokens(tokens, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the tail of 3 is dropped
    assert ppl.chunk_tokens(tokens, 4, n_chunks=1).tolist() == [[0, 1, 2, 3]]
    with pytest.raises(PymlError, match="needs at least 12"):
        ppl.chunk_tokens(tokens, 6)
    assert ppl.chunk_inputs(np.array([7, 8, 9]), 1).tolist() == [1, 8, 9]


def test_smollm2_matches_transformers(requantized, text):
    """On float weights (SmolLM2's Q4_1 file dequantized to F32 by pyml-quantize), where transformers
    computes what pyml does; a quantized file's own figure is llama.cpp's to check (its activations
    are int8 too: the peer test), transformers' differs by ~1% there (13.08 vs 12.94 on Q4_1)."""
    path = requantized("f32")
    lm = load_model(gguf=str(path), warmup=False)
    result = ppl.perplexity(lm, text, n_ctx=128, n_chunks=2)
    assert result.n_chunks == 2 and result.estimate.count == 2 * 63
    chunks = ppl.chunk_tokens(ppl.text_tokens(lm, text), 128, 2)
    assert not lm.tokenizer.add_bos  # SmolLM2 adds no BOS: the chunks are the text's tokens
    ref = oracle_ppl(hf_gguf_model(path), chunks, None)
    assert result.estimate.ppl == pytest.approx(ref, rel=5e-3)


def test_gemma3_matches_transformers_with_bos(gemma3_gguf, text):
    """Gemma 3 270M's Q4_K_M file rewritten as F16 (float weights, computed in f32), with its BOS."""
    path = requantized_file(gemma3_gguf, "f16")
    lm = load_model(gguf=str(path), float_compute="f32", warmup=False)
    tokens = ppl.text_tokens(lm, text)
    assert lm.tokenizer.add_bos and tokens[0] == lm.tokenizer.bos_id  # as llama.cpp's common_tokenize adds it
    result = ppl.perplexity(lm, text, n_ctx=64, n_chunks=2)
    ref = oracle_ppl(hf_gguf_model(path), ppl.chunk_tokens(tokens, 64, 2), lm.tokenizer.bos_id)
    assert result.estimate.ppl == pytest.approx(ref, rel=5e-3)


def test_several_chunks_a_pass_score_as_one_at_a_time(smollm2, text):
    one = ppl.perplexity(smollm2, text, n_ctx=64, n_chunks=3)
    batched = ppl.perplexity(smollm2, text, n_ctx=64, n_chunks=3, seqs=2)
    np.testing.assert_allclose(batched.nll, one.nll, atol=2e-3)
    assert [round(e.ppl, 2) for e in batched.running] == [round(e.ppl, 2) for e in one.running]


def test_top_k_kld_is_low_by_the_rests_own_divergence():
    """The bound of kl_divergence.py's docstring, checked with its terms computed directly."""
    rng = np.random.default_rng(0)
    lp = log_softmax(rng.standard_normal((6, 300)) * 3)
    lq = log_softmax(np.log(np.exp(lp) + 0.01 * rng.random((6, 300))))
    exact = (np.exp(lp) * (lp - lq)).sum(-1)
    ids, vals, rest = kld.top_k(lp, 20)
    est = kld.kld_rows(lq, ids, vals, rest)
    p, q = np.exp(lp), np.exp(lq)
    for r in range(6):
        tail = np.setdiff1d(np.arange(300), ids[r])
        assert set(ids[r]) == set(np.argsort(-lp[r])[:20])
        rp, rq = p[r, tail].sum(), q[r, tail].sum()
        assert math.exp(rest[r]) == pytest.approx(rp, rel=1e-12)
        pt, qt = p[r, tail] / rp, q[r, tail] / rq
        assert exact[r] - est[r] == pytest.approx(rp * (pt * np.log(pt / qt)).sum(), rel=1e-9, abs=1e-15)
        assert est[r] <= exact[r] + 1e-15
    ids, vals, rest = kld.top_k(lp, 300)  # every token kept: exact
    np.testing.assert_allclose(kld.kld_rows(lq, ids, vals, rest), exact, rtol=1e-12)


def test_kl_divergence_against_the_full_logits(smollm2, requantized, text, tmp_path):
    """Base SmolLM2 Q4_1, compared Q8_0: the statistics from the top-K file against the ones computed
    from both models' full distributions at the same positions. Two chunks (62 positions, 4 of them
    with another top token): the top-K mean is 0.65% under the exact one, as over three chunks
    (0.66%), inside the 2% bound."""
    q8 = load_model(gguf=str(requantized("q8_0")), warmup=False)
    full = {}
    for name, lm in (("base", smollm2), ("q", q8)):
        rows = []
        ppl.perplexity(lm, text, 64, 2, on_rows=lambda c, logits, t: rows.append((c, log_softmax(logits), t)))
        full[name] = rows
    lp = np.concatenate([r[1] for r in full["base"]])
    lq = np.concatenate([r[1] for r in full["q"]])
    targets = np.concatenate([r[2] for r in full["base"]])
    exact = (np.exp(lp) * (lp - lq)).sum(-1)

    path = tmp_path / "base.npz"
    kld.save_base(smollm2, text, 64, 2, path)
    result = kld.kl_divergence(q8, kld.Base.load(path))
    at = np.arange(len(targets))
    assert result.kld.mean() == pytest.approx(exact.mean(), rel=2e-2) and (result.kld <= exact + 1e-9).all()
    np.testing.assert_allclose(result.nll, -lq[at, targets], rtol=1e-6)
    np.testing.assert_allclose(result.nll_base, -lp[at, targets], rtol=1e-6)
    np.testing.assert_allclose(result.p_diff, np.exp(lq[at, targets]) - np.exp(lp[at, targets]), atol=1e-6)
    assert (result.same_top == (lq.argmax(-1) == lp.argmax(-1))).all()
    stats = result.stats()
    assert stats["count"] == len(targets) and stats["kld_max"] == pytest.approx(result.kld.max())
    assert stats["same_top"] == pytest.approx((lq.argmax(-1) == lp.argmax(-1)).mean())
    assert stats["rms_dp"] == pytest.approx(math.sqrt(np.mean(result.p_diff ** 2)))
    # the base NLLs are stored as float32
    assert stats["ppl_diff"] == pytest.approx(math.exp(-lq[at, targets].mean()) - math.exp(-lp[at, targets].mean()),
                                              rel=1e-4)


def test_a_damaged_base_file_is_one_error(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(PymlError, match="not a readable KL divergence base file"):
        kld.Base.load(bad)
    with pytest.raises(PymlError, match="no such file"):
        kld.Base.load(tmp_path / "missing.npz")
    other = tmp_path / "other.npz"
    np.savez(other, x=np.zeros(3))
    with pytest.raises(PymlError, match="not a pyml-perplexity KL divergence base file"):
        kld.Base.load(other)
    # a header declaring more than its member holds is refused before numpy allocates it
    base = kld.Base(8, 50, "v", np.zeros(16, np.int32), np.zeros((6, 2), np.int32), np.zeros((6, 2), np.float32),
                    np.zeros(6, np.float32), np.zeros(6, np.float32))
    good = tmp_path / "good.npz"
    base.save(good)
    assert kld.Base.load(good).n_chunks == 2
    liar = tmp_path / "liar.npz"
    with zipfile.ZipFile(liar, "w") as zf:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10 ** 12,)})
        zf.writestr("nll.npy", header.getvalue() + b"\0" * 64)
    with pytest.raises(PymlError, match="declares more than it holds"):
        kld.Base.load(liar)


def test_forward_batch_gives_every_rows_logits_in_the_given_order(smollm2):
    """forward_batch(all_logits=True), which several chunks a pass use: each row's logits as that
    sequence's own pass gives them, rows given longest first (the pass puts one-token rows first)."""
    model = smollm2.model
    prompts = [[5, 9, 2, 77, 31, 64], [12], [8, 90, 1]]
    pool = model.new_pool(3, 16)
    got = model.forward_batch(pool, [(s, p, 0) for s, p in enumerate(prompts)], all_logits=True)
    for p, logits in zip(prompts, got):
        ref = model.forward(p, model.new_cache(16), 0, all_logits=True)
        assert logits.shape == (len(p), model.config.vocab_size)
        np.testing.assert_allclose(logits, ref, atol=2e-3 * np.abs(ref).max())
