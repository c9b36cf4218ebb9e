"""The `decomper` stage: Decomper low-rank compression of the policy with drift compensation (`rl.methods.decomper.core`;
rl/methods/decomper/README.md, confirmed structure with [RECONSTRUCTION]-marked details, see that module).

Calibration and held-out sequences are the SFT data's token sequences (prompt and response, up to `calib_length`
tokens): `calib_sequences` of them, seeded, and `heldout_sequences` others. A Ray task in the run's first learner
bundle loads the policy, collects each projection's input statistics, factorizes every projection at `ratio`
(`method`: whitened or plain SVD), measures the per-block drift uncompensated, then applies `compensation` (none,
closed_form b* = (W − W′)E[x], or learned: started at b* or zero and fitted block by block), measures the drift again,
and saves the model with every projection stored as its factors and bias (`models.lowrank`: the learner and the `hf`
engine load such a folder; vLLM refuses it, naming why).

Artifacts: `policy` (the compressed model, which the stages after it train or serve) and `compression_report`
(JSON: per layer rank and parameters, per block drift before and after compensation, held-out token KL to the
original and both perplexities).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rl.batch import pad_token_rows
from rl.registry import register, register_alias
from rl.stages import Stage, StageContext, StageError, policy_sft_data, say


def _batches(sequences: list[list[int]], pad_id: int, batch_size: int) -> list[dict]:
    """Right-padded batches of `batch_size` token sequences."""
    out = []
    for i in range(0, len(sequences), batch_size):
        ids, mask = pad_token_rows(sequences[i:i + batch_size], pad_id, "right")
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def compress_model(model_path: str, out_dir: str, calib: list[list[int]], held: list[list[int]], pad_id: int, *,
                   ratio: float, method: str, compensation: str, learn_init: str, lr: float, epochs: int,
                   batch_size: int, eps: float, dtype: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """Compress the model at `model_path` into `out_dir` (model and tokenizer); returns the report."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from models.blocks import decoder_layers
    from models.lowrank import save_low_rank
    from models.tokenizer import load_tokenizer
    from rl.methods.decomper.core import (
        block_drift,
        closed_form_bias,
        compress,
        input_stats,
        learn_biases,
        target_linears,
        token_kl_and_nll,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    original = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                    trust_remote_code=trust_remote_code).to(device).eval()
    calib_batches = [{k: v.to(device) for k, v in b.items()} for b in _batches(calib, pad_id, batch_size)]
    held_batches = [{k: v.to(device) for k, v in b.items()} for b in _batches(held, pad_id, batch_size)]
    model = copy.deepcopy(original)
    # block by block: one block's input statistics in memory at a time (XᵀX of a wide projection is large)
    layers, means = {}, {}
    for j in range(len(decoder_layers(original))):
        stats = input_stats(original, calib_batches, block=j)
        layers |= compress(model, stats, ratio, method, "none", eps)
        means |= {name: st.mean for name, st in stats.items()}
        del stats
    report: dict[str, Any] = {"ratio": ratio, "method": method, "compensation": compensation, "layers": layers,
                              "dense_params": sum(v["dense_params"] for v in layers.values()),
                              "factor_params": sum(v["factor_params"] for v in layers.values()),
                              "drift_uncompensated": block_drift(original, model, held_batches),
                              "heldout_uncompensated": token_kl_and_nll(original, model, held_batches)}
    if compensation in ("closed_form", "learned") and not (compensation == "learned" and learn_init == "zero"):
        originals = target_linears(original)
        with torch.no_grad():
            for name, mod in target_linears(model).items():
                mod.bias.add_(closed_form_bias(originals[name].weight, mod.weight, means[name]).to(mod.bias.dtype))
    if compensation == "learned":
        report["learned"] = learn_biases(original, model, calib_batches, lr=lr, epochs=epochs,
                                         log=lambda j, a, b: say(f"decomper: block {j} mse {a:.3g} -> {b:.3g}"))
    report["drift"] = block_drift(original, model, held_batches)
    report["heldout"] = token_kl_and_nll(original, model, held_batches)
    for p in model.parameters():
        p.requires_grad_(True)
    save_low_rank(model.cpu(), out_dir)
    load_tokenizer(model_path).save_pretrained(out_dir)
    report["size"] = {"params_original": sum(p.numel() for p in original.parameters()),
                      "params_compressed": sum(p.numel() for p in model.parameters()),
                      "bytes_original": safetensors_bytes(model_path), "bytes_compressed": safetensors_bytes(out_dir)}
    return report


def safetensors_bytes(folder: str) -> int:
    """Bytes of a model folder's weight files on disk."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


@register("stage", "decomper")
class DecomperStage(Stage):
    reads, publishes = ("policy",), ("policy", "compression_report")  # checked against the recipe's order
    config_keys = ("seed", "model", "data", "sft.max_length", "sft.format", "sft.messages_column", "sft.bad_rows")
    runs_in_driver = True

    def __init__(self, ratio: float = 0.4, method: str = "whitened", compensation: str = "learned",
                 learn_init: str = "closed_form", calib_sequences: int = 32, calib_length: int = 128,
                 heldout_sequences: int = 32, batch_size: int = 8, lr: float = 1e-3, epochs: int = 2,
                 eps: float = 1e-6, num_gpus: float = 0.0):
        """`ratio`: share of each projection's parameters removed; `method`: whitened (SVD-LLM) | plain SVD;
        `compensation`: none | closed_form | learned; `learn_init`: closed_form | zero (where the learned bias
        starts); `calib_sequences` × `calib_length` tokens calibrate, `heldout_sequences` others are the report's
        held-out text; `lr`, `epochs`: Adam on each block's biases [RECONSTRUCTION: 1e-3, 1-5 epochs];
        `eps`: whitening ridge relative to the mean input energy; `num_gpus`: of the task that compresses."""
        from rl.methods.decomper.core import rank_for_ratio
        rank_for_ratio(2, 2, ratio)  # validates the ratio
        if method not in ("whitened", "plain"):
            raise ValueError(f"method must be whitened or plain, got {method!r}")
        if compensation not in ("none", "closed_form", "learned") or learn_init not in ("closed_form", "zero"):
            raise ValueError(f"compensation must be none, closed_form or learned ({compensation!r}); learn_init "
                             f"closed_form or zero ({learn_init!r})")
        self.ratio, self.method, self.compensation, self.learn_init = ratio, method, compensation, learn_init
        self.calib_sequences, self.calib_length, self.heldout_sequences = calib_sequences, calib_length, heldout_sequences
        self.batch_size, self.lr, self.epochs, self.eps, self.num_gpus = batch_size, float(lr), epochs, float(eps), num_gpus

    def run(self, ctx: StageContext) -> dict[str, str]:
        cfg, base, tokenizer, _, examples, _ = policy_sft_data(ctx, "calibration text")
        need = self.calib_sequences + self.heldout_sequences
        if len(examples) < need:
            raise StageError(f"{ctx.name}: {len(examples)} SFT sequences, {need} needed (calib_sequences + "
                             f"heldout_sequences)")
        picked = random.Random(cfg.seed).sample(range(len(examples)), need)
        seqs = [(examples[i].prompt_ids + examples[i].response_ids)[:self.calib_length] for i in picked]
        out = Path(ctx.stage_dir)
        say(f"{ctx.name}: {self.method} SVD at ratio {self.ratio}, compensation {self.compensation}, "
            f"{self.calib_sequences} calibration sequences")
        report = ctx.runtime.run_task(
            compress_model, base, str(out / "model"), seqs[:self.calib_sequences], seqs[self.calib_sequences:],
            tokenizer.pad_token_id, ratio=self.ratio, method=self.method, compensation=self.compensation,
            learn_init=self.learn_init, lr=self.lr, epochs=self.epochs, batch_size=self.batch_size, eps=self.eps,
            dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code, num_gpus=self.num_gpus)
        report_path = out / "compression_report.json"
        report_path.write_text(json.dumps(report, indent=1))
        summary = {"ratio": self.ratio, "method": self.method, "compensation": self.compensation,
                   "kept_params_share": report["factor_params"] / report["dense_params"],
                   "model_params": {k: report["size"][f"params_{k}"] for k in ("original", "compressed")},
                   "bytes_on_disk": {k: report["size"][f"bytes_{k}"] for k in ("original", "compressed")},
                   "drift_last_block": {"uncompensated": report["drift_uncompensated"][-1],
                                        "compensated": report["drift"][-1]},
                   "heldout_token_kl": {"uncompensated": report["heldout_uncompensated"]["token_kl"],
                                        "compensated": report["heldout"]["token_kl"]}}
        ctx.summary[ctx.name] = summary
        say(f"{ctx.name}: last-block drift {summary['drift_last_block']['uncompensated']:.4f} -> "
            f"{summary['drift_last_block']['compensated']:.4f}, held-out token KL "
            f"{summary['heldout_token_kl']['uncompensated']:.4f} -> {summary['heldout_token_kl']['compensated']:.4f}")
        return {"policy": str(out / "model"), "compression_report": str(report_path)}

register_alias("stage", "compress_lowrank", "decomper")
