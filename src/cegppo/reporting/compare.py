"""``cegppo compare RUN_DIR... --out DIR``: ``compare.png`` (every panel), one ``<metric>.png`` per quantity (a
line per run) and ``summary.md``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cegppo.algorithm.diagnostics import QUADRANTS
from cegppo.engine.runlock import claim_outputs
from cegppo.io import atomic_write_text, create_new_file, fsync_dir
from cegppo.reporting.plots import (
    ACCURACY_LABEL, BETA_KEYS, BETA_LABEL, ENTROPY_LABEL, EVAL_TAGS, PERCENT_LABEL, REWARD_LABEL, TAG_MARKERS, Run,
    draw_betas, draw_held_out, legend_right, log_if_spread, pyplot, save_png, series, style, wrap,
)

HELD_OUT = "val/accuracy"  # drawn from eval.jsonl (every tag), not only the metrics' periodic val/accuracy
BETAS = "control/beta"  # both controller betas in one panel
DH_LABEL = "first-order entropy change\nper token (nats per unit step)"
QUADRANT_NAMES = {"PA_HP": "A>0, high-p", "PA_LP": "A>0, low-p", "NA_HP": "A<0, high-p", "NA_LP": "A<0, low-p"}
PANELS = [
    ("entropy", "Rollout policy entropy", ENTROPY_LABEL),
    ("reward/mean", "Train reward", REWARD_LABEL),
    ("reward/accuracy", "Train accuracy (rollouts)", ACCURACY_LABEL),
    (HELD_OUT, "Held-out accuracy", ACCURACY_LABEL),
    ("clip/low_frac", "β1 region: A<0, r<1−eps_low", PERCENT_LABEL),
    ("clip/high_frac", "β2 region: A>0, r>1+eps_high", PERCENT_LABEL),
] + [(f"quadrant/{q}/dH", f"dH of {q} tokens ({QUADRANT_NAMES[q]})", DH_LABEL) for q in QUADRANTS]
BETA_PANEL = (BETAS, "Controller β1 (solid), β2 (dashed)", BETA_LABEL)


def has_data(runs: list[Run], key: str) -> bool:
    if key == HELD_OUT:
        return any(r.evals for r in runs)
    return any(r.has(*(BETA_KEYS if key == BETAS else (key,))) for r in runs)


def draw_panel(ax, runs: list[Run], key: str, title: str, ylabel: str) -> None:
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        if key == HELD_OUT:
            draw_held_out(ax, run, color=color)
        elif key == BETAS:
            draw_betas(ax, run, color=color)
        else:
            xs, ys = series(run.rows, key)
            ax.plot(xs, [100 * y for y in ys] if key.startswith("clip/") else ys, color=color, lw=1.2)
    style(ax, title, ylabel)
    if key == "entropy":
        log_if_spread(ax, [v for r in runs for v in series(r.rows, key)[1]])
    if key.endswith("/dH"):
        ax.axhline(0.0, color="grey", lw=0.6)
    if key in (HELD_OUT, BETAS) and ax.has_data():  # markers / line styles, in black: colours are the runs
        from matplotlib.lines import Line2D

        if key == HELD_OUT:
            tags = [t for t in EVAL_TAGS if any(e["tag"] == t for r in runs for e in r.evals)]
            handles = [Line2D([], [], ls="none", marker=TAG_MARKERS[t], color="white", mec="black", label=t)
                       for t in tags]
        else:
            handles = [Line2D([], [], color="black", ls=ls, label=b) for ls, b in (("-", "β1"), ("--", "β2"))]
        legend_right(ax, handles=handles, title="eval tag" if key == HELD_OUT else None)


def compare_figure(runs: list[Run], keys: list[str] | None = None):
    """All panels (or those named in ``keys``), one colour per run; the run legend below the panels."""
    from matplotlib.lines import Line2D

    panels = PANELS + ([BETA_PANEL] if has_data(runs, BETAS) else [])
    panels = [p for p in panels if keys is None or p[0] in keys]
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    size = (7, 4.2) if cols == 1 else (4.8 * cols, 3.3 * nrows)
    fig, axes = pyplot().subplots(nrows, cols, figsize=(size[0], size[1] + 0.4 * len(runs)), layout="constrained",
                                  squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        draw_panel(ax, runs, *panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.remove()
    handles = [Line2D([], [], color=f"C{i % 10}", lw=2, label=wrap(r.label, 70 if cols == 1 else 90))
               for i, r in enumerate(runs)]
    fig.legend(handles=handles, loc="outside lower center", ncol=1 if cols == 1 else min(len(runs), 2), fontsize=8)
    if cols > 1:
        fig.suptitle(f"{len(runs)} runs compared")
    return fig


def output_names() -> list[str]:
    """Every file name ``compare_runs`` may write into its output directory."""
    return ["compare.png"] + [k.replace("/", "_") + ".png" for k, *_ in PANELS + [BETA_PANEL]] + ["summary.md"]


def check_output(runs: list[Path], out: Path) -> None:
    """Before reading anything: ``out`` must not be one of the runs or inside one (an input), nor hold a file this
    command writes (an earlier comparison is never overwritten). Raises a one-line ``ValueError``."""
    for r in runs:
        if out.resolve() == r.resolve() or r.resolve() in out.resolve().parents:
            raise ValueError(f"--out {out} is inside the compared run {r} (an input); give a directory outside the "
                             f"runs")
    held = [n for n in output_names() if (out / n).exists() or (out / n).is_symlink()]
    if held:
        raise ValueError(f"--out {out} already holds {', '.join(held[:4])}{', ...' if len(held) > 4 else ''} (an "
                         f"earlier comparison?); they would be overwritten: give a new directory, or remove them")


def compare_runs(runs: list[Path], out: Path) -> list[Path]:
    """Write ``compare.png`` (all panels), one ``<metric>.png`` per panel with data, and ``summary.md`` into ``out``
    (refused up front when that would overwrite a file or write into a compared run). ``out`` is claimed for the
    whole command (a second ``compare`` into it is refused); every file is written into a temporary directory
    beside it, then moved in, each whole and without replacing anything (summary.md last)."""
    for r in runs:
        if not (r / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{r} is not a cegppo run directory (no metrics.jsonl)")

    def check() -> None:
        check_output(runs, out)
        out.parent.mkdir(parents=True, exist_ok=True)  # where the claim's lock file goes

    with claim_outputs([out], "--out", check):
        loaded = [Run.load(r) for r in runs]
        tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            names = write_comparison(loaded, tmp)
            return publish(tmp, out, names)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def write_comparison(loaded: list[Run], into: Path) -> list[str]:
    """The comparison's files in ``into``; their names, summary.md last."""
    plt = pyplot()
    names = []
    for name, keys in [("compare", None)] + [(k.replace("/", "_"), [k]) for k, *_ in PANELS + [BETA_PANEL]
                                             if has_data(loaded, k)]:
        fig = compare_figure(loaded, keys)
        names.append(save_png(fig, into / f"{name}.png").name)
        plt.close(fig)
    names.append(summary_table(loaded, into / "summary.md").name)
    return names


def publish(tmp: Path, out: Path, names: list[str]) -> list[Path]:
    """Move the finished files from ``tmp`` into ``out``: the whole directory at once when ``out`` is new, else each
    file hard-linked in (never replacing one; :func:`cegppo.io.create_new_file`'s rule)."""
    if not out.exists():
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return [out / n for n in names]
    for n in names:
        create_new_file(out / n, (tmp / n).read_bytes())
    return [out / n for n in names]


def summary_table(runs: list[Run], path: Path) -> Path:
    def fmt(v, scale=1.0):
        return "-" if v is None else f"{scale * v:.4g}"

    def mean(vals):
        return sum(vals) / len(vals) if vals else None

    lines = [
        "| run | steps | entropy first -> last (nats/token) | reward last | held-out acc base -> warm-start -> final "
        "| β1-region % of tokens (mean) | β2-region % of tokens (mean) | dH NA_LP / PA_LP (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        col = {k: series(run.rows, k)[1] for k in ("entropy", "reward/mean", "clip/low_frac", "clip/high_frac",
                                                  "quadrant/NA_LP/dH", "quadrant/PA_LP/dH")}
        h, rew = col["entropy"], col["reward/mean"]
        final = run.accuracy("final")
        if final is None:  # no final eval: the last periodic one
            final = run.accuracy("periodic")
        lines.append(
            f"| {run.label} | {len(run.rows)} | {fmt(h[0] if h else None)} -> {fmt(h[-1] if h else None)} "
            f"| {fmt(rew[-1] if rew else None)} "
            f"| {fmt(run.accuracy('base'))} -> {fmt(run.accuracy('warm-start'))} -> {fmt(final)} "
            f"| {fmt(mean(col['clip/low_frac']), 100)} | {fmt(mean(col['clip/high_frac']), 100)} "
            f"| {fmt(mean(col['quadrant/NA_LP/dH']))} / {fmt(mean(col['quadrant/PA_LP/dH']))} |"
        )
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
