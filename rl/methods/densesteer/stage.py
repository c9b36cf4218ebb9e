"""The `densesteer` stage: DenseSteer's steering vectors for the current policy (`rl.methods.densesteer.core`; rl/methods/densesteer/README.md, confirmed from the released code).

Reads a pair file of JSONL rows `{prompt, dense, sparse}` (`pairs`, or the `steer_pairs` artifact a synthetic task
publishes, e.g. `data.synthetic.task: densesteer`), takes the first `max_pairs` (the paper: 50 of the model's own
correct solutions with their dense rewrites), and in a Ray task in the run's first learner bundle computes, for
each chosen layer, the mean difference of the decoder block's output at the last token of `prompt + dense` and
`prompt + sparse` (with `chat_template`, of a user turn and an assistant turn).

Artifacts: `steering_vectors` (`steering_vectors.pt`, `{layer: vector}`: what decoding `steer` reads through
`rollout.decoding_params.vectors` or `rollout.eval_decoding_params.vectors`, e.g.
`${output_dir}/stages/densesteer/steering_vectors.pt`) and `steering_report` (JSON: pairs used, each layer's
vector norm and the mean norm of the block's output at the last token, the scale λ multiplies).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl.data import prompt_row_columns
from rl.registry import register, register_alias
from rl.stages import Stage, StageContext, StageError, say


def read_pairs(path: str, max_pairs: int) -> list[dict[str, str]]:
    """The first `max_pairs` rows of a JSONL pair file; a row without a non-empty prompt, dense and sparse text
    fails naming the file and the line."""
    if not Path(path).exists():
        raise StageError(f"densesteer: pair file {path!r} does not exist")
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise StageError(f"densesteer: {path}:{n}: not JSON ({e})") from None
        missing = [k for k in ("prompt", "dense", "sparse") if not isinstance(row.get(k), str) or not row[k]]
        if missing:
            raise StageError(f"densesteer: {path}:{n}: the row needs non-empty text in {missing}")
        rows.append(row)
        if len(rows) == max_pairs:
            break
    if not rows:
        raise StageError(f"densesteer: pair file {path!r} has no rows")
    return rows


def extract_in_task(model_path: str, pairs: list[dict[str, str]], layers: list[int] | None, chat_template: bool,
                    batch_size: int, dtype: str, trust_remote_code: bool) -> tuple[dict[int, Any], dict[str, Any]]:
    """Load the policy and extract its vectors; returns them (CPU tensors) and the report."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.blocks import decoder_layers
    from models.tokenizer import load_tokenizer
    from rl.methods.densesteer.core import last_token_states, mean_difference
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code).to(device).eval()
    tokenizer = load_tokenizer(model_path)
    n_layers = len(decoder_layers(model))
    chosen = list(range(n_layers)) if layers is None else [int(x) for x in layers]
    bad = [x for x in chosen if not 0 <= x < n_layers]
    if bad:
        raise ValueError(f"densesteer: layers {bad} are not among the model's {n_layers} decoder blocks")
    prompts = [r["prompt"] for r in pairs]
    dense_states, sparse_states = (last_token_states(model, tokenizer, prompts, [r[k] for r in pairs], chosen,
                                                     chat_template=chat_template, batch_size=batch_size)
                                   for k in ("dense", "sparse"))
    vectors = mean_difference(dense_states, sparse_states)
    report = {"pairs": len(pairs), "layers": chosen, "num_layers": n_layers,
              "vector_norm": {str(k): float(v.norm()) for k, v in vectors.items()},
              "hidden_norm": {str(k): float(sparse_states[k].norm(dim=-1).mean()) for k in chosen}}
    return vectors, report


@register("stage", "densesteer")
class DenseSteerStage(Stage):
    reads, publishes = ("base_model", "policy"), ("steering_vectors", "steering_report")  # checked against the recipe's order
    config_keys = ("seed", "model", "data", "rollout", "reward")
    runs_in_driver = True

    def __init__(self, pairs: str | None = None, max_pairs: int = 50, layers: list[int] | None = None,
                 chat_template: bool = False, batch_size: int = 16, num_gpus: float = 0.0,
                 select: dict[str, Any] | None = None):
        """`pairs`: JSONL of {prompt, dense, sparse} (none: the `steer_pairs` artifact); `max_pairs`: pairs used
        (the paper's N = 50); `layers`: decoder blocks (0-based) to extract for (none: all); `chat_template`: wrap
        each text as a user and an assistant turn; `num_gpus`: of the extraction task; `select`: choose the layer
        and strength on held-out training problems as the paper does ({layers, strengths, num_problems,
        tolerance}: greedy answers to the first `num_problems` prompts of the training split, unsteered and at
        each layer × strength; the densest whose reward accuracy is within `tolerance` of the unsteered one),
        written to the report's `selected` (decoding `steer` reads it through `selection`)."""
        if max_pairs < 1:
            raise ValueError(f"max_pairs must be >= 1, got {max_pairs}")
        select = dict(select or {})
        unknown = sorted(set(select) - {"layers", "strengths", "num_problems", "tolerance"})
        if unknown:
            raise ValueError(f"densesteer: select has no keys {unknown} (layers, strengths, num_problems, "
                             f"tolerance)")
        if select and (not select.get("layers") or not select.get("strengths")):
            raise ValueError("densesteer: select needs non-empty layers and strengths")
        self.select = select
        self.pairs, self.max_pairs = pairs, max_pairs
        self.layers = None if layers is None else [int(x) for x in layers]
        self.chat_template, self.batch_size, self.num_gpus = chat_template, batch_size, num_gpus

    def input_files(self, cfg: Any) -> list[str | None]:
        return [self.pairs]

    def _select(self, ctx: StageContext, vectors: str) -> dict[str, Any]:
        """Greedy answers to held-out training prompts, unsteered and at each candidate; accuracy by the recipe's
        reward, density ρ by `rl.methods.densesteer.core.density`; `rl.methods.densesteer.core.select_steering` picks."""
        import statistics

        from omegaconf import OmegaConf

        from models.tokenizer import load_tokenizer
        from rl.methods.densesteer.core import density, select_steering
        cfg, rt = ctx.cfg, ctx.runtime
        rows = ctx.rows("train", prompt_row_columns(cfg.data))[:int(self.select.get("num_problems", 50))]
        if not rows:
            raise StageError(f"{ctx.name}: select needs training prompts (data.train_path or a synthetic task)")
        tokenizer = load_tokenizer(ctx.require("base_model"))
        arms = [(int(self.select["layers"][0]), 0.0)] + [(int(layer), float(lam)) for layer in self.select["layers"]
                                                        for lam in self.select["strengths"] if float(lam) != 0.0]
        candidates = []
        min_index = int((cfg.rollout.eval_decoding_params or {}).get("min_token_index", 0)) \
            if cfg.rollout.eval_decoding in ("densesteer", "steer") else 0
        with rt.rollout_workers(ctx, cfg) as workers:
            for layer, lam in arms:
                arm_cfg = OmegaConf.merge(cfg, {"rollout": {"eval_decoding": "densesteer", "eval_runs": 1}})
                # replaced, not merged: a `selection` in the recipe's parameters would override the candidate
                arm_cfg.rollout.eval_decoding_params = {"vectors": vectors, "layer": layer, "strength": lam,
                                                        "min_token_index": min_index}
                batch = rt.generate(workers, tokenizer, arm_cfg, rows, temperature=0.0, n=1, seed=0, evaluation=True)
                scored = rt.score(batch, evaluation=True)
                candidates.append({
                    "layer": layer, "strength": lam,
                    "rho": statistics.mean(density(t)["rho"] for t in batch.responses),
                    "accuracy": statistics.mean(float(s["score"] > 0) for s in scored if not s["failed"])})
                say(f"{ctx.name}: select L{layer} λ={lam:g}: ρ {candidates[-1]['rho']:.2f}, accuracy "
                    f"{candidates[-1]['accuracy']:.3f}")
        chosen = select_steering(candidates, float(self.select.get("tolerance", 0.0)))
        say(f"{ctx.name}: selected layer {chosen['layer']}, strength {chosen['strength']:g} on {len(rows)} held-out "
            f"training problems")
        return {"problems": len(rows), "candidates": candidates, "selected": chosen}

    def run(self, ctx: StageContext) -> dict[str, str]:
        import torch

        path = self.pairs or ctx.artifact("steer_pairs")
        if path is None:
            raise StageError(f"{ctx.name}: no pair file: set params.pairs (JSONL of prompt, dense, sparse) or use a "
                             f"synthetic task that publishes steer_pairs (data.synthetic.task: densesteer)")
        pairs = read_pairs(path, self.max_pairs)
        cfg, policy = ctx.cfg, ctx.require("policy")
        say(f"{ctx.name}: steering vectors from {len(pairs)} (dense, sparse) pairs of {path}")
        vectors, report = ctx.runtime.run_task(extract_in_task, policy, pairs, self.layers, self.chat_template,
                                               self.batch_size, cfg.model.dtype, cfg.model.trust_remote_code,
                                               num_gpus=self.num_gpus)
        out = ctx.stage_dir
        torch.save({int(k): v.contiguous() for k, v in vectors.items()}, out / "steering_vectors.pt")
        report["pair_file"] = path
        ctx.summary[ctx.name] = {"pairs": report["pairs"], "vector_norm": report["vector_norm"]}
        say(f"{ctx.name}: vector norms " + ", ".join(f"L{k} {v:.2f}" for k, v in report["vector_norm"].items()))
        if self.select:
            bad = [x for x in self.select["layers"] if int(x) not in vectors]
            if bad:
                raise StageError(f"{ctx.name}: select.layers {bad} were not extracted (layers: {report['layers']})")
            report["selection"] = self._select(ctx, str(out / "steering_vectors.pt"))
            report["selected"] = {k: report["selection"]["selected"][k] for k in ("layer", "strength")}
            ctx.summary[ctx.name]["selected"] = report["selected"]
        (out / "steering_report.json").write_text(json.dumps(report, indent=1))
        return {"steering_vectors": str(out / "steering_vectors.pt"), "steering_report": str(out / "steering_report.json")}

register_alias("stage", "steer_extract", "densesteer")
