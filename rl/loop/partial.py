"""Partial rollouts (`rollout.partial_tokens`): long responses are generated over several steps, so a long tail does
not hold the step.

Each step every unfinished response of the pool grows by at most `partial_tokens` tokens (one continuation call
from its prompt and the ids it holds, with the weights the engines hold now), rounds repeat until `prompts_per_step`
groups have every response finished (by EOS or a stop string, or at `rollout.max_new_tokens`), and the step trains
on those groups, oldest first; the others stay in the pool, and new prompts keep `rollout.partial_groups` groups
open (default twice `prompts_per_step`: the slack that lets a long response wait while others are trained on).
A response continued across an update holds tokens of several policy versions: each token keeps the version that
sampled it (batch extra `token_version`) and its behaviour logprob, `algorithm.is_correction: token` weights each
token by its own, and a token more than `trainer.max_staleness` versions behind the policy being trained leaves the
loss (`rl.step.bound_token_staleness`). The pool is saved with the checkpoint, so a resumed run continues the
responses it held.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from rl.batch import Batch, pad_token_rows
from rl.data import format_prompt


@dataclass
class PartialResponse:
    group: int  # the group (prompt) it belongs to, unique over the run
    row: int  # index of its prompt in the training rows
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version of each token
    ended: bool = False  # by EOS or a stop string
    done: bool = False  # ended, or at rollout.max_new_tokens


class PartialRollouts:
    """The pool of open groups and the rounds that grow it (`next_batch`), on the actor system `roles`."""

    def __init__(self, cfg: DictConfig, tokenizer: Any, roles: Any, sampler: Any, rows: list[dict]):
        self.cfg, self.tok, self.roles, self.sampler, self.rows = cfg, tokenizer, roles, sampler, rows
        self.pool: list[PartialResponse] = []
        self.next_group = 0
        self.rounds = 0  # continuation rounds so far (seeds)

    def next_batch(self, step: int) -> tuple[Batch, dict[str, float]]:
        """The step's batch of `prompts_per_step` finished groups; metrics of the rounds it took."""
        want, rounds = self.cfg.trainer.prompts_per_step, 0
        self._open_groups(self.cfg.rollout.partial_groups or 2 * want)
        while len(self._finished_groups()) < want:
            self._grow(step)
            rounds += 1
        groups = self._finished_groups()[:want]
        taken = [r for r in self.pool if r.group in set(groups)]
        self.pool = [r for r in self.pool if r.group not in set(groups)]
        carried = sum(1 for r in self.pool if r.ids)
        return self._batch(taken), {"rollout/partial_rounds": float(rounds),
                                    "rollout/partial_carried": float(carried)}

    def _open_groups(self, want: int) -> None:
        """New prompts, `rollout.n` responses each, until `want` groups are open."""
        open_groups = len({r.group for r in self.pool})
        if open_groups >= want:
            return
        d = self.cfg.data
        for i in self.sampler.next(want - open_groups):
            text = format_prompt(self.rows[i][d.prompt_column], self.tok, d.prompt_prefix, d.chat_template)
            ids = self.tok(text, add_special_tokens=False)["input_ids"] or [self.tok.bos_token_id
                                                                             or self.tok.eos_token_id]
            self.pool += [PartialResponse(self.next_group, i, list(ids)) for _ in range(self.cfg.rollout.n)]
            self.next_group += 1

    def _finished_groups(self) -> list[int]:
        order: dict[int, bool] = {}
        for r in self.pool:
            order[r.group] = order.get(r.group, True) and r.done
        return [g for g, done in order.items() if done]

    def _grow(self, step: int) -> None:
        """One round: every unfinished response grows by up to `partial_tokens` tokens."""
        r = self.cfg.rollout
        growing = [x for x in self.pool if not x.done]
        budgets = [min(r.partial_tokens, r.max_new_tokens - len(x.ids)) for x in growing]
        seed = self.cfg.seed * 1_000_003 + self.rounds * 7919
        outs = self.roles.continue_responses([x.prompt_ids + x.ids for x in growing], budgets, seed)
        self.rounds += 1
        for x, budget, (ids, logp, ended, version) in zip(growing, budgets, outs):
            x.ended = ended and len(ids) <= budget  # an end past this response's budget is not reached yet
            ids, logp = ids[:budget], logp[:budget]
            x.ids += ids
            x.logp += logp
            x.versions += [version] * len(ids)
            x.done = x.ended or len(x.ids) >= r.max_new_tokens

    def _batch(self, taken: list[PartialResponse]) -> Batch:
        """The finished responses (grouped, in the pool's order) as a Batch with their tokens' versions."""
        d, tok = self.cfg.data, self.tok
        N, L = len(taken), max(1, max(len(x.ids) for x in taken))
        prompt, prompt_mask = pad_token_rows([x.prompt_ids for x in taken], tok.pad_token_id, "left")
        resp = torch.full((N, L), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros((N, L), dtype=torch.long)
        logp, versions = torch.zeros((N, L)), torch.zeros((N, L), dtype=torch.long)
        for i, x in enumerate(taken):
            n = len(x.ids)
            resp[i, :n], attn[i, :n] = torch.tensor(x.ids, dtype=torch.long), 1
            logp[i, :n], versions[i, :n] = torch.tensor(x.logp), torch.tensor(x.versions)
            versions[i, n:] = x.versions[-1] if x.versions else 0
        rows = [self.rows[x.row] for x in taken]
        batch = Batch(prompt_ids=prompt, prompt_mask=prompt_mask, response_ids=resp, response_mask=attn.float(),
                      response_attn=attn, group_id=torch.tensor([x.group for x in taken]), rollout_logp=logp,
                      truncated=torch.tensor([not x.ended for x in taken]),
                      responses=[tok.decode(x.ids, skip_special_tokens=True) for x in taken],
                      prompts=[format_prompt(r[d.prompt_column], tok, d.prompt_prefix, d.chat_template) for r in rows],
                      ground_truth=[r.get(d.answer_column) for r in rows],
                      metadata=[{"row": x.row, **{c: r.get(c) for c in d.metadata_columns}}
                                for x, r in zip(taken, rows)])
        batch.policy_version = int(versions[attn.bool()].min()) if attn.any() else 0
        batch.set_extra("token_version", versions, pad="right")
        return batch

    def state(self) -> dict[str, Any]:
        return {"pool": [asdict(r) for r in self.pool], "next_group": self.next_group, "rounds": self.rounds}

    def load(self, state: dict[str, Any]) -> None:
        self.pool = [PartialResponse(**r) for r in state.get("pool", [])]
        self.next_group, self.rounds = int(state.get("next_group", 0)), int(state.get("rounds", 0))
