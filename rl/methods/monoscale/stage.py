"""The `monoscale` stage: a router model grows an agent pool round by round with MonoScale's trust-region
memory updates (`rl.methods.monoscale.core`), beside the same rounds without the trust region (`accept_all`), naive
growth and the fixed pool, on the same cluster as training.

The router is a language model served by a frozen engine actor: a `reward.judges` entry named by `router`, or
(null) the run's current policy (the `policy` artifact, e.g. a router taught by the SFT stage). `distiller`
names a judge group that writes the candidate memory entries from the evidence (`core.LMDistiller`); null distills
them from the success counts (`distill_evidence`). `familiarizer` names a judge group that writes each new agent's
familiarization tasks from its card and samples of the task distribution (`core.LMFamiliarizer`; simulated pool
only: written tasks carry no reference answer to judge a real agent by); null draws them from the types the card
claims (`familiarization_tasks`).

The pool is either
* real agents (`agents`: a pool file as the `monoscale` environment reads, in joining order, the first `start`
  being the starting pool): a `model` agent is served by the `reward.judges` entry its `judge` key names (its
  `system_prompt` before each task), a `python` agent runs its `code` in the sandbox with the task in `TASK`. Tasks
  are the data's rows (`data.prompt_column`, `data.answer_column`, `kind_column`: the task type): the held-out split
  is the test set, the train split gives the replay tasks and the familiarization bank. Each agent's output is
  judged against the row's answer (`answer_match`: math, exact or contains); or
* the labelled simulated pool of `core.make_growing_pool` (`pool_seed`, `kinds`, `start`, `final`,
  `unreliable_share`): agents with a success probability per task type, outcomes drawn deterministically.
Artifacts: `router_memory` (the final memory, JSON), `monoscale_report` (J per round and mode, every update, and
with real agents every output and its outcome); every accepted memory version and the accept/reject log are under
`stages/NAME/memory/`.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict
from typing import Any

from rl.config import as_container, engine_actor_config
from rl.methods.monoscale.core import (
    ANSWER_MATCHES,
    MODES,
    AgentCard,
    AgentPool,
    LMDistiller,
    LMFamiliarizer,
    LMRouter,
    MemoryHistory,
    Task,
    answer_matches,
    grow_pool,
    make_growing_pool,
)
from rl.methods.monoscale.env import load_pool, run_tool_agent
from rl.registry import register
from rl.stages import Stage, StageContext, StageError, say


@register("stage", "monoscale")
class MonoScaleStage(Stage):
    reads, publishes = ("policy",), ("router_memory", "monoscale_report")  # checked against the recipe's order
    config_keys = ("seed", "model", "data", "reward.judges")
    runs_in_driver = True

    def __init__(self, router: str | None = None, distiller: str | None = None, familiarizer: str | None = None,
                 modes: list[str] = MODES, agents: str | None = None, kind_column: str = "kind",
                 answer_match: str = "math", pool_seed: int = 0, kinds: int = 6, start: int = 3, final: int = 10,
                 unreliable_share: float = 0.3, delta: float = 0.2, tolerance: float = 0.0,
                 n_familiarization: int = 16, test_size: int = 300, replay_size: int = 48, max_new_tokens: int = 3,
                 seed: int = 0):
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise ValueError(f"modes: {unknown} are not among {list(MODES)}")
        if answer_match not in ANSWER_MATCHES:
            raise ValueError(f"answer_match: one of {list(ANSWER_MATCHES)}, got {answer_match!r}")
        self.agents = load_pool(agents) if agents else None  # a bad pool file fails before start-up
        if self.agents is not None and familiarizer is not None:
            raise ValueError("familiarizer: model-written tasks carry no reference answer to judge real agents by; "
                             "with `agents` the familiarization tasks come from the data's train rows")
        if self.agents is not None and not 0 < start < len(self.agents):
            raise ValueError(f"start ({start}) must leave agents to join the {len(self.agents)} of {agents}")
        if not 0 < start < final:
            raise ValueError(f"start ({start}) and final ({final}) must satisfy 0 < start < final")
        self.router, self.distiller, self.familiarizer, self.modes = router, distiller, familiarizer, list(modes)
        self.agents_path, self.kind_column, self.answer_match = agents, kind_column, answer_match
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.pool = {"seed": pool_seed, "kinds": kinds, "start": start, "final": final,
                     "unreliable_share": unreliable_share}
        self.grow = {"start": start, "delta": delta, "tolerance": tolerance, "n_familiarization": n_familiarization,
                     "test_size": test_size, "replay_size": replay_size}

    def check_judges(self, ctx: StageContext) -> None:
        known = ctx.cfg.reward.judges
        named = [("router", self.router), ("distiller", self.distiller), ("familiarizer", self.familiarizer)]
        named += [(f"agent {a['name']}'s judge", a.get("judge")) for a in self.agents or [] if a["kind"] == "model"]
        for role, name in named:
            if (name is not None or role.startswith("agent")) and name not in known:
                raise StageError(f"stage {ctx.name!r}: {role} {name!r} names no reward.judges entry "
                                 f"(known: {list(known)}){' in ' + self.agents_path if role.startswith('agent') else ''}")

    def run(self, ctx: StageContext) -> dict[str, str]:
        out, rt = ctx.stage_dir, ctx.runtime
        shutil.rmtree(out / "memory", ignore_errors=True)  # a re-run logs its own decisions only
        out.mkdir(parents=True, exist_ok=True)
        self.check_judges(ctx)
        clients = self.start_models(ctx)
        try:
            report = self.grow_all(ctx, clients)
        finally:
            rt.stop_judges(list(clients.values()))
        (out / "report.json").write_text(json.dumps(report, indent=2))
        memory = report["runs"].get("monoscale", next(iter(report["runs"].values())))["memory"]
        (out / "router_memory.json").write_text(memory)
        ctx.summary[ctx.name] = {mode: r["j"] for mode, r in report["runs"].items()}
        return {"router_memory": str(out / "router_memory.json"), "monoscale_report": str(out / "report.json")}

    def start_models(self, ctx: StageContext) -> dict[str, Any]:
        """The router's engine, and the judge groups the distiller, familiarizer and model agents name."""
        cfg, policy = ctx.cfg, ctx.require("policy")
        jc = as_container(cfg.reward.judges[self.router]) if self.router else engine_actor_config(cfg)
        jc.update(temperature=0.0, max_new_tokens=self.max_new_tokens, chat_template=bool(jc.get("chat_template")))
        clients = dict(ctx.runtime.start_judges({"router": jc}, jc.get("model_path") or policy))
        helpers = {self.distiller, self.familiarizer, *(a.get("judge") for a in self.agents or [] if a["kind"] == "model")}
        wanted = {}
        for name in sorted(n for n in helpers if n is not None):
            helper = as_container(cfg.reward.judges[name])
            if helper.get("chat_template") is None:
                helper["chat_template"] = bool(cfg.data.chat_template)
            wanted[f"judge:{name}"] = helper
        if wanted:
            clients.update(ctx.runtime.start_judges(wanted, policy))
        return clients

    def grow_all(self, ctx: StageContext, clients: dict[str, Any]) -> dict[str, Any]:
        router = LMRouter(clients["router"].generate)
        if self.agents is not None:
            pool, cards, kinds, tasks = self.real_pool(ctx, clients)
        else:
            (pool, cards, kinds), tasks = make_growing_pool(**self.pool), {}
        helper = clients.get
        distill = LMDistiller(helper(f"judge:{self.distiller}").generate) if self.distiller else None
        samples = [Task(f"sample-{i}", kinds[i % len(kinds)]) for i in range(2 * len(kinds))]
        familiarize = (LMFamiliarizer(helper(f"judge:{self.familiarizer}").generate, samples) if self.familiarizer
                       else None)
        report: dict[str, Any] = {"pool": getattr(pool, "probs", self.agents_path), "kinds": kinds,
                                  "cards": [asdict(c) for c in cards], "runs": {}}
        for mode in self.modes:
            history = MemoryHistory(ctx.stage_dir / "memory" if mode == "monoscale" else None)
            result = grow_pool(mode, router, pool, cards, kinds, seed=self.seed, history=history, distill=distill,
                               familiarize=familiarize, **self.grow, **tasks)
            report["runs"][mode] = result
            say(f"{ctx.name}: {mode}: J by round {[round(j, 3) for j in result['j']]}")
        if isinstance(pool, AgentPool):
            report["answers"] = [{"task": task, "agent": agent, "output": said, "outcome": score}
                                 for (task, agent), (said, score) in sorted(pool.seen.items())]
        return report

    def real_pool(self, ctx: StageContext, clients: dict[str, Any]) -> tuple[AgentPool, list[AgentCard], list[str],
                                                                               dict[str, Any]]:
        """The agents of the pool file judged on the data's rows: test tasks from the held-out split, replay tasks
        and the familiarization bank (task type -> tasks) from the train split, drawn with the stage's seed."""
        d = ctx.cfg.data
        columns = [d.prompt_column, d.answer_column, self.kind_column]

        def tasks(split: str) -> list[Task]:
            return [Task(f"{split}-{i}", str(r[self.kind_column]), str(r[d.prompt_column]), str(r[d.answer_column]))
                    for i, r in enumerate(ctx.rows(split, columns))]
        test, train = tasks("eval")[:self.grow["test_size"]], tasks("train")
        if not test or len(train) <= self.grow["replay_size"]:
            raise StageError(f"stage {ctx.name!r}: agents need held-out rows (the test set; {len(test)} found) and "
                             f"more train rows than replay_size ({len(train)} found)")
        random.Random(self.seed).shuffle(train)
        replay, bank = train[:self.grow["replay_size"]], {}
        for task in train[self.grow["replay_size"]:]:
            bank.setdefault(task.kind, []).append(task)
        answer = {a["name"]: self.agent_answers(a, clients) for a in self.agents}
        pool = AgentPool(answer, lambda said, reference: answer_matches(said, reference, self.answer_match))
        cards = [AgentCard(a["name"], a["description"], a.get("interface", "")) for a in self.agents]
        kinds = sorted({t.kind for t in [*test, *train]})
        return pool, cards, kinds, {"test": test, "replay": replay, "bank": bank}

    @staticmethod
    def agent_answers(agent: dict[str, Any], clients: dict[str, Any]):
        """One agent answering a batch of task texts: a model agent in one call to its engine group, a python
        agent task by task in the sandbox."""
        if agent["kind"] == "python":
            return lambda texts: [run_tool_agent(agent, text) for text in texts]
        client, system = clients[f"judge:{agent['judge']}"], agent.get("system_prompt", "")
        return lambda texts: client.generate([f"{system}\n{text}".strip() for text in texts])
