"""The cited-facts task (`data.synthetic.task: guidance`): Guidance's tiny setting (rl/methods/guidance/README.md, the
minimal faithful implementation), a labelled synthetic harness.

A world of made-up people, each with numeric facts ("Kov owns 42 goats."). A prompt is a context of `chunks`
sentences, each after its chunk marker `<C0>`, `<C1>`, … (the person's facts among other people's, shuffled), then
`Question: Tell me about Kov.` and `Answer:`. SFT targets state the person's facts in LongBench-Cite's format,
`<statement>S<cite>[j-j]</cite></statement>` citing the chunk that holds the fact (a citation-tuned model), but
from a stale copy of the world in which `stale_fraction` of the numbers differ from the documents, and with
`paraphrase_fraction` of the sentences' tails reworded ("owns 42 goats" → "owns 42 goats in all"), each sentence
starting as the document's does: the warmed-up model speaks from memory, wrong on about half the numbers and
loose in wording. The `answer`
column holds the true facts; `guidance` scores citations against the context and numbers against the answer.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from rl.methods.factuality.task import person_names
from rl.methods.guidance.core import cite_statement
from rl.registry import register, register_alias
from rl.tasks import write_splits

NUMERIC = (("was born in", "{n}", (1900, 1999), "{n} as the records say"),
           ("owns", "{n} goats", (10, 99), "{n} goats in all"),
           ("walks", "{n} miles a day", (2, 30), "{n} miles every day"),
           ("has", "{n} cousins", (2, 40), "{n} cousins in total"),
           ("reads", "{n} books a year", (5, 90), "{n} books each year"))


def fact_sentence(person: str, attr: int, n: int, paraphrase: bool = False) -> str:
    verb, tail, _, alt = NUMERIC[attr]
    return f"{person} {verb} {(alt if paraphrase else tail).format(n=n)}."


def number_accuracy(answer: str, person: str, world: dict[str, dict[int, int]]) -> dict[str, float]:
    """Numbers the answer states about `person` (a sentence starting with the person and an attribute's verb) that
    equal the world's: `correct`, `stated` and their ratio."""
    stated = correct = 0
    for attr, (verb, _, _, _) in enumerate(NUMERIC):
        m = re.search(rf"{re.escape(person)} {re.escape(verb)} (\d+)", answer)
        if m:
            stated += 1
            correct += int(int(m.group(1)) == world[person][attr])
    return {"correct": float(correct), "stated": float(stated), "accuracy": correct / stated if stated else 0.0}


def make_world(num_people: int, stale_fraction: float, rng: random.Random
               ) -> tuple[list[str], dict[str, dict[int, int]], dict[str, dict[int, int]]]:
    """People, the true world and the stale world (numbers differ for a `stale_fraction` share)."""
    people = person_names(num_people, rng)
    true = {p: {a: rng.randint(*NUMERIC[a][2]) for a in range(len(NUMERIC))} for p in people}
    stale = {p: {a: (v if rng.random() >= stale_fraction else
                     rng.choice([x for x in range(*NUMERIC[a][2]) if x != v])) for a, v in facts.items()}
             for p, facts in true.items()}
    return people, true, stale


def citation_prompt(person: str, people: list[str], true: dict[str, dict[int, int]], chunks: int,
                    rng: random.Random) -> tuple[str, dict[int, int]]:
    """The person's facts and other people's (distractors) as `chunks` shuffled sentences after chunk markers;
    returns the prompt and the chunk id of each of the person's attributes."""
    own = [(a, fact_sentence(person, a, n)) for a, n in true[person].items()]
    others = [(None, fact_sentence(q, a, n)) for q in people if q != person for a, n in true[q].items()]
    sentences = own + rng.sample(others, max(0, chunks - len(own)))
    rng.shuffle(sentences)
    context = "".join(f"<C{j}>{s}" for j, (_, s) in enumerate(sentences))
    return f"{context}\nQuestion: Tell me about {person}.\nAnswer:", {a: j for j, (a, _) in enumerate(sentences)
                                                                         if a is not None}


def write_citations_task(out_dir: str | Path, num_people: int = 12, num_sft: int = 3000, num_train: int = 200,
                         num_eval: int = 100, chunks: int = 8, stale_fraction: float = 0.5,
                         paraphrase_fraction: float = 0.5, seed: int = 1234) -> dict[str, str]:
    """Write `sft.jsonl` (prompt, target, answer, person), `train.jsonl` and `eval.jsonl` (prompt, answer: the true
    facts' text, person) and `citation_world.json` (the true and the stale numbers by person and attribute)."""
    rng = random.Random(seed)
    people, true, stale = make_world(num_people, stale_fraction, rng)
    # one wording per (person, attribute): what the model memorised, paraphrase or not
    worded = {p: {a: rng.random() < paraphrase_fraction for a in range(len(NUMERIC))} for p in people}

    def row(person: str, target: bool) -> dict[str, Any]:
        prompt, chunk_of = citation_prompt(person, people, true, chunks, rng)
        r = {"prompt": prompt, "person": person,
             "answer": " ".join(fact_sentence(person, a, n) for a, n in true[person].items())}
        if target:
            r["target"] = " " + " ".join(cite_statement(fact_sentence(person, a, n, worded[person][a]), [chunk_of[a]])
                                         for a, n in stale[person].items())
        return r
    paths = write_splits(out_dir, {"sft": [row(rng.choice(people), True) for _ in range(num_sft)],
                                   "train": [row(rng.choice(people), False) for _ in range(num_train)],
                                   "eval": [row(people[i % num_people], False) for i in range(num_eval)]})
    world_path = Path(out_dir) / "citation_world.json"
    world_path.write_text(json.dumps({"true": true, "stale": stale}))
    return {**paths, "citation_world": str(world_path)}


@register("task", "guidance")
def citations_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float, seed: int,
                   num_people: int = 12, chunks: int = 8, stale_fraction: float = 0.5, paraphrase_fraction: float = 0.5,
                   **_: Any) -> dict[str, str]:
    """`num_train` rows, `sft_fraction` of them SFT; `num_people` people with 5 numeric facts each; `chunks`
    context sentences per prompt; `stale_fraction` of the memorised numbers wrong; `paraphrase_fraction` of the
    memorised sentences reworded."""
    n_sft = int(num_train * sft_fraction)
    return write_citations_task(out_dir, num_people=num_people, num_sft=n_sft, num_train=num_train - n_sft,
                                num_eval=num_eval, chunks=chunks, stale_fraction=stale_fraction,
                                paraphrase_fraction=paraphrase_fraction, seed=seed)

register_alias("task", "citations", "guidance")
