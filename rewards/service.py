"""The reward service: scores samples with one or more reward functions in worker processes.

Why processes: math-verify (and many graders) use `signal.alarm`, which fails off the main thread,
and a stuck user plugin must be killable. Each sample gets `timeout_s`, enforced inside the worker
with an interval timer and, as a backstop, by the parent, which kills and restarts the pool when
a worker stops answering (dead, or silent past every timer plus `grace_s`) and scores its unfinished
chunks again, up to `max_worker_deaths` times per call. An exception, a timeout, a NaN or a wrong return type becomes a recorded
failure for that sample (flagged in the batch and counted in the metrics), never a crashed run.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import threading
import time
import traceback
from typing import Any

from rewards.scoring import RewardSpec, load_rewards, score_chunk
from rl.reward import RewardResult, needs_judges, normalize_result
from rollout.probes import ActorProbes


class RewardService(ActorProbes):
    """Scores samples with weighted reward functions in `num_workers` spawned processes."""

    def __init__(self, functions: list[RewardSpec], num_workers: int = 2, timeout_s: float = 10.0,
                 failure_reward: float = 0.0, judges: dict[str, Any] | None = None, grace_s: float = 30.0):
        if not functions:
            raise ValueError("the reward service needs at least one reward function")
        from rl.registry import lookup
        keys = [f.key for f in functions]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"reward functions {dup} appear more than once: give each a distinct `label`")
        # fail at start-up, in the driver, for plugins that cannot be loaded; rewards that call judges run
        # in this process (where the judges' Ray handles live), the others in the worker pool
        self.in_process = {f.key for f in functions if needs_judges(lookup("reward", f.name))}
        self.functions = functions
        self.judges: dict[str, Any] = dict(judges or {})
        self.num_workers = max(1, num_workers)
        self.timeout_s = timeout_s
        self.failure_reward = failure_reward
        self._pool = None
        self.restarts = 0
        self.worker_deaths = 0  # worker processes that died or stopped answering; their chunks were scored again
        self.max_worker_deaths = 3  # per score() call; beyond that, unfinished samples are marked failed
        self.grace_s = grace_s  # beyond every per-sample timer, before a silent worker counts as stuck
        pooled = sorted({f.name for f in functions if f.key not in self.in_process})
        self._loading = None
        if pooled:  # start the worker processes and import the rewards now, while the other roles start
            self._loading = self._ensure_pool().map_async(load_rewards, [pooled] * self.num_workers, chunksize=1)

    def wait_started(self, timeout_s: float = 60.0) -> bool:
        """Wait (at most `timeout_s`) until the worker processes have imported the rewards; whether they have.
        The driver measures the machine's ceilings (`perf/mfu`) after it, on cores nothing else is busy on."""
        if self._loading is None:
            return True
        self._loading.wait(timeout_s)
        return self._loading.ready()

    def set_judges(self, judges: dict[str, Any]) -> None:
        """Hand the judge clients (`rewards.judges.JudgeClient`) to the rewards that call them."""
        self.judges = dict(judges)

    def _score_in_process(self, f: RewardSpec, items: list[dict]) -> list[tuple[Any, str | None]]:
        """A judge-calling (batched) reward, run here; an exception marks every sample of the call failed."""
        from rl.registry import lookup
        cols = {k: [it.get(k) for it in items] for k in items[0]}
        try:
            out = lookup("reward", f.name)(cols.pop("prompt"), cols.pop("response"), judges=self.judges,
                                        **cols, **dict(f.params))
        except Exception as exc:
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            return [(None, f"reward {f.name!r} raised {tb}")] * len(items)
        if not isinstance(out, (list, tuple)) or len(out) != len(items):
            return [(None, f"reward {f.name!r} returned {type(out).__name__}, expected a list of {len(items)}")] \
                * len(items)
        return [(v, None) for v in out]

    def _ensure_pool(self):
        if self._pool is None:
            self._pool = mp.get_context("spawn").Pool(self.num_workers)
        return self._pool

    def _discard_pool(self, wait_s: float) -> None:
        """Shut the pool down. `Pool.terminate()` can block for ever once a worker died while holding the
        result queue's lock (CPython issue 22393), so it runs on a daemon thread and is waited for at most
        `wait_s`, then any worker still alive is killed; a fresh pool replaces it either way."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        workers = list(pool._pool)
        closer = threading.Thread(target=pool.terminate, daemon=True)
        closer.start()
        closer.join(wait_s)
        for proc in workers:  # still stuck: make sure no worker outlives the pool
            if proc.exitcode is None:
                proc.kill()

    def _restart_pool(self):
        self._discard_pool(wait_s=5.0)
        self.restarts += 1

    def close(self) -> None:
        self._discard_pool(wait_s=10.0)

    def score(self, items: list[dict], evaluation: bool = False) -> list[dict]:
        """Score rows `{prompt, response, ground_truth, metadata, ...}`.

        Returns per row `{score, failed, error, components}`; `score` is the weighted sum over the
        applicable functions, or `failure_reward` when any function failed for that row. `eval_only`
        functions run only with `evaluation` and then add their components, not their score.
        """
        if not items:
            return []
        functions = [f for f in self.functions if evaluation or not f.eval_only]
        raw: dict[str, list[tuple[Any, str | None]]] = {f.key: [(None, None)] * len(items) for f in functions}
        for f in functions:
            if f.key in self.in_process:
                raw[f.key] = self._score_in_process(f, items)
        pooled = [f for f in functions if f.key not in self.in_process]
        if pooled:
            self._score_in_pool(pooled, items, raw)
        return [self._combine({f.key: raw[f.key][i] for f in functions}, functions) for i in range(len(items))]

    def _score_in_pool(self, pooled: list[RewardSpec], items: list[dict],
                       raw: dict[str, list[tuple[Any, str | None]]]) -> None:
        """Score `items` with the pooled functions in chunks over the worker processes, into `raw`; chunks lost
        with a dead or stuck worker are scored again (up to `max_worker_deaths` restarts)."""
        n_chunks = min(len(items), self.num_workers * 2)
        bounds = [round(i * len(items) / n_chunks) for i in range(n_chunks + 1)]
        tasks = [(f, bounds[c], items[bounds[c]:bounds[c + 1]]) for f in pooled for c in range(n_chunks)]
        waves = math.ceil(len(tasks) / self.num_workers)
        budget = self.timeout_s * (max(bounds[i + 1] - bounds[i] for i in range(n_chunks)) * waves + 1) + self.grace_s
        todo = list(range(len(tasks)))
        deaths = 0
        while todo:
            deadline = time.monotonic() + budget
            pool = self._ensure_pool()
            workers = list(pool._pool)  # multiprocessing.Pool has no public handle on its processes
            running = {t: pool.apply_async(score_chunk, (tasks[t][0].name, dict(tasks[t][0].params), tasks[t][2],
                                                          self.timeout_s)) for t in todo}
            todo, deaths = self._wait(running, tasks, raw, workers, deadline, deaths)

    def _wait(self, running: dict[int, Any], tasks: list[tuple], raw: dict[str, list], workers: list[Any],
              deadline: float, deaths: int) -> tuple[list[int], int]:
        """Collect the chunks as they finish; returns the chunks to score again and the restarts so far."""
        while running:
            for t, res in list(running.items()):
                if res.ready():
                    f, start, chunk = tasks[t]
                    try:
                        out = res.get()
                    except Exception as exc:
                        out = [(None, f"reward {f.name!r} worker failed: {type(exc).__name__}: {exc}")] * len(chunk)
                    raw[f.key][start:start + len(chunk)] = out
                    del running[t]
            if not running:
                break
            died = any(w.exitcode is not None for w in workers)
            if (died or time.monotonic() > deadline) and deaths < self.max_worker_deaths:
                # A worker process died (killed, out of memory: the pool replaces it but silently drops its task),
                # or is stuck past every per-sample timer (a plugin blocking its timer signal, a hung C call):
                # restart the pool and score every unfinished chunk again.
                self.worker_deaths += 1
                self._restart_pool()
                return sorted(running), deaths + 1
            if time.monotonic() > deadline:  # stuck again and again: give up on these samples
                for t in running:
                    f, start, chunk = tasks[t]
                    raw[f.key][start:start + len(chunk)] = [
                        (None, f"reward {f.name!r} worker did not answer in time (killed and restarted)")] * len(chunk)
                self._restart_pool()
                break
            time.sleep(0.005)
        return [], deaths

    def _combine(self, per_fn: dict[str, tuple[Any, str | None]], functions: list[RewardSpec]) -> dict:
        total, applicable, errors, components, steps, valid = 0.0, 0, [], {}, None, None
        for f in functions:
            value, err = per_fn[f.key]
            res = RewardResult(None, error=err) if err else normalize_result(value, f.key)
            if res.failed and f.eval_only:  # a held-out measurement that failed does not fail the sample
                components[f"{f.key}/failed"] = 1.0
                continue
            if res.failed:
                errors.append(res.error)
                continue
            for k, v in res.components.items():
                components[f"{f.key}/{k}"] = v
            if res.steps is not None and not f.eval_only:  # a process reward's steps (the first one's)
                steps = steps or {"rewards": [f.weight * r for r in res.steps["rewards"]], "ends": res.steps["ends"]}
            if res.valid is not None and not f.eval_only:  # valid when every function that judges validity says so
                valid = res.valid if valid is None else (valid and res.valid)
            if res.score is not None:
                components[f.key] = res.score
                if not f.eval_only:
                    total += f.weight * res.score
                    applicable += 1
        if errors:
            return {"score": self.failure_reward, "failed": True, "error": "; ".join(errors),
                    "components": components}
        if applicable == 0:
            return {"score": self.failure_reward, "failed": False, "error": None,
                    "components": components, "not_applicable": True}
        out = {"score": total, "failed": False, "error": None, "components": components}
        if steps is not None:
            out["steps"] = steps
        if valid is not None:
            out["valid"] = valid
        return out
