"""Decoding plugin: hooks on the hf engine's own decode loop (`process_logits`, `residual_hooks`,
`kv_policy`, `insert`; see rollout/decoding.py). Recipe: `rollout.eval_decoding: recipes/extending/decoding.py:NoImmediateRepeat`."""

import torch


class NoImmediateRepeat:
    """A logits processor: a row may not sample the token it sampled last (the logprobs reported are of
    the distribution with that token removed)."""

    def process_logits(self, logits: torch.Tensor, state) -> torch.Tensor:
        for i, response in enumerate(state.responses):
            if response:
                logits[i, response[-1]] = float("-inf")
        return logits
