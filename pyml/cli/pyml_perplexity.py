"""pyml-perplexity: a model's perplexity over a text, and its KL divergence from a reference's, as llama.cpp's llama-perplexity.

    pyml-perplexity -m MODEL -f TEXT [-c 512] [--chunks N] [-b BATCH] [--activations ggml] [--json]
    pyml-perplexity -m F32.gguf -f TEXT --kl-divergence-base base.npz      # the reference's side
    pyml-perplexity -m Q4_0.gguf --kl-divergence-base base.npz --kl-divergence [--plot kld.png]

Chunks of -c tokens, the second half of each scored (pyml/nlp/perplexity.py); the running estimate
as llama-perplexity prints it ([1]ppl,[2]ppl,...), and its last line is llama-perplexity's
`Final estimate: PPL = X +/- Y`. With --kl-divergence, llama-perplexity's per-chunk table and
statistics (pyml/nlp/kl_divergence.py; the base file holds the reference's top-K log-probabilities).
--activations ggml rounds each quantized product's activations as llama.cpp's CPU backend does
(quant/ggml_grids.py), for figures that compare with llama-perplexity's.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from pyml import quant
from pyml.cli.main import Parser, run_command, say
from pyml.cli.options import add_model_options, check_output_file, model_options, read_prompt
from pyml.core import progress
from pyml.core.errors import PymlError
from pyml.nlp import kl_divergence as kld
from pyml.nlp import perplexity as ppl
from pyml.nlp.api import load_model
from pyml.report import plots

DEFAULT_CTX = 512  # llama-perplexity's
DEFAULT_BATCH = 2048  # llama-perplexity's n_batch: 4 chunks of 512 a pass (docs/perplexity.md: the speed-up)


def build_parser() -> Parser:
    p = Parser(prog="pyml-perplexity", description=__doc__.split("\n")[0])
    add_model_options(p)
    p.add_argument("-f", "--file", metavar="FILE", help="the text (- = stdin); with --kl-divergence the base "
                                                        "file's tokens are used and FILE, if given, must match them")
    p.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_CTX, metavar="N",
                   help=f"tokens per chunk (default {DEFAULT_CTX}, as llama-perplexity)")
    p.add_argument("--chunks", type=int, default=None, metavar="N", help="score only the first N chunks")
    p.add_argument("-b", "--batch-size", type=int, default=None, metavar="N",
                   help=f"tokens a pass: N / ctx chunks go through one batched forward pass (a multiple of -c; "
                        f"default {DEFAULT_BATCH} or the multiple of -c below it, as llama-perplexity's n_batch)")
    p.add_argument("--kl-divergence-base", metavar="FILE",
                   help="without --kl-divergence: save the model's top-K log-probabilities here; with it: read them")
    p.add_argument("--kl-divergence", action="store_true",
                   help="compare the model with the reference saved in --kl-divergence-base")
    p.add_argument("--kl-top-k", type=int, default=None, metavar="K",
                   help=f"saving a base: log-probabilities saved per position (default {kld.DEFAULT_TOP_K}; "
                        "the rest is kept as one sum: docs/perplexity.md for the error)")
    p.add_argument("--plot", metavar="PNG", help="with --kl-divergence: a histogram of the per-position KLD")
    p.add_argument("--activations", choices=("pyml", "ggml"), default="pyml",
                   help="how quantized products round their activations: pyml's int8 with a scale per 32 values "
                        "(default), or ggml's grids as llama.cpp's CPU backend (q8_0 / q8_1 with fp16 scales per "
                        "32, q8_K per 256, f16 for F16 weights; the attention's queries and probabilities in f16) "
                        "on the float path: figures comparable with "
                        "llama-perplexity's, at about a third of the speed (docs/perplexity.md)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the text report")
    # f32 by default: a quantization's cost measured with llama.cpp's float attention, not with the bf16
    # prefill attention `auto` picks for quantized weights on AVX-512 BF16 (SmolLM2 Q8_0: +0.5% ppl;
    # docs/perplexity.md); --float-compute auto measures pyml's fast path
    p.set_defaults(prompt=None, float_compute="f32")  # prompt: options.read_prompt's -p; the text is -f only
    return p


def check_args(args) -> int:
    """Flags that cannot work together, refused by name; returns the tokens a pass (-b)."""
    if args.kl_divergence and not args.kl_divergence_base:
        raise PymlError("--kl-divergence needs --kl-divergence-base FILE (the reference's, saved by a run without "
                        "--kl-divergence)")
    if args.plot and not args.kl_divergence:
        raise PymlError("--plot draws the KL divergence: it needs --kl-divergence")
    if args.kl_top_k is not None and (args.kl_divergence or not args.kl_divergence_base):  # it would be ignored
        raise PymlError("--kl-top-k sets what a saved base keeps: it needs --kl-divergence-base FILE without "
                        "--kl-divergence (a comparison reads K from the base)")
    if not args.kl_divergence and args.file is None:
        raise PymlError("give the text with -f FILE")
    if args.kl_divergence_base and not args.kl_divergence:  # to be written: refused before the work, not after
        check_output_file(args.kl_divergence_base, f"--kl-divergence-base {args.kl_divergence_base}")
    if args.activations == "ggml" and args.float_compute != "f32":
        raise PymlError(f"--activations ggml computes as llama.cpp, in float32: it does not take --float-compute "
                        f"{args.float_compute}")
    if args.ctx_size < 4:
        raise PymlError(f"-c must be at least 4, got {args.ctx_size}")
    b = args.batch_size if args.batch_size is not None else max(1, DEFAULT_BATCH // args.ctx_size) * args.ctx_size
    if b < 1 or (b > args.ctx_size and b % args.ctx_size):
        raise PymlError(f"-b {b} must be a multiple of -c {args.ctx_size} (or at most it)")
    return b


def run(args) -> int:
    batch = check_args(args)
    base = kld.Base.load(args.kl_divergence_base) if args.kl_divergence else None
    text = read_prompt(args) if args.file is not None else None
    # every pass is a prompt's (T > 1): warm the prefill's kernels, not a decode step's, which a first
    # run would compile for nothing
    lm = load_model(**model_options(args), warmup=False)
    lm.warm_up(prefill=True, cold=True)
    n_ctx = base.n_ctx if base is not None else args.ctx_size
    if base is not None:
        base.check_model(lm, args.kl_divergence_base)
        if text is not None and list(ppl.text_tokens(lm, text)[:len(base.tokens)]) != base.tokens.tolist():
            raise PymlError(f"-f {args.file} does not tokenize to the tokens {args.kl_divergence_base} was computed on")
        tokens = base.tokens
    else:
        tokens = ppl.text_tokens(lm, text)
    if n_ctx > lm.model.max_positions:
        raise PymlError(f"-c {n_ctx} is longer than the model's {lm.model.max_positions} positions")
    n_chunks = ppl.chunk_tokens(tokens, n_ctx, args.chunks).shape[0] if base is None else base.n_chunks
    seqs = max(1, batch // n_ctx)  # a base file's context may differ from -c: llama-perplexity's n_seq
    if not args.json:
        say(f"perplexity: calculating perplexity over {n_chunks} chunks, n_ctx={n_ctx}, batch_size={seqs * n_ctx}, "
            f"n_seq={seqs}" + (", activations rounded as ggml's" if args.activations == "ggml" else ""))
    out = sys.stdout
    t0 = time.perf_counter()
    with progress.bar(n_chunks, desc="perplexity", unit="chunk") as bar, \
            quant.ggml_activations(args.activations == "ggml"):
        if base is not None:
            def chunk_done(i, stats):
                bar.update(1)
                if not args.json:
                    if i == 0:
                        print(KLD_TABLE_HEADER, file=out)
                    print(kld_row(i, stats), file=out, flush=True)

            result = kld.kl_divergence(lm, base, seqs=seqs, on_chunk=chunk_done, path=args.kl_divergence_base)
            ppl_result = result.ppl
        else:
            def chunk_done(i, running):
                bar.update(1)
                if not args.json:
                    print(f"[{i + 1}]{running.ppl:.4f},", end="", file=out, flush=True)

            if args.kl_divergence_base:
                top_k = kld.DEFAULT_TOP_K if args.kl_top_k is None else args.kl_top_k
                ppl_result = kld.save_base(lm, None, n_ctx, args.chunks, args.kl_divergence_base, k=top_k,
                                           seqs=seqs, on_chunk=chunk_done, tokens=tokens)
            else:
                ppl_result = ppl.perplexity(lm, None, n_ctx, args.chunks, tokens=tokens, seqs=seqs,
                                            on_chunk=chunk_done)
    seconds = time.perf_counter() - t0
    scored = ppl_result.n_chunks * n_ctx
    if args.json:
        doc = dict(model=lm.source, activations=args.activations, n_ctx=n_ctx, chunks=ppl_result.n_chunks, n_seq=seqs,
                   count=ppl_result.estimate.count, ppl=ppl_result.estimate.ppl, ppl_unc=ppl_result.estimate.err,
                   running=[e.ppl for e in ppl_result.running], seconds=seconds, tokens_per_second=scored / seconds)
        if base is not None:
            doc["kl_divergence"] = result.stats()
            doc["base_rest_mass"] = float(rest_mass(base))
        print(json.dumps(doc), file=out)
        return 0
    print(file=out)
    if base is not None:
        print(kld_report(result.stats(), base), file=out)
        if args.plot:
            name, _ = plots.kld_plot(result.kld, args.plot, f"KL divergence per position: {lm.source.split('/')[-1]}")
            say(f"pyml-perplexity: wrote {args.plot}")
    say(f"perplexity: {seconds:.2f} s, {scored / seconds:.1f} tokens/s")
    print(ppl_result.estimate.final_line(), file=out)
    return 0


KLD_TABLE_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                    "              Δp RMS            Same top p")


def kld_row(i: int, s: dict) -> str:
    """A row of llama-perplexity's per-chunk KL divergence table, in its format."""
    return (f"{i + 1:4d}    {s['ppl']:9.4f} ± {s['ppl_unc']:9.4f}    {s['ln_ratio']:10.5f} ± {s['ln_ratio_unc']:10.5f}"
            f"    {s['kld']:10.5f} ± {s['kld_unc']:10.5f}    {100 * s['rms_dp']:6.3f} ± {100 * s['rms_dp_unc']:6.3f} %"
            f"    {100 * s['same_top']:6.3f} ± {100 * s['same_top_unc']:6.3f} %")


def rest_mass(base) -> float:
    return float(np.exp(base.log_rest.astype(float)).mean())


def kld_report(s: dict, base) -> str:
    """llama-perplexity's statistics after the table, in its words and formats."""
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_unc']:10.6f}",
             f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_unc']:10.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['cor']:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ratio']:10.6f} ± {s['ln_ratio_unc']:10.6f}",
             f"Mean PPL(Q)/PPL(base)         : {s['ratio']:10.6f} ± {s['ratio_unc']:10.6f}",
             f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_unc']:10.6f}",
             "",
             "====== KL divergence statistics ======",
             f"Mean    KLD: {s['kld']:10.6f} ± {s['kld_unc']:10.6f}",
             f"Maximum KLD: {s['kld_max']:10.6f}"]
    pk = s["kld_percentiles"]
    lines += [f"{q:4.1f}%   KLD: {pk[q]:10.6f}" for q in (99.9, 99.0, 95.0, 90.0)]
    lines.append(f"Median  KLD: {s['kld_median']:10.6f}")
    lines += [f"{q:4.1f}%   KLD: {pk[q]:10.6f}" for q in (10.0, 5.0, 1.0, 0.1)]
    lines += [f"Minimum KLD: {s['kld_min']:10.6f}",
              f"(base file: top-{base.top_ids.shape[1]} log-probabilities, mean mass outside them "
              f"{rest_mass(base):.5f}: the KLD is low by at most that x the tails' own divergence)",
              "",
              "====== Token probability statistics ======",
              f"Mean    Δp: {100 * s['p_diff']:6.3f} ± {100 * s['p_diff_unc']:5.3f} %",
              f"Maximum Δp: {100 * s['p_diff_max']:6.3f}%"]
    pd = s["p_diff_percentiles"]
    lines += [f"{q:4.1f}%   Δp: {100 * pd[q]:6.3f}%" for q in (99.9, 99.0, 95.0, 90.0, 75.0)]
    lines.append(f"Median  Δp: {100 * s['p_diff_median']:6.3f}%")
    lines += [f"{q:4.1f}%   Δp: {100 * pd[q]:6.3f}%" for q in (25.0, 10.0, 5.0, 1.0, 0.1)]
    lines += [f"Minimum Δp: {100 * s['p_diff_min']:6.3f}%",
              f"RMS Δp    : {100 * s['rms_dp']:6.3f} ± {100 * s['rms_dp_unc']:5.3f} %",
              f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_unc']:5.3f} %"]
    return "\n".join(lines)


def main(argv=None) -> int:
    return run_command("pyml-perplexity", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
