"""`looprl` command line: run, submit, slurm, plan, config show, plot."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig


def _quiet_env() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


def cmd_run(args: argparse.Namespace) -> int:
    from rl import config
    cfg = config.load(args.recipe, args.overrides)
    from cluster.pipeline import run
    summary = run(cfg, only_stage=args.stage)
    keys = ("accuracy_before_rl", "accuracy_after_rl", "reward/mean", "steps", "wall_s")
    print("looprl summary: " + ", ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else
                                         f"{k}={summary[k]}" for k in keys if k in summary))
    print(f"looprl outputs in {cfg.output_dir}")
    return 0


def check_recipe_here(cfg: DictConfig) -> None:
    """What `looprl run` checks before Ray starts, for the commands that only read a recipe."""
    from cluster.pipeline import check_recipe
    check_recipe(cfg, cfg.model.path)


def cmd_config_show(args: argparse.Namespace) -> int:
    from rl import config
    cfg = config.load(args.recipe, args.overrides)
    check_recipe_here(cfg)
    if args.docs:
        docs = config.field_docs()
        for key, doc in docs.items():
            print(f"{key}: {doc}")
        return 0
    print(config.to_yaml(cfg), end="")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the memory plan of a recipe on a cluster of the given shape; exit 1 when it does not fit."""
    from cluster.plan import Devices, make_plan, render, suggest_fix
    from rl import config
    cfg = config.load(args.recipe, args.overrides)
    devices = Devices(args.nodes, args.gpus_per_node, args.gpu_memory_gib)
    prompt_tokens = args.prompt_tokens or cfg.cluster.plan_prompt_tokens
    plan = make_plan(cfg, devices, prompt_tokens)
    print(render(plan))
    if not plan.problems:
        print("fits")
        return 0
    print("does not fit:\n" + "\n".join(f"  {p}" for p in plan.problems))
    fix = suggest_fix(cfg, devices, prompt_tokens, plan.shape)
    print(f"it would fit with {fix}" if fix else "no single change tried makes it fit")
    return 1


def cmd_submit(args: argparse.Namespace) -> int:
    from rl import config
    check_recipe_here(config.load(args.recipe, args.overrides))  # a bad recipe fails here, not on the cluster
    from cluster.launch import submit_job
    address = args.address or os.environ.get("RAY_DASHBOARD_ADDRESS") or "http://127.0.0.1:8265"
    return submit_job(args.recipe, args.overrides, address, working_dir=args.working_dir, follow=not args.no_follow)


def cmd_slurm(args: argparse.Namespace) -> int:
    from rl import config
    check_recipe_here(config.load(args.recipe, args.overrides))  # a bad recipe fails here, not on the cluster
    from cluster.launch import render_sbatch
    script = render_sbatch(args.recipe, args.overrides, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                           cpus_per_node=args.cpus_per_node, partition=args.partition, time_limit=args.time,
                           job_name=args.job_name, log_dir=args.log_dir, extra_sbatch=args.sbatch)
    out = args.out or f"{args.job_name}.sbatch"
    with open(out, "w") as f:
        f.write(script)
    print(f"wrote {out}")
    if args.submit:
        import subprocess
        return subprocess.run(["sbatch", out]).returncode
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from cluster.plot import plot_run
    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    pn = sub.add_parser("plan", help="memory per role and device from the model's config.json alone, and whether "
                                     "the run fits: looprl plan RECIPE [key=value ...] --nodes 2 --gpus-per-node 8")
    pn.add_argument("recipe")
    pn.add_argument("overrides", nargs="*")
    pn.add_argument("--nodes", type=int, default=1)
    pn.add_argument("--gpus-per-node", type=int, default=8)
    pn.add_argument("--gpu-memory-gib", type=float, default=80.0)
    pn.add_argument("--prompt-tokens", type=int, default=None,
                    help="prompt length the plan assumes (default: cluster.plan_prompt_tokens)")
    pn.set_defaults(fn=cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="looprl", description="Distributed RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a recipe: looprl run recipes/quickstart.yaml key=value ...")
    r.add_argument("recipe")
    r.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=5 learner.lr=1e-5")
    r.add_argument("--stage", default=None, help="run only this stage, from the artifacts of the stages before it "
                                                 "already in output_dir")
    r.set_defaults(fn=cmd_run)
    sj = sub.add_parser("submit", help="submit a recipe to a running Ray cluster (job API), stream its logs")
    sj.add_argument("recipe")
    sj.add_argument("overrides", nargs="*")
    sj.add_argument("--address", default=None,
                    help="dashboard address, e.g. http://HEAD:8265 (default: $RAY_DASHBOARD_ADDRESS or local)")
    sj.add_argument("--working-dir", default=".", help="folder shipped to the cluster (default: .)")
    sj.add_argument("--no-follow", action="store_true", help="return once the job is accepted")
    sj.set_defaults(fn=cmd_submit)
    sl = sub.add_parser("slurm", help="write (and with --submit, sbatch) a multi-node SLURM script for a recipe")
    sl.add_argument("recipe")
    sl.add_argument("overrides", nargs="*")
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument("--gpus-per-node", type=int, default=0)
    sl.add_argument("--cpus-per-node", type=int, default=8)
    sl.add_argument("--partition", default=None)
    sl.add_argument("--time", default=None, help="SLURM time limit, e.g. 24:00:00")
    sl.add_argument("--job-name", default="looprl")
    sl.add_argument("--log-dir", default=".", help="where SLURM writes the job's output")
    sl.add_argument("--sbatch", action="append", default=[], help="extra #SBATCH line, e.g. --sbatch=--account=X")
    sl.add_argument("--out", default=None, help="script path (default JOB_NAME.sbatch)")
    sl.add_argument("--submit", action="store_true", help="submit with sbatch after writing")
    sl.set_defaults(fn=cmd_slurm)
    _add_plan_parser(sub)
    c = sub.add_parser("config", help="inspect recipes")
    csub = c.add_subparsers(dest="config_command", required=True)
    s = csub.add_parser("show", help="print the resolved config with every default")
    s.add_argument("recipe")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--docs", action="store_true", help="print every key with its one-line doc instead")
    s.set_defaults(fn=cmd_config_show)
    sr = sub.add_parser("serve-reward", help="serve a reward plugin over HTTP (recipes call it by URL)")
    sr.add_argument("reward", help="reward spec: short name, module:attr or path/to/file.py:attr")
    sr.add_argument("--host", default="127.0.0.1")
    sr.add_argument("--port", type=int, default=8400)
    sr.add_argument("--params", type=json.loads, default={}, help="JSON keyword arguments passed to the reward")
    sr.add_argument("--timeout-s", type=float, default=10.0, help="per-sample timeout")
    sr.add_argument("--workers", type=int, default=2, help="scoring processes")
    sr.set_defaults(fn=cmd_serve_reward)
    ev = sub.add_parser("eval", add_help=False,
                        help="math benchmark evaluation: mean@k, paired comparison, per-loop accuracy "
                             "(looprl eval --help)")
    ev.add_argument("eval_args", nargs=argparse.REMAINDER)
    ev.set_defaults(fn=cmd_eval)
    pl = sub.add_parser("plot", help="PNG of reward, KL, response length and step-time breakdown")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None, help="output PNG (default RUN_DIR/metrics.png)")
    pl.set_defaults(fn=cmd_plot)
    return p


def cmd_serve_reward(args: argparse.Namespace) -> int:
    from rewards.remote import serve
    serve(args.reward, host=args.host, port=args.port, params=args.params, timeout_s=args.timeout_s,
          num_workers=args.workers)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from cluster.math_eval import main as eval_main
    return eval_main(args.eval_args)


def main(argv: list[str] | None = None) -> int:
    _quiet_env()
    from cluster.ray_utils import skip_optional_imports
    skip_optional_imports()  # the `looprl` process loads models as its actors do (cluster.ray_utils)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:  # its own parser (argparse cannot hand "--help" etc. through a subcommand)
        args = argparse.Namespace(eval_args=argv[1:], fn=cmd_eval)
    else:
        parser = build_parser()
        # overrides may also follow the options (`looprl slurm R --nodes 2 trainer.steps=3`)
        args, extra = parser.parse_known_args(argv)
        if extra:
            if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.overrides = [*args.overrides, *extra]
    from rl.config import ConfigError
    from rl.registry import RegistryError
    from rl.stages import StageError
    try:
        return args.fn(args)
    except (ConfigError, RegistryError, StageError, FileNotFoundError, ConnectionError) as exc:
        print(f"looprl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("looprl: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # any other failure: say what, exit non-zero
        import traceback
        traceback.print_exc()
        print(f"looprl: run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
