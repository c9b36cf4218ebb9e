"""Decomper: low-rank decomposition of a causal LM's projections with representation-drift compensation.

rl/methods/decomper/README.md. Confirmed (abstract and reviews): one bias vector per decomposed linear, learned block by
block on a small calibration set so that each decomposed block's output matches the original block's, fused into
the layer's bias (zero inference cost); the closed-form reference b* = (W − W′)·E[x] (it zeroes the mean output
error); works on plain and data-whitening SVD. [RECONSTRUCTION] marks the details no source gives: the SVD-LLM
whitening (Cholesky factor S of XXᵀ + εI, SVD of W·S, B = Σ^½Vᵀ S⁻¹), the rank rule k = ⌊(1 − ρ)·m·n/(m + n)⌋, the
block objective (MSE between the compensated compressed block's output, fed by the compensated compressed prefix, and
the original block's output), Adam and its defaults.

The functions here are pure torch; `rl.methods.decomper.stage` runs them as the `decomper` stage. Each compressed
projection becomes a `models.lowrank.LowRankLinear`: its factors A and B and the compensating bias are what the model
stores and multiplies with (k·(m + n) + m parameters for an m×n projection), saved with `models.lowrank.save_low_rank`
and read back by the learner and the `hf` engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from models.blocks import block_outputs, decoder_layers, set_module
from models.lowrank import LowRankLinear


def target_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Every attention and MLP projection (each `nn.Linear` inside a decoder layer, or the `LowRankLinear` that
    replaced it), by its name in the model; embeddings and the output head are outside the layers and stay
    untouched."""
    prefix, out = "model.layers", {}
    for i, layer in enumerate(decoder_layers(model)):
        factored = [name for name, mod in layer.named_modules() if isinstance(mod, LowRankLinear)]
        for name, mod in layer.named_modules():
            inside = any(name.startswith(f + ".") for f in factored)
            if isinstance(mod, LowRankLinear) or (isinstance(mod, nn.Linear) and not inside):
                out[f"{prefix}.{i}.{name}"] = mod
    return out


@dataclass
class InputStats:
    """Running second moment and sum of a linear layer's inputs over real (non-padding) tokens, in float64."""
    xtx: torch.Tensor
    xsum: torch.Tensor
    count: int = 0

    @property
    def mean(self) -> torch.Tensor:
        return self.xsum / max(self.count, 1)


def _real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The rows of `x` at the real (non-padding) tokens of `mask`."""
    return x[mask.bool()]


@torch.no_grad()
def input_stats(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], block: int | None = None
                ) -> dict[str, InputStats]:
    """XᵀX, ΣX and the token count of every target linear's inputs over `batches` (each `input_ids` and
    `attention_mask`; padding tokens are left out), on the inputs' device. With `block`, only that decoder block's
    linears, and the forward stops after it (what a large model compressed block by block keeps in memory)."""
    stats: dict[str, InputStats] = {}
    current: dict[str, torch.Tensor] = {}
    prefix = None if block is None else f"model.layers.{block}."

    def hook(name: str):
        def record(_m: nn.Module, args: tuple, _out: torch.Tensor) -> None:
            x = _real(args[0], current["mask"]).double()
            s = stats.setdefault(name, InputStats(x.new_zeros(x.shape[1], x.shape[1]), x.new_zeros(x.shape[1])))
            s.xtx += x.T @ x
            s.xsum += x.sum(0)
            s.count += x.shape[0]
        return record
    handles = [mod.register_forward_hook(hook(name)) for name, mod in target_linears(model).items()
               if prefix is None or name.startswith(prefix)]
    try:
        for batch in batches:
            current["mask"] = batch["attention_mask"].to(next(model.parameters()).device)
            if block is None:
                model(**batch, use_cache=False)
            else:
                block_outputs(model, batch, block)
    finally:
        for h in handles:
            h.remove()
    return stats


def rank_for_ratio(m: int, n: int, ratio: float) -> int:
    """Rank k of an m×n matrix's factors A (m×k) and B (k×n) that removes the share `ratio` of its m·n parameters:
    k = ⌊(1 − ρ)·m·n/(m + n)⌋, at least 1 [RECONSTRUCTION]. ρ = 0 keeps full rank (no truncation)."""
    if not 0 <= ratio < 1:
        raise ValueError(f"compression ratio must be in [0, 1), got {ratio}")
    if ratio == 0:
        return min(m, n)
    return max(1, min(min(m, n), math.floor((1 - ratio) * m * n / (m + n))))


def plain_factors(w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of `w [m, n]`: A = U_k Σ_k^½, B = Σ_k^½ V_kᵀ (the control)."""
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    root = s[:k].sqrt()
    return u[:, :k] * root, root[:, None] * vh[:k]


def whitened_factors(w: torch.Tensor, xtx: torch.Tensor, k: int, eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-whitening SVD (SVD-LLM) [RECONSTRUCTION]: S the lower Cholesky factor of XᵀX + ε·mean(diag)·I,
    U Σ Vᵀ = SVD(W S), A = U_k Σ_k^½ and B = Σ_k^½ V_kᵀ S⁻¹. Truncating W S minimises ‖(W − AB) X‖ on the calibration
    inputs, where plain SVD minimises ‖W − AB‖."""
    n = xtx.shape[0]
    reg = eps * float(xtx.diagonal().mean()) + 1e-12
    s_chol = torch.linalg.cholesky(xtx.double() + reg * torch.eye(n, dtype=torch.float64, device=xtx.device))
    u, s, vh = torch.linalg.svd(w.double().to(xtx.device) @ s_chol, full_matrices=False)
    root = s[:k].sqrt()
    b = torch.linalg.solve_triangular(s_chol, root[:, None] * vh[:k], upper=False, left=False)  # X S = Y
    return u[:, :k] * root, b


def closed_form_bias(w: torch.Tensor, w_low: torch.Tensor, mean_x: torch.Tensor) -> torch.Tensor:
    """b* = (W − W′)·E[x]: the bias that zeroes the layer's mean output error on the calibration inputs."""
    return (w.double() - w_low.double()) @ mean_x.double()


@torch.no_grad()
def compress(model: nn.Module, stats: dict[str, InputStats], ratio: float, method: str = "whitened",
             compensation: str = "closed_form", eps: float = 1e-6) -> dict[str, dict]:
    """Replace every target projection `stats` has by a `LowRankLinear` of its factors A, B (`method` whitened or
    plain, rank from `ratio`) in place, with the layer's bias (zeros where it had none) plus b* under
    `compensation: closed_form` (also the start of the learned bias). Returns per layer: shape, rank, the
    factorized parameter count, ‖b*‖ and the relative weight error."""
    if method not in ("whitened", "plain"):
        raise ValueError(f"method must be whitened or plain, got {method!r}")
    if compensation not in ("none", "closed_form"):
        raise ValueError(f"compensation must be none or closed_form here, got {compensation!r}")
    report = {}
    for name, mod in target_linears(model).items():
        if name not in stats or isinstance(mod, LowRankLinear):  # another block's (compressed block by block)
            continue
        w = mod.weight.data
        m, n = w.shape
        k = rank_for_ratio(m, n, ratio)
        a, b = whitened_factors(w, stats[name].xtx, k, eps) if method == "whitened" else plain_factors(w, k)
        low = a @ b
        b_star = closed_form_bias(w, low, stats[name].mean.to(w.device))
        bias = mod.bias.detach().double() if mod.bias is not None else torch.zeros_like(b_star)
        if compensation == "closed_form":
            bias = bias + b_star
        set_module(model, name, LowRankLinear.from_factors(a.to(w.device), b.to(w.device), bias, w.dtype))
        report[name] = {"shape": [m, n], "rank": k, "factor_params": k * (m + n), "dense_params": m * n,
                        "weight_rel_error": float((w.double() - low).norm() / w.double().norm().clamp(min=1e-30)),
                        "closed_form_bias_norm": float(b_star.norm())}
    return report


@torch.no_grad()
def block_drift(original: nn.Module, compressed: nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """Per decoder block j, ‖h̃_j − h_j‖ / ‖h_j‖ over the real tokens of `batches`: the compressed model's block
    output (fed by its own compressed prefix) against the original's."""
    num, den = None, None
    for batch in batches:
        mask = batch["attention_mask"].bool()
        a, b = block_outputs(original, batch), block_outputs(compressed, batch)
        d = torch.stack([(y[mask] - x[mask]).double().pow(2).sum() for x, y in zip(a, b)])
        r = torch.stack([x[mask].double().pow(2).sum() for x in a])
        num, den = (d, r) if num is None else (num + d, den + r)
    return (num / den).sqrt().tolist()


def _block_mse(model: nn.Module, batch: dict[str, torch.Tensor], target: torch.Tensor, j: int) -> torch.Tensor:
    """Token-mean squared error of block j's output against `target` over the real tokens."""
    mask = batch["attention_mask"].bool()
    out = block_outputs(model, batch, j)[j]
    return (out[mask].float() - target[mask].float()).pow(2).sum(-1).mean()


@torch.no_grad()
def _mean_block_mse(model: nn.Module, batches: list[dict[str, torch.Tensor]], targets: list[torch.Tensor], j: int
                    ) -> float:
    return sum(float(_block_mse(model, b, t, j)) for b, t in zip(batches, targets)) / len(batches)


def learn_biases(original: nn.Module, compressed: nn.Module, batches: list[dict[str, torch.Tensor]], *,
                 lr: float = 1e-3, epochs: int = 2, log=None) -> list[dict[str, float]]:
    """Fit the compressed model's projection biases block by block [RECONSTRUCTION of problem (6)]: for block j,
    only its biases train (Adam, `lr`, `epochs` passes over `batches`) to minimise the token-mean squared error
    between its output, fed by the already-compensated compressed prefix, and the original block's output; the
    biases of its best epoch are kept (the start's if no epoch improved it); then block j + 1. Everything else stays
    frozen. Returns per block the loss before and after."""
    for p in compressed.parameters():
        p.requires_grad_(False)
    history = []
    layers = decoder_layers(compressed)
    for j, layer in enumerate(layers):
        biases = [m.bias for m in layer.modules() if isinstance(m, LowRankLinear)]
        for b in biases:
            b.requires_grad_(True)
        opt = torch.optim.Adam(biases, lr=lr)
        with torch.no_grad():
            targets = [block_outputs(original, batch, j)[j] for batch in batches]

        before = best = _mean_block_mse(compressed, batches, targets, j)
        kept = [b.detach().clone() for b in biases]
        for _ in range(epochs):
            for batch, target in zip(batches, targets):
                opt.zero_grad()
                _block_mse(compressed, batch, target, j).backward()
                opt.step()
            if (now := _mean_block_mse(compressed, batches, targets, j)) < best:
                best, kept = now, [b.detach().clone() for b in biases]
        with torch.no_grad():  # the biases of the best epoch (or the start): never worse on the calibration set
            for b, k in zip(biases, kept):
                b.copy_(k)
                b.requires_grad_(False)
        after = best
        history.append({"block": j, "mse_before": before, "mse_after": after})
        if log is not None:
            log(j, before, after)
    return history


@torch.no_grad()
def token_kl_and_nll(original: nn.Module, compressed: nn.Module, batches: list[dict[str, torch.Tensor]]
                     ) -> dict[str, float]:
    """Mean next-token KL(p_orig ‖ p_comp) and both models' token-mean NLL (perplexity = exp) over the real tokens
    of `batches`."""
    kl = nll_o = nll_c = 0.0
    count = 0
    for batch in batches:
        real = batch["attention_mask"].bool()
        mask = real[:, :-1] & real[:, 1:]  # a real token predicted from a real position (not from left padding)
        ids = batch["input_ids"][:, 1:]
        lo = torch.log_softmax(original(**batch, use_cache=False).logits[:, :-1].double(), -1)
        lc = torch.log_softmax(compressed(**batch, use_cache=False).logits[:, :-1].double(), -1)
        kl += float(((lo.exp() * (lo - lc)).sum(-1))[mask].sum())
        nll_o -= float(lo.gather(-1, ids[..., None]).squeeze(-1)[mask].sum())
        nll_c -= float(lc.gather(-1, ids[..., None]).squeeze(-1)[mask].sum())
        count += int(mask.sum())
    return {"token_kl": kl / count, "nll_original": nll_o / count, "nll_compressed": nll_c / count}
