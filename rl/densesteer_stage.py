"""The `steer_extract` stage: DenseSteer's steering vectors for the current policy (`rl.densesteer`; shared/specs/
stages.md §10, confirmed from the released code).

Reads a pair file of JSONL rows `{prompt, dense, sparse}` (`pairs`, or the `steer_pairs` artifact a synthetic task
publishes, e.g. `data.synthetic.task: styles`), takes the first `max_pairs` (the paper: 50 of the model's own
correct solutions with their dense rewrites), and in a Ray task in the run's first learner bundle computes, for
each chosen layer, the mean difference of the decoder block's output at the last token of `prompt + dense` and
`prompt + sparse` (with `chat_template`, of a user turn and an assistant turn).

Artifacts: `steering_vectors` (`steering_vectors.pt`, `{layer: vector}`: what decoding `steer` reads through
`rollout.decoding_params.vectors` or `rollout.eval_decoding_params.vectors`, e.g.
`${output_dir}/stages/steer_extract/steering_vectors.pt`) and `steering_report` (JSON: pairs used, each layer's
vector norm and the mean norm of the block's output at the last token, the scale λ multiplies).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl.registry import register
from rl.stages import Stage, StageContext, StageError, say


def read_pairs(path: str, max_pairs: int) -> list[dict[str, str]]:
    """The first `max_pairs` rows of a JSONL pair file; a row without a non-empty prompt, dense and sparse text
    fails naming the file and the line."""
    if not Path(path).exists():
        raise StageError(f"steer_extract: pair file {path!r} does not exist")
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise StageError(f"steer_extract: {path}:{n}: not JSON ({e})") from None
        missing = [k for k in ("prompt", "dense", "sparse") if not isinstance(row.get(k), str) or not row[k]]
        if missing:
            raise StageError(f"steer_extract: {path}:{n}: the row needs non-empty text in {missing}")
        rows.append(row)
        if len(rows) == max_pairs:
            break
    if not rows:
        raise StageError(f"steer_extract: pair file {path!r} has no rows")
    return rows


def extract_in_task(model_path: str, pairs: list[dict[str, str]], layers: list[int] | None, chat_template: bool,
                    batch_size: int, dtype: str, trust_remote_code: bool) -> tuple[dict[int, Any], dict[str, Any]]:
    """Load the policy and extract its vectors; returns them (CPU tensors) and the report."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.blocks import decoder_layers
    from rl.densesteer import last_token_states, mean_difference
    from rollout.base import load_tokenizer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code).to(device).eval()
    tokenizer = load_tokenizer(model_path)
    n_layers = len(decoder_layers(model))
    chosen = list(range(n_layers)) if layers is None else [int(x) for x in layers]
    bad = [x for x in chosen if not 0 <= x < n_layers]
    if bad:
        raise ValueError(f"steer_extract: layers {bad} are not among the model's {n_layers} decoder blocks")
    prompts = [r["prompt"] for r in pairs]
    dense_states, sparse_states = (last_token_states(model, tokenizer, prompts, [r[k] for r in pairs], chosen,
                                                     chat_template=chat_template, batch_size=batch_size)
                                   for k in ("dense", "sparse"))
    vectors = mean_difference(dense_states, sparse_states)
    report = {"pairs": len(pairs), "layers": chosen, "num_layers": n_layers,
              "vector_norm": {str(k): float(v.norm()) for k, v in vectors.items()},
              "hidden_norm": {str(k): float(sparse_states[k].norm(dim=-1).mean()) for k in chosen}}
    return vectors, report


@register("stage", "steer_extract")
class SteerExtractStage(Stage):
    config_keys = ("seed", "model", "data")
    runs_in_driver = True

    def __init__(self, pairs: str | None = None, max_pairs: int = 50, layers: list[int] | None = None,
                 chat_template: bool = False, batch_size: int = 16, num_gpus: float = 0.0):
        """`pairs`: JSONL of {prompt, dense, sparse} (none: the `steer_pairs` artifact); `max_pairs`: pairs used
        (the paper's N = 50); `layers`: decoder blocks (0-based) to extract for (none: all); `chat_template`: wrap
        each text as a user and an assistant turn; `num_gpus`: of the extraction task."""
        if max_pairs < 1:
            raise ValueError(f"max_pairs must be >= 1, got {max_pairs}")
        self.pairs, self.max_pairs = pairs, max_pairs
        self.layers = None if layers is None else [int(x) for x in layers]
        self.chat_template, self.batch_size, self.num_gpus = chat_template, batch_size, num_gpus

    def input_files(self, cfg: Any) -> list[str | None]:
        return [self.pairs]

    def run(self, ctx: StageContext) -> dict[str, str]:
        import ray
        import torch

        from cluster.ray_utils import bundle_options
        path = self.pairs or ctx.artifact("steer_pairs")
        if path is None:
            raise StageError(f"{ctx.name}: no pair file: set params.pairs (JSONL of prompt, dense, sparse) or use a "
                             f"synthetic task that publishes steer_pairs (data.synthetic.task: styles)")
        pairs = read_pairs(path, self.max_pairs)
        cfg, policy = ctx.cfg, ctx.require("policy")
        task = ray.remote(extract_in_task).options(**bundle_options(ctx.runtime.placement, 0, self.num_gpus))
        say(f"{ctx.name}: steering vectors from {len(pairs)} (dense, sparse) pairs of {path}")
        vectors, report = ray.get(task.remote(policy, pairs, self.layers, self.chat_template, self.batch_size,
                                              cfg.model.dtype, cfg.model.trust_remote_code))
        out = ctx.stage_dir
        torch.save({int(k): v.contiguous() for k, v in vectors.items()}, out / "steering_vectors.pt")
        report["pair_file"] = path
        (out / "steering_report.json").write_text(json.dumps(report, indent=1))
        ctx.summary[ctx.name] = {"pairs": report["pairs"], "vector_norm": report["vector_norm"]}
        say(f"{ctx.name}: vector norms " + ", ".join(f"L{k} {v:.2f}" for k, v in report["vector_norm"].items()))
        return {"steering_vectors": str(out / "steering_vectors.pt"), "steering_report": str(out / "steering_report.json")}
