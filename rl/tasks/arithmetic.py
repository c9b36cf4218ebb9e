"""The embedded synthetic math task used by the quickstart: `a+b*c=`.

Targets show the work, `b*c=m,a+m=s\\boxed{s}`, and the answer is checked by math-verify.
For the SFT warm-up a share of targets uses the wrong order of operations (`a+b=s,s*c=t`,
boxed `t`), so the warmed-up model holds two competing behaviours and starts near chance
between them; RL then has something to choose. This is what RL does here: it selects the
behaviour that earns reward, it does not teach new arithmetic.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rl.registry import register
from rl.tasks import write_splits


def make_problem(rng: random.Random) -> tuple[int, int, int]:
    return rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)


def prompt_of(a: int, b: int, c: int) -> str:
    return f"{a}+{b}*{c}="


def correct_target(a: int, b: int, c: int) -> str:
    m = b * c
    return f"{b}*{c}={m},{a}+{m}={a + m}\\boxed{{{a + m}}}"


def wrong_order_target(a: int, b: int, c: int) -> str:
    s = a + b
    return f"{a}+{b}={s},{s}*{c}={s * c}\\boxed{{{s * c}}}"


def write_synthetic_task(out_dir: str | Path, num_train: int = 4000, num_eval: int = 200,
                         sft_fraction: float = 0.5, wrong_order_fraction: float = 0.5,
                         seed: int = 1234) -> dict[str, str]:
    """Write `sft.jsonl`, `train.jsonl` (RL prompts) and `eval.jsonl` with disjoint problems.

    Returns the three paths. Columns: prompt, answer (and target for SFT rows).
    """
    rng = random.Random(seed)
    seen: set[tuple[int, int, int]] = set()
    problems: list[tuple[int, int, int]] = []
    while len(problems) < num_train + num_eval:
        p = make_problem(rng)
        if p not in seen:
            seen.add(p)
            problems.append(p)
    eval_set, train_set = problems[:num_eval], problems[num_eval:]
    n_sft = int(len(train_set) * sft_fraction)
    sft_set, rl_set = train_set[:n_sft], train_set[n_sft:]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def rows(ps, sft=False):
        for a, b, c in ps:
            row = {"prompt": prompt_of(a, b, c), "answer": str(a + b * c)}
            if sft:
                row["target"] = wrong_order_target(a, b, c) if rng.random() < wrong_order_fraction \
                    else correct_target(a, b, c)
            yield row

    paths = {}
    for name, ps, sft in (("sft", sft_set, True), ("train", rl_set, False), ("eval", eval_set, False)):
        path = out / f"{name}.jsonl"
        with path.open("w") as f:
            for row in rows(ps, sft):
                f.write(json.dumps(row) + "\n")
        paths[name] = str(path)
    return paths


@register("task", "arithmetic")
def arithmetic_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float,
                    wrong_order_fraction: float, seed: int, **_: Any) -> dict[str, str]:
    """`data.synthetic` as it is: the a+b*c= task with its wrong-order SFT targets."""
    return write_synthetic_task(out_dir, num_train=num_train, num_eval=num_eval, sft_fraction=sft_fraction,
                                wrong_order_fraction=wrong_order_fraction, seed=seed)


def chat_rows(problems: list[tuple[int, int, int]], rng: random.Random, wrong_order_fraction: float,
              max_turns: int = 3) -> list[dict[str, Any]]:
    """SFT conversations over `problems`: 1 to `max_turns` user questions in a row, each answered by the
    assistant with its work (the wrong order of operations for a `wrong_order_fraction` share)."""
    rows, i = [], 0
    while i < len(problems):
        messages = []
        for a, b, c in problems[i:i + rng.randint(1, max_turns)]:
            ask = prompt_of(a, b, c) if not messages else f"and {prompt_of(a, b, c)}"
            wrong = rng.random() < wrong_order_fraction
            messages += [{"role": "user", "content": ask},
                         {"role": "assistant", "content": (wrong_order_target if wrong else correct_target)(a, b, c)}]
            i += 1
        rows.append({"messages": messages})
    return rows


def sft_problems(path: str | Path) -> list[tuple[int, int, int]]:
    """The (a, b, c) of each `a+b*c=` prompt of an SFT file written by `write_synthetic_task`, in order."""
    problems = []
    for line in Path(path).read_text().splitlines():
        a, rest = json.loads(line)["prompt"].rstrip("=").split("+")
        b, c = rest.split("*")
        problems.append((int(a), int(b), int(c)))
    return problems


@register("task", "arithmetic_chat")
def arithmetic_chat_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float,
                         wrong_order_fraction: float, seed: int, **_: Any) -> dict[str, str]:
    """The a+b*c= task with chat SFT data: `sft.jsonl` holds multi-turn conversations (a `messages` column, as a
    user's chat export would), RL and held-out rows are single prompts (`data.chat_template: true`)."""
    paths = write_synthetic_task(out_dir, num_train=num_train, num_eval=num_eval, sft_fraction=sft_fraction,
                                 wrong_order_fraction=wrong_order_fraction, seed=seed)
    rng = random.Random(seed + 1)
    problems = sft_problems(paths["sft"])
    Path(paths["sft"]).write_text("".join(json.dumps(r) + "\n" for r in chat_rows(problems, rng, wrong_order_fraction)))
    return paths


def calculator_conversation(a: int, b: int, c: int, wrong: bool) -> list[dict[str, str]]:
    """One calculator-tool conversation for `a+b*c=`: the assistant writes the expression to compute (`a+b*c`,
    or `(a+b)*c` when `wrong`), the tool answers `=value`, the assistant boxes the tool's value."""
    expression, value = (f"({a}+{b})*{c}", (a + b) * c) if wrong else (f"{a}+{b}*{c}", a + b * c)
    return [{"role": "user", "content": prompt_of(a, b, c)}, {"role": "assistant", "content": expression},
            {"role": "tool", "content": f"={value}\n"}, {"role": "assistant", "content": f"\\boxed{{{value}}}"}]


@register("task", "calculator_chat")
def calculator_chat_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float,
                         wrong_order_fraction: float, seed: int, **_: Any) -> dict[str, str]:
    """The a+b*c= task solved with a calculator tool (the agent program `recipes/extending/agent.py` is the
    tool's caller): `sft.jsonl` holds tool conversations (`calculator_conversation`) that write the wrong order
    of operations for a `wrong_order_fraction` share, so RL through the agent has a behaviour to select;
    RL and held-out rows are plain prompts (the agent applies the chat template)."""
    paths = write_synthetic_task(out_dir, num_train=num_train, num_eval=num_eval, sft_fraction=sft_fraction,
                                 wrong_order_fraction=wrong_order_fraction, seed=seed)
    rng = random.Random(seed + 1)
    rows = [{"messages": calculator_conversation(a, b, c, rng.random() < wrong_order_fraction)}
            for a, b, c in sft_problems(paths["sft"])]
    Path(paths["sft"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


@register("task", "addition")
def addition_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float, seed: int,
                  digits: int = 3, **_: Any) -> dict[str, str]:
    """`a+b=` with a and b of `digits` digits and the sum written with `digits + 1` digits (zero-padded): a task
    for masked-diffusion models, whose answers have one length and whose leading digits depend on the carries of
    later ones (decoded left to right, the first digit is a guess; decoded in any order, it need not be).
    `sft.jsonl` (prompt, target, answer), `train.jsonl` and `eval.jsonl` (prompt, answer) hold disjoint problems."""
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10 ** digits - 1
    if num_train + num_eval > (high - low + 1) ** 2:
        raise ValueError(f"data.synthetic: the addition task with digits={digits} has {(high - low + 1) ** 2} distinct "
                         f"problems; num_train + num_eval = {num_train + num_eval} asks for more")
    seen: set[tuple[int, int]] = set()
    while len(seen) < num_train + num_eval:
        seen.add((rng.randint(low, high), rng.randint(low, high)))
    problems = sorted(seen)
    rng.shuffle(problems)
    eval_set, train_set = problems[:num_eval], problems[num_eval:]
    n_sft = int(len(train_set) * sft_fraction)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, ps in (("sft", train_set[:n_sft]), ("train", train_set[n_sft:]), ("eval", eval_set)):
        rows = [{"prompt": f"{a}+{b}=", "answer": f"{a + b:0{digits + 1}d}"} for a, b in ps]
        if name == "sft":
            rows = [{**r, "target": r["answer"]} for r in rows]
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[name] = str(path)
    return paths


def make_chain(rng: random.Random, products: int) -> tuple[int, ...]:
    """`a` and `products` (b, c) pairs of `a+b1*c1+b2*c2+...=`, drawn as `make_problem` draws a, b and c."""
    terms = [rng.randint(10, 99)]
    for _ in range(products):
        terms += [rng.randint(10, 99), rng.randint(2, 9)]
    return tuple(terms)


def chain_prompt(terms: tuple[int, ...]) -> str:
    return "+".join([str(terms[0])] + [f"{b}*{c}" for b, c in zip(terms[1::2], terms[2::2])]) + "="


def chain_value(terms: tuple[int, ...]) -> int:
    return terms[0] + sum(b * c for b, c in zip(terms[1::2], terms[2::2]))


def chain_target(terms: tuple[int, ...], wrong: bool) -> str:
    """The work for a chain: every product, then the running sum, then the boxed value. `wrong`: the first term
    in the wrong order of operations (`(a+b1)*c1`, as `wrong_order_target` does for one product); a chain of one
    product is exactly `correct_target` / `wrong_order_target`."""
    a, pairs = terms[0], list(zip(terms[1::2], terms[2::2]))
    work, total = [], a
    if wrong:
        (b, c), pairs = pairs[0], pairs[1:]
        work += [f"{a}+{b}={a + b}", f"{a + b}*{c}={(a + b) * c}"]
        total = (a + b) * c
    work += [f"{b}*{c}={b * c}" for b, c in pairs]
    for b, c in pairs:
        work.append(f"{total}+{b * c}={total + b * c}")
        total += b * c
    return ",".join(work) + f"\\boxed{{{total}}}"


@register("task", "long_tail_arithmetic")
def long_tail_arithmetic_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float,
                              wrong_order_fraction: float, seed: int, long_fraction: float = 0.125,
                              long_products: int = 8, **_: Any) -> dict[str, str]:
    """The a+b*c= task with a long tail of answer lengths, for measuring rollouts whose lengths differ: a
    `long_fraction` share of problems (one in eight by default) chain `long_products` products
    (`a+b1*c1+...+b8*c8=`), whose work is about eight times as long as one product's. SFT targets use the wrong
    order of operations for the first product in a `wrong_order_fraction` share, so RL has the quickstart's choice
    to make on every problem; the answer is the value with the right order. Params (`data.synthetic.params`):
    long_fraction, long_products."""
    if not 0 <= long_fraction <= 1 or long_products < 1:
        raise ValueError(f"data.synthetic.params: the long_tail_arithmetic task needs 0 <= long_fraction <= 1 and "
                         f"long_products >= 1; got long_fraction={long_fraction}, long_products={long_products}")
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    while len(seen) < num_train + num_eval:
        seen.add(make_chain(rng, long_products if rng.random() < long_fraction else 1))
    problems = sorted(seen, key=lambda t: (len(t), t))
    rng.shuffle(problems)
    eval_set, train_set = problems[:num_eval], problems[num_eval:]
    n_sft = int(len(train_set) * sft_fraction)

    def rows(ps: list[tuple[int, ...]], sft: bool) -> list[dict[str, Any]]:
        out = [{"prompt": chain_prompt(t), "answer": str(chain_value(t))} for t in ps]
        if sft:
            out = [{**r, "target": chain_target(t, rng.random() < wrong_order_fraction)} for r, t in zip(out, ps)]
        return out

    return write_splits(out_dir, {"sft": rows(train_set[:n_sft], True), "train": rows(train_set[n_sft:], False),
                                  "eval": rows(eval_set, False)})
