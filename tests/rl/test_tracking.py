"""Run logging to MLflow (a local file store: MLflow's own client reads back what looprl logged)."""

import pytest

from rl.loop.tracking import MetricsLogger, flat_params, mlflow_name


def test_metrics_and_the_recipe_reach_mlflow_and_a_resumed_run_continues_its_mlflow_run(tmp_path):
    mlflow = pytest.importorskip("mlflow", reason="needs the mlflow extra: pip install 'looprl[mlflow]'")
    uri = f"file:{tmp_path / 'mlruns'}"
    config = {"trainer": {"steps": 3, "lr": 1e-3}, "model": {"path": None}, "stages": [{"name": "rl"}]}
    out = tmp_path / "run"
    logger = MetricsLogger(out, 3, tensorboard=False, progress_bar=False, config=config, mlflow_tracking_uri=uri)
    for step in (1, 2):
        logger.log(step, {"reward/mean": 0.5 * step, "actor/kl": float("nan"), "note": "text", "done": True})
    logger.close()
    resumed = MetricsLogger(out, 3, tensorboard=False, progress_bar=False, config=config, start_step=2,
                            mlflow_tracking_uri=uri)
    resumed.log(3, {"reward/mean": 1.5})
    resumed.close()
    client = mlflow.tracking.MlflowClient(uri)
    experiment = client.get_experiment_by_name("looprl")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "run/rl" and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert "actor/kl" not in runs[0].data.metrics and "note" not in runs[0].data.metrics  # NaN and text left out
    assert runs[0].data.params["trainer.steps"] == "3" and runs[0].data.params["model.path"] == "None"


def test_nested_recipe_keys_become_dotted_parameters():
    assert flat_params({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2], "f": {}}) == {
        "a.b": "1", "a.c.d": "x", "e": "[1, 2]", "f": "{}"}
    assert len(flat_params({"long": "x" * 7000})["long"]) == 6000


def test_metric_keys_become_names_mlflow_accepts():
    assert mlflow_name("reward/mean") == "reward/mean"
    assert mlflow_name("reward//tmp/x/flaky.py:flaky") == "reward/tmp/x/flaky.py:flaky"
    assert mlflow_name("reward/../a*b") == "reward/_/a_b"
