"""Evaluation: the held-out check of a run and the benchmark protocol, one code path for both.

* `cluster.evaluation.evaluate`: one answer per held-out prompt at `rollout.eval_temperature` through the
  run's rollout workers, scored by every reward function (eval-only judges included): accuracy and component
  means.
* The protocol (the RLTT paper's): `runs` independent sampled runs, each answering every problem once
  with seed `seed + r` → `[runs, problems]` scores; mean@k over runs, a paired comparison of two policies on
  the same problems (paired t-test), and for looped models greedy accuracy read out after each loop.
  `protocol_scores` and `per_loop_accuracy` take a `generate` and a `score` callable, so the recipe's
  `evaluate` stage (rollout workers, reward service actor) and `looprl eval` (an in-process engine,
  `cluster/math_eval.py`) run the same protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def mean_at_k(correct: np.ndarray) -> dict[str, Any]:
    """`correct [runs, problems]` (0/1 or graded) → mean accuracy over runs, its std over runs, per run."""
    per_run = correct.mean(axis=1)
    return {"mean": float(per_run.mean()), "std_over_runs": float(per_run.std(ddof=1)) if len(per_run) > 1 else 0.0,
            "per_run": [float(x) for x in per_run], "runs": int(correct.shape[0]), "problems": int(correct.shape[1])}


def paired_comparison(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Model A vs model B on the same problems: per-problem accuracy (mean over each model's runs),
    mean difference A − B with its 95% confidence interval (Student t over problems), and the two-sided
    paired t-test over problems. Identical per-problem accuracies give p = 1."""
    from scipy.stats import t as student_t
    from scipy.stats import ttest_rel
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"paired comparison needs the same problems: {a.shape[1]} vs {b.shape[1]}")
    pa, pb = a.mean(axis=0), b.mean(axis=0)
    diff = pa - pb
    n = len(diff)
    if np.allclose(diff, diff[0]):
        t, p = (0.0, 1.0) if diff[0] == 0 else (float("inf") * np.sign(diff[0]), 0.0)
        half = 0.0
    else:
        res = ttest_rel(pa, pb)
        t, p = float(res.statistic), float(res.pvalue)
        half = float(student_t.ppf(0.975, n - 1) * diff.std(ddof=1) / np.sqrt(n))
    return {"mean_diff": float(diff.mean()), "ci95": [float(diff.mean()) - half, float(diff.mean()) + half],
            "t": t, "p_value": p, "problems": int(n)}


def protocol_scores(generate: Callable[..., Any], score: Callable[[Any], list[float]], *, runs: int,
                    temperature: float, top_p: float, seed: int, exit_at_step: int | None = None) -> np.ndarray:
    """`[runs, problems]`: run r answers every problem once (`generate(temperature=, top_p=, seed=seed + r,
    exit_at_step=)` → a Batch) and is scored by `score(batch)`."""
    return np.stack([np.asarray(score(generate(temperature=temperature, top_p=top_p, seed=seed + r,
                                               exit_at_step=exit_at_step)), dtype=np.float64)
                     for r in range(runs)])


def per_loop_accuracy(generate: Callable[..., Any], score: Callable[[Any], list[float]], loops: list[int], *,
                      seed: int = 0) -> dict[str, float]:
    """Greedy accuracy read out after each loop t in `loops` (looped models: `exit_at_step`)."""
    return {str(t): float(protocol_scores(generate, score, runs=1, temperature=0.0, top_p=1.0, seed=seed,
                                          exit_at_step=t).mean()) for t in loops}
