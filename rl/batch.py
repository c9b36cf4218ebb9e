"""`Batch`: the one data structure passed between rollout workers, reward service and learners.

Layout: prompts are left-padded `[N, P]`, responses right-padded `[N, L]`; per-token tensors
(`*_logp`, `advantages`) are `[N, L]` aligned with `response_ids`; looped models may add
`[N, L, T]` tensors. `group_id [N]` names the prompt a sample came from: group-relative
estimators need it, and a batch whose grouping does not match the recipe is rejected loudly.

Per-method data travels in `extras`: named per-sample or per-token tensors (or per-sample lists), each
with its padding rule, so a method adds a field without editing this file. Any advantage estimator or
loss that names a core field of `NAMED_FIELDS` or an extra as a keyword parameter receives it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

# Tensor fields that are per response token and right-padded, or per prompt token and left-padded.
_RIGHT_PADDED = ("response_ids", "response_mask", "response_attn", "token_step", "observation_mask", "rollout_logp",
                 "old_logp", "ref_logp", "advantages")
_LEFT_PADDED = ("prompt_ids", "prompt_mask")
_PAD_VALUE = {"token_step": -1}  # padding belongs to no step
PAD_RULES = ("none", "right", "left")

# Core fields that an advantage estimator or a loss receives when it names them as keyword parameters
# (multi-turn/step data); extras are passed the same way.
NAMED_FIELDS = ("token_step", "step_rewards", "step_types", "valid", "observation_mask")


@dataclass(frozen=True)
class Extra:
    """One per-method field: `value` is a tensor `[N, ...]` or a per-sample list; `pad` says how batches of
    different widths are joined: `none` (per sample), `right` (per response token, dim 1 right-padded, as
    `response_ids`) or `left` (per prompt token, as `prompt_ids`), filling with `pad_value`."""
    value: Any
    pad: str = "none"
    pad_value: float = 0


@dataclass
class Batch:
    prompt_ids: torch.Tensor  # [N, P] long, left-padded
    prompt_mask: torch.Tensor  # [N, P] long/bool, 1 on real prompt tokens
    response_ids: torch.Tensor  # [N, L] long, right-padded
    response_mask: torch.Tensor  # [N, L] float, 1 on tokens that count in the loss
    group_id: torch.Tensor  # [N] int64, same id for all samples of one prompt
    response_attn: torch.Tensor | None = None  # [N, L] long, 1 on generated tokens (None: = response_mask)
    rollout_logp: torch.Tensor | None = None  # [N, L] sampled-token logprobs from the rollout engine
    old_logp: torch.Tensor | None = None  # [N, L] learner logprobs before the update (PPO ratio)
    ref_logp: torch.Tensor | None = None  # [N, L] frozen reference logprobs (KL)
    advantages: torch.Tensor | None = None  # [N, L] (or [N, L, T] for per-loop credit)
    rewards: torch.Tensor | None = None  # [N] float
    reward_failed: torch.Tensor | None = None  # [N] bool: the reward could not be computed
    truncated: torch.Tensor | None = None  # [N] bool: generation hit max_new_tokens
    token_step: torch.Tensor | None = None  # [N, L] long: index of the step (span) a token belongs to, -1 outside
    observation_mask: torch.Tensor | None = None  # [N, L] 1 on environment/tool-output tokens (never trained on)
    valid: torch.Tensor | None = None  # [N] bool: trajectory passed its validity check (multi-granularity rewards)
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    ground_truth: list[Any] = field(default_factory=list)
    metadata: list[dict] = field(default_factory=list)
    reward_components: list[dict] = field(default_factory=list)
    step_rewards: list[list[float]] = field(default_factory=list)  # per sample, one reward per step
    step_types: list[list[str]] = field(default_factory=list)  # per sample, the type of each step
    policy_version: int = 0
    extras: dict[str, Extra] = field(default_factory=dict)  # per-method fields with their padding rule

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    # ------------------------------------------------------------------ extras
    def set_extra(self, name: str, value: Any, pad: str = "none", pad_value: float = 0) -> None:
        """Attach a per-method field (see `Extra`); its first dimension must be the batch size."""
        if name in {f.name for f in dataclasses.fields(Batch)}:
            raise ValueError(f"batch extra {name!r}: the name of a core Batch field")
        if pad not in PAD_RULES:
            raise ValueError(f"batch extra {name!r}: pad must be one of {PAD_RULES}, got {pad!r}")
        rows = value.shape[0] if isinstance(value, torch.Tensor) else len(value)
        if rows != len(self):
            raise ValueError(f"batch extra {name!r}: {rows} rows for a batch of {len(self)} samples")
        if pad != "none" and not (isinstance(value, torch.Tensor) and value.dim() >= 2):
            raise ValueError(f"batch extra {name!r}: pad {pad!r} needs a tensor with a token dimension")
        self.extras[name] = Extra(value, pad, pad_value)

    def named_fields(self, fn: Any) -> dict[str, Any]:
        """The core fields of `NAMED_FIELDS` and the extras that `fn` names as parameters and this batch
        carries (e.g. MGPO's step map), by name."""
        import inspect
        params = inspect.signature(fn).parameters
        out = {}
        for name in NAMED_FIELDS:
            value = getattr(self, name)
            if name in params and value is not None and (not isinstance(value, list) or value):
                out[name] = value
        out.update({name: e.value for name, e in self.extras.items() if name in params})
        return out

    # ------------------------------------------------------------------ structure
    def select(self, index: torch.Tensor | list[int] | slice) -> Batch:
        """Rows `index` (tensor/list of ints or a slice) as a new Batch."""
        if isinstance(index, slice):
            rows = list(range(len(self)))[index]
        else:
            rows = [int(i) for i in (index.tolist() if isinstance(index, torch.Tensor) else index)]
        idx = torch.tensor(rows, dtype=torch.long)
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v.index_select(0, idx)
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in rows] if v else []
            elif f.name == "extras":
                out[f.name] = {name: dataclasses.replace(e, value=e.value.index_select(0, idx)
                                                         if isinstance(e.value, torch.Tensor)
                                                         else [e.value[i] for i in rows])
                               for name, e in v.items()}
            else:
                out[f.name] = v
        return Batch(**out)

    def trimmed(self) -> Batch:
        """The same rows without the columns that are padding in every row: leading prompt columns no row
        uses (one prompt column always stays: the first response token is predicted from it) and response
        columns past every row's end. A micro-batch of similar lengths then runs at its own width, not the
        whole batch's; nothing changes but the width (padding is masked and positions count real tokens)."""
        resp = self.response_mask.bool()
        if self.response_attn is not None:
            resp = resp | self.response_attn.bool()
        used = self.prompt_mask.bool().any(0).nonzero()
        start = min(int(used[0]) if len(used) else self.prompt_ids.shape[1] - 1, self.prompt_ids.shape[1] - 1)
        ends = resp.any(0).nonzero()
        end = int(ends[-1]) + 1 if len(ends) else 1
        if start == 0 and end == self.response_ids.shape[1]:
            return self
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and f.name in _RIGHT_PADDED:
                v = v[:, :end]
            elif isinstance(v, torch.Tensor) and f.name in _LEFT_PADDED:
                v = v[:, start:]
            elif f.name == "extras":
                v = {name: dataclasses.replace(e, value=e.value[:, :end] if e.pad == "right" else
                                               e.value[:, start:] if e.pad == "left" else e.value)
                     for name, e in v.items()}
            out[f.name] = v
        return Batch(**out)

    def split(self, num_chunks: int) -> list[Batch]:
        """Contiguous, near-equal chunks (for data-parallel ranks or micro-batches)."""
        n = len(self)
        if num_chunks < 1 or num_chunks > n:
            raise ValueError(f"cannot split a batch of {n} samples into {num_chunks} chunks")
        bounds = [round(i * n / num_chunks) for i in range(num_chunks + 1)]
        return [self.select(slice(bounds[i], bounds[i + 1])) for i in range(num_chunks)]

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Stack batches row-wise, re-padding prompts (left) and responses (right) to a common width."""
        if not batches:
            raise ValueError("concat of an empty list")
        out: dict[str, Any] = {}
        for f in dataclasses.fields(Batch):
            vals = [getattr(b, f.name) for b in batches]
            if all(isinstance(v, torch.Tensor) for v in vals):
                if f.name in _RIGHT_PADDED or f.name in _LEFT_PADDED:
                    width = max(v.shape[1] for v in vals)
                    vals = [_pad_dim1(v, width, left=f.name in _LEFT_PADDED, value=_PAD_VALUE.get(f.name, 0))
                            for v in vals]
                out[f.name] = torch.cat(vals, 0)
            elif all(v is None for v in vals):
                out[f.name] = None
            elif all(isinstance(v, list) for v in vals):
                out[f.name] = [x for v in vals for x in v]
            elif f.name == "policy_version":
                out[f.name] = min(vals)
            elif f.name == "extras":
                out[f.name] = _concat_extras(vals)
            else:
                raise ValueError(f"cannot concat batches: field {f.name!r} is set in some and not others")
        return Batch(**out)

    # ------------------------------------------------------------------ model inputs
    def model_inputs(self) -> dict[str, torch.Tensor]:
        """`input_ids`, `attention_mask`, `position_ids` of prompt+response, for a causal LM forward.

        Positions count real tokens only, so a left-padded prompt gets the same positions as in
        generation; right padding after EOS is masked out.
        """
        resp_attn = self.response_attn if self.response_attn is not None else self.response_mask
        attn = torch.cat([self.prompt_mask.long(), resp_attn.long()], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": torch.cat([self.prompt_ids, self.response_ids], 1),
                "attention_mask": attn, "position_ids": pos}

    def check_groups(self, group_size: int) -> None:
        """Fail loudly when grouping does not match the recipe's group size."""
        ids, counts = torch.unique(self.group_id, return_counts=True)
        bad = [(int(i), int(c)) for i, c in zip(ids, counts) if c != group_size]
        if bad:
            raise ValueError(f"group_id mismatch: expected {group_size} samples per prompt, got "
                             f"(group_id, count) = {bad[:5]}{' ...' if len(bad) > 5 else ''}")


def _concat_extras(parts: list[dict[str, Extra]]) -> dict[str, Extra]:
    names = set(parts[0])
    for p in parts[1:]:
        if set(p) != names:
            raise ValueError(f"cannot concat batches: extras {sorted(names ^ set(p))} are set in some and not others")
    out = {}
    for name in sorted(names):
        es = [p[name] for p in parts]
        if len({(e.pad, e.pad_value) for e in es}) > 1:
            raise ValueError(f"cannot concat batches: extra {name!r} has different padding rules")
        pad, value = es[0].pad, es[0].pad_value
        if isinstance(es[0].value, torch.Tensor):
            vals = [e.value for e in es]
            if pad != "none":
                width = max(v.shape[1] for v in vals)
                vals = [_pad_dim1(v, width, left=pad == "left", value=value) for v in vals]
            out[name] = Extra(torch.cat(vals, 0), pad, value)
        else:
            out[name] = Extra([x for e in es for x in e.value], pad, value)
    return out


def _pad_dim1(t: torch.Tensor, width: int, left: bool, value: int = 0) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad_shape = list(t.shape)
    pad_shape[1] = width - t.shape[1]
    pad = torch.full(pad_shape, value, dtype=t.dtype)
    return torch.cat([pad, t] if left else [t, pad], 1)


def sequence_tokens(batch: Batch) -> list[int]:
    """Real tokens of each row (prompt plus generated response): its cost in a packed forward."""
    resp = batch.response_attn if batch.response_attn is not None else batch.response_mask
    return (batch.prompt_mask.long().sum(-1) + resp.long().sum(-1)).tolist()


def plan_micro_batches(costs: list[int], world_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Rows per rank and per micro-batch, formed by token count: `plan[rank][k]` lists row indices.

    Rows go to ranks longest first, each to the rank with the fewest tokens so far (balanced work); each
    rank's rows are packed first-fit into micro-batches of at most `max_tokens` tokens (a longer row is a
    micro-batch of its own). Every rank gets the same number of micro-batches — ZeRO-2/3 run a collective
    per forward/backward — so a rank with fewer splits its fullest micro-batch, or gets empty ones (the
    caller fills those with a row that carries no loss).
    """
    if world_size < 1 or max_tokens < 1:
        raise ValueError(f"plan_micro_batches: world_size and max_tokens must be >= 1, got {world_size}, {max_tokens}")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in order:
        r = min(range(world_size), key=lambda r: (load[r], len(ranks[r]), r))
        ranks[r].append(i)
        load[r] += costs[i]
    plans = []
    for rows in ranks:  # already longest first: first-fit decreasing
        bins: list[list[int]] = []
        room: list[int] = []
        for i in rows:
            k = next((k for k, free in enumerate(room) if costs[i] <= free), None)
            if k is None:
                bins.append([i])
                room.append(max_tokens - costs[i])
            else:
                bins[k].append(i)
                room[k] -= costs[i]
        plans.append(bins)
    count = max(1, max(len(b) for b in plans))
    for bins in plans:
        while len(bins) < count:
            splittable = [k for k, b in enumerate(bins) if len(b) > 1]
            if not splittable:
                bins.append([])
                continue
            k = max(splittable, key=lambda k: sum(costs[i] for i in bins[k]))
            half = len(bins[k]) // 2
            bins.append(bins[k][half:])
            bins[k] = bins[k][:half]
    return [[sorted(b) for b in bins] for bins in plans]


def plan_prompt_groups(batch: Batch, world_size: int, max_tokens: int) -> list[list[list[int]]]:
    """`plan_micro_batches` for a learner that shares each prompt's forward among the rows that repeat it
    (`learner.share_prompts`): the rows of one group (`group_id`, the prompt they were sampled from) stay in one
    micro-batch, which costs the prompt's tokens once plus every row's response tokens."""
    resp = batch.response_attn if batch.response_attn is not None else batch.response_mask
    resp_tokens = resp.long().sum(-1)
    prompt_tokens = batch.prompt_mask.long().sum(-1)
    ids = torch.unique(batch.group_id)
    groups = [(batch.group_id == g).nonzero().flatten().tolist() for g in ids]
    costs = [int(prompt_tokens[rows[0]]) + int(resp_tokens[rows].sum()) for rows in groups]
    return [[sorted(r for g in bin_ for r in groups[g]) for bin_ in bins]
            for bins in plan_micro_batches(costs, world_size, max_tokens)]


def contiguous_plan(num_rows: int, world_size: int, micro_batches: int) -> list[list[list[int]]]:
    """Rows per rank and micro-batch by count: contiguous near-equal shards, each split into `micro_batches`."""
    def split(rows: list[int], n: int) -> list[list[int]]:
        if n < 1 or n > len(rows):
            raise ValueError(f"cannot split a batch of {len(rows)} samples into {n} chunks")
        bounds = [round(i * len(rows) / n) for i in range(n + 1)]
        return [rows[bounds[i]:bounds[i + 1]] for i in range(n)]
    return [split(shard, micro_batches) for shard in split(list(range(num_rows)), world_size)]


def micro_batches_of(batch: Batch, plan: list[list[list[int]]]) -> list[list[Batch]]:
    """The `Batch` of every micro-batch of `plan`, at its own width (`Batch.trimmed`); an empty one becomes a
    filler: a row of the batch with its loss mask zeroed, so that its rank still runs the forward and
    backward the others run."""
    out = []
    for bins in plan:
        mbs = []
        for rows in bins:
            if rows:
                mbs.append(batch.select(rows).trimmed())
            else:
                filler = batch.select([0])
                filler.response_mask = torch.zeros_like(filler.response_mask)
                mbs.append(filler)
        out.append(mbs)
    return out


def batch_of_examples(examples: list[Any], pad_id: int) -> Batch:
    """`rl.sft_data.SFTExample`s as one batch: prompts left-padded, responses right-padded; `response_mask` is
    each example's loss mask, `response_attn` covers all its response tokens (later user turns are read, not
    trained)."""
    n, p_width = len(examples), max(len(e.prompt_ids) for e in examples)
    width = max(len(e.response_ids) for e in examples)
    prompt = torch.full((n, p_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, p_width), dtype=torch.long)
    resp = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width))
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, e in enumerate(examples):
        if e.prompt_ids:
            prompt[i, p_width - len(e.prompt_ids):] = torch.tensor(e.prompt_ids)
            prompt_mask[i, p_width - len(e.prompt_ids):] = 1
        resp[i, :len(e.response_ids)] = torch.tensor(e.response_ids)
        mask[i, :len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.float)
        attn[i, :len(e.response_ids)] = 1
    return Batch(prompt_ids=prompt, prompt_mask=prompt_mask, response_ids=resp, response_mask=mask,
                 response_attn=attn, group_id=torch.arange(n))


def pad_token_rows(rows: list[list[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` `[N, max length]` of token rows padded on `side` (right: positions count
    from each row's first token; left: rows end together, as prompts for generation)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        ids[i, span], mask[i, span] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask
