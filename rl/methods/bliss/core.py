"""BLISS: bilevel influence scoring for data selection (rl/methods/bliss/README.md, from the released code).

A score model `s_i = sigmoid(Linear(h_i))` (the warmed-up proxy's backbone; `h_i` the last real token's hidden
state, as transformers' sequence classifiers read a decoder) weights the samples of a global batch by
`P = softmax(s)`. The lower level trains the proxy on

    G(θp) = Σ_i P_i CE_i + γ · KL(target ‖ proxy) + reg · ‖θp‖²          (`lower_level_loss`)

for `inner_steps` AdamW steps; the upper level lowers the proxy's validation loss `f` through the implicit
hypergradient:

    z ≈ (∇²G + λ_z I)⁻¹ ∇f        by `z_loops` steps z ← z − lr_z (Hz − ∇f + λ_z z), each clipped to norm 1
    g_i = ⟨∇CE_i, z⟩             (one double backward for all i)
    ∇_θs Φ = −Σ_i (∂P_i/∂θs) g_i = Σ_i c_i ∇s_i,   c_i = −P_i (g_i − Σ_j P_j g_j)     (`softmax_coefficients`)

so the score model's step is a backward of the surrogate `Σ_i c_i s_i`. Every sum over the global batch
(softmax, losses, gradients, Hessian-vector products) goes through a `Collective`, so data-parallel ranks take
exactly the step one process takes on the whole batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch


class Collective:
    """Sums and gathers over the data-parallel ranks (`torch.distributed` when initialised; else one rank)."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.world = self.dist.get_world_size() if self.dist else 1
        self.rank = self.dist.get_rank() if self.dist else 0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dist is not None:
            t = t.clone()
            self.dist.all_reduce(t)
        return t

    def sum_grads(self, params: list[torch.Tensor]) -> None:
        if self.dist is not None:
            for p in params:
                if p.grad is not None:
                    self.dist.all_reduce(p.grad)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The concatenation of every rank's `t` (equal sizes), in rank order."""
        if self.dist is None:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)


def global_softmax(scores: torch.Tensor, collective: Collective) -> torch.Tensor:
    """This rank's share of `softmax` over the scores of every rank (differentiable in the local scores)."""
    everything = collective.gather(scores.detach())
    log_z = torch.logsumexp(everything, 0)
    return torch.exp(scores - log_z)


def softmax_coefficients(weights: torch.Tensor, g: torch.Tensor, collective: Collective | None = None
                         ) -> torch.Tensor:
    """`c_i = −P_i (g_i − Σ_j P_j g_j)`: the hypergradient `−Σ_i (∂P_i/∂θs) g_i` equals `Σ_i c_i ∇s_i` for
    `P = softmax(s)` (the sum over `j` runs over the global batch)."""
    mean = (weights * g).sum()
    if collective is not None:
        mean = collective.sum(mean)
    return -weights * (g - mean)


def solve_z(hvp: Callable[[torch.Tensor], torch.Tensor], f_y: torch.Tensor, loops: int, lr_z: float,
            lamb: float, init: torch.Tensor | None = None, clip: float | None = 1.0) -> torch.Tensor:
    """`loops` gradient steps on `½ zᵀ(H + λI)z − zᵀ f_y` from `init` (default: every entry 1/numel), each step
    clipped to norm `clip`; tends to `(H + λI)⁻¹ f_y`."""
    z = torch.full_like(f_y, 1.0 / f_y.numel()) if init is None else init.clone()
    for _ in range(loops):
        step = lr_z * (hvp(z) - f_y + lamb * z)
        if clip is not None:
            norm = step.norm()
            if norm > clip:
                step = step * (clip / norm)
        z = z - step
    return z


def flat(tensors: list[torch.Tensor | None], like: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(tensors, like)])


def unflat(vector: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, i = [], 0
    for p in like:
        out.append(vector[i:i + p.numel()].view_as(p))
        i += p.numel()
    return out


class ScoreModel(torch.nn.Module):
    """The proxy's backbone (a copy) with a `Linear(d, 1)` + sigmoid head read at each sequence's last real token."""

    def __init__(self, proxy: torch.nn.Module):
        super().__init__()
        self.backbone = copy.deepcopy(proxy.get_decoder())
        self.head = torch.nn.Linear(proxy.config.hidden_size, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
                ) -> torch.Tensor:
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)  # the last real token of each row
        return torch.sigmoid(self.head(h[torch.arange(len(h)), last]).squeeze(-1))


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """Half precision computed in float32; float32 and float64 as they are."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def sequence_stats(model: torch.nn.Module, batch: Any, target_logp: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample, the token-mean CE of its trained response tokens `[N]`; per sample, the summed token KL of
    the target's distribution against the model's `[N]` (zeros without `target_logp [N, L, V]`); and the trained
    token count per sample `[N]`."""
    inputs = batch.model_inputs()
    P = batch.prompt_ids.shape[1]
    L = batch.response_ids.shape[1]
    logits = at_least_float32(model(**inputs, use_cache=False).logits[:, P - 1:P - 1 + L])
    logp = torch.log_softmax(logits, -1)
    mask = batch.response_mask.float()
    tokens = mask.sum(1)
    token_logp = logp.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    ce = -(token_logp * mask).sum(1) / tokens.clamp(min=1)
    if target_logp is None:
        return ce, torch.zeros_like(ce), tokens
    kl = (target_logp.exp() * (target_logp - logp)).sum(-1)
    return ce, (kl * mask).sum(1), tokens


class BilevelSelector:
    """One rank's BLISS optimisation: the proxy (lower level) and the score model (upper level), AdamW for both
    with the released defaults (rl/methods/bliss/README.md; the `bliss` stage's keyword defaults are the same)."""

    def __init__(self, proxy: torch.nn.Module, score_model: torch.nn.Module, collective: Collective | None = None,
                 *, lr: float = 1e-5, score_lr: float = 1e-5, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.1, grad_clip: float = 1.0, reg: float = 1e-7, gamma: float = 1e-2,
                 inner_steps: int = 5, z_loops: int = 3, lr_z: float = 1e-2, lamb: float = 1e-2,
                 warmup_steps: int = 0):
        self.proxy, self.score_model = proxy, score_model
        self.col = collective or Collective()
        self.params = [p for p in proxy.parameters() if p.requires_grad]
        self.score_params = [p for p in score_model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.score_opt = torch.optim.AdamW(self.score_params, lr=score_lr, betas=betas, weight_decay=weight_decay)
        self.grad_clip, self.reg, self.gamma = grad_clip, reg, gamma
        self.inner_steps, self.z_loops, self.lr_z, self.lamb = inner_steps, z_loops, lr_z, lamb
        # both rates rise linearly over the first `warmup_steps` outer steps (the released scripts: 10% of them)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / max(1, warmup_steps)))
                           for opt in (self.opt, self.score_opt)]

    def lower_level_loss(self, batch: Any, weights: torch.Tensor, target_logp: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of G (the shares sum to G over ranks) and its per-sample CE."""
        ce, kl, tokens = sequence_stats(self.proxy, batch, target_logp)
        loss = (weights * ce).sum()
        if self.gamma and target_logp is not None:
            loss = loss + self.gamma * kl.sum() / self.col.sum(tokens.sum()).clamp(min=1)
        if self.reg and self.col.rank == 0:  # counted once over the ranks
            loss = loss + self.reg * sum((at_least_float32(p) ** 2).sum() for p in self.params)
        return loss, ce

    def _step(self, opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> float:
        self.col.sum_grads(params)
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip)) if self.grad_clip else float("nan")
        opt.step()
        opt.zero_grad(set_to_none=True)
        return norm

    def outer_step(self, batch: Any, val_batch: Any, target_logp: torch.Tensor | None = None) -> dict[str, float]:
        """`inner_steps` proxy updates under the current sample weights, then one score-model update by the
        implicit hypergradient of the validation loss."""
        with torch.no_grad():
            weights = global_softmax(self.score_model(**batch.model_inputs()), self.col)
        for _ in range(self.inner_steps):
            loss, _ = self.lower_level_loss(batch, weights, target_logp)
            loss.backward()
            self._step(self.opt, self.params)

        # F_y: the gradient of the mean validation CE over the global validation batch
        ce_val, _, _ = sequence_stats(self.proxy, val_batch)
        count = self.col.sum(torch.tensor(float(len(ce_val))))
        f_y = self.col.sum(flat(torch.autograd.grad(ce_val.sum() / count, self.params), self.params).detach())

        # H z by double backward through the lower level (the P_i held fixed)
        loss, _ = self.lower_level_loss(batch, weights, target_logp)
        grad_g = torch.autograd.grad(loss, self.params, create_graph=True)

        def hvp(z: torch.Tensor) -> torch.Tensor:
            hz = torch.autograd.grad(grad_g, self.params, grad_outputs=unflat(z, self.params), retain_graph=True)
            return self.col.sum(flat(hz, self.params).detach())

        z = solve_z(hvp, f_y, self.z_loops, self.lr_z, self.lamb)

        # g_i = <∇CE_i, z> for every sample at once: d/du_i of <∇ Σ_j u_j CE_j, z> at u = 1
        ce, _, _ = sequence_stats(self.proxy, batch)
        u = torch.ones_like(ce, requires_grad=True)
        grad_u = torch.autograd.grad((u * ce).sum(), self.params, create_graph=True)
        g = torch.autograd.grad(flat(grad_u, self.params) @ z, u)[0].detach()

        scores = self.score_model(**batch.model_inputs())
        weights = global_softmax(scores, self.col)
        coeff = softmax_coefficients(weights.detach(), g, self.col)
        (coeff * scores).sum().backward()
        score_norm = self._step(self.score_opt, self.score_params)
        for scheduler in self.schedulers:  # one outer step: the proxy's inner steps share its rate
            scheduler.step()
        return {"lower_loss": float(self.col.sum(loss.detach())), "val_ce": float(self.col.sum(ce_val.detach().sum())
                / count), "z_norm": float(z.norm()), "score_grad_norm": score_norm,
                "weight_max": float(self.col.gather(weights.detach()).max())}

    @torch.no_grad()
    def scores(self, batch: Any) -> torch.Tensor:
        return self.score_model(**batch.model_inputs())
