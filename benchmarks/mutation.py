"""Mutation testing: do the tests catch a broken mechanism? mutmut mutates the defining functions of the RL core's
estimators and losses and of the methods, one change at a time (an operator, a constant, a dropped argument), and
runs the fast tests that cover each mutant; a mutant the tests do not fail on survived.

    python benchmarks/mutation.py [--only advantages losses zo_finetuner] [--out benchmarks/results/mutation.json]
    make mutation

The modules and the tests mutmut may run are `[tool.mutmut]` in pyproject.toml; mutmut keeps its work in
`mutants/` and resumes where it stopped. Per target: mutants killed, survived (listed), timed out, and the
kill rate over the mutants that are not equivalent (`EQUIVALENT`: mutants that cannot change a result, each with
the reason). The tests assert on behaviour (values by hand, invariances, effects); none names a mutant.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# target -> mutmut's names of its functions' mutants (`module.x_function__mutmut_N`)
TARGETS = {
    "advantages": "rl.advantages.",
    "losses": "rl.losses.",
    "zo_finetuner": "rl.methods.zo_finetuner.optimizer.",
    "fair_calib": "rl.methods.fair_calib.core.",
    "decomper": "rl.methods.decomper.core.",
}

# mutants that compute the same results as the code (checked by reading them: `mutmut show NAME`)
_DIM = "dim -1 -> +1 on a 2-D [N, L] tensor (or unsqueeze of a 1-D one): the same dimension"
_PRECISION = ("an intermediate's dtype (float64 -> the input's): the same values to float32 rounding; the float64 "
              "guards accumulation over long responses, beyond what a test can tell apart at its sizes")
_DEVICE = ("a tensor made on the default device instead of its input's: the same on the CPU the suite runs on; a "
           "CUDA run of the stage (tests/cluster/test_gpu.py) is what tells them apart")
_CAST = "a dtype the next operation casts to anyway (assignment into a float32 tensor, a bool or int mask times floats)"
EQUIVALENT: dict[str, str] = {
    **{f"rl.advantages.x_discounted_outcome_returns__mutmut_{i}": _DIM for i in (8, 10, 12, 20)},
    "rl.advantages.x_outcome_token_rewards__mutmut_14": _DIM,
    **{f"rl.advantages.x_discounted_outcome_returns__mutmut_{i}": _PRECISION for i in (2, 19)},
    **{f"rl.advantages.x_gae_advantages_and_returns__mutmut_{i}": _PRECISION
       for i in (4, 7, 9, 14, 17, 20, 22, 25, 27)},
    **{f"rl.advantages.x_masked_whiten__mutmut_{i}": _PRECISION for i in (3, 5)},
    **{f"rl.advantages.x_outcome_token_rewards__mutmut_{i}": _CAST for i in (2, 5, 7, 20)},
    "rl.advantages.x_outcome_token_rewards__mutmut_13": "idx + 1 -> idx + 2: still positive at every counted "
                                                        "position, so the argmax (the last one) is the same",
    "rl.advantages.x_group_stats__mutmut_58": "count > 1 -> count >= 1: a group of one has a squared deviation of "
                                              "0, so both branches give a variance of 0",
    **{f"rl.losses.x_aggregate_loss__mutmut_{i}": _DIM for i in (7, 36, 53)},
    "rl.losses.x_kl_in_reward__mutmut_12": _DIM,
    **{f"rl.losses.x_sequence_log_ratio__mutmut_{i}": _DIM for i in (10, 18)},
    "rl.losses.x_rollout_importance_weights__mutmut_53": _DIM,
    "rl.losses.x_aggregate_loss__mutmut_4": _CAST,
    **{f"rl.losses.x_rollout_importance_weights__mutmut_{i}": _CAST for i in (14, 63, 65, 102)},
    "rl.losses.x_sequence_log_ratio__mutmut_2": _CAST,
    "rl.losses.x_soft_overlong_penalty__mutmut_7": _CAST + "; integer lengths minus an integer, clamped with a float "
                                                            "bound, are promoted to float32 anyway",
    "rl.losses.x_rollout_importance_weights__mutmut_31": "the estimator named explicitly (k3) is kl_penalty's default",
    **{f"rl.methods.zo_finetuner.optimizer.x_normalization__mutmut_{i}": _CAST + " (the default float32 is σ's)"
       for i in (3, 5)},
    "rl.methods.zo_finetuner.optimizer.x_pert_features__mutmut_8": _CAST + " (the five features are float32)",
    **{f"rl.methods.zo_finetuner.optimizer.xǁPertBundleǁload__mutmut_{i}": "the file holds tensors, strings, numbers "
       "and tuples: the safe loader (torch's default) and the full one read it alike" for i in (3, 5, 6)},
    **{f"rl.methods.zo_finetuner.optimizer.xǁZOFinetunerǁ__init____mutmut_{i}": "step() sets the scales from the "
       "bundle before it draws a direction: the initial value is never read by a step" for i in (46, 48)},
    "rl.methods.zo_finetuner.optimizer.xǁZOFinetunerǁ_directions__mutmut_6": "xi * 1.0 is xi",
    **{f"rl.methods.fair_calib.core.x_{fn}__mutmut_{i}": _DEVICE for fn, ids in
       (("lags_from_agreement", (18, 20)), ("position_weights", (12, 14, 15, 25, 35, 38))) for i in ids},
    **{f"rl.methods.fair_calib.core.x_{fn}__mutmut_{i}": "block_outputs without its stop runs the blocks after j "
       "too; block j's output is the same" for fn, ids in (("_block_loss", (4, 7)), ("calibrate_blocks", (22, 25)))
       for i in ids},
    **{f"rl.methods.fair_calib.core.x_accumulate_prior__mutmut_{i}": _PRECISION for i in (9, 11)},
    "rl.methods.fair_calib.core.x_calibrate_blocks__mutmut_65": "< -> <= on the best epoch's loss: a later epoch "
                                                                "with exactly the same float loss",
    "rl.methods.decomper.core.x_learn_biases__mutmut_55": "< -> <= on the best epoch's error: a later epoch with "
                                                          "exactly the same float error",
    **{f"rl.methods.decomper.core.x_{fn}__mutmut_{i}": "block_outputs without its stop runs the blocks after j too; "
       "block j's output is the same" for fn, ids in (("_block_mse", (7, 10)), ("learn_biases", (20, 23)))
       for i in ids},
    **{f"rl.methods.decomper.core.x_{fn}__mutmut_{i}": "full_matrices: the first k singular vectors are the same"
       for fn, ids in (("plain_factors", (5, 6)), ("whitened_factors", (23, 25))) for i in ids},
    **{f"rl.methods.decomper.core.x_whitened_factors__mutmut_{i}": _CAST + " (the identity's ones and zeros are "
       "exact in float32, and the sum is float64)" for i in (14, 17)},
    **{f"rl.methods.decomper.core.x_whitened_factors__mutmut_{i}": _DEVICE for i in (15, 18, 24)},
    "rl.methods.decomper.core.x_whitened_factors__mutmut_3": "XᵀX is square: shape[1] is shape[0]",
    "rl.methods.decomper.core.x__block_mse__mutmut_15": _DIM,
    "rl.methods.decomper.core.x_whitened_factors__mutmut_5": "+1e-12 -> -1e-12 in the ridge: it guards an all-zero "
                                                             "XᵀX; with any input energy it is below the ridge's "
                                                             "float64 resolution",
    "rl.methods.zo_finetuner.optimizer.x_learn_to_learn__mutmut_34": "the placeholder before step 0's restart makes "
                                                                      "the optimizer; it is never read",
    "rl.methods.zo_finetuner.optimizer.x_learn_to_learn__mutmut_54": "the rate is set from the decay schedule at every "
                                                                      "step before the optimizer steps",
    "rl.losses.x_rollout_importance_weights__mutmut_58": "the exponent's guard 20 -> 21: e^20 is 4.9e8, so for any "
                                                         "cap below it both cap or mask every ratio that reaches the "
                                                         "guard",
}


def mutmut(*args: str) -> str:
    done = subprocess.run([str(Path(sys.executable).parent / "mutmut"), *args], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"mutmut {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def statuses() -> dict[str, str]:
    """Every mutant's status from `mutmut results --all true` (lines `    name: status`)."""
    out = {}
    for line in mutmut("results", "--all", "true").splitlines():
        name, _, status = line.strip().partition(": ")
        if status:
            out[name] = status
    return out


def summarise(prefix: str, status: dict[str, str]) -> dict:
    mine = {k: v for k, v in status.items() if k.startswith(prefix)}
    equivalent = sorted(k for k in mine if k in EQUIVALENT)
    counted = {k: v for k, v in mine.items() if k not in EQUIVALENT}
    killed = sum(v in ("killed", "timeout") for v in counted.values())
    survived = sorted(k for k, v in counted.items() if v == "survived")
    untested = sorted(k for k, v in counted.items() if v in ("no tests", "not checked", "skipped"))
    return {"mutants": len(mine), "killed": killed, "survived": len(survived), "untested": len(untested),
            "equivalent": len(equivalent), "kill_rate": killed / len(counted) if counted else None,
            "survivors": survived, "untested_mutants": untested,
            "equivalent_mutants": {k: EQUIVALENT[k] for k in equivalent}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(TARGETS), default=sorted(TARGETS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/mutation.json"))
    parser.add_argument("--max-children", type=int, default=2)
    args = parser.parse_args(argv)
    for target in args.only:
        print(f"mutation: {target} ({TARGETS[target]}*)", flush=True)
        mutmut("run", "--max-children", str(args.max_children), TARGETS[target] + "*")
    status = statuses()
    out = Path(args.out)
    recorded = json.loads(out.read_text())["targets"] if out.exists() else {}  # targets not rerun stay as recorded
    report = {"cpu": platform.processor() or platform.machine(),
              "targets": {**recorded, **{t: summarise(TARGETS[t], status) for t in args.only}}}
    out.write_text(json.dumps(report, indent=1))
    print("| target | mutants | killed | survived | untested | equivalent | kill rate |\n|---|---|---|---|---|---|---|")
    for t, r in report["targets"].items():
        rate = "-" if r["kill_rate"] is None else f"{r['kill_rate']:.1%}"
        print(f"| {t} | {r['mutants']} | {r['killed']} | {r['survived']} | {r['untested']} | {r['equivalent']} | "
              f"{rate} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
