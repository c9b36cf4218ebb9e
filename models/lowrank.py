"""Low-rank linear layers: a projection stored and computed as its two factors, and the folder format that saves and
loads a model whose projections are such layers (what the Decomper stage writes).

`LowRankLinear` holds W ≈ A·B as two linears, `down` (B, `[k, n]`, no bias) and `up` (A, `[m, k]`, with the layer's
bias), so a rank-k layer keeps k·(m + n) + m parameters instead of m·n + m and multiplies in two thin products. A saved
folder is `save_pretrained`'s (config, safetensors with the `down`/`up` tensors) plus `low_rank.json` naming each
factorized module and its rank; `load_low_rank` builds the architecture from the config without allocating its dense
weights, puts the factor layers in place and loads the tensors, so the learner and the `hf` engine read such a folder
as they read any other (`models.families.CausalFamily.load`, `rollout.hf_engine.HFEngine`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from models.blocks import set_module

SPEC_FILE = "low_rank.json"


class LowRankLinear(nn.Module):
    """y = A·(B·x) + bias with `down.weight` = B `[rank, in]` and `up.weight` = A `[out, rank]`, `up.bias` the bias."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False, dtype=dtype, device=device)
        self.up = nn.Linear(rank, out_features, bias=bias, dtype=dtype, device=device)

    @classmethod
    def from_factors(cls, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
                     ) -> LowRankLinear:
        """The layer of factors `a [out, k]`, `b [k, in]` and `bias [out]` (zeros when None), in `dtype`."""
        layer = cls(b.shape[1], a.shape[0], a.shape[1], dtype=dtype, device=a.device)
        with torch.no_grad():
            layer.down.weight.copy_(b.to(dtype))
            layer.up.weight.copy_(a.to(dtype))
            layer.up.bias.copy_(bias.to(dtype) if bias is not None else torch.zeros_like(layer.up.bias))
        return layer

    @property
    def weight(self) -> torch.Tensor:
        """The dense product A·B (computed on each read: for analysis, not for the forward)."""
        return self.up.weight @ self.down.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.up.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


def low_rank_modules(model: nn.Module) -> dict[str, LowRankLinear]:
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, LowRankLinear)}


def save_low_rank(model: nn.Module, out_dir: str | Path) -> None:
    """`save_pretrained` of a model with factor layers, and `low_rank.json` naming them with their ranks."""
    mods = low_rank_modules(model)
    if not mods:
        raise ValueError("save_low_rank: the model has no low-rank layers")
    model.save_pretrained(out_dir)
    spec = {"modules": {name: {"rank": m.rank, "in_features": m.in_features, "out_features": m.out_features}
                        for name, m in mods.items()}}
    (Path(out_dir) / SPEC_FILE).write_text(json.dumps(spec, indent=1))


def is_low_rank(folder: str | Path) -> bool:
    return (Path(folder) / SPEC_FILE).exists()


def load_low_rank(folder: str | Path, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                  **model_kwargs) -> nn.Module:
    """A causal LM saved by `save_low_rank`: the architecture built from its config with no dense weights allocated
    (accelerate's `init_empty_weights`; buffers such as rotary frequencies are made as usual), the factor layers put
    in place, every tensor of the folder's safetensors assigned. A tensor the model lacks or a weight left unloaded
    (other than a tied output head) is an error naming it."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    folder = Path(folder)
    spec = json.loads((folder / SPEC_FILE).read_text())
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 **model_kwargs)
        for name, shape in spec["modules"].items():
            set_module(model, name, LowRankLinear(shape["in_features"], shape["out_features"], shape["rank"],
                                                  dtype=dtype))
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _read_safetensors(folder).items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if config.tie_word_embeddings else set()
    missing = [k for k in missing if k not in tied and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{folder}: low-rank checkpoint does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    empty = [k for k, p in model.named_parameters() if p.is_meta]
    if empty:
        raise ValueError(f"{folder}: low-rank checkpoint leaves {empty[:5]} unloaded")
    return model.eval()


def load_causal_lm(path: str | Path, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                   **model_kwargs) -> nn.Module:
    """A causal LM folder as transformers loads it, or with its factor layers when it holds them (`is_low_rank`):
    the one loader the learner and the `hf` engine share."""
    if is_low_rank(path):
        return load_low_rank(path, dtype=dtype, trust_remote_code=trust_remote_code, **model_kwargs)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                **model_kwargs)


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a `save_pretrained` folder, one file or a sharded index."""
    from safetensors.torch import load_file
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(folder / f)))
    return state
