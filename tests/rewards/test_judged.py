"""`judge_correctness` with a real judge model: a tiny Llama taught in this process to rate answers against their
references in LongBench-Chat's format, served by the hf engine as a `reward.judges` entry is."""

import pytest
import torch

from models.tiny import build_tiny_model, build_tiny_tokenizer
from rewards.judged import TEMPLATE, judge_correctness
from rollout.base import SamplingParams
from rollout.hf_engine import HFEngine

# (question, reference, answer) -> the rating the judge is taught to give: a right answer 9, a wrong one 2
STEPS = 400  # the rating splits from the plateau (loss ~0.05) near step 275 with these settings
CASES = [(f"What is {a}+{b}?", str(a + b), str(answer))
         for a, b in ((2, 3), (4, 1), (3, 3)) for answer in (a + b, a + b + 1)]


def _rating(reference: str, answer: str) -> str:
    return "Rating: [[9]]" if answer == reference else "Rating: [[2]]"


def _teach_judge(path) -> None:
    """A tiny Llama taught (AdamW, full-prompt sequences) to answer each case's judge prompt with its rating. Every
    prompt opens with the template's instruction: each step runs it once and the six cases' remainders on its cache
    (gradients flow through both), 2.3x fewer positions than six whole prompts."""
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tok, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256,
                             max_position_embeddings=704)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    head = tok(TEMPLATE.split("{question}")[0], add_special_tokens=False)["input_ids"]
    rows = []
    for question, reference, answer in CASES:
        prompt = tok(TEMPLATE.format(question=question, reference=reference, answer=answer),
                     add_special_tokens=False)["input_ids"]
        assert prompt[:len(head)] == head
        target = tok(_rating(reference, answer), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((prompt[len(head):], target))
    L = max(len(p) + len(t) for p, t in rows)
    ids = torch.tensor([p + t + [tok.pad_token_id] * (L - len(p) - len(t)) for p, t in rows])
    attn = torch.tensor([[1] * (len(head) + len(p) + len(t)) + [0] * (L - len(p) - len(t)) for p, t in rows])
    loss_mask = torch.tensor([[0] * len(p) + [1] * len(t) + [0] * (L - len(p) - len(t)) for p, t in rows])[:, 1:]
    positions = torch.arange(len(head), len(head) + L).expand(len(rows), L)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a fixed count: the taught model is the same on any machine
    for _ in range(STEPS):
        shared = model(input_ids=torch.tensor([head]), use_cache=True)
        shared.past_key_values.batch_repeat_interleave(len(rows))
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions,
                       past_key_values=shared.past_key_values).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * loss_mask).sum() / loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    model.save_pretrained(path)
    tok.save_pretrained(path)


class EngineJudge:
    """The engine behind a `reward.judges` entry, called as the reward service calls a judge client (greedy, 16
    new tokens); `seeds` records each call's seed (tests/rl/methods/test_citation.py uses it too)."""

    def __init__(self, engine: HFEngine):
        self.engine, self.seeds = engine, []

    def generate(self, prompts, seed=0, **_):
        self.seeds.append(seed)
        return list(self.engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=16,
                                                                 seed=seed)).responses)


@pytest.fixture(scope="module")
def taught_judge(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge") / "model"
    _teach_judge(path)
    return EngineJudge(HFEngine(str(path)))


def test_a_taught_judge_rates_right_answers_high_and_wrong_ones_low_row_by_row(taught_judge):
    """The positive path: each response's reward is its judge's rating / 10, in the order of the responses, from
    one judge call (no retry needed when every answer is rated)."""
    order = [5, 0, 3, 2, 1, 4]  # mixed, so a reward in the wrong row shows
    questions = [CASES[i][0] for i in order]
    references = [CASES[i][1] for i in order]
    answers = [CASES[i][2] for i in order]
    taught_judge.seeds.clear()
    rewards = judge_correctness(questions, answers, ground_truth=references,
                                judges={"correctness_judge": taught_judge})
    assert rewards == [0.9 if a == r else 0.2 for a, r in zip(answers, references)]
    assert taught_judge.seeds == [0]

