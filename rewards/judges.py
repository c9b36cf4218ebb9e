"""Judge engines: frozen language models that reward functions call for generations.

A recipe declares named judge groups under `reward.judges` (model folder or the run's initial policy,
engine `hf` or `vllm`, number of workers, sampling). Each worker is a Ray actor holding a rollout
engine; nothing ever sends it weights (the learner's weight sync only reaches the rollout workers),
so a judge stays exactly the model it was loaded as, which `weights_sha256` lets a run prove.

Reward functions that need judges are batched and decorated with `rl.reward.uses_judges`; the
reward service calls them in its own process with `judges={name: JudgeClient}`.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import ray

from rl.recipe import engine_options


class JudgeWorker:
    """One judge engine (a Ray actor): prompts in, completions out."""

    def __init__(self, model_path: str, engine: str = "hf", engine_params: dict | None = None, dtype: str = "float32",
                 device: str = "cpu", threads: int = 1, chat_template: bool = False):
        import torch

        from rl.registry import lookup
        torch.set_num_threads(threads)
        self.model_path, self.chat_template = model_path, chat_template
        self.engine = lookup("engine", engine)(model_path, dtype=dtype, device=device, **(engine_params or {}))

    def generate(self, prompts: list[str], sampling: dict[str, Any]) -> list[str]:
        from rl.data import format_prompt
        from rollout.base import SamplingParams
        prompts = [format_prompt(p, self.engine.tokenizer, chat_template=self.chat_template) for p in prompts]
        return list(self.engine.generate(prompts, SamplingParams(n=1, **sampling)).responses)

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """A scoring engine's (`hf_classifier`) scalar per (prompt, response); prompts formatted as asked."""
        from rl.data import format_prompt
        prompts = [format_prompt(p, self.engine.tokenizer, chat_template=self.chat_template) for p in prompts]
        return list(self.engine.score(prompts, responses))

    def weights_sha256(self) -> str:
        """Digest of the engine's weights, to show that the judge never changed. The hf engine hashes the
        transformers state dict; the vllm engine hashes every worker's model in vLLM's own (fused,
        possibly sharded) layout, so the two engines' digests differ for the same checkpoint."""
        model = getattr(self.engine, "model", None)
        if model is not None:
            return state_dict_sha256(model.state_dict())
        llm = getattr(self.engine, "llm", None)
        if llm is None:
            raise NotImplementedError(f"weights_sha256: no weights to hash on {type(self.engine).__name__}")
        per_worker = llm.collective_rpc(_vllm_weights_sha256)
        return per_worker[0] if len(per_worker) == 1 else hashlib.sha256("".join(per_worker).encode()).hexdigest()


def _vllm_weights_sha256(worker: Any) -> str:
    """Runs inside a vLLM worker: digest of the served model's weights."""
    return state_dict_sha256(worker.model_runner.model.state_dict())


def state_dict_sha256(state: dict[str, Any]) -> str:
    """sha256 over every tensor's name and bytes, in name order."""
    import torch
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class JudgeClient:
    """What a reward function receives: `generate(prompts, **sampling)` spread over the group's workers."""

    def __init__(self, name: str, workers: list[Any], sampling: dict[str, Any], timeout_s: float = 600.0,
                 model: str = ""):
        self.name, self.workers, self.sampling, self.timeout_s = name, workers, dict(sampling), timeout_s
        self.model = model  # the model folder and engine the workers serve (part of `identity`)

    @property
    def identity(self) -> str:
        """What decides this judge's answers: its model and sampling settings (a cache key for verdicts)."""
        return f"{self.name}|{self.model}|{sorted(self.sampling.items())}"

    def generate(self, prompts: list[str], **sampling: Any) -> list[str]:
        """Completions for `prompts` (in order), at the judge's sampling settings unless overridden."""
        return self._spread("generate", prompts, params={**self.sampling, **sampling})

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """A reward model's scores for (prompt, response) pairs (in order), spread over the group's workers."""
        return self._spread("score", prompts, responses)

    def _spread(self, method: str, *columns: list, params: dict[str, Any] | None = None) -> list:
        """`method` of the workers on contiguous, near-equal slices of the aligned `columns`; results in order."""
        if not columns[0]:
            return []
        n = len(self.workers)
        bounds = [round(i * len(columns[0]) / n) for i in range(n + 1)]
        refs = [getattr(w, method).remote(*(c[bounds[i]:bounds[i + 1]] for c in columns),
                                          *(() if params is None else (params,)))
                for i, w in enumerate(self.workers) if bounds[i + 1] > bounds[i]]
        return list(itertools.chain.from_iterable(ray.get(refs, timeout=self.timeout_s)))

    def weights_sha256(self) -> list[str]:
        return ray.get([w.weights_sha256.remote() for w in self.workers], timeout=self.timeout_s)


def stop_judges(clients: Any) -> None:
    """Kill every worker of the judge clients (a dict of them by name, or any iterable of clients)."""
    for client in (clients.values() if isinstance(clients, dict) else clients):
        for w in client.workers:
            ray.kill(w)


def start_judges(judges: dict[str, Any], policy_path: str, env: dict[str, str] | None = None) -> dict[str, JudgeClient]:
    """Start every judge group of `reward.judges` (a null `model_path` is the run's initial policy; a null
    `chat_template` must have been resolved by the caller)."""
    clients = {}
    for name, jc in judges.items():
        path = jc["model_path"] or policy_path
        device = "cuda" if jc["num_gpus"] else "cpu"
        actor = ray.remote(JudgeWorker).options(num_cpus=jc["num_cpus"], num_gpus=jc["num_gpus"],
                                                runtime_env={"env_vars": env or {}})
        options = engine_options(jc["engine_params"], jc["engine"], f"reward.judges.{name}.engine_params")
        workers = [actor.remote(path, jc["engine"], options, jc["dtype"], device, jc["threads"],
                                bool(jc["chat_template"]))
                   for _ in range(jc["num_workers"])]
        sampling = {k: jc[k] for k in ("temperature", "top_p", "max_new_tokens")}
        # top-k and the repetition penalty where set (a judge spec written by a stage may not name them)
        sampling |= {k: jc[k] for k, off in (("top_k", 0), ("repetition_penalty", 1.0)) if jc.get(k, off) != off}
        clients[name] = JudgeClient(name, workers, sampling, model=f"{path}|{jc['engine']}|{jc['dtype']}")
    return clients
