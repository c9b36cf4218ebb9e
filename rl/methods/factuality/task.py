"""A synthetic long-form factuality task for the factuality reward at tiny scale (`data.synthetic.task: factuality`, registry kind `task`).

A small world of made-up people, each with one value per attribute ("Kov lives in Tam."). The evidence
corpus (`corpus.txt`) holds every true fact. Prompts ask about one person ("Tell me about Kov."); SFT
answers, `<think>Kov</think> ` followed by 1..`max_facts` facts, vary in detail and are partly wrong:
knowledge thins out with detail, the k-th fact of an answer (k = 0, 1, ...) is corrupted with
probability `p_false + p_false_step * k`. The warmed-up policy thus holds both behaviours the
factuality reward arbitrates between: fewer, safer claims or more, riskier ones (precision alone pays
for stopping early; the detail term pays for each further supported fact). The reference answer
(the `answer` column, used for relevance) lists every true fact about the person. RL prompts and the
held-out prompts ask about the same people as SFT: the knowledge comes from SFT, RL shapes how much of
it an answer states.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rl.registry import register, register_alias

ATTRIBUTES = (("lives in", ["Tam", "Rook", "Vel", "Moor", "Sask", "Lund", "Pell", "Ords"]),
              ("eats", ["figs", "rice", "kale", "plums", "oats", "corn", "leeks", "beans"]),
              ("keeps", ["goats", "bees", "owls", "cats", "hens", "mules", "doves", "pigs"]),
              ("paints", ["boats", "doors", "walls", "kites", "vases", "masks", "signs", "tiles"]),
              ("plays", ["chess", "drums", "polo", "golf", "harps", "cards", "flutes", "dice"]),
              ("sells", ["salt", "wool", "rope", "soap", "wax", "tea", "ink", "nets"]))
THINK_END = "</think>"


def person_names(n: int, rng: random.Random) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add(rng.choice("BDFGKLMNPRSTVZ") + rng.choice("aeiou") + rng.choice("bdgklmnprstvx"))
    return sorted(names)


def write_facts_task(out_dir: str | Path, num_people: int = 40, num_sft: int = 4000, num_train: int = 2000,
                     num_eval: int = 100, max_facts: int = 6, p_false: float = 0.1, p_false_step: float = 0.1,
                     seed: int = 1234) -> dict[str, str]:
    """Write `corpus.txt`, `sft.jsonl` (prompt, answer, target), `train.jsonl` and `eval.jsonl`."""
    rng = random.Random(seed)
    people = person_names(num_people, rng)
    world = {p: {verb: rng.choice(values) for verb, values in ATTRIBUTES} for p in people}

    def fact(person: str, verb: str, value: str) -> str:
        return f"{person} {verb} {value}."

    def reference(person: str) -> str:
        return " ".join(fact(person, verb, world[person][verb]) for verb, _ in ATTRIBUTES)

    def answer(person: str) -> str:
        verbs = rng.sample([v for v, _ in ATTRIBUTES], rng.randint(1, max_facts))
        said = []
        for k, verb in enumerate(verbs):
            value = world[person][verb]
            if rng.random() < p_false + p_false_step * k:
                value = rng.choice([x for v, xs in ATTRIBUTES if v == verb for x in xs if x != value])
            said.append(fact(person, verb, value))
        return f"<think>{person}{THINK_END} " + " ".join(said)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus.txt").write_text("\n".join(fact(p, v, world[p][v]) for p in people for v, _ in ATTRIBUTES) + "\n")
    paths = {"corpus": str(out / "corpus.txt")}
    for split, n, with_target in (("sft", num_sft, True), ("train", num_train, False), ("eval", num_eval, False)):
        path = out / f"{split}.jsonl"
        with path.open("w") as f:
            for i in range(n):
                person = people[i % num_people] if split == "eval" else rng.choice(people)
                row = {"prompt": f"Tell me about {person}.", "answer": reference(person)}
                if with_target:
                    row["target"] = answer(person)
                f.write(json.dumps(row) + "\n")
        paths[split] = str(path)
    return paths


@register("task", "factuality")
def facts_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float, seed: int,
               **_: Any) -> dict[str, str]:
    """`data.synthetic`: `num_train` problems, `sft_fraction` of them SFT rows, the rest RL prompts; the
    evidence corpus lands beside them (`corpus.txt`)."""
    n_sft = int(num_train * sft_fraction)
    return write_facts_task(out_dir, num_sft=n_sft, num_train=num_train - n_sft, num_eval=num_eval, seed=seed)

register_alias("task", "facts", "factuality")
