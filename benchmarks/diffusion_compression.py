"""Compression and decoding of tiny models made in code: Decomper, FAIR-Calib and CORE, each against its controls.

    python benchmarks/diffusion_compression.py [--seeds 0 1 2] [--out benchmarks/results/diffusion_compression.json]
        [--runs-dir runs/diffusion_compression] [--only decomper|fair|core] [key=value ...]

`--only` reruns one method and keeps the other methods' recorded figures in `--out`.

A labelled synthetic harness, per seed:

Decomper (causal): a 4-block tiny Llama fitted in-process to arithmetic text (`a+b*c=` worked solutions), every
projection compressed at ratio ρ ∈ {0.2, 0.4, 0.6} with plain and whitened SVD, each with no, closed-form and
learned compensation (`rl.methods.decomper.core`, 32 calibration sequences); held-out perplexity and token KL to the original.
The paper's claim in direction: compensation cuts the perplexity gap sharply (> 70% at ρ = 0.4 on 8B models).

The masked-diffusion model: `recipes/llada_sft_tiny.yaml` (the LLaDA layout, SFT with the MDLM loss on the addition
task: a+b= with two-digit a and b and a three-digit sum), then on its 200 held-out problems, greedy, one block of G
tokens (the sum's digits and EOS; G = 4) decoded in G steps:

FAIR-Calib: W4A4 fake quantization calibrated block by block (`rl.methods.fair_calib.core`, 64 teacher probes, 64 calibration
sequences, 15 epochs) with the uniform block MSE, each single term of the prior, and both, learning the clipping
ratios; the uniform MSE and both terms again with FlatQuant's learned flattening (`+kron`, the paper's base
quantizer); round-to-nearest (RTN) as the floor. Exact-match accuracy, trajectory KL to full precision on the
teacher's trajectories, frontier flip rate, and the stability lag δ_lag of each model's own trajectories (with the
full-precision teacher's) and its CCDF. The paper's ordering: both > single term > uniform.

CORE: the same recipe on 7-digit sums (an 8-digit answer; 1,500 SFT steps), decoded greedily on a 16-token canvas in
16 steps with 4 probes (16 + 4 forwards), so probes land mid-trajectory: CORE with the spec's current-state score and
with the commit-time score, against compute-matched controls (random and low-margin remasking at the same probes,
and no remasking with 20 steps). Accuracy, the precision of each policy's choice at flagging committed tokens that
are wrong (differ from the correct answer's token), and the share of rows whose first probe sends back other tokens
than low-margin remasking does (the run stops if CORE chooses as low-margin on every row).
"""

from __future__ import annotations

import copy
import json
import random
import statistics
from pathlib import Path

from recipe_runs import method_figures, run_recipe, seed_sweep_parser, write_report

LLADA = "recipes/llada_sft_tiny.yaml"
# CORE's model: the same recipe on 7-digit sums (an 8-digit answer), decoded on a 16-token canvas with 4 probes, so
# that probes land mid-trajectory with committed digits left to revise
CORE_CANVAS, CORE_PROBES = 16, 4
CORE_OVERRIDES = ["data.synthetic.digits=7", f"rollout.max_new_tokens={CORE_CANVAS}", "model.tiny.max_position_embeddings=48",
                  f"rollout.eval_decoding_params={{block_length: {CORE_CANVAS}, steps: {CORE_CANVAS}}}", "sft.steps=1500"]
RATIOS = (0.2, 0.4, 0.6)
WEIGHTINGS = ("uniform", "frontier", "reliability", "fair")
# calibrations: each weighting with the clipping ratios alone, and the two ends with FlatQuant's learned flattening
FAIR_ARMS = (*WEIGHTINGS, "uniform+kron", "fair+kron")


def decomper_seed(seed: int) -> dict:
    from models.lowrank import save_low_rank
    from rl.methods.decomper.core import (
        compress,
        input_stats,
        learn_biases,
        token_kl_and_nll,
    )
    from rl.methods.decomper.task import tiny_arithmetic_lm
    model, batch = tiny_arithmetic_lm(seed, steps=400)
    calib, held = [batch(16) for _ in range(2)], [batch(16) for _ in range(4)]
    stats = input_stats(model, calib)
    out: dict = {"nll_original": token_kl_and_nll(model, model, held)["nll_original"], "arms": {},
                 "size_original": _size(model, save=model.save_pretrained)}
    for method in ("plain", "whitened"):
        for ratio in RATIOS:
            for comp in ("none", "closed_form", "learned"):
                m = copy.deepcopy(model)
                compress(m, stats, ratio, method, "none" if comp == "none" else "closed_form")
                if comp == "learned":
                    learn_biases(model, m, calib, lr=1e-3, epochs=3)
                res = token_kl_and_nll(model, m, held)
                out["arms"][f"{method}/{ratio}/{comp}"] = {"token_kl": res["token_kl"], "nll": res["nll_compressed"],
                                                           **_size(m, save=lambda d, m=m: save_low_rank(m, d))}
    return out


def _size(model, save) -> dict:
    """The model's parameter count and the bytes of its weight files as `save(folder)` writes them."""
    import tempfile

    from rl.methods.decomper.stage import safetensors_bytes
    with tempfile.TemporaryDirectory() as d:
        save(d)
        disk = safetensors_bytes(d)
    return {"params": sum(p.numel() for p in model.parameters()), "bytes": disk}


def _eval_prompts(run_dir: Path, n: int) -> tuple[list[str], list[str]]:
    rows = [json.loads(x) for x in (run_dir / "data" / "eval.jsonl").read_text().splitlines()][:n]
    return [x["prompt"] for x in rows], [x["answer"] for x in rows]


def _decode(model, tok, prompts: list[str], **kw):
    from models.diffusion import diffusion_generate
    enc = tok(prompts, return_tensors="pt", padding=True)
    return diffusion_generate(model, enc["input_ids"], enc["attention_mask"], mask_id=tok.mask_token_id, **kw)


def _canvas(answers: list[str]) -> dict:
    """One block holding the sum's digits and EOS, one token committed per step."""
    G = len(answers[0]) + 1
    return {"gen_length": G, "block_length": G, "steps": G}


def _accuracy(tok, tokens, answers: list[str]) -> list[float]:
    """Exact match of each response up to its first EOS (what the engine returns; the canvas past it is filler)."""
    rows = [r.tolist() for r in tokens]
    texts = tok.batch_decode([r[:r.index(tok.eos_token_id)] if tok.eos_token_id in r else r for r in rows],
                             skip_special_tokens=True)
    return [float(t.strip() == a) for t, a in zip(texts, answers)]


def fair_seed(seed: int, model_dir: Path, run_dir: Path) -> dict:
    """Each weighting through the stage's own task (`rl.methods.fair_calib.stage.quantize_model`), the quantized folder
    read back as the engine reads it; RTN is the quantizer before calibration."""
    import torch
    from transformers import AutoModel

    from models.quant import load_fake_quant, quantize_blocks
    from models.tokenizer import load_tokenizer
    from rl.methods.fair_calib.core import lag_summary, stability_lags
    from rl.methods.fair_calib.stage import quantize_model
    torch.manual_seed(seed)
    tok = load_tokenizer(str(model_dir))
    fp = AutoModel.from_pretrained(model_dir).eval()
    prompts, answers = _eval_prompts(run_dir, 200)
    sft = [json.loads(x) for x in (run_dir / "data" / "sft.jsonl").read_text().splitlines()]
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    calib = [(ids(c["prompt"]), ids(c["target"]) + [tok.eos_token_id]) for c in random.Random(seed).sample(sft, 64)]
    diag = [ids(p) for p in prompts[:64]]
    kw = _canvas(answers)
    rtn = copy.deepcopy(fp)
    quantize_blocks(rtn, 4, 4)
    # the teacher's own stability lags on the diagnostic prompts (the arms' come with their trajectory diagnostics)
    enc = tok(prompts[:64], return_tensors="pt", padding=True)
    own = _decode(fp, tok, prompts[:64], **kw)
    fp_lags = lag_summary(*stability_lags(fp, enc["input_ids"], enc["attention_mask"], own.tokens, own.commit_step,
                                          mask_id=tok.mask_token_id, steps=kw["steps"]))
    out: dict = {"fp": {"accuracy": _accuracy(tok, _decode(fp, tok, prompts, **kw).tokens, answers), **fp_lags},
                 "arms": {"rtn": {"accuracy": _accuracy(tok, _decode(rtn, tok, prompts, **kw).tokens, answers)}}}
    for arm in FAIR_ARMS:
        weighting, _, transform = arm.partition("+")
        folder = run_dir / "quantized" / arm
        report = quantize_model(str(model_dir), str(folder), calib, diag, tok.pad_token_id, tok.mask_token_id,
                                w_bits=4, a_bits=4, weighting=weighting, transform=transform or "none", probes=64,
                                window=256, floor_frac=0.01, beta=1.0, lambda1=1.0, epochs=15, lr=5e-3, batch_size=8,
                                seed=seed, **kw)
        q = load_fake_quant(AutoModel.from_pretrained(folder), folder).eval()
        out["arms"][arm] = {"accuracy": _accuracy(tok, _decode(q, tok, prompts, **kw).tokens, answers),
                            **report["calibrated"]}
        out["arms"]["rtn"].update(report["rtn"])  # the same diagnostics of the uncalibrated quantizer
    return out


def core_seed(seed: int, model_dir: Path, run_dir: Path) -> dict:
    """CORE on a canvas where probing happens mid-trajectory: one block of `CORE_CANVAS` tokens (the 8-digit sum,
    EOS and EOS fill) decoded in as many steps, `CORE_PROBES` probes; CORE with the spec's current-state score and
    with the commit-time score, against random and low-margin remasking at the same probes and no remasking with
    the same forward count. The share of rows whose first probe sends back other tokens than low-margin's is
    recorded, and a run where CORE chooses as low-margin does on every row is refused (nothing would be measured)."""
    import torch
    from transformers import AutoModel

    from models.diffusion import Remasking
    from models.tokenizer import load_tokenizer
    torch.manual_seed(seed)
    tok = load_tokenizer(str(model_dir))
    model = AutoModel.from_pretrained(model_dir).eval()
    prompts, answers = _eval_prompts(run_dir, 200)
    G, k = CORE_CANVAS, CORE_PROBES
    probe = dict(probes=k, candidates=8, m=2)
    arms = {f"none_{G}": (G, Remasking()), f"none_{G + k}": (G + k, Remasking()),
            "core": (G, Remasking("core", **probe)), "core_commit": (G, Remasking("core", **probe, score="commit")),
            "random": (G, Remasking("random", **probe)), "low_margin": (G, Remasking("low_margin", **probe))}
    truth = [tok(a + tok.eos_token, add_special_tokens=False)["input_ids"] for a in answers]
    out, first = {}, {}
    for name, (steps, revise) in arms.items():
        g = torch.Generator().manual_seed(seed)
        res = _decode(model, tok, prompts, gen_length=G, block_length=G, steps=steps, revise=revise, commit_log=True,
                      generator=g)
        probes = [e for e in res.log if "probe" in e]
        flagged = [(row, pos, token) for e in probes for row, pos, token, _ in e["remasked"]]
        wrong = [float(pos < len(truth[row]) and token != truth[row][pos]) for row, pos, token in flagged]
        if probes:
            first[name] = {row: sorted(p for r, p, *_ in probes[0]["remasked"] if r == row) for row in range(len(prompts))}
        out[name] = {"forwards": res.forwards, "accuracy": _accuracy(tok, res.tokens, answers),
                     "flag_precision": statistics.mean(wrong) if wrong else None, "flagged": len(flagged),
                     "probe_steps": [e["step"] for e in probes]}
    for name in ("core", "core_commit"):
        out[name]["first_probe_differs_from_low_margin"] = statistics.mean(
            float(first[name][row] != first["low_margin"][row]) for row in first[name])
    if out["core"]["first_probe_differs_from_low_margin"] == 0:
        raise SystemExit("CORE chose what low-margin remasking chose on every row: this canvas cannot show CORE")
    return out


def summarize(report: dict) -> dict:
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return statistics.mean(xs) if xs else None
    rows = report["per_seed"]
    out: dict = {}
    if rows and "decomper" in rows[0]:
        arms = rows[0]["decomper"]["arms"]
        out["decomper"] = {a: {"token_kl": mean(r["decomper"]["arms"][a]["token_kl"] for r in rows),
                               "ppl_gap": mean(2.718281828 ** r["decomper"]["arms"][a]["nll"]
                                               - 2.718281828 ** r["decomper"]["nll_original"] for r in rows)}
                           for a in arms}
        if all("size_original" in r["decomper"] for r in rows):  # parameters and bytes against the original
            for a in arms:
                arm, orig = rows[0]["decomper"]["arms"][a], rows[0]["decomper"]["size_original"]
                out["decomper"][a].update(params_share=arm["params"] / orig["params"],
                                          bytes_share=arm["bytes"] / orig["bytes"])
            out["decomper_original_size"] = rows[0]["decomper"]["size_original"]
    if rows and "fair" in rows[0]:
        out["fair"] = {"fp_accuracy": mean(mean(r["fair"]["fp"]["accuracy"]) for r in rows)}
        lag_keys = ("stability_lag_mean", "stability_lag_censored")
        if all(k in r["fair"]["fp"] for r in rows for k in lag_keys):
            out["fair"]["fp_lag"] = {k: mean(r["fair"]["fp"][k] for r in rows) for k in lag_keys}
            out["fair"]["fp_lag"]["stability_lag_ccdf"] = _mean_ccdf([r["fair"]["fp"] for r in rows])
        for a in ("rtn", *(a for a in FAIR_ARMS if a in rows[0]["fair"]["arms"])):
            arms = [r["fair"]["arms"][a] for r in rows]
            keys = ("accuracy", "trajectory_kl", "frontier_flip_rate", "post_commit_mismatch",
                    *(k for k in lag_keys if all(k in x for x in arms)))
            out["fair"][a] = {k: mean(mean(x[k]) if k == "accuracy" else x[k] for x in arms) for k in keys}
            if all("stability_lag_ccdf" in x for x in arms):
                out["fair"][a]["stability_lag_ccdf"] = _mean_ccdf(arms)
    if rows and "core" in rows[0]:
        out["core"] = {a: {"accuracy": mean(mean(r["core"][a]["accuracy"]) for r in rows),
                           "forwards": rows[0]["core"][a]["forwards"],
                           "flag_precision": mean(r["core"][a]["flag_precision"] for r in rows)}
                       for a in rows[0]["core"]}
        for a in ("core", "core_commit"):
            if all("first_probe_differs_from_low_margin" in r["core"].get(a, {}) for r in rows):
                out["core"][a]["first_probe_differs_from_low_margin"] = mean(
                    r["core"][a]["first_probe_differs_from_low_margin"] for r in rows)
    return out


def _mean_ccdf(rows: list[dict]) -> list[float]:
    """The seeds' δ_lag CCDFs averaged pointwise (a shorter CCDF is 0 past its end)."""
    n = max(len(r["stability_lag_ccdf"]) for r in rows)
    return [statistics.mean(r["stability_lag_ccdf"][d] if d < len(r["stability_lag_ccdf"]) else 0.0 for r in rows)
            for d in range(n)]


def _decomper(s: dict, axes: list) -> None:
    for method, style in (("plain", "--"), ("whitened", "-")):
        for comp, color in (("none", "tab:gray"), ("closed_form", "tab:orange"), ("learned", "tab:blue")):
            axes[0].plot(RATIOS, [s["decomper"][f"{method}/{r}/{comp}"]["token_kl"] for r in RATIOS], style,
                         color=color, marker="o", label=f"{method}, {comp}")
    axes[0].set_xlabel("compression ratio")
    axes[0].set_ylabel("held-out token KL to the original")
    axes[0].set_yscale("log")
    axes[0].set_title("Decomper: whitened vs plain low-rank, with and without compensation", fontsize=10)
    axes[0].legend(fontsize=7)


def _fair(s: dict, axes: list) -> None:
    names = [a for a in s["fair"] if a not in ("fp_accuracy", "fp_lag")]
    axes[0].bar(names, [s["fair"][a]["accuracy"] for a in names], color="tab:blue")
    axes[0].axhline(s["fair"]["fp_accuracy"], color="k", linestyle="--", label="full precision")
    axes[0].set_ylabel("exact-match accuracy (W4A4)")
    axes[0].set_title("FAIR-Calib vs uniform calibration and round-to-nearest", fontsize=10)
    axes[0].tick_params(axis="x", labelsize=8, rotation=30)
    axes[0].legend(fontsize=8)
    if "fp_lag" not in s["fair"]:
        return
    curves = {"full precision": s["fair"]["fp_lag"], **{a: s["fair"][a] for a in ("rtn", "uniform", "fair",
                                                                                      "uniform+kron", "fair+kron")
                                                         if "stability_lag_ccdf" in s["fair"].get(a, {})}}
    for name, row in curves.items():
        ccdf = row["stability_lag_ccdf"]
        axes[1].plot(range(len(ccdf)), ccdf, marker="o", label=name)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("stability lag δ_lag (steps)")
    axes[1].set_ylabel("P(δ_lag ≥ d), own trajectories")
    axes[1].set_title("FAIR-Calib: the stability lag's CCDF per calibration", fontsize=10)
    axes[1].legend(fontsize=7)


def _core(s: dict, axes: list) -> None:
    names = list(s["core"])
    axes[0].bar(names, [s["core"][a]["accuracy"] for a in names], color="tab:green")
    axes[0].set_ylabel("exact-match accuracy")
    axes[0].set_title("CORE vs its controls (forwards: " + ", ".join(str(s["core"][a]["forwards"]) for a in names)
                      + ")", fontsize=10)
    axes[0].tick_params(axis="x", labelsize=8)


def _plot(report: dict, path: Path) -> None:
    """One figure per method: `diffusion_compression_{decomper,fair,core}.png`."""
    s = report["summary"]
    drawers = {"decomper": (1, _decomper), "fair": (2 if "fp_lag" in s.get("fair", {}) else 1, _fair),
               "core": (1, _core)}
    method_figures(path, s, {name: drawer for name, drawer in drawers.items() if name in s})


def main() -> None:
    p = seed_sweep_parser("diffusion_compression", [0, 1, 2], "overrides of the masked-diffusion recipe")
    p.add_argument("--only", choices=["decomper", "fair", "core"], default=None)
    args = p.parse_args()
    runs = Path(args.runs_dir)
    report = {"recipe": LLADA, "seeds": args.seeds, "per_seed": []}
    for seed in args.seeds:
        row: dict = {"seed": seed}
        if args.only in (None, "decomper"):
            row["decomper"] = decomper_seed(seed)
            print(json.dumps({"seed": seed, "decomper": {k: round(v["token_kl"], 5) for k, v in
                                                         row["decomper"]["arms"].items() if "/0.4/" in k}}), flush=True)
        if args.only in (None, "fair"):
            run_dir = runs / f"seed{seed}" / "llada"
            summary = run_recipe(LLADA, [f"seed={seed}", f"data.synthetic.seed={1234 + seed}", *args.overrides],
                                 run_dir, f"LLaDA SFT seed {seed}")
            row["llada_accuracy"] = summary.get("accuracy_after_rl")
            row["fair"] = fair_seed(seed, Path(summary["stages"]["sft"]["artifacts"]["policy"]), run_dir)
            print(json.dumps({"seed": seed, "fair": {a: statistics.mean(v["accuracy"])
                                                     for a, v in row["fair"]["arms"].items()}}), flush=True)
        if args.only in (None, "core"):
            core_dir = runs / f"seed{seed}" / "llada_core"
            core_run = run_recipe(LLADA, [f"seed={seed}", f"data.synthetic.seed={1234 + seed}", *args.overrides,
                                          *CORE_OVERRIDES], core_dir, f"LLaDA SFT (7-digit sums) seed {seed}")
            row["core_model_accuracy"] = core_run.get("accuracy_after_rl")
            row["core"] = core_seed(seed, Path(core_run["stages"]["sft"]["artifacts"]["policy"]), core_dir)
            print(json.dumps({"seed": seed, "core": {a: statistics.mean(v["accuracy"])
                                                     for a, v in row["core"].items()}}), flush=True)
        report["per_seed"].append(row)
        partial = Path(args.out).with_suffix(".partial.json")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(report, indent=2))
    if args.only and Path(args.out).exists():  # one method rerun: the others' recorded figures stay
        report = _merge(json.loads(Path(args.out).read_text()), report)
    report["summary"] = summarize(report)
    write_report(report, args.out, _plot)


def _merge(recorded: dict, rerun: dict) -> dict:
    """`recorded` with each seed's rows of `rerun` written over it (a method rerun with `--only`)."""
    by_seed = {row["seed"]: row for row in recorded["per_seed"]}
    for row in rerun["per_seed"]:
        by_seed.setdefault(row["seed"], {}).update(row)
    return {**recorded, "seeds": sorted(by_seed), "per_seed": [by_seed[s] for s in sorted(by_seed)]}


if __name__ == "__main__":
    main()
