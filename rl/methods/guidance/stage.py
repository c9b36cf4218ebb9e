"""The `guidance` stage: citation quality and correctness of the policy's answers on the held-out prompts
(`data.eval_path` or the synthetic task's held-out split; `trainer.eval_max_prompts` of them), per arm:

* `plain`: greedy answers as the model writes them (its own citations, if it makes any);
* `post_hoc`: the plain answers with citations removed, each sentence then cited with its best-overlapping chunk;
* `guidance`: greedy decoding with `guidance` (`rl.methods.guidance.core`, `rl.methods.guidance.decoding`; `guidance_params`).

Scores (`rl.methods.guidance.core.score_citations`, LongBench-Cite): citation recall, precision and F1 per answer,
averaged per dataset (the row's `dataset_column`; one dataset without it) and then over the datasets that are not
excluded (LongBench-Cite leaves out MultiFieldQA-en/zh, `dataset_means`);
correctness = the recipe's training reward on the answer with citations stripped (e.g. `fact_numbers`, or at real
scale `judge_correctness`, a judge's rating against the reference as LongBench-Cite scores it), averaged per
dataset like the citation scores; with `no_citation_column` (the held-out rows' prompt without the citation
instruction) the model also answers plainly without citations, and each arm's correctness ratio is its
correctness over that one (LongBench-Cite's CR). The citation judge: `containment` (deterministic; CPU tests and
the synthetic task) or the name of a `reward.judges` entry (a frozen engine asked LongBench-Cite's questions). The
report is `stages/<name>/guidance.json` with the first answers of each arm.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from rl.config import as_container
from rl.data import prompt_row_columns
from rl.methods.guidance.core import (
    LONGBENCH_CITE_EXCLUDED,
    ContainmentJudge,
    LLMCitationJudge,
    dataset_means,
    post_hoc_cite,
    score_citations,
    strip_citations,
)
from rl.registry import register, register_alias
from rl.stages import Stage, StageContext, StageError, say, stage_cfg

ARMS = ("plain", "post_hoc", "guidance")


@register("stage", "guidance")
class GuidanceStage(Stage):
    reads, publishes = ("base_model", "policy"), ("cite_report",)  # checked against the recipe's order
    config_keys = ("data", "rollout", "trainer.eval_max_prompts", "reward")
    runs_in_driver = True

    def __init__(self, arms: list[str] = ARMS, guidance_params: dict[str, Any] | None = None,
                 judge: str = "containment", max_statements: int = 40, examples: int = 3,
                 dataset_column: str | None = None, exclude_datasets: list[str] = LONGBENCH_CITE_EXCLUDED,
                 no_citation_column: str | None = None):
        """`arms`: of plain, post_hoc, guidance; `guidance_params`: of the guidance decoding method;
        `judge`: containment | a name in `reward.judges`; `max_statements` scored per answer (LongBench-Cite: 40);
        `dataset_column`: the held-out rows' column naming their dataset (null: one dataset); `exclude_datasets`:
        left out of the headline average (LongBench-Cite's: multifieldqa_en, multifieldqa_zh);
        `no_citation_column`: the rows' prompt without the citation instruction (null: no correctness ratio)."""
        bad = [a for a in arms if a not in ARMS]
        if bad or not arms:
            raise ValueError(f"guidance: arms must be among {list(ARMS)}, got {list(arms)}")
        self.arms, self.guidance_params = list(arms), dict(guidance_params or {})
        self.judge, self.max_statements, self.examples = judge, max_statements, examples
        self.dataset_column, self.exclude_datasets = dataset_column, list(exclude_datasets)
        self.no_citation_column = no_citation_column

    def run(self, ctx: StageContext) -> dict[str, str]:
        from models.tokenizer import load_tokenizer
        cfg, rt = stage_cfg(ctx), ctx.runtime
        columns = prompt_row_columns(cfg.data)
        extra = [c for c in (self.dataset_column, self.no_citation_column) if c and c not in columns]
        rows = ctx.rows("eval", columns + extra)
        rows = rows[:cfg.trainer.eval_max_prompts]
        if not rows:
            raise StageError(f"{ctx.name}: no held-out prompts (data.eval_path or a synthetic task's eval split)")
        if cfg.rollout.engine != "hf" and "guidance" in self.arms:
            raise StageError(f"{ctx.name}: the guidance arm decodes with the `guidance` decoding method, which the "
                             f"{cfg.rollout.engine!r} engine cannot serve: set rollout.engine: hf")
        judge, clients = self._judge(ctx, cfg)
        tokenizer = load_tokenizer(ctx.require("base_model"))
        report: dict[str, Any] = {"prompts": len(rows), "judge": self.judge, "arms": {}}
        try:
            answers = self._answers(ctx, cfg, rows, tokenizer)
            for arm in self.arms:
                report["arms"][arm] = self._score_arm(rt, cfg, rows, answers[arm], judge)
            if self.no_citation_column:
                self._correctness_ratios(ctx, cfg, rows, tokenizer, report)
        finally:
            rt.stop_judges(clients)
        path = ctx.stage_dir / "guidance.json"
        path.write_text(json.dumps(report, indent=1))
        ctx.summary[ctx.name] = {arm: {k: v for k, v in r.items() if k != "examples"}
                                 for arm, r in report["arms"].items()}
        for arm, r in report["arms"].items():
            say(f"{ctx.name}: {arm}: citation F1 {r['f1']:.3f} (recall {r['recall']:.3f}, precision "
                f"{r['precision']:.3f}), correctness {r['correctness']}")
        return {"cite_report": str(path)}

    def _judge(self, ctx: StageContext, cfg: Any) -> tuple[Any, dict[str, Any]]:
        """The citation judge: containment, or a `reward.judges` entry served by judge actors (their clients
        are returned to be stopped)."""
        if self.judge == "containment":
            return ContainmentJudge(), {}
        if self.judge not in cfg.reward.judges:
            raise StageError(f"{ctx.name}: judge {self.judge!r} is neither 'containment' nor a reward.judges "
                             f"entry ({sorted(cfg.reward.judges)})")
        clients = ctx.runtime.start_judges({self.judge: as_container(cfg.reward.judges[self.judge])},
                                           ctx.require("policy"))
        return LLMCitationJudge(lambda prompts: clients[self.judge].generate(prompts, temperature=0.0)), clients

    def _answers(self, ctx: StageContext, cfg: Any, rows: list[dict], tokenizer: Any) -> dict[str, list[str]]:
        """Greedy answers per arm: plain decoding, Guidance, and post-hoc citation of the plain answers."""
        from omegaconf import OmegaConf
        rt, answers = ctx.runtime, {}
        decodings = {"plain": (None, {}), "guidance": ("guidance", self.guidance_params)}
        with rt.rollout_workers(ctx, cfg) as workers:
            for arm in [a for a in ("plain", "guidance") if a in self.arms or (a == "plain" and "post_hoc" in self.arms)]:
                name, params = decodings[arm]
                arm_cfg = OmegaConf.merge(cfg, {"rollout": {"eval_decoding": name, "eval_decoding_params": params,
                                                            "eval_runs": 1}})
                batch = rt.generate(workers, tokenizer, arm_cfg, rows, temperature=0.0, n=1, seed=0, evaluation=True)
                answers[arm] = list(batch.responses)
                if arm == "plain" and "post_hoc" in self.arms:
                    answers["post_hoc"] = [post_hoc_cite(strip_citations(a), r[cfg.data.prompt_column])
                                           for a, r in zip(batch.responses, rows)]
        return answers

    def _score_arm(self, rt: Any, cfg: Any, rows: list[dict], answers: list[str], judge: Any) -> dict[str, Any]:
        """LongBench-Cite recall, precision and F1 of an arm's answers, and their correctness under the recipe's
        reward with the citations stripped."""
        scores = [score_citations(a, r[cfg.data.prompt_column], judge, self.max_statements)
                  for a, r in zip(answers, rows)]
        return {**dataset_means(scores, self._datasets(rows), self.exclude_datasets),
                "correctness": self._correctness(rt, cfg, rows, answers), "examples": answers[:self.examples]}

    def _datasets(self, rows: list[dict]) -> list[str]:
        return [str(r[self.dataset_column]) if self.dataset_column else "all" for r in rows]

    def _correctness(self, rt: Any, cfg: Any, rows: list[dict], answers: list[str]) -> float | None:
        """The recipe's reward on the answers with citations stripped, averaged per dataset and then over the
        datasets that are not excluded (as the citation scores)."""
        items = [{"prompt": r[cfg.data.prompt_column], "response": strip_citations(a),
                  "ground_truth": r.get(cfg.data.answer_column), "metadata": {}, "truncated": False}
                 for a, r in zip(answers, rows)]
        scored = rt.score_items(items, evaluation=True)
        kept = [(s["score"], d) for s, d in zip(scored, self._datasets(rows)) if not s["failed"]]
        if not kept:
            return None
        by: dict[str, list[float]] = {}
        for score, d in kept:
            by.setdefault(d, []).append(score)
        means = [statistics.mean(v) for d, v in by.items() if d not in self.exclude_datasets] or \
            [statistics.mean(v) for v in by.values()]
        return statistics.mean(means)

    def _correctness_ratios(self, ctx: StageContext, cfg: Any, rows: list[dict], tokenizer: Any,
                            report: dict[str, Any]) -> None:
        """Plain answers to the prompts without the citation instruction, their correctness, and each arm's
        correctness over it (LongBench-Cite's correctness ratio)."""
        from omegaconf import OmegaConf
        plain_rows = [{**r, cfg.data.prompt_column: r[self.no_citation_column]} for r in rows]
        arm_cfg = OmegaConf.merge(cfg, {"rollout": {"eval_decoding": None, "eval_decoding_params": {},
                                                    "eval_runs": 1}})
        with ctx.runtime.rollout_workers(ctx, cfg) as workers:
            batch = ctx.runtime.generate(workers, tokenizer, arm_cfg, plain_rows, temperature=0.0, n=1, seed=0,
                                         evaluation=True)
        base = self._correctness(ctx.runtime, cfg, plain_rows, list(batch.responses))
        report["no_citation_correctness"] = base
        for r in report["arms"].values():
            r["correctness_ratio"] = r["correctness"] / base if base and r["correctness"] is not None else None


register_alias("stage", "cite_eval", "guidance")
