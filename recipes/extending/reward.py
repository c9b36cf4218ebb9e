"""Reward plugin: `fn(prompt, response, *, ground_truth=None, metadata=None, **params)` → float, a dict with
`score` and components, or None (not applicable). Recipe: `reward.functions: [{name: recipes/extending/reward.py:brevity, params: {max_chars: 24}}]`."""


def brevity(prompt: str, response: str, *, max_chars: int = 24, **_) -> dict:
    """1 for a response of at most `max_chars` characters, falling linearly to 0 at twice that."""
    over = max(0, len(response) - max_chars)
    return {"score": max(0.0, 1.0 - over / max_chars), "chars": float(len(response))}
