"""PNG plots of runs (matplotlib, headless): one run's curves -> ``training_curves.png`` (:func:`plot_run`), and
the shared pieces :mod:`cegppo.reporting.compare` lays side by side.

Conventions: every axes has an x and a y label with units; held-out accuracy is drawn as points (separate
evaluations, not a trend), one marker per eval.jsonl tag; clip shares are in percent of response tokens;
legends sit outside the axes, so they never cover data."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from cegppo.config import ConfigError, load_yaml, read_config_text, show
from cegppo.io import atomic_write_bytes, read_jsonl

EVAL_TAGS = ("base", "warm-start", "periodic", "final")  # eval.jsonl rows that are held-out accuracy points
TAG_MARKERS = {"base": "v", "warm-start": "s", "periodic": "o", "final": "*"}
TAG_COLORS = {"base": "grey", "warm-start": "C1", "periodic": "C2", "final": "C3"}
BETA_KEYS = ("control/beta1", "control/beta2")  # logged by an entropy controller, when one runs
LOG_SPAN = 10.0  # entropy goes on a log axis when its positive values span more than this factor

STEP_LABEL = "RL step"
ENTROPY_LABEL = "entropy (nats/token)"
ACCURACY_LABEL = "accuracy (fraction correct)"
REWARD_LABEL = "reward (mean per response)"
PERCENT_LABEL = "% of response tokens"
BETA_LABEL = "β (gradient weight)"


def pyplot():
    """``matplotlib.pyplot`` on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that hold a number under ``key``."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def save_png(fig, out: str | Path) -> Path:
    """Write ``fig`` as a PNG atomically (110 dpi); the figure is left open."""
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(out, buf.getvalue())
    return Path(out)


def wrap(text: str, width: int) -> str:
    return textwrap.fill(text, width, break_long_words=False)


def objective_defaults(objective: str) -> dict:
    """The hyperparameters an objective uses when the config leaves them out (eps 0.2 / 0.2 if it is unknown)."""
    try:
        from cegppo.algorithm.objectives import OBJECTIVES

        return {"eps_low": 0.2, "eps_high": 0.2, **OBJECTIVES[objective].defaults}
    except (ImportError, KeyError, AttributeError):
        return {"eps_low": 0.2, "eps_high": 0.2}


def eval_points(run_dir: Path, rows: list[dict]) -> list[dict]:
    """Held-out accuracy points, one per (step, tag) (the last written), base before warm-start at step 0.
    ``val/accuracy`` in the metrics fills in periodic points that eval.jsonl lacks."""
    pts = {(e["step"], e["tag"]): e for e in read_jsonl(run_dir / "eval.jsonl", int_keys=("step",))
           if e.get("tag") in EVAL_TAGS and isinstance(e.get("accuracy"), (int, float))}
    for step, acc in zip(*series(rows, "val/accuracy")):
        pts.setdefault((step, "periodic"), {"step": step, "tag": "periodic", "accuracy": acc})
    return sorted(pts.values(), key=lambda e: (e["step"], EVAL_TAGS.index(e["tag"])))


def read_run_config(path: Path) -> dict:
    """A run's ``config.yaml`` as a mapping ({} when there is none), read by the config loader's bounded parser;
    the parts a plot reads (``algorithm``, its ``hparams``, ``objective``) must have their shapes."""
    if not path.exists() and not path.is_symlink():
        return {}
    tree = load_yaml(read_config_text(path), str(path))
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config sections, got {type(tree).__name__} "
                          f"{show(tree)}")
    algorithm = tree.get("algorithm")
    if algorithm is not None:
        if not isinstance(algorithm, dict):
            raise ConfigError(f"{path}: algorithm must be a mapping, got {type(algorithm).__name__} {show(algorithm)}")
        hp, objective = algorithm.get("hparams"), algorithm.get("objective")
        if hp is not None and not (isinstance(hp, dict) and all(isinstance(k, str) for k in hp)):
            raise ConfigError(f"{path}: algorithm.hparams must be a mapping of names to values, got {show(hp)}")
        if objective is not None and not isinstance(objective, str):
            raise ConfigError(f"{path}: algorithm.objective must be a name, got {show(objective)}")
    return tree


@dataclass
class Run:
    """One run directory, read once: metrics rows, held-out accuracy points and config."""

    path: Path
    rows: list[dict]
    evals: list[dict]
    config: dict

    @classmethod
    def load(cls, run_dir: str | Path) -> Run:
        """Read through the hardened loaders (bounded YAML, checked JSON lines): a hostile or damaged file is a
        one-line ``ValueError`` (``ConfigError``) naming it."""
        path = Path(run_dir)
        rows = read_jsonl(path / "metrics.jsonl", int_keys=("step",))
        return cls(path, rows, eval_points(path, rows), read_run_config(path / "config.yaml"))

    @property
    def objective(self) -> str:
        return (self.config.get("algorithm") or {}).get("objective", "?")

    @property
    def hparams(self) -> dict:
        """The configured hyperparameters over the objective's defaults."""
        return {**objective_defaults(self.objective), **((self.config.get("algorithm") or {}).get("hparams") or {})}

    @property
    def label(self) -> str:
        if not self.config:
            return self.path.name
        hp = ", ".join(f"{k}={v}" for k, v in sorted(self.hparams.items()))
        return f"{self.path.name}: {self.objective} ({hp})"

    def has(self, *keys: str) -> bool:
        return any(isinstance(r.get(k), (int, float)) for r in self.rows for k in keys)

    def accuracy(self, tag: str) -> float | None:
        """The last held-out accuracy with this tag."""
        accs = [e["accuracy"] for e in self.evals if e["tag"] == tag]
        return accs[-1] if accs else None


def style(ax, title: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set(title=title, xlabel=STEP_LABEL, ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if not ax.has_data():
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")


def log_if_spread(ax, values: list[float]) -> None:
    """Log y axis when all values are positive and span more than LOG_SPAN (e.g. entropies 0.03 and 2.3)."""
    if values and min(values) > 0 and max(values) / min(values) > LOG_SPAN:
        ax.set_yscale("log")


def legend_right(ax, **kw) -> None:
    """The axes' legend, outside on its right (constrained layout makes room for it)."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, **kw)


def draw_held_out(ax, run: Run, color: str | None = None, annotate: bool = False) -> None:
    """Held-out accuracy: markers only (no line), one marker per tag; ``color`` None colours by tag."""
    for tag in EVAL_TAGS:
        pts = [e for e in run.evals if e["tag"] == tag]
        if pts:
            ax.plot([e["step"] for e in pts], [e["accuracy"] for e in pts], ls="none", marker=TAG_MARKERS[tag],
                    ms=10 if tag == "final" else 7, mec="black", mew=0.6, color=color or TAG_COLORS[tag],
                    label=f"held-out: {tag}", zorder=3)
    if annotate and run.evals:
        mid = (min(e["step"] for e in run.evals) + max(e["step"] for e in run.evals)) / 2
        stacked: dict[int, int] = {}  # texts above points already placed at a step (periodic and final at one step)
        for e in run.evals:
            right = e["step"] > mid  # text toward the middle, so it stays inside the axes
            text = f"{e['accuracy']:.2f}" if e["tag"] == "periodic" else f"{e['tag']} {e['accuracy']:.2f}"
            if e["tag"] == "base" or e["accuracy"] > 0.9:
                dy = -13
            else:
                dy = 5 + 10 * stacked.get(e["step"], 0)
                stacked[e["step"]] = stacked.get(e["step"], 0) + 1
            ax.annotate(text, (e["step"], e["accuracy"]), textcoords="offset points", fontsize=7,
                        xytext=(-7 if right else 7, dy), ha="right" if right else "left")
    ax.set_ylim(-0.12 if annotate else -0.05, 1.05)


def draw_betas(ax, run: Run, color: str | None = None) -> None:
    """β1 solid, β2 dashed."""
    for key, ls in zip(BETA_KEYS, ("-", "--")):
        xs, ys = series(run.rows, key)
        if xs:
            ax.plot(xs, ys, ls=ls, color=color, label=key.split("/")[1].replace("beta", "β"))


def run_figure(run_dir: str | Path):
    """The Figure behind ``training_curves.png``: entropy, train reward, accuracy (train and held-out), clip
    shares, and the controller's β1 / β2 when the metrics log them."""
    plt = pyplot()
    run = Run.load(run_dir)
    betas = run.has(*BETA_KEYS)
    n = 5 if betas else 4
    fig, axes = plt.subplots(-(-n // 2), 2, figsize=(12, 3.6 * -(-n // 2)), layout="constrained", squeeze=False)
    axes = list(axes.flat)
    for ax in axes[n:]:
        ax.remove()

    ax = axes[0]
    xs, ys = series(run.rows, "entropy")
    ax.plot(xs, ys, color="C0")
    style(ax, "Rollout policy entropy", ENTROPY_LABEL)
    log_if_spread(ax, ys)

    ax = axes[1]
    ax.plot(*series(run.rows, "reward/mean"), color="C0")
    rw = run.config.get("reward") or {}
    scores = f" (correct {rw['correct_score']:+g}, wrong {rw['incorrect_score']:+g})" if {
        "correct_score", "incorrect_score"} <= rw.keys() else ""
    style(ax, "Train reward" + scores, REWARD_LABEL)

    ax = axes[2]
    ax.plot(*series(run.rows, "reward/accuracy"), color="C0", alpha=0.6, lw=1, label="train rollouts")
    draw_held_out(ax, run, annotate=True)
    style(ax, "Accuracy (train, held-out)", ACCURACY_LABEL)
    legend_right(ax)

    ax = axes[3]
    hp = run.hparams
    regions = ("β1 region", "β2 region") if "beta1" in hp else ("low clip", "high clip")
    for key, region, cond, eps, color in (("clip/low_frac", regions[0], "A<0, r<1−eps_low", "eps_low", "C0"),
                                          ("clip/high_frac", regions[1], "A>0, r>1+eps_high", "eps_high", "C3")):
        xs, ys = series(run.rows, key)
        ax.plot(xs, [100 * y for y in ys], color=color, label=wrap(f"{region}: {cond} ({eps}={hp[eps]:g})", 26))
    style(ax, "Tokens outside the clip interval", PERCENT_LABEL)
    legend_right(ax)

    if betas:
        draw_betas(axes[4], run, color="C4")
        style(axes[4], "Controller β1 (solid), β2 (dashed)", BETA_LABEL)
        legend_right(axes[4])
    fig.suptitle(f"{run.path.name}: {run.objective}")
    return fig


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write :func:`run_figure` to ``out`` (default ``RUN_DIR/training_curves.png``)."""
    fig = run_figure(run_dir)
    try:
        return save_png(fig, Path(out) if out else Path(run_dir) / "training_curves.png")
    finally:
        pyplot().close(fig)
