"""What every generation engine and actor shares: sampling parameters, the tokenizer helpers, the fields
every engine's `Batch` carries. Engines (`hf`, `vllm`, plugins) take prompts and `SamplingParams` and return a
`Batch` (see `rl/batch.py`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl.batch import Batch
from rollout.hardware import DTYPES  # noqa: F401  (re-exported: the engines' dtype names)
from rollout.probes import ActorProbes  # noqa: F401  (re-exported: the rollout worker's probes)


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0  # > 1: tokens already in the prompt or response are less likely (CTRL's rule)
    max_new_tokens: int = 32
    seed: int | None = None
    stop: list[str] | None = None  # stop strings: a response ends after the first one it produces
    exit_at_step: int | None = None  # looped models (Ouro): read out after this loop, 1-based (None: the model's default)
    decoding: str | None = None  # decoding method (registry kind "decoding"; hf engine): None = transformers generate
    decoding_params: dict[str, Any] | None = None  # keyword arguments of the decoding method


def encode_prompts(tok: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Left-padded prompt ids and mask. An empty prompt is given the BOS token (EOS without one): vLLM
    rejects empty prompts, and a judge may well be asked about an empty response; both engines do the
    same so that their batches agree."""
    start = tok.bos_token or tok.eos_token
    return tok([p if p else start for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False)


def attach_prompt_fields(batch: Batch, prompts: list[str], n: int, group_ids: list[int] | None,
                        ground_truth: list[Any] | None, metadata: list[dict] | None) -> Batch:
    """Give each of the `n` rows per prompt (prompt-major) its prompt's text, group id, ground truth and
    metadata; shared by the engines so their batches carry the same fields. What the engine put in a row's
    metadata (the `hf` engine's `gen_s`: its share of the decode time, which `perf/decode_mfu` reads) is kept
    beside the prompt's."""
    group_ids = group_ids if group_ids is not None else list(range(len(prompts)))
    batch.group_id = torch.tensor([g for g in group_ids for _ in range(n)], dtype=torch.long)
    batch.prompts = [p for p in prompts for _ in range(n)]
    batch.ground_truth = [g for g in (ground_truth or [None] * len(prompts)) for _ in range(n)]
    rows = len(prompts) * n
    own = batch.metadata if len(batch.metadata) == rows else [{} for _ in range(rows)]
    given = [m for m in (metadata or [{} for _ in prompts]) for _ in range(n)]
    batch.metadata = [{**o, **dict(g)} for o, g in zip(own, given)]
    return batch


def run_or_fall_back(state: dict, run: Callable[[], Any], failure: str, fallback: str) -> Any:
    """`run()` for a faster CPU path whose first call may fail for want of what this machine lacks (a C++
    compiler, an op of the torch build): then `state["failed"]` records why, one warning says `failure` and
    `fallback`, and None is returned for the caller to take its plain path (for good, as `state` says). An error
    after a call that succeeded (`state["ran"]`) is not such a failure and is raised."""
    try:
        out = run()
    except Exception as err:
        if state["ran"]:
            raise
        state["failed"] = f"{type(err).__name__}: {err}"
        warnings.warn(f"{failure} ({state['failed'][:300]}); {fallback}", stacklevel=3)
        return None
    state["ran"] = True
    return out
