"""PNG figures with matplotlib (the optional extra `plot`): expert load per MoE block, and simple curves.

Uses matplotlib's object API (Figure + Agg canvas), never pyplot, so the caller's backend and global figure
state are left alone. PNGs are written to a temporary file and renamed, so no half-written image is left.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from moecompile.core.errors import MoECompileError
from moecompile.stats import RoutingStats, as_floats


def require_matplotlib():
    """matplotlib's Figure class, or a clear error (call it before long work that ends in a plot)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MoECompileError("plots need matplotlib: pip install 'moecompile[plot]'") from None
    return Figure


def _figure(**kw):
    return require_matplotlib()(**kw)


def expert_load_figure(stats: dict[str, RoutingStats], title: str):
    """One bar chart per block: each expert's share of the assignments relative to an even split (1 = balanced)."""
    if not stats:
        raise MoECompileError("no routing statistics to plot")
    cols = min(4, len(stats))
    rows = math.ceil(len(stats) / cols)
    fig = _figure(figsize=(3.4 * cols, 2.6 * rows + 0.8), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, (path, s) in zip(axes, stats.items()):
        m = as_floats(s.metrics(per_expert=True))
        e = s.num_experts
        ax.bar(range(e), [m[f"load/{i}"] * e for i in range(e)], color="tab:blue")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(f"{path or 'block'}\ndropped {m['dropped_frac']:.1%}, entropy {m['entropy']:.2f}"
                     f" of {math.log(e):.2f}", fontsize=8)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_ylabel("load / even share", fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.tick_params(labelsize=7)
    for ax in axes[len(stats):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    return fig


def curve_figure(series: dict[str, tuple[list, list]], title: str, xlabel: str, ylabel: str,
                 levels: dict[str, float] | None = None):
    """Line plot of named (x, y) series, e.g. training and validation loss against step, with optional named
    horizontal reference levels (dashed)."""
    fig = _figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=name)
    for name, y in (levels or {}).items():
        ax.axhline(y, linestyle="--", linewidth=1, color="gray", label=name)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def save_png(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=dpi)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
