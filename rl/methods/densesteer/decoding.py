"""The `steer` decoding method: DenseSteer's activation steering (rl/methods/densesteer/README.md) on the `hf` engine.

h̃ = h + λ v on the output of decoder block `layer` (the residual stream) at every position from `min_token_index`
on, in the prefill and at every decode step. The vector comes from the `densesteer` stage's file
(`steering_vectors.pt`: `{layer: vector}`) or a file holding one vector. λ = 0 leaves decoding exactly as `plain`.

During RL rollout this is an initialization trick: the engine samples from (and reports logprobs of) the steered
model while the learner scores the samples with the unsteered one, so the gap shows in `actor/mismatch_kl` and an
`algorithm.is_correction` weights it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rl.registry import register, register_alias


def load_steering_vector(path: str, layer: int) -> torch.Tensor:
    """The vector for `layer` from a `{layer: vector}` file (the `densesteer` stage's), or the one vector a file
    holds."""
    if not Path(path).exists():
        raise FileNotFoundError(f"decoding steer: vectors file {path!r} does not exist (the densesteer stage "
                                f"writes stages/<name>/steering_vectors.pt)")
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, torch.Tensor):
        return obj.float()
    vectors = {int(k): v for k, v in obj.items()}
    if layer not in vectors:
        raise KeyError(f"decoding steer: {path!r} holds vectors for layers {sorted(vectors)}, not layer {layer}")
    return vectors[layer].float()


def steer_hidden(hidden: torch.Tensor, vector: torch.Tensor, strength: float, positions: torch.Tensor | None = None,
                 min_token_index: int = 0) -> torch.Tensor:
    """h + λ v at the positions ≥ `min_token_index` (`positions [B, T]`: each column's index in its sequence; None:
    every position)."""
    add = (strength * vector).to(device=hidden.device, dtype=hidden.dtype)
    if positions is None or min_token_index <= 0:
        return hidden + add
    on = (positions >= min_token_index).to(hidden.dtype).unsqueeze(-1)
    return hidden + on * add


@register("decoding", "densesteer")
class SteerDecoding:
    """DenseSteer: add `strength` × the steering vector of decoder block `layer` (0-based, from `vectors`) to that
    block's output at every position ≥ `min_token_index` (0: every position, the paper's setting). `selection`: the
    `densesteer` stage's report; its held-out choice (`selected`: layer and strength) replaces both."""

    def __init__(self, vectors: str, layer: int | None = None, strength: float = 4.0, min_token_index: int = 0,
                 selection: str | None = None):
        if selection is not None:
            import json
            from pathlib import Path
            chosen = json.loads(Path(selection).read_text()).get("selected")
            if not chosen:
                raise ValueError(f"decoding steer: {selection!r} holds no `selected` layer and strength (run "
                                 f"densesteer with params.select)")
            layer, strength = chosen["layer"], chosen["strength"]
        if layer is None:
            raise ValueError("decoding steer: give `layer` (and `strength`) or a `selection` report")
        self.vector = load_steering_vector(vectors, int(layer))
        self.layer, self.strength, self.min_token_index = int(layer), float(strength), int(min_token_index)

    def residual_hooks(self, model: torch.nn.Module) -> dict[int, Callable[[torch.Tensor, Any], torch.Tensor]]:
        n = getattr(model.config, "num_hidden_layers", None)
        if n is not None and not 0 <= self.layer < n:
            raise ValueError(f"decoding steer: layer {self.layer} is not one of the model's {n} decoder blocks")
        if self.vector.shape != (model.config.hidden_size,):
            raise ValueError(f"decoding steer: the vector has shape {tuple(self.vector.shape)}, the model's hidden size "
                             f"is {model.config.hidden_size}")

        def hook(hidden: torch.Tensor, state: Any) -> torch.Tensor:
            return steer_hidden(hidden, self.vector, self.strength, state.positions, self.min_token_index)
        return {self.layer: hook}

register_alias("decoding", "steer", "densesteer")
