"""DenseSteer (rl/methods/densesteer/README.md; confirmed from the released code): a steering vector that moves a small
model's reasoning toward the dense style of stronger models, added to one decoder block's output while decoding.

* Density ρ = tokens / steps, steps delimited by blank lines (`density`).
* Vector at layer ℓ: the mean over (dense, sparse) pairs of the difference of block ℓ's output at each text's last
  token, v_ℓ = mean_i [h_ℓ(prompt_i + dense_i)[-1] − h_ℓ(prompt_i + sparse_i)[-1]] (the steering-vectors library's
  mean-difference aggregator at read_token_index −1; `extract_vectors`).
* Injection: h̃ = h + λ v_ℓ on block ℓ's output at every position from `min_token_index` on, in the prefill and
  at every decode step: the `steer` decoding method of `rl.methods.densesteer.decoding` on the `hf` engine's decode loop.

The `densesteer` stage (`rl.methods.densesteer.stage`) and the benchmark call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from models.blocks import block_outputs, decoder_layers
from rl.batch import pad_token_rows


def density(text: str, tokenizer: Any = None) -> dict[str, float]:
    """DenseSteer's density of a solution: `steps` (non-empty segments between blank lines), `tokens` (the
    tokenizer's count, or characters without one) and ρ = tokens / steps."""
    steps = [s for s in text.split("\n\n") if s.strip()]
    n_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"]) if tokenizer is not None else len(text)
    return {"steps": float(len(steps)), "tokens": float(n_tokens), "rho": n_tokens / max(len(steps), 1)}


def _texts_ids(tokenizer: Any, prompts: Sequence[str], responses: Sequence[str], chat_template: bool) -> list[list[int]]:
    out = []
    for prompt, response in zip(prompts, responses):
        if chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                                  {"role": "assistant", "content": response}], tokenize=False)
        else:
            text = prompt + response
        out.append(tokenizer(text, add_special_tokens=not chat_template)["input_ids"])
    return out


@torch.no_grad()
def last_token_states(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], responses: Sequence[str],
                      layers: Sequence[int], *, chat_template: bool = False, batch_size: int = 16) -> dict[int, torch.Tensor]:
    """Block outputs at each text's last token, `{layer: [N, H]}` (float32), for `prompt + response` texts (or the
    chat template over a user and an assistant turn)."""
    seqs = _texts_ids(tokenizer, prompts, responses, chat_template)
    device = next(model.parameters()).device
    upto = max(layers)
    out: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    for i in range(0, len(seqs), batch_size):
        ids, mask = pad_token_rows(seqs[i:i + batch_size], tokenizer.pad_token_id, "right")
        ids, mask = ids.to(device), mask.to(device)
        hidden = block_outputs(model, {"input_ids": ids, "attention_mask": mask}, upto=upto)
        last = mask.sum(-1) - 1
        rows = torch.arange(ids.shape[0], device=device)
        for layer in layers:
            out[layer].append(hidden[layer][rows, last].float().cpu())
    return {layer: torch.cat(v) for layer, v in out.items()}


def extract_vectors(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], dense: Sequence[str],
                    sparse: Sequence[str], layers: Sequence[int] | None = None, *, chat_template: bool = False,
                    batch_size: int = 16) -> dict[int, torch.Tensor]:
    """DenseSteer's vectors: per layer, the mean over pairs of the last-token difference between the dense and the
    sparse text of the same problem. `layers` None: every decoder block."""
    if not (len(prompts) == len(dense) == len(sparse)) or not prompts:
        raise ValueError(f"extract_vectors: {len(prompts)} prompts, {len(dense)} dense and {len(sparse)} sparse "
                         f"texts; one pair per prompt, at least one")
    layers = list(range(len(decoder_layers(model)))) if layers is None else list(layers)
    pos = last_token_states(model, tokenizer, prompts, dense, layers, chat_template=chat_template, batch_size=batch_size)
    neg = last_token_states(model, tokenizer, prompts, sparse, layers, chat_template=chat_template, batch_size=batch_size)
    return mean_difference(pos, neg)


def mean_difference(pos: dict[int, torch.Tensor], neg: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per layer, the mean over pairs of `pos − neg` (`{layer: [N, H]}` each): the steering vectors."""
    return {layer: (pos[layer] - neg[layer]).mean(0) for layer in pos}


def select_steering(candidates: Sequence[dict[str, Any]], tolerance: float = 0.0) -> dict[str, Any]:
    """The paper's selection on held-out training problems: among `candidates` ({layer, strength, rho, accuracy};
    the unsteered one has strength 0), the highest density ρ whose accuracy is at least the unsteered accuracy
    minus `tolerance`; ties go to the smaller |λ|. With no unsteered candidate the best accuracy is the bar."""
    base = [c for c in candidates if c["strength"] == 0]
    bar = (max(c["accuracy"] for c in base) if base else max(c["accuracy"] for c in candidates)) - tolerance
    ok = [c for c in candidates if c["accuracy"] >= bar - 1e-12]
    return max(ok, key=lambda c: (c["rho"], -abs(c["strength"])))
