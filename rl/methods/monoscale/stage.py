"""The `monoscale` stage: a router model grows an agent pool round by round with MonoScale's trust-region
memory updates (`rl.methods.monoscale.core`), beside naive growth and the fixed pool, on the same cluster as training.

The router is a language model served by a frozen engine actor: a `reward.judges` entry named by `router`, or
(null) the run's current policy (the `policy` artifact, e.g. a router taught by the SFT stage). `distiller`
names a judge group that writes the candidate memory entries from the evidence (`rl.methods.monoscale.core.LMDistiller`);
null distills them from the success counts (`distill_evidence`). `familiarizer` names a judge group that writes
each new agent's familiarization tasks from its card and samples of the task distribution
(`rl.methods.monoscale.core.LMFamiliarizer`); null draws them from the types the card claims (`familiarization_tasks`). The pool is the
labelled simulated pool of `rl.methods.monoscale.core.make_growing_pool` (`pool_seed`, `kinds`, `start`, `final`,
`unreliable_share`): agents with a success probability per task type, outcomes drawn deterministically.
Artifacts: `router_memory` (the final memory, JSON), `monoscale_report` (J per round and mode, every update);
every accepted memory version and the accept/reject log are under `stages/NAME/memory/`.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

from rl.config import as_container, engine_actor_config
from rl.methods.monoscale.core import (
    LMDistiller,
    LMFamiliarizer,
    LMRouter,
    MemoryHistory,
    Task,
    grow_pool,
    make_growing_pool,
)
from rl.registry import register
from rl.stages import Stage, StageContext, StageError, say


@register("stage", "monoscale")
class MonoScaleStage(Stage):
    reads, publishes = ("policy",), ("router_memory", "monoscale_report")  # checked against the recipe's order
    config_keys = ("seed", "model", "reward.judges")
    runs_in_driver = True

    def __init__(self, router: str | None = None, distiller: str | None = None, familiarizer: str | None = None, modes: list[str] = ("monoscale", "naive", "fixed"),
                 pool_seed: int = 0, kinds: int = 6, start: int = 3, final: int = 10, unreliable_share: float = 0.3,
                 delta: float = 0.2, tolerance: float = 0.0, n_familiarization: int = 16, test_size: int = 300,
                 replay_size: int = 48, max_new_tokens: int = 3, seed: int = 0):
        unknown = [m for m in modes if m not in ("monoscale", "naive", "fixed")]
        if unknown:
            raise ValueError(f"modes: {unknown} are not monoscale, naive or fixed")
        if not 0 < start < final:
            raise ValueError(f"start ({start}) and final ({final}) must satisfy 0 < start < final")
        self.router, self.distiller, self.familiarizer, self.modes = router, distiller, familiarizer, list(modes)
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.pool = {"seed": pool_seed, "kinds": kinds, "start": start, "final": final,
                     "unreliable_share": unreliable_share}
        self.grow = {"start": start, "delta": delta, "tolerance": tolerance, "n_familiarization": n_familiarization,
                     "test_size": test_size, "replay_size": replay_size}

    def run(self, ctx: StageContext) -> dict[str, str]:
        from dataclasses import asdict

        cfg, out, rt = ctx.cfg, ctx.stage_dir, ctx.runtime
        shutil.rmtree(out / "memory", ignore_errors=True)  # a re-run logs its own decisions only
        out.mkdir(parents=True, exist_ok=True)
        for role, name in (("router", self.router), ("distiller", self.distiller), ("familiarizer", self.familiarizer)):
            if name is not None and name not in cfg.reward.judges:
                raise StageError(f"stage {ctx.name!r}: {role} {name!r} names no reward.judges entry "
                                 f"(known: {list(cfg.reward.judges)})")
        jc = (as_container(cfg.reward.judges[self.router]) if self.router else
              engine_actor_config(cfg))
        jc.update(temperature=0.0, max_new_tokens=self.max_new_tokens, chat_template=bool(jc.get("chat_template")))
        policy = ctx.require("policy")
        client = rt.start_judges({"router": jc}, jc.get("model_path") or policy)["router"]
        clients = [client]
        try:
            helpers = {}
            for role, name in (("distiller", self.distiller), ("familiarizer", self.familiarizer)):
                if name is not None:
                    helpers[role] = rt.start_judges({role: as_container(cfg.reward.judges[name])}, policy)[role]
                    clients.append(helpers[role])
            router = LMRouter(lambda prompts: client.generate(prompts))
            pool, cards, kinds = make_growing_pool(**self.pool)
            distill = LMDistiller(helpers["distiller"].generate) if "distiller" in helpers else None
            samples = [Task(f"sample-{i}", kinds[i % len(kinds)]) for i in range(2 * len(kinds))]
            familiarize = LMFamiliarizer(helpers["familiarizer"].generate, samples) if "familiarizer" in helpers else None
            report: dict[str, Any] = {"pool": pool.probs, "cards": [asdict(c) for c in cards], "runs": {}}
            for mode in self.modes:
                history = MemoryHistory(out / "memory" if mode == "monoscale" else None)
                result = grow_pool(mode, router, pool, cards, kinds, seed=self.seed, history=history, distill=distill,
                                   familiarize=familiarize, **self.grow)
                report["runs"][mode] = result
                say(f"{ctx.name}: {mode}: J by round {[round(j, 3) for j in result['j']]}")
        finally:
            rt.stop_judges(clients)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        memory = report["runs"].get("monoscale", next(iter(report["runs"].values())))["memory"]
        (out / "router_memory.json").write_text(memory)
        ctx.summary[ctx.name] = {mode: r["j"] for mode, r in report["runs"].items()}
        return {"router_memory": str(out / "router_memory.json"), "monoscale_report": str(out / "report.json")}
