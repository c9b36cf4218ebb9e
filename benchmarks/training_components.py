"""Training components against their baselines: SimpleGPT (SimpleNorm) against the pre-norm Llama block, the ZO
Fine-tuner's learned perturbation shape against MeZO, U-LoRA against LoRA, LoRA GRPO against full fine-tuning.

    python benchmarks/training_components.py [--only simplenorm|zo|ulora|lora_rl] [--seeds 0 1 2]
        [--zo-seeds 0 1 2 3 4] [--out benchmarks/results/training_components.json] [--steps 500]
        [--lrs 3e-4 1e-3 3e-3 1e-2 3e-2] [--runs-dir runs/training_components] [--lora-lr 1e-3]

Each section writes its part of the JSON (a section run alone keeps the other's last results).

## SimpleGPT

A labelled synthetic harness (rl/methods/simplegpt/README.md, the minimal tiny implementation): a tiny Llama (d = 128,
4 layers, 4 heads) in two variants, pre-norm (`model.tiny.norm_placement: prenorm`) and SimpleGPT (`simplenorm`),
trained from scratch as character-level LMs on the same text (the facts task's answers, written in code), with the
same optimizer (AdamW, weight decay 0.1, gradient clip 1.0, 20 warm-up steps then linear decay, batch 16 of 128
characters) for `--steps` steps at each learning rate of the sweep. Per seed and run: the training loss curve, the
held-out loss at the end, whether it diverged (a NaN, or a final loss not below the initial one), and, at lr 1e-3
after 100 steps, the top Hessian eigenvalue of the loss on a fixed batch (`rl.curvature`, 20 power iterations).

The paper's claims, in direction: the largest stable learning rate is at least 3x the pre-norm model's; at a shared
high learning rate SimpleGPT's final loss is lower; its top Hessian eigenvalue is lower.

## ZO Fine-tuner
A labelled synthetic harness (the ZO Fine-tuner's minimal setting, rl/methods/zo_finetuner/README.md): an MLP classifier of about 51k parameters (64 → 192 →
192 → 10, tanh); task A and task B label Gaussian inputs by two different random teacher networks. Per seed: the
learning-to-learn job trains a `PertBundle` on task A for 300 steps (the model on a first-order trajectory, SGD
with momentum 0.8, lr 0.05, restarted every 100 steps; meta step size lr_update = the ZO learning rate, a
[RECONSTRUCTION] at this scale where the code's 1e-6 is for LLM learning rates; lr_mlp 0.1), then forward-only
fine-tuning on task B for 2,000 steps from the same initial weights with MeZO, with the learned σ, and with the
untrained bundle's σ (its random initial shape: what learning adds), all at ε = 1e-3, lr 1e-3, batch 32 and the
same seed stream, so every arm makes the same number of forward passes. The paper's claim: the learned σ ends at
a lower loss than MeZO (23 of 28 settings; +2.5 points of accuracy on average).

## U-LoRA
A labelled synthetic harness (U-LoRA's shared-subspace task, rl/methods/ulora/README.md): a frozen random 2-layer MLP applied to each of 8 tokens of
a sequence; the target adds to its first layer ΔW_k = B⋆ diag(s_k) A⋆ (shared rank-4 A⋆, B⋆) for the sequence's type
k, which its first token reveals. The spec's s_k ∈ {±1, ±2}⁴ cannot be produced by a positive, sum-to-r gate, so
here s_k = 2.5 on direction k and 0.5 on the others (4 types, each row summing to r). Adapters on the first layer,
Adam lr 1e-2, 1,500 steps of 32 sequences, per seed: LoRA r = 4 and r = 5 (at and above U-LoRA's parameter
count), U-LoRA r = 4 (λ = 0.3), and U-LoRA without the context term and with λ = 0 as ablations. Measured: the
held-out MSE; the purity of k-means (k = 4) clusters of the per-token gates against the type; the mean
within-sequence variance of the gates; the standard deviation across steps of the batch-mean gate.

## LoRA GRPO vs full fine-tuning
The quickstart recipe through Ray, per seed: its SFT warm-up once (`trainer.steps=0`), then the same 60 GRPO steps
from that model with full fine-tuning (lr 1e-4, the recipe's) and with `learner.adapter: lora` (peft, r 16,
alpha 32, every attention and MLP projection; lr `--lora-lr`, 10x the full lr as is usual for LoRA). Measured:
held-out accuracy before and after RL, the mean step time and its train and sync phases (steps after the first),
the bytes one weight sync sends (`rollout/sync_bytes`), and each actor's peak resident memory. On a model this
small the process's libraries dominate resident memory, so the memory column says little about LoRA at scale;
the sync bytes and the trainable share are what scale.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("prenorm", "simplenorm")


def corpus() -> str:
    """Character-level training text written in code: the facts task's SFT answers (made-up people and facts)."""
    from rl.methods.factuality.task import write_facts_task
    with tempfile.TemporaryDirectory() as d:
        paths = write_facts_task(d, num_sft=3000, num_train=0, num_eval=0, seed=1234)
        rows = [json.loads(x) for x in Path(paths["sft"]).read_text().splitlines()]
    return "\n".join(f"{r['prompt']} {r['target']}" for r in rows)


def train_run(arch: str, lr: float, seed: int, text: str, steps: int, hessian_at: int | None) -> dict:
    import torch

    from models.tiny import build_tiny_model, build_tiny_tokenizer
    from rl.curvature import top_hessian_eigenvalue
    tok = build_tiny_tokenizer()
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    split = int(len(ids) * 0.9)
    train, held = ids[:split], ids[split:]
    model = build_tiny_model(tok, hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512,
                             max_position_embeddings=128, seed=seed, norm_placement=arch)
    model.train()
    g = torch.Generator().manual_seed(seed)

    def batch(source: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(source) - 128, (n,), generator=gen)
        return torch.stack([source[s:s + 128] for s in starts])
    held_batches = [batch(held, 32, torch.Generator().manual_seed(10_000 + i)) for i in range(4)]
    fixed = batch(train, 16, torch.Generator().manual_seed(20_000))

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x, labels=x).loss

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=lr,
                            betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / 20 if s < 20 else max(0.0, (steps - s) / (steps - 20)))
    losses, hessian = [], None
    for step in range(1, steps + 1):
        loss = loss_of(batch(train, 16, g))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            break
        if hessian_at == step:  # eager attention: CPU SDPA has no double backward
            model.set_attn_implementation("eager")
            hessian = top_hessian_eigenvalue(lambda: loss_of(fixed), list(model.parameters()), iters=20, seed=seed)
            model.set_attn_implementation("sdpa")
    model.eval()
    with torch.no_grad():
        held_loss = statistics.mean(float(loss_of(x)) for x in held_batches)
    first, last = statistics.mean(losses[:10]), statistics.mean(losses[-10:])
    diverged = not (math.isfinite(last) and math.isfinite(held_loss) and last < first)
    return {"losses": losses[::10], "first_loss": first, "final_loss": last, "held_out_loss": held_loss,
            "diverged": diverged, "hessian_top": hessian}


def largest_stable_lr(runs: dict, arch: str, lrs: list[float]) -> float | None:
    stable = [lr for lr in lrs if not runs[f"{arch}/{lr:g}"]["diverged"]]
    return max(stable) if stable else None


def summarize(report: dict) -> dict:
    """The SimpleGPT section's summary."""
    lrs, rows = report["lrs"], report["per_seed"]
    out: dict = {"largest_stable_lr": {a: [largest_stable_lr(r["runs"], a, lrs) for r in rows] for a in ARCHS}}
    out["held_out_loss"] = {a: {f"{lr:g}": statistics.mean(r["runs"][f"{a}/{lr:g}"]["held_out_loss"] for r in rows)
                                for lr in lrs} for a in ARCHS}
    out["diverged"] = {a: {f"{lr:g}": sum(r["runs"][f"{a}/{lr:g}"]["diverged"] for r in rows) for lr in lrs}
                       for a in ARCHS}
    out["hessian_top_at_1e-3"] = {a: [r["runs"][f"{a}/0.001"]["hessian_top"] for r in rows] for a in ARCHS}
    return out


ZO_ARMS = ("mezo", "learned", "untrained")
ZO_LRS = (3e-4, 1e-3, 3e-3)  # each arm at each; the headline compares at 1e-3 and at each arm's best


def zo_seed(seed: int, steps: int = 2000, l2l_steps: int = 300, lr: float = 1e-3, eps: float = 1e-3,
            lr_sweep: tuple[float, ...] = ZO_LRS) -> dict:
    import copy

    import torch
    from torch import nn

    from rl.methods.zo_finetuner.optimizer import PertBundle, ZOFinetuner, learn_to_learn
    from rl.optim import MeZO

    def teacher(task: int):
        g = torch.Generator().manual_seed(task)
        w1, w2 = torch.randn(64, 32, generator=g), torch.randn(32, 10, generator=g)
        return lambda x: (torch.tanh(x @ w1) @ w2).argmax(-1)

    def data(task: int, n: int, stream: int):
        x = torch.randn(n, 64, generator=torch.Generator().manual_seed(stream))
        return x, teacher(task)(x)

    def loss(forward, batch):
        return nn.functional.cross_entropy(forward(batch[0]), batch[1])
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(64, 192), nn.Tanh(), nn.Linear(192, 192), nn.Tanh(), nn.Linear(192, 10))
    task_a, task_b = 100 + seed, 200 + seed
    bundle = learn_to_learn(copy.deepcopy(base), loss, [data(task_a, 32, 10_000 * (seed + 1) + i)
                                                        for i in range(l2l_steps)],
                            eps=eps, lr_update=lr, lr_mlp=0.1, lr_llm=0.05, restart_every=100, seed=seed)
    held = data(task_b, 2000, 99_999 + seed)
    out: dict = {"params": sum(p.numel() for p in base.parameters())}

    def fine_tune(arm: str, rate: float) -> dict:
        model = copy.deepcopy(base)
        if arm == "mezo":
            opt = MeZO(model.parameters(), lr=rate, eps=eps, seed=seed)
        else:
            opt = ZOFinetuner(model.parameters(), lr=rate, eps=eps, seed=seed,
                              bundle=bundle if arm == "learned" else PertBundle.for_model(base, seed=seed))
        curve = []
        for i in range(steps):
            batch = data(task_b, 32, 50_000 * (seed + 1) + i)
            opt.step(lambda m=model, b=batch: loss(m, b))
            if (i + 1) % 100 == 0:
                with torch.no_grad():
                    curve.append(float(loss(model, held)))
        with torch.no_grad():
            accuracy = float((model(held[0]).argmax(-1) == held[1]).float().mean())
        final = curve[-1] if math.isfinite(curve[-1]) else float("inf")
        return {"held_out_loss": curve, "final_loss": final, "accuracy": accuracy,
                "sigma": [opt.last.get("sigma_min"), opt.last.get("sigma_mean"), opt.last.get("sigma_max")]}
    for arm in ZO_ARMS:
        sweep = {f"{rate:g}": fine_tune(arm, rate) for rate in lr_sweep}
        best = min(sweep, key=lambda k: sweep[k]["final_loss"])
        out[arm] = {**sweep[f"{lr:g}"], "best_lr": float(best), "best": sweep[best],
                    "final_loss_by_lr": {k: v["final_loss"] for k, v in sweep.items()}}
    return out


def summarize_zo(rows: list[dict]) -> dict:
    out = {arm: {"final_loss": [r[arm]["final_loss"] for r in rows], "accuracy": [r[arm]["accuracy"] for r in rows],
                 "mean_final_loss": statistics.mean(r[arm]["final_loss"] for r in rows),
                 "mean_accuracy": statistics.mean(r[arm]["accuracy"] for r in rows)} for arm in ZO_ARMS}
    out["learned_beats_mezo"] = sum(r["learned"]["final_loss"] < r["mezo"]["final_loss"] for r in rows)
    for arm in ZO_ARMS:  # each at its own best learning rate of the sweep
        out[arm]["best_lr"] = [r[arm]["best_lr"] for r in rows]
        out[arm]["best_final_loss"] = [r[arm]["best"]["final_loss"] for r in rows]
        out[arm]["mean_best_final_loss"] = statistics.mean(r[arm]["best"]["final_loss"] for r in rows)
    out["learned_beats_mezo_at_best_lrs"] = sum(r["learned"]["best"]["final_loss"] < r["mezo"]["best"]["final_loss"]
                                                for r in rows)
    return out


ULORA_ARMS = ("lora_r4", "lora_r5", "ulora", "ulora_token_only", "ulora_no_prior")


ULORA_SHAPE = {"d": 32, "T": 8, "K": 4, "r": 4}  # width, tokens a sequence, task types, the true update's rank


def ulora_task(seed: int):
    """The synthetic task of `ulora_seed`: a frozen two-layer net, and a batch maker whose targets add to the first
    layer a rank-r update scaled per task type (the type's marker is each sequence's first token)."""
    import torch
    d, T, K, r = (ULORA_SHAPE[k] for k in ("d", "T", "K", "r"))
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(64, d, generator=g) / d ** 0.5, torch.randn(d, 64, generator=g) / 8
    a_star, b_star = torch.randn(r, d, generator=g) / d ** 0.5, torch.randn(64, r, generator=g)
    scales = torch.full((K, r), 0.5)
    scales[torch.arange(K), torch.arange(K)] = 2.5
    markers = torch.randn(K, d, generator=g) * 3

    def batch(n: int, gen: torch.Generator):
        k = torch.randint(0, K, (n,), generator=gen)
        x = torch.randn(n, T, d, generator=gen)
        x[:, 0] = markers[k]
        delta = torch.einsum("or,nr,ri->noi", b_star, scales[k], a_star)
        y = torch.relu(torch.einsum("oi,nti->nto", w1, x) + torch.einsum("noi,nti->nto", delta, x)) @ w2.T
        return x, y, k

    def frozen() -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Linear(d, 64, bias=False), torch.nn.ReLU(), torch.nn.Linear(64, d, bias=False))
        with torch.no_grad():
            m[0].weight.copy_(w1)
            m[2].weight.copy_(w2)
        return m
    return batch, frozen


def ulora_arms() -> dict:
    """The adapters compared: LoRA at ranks 4 and 5, U-LoRA, U-LoRA without its context gate, without its prior."""
    from models.adapters import lora, ulora
    target = {"target_modules": ["0"], "task_type": None}
    return {"lora_r4": lambda m: lora(m, r=4, alpha=4, **target),
            "lora_r5": lambda m: lora(m, r=5, alpha=5, **target),
            "ulora": lambda m: ulora(m, r=4, alpha=4, **target),
            "ulora_token_only": lambda m: ulora(m, r=4, alpha=4, context=False, **target),
            "ulora_no_prior": lambda m: ulora(m, r=4, alpha=4, lam=0.0, **target)}


def gate_report(layer, test: tuple, batch_gates: list, seed: int) -> dict:
    """How U-LoRA's gates sort the test tokens by task type (KMeans purity), their spread within a sequence and
    across the last 500 training batches."""
    import numpy as np
    import torch
    from sklearn.cluster import KMeans
    T, K, r = ULORA_SHAPE["T"], ULORA_SHAPE["K"], ULORA_SHAPE["r"]
    gates = layer.last_gate[:, 1:].reshape(-1, r).numpy()  # every token after the type marker
    types = test[2][:, None].expand(-1, T - 1).reshape(-1).numpy()
    labels = KMeans(K, n_init=10, random_state=seed).fit_predict(gates)
    return {"gate_purity": float(sum(np.bincount(types[labels == c]).max() for c in set(labels)) / len(types)),
            "within_sequence_gate_var": float(layer.last_gate[:, 1:].var(1).mean()),
            "batch_gate_std_over_steps": float(torch.stack(batch_gates[-500:]).std(0).mean())}


def ulora_seed(seed: int, steps: int = 1500) -> dict:
    import torch

    from models.adapters import finish_optimizer_step
    batch, frozen = ulora_task(seed)
    test = batch(512, torch.Generator().manual_seed(7))
    out: dict = {}
    for arm, make in ulora_arms().items():
        torch.manual_seed(seed)
        model = make(frozen())
        layer = model.get_base_model()[0]
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=1e-2)
        gen = torch.Generator().manual_seed(1000 + seed)
        batch_gates = []
        for _ in range(steps):
            x, y, _k = batch(32, gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            finish_optimizer_step(model)  # U-LoRA's EMA prior: one step per optimizer step
            if getattr(layer, "last_gate", None) is not None:
                batch_gates.append(layer.last_gate.reshape(-1, ULORA_SHAPE["r"]).mean(0))
        model.eval()
        with torch.no_grad():
            mse = float(((model(test[0]) - test[1]) ** 2).mean())
        out[arm] = {"params": sum(p.numel() for p in params), "test_mse": mse,
                    **(gate_report(layer, test, batch_gates, seed) if batch_gates else {})}
    return out


def summarize_ulora(rows: list[dict]) -> dict:
    out = {arm: {"test_mse": [r[arm]["test_mse"] for r in rows], "params": rows[0][arm]["params"],
                 "mean_test_mse": statistics.mean(r[arm]["test_mse"] for r in rows)} for arm in ULORA_ARMS}
    for arm in ("ulora", "ulora_token_only", "ulora_no_prior"):
        for key in ("gate_purity", "within_sequence_gate_var", "batch_gate_std_over_steps"):
            out[arm][key] = [r[arm][key] for r in rows]
    out["ulora_beats_lora_r5"] = sum(r["ulora"]["test_mse"] < r["lora_r5"]["test_mse"] for r in rows)
    return out


LORA_RL = ("full", "lora")
LORA_SPEC = ("learner.adapter={name: lora, params: {r: 16, alpha: 32, dropout: 0.0, target_modules: [q_proj, k_proj, "
             "v_proj, o_proj, gate_proj, up_proj, down_proj]}}")


def lora_rl_seed(seed: int, runs_dir: Path, lora_lr: float, overrides: list[str]) -> dict:
    """The quickstart's SFT once, then GRPO with full fine-tuning and with LoRA from the same model."""
    from recipe_runs import run_recipe
    recipe = "recipes/quickstart.yaml"
    sft_dir = runs_dir / f"seed{seed}" / "sft"
    run_recipe(recipe, [f"seed={seed}", *overrides, "trainer.steps=0"], sft_dir, f"quickstart SFT seed {seed}")
    common = [f"seed={seed}", "sft.enabled=false", f"model.path={sft_dir / 'sft_model'}", "trainer.save_hf=false",
              *overrides]
    arms = {"full": common, "lora": [*common, LORA_SPEC, f"learner.lr={lora_lr}"]}
    out = {}
    for arm, overrides in arms.items():
        s = run_recipe(recipe, overrides, runs_dir / f"seed{seed}" / arm, f"{arm} GRPO seed {seed}")
        later = s["metrics"][1:]  # the first step also pays one-off start-up costs

        def mean(key: str, rows: list[dict] = later) -> float:
            return statistics.mean(r[key] for r in rows if key in r)
        out[arm] = {"accuracy_before_rl": s["accuracy_before_rl"], "accuracy_after_rl": s["accuracy_after_rl"],
                    "step_s": mean("perf/step_s"), "train_s": mean("time/train"), "sync_s": mean("time/sync"),
                    "sync_bytes": mean("rollout/sync_bytes", s["metrics"]), "peak_rss_gib": s["peak_rss_gib"],
                    "final_train_reward": s["reward/mean"], "rl_wall_s": s["rl_wall_s"]}
    return out


def summarize_lora_rl(rows: list[dict]) -> dict:
    out: dict = {}
    for arm in LORA_RL:
        out[arm] = {k: statistics.mean(r[arm][k] for r in rows)
                    for k in ("accuracy_before_rl", "accuracy_after_rl", "step_s", "train_s", "sync_s", "sync_bytes")}
        out[arm]["accuracy_after_rl_per_seed"] = [r[arm]["accuracy_after_rl"] for r in rows]
        out[arm]["max_peak_rss_gib"] = {actor: max(r[arm]["peak_rss_gib"][actor] for r in rows)
                                        for actor in rows[0][arm]["peak_rss_gib"]}
    out["sync_bytes_ratio_lora_over_full"] = out["lora"]["sync_bytes"] / out["full"]["sync_bytes"]
    out["step_time_ratio_lora_over_full"] = out["lora"]["step_s"] / out["full"]["step_s"]
    return out


def _simplenorm(report: dict, axes: list) -> None:
    sn = report["simplenorm"]
    lrs, s = sn["lrs"], sn["summary"]
    high = f"{max(lrs):g}"
    for arch, color in zip(ARCHS, ("tab:gray", "tab:blue")):
        axes[0].plot(lrs, [s["held_out_loss"][arch][f"{lr:g}"] for lr in lrs], marker="o", color=color,
                     label=arch)
        curves = [r["runs"][f"{arch}/{high}"]["losses"] for r in sn["per_seed"]]
        for i, losses in enumerate(c for c in curves if c is not None):  # a seed from its run log has none
            axes[1].plot([10 * j for j in range(len(losses))], losses, color=color, alpha=0.6,
                         label=arch if i == 0 else None)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("learning rate")
    axes[0].set_ylabel("held-out loss after training (mean of seeds)")
    axes[0].set_title("SimpleGPT vs pre-norm: learning-rate sweep", fontsize=10)
    axes[0].legend()
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("training loss")
    axes[1].set_title(f"SimpleGPT vs pre-norm: training loss at lr {high}, every seed", fontsize=10)
    axes[1].legend()


def _zo(report: dict, axes: list) -> None:
    rows = report["zo"]["per_seed"]
    for arm, color in zip(ZO_ARMS, ("tab:gray", "tab:blue", "tab:orange")):
        curves = [r[arm]["held_out_loss"] for r in rows]
        mean = [statistics.mean(c[i] for c in curves) for i in range(len(curves[0]))]
        axes[0].plot([100 * (i + 1) for i in range(len(mean))], mean, color=color, label=arm)
    axes[0].set_xlabel("forward-only step (2 forwards each)")
    axes[0].set_ylabel(f"task-B held-out loss (mean of {len(rows)} seeds)")
    axes[0].set_title("ZO Fine-tuner vs MeZO", fontsize=10)
    axes[0].legend()


def _ulora(report: dict, axes: list) -> None:
    su = report["ulora"]["summary"]
    axes[0].bar(list(ULORA_ARMS), [su[a]["mean_test_mse"] for a in ULORA_ARMS], color="tab:green")
    for i, a in enumerate(ULORA_ARMS):
        axes[0].scatter([i] * len(su[a]["test_mse"]), su[a]["test_mse"], color="k", s=10, zorder=3)
        axes[0].text(i, su[a]["mean_test_mse"], f"{su[a]['params']} params", ha="center", va="bottom", fontsize=7)
    axes[0].set_ylabel("held-out MSE (bars: mean; dots: seeds)")
    axes[0].set_title("U-LoRA vs LoRA: per-sequence utilization task", fontsize=10)
    axes[0].tick_params(axis="x", labelsize=7)


def _lora_rl(report: dict, axes: list) -> None:
    rows = report["lora_rl"]["per_seed"]
    for arm, color in zip(LORA_RL, ("tab:gray", "tab:blue")):
        before = [r[arm]["accuracy_before_rl"] for r in rows]
        after = [r[arm]["accuracy_after_rl"] for r in rows]
        for i, (b, a) in enumerate(zip(before, after)):
            axes[0].plot([0, 1], [b, a], marker="o", color=color, alpha=0.7, label=arm if i == 0 else None)
    axes[0].set_xticks([0, 1], ["before RL", "after 60 GRPO steps"])
    axes[0].set_ylabel("held-out accuracy (each line a seed)")
    axes[0].set_title("LoRA vs full fine-tuning, quickstart", fontsize=10)
    axes[0].legend()


def _plot(report: dict, path: Path) -> None:
    """One figure per component: `training_components_{simplenorm,zo,ulora,lora_rl}.png`."""
    from recipe_runs import method_figures
    drawers = {"simplenorm": (2, _simplenorm), "zo": (1, _zo), "ulora": (1, _ulora), "lora_rl": (1, _lora_rl)}
    method_figures(path, report, {name: drawer for name, drawer in drawers.items() if name in report})


def _seed_section(report: dict, name: str, seeds: list[int], run_seed, arms: tuple[str, ...], measure: str,
                  summarize_rows) -> None:
    """Run `run_seed` for every seed (printing each arm's `measure`) into `report[name]` and its summary."""
    rows = []
    for seed in seeds:
        rows.append({"seed": seed, **run_seed(seed)})
        print(json.dumps({"seed": seed, **{a: round(rows[-1][a][measure], 4) for a in arms}}), flush=True)
    report[name] = {"seeds": seeds, "per_seed": rows, "summary": summarize_rows(rows)}
    report["summary"][name] = report[name]["summary"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["simplenorm", "zo", "ulora", "lora_rl"], default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--zo-seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2, 3e-2])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/training_components.json"))
    p.add_argument("--runs-dir", default=str(ROOT / "runs/training_components"))
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("overrides", nargs="*", help="overrides of the quickstart recipe for the lora_rl section")
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    out = Path(args.out)
    report: dict = json.loads(out.read_text()) if out.exists() else {}
    report.setdefault("summary", {})
    if args.only in (None, "simplenorm"):
        text = corpus()
        sn: dict = {"lrs": args.lrs, "steps": args.steps, "seeds": args.seeds, "corpus_chars": len(text),
                    "per_seed": []}
        for seed in args.seeds:
            runs = {}
            for arch in ARCHS:
                for lr in args.lrs:
                    t0 = time.perf_counter()
                    runs[f"{arch}/{lr:g}"] = train_run(arch, lr, seed, text, args.steps,
                                                       hessian_at=100 if lr == 1e-3 else None)
                    r = runs[f"{arch}/{lr:g}"]
                    print(json.dumps({"seed": seed, "arch": arch, "lr": lr, "final": round(r["final_loss"], 3),
                                      "held_out": round(r["held_out_loss"], 3), "diverged": r["diverged"],
                                      "hessian": r["hessian_top"], "s": round(time.perf_counter() - t0)}),
                          flush=True)
            sn["per_seed"].append({"seed": seed, "runs": runs})
        sn["summary"] = summarize(sn)
        report["simplenorm"], report["summary"]["simplenorm"] = sn, sn["summary"]
    if args.only in (None, "zo"):
        _seed_section(report, "zo", args.zo_seeds, zo_seed, ZO_ARMS, "final_loss", summarize_zo)
    if args.only in (None, "ulora"):
        _seed_section(report, "ulora", args.seeds, ulora_seed, ULORA_ARMS, "test_mse", summarize_ulora)
    if args.only in (None, "lora_rl"):
        _seed_section(report, "lora_rl", args.seeds, lambda seed: lora_rl_seed(seed, Path(args.runs_dir), args.lora_lr,
                                                                                  args.overrides),
                      LORA_RL, "accuracy_after_rl", summarize_lora_rl)
    from recipe_runs import write_report
    write_report(report, args.out, _plot)


if __name__ == "__main__":
    main()
