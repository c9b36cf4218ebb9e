"""What the RL loop drives: the contract of an actor system (`RLRoles`), implemented by the driver's Ray roles
(`cluster.rl_roles.RayRLRoles`). The loop decides what to do and in which order (the algorithm, the prompts, the
steps, the checkpoints); the roles do it where the actors live (generation, scoring, the learners' passes, weight
transport, colocated turns, recovery from a dead or stuck worker)."""

from __future__ import annotations

from typing import Any, Protocol

from rl.batch import Batch


class LearnerFailed(RuntimeError):
    """A learner rank died or stopped answering: the run stops (a DeepSpeed rank cannot rejoin its process
    group) and resumes from a checkpoint."""


class RLRoles(Protocol):
    """The actor system of an RL run. `learners` (and `critic`, None without one) are learner groups: their
    `compute_logprobs`, `train_step`, `save_checkpoint` and `load_checkpoint` run on every rank. The methods below
    state the rest of the contract."""

    learners: Any  # the policy's learner group
    critic: Any  # the critic's learner group, or None

    # ------------------------------------------------------------------ colocated turns (no-ops when split)
    def rollout_turn(self) -> None:
        """Before generation: the engines get the devices they share with the learner."""

    def learner_turn(self, timing: dict[str, float]) -> None:
        """After generation: the learner gets the devices back (time spent adds to `timing['swap']`)."""

    def weights_turn(self) -> None:
        """Before the weight sync: the engines make room for the new weights."""

    def cache_turn(self, timing: dict[str, float]) -> dict[str, float]:
        """After the sync: the engines get their KV cache back; returns memory metrics."""

    # ------------------------------------------------------------------ generation and scoring
    def submit_rollout(self, rows: list[dict], seed: int, group_base: int) -> Any:
        """Start generating `rollout.n` samples for each row (group ids from `group_base`) without waiting;
        returns a handle for `gather_rollout`. Generations run in submission order on each worker."""

    def gather_rollout(self, handle: Any, step: int) -> Batch:
        """The batch of a submitted rollout for `step`; a worker that dies or is stuck meanwhile is restarted and
        the same rollout generated again (same prompts and seeds)."""

    def continue_responses(self, contexts: list[list[int]], max_new_tokens: list[int], seed: int
                           ) -> list[tuple[list[int], list[float], bool, int]]:
        """Continue each context (prompt and response ids so far) by up to its `max_new_tokens` with the recipe's
        sampling, spread over the rollout workers: per context (new ids, their logprobs, whether it ended, the
        policy version that sampled them). Partial rollouts (`rl.loop.partial`)."""

    def score(self, batch: Batch, step: int) -> list[dict]:
        """The reward service's scores of `batch`, within the recipe's deadline."""

    def evaluate(self, rows: list[dict]) -> dict[str, Any]:
        """The held-out evaluation of the current policy on `rows` (`cluster.evaluation.evaluate`)."""

    # ------------------------------------------------------------------ weights and accounting
    def sync_weights(self, version: int) -> dict[str, float]:
        """The learner's weights into every engine as policy `version`; returns `rollout/weight_load_s` and
        `rollout/sync_bytes`."""

    def perf_metrics(self, batch: Batch, timing: dict[str, float], step_s: float, train_passes: int,
                     logprob_passes: int) -> dict[str, float]:
        """The step's utilisation (`perf/*`), the engines' own generation time and the rollout restarts."""

    def peak_memory(self) -> dict[str, float]:
        """Peak resident memory (GiB) of every actor and of the driver."""

    def actor_nodes(self) -> dict[str, str]:
        """The node each learner rank and rollout worker runs on."""

    def close(self) -> None:
        """Stop every actor of the run."""
