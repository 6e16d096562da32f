"""PNG plots with matplotlib (the optional `plot` extra): decode step times, the component
share of each step, and per-layer time in prefill and decode."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from pyml.report import aggregate

MATPLOTLIB_MISSING = "plots skipped: matplotlib is not installed (pip install 'pyml[plot]')"


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_plots(run, out_dir: Path) -> list:
    """[(filename, description)] of the plots written into out_dir (none without decode steps)."""
    # Deferred: matplotlib is an optional extra, and importing pyplot costs ~0.7 s.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    steps = aggregate.step_breakdowns(run)
    written = []
    if steps:
        x = [s["step"] for s in steps]
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot(x, [s["total"] for s in steps], marker="o", label="decode step")
        ax.plot(x, [s["layers"] for s in steps], marker=".", label="layers")
        ax.plot(x, [s["projection"] for s in steps], marker=".", label="projection (lm_head)")
        ax.set_xlabel("decode step")
        ax.set_ylabel("ms")
        ax.set_title(f"Decode step time per token — {run.label}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, plt, out_dir / "decode_steps.png", "decode step time per token"))

        fig, ax = plt.subplots(figsize=(8, 3.5))
        bottom = [0.0] * len(steps)
        for k in aggregate.COMPONENTS:
            share = [100.0 * s[k] / s["total"] if s["total"] else 0.0 for s in steps]
            ax.bar(x, share, bottom=bottom, label=k)
            bottom = [b + v for b, v in zip(bottom, share)]
        ax.set_xlabel("decode step")
        ax.set_ylabel("% of step")
        ax.set_ylim(0, 100)
        ax.set_title("Component share per decode step")
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
        written.append(_save(fig, plt, out_dir / "component_share.png", "stacked component share per step"))

    pre, dec = aggregate.layer_stats(run, "prefill"), aggregate.layer_stats(run, "decode")
    if pre or dec:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        w = 0.4
        if pre:
            ax.bar([r["layer"] - w / 2 for r in pre], [r["mean"] for r in pre], width=w, label="prefill (per pass)")
        if dec:
            ax.bar([r["layer"] + w / 2 for r in dec], [r["mean"] for r in dec], width=w, label="decode (mean/step)")
            ax.errorbar([r["layer"] + w / 2 for r in dec], [r["mean"] for r in dec],
                        # max(0, ...): a mean of equal steps can round a hair below their min
                        yerr=[[max(0.0, r["mean"] - r["min"]) for r in dec],
                              [max(0.0, r["max"] - r["mean"]) for r in dec]],
                        fmt="none", ecolor="black", capsize=2, linewidth=0.8, label="decode min–max")
        ax.set_xlabel("layer")
        ax.set_ylabel("ms")
        ax.set_title("Time per layer")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
        written.append(_save(fig, plt, out_dir / "layers.png", "per-layer time, prefill and decode"))
    return written


def attention_share_plot(results: list, out_dir: Path) -> tuple:
    """pyml-sweep's question as a picture: attention's core and the feed-forward block as shares of a
    forward pass, against context length (log scale), one colour per model size."""
    import matplotlib  # deferred: see write_plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, size in enumerate(dict.fromkeys(r["size"] for r in results)):
        rows = sorted((r for r in results if r["size"] == size), key=lambda r: r["ctx"])
        ctx = [r["ctx"] for r in rows]
        color = f"C{i}"
        ax.plot(ctx, [r["attention_core_pct"] for r in rows], marker="o", color=color, label=f"{size}: attention core")
        ax.plot(ctx, [r["ffn_pct"] for r in rows], marker="s", linestyle="--", color=color,
                label=f"{size}: feed-forward")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens, one prefill)")
    ax.set_ylabel("% of the forward pass")
    ax.set_ylim(0, 100)
    ax.set_title("When does attention, not the FFN, dominate?")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, Path(out_dir) / "attention_share.png", "attention and FFN shares by context length")


def kld_plot(kld, path: Path, title: str) -> tuple:
    """pyml-perplexity --plot: the per-position KL divergences as a histogram on a log axis (a
    quantization's cost is in its tail), with the median and the 99th percentile marked."""
    import matplotlib  # deferred: see write_plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kld = np.asarray(kld, np.float64)
    positive = kld[kld > 0]
    low = max(positive.min(), 1e-8) if len(positive) else 1e-8
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(np.clip(kld, low, None), bins=np.geomspace(low, max(kld.max(), low * 10), 60), color="C0")
    for q, style in ((50, "--"), (99, ":")):
        ax.axvline(np.percentile(kld, q), color="black", linestyle=style, linewidth=1, label=f"p{q}")
    ax.set_xscale("log")
    ax.set_xlabel("KL divergence at a position (nats)")
    ax.set_ylabel("positions")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, plt, Path(path), "per-position KL divergence")


def _save(fig, plt, path, what):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name, what
