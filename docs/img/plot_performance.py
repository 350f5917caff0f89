"""Draws docs/img/performance-h100-<date>.png from the CSV beside it.

The CSV holds the milliseconds of one dated entry of benchmarks/RESULTS.md (case,
regime: short or sustained samples, implementation, ms); the plot shows each
implementation's speed relative to cuDNN (cuDNN's time over its own) per case.

    python docs/img/plot_performance.py [docs/img/performance-h100-2026-11-28.csv]
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
SERIES = [("omni_mosaic", "short", "omni-jax (short samples)"),
          ("omni_mosaic", "sustained", "omni-jax (sustained, power-capped)"),
          ("jax_mgpu", "short", "JAX Pallas attention_mgpu (short samples)")]


def main(path: Path) -> Path:
    with path.open() as f:
        ms = {(r["case"], r["regime"], r["impl"]): float(r["ms"]) for r in csv.DictReader(f)}
    cases = list(dict.fromkeys(case for case, _, _ in ms))
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(cases) + 1.2))
    height = 0.8 / len(SERIES)
    for i, (impl, regime, label) in enumerate(SERIES):
        ys, ratios = [], []
        for j, case in enumerate(cases):
            if (case, regime, impl) in ms and (case, regime, "cudnn") in ms:
                ys.append(j + i * height)
                ratios.append(ms[case, regime, "cudnn"] / ms[case, regime, impl])
        ax.barh(ys, ratios, height, label=label)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(cases))], cases, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speed relative to cuDNN (cuDNN ms / ms; above 1 is faster)")
    ax.set_title("Attention on one H100 80GB HBM3, bf16, 16 heads (2026-11-28)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else
               HERE / "performance-h100-2026-11-28.csv"))
