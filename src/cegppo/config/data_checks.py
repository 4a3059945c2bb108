"""Checks that need the loaded data or the tokenizer: run after loading them, before training or evaluating."""

from __future__ import annotations

from typing import Any

from cegppo.config.schema import Config
from cegppo.errors import ConfigError, show


def check_data(cfg: Config, train_problems: list, test_problems: list | None = None) -> None:
    """Settings that the loaded data makes impossible; call right after loading the data, before the model.

    ``sft.steps > 0`` needs a reference ``solution`` on every training problem (the warm-start trains on them).
    """
    if cfg.sft.steps > 0:
        missing = [p for p in train_problems if not getattr(p, "solution", None)]
        if missing:
            where = f"data.train_path {cfg.data.train_path}" if cfg.data.train_path else f"data.task {cfg.data.task}"
            raise ConfigError(f"sft.steps={cfg.sft.steps} needs a reference 'solution' on every training problem; "
                              f"{len(missing)} of {len(train_problems)} in {where} have none (first: id "
                              f"{show(missing[0].id, 40)}); set sft.steps=0 or add a solution field")


def prompt_budget_cuts(tokenizer: Any, problems: list, max_prompt_tokens: int) -> list[tuple[Any, int, int]]:
    """Prompts whose question would be cut by ``max_prompt_tokens``: [(problem, prompt tokens, tokens before the
    question)]. Prompts are built as the rollout builds them (chat template with the generation prompt, then
    left truncation to the last ``max_prompt_tokens`` tokens); cutting only template or system tokens is fine."""
    texts: dict[str, Any] = {}  # templated prompt -> its first problem
    for p in problems:
        texts.setdefault(tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False), p)
    items = list(texts.items())
    cuts = []
    for i in range(0, len(items), 1024):  # batched tokenization (fast tokenizers run it in parallel)
        chunk = items[i: i + 1024]
        lengths = [len(x) for x in tokenizer([t for t, _ in chunk], add_special_tokens=False)["input_ids"]]
        for (text, p), n in zip(chunk, lengths):
            if n <= max_prompt_tokens:
                continue
            question = p.prompt_text
            start = text.rfind(question) if question else -1
            before = len(tokenizer(text[:start], add_special_tokens=False)["input_ids"]) if start > 0 else 0
            if n - max_prompt_tokens > before:
                cuts.append((p, n, before))
    return cuts


def check_prompt_budget(tokenizer: Any, problems: list, max_prompt_tokens: int,
                        key: str = "rollout.max_prompt_tokens") -> None:
    """ConfigError when ``max_prompt_tokens`` would cut into the question of any prompt (the policy would be
    trained or evaluated on a truncated problem). Call right after the tokenizer is loaded, on the training and
    held-out problems (``cegppo eval``: key="--max-prompt-tokens")."""
    cuts = prompt_budget_cuts(tokenizer, problems, max_prompt_tokens)
    if cuts:
        p, n, before = max(cuts, key=lambda c: c[1] - c[2])
        raise ConfigError(f"{key}={max_prompt_tokens} cuts the question of {len(cuts)} prompt(s) (left truncation; "
                          f"e.g. id {show(p.id, 40)}: {n} tokens, its question from token {before}); "
                          f"expected >= {n - before}")
