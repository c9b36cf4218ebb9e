"""The Decomper benchmark's and tests' labelled synthetic harness: a tiny causal LM made in code and fitted to
worked arithmetic (`rl.methods.decomper.core` compresses it)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def tiny_arithmetic_lm(seed: int = 0, steps: int = 200) -> tuple[nn.Module, Callable[[int], dict[str, torch.Tensor]]]:
    """A labelled synthetic harness (the tests' and `benchmarks/diffusion_compression.py`'s): a 4-block tiny Llama
    made in code and fitted for `steps` AdamW steps to worked `a+b*c=` solutions. Returns it in eval mode and
    `batch(n)`, which gives n more such texts from the same seeded stream."""
    import random

    from models.tiny import build_tiny_model, build_tiny_tokenizer
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=128, seed=seed)

    def text() -> str:
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
        return f"{a}+{b}*{c}={b * c},{a}+{b * c}={a + b * c}"

    def batch(n: int) -> dict[str, torch.Tensor]:
        enc = tok([text() for _ in range(n)], return_tensors="pt", padding=True)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        b = batch(32)
        loss = model(**b, labels=b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), batch
