"""The two-style sum task (`data.synthetic.task: densesteer`): DenseSteer's tiny setting (rl/methods/densesteer/README.md,
the minimal faithful implementation), a labelled synthetic harness.

A problem is a sum of `k` one-digit numbers, `3+4+2+5=`. Its worked solution comes in two styles that make the same
computations and reach the same boxed answer:

* sparse: one addition per step, steps separated by blank lines: `3+4=7\\n\\n7+2=9\\n\\n9+5=14\\n\\n\\boxed{14}`;
* dense: the additions merged into one step: `3+4=7,7+2=9,9+5=14\\n\\n\\boxed{14}`.

Steps are delimited by blank lines, as DenseSteer's density metric ρ = tokens / steps counts them
(`rl.methods.densesteer.core.density`). The SFT split mixes the styles half and half (a seeded coin per row), so the warmed-up
model holds both and chooses one per problem; `steer_pairs.jsonl` renders `num_pairs` further problems in both
styles: the (dense, sparse) pairs the `densesteer` stage reads. In the paper a rewriter LLM (GPT-5.1; the
released script: Qwen2.5-7B-Instruct) densifies the target model's own correct solutions; here the task's two
renderings of one computation stand in for that rewrite, as the spec's tiny implementation does.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rl.registry import register, register_alias
from rl.tasks import write_splits


def make_sum(rng: random.Random, min_terms: int, max_terms: int) -> tuple[int, ...]:
    return tuple(rng.randint(1, 9) for _ in range(rng.randint(min_terms, max_terms)))


def sum_prompt(terms: tuple[int, ...]) -> str:
    return "+".join(map(str, terms)) + "="


def _additions(terms: tuple[int, ...]) -> list[str]:
    out, acc = [], terms[0]
    for t in terms[1:]:
        out.append(f"{acc}+{t}={acc + t}")
        acc += t
    return out


def sparse_solution(terms: tuple[int, ...]) -> str:
    """One addition per step, blank lines between the steps, then the boxed answer as the last step."""
    return "\n\n".join([*_additions(terms), f"\\boxed{{{sum(terms)}}}"])


def dense_solution(terms: tuple[int, ...]) -> str:
    """The same additions merged into one step, then the boxed answer."""
    return ",".join(_additions(terms)) + f"\n\n\\boxed{{{sum(terms)}}}"


def write_styles_task(out_dir: str | Path, num_train: int = 4000, num_eval: int = 200, sft_fraction: float = 0.5,
                      dense_fraction: float = 0.5, num_pairs: int = 50, min_terms: int = 3, max_terms: int = 5,
                      seed: int = 1234) -> dict[str, str]:
    """Write `sft.jsonl` (prompt, target in a style drawn per row, answer, style), `train.jsonl` and `eval.jsonl`
    (prompt, answer) and `steer_pairs.jsonl` (prompt, dense, sparse, answer), over disjoint problems."""
    rng = random.Random(seed)
    need = num_train + num_eval + num_pairs
    distinct = sum(9 ** k for k in range(min_terms, max_terms + 1))
    if need > distinct:
        raise ValueError(f"styles task: {need} distinct problems asked (num_train + num_eval + num_pairs), only "
                         f"{distinct} sums of {min_terms}-{max_terms} one-digit terms exist")
    seen: set[tuple[int, ...]] = set()
    problems: list[tuple[int, ...]] = []
    while len(problems) < need:
        p = make_sum(rng, min_terms, max_terms)
        if p not in seen:
            seen.add(p)
            problems.append(p)
    eval_set, pair_set, train_set = problems[:num_eval], problems[num_eval:num_eval + num_pairs], problems[num_eval + num_pairs:]
    n_sft = int(len(train_set) * sft_fraction)

    def row(p: tuple[int, ...]) -> dict[str, Any]:
        return {"prompt": sum_prompt(p), "answer": str(sum(p))}

    sft = []
    for p in train_set[:n_sft]:
        dense = rng.random() < dense_fraction
        sft.append({**row(p), "target": (dense_solution if dense else sparse_solution)(p),
                    "style": "dense" if dense else "sparse"})
    return write_splits(out_dir, {
        "sft": sft, "train": [row(p) for p in train_set[n_sft:]], "eval": [row(p) for p in eval_set],
        "steer_pairs": [{**row(p), "dense": dense_solution(p), "sparse": sparse_solution(p)} for p in pair_set]})


@register("task", "densesteer")
def styles_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float, seed: int,
                dense_fraction: float = 0.5, num_pairs: int = 50, min_terms: int = 3, max_terms: int = 5,
                **_: Any) -> dict[str, str]:
    """The two-style sum task: `dense_fraction` of the SFT targets dense, `num_pairs` (dense, sparse) pairs for
    the steering vector, sums of `min_terms`-`max_terms` one-digit numbers."""
    return write_styles_task(out_dir, num_train=num_train, num_eval=num_eval, sft_fraction=sft_fraction,
                             dense_fraction=dense_fraction, num_pairs=num_pairs, min_terms=min_terms,
                             max_terms=max_terms, seed=seed)

register_alias("task", "styles", "densesteer")
