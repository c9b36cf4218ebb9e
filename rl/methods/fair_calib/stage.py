"""The `fair_calib` stage: FAIR-Calib W4A4 fake quantization of a masked-diffusion policy (`rl.methods.fair_calib.core`;
rl/methods/fair_calib/README.md, confirmed formulas with [RECONSTRUCTION]-marked details, see that module).

The SFT data gives the sequences: `calib_sequences` teacher-forced prompt+answer sequences calibrate, their prompts
(cycled) drive the `probes` random-commit rollouts of Stage I, and `diag_sequences` other prompts measure the
diagnostics. A Ray task in the run's first learner bundle builds the prior (`weighting`: fair = both terms,
frontier, reliability, or uniform = FlatQuant's plain block MSE), wraps every block projection in a fake quantizer
(`w_bits`/`a_bits`, with FlatQuant's flattening when `transform: kron`), records the round-to-nearest diagnostics,
calibrates the quantizers block by block, records the diagnostics again and saves the quantized folder.

Artifacts: `policy` (the fake-quantized model folder; the `hf` engine serves it quantized, e.g. in the evaluation
stage) and `quantization_report` (JSON: the prior, per-block losses, diagnostics of RTN and of the calibrated model).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rl.batch import pad_token_rows
from rl.registry import register, register_alias
from rl.stages import Stage, StageContext, StageError, policy_sft_data, say


def quantize_model(model_path: str, out_dir: str, calib: list[tuple[list[int], list[int]]], diag: list[list[int]],
                   pad_id: int, mask_id: int, *, w_bits: int, a_bits: int, weighting: str, probes: int, window: int,
                   floor_frac: float, beta: float, lambda1: float, gen_length: int, block_length: int, steps: int,
                   epochs: int, lr: float, batch_size: int, seed: int, transform: str = "none", device: str = "cpu",
                   dtype: str = "float32") -> dict[str, Any]:
    """Build the prior, quantize, calibrate and save the model at `model_path` into `out_dir` on `device`, the
    model's weights in `dtype` (the quantizers' ratios and transforms stay fp32); returns the report."""
    import copy

    import torch
    from transformers import AutoModel

    from models.quant import quantize_blocks, save_fake_quant
    from models.tokenizer import load_tokenizer
    from rl.methods.fair_calib.core import (
        calibrate_blocks,
        position_weights,
        probe_prior,
        trajectory_diagnostics,
        window_floor,
        window_prior,
    )
    torch.manual_seed(seed)
    fp = AutoModel.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    report: dict[str, Any] = {"w_bits": w_bits, "a_bits": a_bits, "weighting": weighting, "transform": transform,
                              "device": str(device), "dtype": dtype}
    prior = floor = None
    if weighting != "uniform":
        prompts, pmask = pad_token_rows([p for p, _ in calib], pad_id, "left")
        raw = probe_prior(fp, prompts, pmask, mask_id=mask_id, gen_length=gen_length, steps=steps, probes=probes,
                          seed=seed, beta=beta, lambda1=lambda1, frontier=weighting in ("fair", "frontier"),
                          masked_stage=weighting in ("fair", "reliability"))
        prior = window_prior(raw, window, floor_frac)
        floor = window_floor(prior, window, floor_frac)
        report["prior"], report["prior_floor"] = prior.tolist(), floor
    batches, weights = [], []
    for i in range(0, len(calib), batch_size):
        chunk = calib[i:i + batch_size]
        ids, mask = pad_token_rows([p + a for p, a in chunk], pad_id, "right")
        batches.append({"input_ids": ids.to(device), "attention_mask": mask.to(device)})
        weights.append(position_weights(mask, torch.tensor([len(p) for p, _ in chunk]), prior, floor).to(device))
    quant = copy.deepcopy(fp)
    quantize_blocks(quant, w_bits, a_bits, transform)
    dprompts, dmask = pad_token_rows(diag, pad_id, "left")
    dkw = dict(mask_id=mask_id, gen_length=gen_length, block_length=block_length, steps=steps)
    report["rtn"] = trajectory_diagnostics(fp, quant, dprompts, dmask, **dkw)
    report["blocks"] = calibrate_blocks(fp, quant, batches, weights, epochs=epochs, lr=lr,
                                        log=lambda j, a, b: say(f"fair_calib: block {j} loss {a:.4g} -> {b:.4g}"))
    report["calibrated"] = trajectory_diagnostics(fp, quant, dprompts, dmask, **dkw)
    load_tokenizer(model_path).save_pretrained(out_dir)
    save_fake_quant(quant, out_dir, extra={"weighting": weighting})
    return report


@register("stage", "fair_calib")
class FairCalibStage(Stage):
    reads, publishes = ("policy",), ("policy", "quantization_report")  # checked against the recipe's order
    config_keys = ("seed", "model", "data", "rollout.max_new_tokens", "rollout.eval_decoding_params", "sft.max_length",
                   "sft.format", "sft.messages_column", "sft.bad_rows")
    runs_in_driver = True

    def __init__(self, w_bits: int = 4, a_bits: int = 4, weighting: str = "fair", probes: int = 512,
                 window: int = 256, floor_frac: float = 0.01, beta: float = 1.0, lambda1: float = 1.0,
                 calib_sequences: int = 128, diag_sequences: int = 32, epochs: int = 15, lr: float = 5e-3,
                 batch_size: int = 8, transform: str = "none", num_gpus: float = 0.0):
        """`w_bits`/`a_bits`: integer bits of weights (per output channel) and activations (per token);
        `weighting`: fair (frontier hits + masked-stage reliability) | frontier | reliability | uniform; `probes`
        random-commit rollouts of the teacher (the paper's 512), the prior over the last `window` generation
        positions with `floor_frac` outside, `beta` the early boost, `lambda1` the reliability weight;
        `calib_sequences` teacher-forced sequences, `epochs` and `lr` of each block's AdamW over its clipping ratios
        (FlatQuant's ~15 and 5e-3); `transform`: none | kron (FlatQuant's learnable Kronecker-factored flattening
        of each projection's input and weight, trained with the clipping ratios; the paper's base quantizer);
        `diag_sequences` prompts for the diagnostics. The generation length is `rollout.max_new_tokens`, block
        length and steps are `rollout.eval_decoding_params`'."""
        from models.quant import TRANSFORMS
        from rl.methods.fair_calib.core import WEIGHTINGS
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")
        self.transform = transform
        if not (2 <= w_bits <= 8 and 2 <= a_bits <= 16):
            raise ValueError(f"w_bits must be in 2..8 and a_bits in 2..16 (16: activations unquantized), got "
                             f"{w_bits}, {a_bits}")
        self.w_bits, self.a_bits, self.weighting, self.probes = w_bits, a_bits, weighting, probes
        self.window, self.floor_frac, self.beta, self.lambda1 = window, float(floor_frac), float(beta), float(lambda1)
        self.calib_sequences, self.diag_sequences = calib_sequences, diag_sequences
        self.epochs, self.lr, self.batch_size, self.num_gpus = epochs, float(lr), batch_size, num_gpus

    def run(self, ctx: StageContext) -> dict[str, str]:
        cfg, base, tokenizer, _, examples, _ = policy_sft_data(ctx, "calibration sequences")
        if tokenizer.mask_token_id is None:
            raise StageError(f"{ctx.name}: fair_calib calibrates masked-diffusion models; {base} has no mask token")
        need = self.calib_sequences + self.diag_sequences
        if len(examples) < need:
            raise StageError(f"{ctx.name}: {len(examples)} SFT sequences, {need} needed (calib_sequences + "
                             f"diag_sequences)")
        picked = random.Random(cfg.seed).sample(range(len(examples)), need)
        calib = [(examples[i].prompt_ids, examples[i].response_ids) for i in picked[:self.calib_sequences]]
        diag = [examples[i].prompt_ids for i in picked[self.calib_sequences:]]
        gen = int(cfg.rollout.max_new_tokens)
        dp = cfg.rollout.eval_decoding_params or {}
        out = Path(ctx.stage_dir)
        say(f"{ctx.name}: W{self.w_bits}A{self.a_bits}, {self.weighting} weighting, {self.probes} probes, "
            f"{self.calib_sequences} calibration sequences")
        report = ctx.runtime.run_task(
            quantize_model, base, str(out / "model"), calib, diag, tokenizer.pad_token_id, tokenizer.mask_token_id,
            num_gpus=self.num_gpus, device="cuda" if self.num_gpus > 0 else "cpu", dtype=cfg.model.dtype,
            w_bits=self.w_bits, a_bits=self.a_bits, weighting=self.weighting, probes=self.probes,
            window=self.window, floor_frac=self.floor_frac, beta=self.beta, lambda1=self.lambda1, gen_length=gen,
            block_length=int(dp.get("block_length") or gen), steps=int(dp.get("steps") or gen), epochs=self.epochs,
            lr=self.lr, batch_size=self.batch_size, seed=cfg.seed, transform=self.transform)
        report_path = out / "quantization_report.json"
        report_path.write_text(json.dumps(report, indent=1))
        ctx.summary[ctx.name] = {"weighting": self.weighting, "rtn": report["rtn"], "calibrated": report["calibrated"]}
        say(f"{ctx.name}: frontier flip rate {report['rtn']['frontier_flip_rate']:.3f} (round to nearest) -> "
            f"{report['calibrated']['frontier_flip_rate']:.3f}, trajectory KL {report['rtn']['trajectory_kl']:.4f} -> "
            f"{report['calibrated']['trajectory_kl']:.4f}")
        return {"policy": str(out / "model"), "quantization_report": str(report_path)}

register_alias("stage", "quantize_fair", "fair_calib")
