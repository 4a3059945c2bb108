"""Evaluation (an engine phase: generate and grade): k samples per problem -> avg@k, pass@k (unbiased estimator) and
maj@k per data source (maj@k votes over the answers the grader judged, so maj@k <= pass@k and maj@1 = avg@1),
each beside the number of graded items the scorer failed or timed out on (a failed item
scores incorrect: a broken grader must not read as a weak model)."""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from cegppo.data.problems import Problem
from cegppo.data.rewards import RewardFn
from cegppo.engine.rollout import Generator, Sampling
from cegppo.engine.reporter import Reporter


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: list[str | None], correct: list[bool]) -> bool:
    """maj@k: the most common answer (ties: the one seen first) decides, with the grader's verdict on its first
    occurrence; no answer (None) never wins. With :func:`judged_answers`' answers, maj@k <= pass@k (the winner is
    one of the graded items) and maj@1 = avg@1 (an item without an answer was judged incorrect)."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    best = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == best)
    return correct[answers.index(winner)]


def _normalise(answer: str | None) -> str | None:
    return None if answer is None else " ".join(answer.split()).strip("$ ") or None


def judged_answers(texts: list[str], correct: list[bool], answers: list[str | None] | None) -> list[str | None]:
    """What maj@k votes over, per response: the answer the grader judged (``RewardResult.answers``: the extraction
    the reward used), normalised; where the reward reports none, the normalised response itself (an empty
    response too: the grader judged it). None, which never wins a vote, only for an item the grader judged
    incorrect without an answer; an item judged correct always votes (its response stands in for a missing
    answer)."""
    if answers is None or len(answers) != len(texts):
        return [" ".join(t.split()) for t in texts]
    return [_normalise(a) if _normalise(a) is not None or not ok else " ".join(t.split())
            for t, ok, a in zip(texts, correct, answers)]


class ScorerFailedError(ValueError):
    """The scorer failed on every graded item of a data source: its accuracy measures the grader, not the model."""


@dataclass
class EvalResult:
    # data_source -> {num_problems, k, avg@k, pass@k, maj@k, graded, scorer_failures, scorer_timeouts}
    summary: dict[str, dict[str, float]]
    rows: list[dict]  # one per problem
    failure_messages: list[str] = field(default_factory=list)  # the scorer's first few failures

    def headline(self, metric: str = "avg@k") -> float:
        """Mean of ``metric`` over data sources (the paper averages benchmarks with equal weight)."""
        vals = [s[metric] for s in self.summary.values()]
        return sum(vals) / len(vals) if vals else 0.0

    def total(self, key: str) -> int:
        """``graded``, ``scorer_failures`` or ``scorer_timeouts`` summed over data sources."""
        return sum(int(s.get(key, 0)) for s in self.summary.values())

    def all_failed(self) -> list[str]:
        """The data sources on whose every graded item the scorer failed."""
        return [src for src, s in self.summary.items() if s.get("graded") and s["scorer_failures"] == s["graded"]]

    def failure_note(self) -> str | None:
        """One line on the scorer's failures (None when there were none): how many, where, the first message."""
        failed = self.total("scorer_failures")
        if not failed:
            return None
        where = ", ".join(f"{src}: {int(s['scorer_failures'])} of {int(s['graded'])}"
                          for src, s in self.summary.items() if s["scorer_failures"])
        first = f"; first: {self.failure_messages[0]}" if self.failure_messages else ""
        return (f"the scorer failed on {failed} of {self.total('graded')} graded items "
                f"({self.total('scorer_timeouts')} timed out; {where}){first}")

    def check_scorer(self, what: str) -> None:
        """Raise :class:`ScorerFailedError` when the scorer failed on every item of some data source."""
        dead = self.all_failed()
        if dead:
            raise ScorerFailedError(
                f"{what}: the scorer failed on every graded item of {', '.join(dead)} ({self.failure_note()}); the "
                f"accuracy {self.headline():.4f} measures the reward function, not the model: fix the reward")


def evaluate(
    generator: Generator,
    problems: list[Problem],
    reward_fn: RewardFn,
    k: int = 1,
    sampling: Sampling | None = None,
    batch_prompts: int = 16,
    progress: Reporter | None = None,
) -> EvalResult:
    """Sample ``k`` responses per (de-duplicated) problem and grade them; count the items the scorer failed on."""
    if isinstance(batch_prompts, bool) or not isinstance(batch_prompts, int) or batch_prompts < 1:
        raise ValueError(f"batch_prompts must be an integer >= 1 (prompts generated together), got {batch_prompts!r}")
    sampling = sampling or Sampling(temperature=0.0)
    rows, messages = [], []
    t0, generated = time.perf_counter(), 0
    for s in range(0, len(problems), batch_prompts):
        chunk = problems[s : s + batch_prompts]
        if progress is not None:
            progress.phase(f"generate {len(chunk)} x {k}")
        batch = generator.generate([p.messages for p in chunk], k, sampling,
                                   on_token=progress.on_token if progress is not None else None)
        generated += int(batch.response_mask.sum())
        if progress is not None:
            progress.advance(len(chunk), tok_s=generated / (time.perf_counter() - t0))
        graded = reward_fn(batch.texts, [p.answer for p in chunk for _ in range(k)])
        n_items = len(chunk) * k
        failed = list(getattr(graded, "failed", None) or [False] * n_items)
        timed_out = list(getattr(graded, "timed_out", None) or [False] * n_items)
        messages += list(getattr(graded, "failure_messages", []))[: 5 - len(messages)]
        judged = list(getattr(graded, "answers", None) or [])
        judged = judged if len(judged) == n_items else None  # a reward that reports no answers (or not one each)
        for i, p in enumerate(chunk):
            texts = batch.texts[i * k : (i + 1) * k]
            correct = graded.correct[i * k : (i + 1) * k]
            answers = judged_answers(texts, correct, judged[i * k : (i + 1) * k] if judged else None)
            c = sum(correct)
            rows.append({
                "id": p.id, "data_source": p.data_source, "copies": p.copies, "answer": p.answer, "k": k,
                "num_correct": c, "avg@k": c / k, "pass@k": pass_at_k(k, c, k), "maj@k": float(majority_correct(answers, correct)),
                "extracted": answers, "truncated": batch.truncated[i * k : (i + 1) * k].tolist(),
                "scorer_failures": sum(failed[i * k : (i + 1) * k]),
                "scorer_timeouts": sum(timed_out[i * k : (i + 1) * k]),
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
            "graded": len(rs) * k,
            "scorer_failures": sum(r["scorer_failures"] for r in rs),
            "scorer_timeouts": sum(r["scorer_timeouts"] for r in rs),
        }
        for src, rs in by_source.items()
    }
    return EvalResult(summary, rows, messages)
