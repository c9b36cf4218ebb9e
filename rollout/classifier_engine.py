"""`hf_classifier` engine: a frozen reward model (a transformers sequence-classification model with one
output) that scores (prompt, response) pairs in batches. Judges (`reward.judges`) serve it to the reward
service; the `reward_model` reward calls it. A response is scored as it was trained on: the prompt's
tokens, the response's tokens and EOS (`rl.sft_data.make_sft_batch`), read at the EOS.
"""

from __future__ import annotations

from typing import Any

import torch

from models.tokenizer import load_tokenizer
from rl.registry import register
from rollout.base import DTYPES


@register("engine", "hf_classifier")
class ClassifierEngine:
    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False,
                 batch_size: int = 64):
        from models.families import SequenceScoreFamily
        self.tokenizer = load_tokenizer(model_path)
        self.device = torch.device(device)
        self.family = SequenceScoreFamily()
        self.model = self.family.load(model_path, dtype=DTYPES[dtype],
                                      trust_remote_code=trust_remote_code).to(self.device).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One scalar per (prompt, response), in order."""
        from rl.sft_data import make_sft_batch
        out: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            batch = make_sft_batch(self.tokenizer, prompts[start:start + self.batch_size],
                                   responses[start:start + self.batch_size])
            out.extend(self.family.forward(self.model, batch)["scores"].tolist())
        return out

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("the hf_classifier engine scores (prompt, response) pairs; it does not generate "
                        "(use it as a judge of the reward_model reward)")
