"""The rollout worker: a Ray actor that owns one generation engine."""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

import ray
import torch

from rl.batch import Batch
from rl.registry import lookup
from rl.tools import require_sandbox
from rollout.base import ActorProbes, SamplingParams
from rollout.weight_sync import PackedState, unpack_state


class RolloutWorkerRestarted(RuntimeError):
    """Raised by a rollout worker that Ray restarted and that has not received the current weights yet."""


class RolloutWorkerStuck(RuntimeError):
    """A rollout worker did not answer within its deadline (`trainer.deadlines`); it was killed for a restart."""


def token_versions(shape: tuple[int, int], start: int, swaps: list[tuple[int, int, list[int] | None]]
                   ) -> torch.Tensor:
    """`[N, L]` policy version of each response token: `start`, and after a swap `(s, v, counts)` (weights of
    version `v` installed after engine step `s`) `v` from each row's token `counts[row]` on, or, where the engine
    gives no counts (`hf`'s plain loop samples token j of every row at step j), from token `s + 1` on."""
    out = torch.full(shape, start, dtype=torch.long)
    for step, version, counts in swaps:
        if counts is None:
            out[:, step + 1:] = version
        else:
            for row, count in enumerate(counts):
                out[row, count:] = version
    return out


class RolloutWorker(ActorProbes):
    """Generates samples with the engine named in the recipe and receives weight updates."""

    def __init__(self, engine: str, model_path: str, threads: int = 1, **engine_kwargs: Any):
        torch.set_num_threads(threads)
        self.engine = lookup("engine", engine)(model_path, **engine_kwargs)
        self.policy_version = 0
        self.engine_lock = threading.Lock()  # the endpoint's generate calls and weight loads take turns
        # weights received in the background while the engine generates (`receive_weights_staged`): (version,
        # tensors, seconds the transfer took), installed between two generations by `install_staged`
        self.staged: tuple[int, dict[str, torch.Tensor], float] | None = None
        self.staged_ready = threading.Condition()
        # A restarted actor is rebuilt from its constructor arguments, i.e. the initial weights: it
        # must not generate until the trainer has sent the current ones.
        with warnings.catch_warnings():  # Ray's property uses a deprecated accessor internally
            warnings.simplefilter("ignore", DeprecationWarning)
            self.needs_weights = ray.get_runtime_context().was_current_actor_reconstructed

    def generate(self, prompts: list[str], sampling: dict, group_ids: list[int],
                 ground_truth: list[Any] | None = None, metadata: list[dict] | None = None,
                 in_flight: bool = False) -> Batch:
        """`in_flight` (`rollout.in_flight_updates`): weights staged while the engine generates are swapped in
        between two decode steps (`hf`) or engine steps (`vllm`); every token's policy version is the batch extra `token_version`
        and `batch.policy_version` is the oldest (the version the generation started from)."""
        if self.needs_weights:
            raise RolloutWorkerRestarted(f"rollout worker (pid {os.getpid()}) was restarted and has no weights yet")
        start, swaps = self.policy_version, []
        if in_flight:
            self.engine.between_steps = lambda step: self._swap_in_flight(step, swaps)
        try:
            batch = self.engine.generate(prompts, SamplingParams(**sampling), group_ids=group_ids,
                                         ground_truth=ground_truth, metadata=metadata)
        finally:
            self.engine.between_steps = None
        batch.policy_version = start
        if in_flight:
            batch.set_extra("token_version", token_versions(batch.response_ids.shape, start, swaps), pad="right")
        return batch

    def continue_ids(self, contexts: list[list[int]], sampling: dict, seeds: list[int]
                     ) -> list[tuple[list[int], list[float], bool, int]]:
        """Continue each context of token ids (partial rollouts): (new ids, logprobs, ended, policy version)."""
        if self.needs_weights:
            raise RolloutWorkerRestarted(f"rollout worker (pid {os.getpid()}) was restarted and has no weights yet")
        outs = self.engine.generate_ids(contexts, SamplingParams(**sampling), seeds=seeds)
        return [(o.ids, o.logprobs, o.ended, self.policy_version) for o in outs]

    def _swap_in_flight(self, step: int, swaps: list[tuple[int, int]]) -> None:
        """Between decode steps: install the staged weights, if any have arrived, and note the step."""
        with self.staged_ready:
            staged, self.staged = self.staged, None
        if staged is not None:
            self._install(staged[1], staged[0])
            counts = getattr(self.engine, "sampled_counts", None)
            swaps.append((step, staged[0], counts() if counts is not None else None))

    @ray.method(concurrency_group="weight_sync")
    def stage_weights(self, packed: PackedState, version: int) -> float:
        """Keep weights sent through the object store beside the engine's while it may be generating
        (`rollout.in_flight_updates`): swapped in between two decode steps, or by `install_staged`."""
        t0 = time.perf_counter()
        named = {k: v.clone() for k, v in unpack_state(packed).items()}  # the object store's buffer is not ours
        return self._stage(version, named, time.perf_counter() - t0)

    def _stage(self, version: int, named: dict[str, torch.Tensor], seconds: float) -> float:
        """Keep `named` as the staged weights unless newer ones wait already; wake `install_staged`."""
        with self.staged_ready:
            if self.staged is None or self.staged[0] < version:
                self.staged = (version, named, seconds)
            self.staged_ready.notify_all()
        return seconds

    def run_episodes(self, prompts: list[str], rows: list[dict], sampling: dict, group_ids: list[int],
                     env: dict[str, Any], metadata: list[dict] | None = None) -> Batch:
        """Multi-turn episodes of the environment `env` ({name, params, max_turns, max_episode_tokens,
        opponent_path, step_timeout_s, schedule, env_workers}) from `prompts` (see `rollout.multiturn`)."""
        from rollout.multiturn import Seats, run_episodes
        if self.needs_weights:
            raise RolloutWorkerRestarted(f"rollout worker (pid {os.getpid()}) was restarted and has no weights yet")
        env_cls, params = lookup("env", env["name"]), dict(env.get("params") or {})
        if getattr(env_cls, "runs_model_code", False):  # checked on this worker's node, not only the driver's
            require_sandbox()
        if env.get("opponent_path") and getattr(self, "frozen_engine", None) is None:
            from rollout.hf_engine import HFEngine
            self.frozen_engine = HFEngine(env["opponent_path"])
        sp = SamplingParams(**sampling)
        batch = run_episodes(self.engine, lambda: env_cls(**params), prompts, rows, sp,
                             max_turns=env["max_turns"], max_episode_tokens=env["max_episode_tokens"],
                             seats=Seats(self.engine, getattr(self, "frozen_engine", None)), group_ids=group_ids,
                             metadata=metadata, step_timeout_s=env.get("step_timeout_s", 60.0),
                             schedule=env.get("schedule", "lockstep"), env_workers=env.get("env_workers", 8))
        batch.policy_version = self.policy_version
        return batch

    def run_agent_episodes(self, prompts: list[str], rows: list[dict], sampling: dict, group_ids: list[int],
                           agent: dict[str, Any], metadata: list[dict] | None = None) -> Batch:
        """Episodes of the agent program `agent["program"]` against this worker's OpenAI-compatible endpoint
        (see `rollout.agent_programs`), `sampling["n"]` per prompt."""
        from rollout.agent_programs import run_agent_episodes
        if self.needs_weights:
            raise RolloutWorkerRestarted(f"rollout worker (pid {os.getpid()}) was restarted and has no weights yet")
        batch = run_agent_episodes(self.openai_server(agent.get("port", 0)), agent["program"], prompts, rows,
                                   SamplingParams(**sampling), group_ids=group_ids, metadata=metadata,
                                   workers=agent["workers"], timeout_s=agent["timeout_s"],
                                   max_episode_tokens=agent["max_episode_tokens"])
        batch.policy_version = self.policy_version
        return batch

    def openai_server(self, port: int = 0) -> Any:
        """The OpenAI-compatible endpoint on this worker's engine (`rollout.openai_server`), started on first use;
        it serves while the worker lives, each response tagged with the policy version the engine holds."""
        if getattr(self, "_openai", None) is None:
            from rollout.openai_server import OpenAIServer
            self._openai = OpenAIServer(self.engine, lock=self.engine_lock, version=lambda: self.policy_version,
                                        port=port)
        return self._openai

    def openai_address(self) -> str:
        return self.openai_server().address

    def accept_initial_weights(self) -> None:
        """Let a restarted worker generate with the weights it was built from: right for a stage that serves
        the model it started the workers with (MEMO), never after the trainer has sent other weights."""
        self.needs_weights = False

    def load_weights(self, packed: PackedState, version: int) -> float:
        """Load weights sent by the learner (`cluster.weight_sync.pack_state`) and tag the new policy version."""
        t0 = time.perf_counter()
        self._install(unpack_state(packed), version)
        return time.perf_counter() - t0

    def _install(self, named: dict[str, torch.Tensor], version: int) -> None:
        """Copy `named` into the engine and tag the new policy version (every weight-sync path ends here)."""
        with self.engine_lock:
            self.engine.load_weights(named)
            self.policy_version = version
        self.needs_weights = False

    def init_weight_sync_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        from rollout.weight_sync import make_sync_group
        self.sync_group = make_sync_group(host, port, rank, world_size, backend)
        self.sync_device = "cuda" if backend == "nccl" else "cpu"

    def receive_weights(self, version: int, meta: list, bucket_bytes: int) -> float:
        """Receive learner rank 0's broadcast (`rollout.weight_sync: collective`) and load it."""
        from rollout.weight_sync import receive_state
        t0 = time.perf_counter()
        named: dict[str, torch.Tensor] = {}
        for part in receive_state(self.sync_group, meta, bucket_bytes, self.sync_device):
            named.update(part)
        self._install(named, version)
        return time.perf_counter() - t0

    @ray.method(concurrency_group="weight_sync")
    def receive_weights_staged(self, version: int, meta: list, bucket_bytes: int) -> float:
        """Receive learner rank 0's broadcast on the weight-sync thread while the engine may be generating
        (`rollout.weight_sync: collective` with `trainer.max_staleness > 0`): the tensors wait beside the
        engine's (one more copy of the weights) until `install_staged` swaps them in between two generations."""
        from rollout.weight_sync import receive_state
        t0 = time.perf_counter()
        named: dict[str, torch.Tensor] = {}
        for part in receive_state(self.sync_group, meta, bucket_bytes, self.sync_device):
            named.update(part)
        return self._stage(version, named, time.perf_counter() - t0)  # broadcasts arrive in version order

    def install_staged(self, version: int, timeout_s: float = 600.0) -> float:
        """Swap in the staged weights of `version` (or newer), waiting for their transfer to end; queued behind
        the generation in flight, so that the next one samples from them. Returns transfer + load seconds."""
        with self.staged_ready:
            if self.policy_version >= version and self.staged is None:
                return 0.0  # a newer transfer already installed (it overtook this one's install)
            if not self.staged_ready.wait_for(lambda: self.staged is not None and self.staged[0] >= version,
                                              timeout=timeout_s):
                raise RuntimeError(f"rollout worker: the weights of version {version} did not arrive within "
                                   f"{timeout_s:g} s")
            staged_version, named, seconds = self.staged
            self.staged = None
        t0 = time.perf_counter()
        self._install(named, staged_version)
        return seconds + time.perf_counter() - t0

    def load_weights_ipc(self, shared: dict, version: int) -> float:
        """Load the weights of the learner rank on this GPU from its CUDA IPC handles
        (`rollout.weight_sync: cuda_ipc`, `LearnerWorker.share_weights_ipc`)."""
        from rollout.weight_sync import gpu_uuid, open_state_ipc
        t0 = time.perf_counter()
        if shared["gpu"] != gpu_uuid():
            raise RuntimeError(f"rollout.weight_sync=cuda_ipc: this rollout worker runs on GPU {gpu_uuid()}, its "
                               f"learner rank on {shared['gpu']}; cuda_ipc needs them colocated on one GPU "
                               "(cluster.placement: colocated), else use collective")
        named: dict[str, torch.Tensor] = {}
        for part in open_state_ipc(shared["handles"], shared["meta"], shared["bucket_bytes"]):
            named.update(part)
        self._install(named, version)
        del named
        torch.cuda.synchronize()  # the copies out of the learner's buckets are done before it may free them
        return time.perf_counter() - t0

    def sleep(self) -> float:
        """Free the engine's GPU memory for the colocated learner (`rollout.sleep_between_phases`)."""
        t0 = time.perf_counter()
        self.engine.sleep()
        return time.perf_counter() - t0

    def wake(self, tags: list[str] | None = None) -> float:
        t0 = time.perf_counter()
        self.engine.wake(tags)
        return time.perf_counter() - t0

    def pid(self) -> int:
        return os.getpid()
