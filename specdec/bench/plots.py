"""PNG plots of a benchmark (matplotlib's object API: no pyplot state, no display needed).

- ``speedup_vs_gamma.png``: wall-time speedup over plain-hf by gamma, one line per method, one
  panel per temperature; methods without a gamma are dashed horizontal lines.
- ``acceptance_by_position.png``: for methods that report it, the share of rounds whose draft at
  position i was accepted (given that position was drafted), per method and gamma.
- ``time_split.png``: mean seconds per run inside target forwards, drafting, and the rest.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from specdec.bench.summary import Row


def _label(row: Row) -> str:
    gamma = f" γ={row.gamma}" if row.gamma is not None else ""
    return f"{row.method}{gamma} T={row.temperature:g}"


def _colors(rows: list[Row]) -> dict[str, str]:
    """One colour per method, the same in every plot and panel."""
    return {method: f"C{i % 10}" for i, method in enumerate(dict.fromkeys(r.method for r in rows))}


def _panels(rows: list[Row], width: float = 5.5, height: float = 4.2) -> tuple[Figure, list, list[float]]:
    """A figure with one panel per temperature."""
    temperatures = sorted({r.temperature for r in rows})
    fig = Figure(figsize=(width * len(temperatures), height))
    axes = fig.subplots(1, len(temperatures), squeeze=False)[0]
    return fig, list(axes), temperatures


def plot_speedup_vs_gamma(rows: list[Row], path: Path) -> None:
    """Speedup over plain-hf against gamma, per method; one panel per temperature."""
    colors = _colors(rows)
    fig, axes, temperatures = _panels(rows)
    for ax, temperature in zip(axes, temperatures):
        shown = [r for r in rows if r.temperature == temperature and r.speedup is not None]
        for r in shown:
            if r.gamma is None:
                ax.axhline(r.speedup, linestyle="--", linewidth=1.2, color=colors[r.method], label=r.method)
        for method in dict.fromkeys(r.method for r in shown if r.gamma is not None):
            points = sorted((r.gamma, r.speedup) for r in shown if r.method == method and r.gamma is not None)
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", color=colors[method], label=method)
        gammas = sorted({r.gamma for r in shown if r.gamma is not None})
        if gammas:
            ax.set_xticks(gammas)
        ax.set_title(f"temperature {temperature:g}")
        ax.set_xlabel("gamma (tokens drafted per round)")
        ax.set_ylabel("speedup over plain-hf (mean tokens/s ratio)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_acceptance_by_position(rows: list[Row], path: Path) -> None:
    """P(draft position i accepted | drafted), per method (colour) and gamma (shade); panel per temperature."""
    colors = _colors(rows)
    fig, axes, temperatures = _panels(rows)
    max_gamma = max((r.gamma or 1 for r in rows), default=1)
    for ax, temperature in zip(axes, temperatures):
        for r in rows:
            if r.temperature == temperature and r.acceptance_by_position:
                positions = range(1, len(r.acceptance_by_position) + 1)
                shade = 0.35 + 0.65 * (r.gamma or 1) / max_gamma
                ax.plot(positions, r.acceptance_by_position, marker="o", color=colors[r.method], alpha=shade,
                        label=f"{r.method} γ={r.gamma}")
        ax.set_title(f"temperature {temperature:g}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted / drafted at that position")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_time_split(rows: list[Row], path: Path) -> None:
    """Stacked bars: mean seconds per run in the target, the drafter, and overhead."""
    shown = [r for r in rows if r.target_s is not None]
    fig = Figure(figsize=(7, 0.45 * len(shown) + 1.5))
    ax = fig.subplots()
    labels = [_label(r) for r in shown]
    left = [0.0] * len(shown)
    for part, color in (("target_s", "C0"), ("drafter_s", "C1"), ("overhead_s", "C7")):
        widths = [max(0.0, getattr(r, part) or 0.0) for r in shown]
        ax.barh(labels, widths, left=left, color=color, label=part.removesuffix("_s"))
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("mean seconds per prompt")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


PLOTS = {
    "speedup_vs_gamma.png": plot_speedup_vs_gamma,
    "acceptance_by_position.png": plot_acceptance_by_position,
    "time_split.png": plot_time_split,
}


def write_plots(rows: list[Row], out_dir: Path) -> list[Path]:
    """Write every plot into out_dir; return their paths."""
    paths = []
    for name, plot in PLOTS.items():
        plot(rows, out_dir / name)
        paths.append(out_dir / name)
    return paths
