"""`looprl` command line: run, config show, plot."""

from __future__ import annotations

import argparse
import os
import sys


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
    from rl.pipeline import run
    summary = run(cfg)
    keys = ("accuracy_before_rl", "accuracy_after_rl", "reward/mean", "steps", "wall_s")
    print("looprl summary: " + ", ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else
                                         f"{k}={summary[k]}" for k in keys if k in summary))
    print(f"looprl outputs in {cfg.output_dir}")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from rl import config
    cfg = config.load(args.recipe, args.overrides)
    if args.docs:
        docs = config.field_docs()
        for key, doc in docs.items():
            print(f"{key}: {doc}")
        return 0
    print(config.to_yaml(cfg), end="")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from rl.plot import plot_run
    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="looprl", description="Distributed RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a recipe: looprl run recipes/quickstart.yaml key=value ...")
    r.add_argument("recipe")
    r.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=5 learner.lr=1e-5")
    r.set_defaults(fn=cmd_run)
    c = sub.add_parser("config", help="inspect recipes")
    csub = c.add_subparsers(dest="config_command", required=True)
    s = csub.add_parser("show", help="print the resolved config with every default")
    s.add_argument("recipe")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--docs", action="store_true", help="print every key with its one-line doc instead")
    s.set_defaults(fn=cmd_config_show)
    pl = sub.add_parser("plot", help="PNG of reward, KL, response length and step-time breakdown")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None, help="output PNG (default RUN_DIR/metrics.png)")
    pl.set_defaults(fn=cmd_plot)
    return p


def main(argv: list[str] | None = None) -> int:
    _quiet_env()
    args = build_parser().parse_args(argv)
    from rl.config import ConfigError
    from rl.registry import RegistryError
    try:
        return args.fn(args)
    except (ConfigError, RegistryError, FileNotFoundError) as exc:
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
