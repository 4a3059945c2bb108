"""PNG plots of runs (matplotlib, headless): one run's curves, and several runs side by side."""

from __future__ import annotations

from io import BytesIO
from pathlib import Path

from cegppo.algorithm.diagnostics import QUADRANTS
from cegppo.io import atomic_write_bytes, read_jsonl


EVAL_TAGS = ("periodic", "final", "warm-start", "base")  # eval.jsonl rows that are held-out accuracy points


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _save(fig, out: Path) -> Path:
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(out, buf.getvalue())
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Entropy and reward / accuracy over steps of one run -> ``training_curves.png``."""
    plt = _plt()
    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    axes[0].plot(*_series(rows, "entropy"), label="rollout policy entropy")
    axes[0].set(title="Entropy (nats/token)", xlabel="RL step")
    axes[1].plot(*_series(rows, "reward/mean"), label="reward (mean)")
    axes[1].plot(*_series(rows, "reward/accuracy"), label="train accuracy")
    periodic = [e for e in evals if e.get("tag") in EVAL_TAGS]
    if periodic:
        axes[1].plot([e["step"] for e in periodic], [e["accuracy"] for e in periodic], "o--", label="held-out accuracy")
        for e in periodic:
            if e["tag"] != "periodic":
                axes[1].annotate(f"{e['tag']} {e['accuracy']:.2f}", (e["step"], e["accuracy"]), fontsize=7,
                                 xytext=(4, -10 if e["tag"] == "base" else 4), textcoords="offset points")
    axes[1].set(title="Reward and accuracy", xlabel="RL step")
    axes[1].legend(fontsize=8)
    axes[2].plot(*_series(rows, "clip/low_frac"), label="beta1 region (A<0, r<1-eps)")
    axes[2].plot(*_series(rows, "clip/high_frac"), label="beta2 region (A>0, r>1+eps)")
    axes[2].set(title="Tokens outside the clip interval", xlabel="RL step")
    axes[2].legend(fontsize=8)
    fig.suptitle(run_dir.name)
    out = Path(out) if out else run_dir / "training_curves.png"
    path = _save(fig, out)
    plt.close(fig)
    return path


COMPARE_PANELS = [
    ("entropy", "Policy entropy (nats/token)"),
    ("reward/mean", "Reward (mean)"),
    ("reward/accuracy", "Train accuracy"),
    ("val/accuracy", "Held-out accuracy"),
    ("clip/low_frac", "beta1 region share (A<0, r<1-eps_low)"),
    ("clip/high_frac", "beta2 region share (A>0, r>1+eps_high)"),
] + [(f"quadrant/{q}/dH", f"{q}: first-order entropy change") for q in QUADRANTS]


def run_label(run_dir: Path) -> str:
    import yaml

    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        return run_dir.name
    cfg = yaml.safe_load(cfg_path.read_text())
    a = cfg.get("algorithm", {})
    hp = ", ".join(f"{k}={v}" for k, v in sorted((a.get("hparams") or {}).items()))
    return f"{run_dir.name}: {a.get('objective', '?')}" + (f" ({hp})" if hp else "")
