"""ZO Fine-tuner (arXiv 2510.00419; rl/methods/zo_finetuner/README.md): MeZO with a learned perturbation shape.

The perturbation of parameter tensor i is u_i = f·σ_i·ξ_i with ξ ~ N(0, I) regenerated from the step's seed (as
MeZO's), σ_i one scalar per tensor from a small network of its own (`PertNet`: 5 → 64 → 1, tanh, |·|) reading the
tensor's mean and variance, the previous step's L+ and L− and its previous σ, and f the normalisation that keeps
E‖u‖² at the isotropic value: f² Σ n_i σ_i² = Σ n_i (n_i the tensor's elements; an embedding counts only the rows
a batch touches, about `embedding_rows` of them). The update is MeZO's with u in place of ξ:
θ ← θ − η·((L+ − L−)/(2ε))·u. With every σ_i = 1 it is MeZO's step bit for bit.

The networks come from a learning-to-learn job (`learn_to_learn`), run once per base model: the model follows a
first-order trajectory (SGD with momentum 0.8, restarted from its initial weights every `restart_every` steps, its
learning rate decayed linearly within each period), and at each step the networks are trained so that a virtual
ZO step θ′ = θ − lr_update·((L+ − L−)/(2ε))·f·σ⊙ξ lowers the loss on the same batch: the meta-loss L(θ′) is
back-propagated into the networks only (through σ; f, ξ and the loss difference are constants). The bundle is
saved with `PertBundle.save` and used by the forward-only optimizer `zo_finetuner` (`learner.optimizer: {name:
zo_finetuner, params: {bundle: path}}`) on another task.

[RECONSTRUCTION] where the released code was not followed to the letter: the previous σ fed at the first step is
1 (the history losses are 0 there, as in the code); the embedding row estimate `embedding_rows` applies to
parameters whose name contains "embed". As in the released code it is 15 × the batch size: the learn-to-learn stage
(`rl.methods.zo_finetuner.stage`) sets it so and the bundle carries it to the optimizer, which uses it unless its
own `embedding_rows` is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rl.optim import MeZO
from rl.registry import register


class PertNet(nn.Module):
    """σ for one parameter tensor: an MLP 5 → hidden (tanh) → 1 with |·| on the output."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).abs().squeeze(-1)


def pert_features(p: torch.Tensor, loss_plus: float, loss_minus: float, sigma_prev: float) -> torch.Tensor:
    """The 5 inputs of a tensor's PertNet: its mean and variance, the previous step's L+ and L−, its previous σ."""
    x = p.detach().float()
    var = x.var() if x.numel() > 1 else torch.zeros(())
    return torch.stack([x.mean(), var, torch.tensor(float(loss_plus)), torch.tensor(float(loss_minus)),
                        torch.tensor(float(sigma_prev))]).to(torch.float32)


def effective_sizes(names: Sequence[str], shapes: Sequence[torch.Size], embedding_rows: int | None) -> list[int]:
    """n_i of the normalisation: a tensor's elements, or for an embedding (a name with "embed") the elements of
    the `embedding_rows` rows a batch touches (when given and fewer than it has)."""
    out = []
    for name, shape in zip(names, shapes):
        n = math.prod(shape)
        if embedding_rows and "embed" in name and len(shape) == 2:
            n = min(n, embedding_rows * shape[1])
        out.append(n)
    return out


def normalization(sigmas: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """f with f² Σ n_i σ_i² = Σ n_i (E‖u‖² equals the isotropic d)."""
    n = torch.tensor(list(sizes), dtype=sigmas.dtype)
    return torch.sqrt(n.sum() / (n * sigmas.pow(2)).sum())


class PertBundle(nn.Module):
    """One `PertNet` per parameter tensor of a model, in the model's parameter order, with the names and shapes
    they were made for (a bundle only applies to a model with the same tensors)."""

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]], hidden: int = 64, seed: int = 0,
                 embedding_rows: int | None = None):
        super().__init__()
        torch.manual_seed(seed)
        self.names, self.shapes, self.hidden = list(names), [tuple(s) for s in shapes], hidden
        self.embedding_rows = embedding_rows  # the touched-rows estimate the networks were trained with
        self.nets = nn.ModuleList([PertNet(hidden) for _ in self.names])

    @classmethod
    def for_model(cls, model: nn.Module, hidden: int = 64, seed: int = 0, embedding_rows: int | None = None
                  ) -> PertBundle:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return cls([n for n, _ in named], [tuple(p.shape) for _, p in named], hidden, seed, embedding_rows)

    def sigmas(self, params: Sequence[torch.Tensor], loss_plus: float, loss_minus: float,
               sigma_prev: Sequence[float]) -> torch.Tensor:
        """σ_i for every tensor (differentiable in the networks' parameters)."""
        dtype = next(self.parameters()).dtype
        return torch.stack([net(pert_features(p, loss_plus, loss_minus, s).to(dtype))
                            for net, p, s in zip(self.nets, params, sigma_prev)])

    def check(self, params: Sequence[torch.Tensor]) -> None:
        shapes = [tuple(p.shape) for p in params]
        if shapes != self.shapes:
            first = next((i for i, (a, b) in enumerate(zip(shapes, self.shapes)) if a != b), min(len(shapes),
                                                                                                len(self.shapes)))
            raise ValueError(f"zo_finetuner bundle: made for {len(self.shapes)} tensors, the model has {len(shapes)};"
                             f" first difference at tensor {first} "
                             f"({self.names[first] if first < len(self.names) else '-'}: bundle "
                             f"{self.shapes[first] if first < len(self.shapes) else None}, model "
                             f"{shapes[first] if first < len(shapes) else None})")

    def save(self, path: str | Path) -> None:
        torch.save({"names": self.names, "shapes": self.shapes, "hidden": self.hidden,
                    "embedding_rows": self.embedding_rows, "state": self.state_dict()}, path)

    @classmethod
    def load(cls, path: str | Path) -> PertBundle:
        blob = torch.load(path, weights_only=True)  # tensors, names, shapes and numbers: no pickled code
        bundle = cls(blob["names"], blob["shapes"], blob["hidden"], embedding_rows=blob.get("embedding_rows"))
        bundle.load_state_dict(blob["state"])
        return bundle


class ZOFinetuner(MeZO):
    """MeZO whose direction for tensor i is f·σ_i·ξ_i, σ from a `PertBundle` (computed once per step, before the
    two evaluations, and held through the update). `bundle=None` or `learned=False` gives σ_i = 1 (MeZO's step
    bit for bit). `self.last` adds σ's mean, min, max and f to MeZO's L+, L− and projected gradient."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-6, eps: float = 1e-3,
                 weight_decay: float = 0.0, seed: int = 0, bundle: PertBundle | str | None = None,
                 normalize: bool = True, embedding_rows: int | None = None, names: Sequence[str] | None = None):
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay, seed=seed)
        tensors = [p for _, p in self._params()]
        self.bundle = PertBundle.load(bundle) if isinstance(bundle, (str, Path)) else bundle
        if self.bundle is not None:
            self.bundle.check(tensors)
            for q in self.bundle.parameters():
                q.requires_grad_(False)
        names = list(names) if names is not None else (self.bundle.names if self.bundle is not None
                                                       else [f"param{i}" for i in range(len(tensors))])
        if embedding_rows is None and self.bundle is not None:
            embedding_rows = self.bundle.embedding_rows  # the estimate the bundle was trained with
        self.sizes = effective_sizes(names, [p.shape for p in tensors], embedding_rows)
        self.normalize = normalize
        self.scales = [1.0] * len(tensors)
        self.sigma_prev = [1.0] * len(tensors)
        self.history = (0.0, 0.0)

    def _directions(self, seed: int):
        """u_i = f·σ_i·ξ_i, ξ from MeZO's generator in MeZO's order."""
        for (group, p, xi), scale in zip(super()._directions(seed), self.scales):
            yield group, p, xi if scale == 1.0 else xi * scale

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        tensors = [p for _, p in self._params()]
        if self.bundle is not None:
            sigma = self.bundle.sigmas(tensors, *self.history, self.sigma_prev)
        else:
            sigma = torch.ones(len(tensors))
        f = normalization(sigma, self.sizes) if self.normalize else torch.tensor(1.0)
        self.scales = [float(x) for x in f * sigma]
        out = super().step(closure)
        self.history = (self.last["loss_plus"], self.last["loss_minus"])
        self.sigma_prev = [float(x) for x in sigma]
        self.norm_factor = float(f)
        self.last.update(sigma_mean=float(sigma.mean()), sigma_min=float(sigma.min()), sigma_max=float(sigma.max()),
                         norm_factor=float(f))
        return out


@register("optimizer", "zo_finetuner")
def zo_finetuner(params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float = 0.0, eps: float = 1e-3,
                 seed: int = 0, bundle: str | None = None, normalize: bool = True,
                 embedding_rows: int | None = None) -> ZOFinetuner:
    """The ZO Fine-tuner (forward-only): MeZO's `eps` and `seed`, `bundle` the path of a saved `PertBundle` made for
    this model (None: σ = 1, MeZO), `normalize` the trace-matching f, `embedding_rows` the touched-rows estimate
    (None: the bundle's, 15 × the batch it was trained with)."""
    if isinstance(bundle, str) and bundle.startswith("artifact:"):
        raise ValueError(f"learner.optimizer.params.bundle: {bundle!r}, but no earlier stage published "
                         f"{bundle.split(':', 1)[1]!r}: put the stage that writes it (zo_finetuner) before this one")
    return ZOFinetuner(params, lr=lr, eps=eps, weight_decay=weight_decay, seed=seed, bundle=bundle,
                       normalize=normalize, embedding_rows=embedding_rows)


zo_finetuner.forward_only = True


def virtual_step_loss(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any,
                      params: dict[str, torch.Tensor], sigma: torch.Tensor, f: torch.Tensor,
                      xis: Sequence[torch.Tensor], projected: float, lr_update: float) -> torch.Tensor:
    """The meta-loss L(θ′) with θ′_i = θ_i − lr_update·projected·f·σ_i·ξ_i, differentiable in σ only."""
    from torch.func import functional_call
    moved = {name: theta - lr_update * projected * f * s * xi
             for (name, theta), s, xi in zip(params.items(), sigma, xis)}
    return loss_fn(lambda *a, **k: functional_call(model, moved, a, k), batch)


def learn_to_learn(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], batches: Iterable[Any], *,
                   eps: float = 1e-3, lr_update: float = 1e-6, lr_mlp: float = 1e-3, lr_llm: float = 0.01,
                   momentum: float = 0.8, restart_every: int = 100, hidden: int = 64, normalize: bool = True,
                   embedding_rows: int | None = None, seed: int = 0,
                   log: Callable[[int, dict[str, float]], None] | None = None) -> PertBundle:
    """Train a `PertBundle` for `model` on `batches` (one step each). `loss_fn(forward, batch)` is the loss of
    `forward(**inputs)` (the model itself, or the model at other parameters) on a batch."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    bundle = PertBundle.for_model(model, hidden, seed, embedding_rows)
    sizes = effective_sizes(names, [p.shape for p in params], embedding_rows)
    meta_opt = torch.optim.SGD(bundle.parameters(), lr=lr_mlp)
    initial = [p.detach().clone() for p in params]
    sgd = None  # made at step 0, the first restart
    history, sigma_prev = (0.0, 0.0), [1.0] * len(params)
    for step, batch in enumerate(batches):
        if step % restart_every == 0:  # a restart: back to the initial weights, momentum cleared
            with torch.no_grad():
                for p, p0 in zip(params, initial):
                    p.copy_(p0)
            sgd = torch.optim.SGD(params, lr=lr_llm, momentum=momentum)
        for g in sgd.param_groups:  # linear decay to 0 within each period
            g["lr"] = lr_llm * (1 - (step % restart_every) / restart_every)
        sigma = bundle.sigmas(params, *history, sigma_prev)
        f = (normalization(sigma, sizes) if normalize else torch.tensor(1.0)).detach()
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        xis = [torch.randn(p.shape, generator=gen) for p in params]
        with torch.no_grad():
            scale = [float(x) for x in f * sigma.detach()]
            for p, xi, s in zip(params, xis, scale):
                p.add_(xi, alpha=eps * s)
            loss_plus = float(loss_fn(model, batch))
            for p, xi, s in zip(params, xis, scale):
                p.add_(xi, alpha=-2 * eps * s)
            loss_minus = float(loss_fn(model, batch))
            for p, xi, s in zip(params, xis, scale):
                p.add_(xi, alpha=eps * s)
        projected = (loss_plus - loss_minus) / (2 * eps)
        theta = {n: p.detach() for n, p in zip(names, params)}
        meta = virtual_step_loss(model, loss_fn, batch, theta, sigma, f, xis, projected, lr_update)
        meta_opt.zero_grad()
        meta.backward()
        meta_opt.step()
        # the model's own first-order step on the same batch
        sgd.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        sgd.step()
        history, sigma_prev = (loss_plus, loss_minus), [float(x) for x in sigma.detach()]
        if log is not None:
            log(step, {"loss": float(loss.detach()), "meta_loss": float(meta.detach()),
                       "sigma_mean": float(sigma.detach().mean()),
                       "norm_factor": float(f)})
    return bundle
