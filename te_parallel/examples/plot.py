"""Loss curves of one or several runs as a PNG: train loss (thin, every step) and validation loss
(markers; a run without an evaluation yet has none), both in the legend, and an optional note under
the axes (why validation can sit below train)."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Dict, List, Optional


def plot_runs(runs: Dict[str, List[dict]], path: Path, title: str = "GPT on Python's stdlib (bytes)",
              note: Optional[str] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5 if note else 4.5))
    for i, (name, log) in enumerate(runs.items()):
        color = f"C{i}"
        prefix = f"{name}: " if name else ""
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], color=color, alpha=0.35, linewidth=0.8,
                label=f"{prefix}train (each step's batch)")
        val = [r for r in log if "val_loss" in r]
        if val:  # (none before the first evaluation: no empty legend entry)
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color=color, markersize=3,
                    label=f"{prefix}validation (held-out text)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if note:
        fig.text(0.01, 0.01, textwrap.fill(note, 120), fontsize=7, va="bottom")
        fig.tight_layout(rect=(0, 0.08, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
