"""PNG plots of one run's results (matplotlib, Agg: no display on CI or over ssh)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.hydrate import ALTERNATIVES  # noqa: E402


def hydrate_plot(res: dict, path: Path) -> None:
    rows = res["rows"]
    regimes = ["fresh", "reused"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, regime in zip(axes, regimes, strict=True):
        for shape in sorted({r["shape"] for r in rows}):
            sel = sorted(
                (r for r in rows if r["shape"] == shape and r["regime"] == regime),
                key=lambda r: r["nbytes"],
            )
            if not sel:
                continue
            x = [r["nbytes"] / 2**20 for r in sel]
            for alt, style in zip(ALTERNATIVES, ("o-", "d-.", "s--", "^:", "v:"), strict=True):
                if shape != "kv28-f16" and alt in ("read", "memcpy"):
                    continue  # floors do not depend on the layout: draw them once
                ax.plot(
                    x,
                    [r["gbps"][alt] for r in sel],
                    style,
                    label=f"{alt} ({shape})" if alt not in ("read", "memcpy") else alt,
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("entry size (MiB)")
        ax.set_title(f"hydrate into LRUPromptCache, {regime} buffers")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s (median)")
    axes[1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pipeline_plot(res: dict, path: Path) -> None:
    tiers = list(res["tiers"])
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.38
    for i, mode in enumerate(("cold", "kvstore")):
        pre = [res["tiers"][t][mode]["prefill_s"] for t in tiers]
        dec = [res["tiers"][t][mode]["decode_s"] for t in tiers]
        xs = [j + (i - 0.5) * w for j in range(len(tiers))]
        ax.bar(xs, pre, w, label=f"prefill ({mode})", color=("#c44e52", "#55a868")[i])
        ax.bar(xs, dec, w, bottom=pre, label=f"decode ({mode})", color=("#e8a0a0", "#a8d8b0")[i])
    ax.set_xticks(range(len(tiers)), tiers)
    ax.set_ylabel("model seconds per query (median)")
    ax.set_title("pipeline replay: cold start vs restart with kvstore")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling_plot(res: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    rows = res["vs_prefix"]
    axes[0].plot([r["tokens"] for r in rows], [r["stats"]["median"] * 1e3 for r in rows], "o-")
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("prefix tokens (kv28-f16, 112 KiB/token)")
    axes[0].set_ylabel("kvstore.client.hydrate ms (median)")
    axes[0].grid(alpha=0.3)
    pop = res["vs_population"]
    names = list(pop)
    axes[1].bar(
        names,
        [pop[n]["stats"]["median"] * 1e3 for n in names],
        yerr=[
            [pop[n]["stats"]["median"] * 1e3 - pop[n]["stats"]["q1"] * 1e3 for n in names],
            [pop[n]["stats"]["q3"] * 1e3 - pop[n]["stats"]["median"] * 1e3 for n in names],
        ],
    )
    axes[1].set_ylabel("hydrate 4 pins, ms (median, IQR)")
    axes[1].set_title("store population (others: other models)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
