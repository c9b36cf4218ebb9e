"""`looprl eval`: the evaluation protocol of `rl.evaluate` (mean@k, paired comparison, per-loop accuracy) on
model folders, in-process. The recipe's `evaluate` stage runs the same protocol on the run's policy.

    looprl eval MODEL --data math500.jsonl [--compare OTHER_MODEL] [--runs 10] [--loops 1 2 3 4] [--out F]

Problems come from a local JSONL / Parquet / CSV file or `load_from_disk` folder (MATH-500, AIME-style:
a problem and an answer column). Each of `runs` independent sampled runs (the RLTT paper's protocol:
temperature 0.2, top-p 0.95, 10 runs, a distinct seed per run) answers every problem once; answers are
scored by the reward registry (`math`: math-verify, in worker processes). Reported:

- mean@k: accuracy averaged over the k runs (and its spread over runs);
- a paired comparison between two checkpoints on the same problems: mean difference of per-problem
  accuracy and the paired t-test p-value (scipy's `ttest_rel`);
- per-loop accuracy for looped models (`--loops`): greedy decoding read out after loop t
  (`exit_at_step`), one run each, as in the RLTT per-loop analysis.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rl.evaluate import mean_at_k, paired_comparison, per_loop_accuracy, protocol_scores


@dataclass
class MathEvalConfig:
    runs: int = 10  # independent sampled runs per problem (mean@k over them)
    temperature: float = 0.2  # sampling temperature of the runs (RLTT protocol)
    top_p: float = 0.95  # nucleus sampling of the runs
    max_new_tokens: int = 2048  # completion cap
    seed: int = 0  # run r uses seed + r
    problem_column: str = "problem"  # column holding the problem text
    answer_column: str = "answer"  # column holding the ground truth
    prompt_prefix: str = ""  # text placed before every problem
    chat_template: bool = False  # wrap problems with the tokenizer's chat template
    max_problems: int | None = None  # first N problems only
    reward: str = "math"  # reward registry spec scoring an answer (1 = correct)
    reward_params: dict[str, Any] = field(default_factory=dict)  # its keyword arguments
    batch_size: int = 64  # prompts per generate call
    device: str = "auto"  # cpu | cuda | auto
    dtype: str = "auto"  # float32 | bfloat16 | auto (bfloat16 on GPU, float32 on CPU)


class MathEvaluator:
    """One checkpoint on one problem set: an in-process hf engine and a reward service."""

    def __init__(self, model_path: str, cfg: MathEvalConfig, data_path: str):
        import torch

        from rewards.service import RewardService, RewardSpec
        from rl.data import format_prompt, load_rows
        from rollout.hf_engine import HFEngine
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        self.cfg = cfg
        self.engine = HFEngine(model_path, dtype=dtype, device=device, batch_size=cfg.batch_size)
        rows = load_rows(data_path, [cfg.problem_column, cfg.answer_column], "eval --data")
        rows = rows[: cfg.max_problems] if cfg.max_problems else rows
        self.prompts = [format_prompt(r[cfg.problem_column], self.engine.tokenizer, cfg.prompt_prefix,
                                      cfg.chat_template) for r in rows]
        self.answers = [str(r[cfg.answer_column]) for r in rows]
        self.rewards = RewardService([RewardSpec(cfg.reward, 1.0, dict(cfg.reward_params))], num_workers=2)
        self.last_responses: list[str] = []

    def generate(self, *, temperature: float, top_p: float, seed: int, exit_at_step: int | None = None) -> Any:
        """One answer per problem (a `Batch`)."""
        from rollout.base import SamplingParams
        sp = SamplingParams(n=1, temperature=temperature, top_p=top_p, max_new_tokens=self.cfg.max_new_tokens,
                            seed=seed, exit_at_step=exit_at_step)
        batch = self.engine.generate(self.prompts, sp, ground_truth=self.answers)
        self.last_responses = list(batch.responses)
        return batch

    def score(self, batch: Any) -> list[float]:
        scored = self.rewards.score([{"prompt": p, "response": r, "ground_truth": g, "metadata": {}}
                                     for p, r, g in zip(batch.prompts, batch.responses, batch.ground_truth)])
        return [s["score"] for s in scored]

    def run(self, *, temperature: float, top_p: float, seed: int, exit_at_step: int | None = None) -> np.ndarray:
        """Score of every problem for one run, `[problems]`."""
        return protocol_scores(self.generate, self.score, runs=1, temperature=temperature, top_p=top_p, seed=seed,
                               exit_at_step=exit_at_step)[0]

    def sampled_runs(self) -> np.ndarray:
        """`[runs, problems]` scores of the protocol's sampled runs."""
        c = self.cfg
        return protocol_scores(self.generate, self.score, runs=c.runs, temperature=c.temperature, top_p=c.top_p,
                               seed=c.seed)

    def per_loop(self, loops: list[int]) -> dict[str, float]:
        """Greedy accuracy read out after each loop t in `loops` (looped models only)."""
        if not hasattr(self.engine.model, "loop_states"):
            raise ValueError("--loops needs a looped model (model_type ouro)")
        return per_loop_accuracy(self.generate, self.score, loops, seed=self.cfg.seed)

    def close(self) -> None:
        self.rewards.close()


def evaluate_math(model_path: str, data_path: str, cfg: MathEvalConfig, *, compare: str | None = None,
                  loops: list[int] | None = None) -> dict[str, Any]:
    """mean@k of `model_path` (and of `compare` with the paired test), per-loop accuracy if `loops`."""
    report: dict[str, Any] = {"model": model_path, "data": data_path, "config": asdict(cfg)}
    scores = {}
    for name, path in [("model", model_path)] + ([("compare", compare)] if compare else []):
        ev = MathEvaluator(path, cfg, data_path)
        try:
            scores[name] = ev.sampled_runs()
            report[f"{name}_mean_at_k"] = mean_at_k(scores[name])
            if loops:
                report[f"{name}_per_loop_accuracy"] = ev.per_loop(loops)
        finally:
            ev.close()
    if compare:
        report["compare"] = compare
        report["paired"] = paired_comparison(scores["model"], scores["compare"])
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="looprl eval", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="HF model folder to evaluate")
    p.add_argument("--data", required=True, help="problems: JSONL/Parquet/CSV file or load_from_disk folder")
    p.add_argument("--compare", help="a second model folder: paired comparison on the same problems")
    p.add_argument("--loops", type=int, nargs="*", help="looped models: greedy accuracy read out after each loop")
    p.add_argument("--out", help="write the report here (JSON); printed either way")
    from rl.config import field_docs
    docs = field_docs(MathEvalConfig)
    for f in MathEvalConfig.__dataclass_fields__.values():
        if f.name == "reward_params":
            p.add_argument("--reward-params", type=json.loads, default={}, help="JSON keyword arguments of --reward")
            continue
        default = f.default
        kind = {"bool": bool, "int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, action="store_true", default=default, help=docs[f.name])
        elif f.name == "max_problems":
            p.add_argument(flag, type=int, default=None, help=docs[f.name])
        else:
            p.add_argument(flag, type=kind, default=default, help=f"{docs[f.name]} (default {default})")
    args = p.parse_args(argv)
    cfg = MathEvalConfig(**{k: getattr(args, k) for k in MathEvalConfig.__dataclass_fields__})
    report = evaluate_math(args.model, args.data, cfg, compare=args.compare, loops=args.loops)
    text = json.dumps(report, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0
