"""Evaluation (an engine phase: generate and grade): k samples per problem -> avg@k, pass@k (unbiased estimator) and maj@k per data source."""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

from cegppo.data.problems import Problem
from cegppo.data.rewards import RewardFn, last_boxed
from cegppo.engine.rollout import RolloutEngine, Sampling
from cegppo.engine.reporter import Reporter


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: list[str | None], correct: list[bool]) -> bool:
    """maj@k: the most common extracted answer (ties: the one seen first) decides; no answer never wins."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    best = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == best)
    return correct[answers.index(winner)]


def _normalise(answer: str | None) -> str | None:
    return None if answer is None else " ".join(answer.split()).strip("$ ") or None


@dataclass
class EvalResult:
    summary: dict[str, dict[str, float]]  # data_source -> {avg@k, pass@k, maj@k, pass@1, num_problems}
    rows: list[dict]  # one per problem

    def headline(self, metric: str = "avg@k") -> float:
        """Mean of ``metric`` over data sources (the paper averages benchmarks with equal weight)."""
        vals = [s[metric] for s in self.summary.values()]
        return sum(vals) / len(vals) if vals else 0.0


def evaluate(
    engine: RolloutEngine,
    problems: list[Problem],
    reward_fn: RewardFn,
    k: int = 1,
    sampling: Sampling | None = None,
    batch_prompts: int = 16,
    progress: Reporter | None = None,
) -> EvalResult:
    """Sample ``k`` responses per (de-duplicated) problem and grade them."""
    sampling = sampling or Sampling(temperature=0.0)
    rows = []
    t0, generated = time.perf_counter(), 0
    for s in range(0, len(problems), batch_prompts):
        chunk = problems[s : s + batch_prompts]
        if progress is not None:
            progress.phase(f"generate {len(chunk)} x {k}")
        batch = engine.generate([p.messages for p in chunk], k, sampling,
                                on_token=progress.on_token if progress is not None else None)
        generated += int(batch.response_mask.sum())
        if progress is not None:
            progress.advance(len(chunk), tok_s=generated / (time.perf_counter() - t0))
        graded = reward_fn(batch.texts, [p.answer for p in chunk for _ in range(k)])
        for i, p in enumerate(chunk):
            texts = batch.texts[i * k : (i + 1) * k]
            correct = graded.correct[i * k : (i + 1) * k]
            answers = [_normalise(last_boxed(t)) for t in texts]
            c = sum(correct)
            rows.append({
                "id": p.id, "data_source": p.data_source, "copies": p.copies, "answer": p.answer, "k": k,
                "num_correct": c, "avg@k": c / k, "pass@k": pass_at_k(k, c, k), "maj@k": float(majority_correct(answers, correct)),
                "extracted": answers, "truncated": batch.truncated[i * k : (i + 1) * k].tolist(),
                "responses": texts,
            })
    by_source: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_source[r["data_source"] or "data"].append(r)
    summary = {
        src: {
            "num_problems": len(rs),
            "avg@k": sum(r["avg@k"] for r in rs) / len(rs),
            "pass@k": sum(r["pass@k"] for r in rs) / len(rs),
            "maj@k": sum(r["maj@k"] for r in rs) / len(rs),
            "k": k,
        }
        for src, rs in by_source.items()
    }
    return EvalResult(summary, rows)
