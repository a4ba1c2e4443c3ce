"""data_lengths.png: the training documents' token lengths against seq_len (the data check's plot)."""
from __future__ import annotations

import os
from pathlib import Path


def plot_lengths(lengths: list[int], seq_len: int, out: Path, title: str = "") -> None:
    """A histogram of `lengths` (tokens per document) with seq_len marked; written atomically.
    Drawn on a bare Agg canvas (no pyplot state), so it is safe beside other figures."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    over = sum(n > seq_len for n in lengths)
    top = max([seq_len, *lengths]) if lengths else seq_len
    ax.hist(lengths, bins=min(60, max(1, len(set(lengths)))), range=(0, top), color="#4c72b0")
    ax.axvline(seq_len, color="#c44e52", linestyle="--", label=f"seq_len {seq_len}: {over} of {len(lengths)} longer")
    ax.set_xlabel("tokens per document")
    ax.set_ylabel("documents")
    ax.set_title(title or "token lengths of the training documents")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, out)
