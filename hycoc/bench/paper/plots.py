"""The bench's plots (`hycoc bench`; docs/benchmarks.md): MAT vs g per configuration and the paired Δg per category,
drawn from a summary (`hycoc.bench.paper.summary.summarize`) with matplotlib's Agg canvas (no pyplot state), written
atomically, mode 0644 like the bench's other outputs. Core module: matplotlib is imported inside the functions that
draw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hycoc.bench.files import replacing
from hycoc.bench.paper.stats import DEFAULT_BASELINE, _num
from hycoc.bench.paper.stats import table5_order as _order

# ---- plots --------------------------------------------------------------------------------------------------


def _save(fig: Any, path: Path) -> Path:
    """Write a figure atomically, mode 0644 (`hycoc.bench.files.replacing`); returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    return path


def _label_offsets(
    points: Sequence[tuple[float, float]], xspan: float, yspan: float, step: float = 11.0
) -> list[tuple[float, float]]:
    """Offsets (points of type, x and y) for one label per point so that labels of points close together (within 6%
    of the y span, and within 20% of the x span, as a label runs to the right of its point) stack one above the
    other instead of overlapping: the k-th close neighbour's label goes k lines higher."""
    out: list[tuple[float, float]] = []
    for i, (x, y) in enumerate(points):
        near = sum(
            1 for (x2, y2) in points[:i] if abs(x - x2) <= 0.2 * (xspan or 1.0) and abs(y - y2) <= 0.06 * (yspan or 1.0)
        )
        out.append((6.0, 4.0 + step * near))
    return out


def write_plots(
    summary: Mapping[str, Mapping[str, Any]], out_dir: str | Path, *, baseline: str = DEFAULT_BASELINE
) -> list[Path]:
    """Write ``mat_vs_g.png`` and ``category_delta_g.png`` into out_dir (created if needed); returns the two paths.

    mat_vs_g.png: MAT vs g, one colour per configuration (named in the legend and beside its point; labels of
    points close together are stacked, `_label_offsets`): filled circle = g measured incl. prefill, hollow square =
    g projected over every server forward, a dotted line joining the two. category_delta_g.png: grouped bars of
    paired Δg % per category per configuration, each with its 95% CI as an error bar and its value written on it.
    Uses matplotlib's Agg canvas, no pyplot state; each file is written to a temporary name and renamed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = _order(summary)
    return [
        _save(_mat_vs_g(summary, names), out / "mat_vs_g.png"),
        _save(_category_delta_g(summary, names, baseline), out / "category_delta_g.png"),
    ]


def _mat_vs_g(summary: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> Any:
    """The MAT vs g figure of `write_plots` (configurations in ``names``' order, colour C{index})."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 5.5))
    ax = fig.add_subplot()
    shown: list[tuple[str, float, float, str]] = []
    for i, n in enumerate(names):
        s = summary[n]
        mat, g, gp = _num(s.get("mat")), _num(s.get("g_ms_per_token")), _num(s.get("g_projected_ms_per_token"))
        at = g if g is not None else gp
        if mat is None or at is None:  # no MAT, or neither g
            continue
        color = f"C{i % 10}"
        if g is not None:
            ax.scatter([g], [mat], color=color, marker="o", s=50, zorder=3, label=n)
        if gp is not None:
            ax.scatter(
                [gp],
                [mat],
                facecolors="none",
                edgecolors=color,
                marker="s",
                s=50,
                zorder=3,
                label=None if g is not None else n,
            )
            if g is not None:
                ax.plot([g, gp], [mat, mat], color=color, lw=0.8, ls=":")
        shown.append((n, at, mat, color))
    if shown:
        _name_points(ax, summary, shown)
    else:
        ax.text(0.5, 0.5, "no configuration with a verifier", ha="center", va="center", transform=ax.transAxes)
    ax.scatter([], [], color="gray", marker="o", label="g measured (incl. prefill)")
    ax.scatter([], [], facecolors="none", edgecolors="gray", marker="s", label="g projected (every server forward)")
    ax.legend(loc="best", fontsize=7)
    ax.margins(x=0.15, y=0.15)
    ax.set_xlabel("g: verifier ms per output token (lower is better)")
    ax.set_ylabel("MAT: tokens per verification round")
    ax.set_title("MAT vs g per configuration")
    ax.grid(True, alpha=0.3)
    return fig


def _name_points(ax: Any, summary: Mapping[str, Mapping[str, Any]], shown: Sequence[tuple]) -> None:
    """Each shown point's configuration beside it (``shown``: (name, g, MAT, colour)), labels of points close
    together stacked (`_label_offsets`, spans over both g markers)."""
    xs = [x for _, x, _, _ in shown] + [_num(summary[n].get("g_projected_ms_per_token")) or x for n, x, _, _ in shown]
    ys = [y for _, _, y, _ in shown]
    offsets = _label_offsets([(x, y) for _, x, y, _ in shown], max(xs) - min(xs), max(ys) - min(ys))
    for (n, x, y, color), off in zip(shown, offsets):
        ax.annotate(
            n,
            (x, y),
            textcoords="offset points",
            xytext=off,
            fontsize=8,
            color=color,
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
        )


def _category_delta_g(summary: Mapping[str, Mapping[str, Any]], names: Sequence[str], baseline: str) -> Any:
    """The paired Δg per category figure of `write_plots`: one bar group per category, one bar per configuration
    other than ``baseline`` that has a paired Δg (colour C{its index in ``names``})."""
    from matplotlib.figure import Figure

    cfgs = [
        n
        for n in names
        if n != baseline
        and any(_num(pc.get("delta_g_pct")) is not None for pc in (summary[n].get("per_category") or {}).values())
    ]
    cats = sorted({c for n in cfgs for c in summary[n]["per_category"]})
    fig = Figure(figsize=(max(7.0, 1.1 * len(cats) * max(1, len(cfgs)) ** 0.5 + 3), 5.5))
    ax = fig.add_subplot()
    if cfgs and cats:
        width = 0.8 / len(cfgs)
        ticks = np.arange(len(cats))
        for j, n in enumerate(cfgs):
            pcs = summary[n]["per_category"]
            vals = [_num((pcs.get(c) or {}).get("delta_g_pct")) for c in cats]
            cis = [(pcs.get(c) or {}).get("delta_g_ci95") for c in cats]
            lo = [v - ci[0] if v is not None and ci else 0.0 for v, ci in zip(vals, cis)]
            hi = [ci[1] - v if v is not None and ci else 0.0 for v, ci in zip(vals, cis)]
            bars = ax.bar(
                ticks + (j - (len(cfgs) - 1) / 2) * width,
                [np.nan if v is None else v for v in vals],
                width,
                label=n,
                color=f"C{names.index(n) % 10}",
                yerr=[lo, hi],
                capsize=2,
                error_kw={"elinewidth": 0.8, "ecolor": "black"},
            )
            ax.bar_label(bars, labels=["" if v is None else f"{v:+.0f}" for v in vals], fontsize=6, padding=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels(cats, rotation=30, ha="right")
        ax.axhline(0.0, color="black", lw=0.8)
        ax.legend(fontsize=7)
    else:
        ax.text(
            0.5, 0.5, f"no paired Δg (baseline {baseline} absent?)", ha="center", va="center", transform=ax.transAxes
        )
    ax.set_ylabel(f"Δg % vs {baseline} (lower is better)")
    ax.set_title("Paired Δg per category (value on each bar; error bar: 95% CI over the category's questions)")
    ax.grid(True, axis="y", alpha=0.3)
    return fig
