"""FAIR-Calib: post-training W4A4 quantization of masked-diffusion LMs, calibrated with a frontier-aware position prior.

rl/methods/fair_calib/README.md. Confirmed: Stage I probes the full-precision teacher under a random commit policy and
accumulates, per generation position i, w_i += λ0(t)·1{i ∈ Ĉ_t} + λ1·c̃_{t,i}·1{i masked at t} (frontier hits with an
early boost, plus the masked-stage reliability), aligned to a window of the last K positions, normalised, with a
floor outside; Stage II calibrates the quantizers block by block, earlier blocks calibrated and frozen, minimising the
w̄-weighted hidden-state MSE on teacher-forced (unmasked) sequences. [RECONSTRUCTION]: λ0(t) = 1 + β(1 − t/T),
λ1 = 1, c̃ = the top-1 probability divided by its largest value over the row's masked positions, floor =
0.01·mean(w̄); the quantizer is `models.quant` (per-channel weights, per-token activations, learnable clipping ratios,
and with `transform="kron"` FlatQuant's learnable Kronecker-factored flattening, trained with the ratios).

Diagnostics on the teacher's own low-confidence trajectories: the frontier flip rate (the quantized model's argmax
differs from the token the teacher commits, in the same state), the trajectory KL (KL(p_fp ‖ p_q) at the committed
positions), the post-commit mismatch (the quantized model's own decoded tokens against the teacher's), and the
stability lag δ_lag of the quantized model's own trajectories with its CCDF: the steps from a position's commit until
the model's top-1 prediction for it agrees with the final token and keeps agreeing. [RECONSTRUCTION]: a masked-diffusion
model predicts masked positions only, so "its top-1 prediction" at a committed position is read leave-one-out: that
position alone masked again in the state after each step (as CORE probes committed tokens); a position that still
disagrees in the final state is censored at the steps left after its commit.
"""

from __future__ import annotations

import torch
from torch import nn

from models.blocks import block_outputs, decoder_layers
from models.diffusion import num_transfer_tokens
from models.quant import FakeQuantLinear

WEIGHTINGS = ("fair", "frontier", "reliability", "uniform")


def early_boost(t: int, steps: int, beta: float = 1.0) -> float:
    """λ0(t) = 1 + β(1 − t/T): commits early in the trajectory weigh more (non-increasing in t)."""
    return 1.0 + beta * (1.0 - t / steps)


def accumulate_prior(commits: torch.Tensor, masked: torch.Tensor, reliability: torch.Tensor, *, beta: float = 1.0,
                     lambda1: float = 1.0, frontier: bool = True, masked_stage: bool = True) -> torch.Tensor:
    """w_i = Σ_t λ0(t)·1{i ∈ Ĉ_t} + λ1·c̃_{t,i}·1{i ∈ M(S_t)} over one rollout: `commits`, `masked` `[T, G]` bool
    (what step t commits; what is masked when step t starts), `reliability` `[T, G]` (c̃ at step t)."""
    steps = commits.shape[0]
    w = torch.zeros(commits.shape[1], dtype=torch.float64)
    for t in range(steps):
        if frontier:
            w += early_boost(t, steps, beta) * commits[t].double()
        if masked_stage:
            w += lambda1 * reliability[t].double() * masked[t].double()
    return w


def window_prior(w: torch.Tensor, window: int, floor_frac: float = 0.01) -> torch.Tensor:
    """The prior over the generation positions: the last `window` positions normalised to sum to 1, every earlier
    position given the floor `floor_frac`·mean (of the window's normalised weights)."""
    w = w.double().clone()
    k = min(window, len(w))
    inside = w[-k:] / w[-k:].sum().clamp(min=1e-30)
    out = torch.full_like(w, window_floor(inside, window, floor_frac))
    out[-k:] = inside
    return out


def window_floor(prior: torch.Tensor, window: int, floor_frac: float) -> float:
    """The floor weight outside the window, `floor_frac`·mean of the window's weights: what earlier generation
    positions get from `window_prior` and prompt tokens from `position_weights`, whatever the generation length."""
    return floor_frac * float(prior[-min(window, len(prior)):].double().mean())


@torch.no_grad()
def probe_prior(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, mask_id: int,
                gen_length: int, steps: int, probes: int, seed: int = 0, beta: float = 1.0, lambda1: float = 1.0,
                frontier: bool = True, masked_stage: bool = True) -> torch.Tensor:
    """Stage I: `probes` rollouts of the full-precision teacher (the prompts cycled) under a random commit policy
    (LLaDA's linear schedule of tokens per step, the positions drawn at random among the masked ones, filled with the
    teacher's top-1), each accumulated by `accumulate_prior`; returns the mean `[gen_length]` weights."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    total = torch.zeros(gen_length, dtype=torch.float64)
    done = 0
    B, P = prompt_ids.shape
    while done < probes:
        n = min(B, probes - done)
        x = torch.cat([prompt_ids[:n], torch.full((n, gen_length), mask_id, dtype=torch.long, device=device)], 1)
        attn = torch.cat([prompt_mask[:n].long(), torch.ones(n, gen_length, dtype=torch.long, device=device)], 1)
        pos_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        schedule = num_transfer_tokens(torch.full((n,), gen_length), steps)
        # the rollout's bookkeeping stays on the host; only the model's inputs live on its device
        commits = torch.zeros(steps, n, gen_length, dtype=torch.bool)
        masked_at = torch.zeros(steps, n, gen_length, dtype=torch.bool)
        rel = torch.zeros(steps, n, gen_length)
        for t in range(steps):
            masked = x[:, P:] == mask_id
            probs = torch.softmax(model(input_ids=x, attention_mask=attn, position_ids=pos_ids).logits[:, P:].float(), -1)
            top, arg = probs.max(-1)
            row_max = torch.where(masked, top, torch.zeros_like(top)).amax(-1, keepdim=True).clamp(min=1e-12)
            rel[t] = torch.where(masked, top / row_max, torch.zeros_like(top)).cpu()
            masked_at[t] = masked.cpu()
            for r in range(n):
                open_ = masked_at[t, r].nonzero().squeeze(-1)
                pick = open_[torch.randperm(len(open_), generator=g)[:int(schedule[r, t])]]
                commits[t, r, pick] = True
                x[r, P + pick.to(device)] = arg[r, pick.to(device)]
        for r in range(n):
            total += accumulate_prior(commits[:, r], masked_at[:, r], rel[:, r], beta=beta, lambda1=lambda1,
                                      frontier=frontier, masked_stage=masked_stage)
        done += n
    return total / probes


def position_weights(attention_mask: torch.Tensor, answer_start: torch.Tensor, prior: torch.Tensor | None,
                     floor: float | None = None) -> torch.Tensor:
    """`[B, S]` calibration weights of right-padded teacher-forced sequences: answer position j of a row gets
    `prior[j]` (the prior's last value past its end), its prompt tokens `floor` (`window_floor`: the same floor as
    generation positions before the window), padding 0. `prior` None: 1 at every real token (the uniform block MSE)."""
    real = attention_mask.bool()
    if prior is None:
        return real.float()
    if floor is None:
        raise ValueError("position_weights: a prior needs its floor (window_floor) for the prompt tokens")
    S, device = attention_mask.shape[1], attention_mask.device
    j = torch.arange(S, device=device)[None] - answer_start.to(device)[:, None]
    w = torch.where(j >= 0, prior.float().to(device)[j.clamp(0, len(prior) - 1)],
                    torch.full((1, S), float(floor), device=device))
    return w * real


def calibrate_blocks(fp: nn.Module, quant: nn.Module, batches: list[dict[str, torch.Tensor]],
                     weights: list[torch.Tensor], *, epochs: int = 15, lr: float = 5e-3, log=None) -> list[dict]:
    """Stage II: block by block, the clipping ratios (and flattening transforms) of block ℓ's quantizers (AdamW,
    `lr`, `epochs` passes over `batches`) minimise Σ_i w_i ‖h^q_ℓ,i − h*_ℓ,i‖² / Σ_i w_i, the quantized block fed by
    the calibrated quantized prefix; the parameters of the best epoch are kept. Returns per block the loss before and
    after."""
    for p in quant.parameters():
        p.requires_grad_(False)
    history = []
    for j, block in enumerate(decoder_layers(quant)):
        params = [p for m in block.modules() if isinstance(m, FakeQuantLinear)
                  for p in m.quantizer_parameters().values()]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        with torch.no_grad():
            targets = [block_outputs(fp, b, j)[j].float() for b in batches]
        before = best = _weighted_mse(quant, batches, targets, weights, j)
        kept = [p.detach().clone() for p in params]
        for _ in range(epochs):
            for b, t, w in zip(batches, targets, weights):
                opt.zero_grad()
                _block_loss(quant, b, t, w, j).backward()
                opt.step()
            if (now := _weighted_mse(quant, batches, targets, weights, j)) < best:
                best, kept = now, [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, k in zip(params, kept):
                p.copy_(k)
                p.requires_grad_(False)
        history.append({"block": j, "loss_before": before, "loss_after": best})
        if log is not None:
            log(j, before, best)
    return history


def _block_loss(model: nn.Module, batch: dict[str, torch.Tensor], target: torch.Tensor, weight: torch.Tensor,
                j: int) -> torch.Tensor:
    out = block_outputs(model, batch, j)[j].float()
    return ((out - target).pow(2).sum(-1) * weight).sum() / weight.sum().clamp(min=1e-12)


@torch.no_grad()
def _weighted_mse(model: nn.Module, batches: list, targets: list, weights: list, j: int) -> float:
    return sum(float(_block_loss(model, b, t, w, j)) for b, t, w in zip(batches, targets, weights)) / len(batches)


@torch.no_grad()
def trajectory_diagnostics(fp: nn.Module, quant: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                           mask_id: int, gen_length: int, block_length: int, steps: int) -> dict:
    """On the teacher's greedy low-confidence trajectories: the frontier flip rate, the mean KL(p_fp ‖ p_q) at the
    committed positions (the trajectory KL), and the quantized model's own greedy decode against the teacher's
    (the share of response tokens that differ: the post-commit mismatch)."""
    from models.diffusion import diffusion_generate
    device = next(fp.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    teacher = diffusion_generate(fp, prompt_ids, prompt_mask, gen_length=gen_length, block_length=block_length,
                                 steps=steps, mask_id=mask_id)
    own = diffusion_generate(quant, prompt_ids, prompt_mask, gen_length=gen_length, block_length=block_length,
                             steps=steps, mask_id=mask_id)
    B, P = prompt_ids.shape
    attn = torch.cat([prompt_mask.long(), torch.ones(B, gen_length, dtype=torch.long, device=prompt_ids.device)], 1)
    pos_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    flips = kl = 0.0
    count = 0
    for t in range(steps):  # replay the teacher's states: what was committed before step t
        state = torch.cat([prompt_ids, torch.where((teacher.commit_step < t), teacher.tokens,
                                                   torch.full_like(teacher.tokens, mask_id))], 1)
        now = teacher.commit_step == t
        if not now.any():
            continue
        lf = torch.log_softmax(fp(input_ids=state, attention_mask=attn, position_ids=pos_ids).logits[:, P:].float(), -1)
        lq = torch.log_softmax(quant(input_ids=state, attention_mask=attn, position_ids=pos_ids).logits[:, P:].float(), -1)
        flips += float((lq.argmax(-1) != teacher.tokens)[now].sum())
        kl += float((lf.exp() * (lf - lq)).sum(-1)[now].sum())
        count += int(now.sum())
    return {"frontier_flip_rate": flips / max(count, 1), "trajectory_kl": kl / max(count, 1),
            "post_commit_mismatch": float((own.tokens != teacher.tokens).float().mean()),
            **lag_summary(*stability_lags(quant, prompt_ids, prompt_mask, own.tokens, own.commit_step, mask_id=mask_id,
                                          steps=steps))}


def lags_from_agreement(agree: torch.Tensor, commit_step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """δ_lag per position from `agree [T, B, G]` (whether the top-1 prediction for the position after step t equals
    its final token; steps before its commit are ignored) and `commit_step [B, G]`: the first step t ≥ commit from
    which it agrees through the last step, minus the commit step. Positions that disagree in the last state are
    censored at T − commit. Returns `(lags [B, G], censored [B, G])`."""
    T = agree.shape[0]
    # agrees_from[t] = agree[t] & agree[t+1] & ... & agree[T-1]: a reversed cumulative AND
    agrees_from = agree.flip(0).long().cumprod(0).flip(0).bool()
    steps = torch.arange(T, device=agree.device).view(T, 1, 1)
    after_commit = steps >= commit_step.unsqueeze(0)
    first = torch.where(agrees_from & after_commit, steps, torch.full_like(steps.expand_as(agree), T)).amin(0)
    censored = first >= T
    return (first - commit_step).clamp(min=0), censored


def lag_ccdf(lags: torch.Tensor, max_lag: int) -> list[float]:
    """P(δ_lag ≥ d) for d = 0 … max_lag over every position of `lags`."""
    flat = lags.flatten().float()
    return [float((flat >= d).float().mean()) for d in range(max_lag + 1)]


def lag_summary(lags: torch.Tensor, censored: torch.Tensor) -> dict:
    """The diagnostics' δ_lag figures: its mean, the share of positions that never agreed, the CCDF up to the largest
    lag (`stability_lag_ccdf[d]` = P(δ_lag ≥ d))."""
    return {"stability_lag_mean": float(lags.float().mean()), "stability_lag_censored": float(censored.float().mean()),
            "stability_lag_ccdf": lag_ccdf(lags, int(lags.max()) if lags.numel() else 0)}


@torch.no_grad()
def stability_lags(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokens: torch.Tensor,
                   commit_step: torch.Tensor, *, mask_id: int, steps: int, rows_per_forward: int = 512
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """δ_lag of a finished trajectory without remasking (`tokens [B, G]` committed at `commit_step [B, G]`, as
    `diffusion_generate` returns them): after each step t, every committed position is masked again alone in the
    state of step t (what was committed up to t) and the model's argmax there is compared with its final token
    (`lags_from_agreement`)."""
    B, P = prompt_ids.shape
    G = tokens.shape[1]
    if bool((commit_step < 0).any()):
        raise ValueError("stability_lags: every response position must be committed (a finished trajectory)")
    attn = torch.cat([prompt_mask.long(), torch.ones(B, G, dtype=torch.long, device=prompt_ids.device)], 1)
    pos_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    agree = torch.zeros(steps, B, G, dtype=torch.bool, device=prompt_ids.device)
    for t in range(steps):
        state = torch.cat([prompt_ids, torch.where(commit_step <= t, tokens, torch.full_like(tokens, mask_id))], 1)
        rows, cols = (commit_step <= t).nonzero(as_tuple=True)
        for s in range(0, len(rows), rows_per_forward):
            r, c = rows[s:s + rows_per_forward], cols[s:s + rows_per_forward]
            probe = state[r].clone()
            probe[torch.arange(len(r), device=r.device), P + c] = mask_id
            logits = model(input_ids=probe, attention_mask=attn[r], position_ids=pos_ids[r]).logits
            agree[t, r, c] = logits[torch.arange(len(r), device=r.device), P + c].argmax(-1) == tokens[r, c]
    return lags_from_agreement(agree, commit_step)
