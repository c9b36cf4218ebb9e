"""String-match reward: 1.0 when the response states the ground truth exactly (after light normalisation)."""

from __future__ import annotations

from typing import Any

from rl.registry import register


@register("reward", "exact_match")
def exact_match_reward(prompt: str, response: str, *, ground_truth: Any = None, first_line: bool = True,
                       ignore_case: bool = False, **_: Any) -> float | None:
    """1.0 if the response equals `ground_truth` after stripping whitespace (with `first_line`, only the
    response's first line counts; with `ignore_case`, case is ignored), else 0.0; None without a ground truth."""
    if ground_truth is None or str(ground_truth).strip() == "":
        return None
    said = response.strip().split("\n", 1)[0].strip() if first_line else response.strip()
    truth = str(ground_truth).strip()
    if ignore_case:
        said, truth = said.lower(), truth.lower()
    return 1.0 if said == truth else 0.0


@register("reward", "fact_numbers")
def fact_numbers_reward(prompt: str, response: str, *, ground_truth: Any = None, **_: Any) -> float | None:
    """Number accuracy of stated facts: each sentence of `ground_truth` holding a number is a fact keyed by its
    words before that number ("Kov owns" of "Kov owns 42 goats."); a response sentence (statement and citation
    markup removed) that starts with a fact's key states it, right when its first number is the fact's. The share
    of stated facts stated right; None when the response states none (or there is no ground truth)."""
    from rl.methods.guidance.core import normalize_words, split_sentences, strip_citations
    if ground_truth is None:
        return None
    facts = {}
    for sentence in split_sentences(str(ground_truth)):
        words = normalize_words(sentence)
        first = next((i for i, w in enumerate(words) if w.isdigit()), None)
        if first:
            facts[tuple(words[:first])] = words[first]
    stated = right = 0
    for sentence in split_sentences(strip_citations(response).replace("\n", " ")):
        words = normalize_words(sentence)
        for key, number in facts.items():
            if tuple(words[:len(key)]) == key:
                said = next((w for w in words[len(key):] if w.isdigit()), None)
                if said is not None:
                    stated += 1
                    right += int(said == number)
                break
    return right / stated if stated else None
