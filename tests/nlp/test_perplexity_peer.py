"""pyml-perplexity against llama.cpp (the bench extra's llama-cpp-python): the same file, text and
chunks, llama.cpp's logits scored as llama-perplexity scores them; and the KL divergence of a Q4_0
file from its F32 reference against the one llama.cpp's logits give. `-m peer` runs them.

A quantized file's perplexity is compared as a mean over DRAWS copies of the file that differ by a
perturbation far below any meaningful value (perturbed_copy): both engines round every activation of a
quantized product to int8, a step function, so a one-ulp change anywhere re-draws the rounding of every
later layer. On SmolLM2 Q4_0 at -c 256 x4 llama.cpp's own perplexity moves 13.33-13.49 (sd 0.42%) and its
distributions by mean KL 4.4e-3 from its unperturbed ones - the whole of what separates it from pyml's
(docs/perplexity.md, "The noise of one figure"): one figure per engine would test that draw, not the kernels.
So the means must agree to 0.5% beyond two standard errors of their difference (the draws' own spread).
The quantized files are run twice: with pyml's activation rounding and with ggml's (--activations ggml).

On a text 8 times as long (Python's own documentation, 32 chunks) a draw spreads a third as wide, and the
file itself is compared, as llama-perplexity's user would: one figure each, no draws."""

import math
import shutil

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.nlp import kl_divergence as kld
from pyml.nlp import perplexity as ppl
from pyml.nlp.api import load_model
from pyml.nlp.logprobs import log_softmax
from tests.nlp.test_perplexity import text  # noqa: F401 (the fixture)

pytestmark = pytest.mark.peer
N_CTX, N_CHUNKS = 256, 4
DRAWS = 4  # the file and 3 perturbed copies; float files need one (their products round nothing to int8)
PERTURBED = "blk.0.attn_norm.weight"  # F32 in every llama-family and Gemma GGUF: the first op of layer 0


def llama_chunk_logp(path, tokens_of, n_ctx: int, n_chunks: int, targets_only: bool = False):
    """(the text's tokens by llama.cpp's tokenizer, log-probabilities [n_chunks * scored, vocab] of every
    scored position, or with targets_only [n_chunks * scored] of each position's next token - Gemma's
    rows of 32 chunks would be 4 GB): llama-perplexity's chunks, BOS in place of each chunk's first token
    when the model adds one, each chunk one llama_decode from an empty cache (f16, llama.cpp's default)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason='llama.cpp is the bench extra\'s peer: pip install ".[bench]"')
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                          verbose=False)
    tokens = np.array(tokens_of(llm), np.int64)
    chunks = ppl.chunk_tokens(tokens, n_ctx, n_chunks)
    bos = llm.token_bos() if llm._model.add_bos_token() else None
    first = n_ctx // 2
    rows = []
    for chunk in chunks:
        llm.reset()
        llm.eval(ppl.chunk_inputs(chunk, bos).tolist())
        logp = log_softmax(np.array(llm.scores[first:n_ctx - 1]))
        rows.append(logp[np.arange(len(logp)), chunk[first + 1:]] if targets_only else logp)
    return tokens, chunks, np.concatenate(rows)


def llama_estimate(path, text, n_ctx=N_CTX, n_chunks=N_CHUNKS):
    tokens, _, logp = llama_chunk_logp(path, lambda llm: llm.tokenize(text.encode(), add_bos=True),
                                       n_ctx, n_chunks, targets_only=True)
    return tokens, ppl.estimate(-logp)


def perturbed_copy(path, seed: int, dest):
    """`path` copied to `dest` with PERTURBED's values times 1 + 1e-6 * N(0, 1) (numpy's generator,
    `seed`): the same model to six digits, another draw of every int8 rounding after it."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == PERTURBED)
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, tensor.tensor_type
    shutil.copyfile(path, dest)
    w = np.memmap(dest, np.float32, "r+", int(tensor.data_offset), (int(tensor.n_elements),))
    w[:] = w * (1 + 1e-6 * np.random.default_rng(seed).standard_normal(w.shape))
    w.flush()
    return dest


def check_against_llama(say, path, text, label, tmp_path, draws=DRAWS, activations="pyml"):
    """pyml's mean perplexity over `draws` copies of the file (the file itself, then perturbed copies)
    within 0.5% of llama.cpp's mean over the same copies, beyond what the draws' own spread leaves
    unknown (two standard errors of the difference of the means); `activations` as pyml-perplexity's."""
    ours, theirs = [], []
    for seed in range(draws):
        copy = path if seed == 0 else perturbed_copy(path, seed, tmp_path / f"draw{seed}.gguf")
        lm = load_model(gguf=str(copy), float_compute="f32")  # as pyml-perplexity: f32 attention
        tokens, ref = llama_estimate(copy, text)
        assert ppl.text_tokens(lm, text).tolist() == tokens.tolist()
        with quant.ggml_activations(activations == "ggml"):
            ours.append(ppl.perplexity(lm, text, N_CTX, N_CHUNKS).estimate.ppl)
        theirs.append(ref.ppl)
        del lm
        if copy != path:
            copy.unlink()
    got, ref = float(np.mean(ours)), float(np.mean(theirs))
    se = math.sqrt((np.var(ours, ddof=1) + np.var(theirs, ddof=1)) / draws) / ref if draws > 1 else 0.0
    say(f"perplexity {label} -c {N_CTX} x{N_CHUNKS}, --activations {activations}, mean of {draws}: pyml {got:.4f} "
        f"({min(ours):.4f}..{max(ours):.4f}), llama.cpp {ref:.4f} ({min(theirs):.4f}..{max(theirs):.4f}) "
        f"({100 * (got / ref - 1):+.2f}% +/- {100 * se:.2f}%)")
    assert abs(got / ref - 1) <= 5e-3 + 2 * se


@pytest.mark.parametrize("activations", ["pyml", "ggml"])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f16"])
def test_smollm2_perplexity_matches_llama_cpp(kind, activations, say, smollm2_gguf, requantized, text, tmp_path):
    check_against_llama(say, smollm2_gguf if kind == "q4_1" else requantized(kind), text, f"SmolLM2 {kind}",
                        tmp_path, draws=1 if kind == "f16" else DRAWS, activations=activations)


# With ggml's roundings (its activation grids and its attention's f16 Q and probabilities): pyml's own
# (int8 per 32 values, where llama.cpp's K-quant products take a scale per 256) reads 0.7% below
# llama.cpp's mean of 8 draws and 0.1% below the F16 file of the same weights, where the two engines
# agree to 0.001%. ggml's q8_K draws spread 3x as wide as pyml's (sd 0.5% a draw): 8 of them
# (docs/perplexity.md, "Activations rounded as ggml rounds them").
def test_gemma3_perplexity_matches_llama_cpp(say, gemma3_gguf, text, tmp_path):
    check_against_llama(say, gemma3_gguf, text, "Gemma 3 Q4_K_M", tmp_path, draws=8, activations="ggml")


LONG_CHUNKS = 32  # 4,064 scored tokens: a draw spreads ~0.16% (0.45% at 4 chunks)


@pytest.fixture(scope="module")
def long_text():
    """Python's own documentation (the pydoc topics every CPython ships): English prose with code, 465 kB."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


@pytest.fixture(scope="module")
def long_ref(long_text):
    """llama.cpp's estimate for a file over the long text, each file's once."""
    refs = {}
    return lambda path: refs.setdefault(path, llama_estimate(path, long_text, N_CTX, LONG_CHUNKS)[1])


# measured on the AVX2 machine (pyml, llama.cpp): Gemma 14.4929 and 14.5298 with ggml's roundings against
# 14.5018; SmolLM2 Q4_1 13.5151 against 13.5146
@pytest.mark.parametrize("model, activations", [("gemma3", "pyml"), ("gemma3", "ggml"), ("smollm2", "pyml")])
def test_the_file_itself_on_a_long_text_matches_llama_cpp(model, activations, say, request, long_text, long_ref):
    """The file, the text and the context of a llama-perplexity run, one figure each: within 0.5%."""
    path = request.getfixturevalue(f"{model}_gguf")
    ref = long_ref(path)
    lm = load_model(gguf=str(path), float_compute="f32", warmup=False)
    with quant.ggml_activations(activations == "ggml"):
        got = ppl.perplexity(lm, long_text, N_CTX, LONG_CHUNKS).estimate.ppl
    say(f"perplexity {model} {path.name}, the file itself, -c {N_CTX} x{LONG_CHUNKS} of Python's documentation, "
        f"--activations {activations}: pyml {got:.4f}, llama.cpp {ref.ppl:.4f} ({100 * (got / ref.ppl - 1):+.2f}%)")
    assert abs(got / ref.ppl - 1) <= 5e-3


def test_q4_0_kld_from_f32_matches_llama_cpp(say, requantized, text, tmp_path):
    f32, q4 = requantized("f32"), requantized("q4_0")
    base = tmp_path / "base.npz"
    kld.save_base(load_model(gguf=str(f32), float_compute="f32"), text, N_CTX, N_CHUNKS, base)
    ours = kld.kl_divergence(load_model(gguf=str(q4), float_compute="f32"), kld.Base.load(base)).kld.mean()
    _, _, lp = llama_chunk_logp(f32, lambda llm: llm.tokenize(text.encode(), add_bos=True), N_CTX, N_CHUNKS)
    _, _, lq = llama_chunk_logp(q4, lambda llm: llm.tokenize(text.encode(), add_bos=True), N_CTX, N_CHUNKS)
    theirs = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    say(f"KLD SmolLM2 Q4_0 vs F32 -c {N_CTX} x{N_CHUNKS}: pyml {ours:.5f}, llama.cpp {theirs:.5f} "
        f"({100 * (ours / theirs - 1):+.2f}%)")
    assert math.isfinite(theirs) and ours == pytest.approx(theirs, rel=5e-2)
