"""The stage pipeline: a user stage between SFT and RL, artifact reuse by fingerprint, `--stage` alone."""

import json
from pathlib import Path

import pytest

from cluster.pipeline import run
from rl import config
from rl.stages import StageError

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=64", "data.synthetic.num_train=80", "data.synthetic.num_eval=8",
        "rollout.n=4", "rollout.max_new_tokens=12", "trainer.prompts_per_step=4", "learner.micro_batch_size=8",
        "reward.num_workers=1", "logging.progress_bar=false", "logging.tensorboard=false", "sft.enabled=false",
        "trainer.steps=1"]

SELECT_STAGE = '''
import json
from pathlib import Path


class KeepFirst:
    """Data selection: keep the first `keep` training rows (counts its runs in its folder)."""
    resources = {"num_cpus": 0.25}

    def __init__(self, keep: int):
        self.keep = keep

    def run(self, ctx):
        rows = Path(ctx.require("train")).read_text().splitlines()[: self.keep]
        out = ctx.stage_dir / "train.jsonl"
        out.write_text("\\n".join(rows) + "\\n")
        runs = ctx.stage_dir / "runs"
        runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))
        ctx.summary["selected_rows"] = len(rows)
        return {"train": str(out)}
'''


def _cfg(tmp_path, keep, *extra, evaluate="{}"):
    plugin = tmp_path / "select_stage.py"
    plugin.write_text(SELECT_STAGE)
    stages = ("stages=[{name: model}, {name: data}, {name: sft}, "
              f"{{name: '{plugin}:KeepFirst', label: select, params: {{keep: {keep}}}}}, "
              f"{{name: rl}}, {{name: export}}, {{name: evaluate, params: {evaluate}}}]")
    return config.load(ROOT / "recipes/quickstart.yaml", [f"output_dir={tmp_path / 'run'}", *TINY, stages, *extra])


@pytest.mark.extended  # CI: a user stage feeds RL in tests/test_extending.py; reuse and the rerun of what follows a
@pytest.mark.slow      # changed stage in tests/cluster/test_pipeline.py (the SFT warm-up stage)
def test_a_user_stage_feeds_rl_is_reused_and_reruns_with_everything_after_it_when_changed(ray_cluster, tmp_path):
    first = run(_cfg(tmp_path, 20))
    runs = tmp_path / "run" / "stages" / "select" / "runs"
    assert first["selected_rows"] == 20 and first["rl_train_rows"] == 20
    assert first["rl_train_path"] == first["stages"]["select"]["artifacts"]["train"]
    assert list(first["stages"]) == ["model", "data", "sft", "select", "rl", "export", "evaluate"]
    assert all(not s["reused"] and s["wall_s"] >= 0 for s in first["stages"].values())
    assert runs.read_text() == "1"

    again = run(_cfg(tmp_path, 20))
    assert all(s["reused"] for s in again["stages"].values()) and runs.read_text() == "1"
    assert again["accuracy_after_rl"] == first["accuracy_after_rl"]  # the summary comes back from the records

    changed = run(_cfg(tmp_path, 12))
    reused = {name: s["reused"] for name, s in changed["stages"].items()}
    assert reused == {"model": True, "data": True, "sft": True, "select": False, "rl": False, "export": False,
                      "evaluate": False}
    assert runs.read_text() == "2" and changed["rl_train_rows"] == 12

    # one stage alone, from the records on disk: evaluation of the exported policy, with no live trainer,
    # gives the held-out figures the run gave with the trainer's own rollout workers
    alone = run(_cfg(tmp_path, 12), only_stage="evaluate")
    assert list(alone["stages"]) == ["evaluate"]
    assert alone["accuracy_after_rl"] == changed["accuracy_after_rl"]
    assert alone["heldout_rewards_after_rl"] == changed["heldout_rewards_after_rl"]
    with pytest.raises(StageError, match="--stage 'nope'"):
        run(_cfg(tmp_path, 12), only_stage="nope")
    record = json.loads((tmp_path / "run" / "stages" / "select.json").read_text())
    assert record["complete"] and record["artifacts"]["train"].endswith("stages/select/train.jsonl")

    # the evaluation protocol: only the evaluate stage runs again, on the exported policy (no live trainer),
    # and compares it with the policy RL started from on the same sampled runs
    protocol = run(_cfg(tmp_path, 12, evaluate="{runs: 2, temperature: 1.0, compare_before: true}"))
    assert [n for n, st in protocol["stages"].items() if not st["reused"]] == ["evaluate"]
    p = protocol["eval_protocol"]
    assert p["mean_at_k"]["runs"] == 2 and p["mean_at_k"]["problems"] == 8 and p["paired"]["problems"] == 8
    assert p["before_policy"] == changed["stages"]["model"]["artifacts"]["policy"]  # sft off: the base model
    assert protocol["accuracy_after_rl"] == changed["accuracy_after_rl"]


def test_a_bad_stage_param_names_the_recipe_key_at_start_up(tmp_path):
    from cluster.pipeline import check_recipe
    cfg = config.load(ROOT / "recipes/quickstart.yaml", [
        "stages=[{name: model}, {name: data}, {name: sft}, {name: rl, params: {keep: 3}}]"])
    with pytest.raises(StageError, match=r"stages\[3\].params: stage 'rl' does not take \['keep'\]"):
        check_recipe(cfg, None)
    bad = config.load(ROOT / "recipes/quickstart.yaml", ["stages=[{name: model}, {name: selectt}]"])
    with pytest.raises(Exception, match="unknown stage 'selectt'"):
        check_recipe(bad, None)


COUNTING_STAGE = '''
from pathlib import Path


class CountRuns:
    """A driver stage that reads a user file and counts its runs."""
    runs_in_driver = True

    def __init__(self, source: str):
        self.source = source

    def input_files(self, cfg):
        return [self.source]

    def run(self, ctx):
        runs = ctx.stage_dir / "runs"
        runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))
        return {"copy": str(runs)}
'''


def test_a_stage_runs_again_when_a_file_it_reads_is_edited_in_place(tmp_path):
    from cluster.stage_runner import run_stages
    plugin, source = tmp_path / "count_stage.py", tmp_path / "rows.jsonl"
    plugin.write_text(COUNTING_STAGE)
    source.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = config.load(ROOT / "recipes/quickstart.yaml", [
        f"output_dir={tmp_path / 'run'}", f"stages=[{{name: '{plugin}:CountRuns', label: count, "
                                          f"params: {{source: '{source}'}}}}]"])
    runs = tmp_path / "run" / "stages" / "count" / "runs"
    run_stages(cfg, runtime=None)
    assert run_stages(cfg, runtime=None)["stages"]["count"]["reused"] and runs.read_text() == "1"
    source.write_text('{"prompt": "12+2=", "answer": "14"}\n')  # (a new size: robust to coarse mtimes)
    assert not run_stages(cfg, runtime=None)["stages"]["count"]["reused"] and runs.read_text() == "2"


def test_checkpoint_selection_keeps_the_selected_one_from_pruning(tmp_path):
    import json

    from rl.loop.checkpoints import improves, prune_checkpoints, selected_checkpoint
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "COMPLETE").write_text("")
    (root / "best.json").write_text(json.dumps({"checkpoint": "step_2", "step": 2, "metric": "eval/accuracy",
                                                "value": 0.5}))
    prune_checkpoints(root, keep=1)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_2", "step_4"]
    best = selected_checkpoint(tmp_path)
    assert best["step"] == 2
    assert improves(0.6, best, "max") and not improves(0.5, best, "max") and not improves(0.4, best, "max")
    assert improves(0.4, best, "min") and improves(1.0, None, "min")
