"""What every generation engine and actor shares: sampling parameters, the tokenizer helpers, the fields
every engine's `Batch` carries, and the probes the driver asks every actor. Engines (`hf`, `vllm`, plugins) take prompts and `SamplingParams` and return a
`Batch` (see `rl/batch.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rl.batch import Batch


def peak_rss_gib() -> float:
    """This process's peak resident memory in GiB (Linux reports ru_maxrss in KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class ActorProbes:
    """What the driver asks every looprl actor at the end of a run (mixed into the actor classes: rollout
    workers, the reward service, learners)."""

    def peak_rss_gib(self) -> float:
        return peak_rss_gib()

    def hardware_rates(self, dtype: str = "float32") -> dict[str, float]:
        """This process's measured matmul FLOP/s (in `dtype`) and memory copy bytes/s (`hardware_rates`)."""
        return hardware_rates(dtype)

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_RATES: dict[tuple[str, str], dict[str, float]] = {}


def hardware_rates(dtype: str = "float32", seconds: float = 0.3) -> dict[str, float]:
    """The ceilings the `perf/mfu` and `perf/mbu` metrics divide by, measured in this process with its torch
    threads (on CPU) or on its GPU: square matmuls in `dtype` (`matmul_flops`, FLOP/s) and a large tensor
    copy (`copy_bytes_per_s`, bytes read + written per second). Measured once per process."""
    import time
    device = "cuda" if torch.cuda.is_available() else "cpu"
    key = (dtype, device)
    if key in _RATES:
        return _RATES[key]
    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(DTYPES[dtype])
    b = torch.randn(n, n, device=device).to(DTYPES[dtype])

    def timed(fn, min_s: float) -> float:  # seconds per call, after one warm-up call
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            if device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s:
                return elapsed / calls
    matmul_s = timed(lambda: a @ b, seconds)
    src = torch.empty((256 << 20) // 4, device=device)  # 256 MB, well past any CPU cache
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), seconds)
    _RATES[key] = {"matmul_flops": 2 * n ** 3 / matmul_s, "copy_bytes_per_s": 2 * src.numel() * 4 / copy_s,
                   "device": device}
    a = b = src = dst = None  # noqa: F841  (released before the cache is emptied)
    if device == "cuda":
        torch.cuda.empty_cache()  # give the engine back what the measurement held
    return _RATES[key]


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    seed: int | None = None
    stop: list[str] | None = None  # stop strings: a response ends after the first one it produces
    exit_at_step: int | None = None  # looped models (Ouro): read out after this loop, 1-based (None: the model's default)
    decoding: str | None = None  # decoding method (registry kind "decoding"; hf engine): None = transformers generate
    decoding_params: dict[str, Any] | None = None  # keyword arguments of the decoding method


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved with a model folder, left-padded for generation."""
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, KeyError):
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def encode_prompts(tok: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Left-padded prompt ids and mask. An empty prompt is given the BOS token (EOS without one): vLLM
    rejects empty prompts, and a judge may well be asked about an empty response; both engines do the
    same so that their batches agree."""
    start = tok.bos_token or tok.eos_token
    return tok([p if p else start for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False)


def attach_prompt_fields(batch: Batch, prompts: list[str], n: int, group_ids: list[int] | None,
                        ground_truth: list[Any] | None, metadata: list[dict] | None) -> Batch:
    """Give each of the `n` rows per prompt (prompt-major) its prompt's text, group id, ground truth and
    metadata; shared by the engines so their batches carry the same fields."""
    group_ids = group_ids if group_ids is not None else list(range(len(prompts)))
    batch.group_id = torch.tensor([g for g in group_ids for _ in range(n)], dtype=torch.long)
    batch.prompts = [p for p in prompts for _ in range(n)]
    batch.ground_truth = [g for g in (ground_truth or [None] * len(prompts)) for _ in range(n)]
    batch.metadata = [dict(m) for m in (metadata or [{} for _ in prompts]) for _ in range(n)]
    return batch
