"""Fake quantization of a model's block projections (symmetric integer weights per output channel, activations per
token), with learnable clipping ratios, an optional learnable affine flattening transform (FlatQuant's), and its
save format.

The rounding follows compressed-tensors (the quantization format vLLM and llm-compressor read): symmetric int-b with
scale = max|x| / ((2^b − 1) / 2) and values clamped to [−2^(b−1), 2^(b−1) − 1]; at clipping ratio 1 the fake-quantized
tensors equal `compressed_tensors.quantization.lifecycle.forward.fake_quantize` (tested). The clipping ratios scale
that max and are trained by calibration through a straight-through rounding (LSQ-style gradients reach the ratio).

The flattening transform (`transform="kron"`, FlatQuant: Sun et al. 2024) is a learnable invertible matrix
P = P1 ⊗ P2 per layer, Kronecker-factored (n = n1·n2, n1 the largest divisor of n up to √n): the input is quantized
as x̃ = x·P and the weight as W̃ = W·P⁻ᵀ, so x̃·W̃ᵀ = x·Wᵀ before rounding. P starts at the identity (the plain
quantizer) and is trained by calibration with the clipping ratios, spreading outlier channels before they are
rounded. [RECONSTRUCTION] of FlatQuant's defaults: no per-channel scaling beside P, P1 and P2 inverted exactly in
each forward (they are at most ~64 × 64 at 4096 channels).

A folder saved by `save_fake_quant` is the full-precision model (`save_pretrained`) plus `fake_quant.json` (bits and
the quantized modules and transform) and `fake_quant.safetensors` (the clipping ratios and flattening transforms);
`load_fake_quant` wraps a loaded model again, and the `hf` engine does so by itself for such a folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.blocks import decoder_layers, set_module

CONFIG_FILE, STATE_FILE = "fake_quant.json", "fake_quant.safetensors"


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer forward; identity gradient backward."""
    return x + (x.round() - x).detach()


def fake_quant(x: torch.Tensor, max_abs: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric int-`bits` fake quantization of `x` with scale `max_abs / ((2^bits − 1) / 2)` (broadcast)."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    scale = (max_abs / ((qmax - qmin) / 2)).clamp(min=1e-8)
    return torch.clamp(round_ste(x / scale), qmin, qmax) * scale


TRANSFORMS = ("none", "kron")


def kron_factors(n: int) -> tuple[int, int]:
    """(n1, n2) with n1·n2 = n, n1 the largest divisor of n that is at most √n."""
    n1 = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
    return n1, n // n1


def flatten_input(x: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor) -> torch.Tensor:
    """x·(P1 ⊗ P2) for rows x `[..., n1·n2]`: P1ᵀ·X·P2 on each row reshaped to `[n1, n2]`."""
    X = x.reshape(*x.shape[:-1], p1.shape[0], p2.shape[0])
    return (p1.T @ X @ p2).reshape(x.shape)


def flatten_weight(w: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor) -> torch.Tensor:
    """W·(P1 ⊗ P2)⁻ᵀ for `w [out, n1·n2]`: P1⁻¹·W_r·P2⁻ᵀ on each row, so that flatten_input(x)·W̃ᵀ = x·Wᵀ."""
    W = w.reshape(w.shape[0], p1.shape[0], p2.shape[0])
    return (torch.linalg.inv(p1) @ W @ torch.linalg.inv(p2).T).reshape(w.shape)


class FakeQuantLinear(nn.Module):
    """A linear layer whose weight (per output channel) and input (per token) are fake-quantized. `w_clip [out, 1]`
    and `a_clip [1]` are the learnable clipping ratios (start at 1: the plain round-to-nearest quantizer);
    `transform="kron"` adds FlatQuant's learnable flattening `p1 [n1, n1]`, `p2 [n2, n2]` (start at the identity);
    the full-precision weight and bias are the wrapped layer's, frozen."""

    def __init__(self, linear: nn.Linear, w_bits: int = 4, a_bits: int = 4, transform: str = "none"):
        super().__init__()
        if transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")
        self.linear = linear
        for p in linear.parameters():
            p.requires_grad_(False)
        self.w_bits, self.a_bits, self.transform = w_bits, a_bits, transform
        device = linear.weight.device
        self.w_clip = nn.Parameter(torch.ones(linear.out_features, 1, device=device))
        self.a_clip = nn.Parameter(torch.ones(1, device=device))
        if transform == "kron":
            n1, n2 = kron_factors(linear.in_features)
            self.p1 = nn.Parameter(torch.eye(n1, device=device))
            self.p2 = nn.Parameter(torch.eye(n2, device=device))

    def quantizer_parameters(self) -> dict[str, nn.Parameter]:
        """What calibration learns and the save format stores: the clipping ratios (and the flattening factors)."""
        return {name: p for name, p in self.named_parameters() if not name.startswith("linear.")}

    def quantized_weight(self) -> torch.Tensor:
        w = self.linear.weight
        if self.transform == "kron":
            w = flatten_weight(w.float(), self.p1, self.p2).to(w.dtype)
        return fake_quant(w, self.w_clip.clamp(0.05, 1.0) * w.abs().amax(1, keepdim=True), self.w_bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.transform == "kron":
            x = flatten_input(x.float(), self.p1, self.p2).to(dtype)
        if self.a_bits < 16:
            x = fake_quant(x, self.a_clip.clamp(0.05, 1.0) * x.abs().amax(-1, keepdim=True).detach(), self.a_bits)
        # the ratios and transforms stay fp32 (what AdamW trains well); a bf16 model computes the product in bf16
        return F.linear(x.to(dtype), self.quantized_weight().to(dtype), self.linear.bias)


def block_linear_names(model: nn.Module) -> list[tuple[int, str]]:
    """(block index, name inside the block) of every `nn.Linear` in the decoder blocks: the projections that are
    quantized (embeddings and the output head stay in full precision)."""
    return [(i, name) for i, block in enumerate(decoder_layers(model))
            for name, mod in block.named_modules() if isinstance(mod, nn.Linear)]


def quantize_blocks(model: nn.Module, w_bits: int = 4, a_bits: int = 4, transform: str = "none"
                    ) -> dict[str, FakeQuantLinear]:
    """Replace every block projection by a `FakeQuantLinear` in place; returns them by `"{block}.{name}"`."""
    out = {}
    blocks = decoder_layers(model)
    for i, name in block_linear_names(model):
        wrapped = FakeQuantLinear(blocks[i].get_submodule(name), w_bits, a_bits, transform)
        set_module(blocks[i], name, wrapped)
        out[f"{i}.{name}"] = wrapped
    return out


def quantized_modules(model: nn.Module) -> dict[str, FakeQuantLinear]:
    blocks = decoder_layers(model)
    return {f"{i}.{name}": mod for i, block in enumerate(blocks) for name, mod in block.named_modules()
            if isinstance(mod, FakeQuantLinear)}


def unwrap_fake_quant(model: nn.Module) -> nn.Module:
    """Put the full-precision linears back in place (the model to save with `save_pretrained`)."""
    blocks = decoder_layers(model)
    for key, mod in quantized_modules(model).items():
        i, name = key.split(".", 1)
        set_module(blocks[int(i)], name, mod.linear)
    return model


def _quantizer_state(mods: dict[str, FakeQuantLinear]) -> dict[str, torch.Tensor]:
    return {f"{k}.{name}": p.detach().cpu().contiguous() for k, m in mods.items()
            for name, p in m.quantizer_parameters().items()}


def _load_quantizer_state(mods: dict[str, FakeQuantLinear], state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, m in mods.items():
            for name, p in m.quantizer_parameters().items():
                p.copy_(state[f"{k}.{name}"])


def save_fake_quant(model: nn.Module, out_dir: str | Path, extra: dict | None = None) -> None:
    """Save a fake-quantized model: the full-precision model, its quantizers' parameters (clipping ratios, and the
    flattening transforms) and bits."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    mods = quantized_modules(model)
    if not mods:
        raise ValueError("save_fake_quant: the model has no fake-quantized layers")
    any_mod = next(iter(mods.values()))
    state = _quantizer_state(mods)
    unwrap_fake_quant(model)
    try:
        model.save_pretrained(out)
    finally:
        _load_quantizer_state(quantize_blocks(model, any_mod.w_bits, any_mod.a_bits, any_mod.transform), state)
    save_file(state, str(out / STATE_FILE))
    (out / CONFIG_FILE).write_text(json.dumps({"w_bits": any_mod.w_bits, "a_bits": any_mod.a_bits,
                                               "transform": any_mod.transform, "modules": sorted(mods),
                                               **(extra or {})}, indent=1))


def load_fake_quant(model: nn.Module, folder: str | Path) -> nn.Module:
    """Wrap a model loaded from a `save_fake_quant` folder with its quantizers and clipping ratios (no-op for a
    folder without `fake_quant.json`)."""
    from safetensors.torch import load_file
    folder = Path(folder)
    if not (folder / CONFIG_FILE).exists():
        return model
    spec = json.loads((folder / CONFIG_FILE).read_text())
    mods = quantize_blocks(model, spec["w_bits"], spec["a_bits"], spec.get("transform", "none"))
    if sorted(mods) != spec["modules"]:
        raise ValueError(f"{folder / CONFIG_FILE}: quantized modules {spec['modules'][:3]}... do not match the "
                         f"model's block projections {sorted(mods)[:3]}...")
    _load_quantizer_state(mods, load_file(str(folder / STATE_FILE)))
    return model
