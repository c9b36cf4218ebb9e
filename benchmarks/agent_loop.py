"""Multi-turn rollouts with a slow tool: wall time of one rollout per agent-loop schedule.

    python benchmarks/agent_loop.py [--seeds 0 1 2] [--prompts 8] [--n 2] [--turns 3] [--max-sleep 2.0]

Synthetic harness measuring one mechanism, the scheduling of `rollout.multiturn`: a tiny model built in code
(hf engine) plays `--prompts` x `--n` episodes of `--turns` turns each; every environment step is a tool call
that sleeps a random 0..`--max-sleep` s (drawn per episode and turn from the seed), the way a code interpreter
or a search call with a long tail does. Arms, each on the same episodes and sleeps:

* `sequential`: lockstep with one step at a time (`rollout.env_workers: 1`), what a loop that steps its
  episodes one after another costs;
* `lockstep`: every turn's steps at once (`env_workers` = episodes), each turn waits for its slowest call;
* `per_episode`: `rollout.agent_loop: per_episode`, each episode advances on its own.

Beside each wall time, the two bounds of the sleeps alone: the sum over turns of each turn's slowest call (what
lockstep cannot beat) and the slowest single episode's total (what per-episode scheduling approaches); the rest
is generation. Results: `benchmarks/results/agent_loop.json`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.weight_sync import cpu_kind  # noqa: E402
from models.tiny import save_tiny  # noqa: E402
from rl.env import Env, EnvStep  # noqa: E402
from rollout.base import SamplingParams  # noqa: E402
from rollout.hf_engine import HFEngine  # noqa: E402
from rollout.multiturn import Seats, run_episodes  # noqa: E402


def sleeps(seed: int, episodes: int, turns: int, max_sleep: float) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.uniform(0.0, max_sleep) for _ in range(turns)] for _ in range(episodes)]


def slow_tool_env(table: list[list[float]], turns: int, n: int) -> type:
    """An environment whose step `t` of episode `e` sleeps `table[e][t]` s; episodes are told apart by their
    prompt (`row["episode"]`) and the order `reset` sees the `n` copies of a prompt in."""
    seen: dict[int, int] = {}

    class SlowTool(Env):
        def reset(self, prompt, row, seats):
            copy = seen.get(row["episode"], 0)
            seen[row["episode"]] = copy + 1
            self.sleeps, self.t = table[row["episode"] * n + copy], 0
            return prompt

        def step(self, action):
            time.sleep(self.sleeps[self.t])
            self.t += 1
            return EnvStep(observation=f"[{self.t}]", reward=1.0, done=self.t >= turns)
    return SlowTool


def run_arm(engine: HFEngine, args: argparse.Namespace, seed: int, schedule: str, workers: int) -> dict:
    table = sleeps(seed, args.prompts * args.n, args.turns, args.max_sleep)
    env = slow_tool_env(table, args.turns, args.n)
    prompts = [f"{i}+{i}=" for i in range(args.prompts)]
    rows = [{"episode": i} for i in range(args.prompts)]
    sp = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=8, seed=seed)
    t0 = time.perf_counter()
    batch = run_episodes(engine, env, prompts, rows, sp, max_turns=args.turns, max_episode_tokens=128,
                         seats=Seats(engine), step_timeout_s=60.0, schedule=schedule, env_workers=workers)
    wall = time.perf_counter() - t0
    assert all(len(r) == args.turns for r in batch.step_rewards), "an episode ended early"
    return {"wall_s": wall, "turn_max_bound_s": sum(max(col) for col in zip(*table)),
            "episode_max_bound_s": max(sum(row) for row in table), "sum_of_sleeps_s": sum(map(sum, table))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-sleep", type=float, default=2.0)
    p.add_argument("--out", default="benchmarks/results/agent_loop.json")
    args = p.parse_args()
    torch.set_num_threads(2)
    engine = HFEngine(str(save_tiny(Path(tempfile.mkdtemp()), hidden_size=64, num_layers=2, num_heads=2,
                                    intermediate_size=128)))
    episodes = args.prompts * args.n
    arms = {"sequential": ("lockstep", 1), "lockstep": ("lockstep", episodes), "per_episode": ("per_episode", episodes)}
    rows = []
    for seed in args.seeds:
        for arm, (schedule, workers) in arms.items():
            row = {"seed": seed, "arm": arm, **run_arm(engine, args, seed, schedule, workers)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {arm: {"wall_s_mean": statistics.mean(r["wall_s"] for r in rows if r["arm"] == arm),
                     "speedup_vs_sequential": statistics.mean(
                         s["wall_s"] / r["wall_s"] for r in rows if r["arm"] == arm
                         for s in rows if s["arm"] == "sequential" and s["seed"] == r["seed"])}
               for arm in arms}
    report = {"cpu": cpu_kind(), "episodes": episodes, "turns": args.turns, "max_sleep_s": args.max_sleep,
              "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
