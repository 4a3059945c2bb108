"""``cegppo compare RUN_DIR... --out DIR``: one PNG per quantity (a line per run) and a markdown table."""

from __future__ import annotations

from pathlib import Path

from cegppo.io import atomic_write_text, read_jsonl
from cegppo.reporting.plots import COMPARE_PANELS, EVAL_TAGS, _plt, _save, _series, run_label


def _eval_series(run: Path) -> tuple[list[int], list[float]]:
    evals = [e for e in read_jsonl(run / "eval.jsonl") if e.get("tag") in EVAL_TAGS]
    pts = sorted({e["step"]: e["accuracy"] for e in evals}.items())
    return [p[0] for p in pts], [p[1] for p in pts]


def compare_runs(runs: list[Path], out: Path) -> list[Path]:
    """Write ``compare.png`` (all panels), one ``<metric>.png`` per panel, and ``summary.md``; return the paths."""
    for r in runs:
        if not (r / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{r} is not a cegppo run directory (no metrics.jsonl)")
    out.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    data = {r: read_jsonl(r / "metrics.jsonl") for r in runs}
    evals = {r: _eval_series(r) for r in runs}
    labels = {r: run_label(r) for r in runs}
    written = []

    def draw(ax, key: str, title: str) -> bool:
        any_data = False
        for r in runs:
            xs, ys = evals[r] if key == "val/accuracy" else _series(data[r], key)
            if xs:
                any_data = True
                ax.plot(xs, ys, marker="o" if key == "val/accuracy" else None, ms=3, label=labels[r])
        if key.endswith("/dH"):
            ax.axhline(0.0, color="grey", lw=0.6)
        ax.set(title=title, xlabel="RL step")
        return any_data

    cols = 4
    rows_n = -(-len(COMPARE_PANELS) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.6 * rows_n))
    for ax, (key, title) in zip(axes.flat, COMPARE_PANELS):
        draw(ax, key, title)
    for ax in list(axes.flat)[len(COMPARE_PANELS):]:
        ax.axis("off")
    handles, lbls = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, lbls, loc="lower center", ncol=min(len(runs), 3), fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    written.append(_save(fig, out / "compare.png"))
    plt.close(fig)
    for key, title in COMPARE_PANELS:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        if draw(ax, key, title):
            ax.legend(fontsize=8)
            written.append(_save(fig, out / (key.replace("/", "_") + ".png")))
        plt.close(fig)
    written.append(summary_table(runs, data, evals, labels, out / "summary.md"))
    return written


def summary_table(runs: list[Path], data: dict, evals: dict, labels: dict, path: Path) -> Path:
    def last(rows, key):
        vals = _series(rows, key)[1]
        return vals[-1] if vals else None

    def mean(rows, key):
        vals = _series(rows, key)[1]
        return sum(vals) / len(vals) if vals else None

    def fmt(v):
        return "-" if v is None else f"{v:.4g}"

    lines = [
        "| run | steps | entropy first -> last | reward last | held-out acc (first -> last) | beta1-region share (mean) "
        "| beta2-region share (mean) | dH NA_LP / PA_LP (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        rows = data[r]
        accs = evals[r][1]
        entropies = _series(rows, "entropy")[1]
        first_h = entropies[0] if entropies else None
        lines.append(
            f"| {labels[r]} | {len(rows)} | {fmt(first_h)} -> {fmt(last(rows, 'entropy'))} | {fmt(last(rows, 'reward/mean'))} "
            f"| {fmt(accs[0] if accs else None)} -> {fmt(accs[-1] if accs else None)} | {fmt(mean(rows, 'clip/low_frac'))} "
            f"| {fmt(mean(rows, 'clip/high_frac'))} | {fmt(mean(rows, 'quadrant/NA_LP/dH'))} / {fmt(mean(rows, 'quadrant/PA_LP/dH'))} |"
        )
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
