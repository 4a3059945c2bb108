"""training_curves.png and compare: labelled axes, held-out accuracy as points (base kept), log entropy across
orders of magnitude, legends clear of every axes, controller betas when logged. Built on fake run directories."""

import json
import math

import pytest
import yaml

from cegppo.reporting.compare import HELD_OUT, compare_figure, compare_runs
from cegppo.reporting.plots import Run, plot_run, pyplot, run_figure

QUADS = ("PA_HP", "PA_LP", "NA_HP", "NA_LP")
EVALS = [{"step": 0, "tag": "base", "accuracy": 0.0}, {"step": 0, "tag": "warm-start", "accuracy": 0.5},
         {"step": 2, "tag": "periodic", "accuracy": 0.6}, {"step": 4, "tag": "final", "accuracy": 0.7}]


def make_run(root, name, objective="ce_gppo", hparams=None, entropy=0.08, steps=4, betas=False, evals=EVALS):
    d = root / name
    d.mkdir()
    hp = {"eps_low": 0.2, "eps_high": 0.28, "beta1": 0.75, "beta2": 1.0} if hparams is None else hparams
    cfg = {"algorithm": {"objective": objective, "hparams": hp},
           "reward": {"correct_score": 1.0, "incorrect_score": -1.0}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for s in range(1, steps + 1):
        acc = 0.4 + 0.1 * s % 0.5
        row = {"step": s, "entropy": entropy / s, "reward/mean": 2 * acc - 1, "reward/accuracy": acc,
               "clip/low_frac": 0.002 * s, "clip/high_frac": 0.001 * (s % 2)}
        row.update({f"quadrant/{q}/dH": (-1) ** i * 1e-3 * s for i, q in enumerate(QUADS)})
        if s == 2:
            row["val/accuracy"] = 0.6
        if betas:
            row.update({"control/beta1": 0.75 + 0.05 * s, "control/beta2": 1.0 - 0.02 * s})
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return d


def held_out_lines(ax):
    return [ln for ln in ax.get_lines() if ln.get_label().startswith("held-out")] or \
        [ln for ln in ax.get_lines() if ln.get_marker() not in (None, "None", "")]


def assert_readable(fig, panels):
    """Panel count; every axes labelled; no legend over any axes (its own: frame, ticks, labels, annotations;
    the others: everything) or past the figure's edge."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert len(fig.axes) == panels
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), ax.get_title()
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert legends
    for leg in legends:
        box = leg.get_window_extent(r)
        assert fig.bbox.containsx(box.x0) and fig.bbox.containsx(box.x1) and box.y0 >= 0 and box.y1 <= fig.bbox.y1
        for ax in fig.axes:
            own = ax.get_legend() is leg
            area = ax.get_tightbbox(r, bbox_extra_artists=ax.texts) if own else ax.get_tightbbox(r)
            assert not box.overlaps(area), f"legend {[t.get_text() for t in leg.get_texts()]} over {ax.get_title()!r}"


def test_overlap_check_catches_a_legend_on_the_data():
    fig, ax = pyplot().subplots(layout="constrained")
    ax.plot([0, 1], [0, 1], label="a line")
    ax.set(xlabel="x", ylabel="y", title="t")
    ax.legend(loc="upper left")
    with pytest.raises(AssertionError, match="legend"):
        assert_readable(fig, 1)
    pyplot().close(fig)


def test_training_curves(tmp_path):
    run = make_run(tmp_path, "r")
    fig = run_figure(run)
    assert_readable(fig, 4)
    entropy, reward, acc, clip = fig.axes
    assert "nats/token" in entropy.get_ylabel() and entropy.get_yscale() == "linear"
    assert [ln.get_ydata()[0] for ln in reward.get_lines()] == [pytest.approx(2 * 0.5 - 1)]  # reward alone
    points = {ln.get_label(): ln for ln in acc.get_lines() if ln.get_label().startswith("held-out")}
    assert set(points) == {"held-out: base", "held-out: warm-start", "held-out: periodic", "held-out: final"}
    for ln in points.values():
        assert ln.get_linestyle() == "None" and ln.get_marker() not in ("None", "", None)
    assert list(points["held-out: base"].get_xdata()) == [0] and list(points["held-out: base"].get_ydata()) == [0.0]
    assert list(points["held-out: warm-start"].get_xdata()) == [0]
    assert points["held-out: base"].get_marker() != points["held-out: warm-start"].get_marker()
    notes = {t.get_text() for t in acc.texts}
    assert {"base 0.00", "warm-start 0.50", "0.60", "final 0.70"} <= notes
    assert "%" in clip.get_ylabel()
    assert list(clip.get_lines()[0].get_ydata()) == pytest.approx([0.2, 0.4, 0.6, 0.8])  # percent, not fraction
    legend = " ".join(t.get_text().replace("\n", " ") for t in clip.get_legend().get_texts())
    assert "eps_low=0.2" in legend and "eps_high=0.28" in legend and "β1 region" in legend

    path = plot_run(run)
    assert path == run / "training_curves.png"
    img = pyplot().imread(path)
    w, h = fig.get_size_inches() * 110
    assert img.shape[:2] == (round(h), round(w))
    pyplot().close(fig)


def test_training_curves_defaults_log_entropy_and_betas(tmp_path):
    run = make_run(tmp_path, "g", objective="grpo", hparams={}, entropy=2.3, steps=12, betas=True)
    fig = run_figure(run)
    assert_readable(fig, 5)
    assert fig.axes[0].get_yscale() == "log"  # 2.3 -> 0.19 spans 12x
    legend = " ".join(t.get_text().replace("\n", " ") for t in fig.axes[3].get_legend().get_texts())
    assert "eps_low=0.2" in legend and "eps_high=0.2" in legend  # grpo's defaults, config had none
    assert "low clip" in legend and "β1" not in legend  # grpo has no beta1
    beta = fig.axes[4]
    assert [ln.get_label() for ln in beta.get_lines()] == ["β1", "β2"]
    assert beta.get_lines()[0].get_ydata()[-1] == pytest.approx(0.75 + 0.6)
    pyplot().close(fig)


@pytest.mark.parametrize("entropies, scale", [((2.3, 0.05), "log"), ((0.08, 0.05), "linear")])
def test_compare_entropy_scale(tmp_path, entropies, scale):
    runs = [Run.load(make_run(tmp_path, f"r{i}", entropy=h)) for i, h in enumerate(entropies)]
    fig = compare_figure(runs, ["entropy"])
    assert fig.axes[0].get_yscale() == scale
    assert_readable(fig, 1)
    pyplot().close(fig)


def test_compare_figure(tmp_path):
    runs = [Run.load(make_run(tmp_path, "cegppo", betas=True)),
            Run.load(make_run(tmp_path, "a-run-with-a-long-name-grpo", objective="grpo", hparams={}, entropy=0.05))]
    fig = compare_figure(runs)
    assert_readable(fig, 11)  # 10 panels + the controller's betas (one run logs them)
    by_title = {ax.get_title(): ax for ax in fig.axes}
    held = by_title["Held-out accuracy"]
    lines = held.get_lines()
    assert lines and all(ln.get_linestyle() == "None" for ln in lines)
    at_zero = {(ln.get_label(), ln.get_color()) for ln in lines if 0 in list(ln.get_xdata())}
    assert {lbl for lbl, _ in at_zero} == {"held-out: base", "held-out: warm-start"} and len(at_zero) == 4
    assert [t.get_text() for t in held.get_legend().get_texts()] == ["base", "warm-start", "periodic", "final"]
    for ax in fig.axes:
        if ax.get_title().startswith("dH of"):
            assert "nats per unit step" in ax.get_ylabel() and "entropy change" in ax.get_ylabel()
    run_legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "eps_high=0.2" in run_legend[1] and "eps_high=0.28" in run_legend[0]
    assert run_legend[1].replace("\n", " ").endswith("grpo (clip_ratio_c=None, eps_high=0.2, eps_low=0.2)")
    pyplot().close(fig)


def test_compare_runs_files_and_summary(tmp_path):
    dirs = [make_run(tmp_path, "cegppo"), make_run(tmp_path, "grpo", objective="grpo", hparams={}, entropy=2.3)]
    paths = compare_runs(dirs, tmp_path / "cmp")
    names = {p.name for p in paths}
    assert {"compare.png", "entropy.png", "val_accuracy.png", "clip_low_frac.png", "quadrant_NA_LP_dH.png",
            "summary.md"} <= names and "control_beta.png" not in names
    for p in paths:
        if p.suffix == ".png":
            h, w = pyplot().imread(p).shape[:2]
            assert 300 < w < 3000 and 300 < h < 3000, (p.name, w, h)
    for key in ("entropy", HELD_OUT, "clip/low_frac"):  # the per-metric figures: legend below, clear of the axes
        fig = compare_figure([Run.load(d) for d in dirs], [key])
        assert_readable(fig, 1)
        pyplot().close(fig)
    table = (tmp_path / "cmp" / "summary.md").read_text()
    assert "base -> warm-start -> final" in table and "first -> last)" not in table
    assert "| 0 -> 0.5 -> 0.7 |" in table
    assert f"| {100 * (0.002 + 0.004 + 0.006 + 0.008) / 4:.4g} |" in table  # clip share in percent
    assert math.isclose(float(table.splitlines()[3].split("|")[3].split("->")[0]), 2.3)
