"""Six synthetic "domains" for the data-ordering and data-selection stages (`data.synthetic.task: string_domains`).

Each domain is a deterministic string transformation with a prefix of its own (`rev:abc=` -> `cba`): reverse,
shift every letter by one, sort, double every letter, rotate left by two, swap adjacent pairs. Each also has a
vocabulary of its own, as real domains do: its words use 8 letters of a window that moves 3 letters per domain,
so neighbouring domains share letters and distant ones none. A small model learns them from SFT rows (`prompt`,
`target`, and `domain` naming the transformation); RL and held-out rows carry the transformed word as
`answer`. The split of rows over domains is uniform.
"""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

from rl.registry import register
from rl.tasks import write_splits


def _shift(w: str) -> str:
    return "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in w)


def _swap_pairs(w: str) -> str:
    chars = list(w)
    for i in range(0, len(chars) - 1, 2):
        chars[i], chars[i + 1] = chars[i + 1], chars[i]
    return "".join(chars)


DOMAINS = {"rev": lambda w: w[::-1], "shf": _shift, "srt": lambda w: "".join(sorted(w)),
           "dbl": lambda w: "".join(c + c for c in w), "rot": lambda w: w[2:] + w[:2], "swp": _swap_pairs}


def domain_row(domain: str, word: str) -> dict[str, str]:
    return {"prompt": f"{domain}:{word}=", "target": DOMAINS[domain](word), "answer": DOMAINS[domain](word),
            "domain": domain}


def random_word(rng: random.Random, letters: str, low: int = 3, high: int = 7) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(low, high)))


def domain_letters(index: int) -> str:
    return string.ascii_lowercase[3 * index:3 * index + 8]


def domain_rows(num: int, rng: random.Random) -> list[dict[str, str]]:
    names = list(DOMAINS)
    return [domain_row(names[i % len(names)], random_word(rng, domain_letters(i % len(names)))) for i in range(num)]


@register("task", "string_domains")
def string_domains_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float, seed: int,
                        **_: Any) -> dict[str, str]:
    """`sft.jsonl` (`sft_fraction` of `num_train` rows, with targets), `train.jsonl` (the rest) and `eval.jsonl`."""
    rng = random.Random(seed)
    rows = domain_rows(num_train + num_eval, rng)
    rng.shuffle(rows)
    n_sft = int(num_train * sft_fraction)
    splits = {"sft": rows[:n_sft], "train": rows[n_sft:num_train], "eval": rows[num_train:]}
    return write_splits(out_dir, splits)


def corrupt(row: dict[str, str], rng: random.Random) -> dict[str, Any]:
    """The row with its target replaced by random letters (a corrupted sample of the pool)."""
    noise = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 14)))
    return {**row, "target": noise, "answer": noise, "clean": False}


@register("task", "noisy_domains")
def noisy_domains_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float, seed: int,
                       corrupt_fraction: float = 0.5, **_: Any) -> dict[str, str]:
    """A data-selection pool: `sft.jsonl` holds `sft_fraction` of `num_train` string_domains rows, a
    `corrupt_fraction` of them with random targets (column `clean`); `sft_val.jsonl` holds `num_eval` clean rows
    with targets (the validation set of the selection); `train.jsonl` and `eval.jsonl` are clean prompts."""
    rng = random.Random(seed)
    rows = domain_rows(num_train + 2 * num_eval, rng)
    rng.shuffle(rows)
    n_sft = int(num_train * sft_fraction)
    pool = [corrupt(r, rng) if rng.random() < corrupt_fraction else {**r, "clean": True} for r in rows[:n_sft]]
    splits = {"sft": pool, "train": rows[n_sft:num_train], "eval": rows[num_train:num_train + num_eval],
              "sft_val": rows[num_train + num_eval:]}
    return write_splits(out_dir, splits)
