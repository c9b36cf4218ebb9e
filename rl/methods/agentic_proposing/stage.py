"""The `agentic_proposing` stage: a solver fine-tuned on the problems a proposer synthesizes (Agentic
Proposing, rl/methods/agentic_proposing/README.md: solvers are trained by SFT on synthesized data).

1. The proposer (the `policy` artifact: after `rl` and `export`, the trained proposer; without them, the
   SFT model) runs `proposals` episodes of the recipe's environment on the rollout workers, from seeds of the
   `eval` split (not trained on) or the `train` split (`seeds`).
2. The recipe's reward functions score them; the valid problems (the verifier ensemble's `valid`) with their
   stated answers, deduplicated, are kept.
3. A worked solution per problem by rejection sampling: the judge group `solutions` (default the prober)
   samples `k` solutions and the first whose answer equals the verified one is the SFT target (a problem
   without one is dropped and counted).
4. The solver (`solver`: a model folder, or null for the model the RL stage started from) is fine-tuned on
   those rows (at most `max_rows`, so that proposers are compared on the same number of problems) through
   the learner (`steps`, `batch_size`, `lr`; `steps` null: one pass) and both it and the
   solver before fine-tuning are evaluated greedily on `eval_data` (a JSONL of `prompt` / `answer` rows, or
   the synthetic task's `solver_eval` split) by a frozen engine actor (`eval_num_gpus` GPUs).

Artifacts: `proposals` (every episode with its verdict), `solver_sft_set`, `solver`. The trainer of an
earlier `rl` stage is closed first (its learners hold the learner bundles that this SFT needs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl.answers import equivalent, stated_answer
from rl.config import engine_actor_config
from rl.data import prompt_row_columns
from rl.methods.agentic_proposing.core import parse_final
from rl.registry import register, register_alias
from rl.stages import Stage, StageContext, StageError, StageRuntime, say, stage_cfg


@register("stage", "agentic_proposing")
class AgenticProposingStage(Stage):
    config_keys = ("seed", "model", "rollout", "reward", "data", "sft", "learner")
    runs_in_driver = True
    publishes = ("proposals", "solver_sft_set", "solver")  # checked against the recipe's order

    def __init__(self, proposals: int = 256, seeds: str = "eval", solutions: str = "prober", k: int = 8,
                 solver: str | None = None, steps: int | None = None, batch_size: int = 32, lr: float = 1e-3,
                 eval_data: str | None = None, eval_max: int = 200, max_new_tokens: int = 64,
                 solver_template: str = "Solve: {problem}\n", eval_num_gpus: float = 0.0, max_rows: int | None = None,
                 seed: int = 0):
        if seeds not in ("eval", "train"):
            raise ValueError(f"seeds must be eval or train, got {seeds!r}")
        self.reads = ("policy", "base_model", seeds)
        self.proposals, self.seeds, self.solutions, self.k = proposals, seeds, solutions, k
        self.solver, self.steps, self.batch_size, self.lr = solver, steps, batch_size, lr
        self.eval_data, self.eval_max, self.max_new_tokens = eval_data, eval_max, max_new_tokens
        self.solver_template, self.eval_num_gpus, self.seed = solver_template, eval_num_gpus, seed
        self.max_rows = max_rows

    def run(self, ctx: StageContext) -> dict[str, str]:
        from omegaconf import OmegaConf

        from models.tokenizer import load_tokenizer
        from rl.sft_data import prompt_response_example
        cfg, rt, out = stage_cfg(ctx), ctx.runtime, ctx.stage_dir
        out.mkdir(parents=True, exist_ok=True)
        if cfg.rollout.env is None:
            raise StageError(f"stage {ctx.name!r}: needs the proposer's environment (rollout.env)")
        proposer = ctx.require("policy")
        start = ctx.artifact_before("policy", "checkpoint") if ctx.artifact("checkpoint") else proposer
        solver = self.solver or start
        rt.release_trainer()  # its learners hold the learner bundles the SFT below needs
        if not rt.judges:
            rt.judges = rt.serve_reward_judges(cfg, start, ctx.summary, ctx.require)
        if self.solutions not in rt.judges:
            raise StageError(f"stage {ctx.name!r}: solutions {self.solutions!r} names no reward.judges entry "
                             f"(known: {sorted(rt.judges)})")
        tok = load_tokenizer(ctx.require("base_model"))
        episodes, problems = self._propose(ctx, cfg, proposer, tok)
        sft_rows, unsolved = self._solutions(rt.judges[self.solutions], problems)
        sft_rows = sft_rows[:self.max_rows]  # the same number of problems for every proposer compared
        set_path = out / "solver_sft_set.jsonl"
        set_path.write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
        say(f"{ctx.name}: {len(episodes)} proposals, {len(problems)} distinct valid problems, "
            f"{len(sft_rows)} with a verified solution ({unsolved} without)")
        report: dict[str, Any] = {"proposals": len(episodes), "valid_frac": sum(e["valid"] for e in episodes) /
                                  max(1, len(episodes)), "distinct_valid": len(problems), "sft_rows": len(sft_rows),
                                  "unsolved": unsolved}
        eval_rows = self._eval_rows(ctx)
        report["solver_accuracy_before"] = self._accuracy(rt, cfg, solver, eval_rows)
        solver_out = out / "solver"
        if sft_rows:
            steps = self.steps or max(1, -(-len(sft_rows) // self.batch_size))
            sft_cfg = OmegaConf.merge(cfg, {"output_dir": str(out), "data": {"prompt_prefix": "", "chat_template": False},
                                            "sft": {"steps": steps, "batch_size": self.batch_size, "lr": self.lr,
                                                    "warmup_steps": min(cfg.sft.warmup_steps, steps // 10)}})
            examples = [prompt_response_example(tok, r["prompt"], r["target"]) for r in sft_rows]
            report["sft"] = rt.fine_tune(sft_cfg, solver, str(solver_out), tok, examples)
            report["solver_accuracy_after"] = self._accuracy(rt, cfg, str(solver_out), eval_rows)
        else:
            say(f"{ctx.name}: no verified problem to train on; the solver stays as it was")
            report["solver_accuracy_after"] = report["solver_accuracy_before"]
            solver_out = Path(solver)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        ctx.summary[ctx.name] = report
        say(f"{ctx.name}: solver accuracy {report['solver_accuracy_before']:.3f} -> {report['solver_accuracy_after']:.3f} "
            f"({len(eval_rows)} held-out problems)")
        return {"proposals": str(out / "proposals.jsonl"), "solver_sft_set": str(set_path), "solver": str(solver_out)}

    def _propose(self, ctx: StageContext, cfg: Any, proposer: str, tok: Any) -> tuple[list[dict], dict[str, str]]:
        """`proposals` episodes of the proposer from the seed rows, scored by the recipe's reward; the episodes
        (written to proposals.jsonl) and the distinct valid problems with their answers."""
        from rl.data import load_rows
        rt = ctx.runtime
        seeds = load_rows(ctx.require(self.seeds), prompt_row_columns(cfg.data), f"stage {ctx.name} seeds")
        rows = [seeds[i % len(seeds)] for i in range(self.proposals)]
        workers = rt.start_rollout_workers(cfg, proposer)
        try:
            batch = rt.generate(workers, tok, cfg, rows, temperature=cfg.rollout.temperature, n=1,
                                seed=cfg.seed * 1_000_003 + self.seed)
        finally:
            rt.stop_actors(workers)
        episodes, problems = [], {}
        for response, s in zip(batch.responses, rt.score(batch)):
            final = parse_final(response)
            valid = bool(s.get("valid", False)) and final is not None
            episodes.append({"response": response, "valid": valid, "score": s["score"],
                             "components": s["components"]})
            if valid and final[0] not in problems:
                problems[final[0]] = final[1]
        (ctx.stage_dir / "proposals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in episodes))
        return episodes, problems

    def _solutions(self, judge: Any, problems: dict[str, str]) -> tuple[list[dict], int]:
        prompts = [self.solver_template.format(problem=p) for p in problems for _ in range(self.k)]
        said = judge.generate(prompts, seed=self.seed) if prompts else []
        return verified_solutions(problems, said, self.k, self.solver_template)

    def _eval_rows(self, ctx: StageContext) -> list[dict]:
        path = self.eval_data or ctx.artifact("solver_eval")
        if path is None:
            raise StageError(f"stage {ctx.name!r}: no held-out solver set: set params.eval_data to a JSONL of "
                             f"prompt/answer rows")
        rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        for i, r in enumerate(rows):
            if "prompt" not in r or "answer" not in r:
                raise StageError(f"stage {ctx.name!r}: {path} row {i} lacks prompt or answer")
        return rows[:self.eval_max]

    def _accuracy(self, rt: StageRuntime, cfg: Any, model: str, rows: list[dict]) -> float:
        """Greedy accuracy of `model` on `rows` (stated answers equivalent to the rows'), from a frozen engine actor."""
        jc = engine_actor_config(cfg, max_new_tokens=self.max_new_tokens, num_gpus=self.eval_num_gpus,
                                 chat_template=bool(cfg.data.chat_template))
        client = rt.start_judges({"solver": jc}, model)["solver"]
        try:
            said = client.generate([r["prompt"] for r in rows])
        finally:
            rt.stop_judges([client])
        return sum(equivalent(stated_answer(s), str(r["answer"])) for s, r in zip(said, rows)) / max(1, len(rows))


def verified_solutions(problems: dict[str, str], said: list[str], k: int, template: str) -> tuple[list[dict], int]:
    """Rejection sampling: per problem (in order, `k` samples each in `said`), the first sampled solution whose
    answer is the verified one becomes an SFT row; returns the rows and the number of problems without one."""
    rows, unsolved = [], 0
    for j, (problem, answer) in enumerate(problems.items()):
        found = [s for s in said[j * k:(j + 1) * k] if equivalent(stated_answer(s), answer)]
        if found:
            rows.append({"prompt": template.format(problem=problem), "target": found[0].strip(), "answer": answer})
        else:
            unsolved += 1
    return rows, unsolved

register_alias("stage", "proposer_solver_sft", "agentic_proposing")
