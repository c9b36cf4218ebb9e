from pathlib import Path

import pytest

from rl import config
from rl.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    cfg = config.load(_write(tmp_path, "trainer: {steps: 3}\n"), ["learner.lr=3e-5", "rollout.n=4"])
    assert cfg.trainer.steps == 3
    assert cfg.learner.lr == pytest.approx(3e-5)
    assert cfg.rollout.n == 4
    assert cfg.algorithm.loss == "ppo_clip"  # default filled in


def test_unknown_nested_key_names_path_and_closest(tmp_path):
    with pytest.raises(ConfigError) as e:
        config.load(_write(tmp_path, "learner:\n  lerning_rate: 1.0\n  lr: 2\n"))
    msg = str(e.value)
    assert "learner.lerning_rate" in msg and "r.yaml" in msg
    with pytest.raises(ConfigError, match=r"did you mean 'rollout.temperature'"):
        config.load(_write(tmp_path, "rollout: {temprature: 0.5}\n"))


def test_unknown_key_in_list_item(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].wieght.*did you mean 'reward.functions\[0\].weight'"):
        config.load(_write(tmp_path, "reward:\n  functions:\n    - {name: math, wieght: 2}\n"))


def test_unknown_override_key():
    with pytest.raises(ConfigError, match="trainer.stepz"):
        config.load(None, ["trainer.stepz=3"])


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match="trainer.steps"):
        config.load(_write(tmp_path, "trainer: {steps: many}\n"))


def test_malformed_yaml(tmp_path):
    with pytest.raises(ConfigError, match="malformed YAML"):
        config.load(_write(tmp_path, "trainer: {steps: 3\n  bad: [\n"))


def test_missing_recipe(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.yaml")


def test_cross_field_validation(tmp_path):
    with pytest.raises(ConfigError, match="learner.world_size"):
        config.load(None, ["trainer.prompts_per_step=3", "rollout.n=1", "learner.world_size=2"])
    with pytest.raises(ConfigError, match="algorithm.kl_estimator"):
        config.load(None, ["algorithm.kl_estimator=k7"])
    with pytest.raises(ConfigError, match="cuda_ipc needs cluster.placement: colocated"):
        config.load(None, ["rollout.weight_sync=cuda_ipc", "cluster.placement=split"])


def test_gpu_only_weight_sync_is_refused_before_any_actor_starts():
    from cluster.ray_utils import Placement
    from cluster.rl_roles import RayRLRoles
    from rl.algorithm import RLAlgorithm
    cfg = config.load(None, ["rollout.weight_sync=cuda_ipc"])
    with pytest.raises(ValueError, match="cuda_ipc needs GPUs"):
        RayRLRoles(cfg, RLAlgorithm(cfg), "unused", None, Placement(None, [0], [0], gpus_per_actor=0.0), None)
    cfg = config.load(None, ["rollout.weight_sync=collective"])
    with pytest.raises(ValueError, match="needs cluster.placement: split"):
        RayRLRoles(cfg, RLAlgorithm(cfg), "unused", None, Placement(None, [0], [0], gpus_per_actor=0.5), None)


def test_every_field_has_a_doc():
    docs = config.field_docs()
    assert docs["learner.zero_stage"].startswith("ZeRO stage")
    assert "rollout.n" in docs and "reward.functions" in docs
    assert all(v for v in docs.values())


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("**/*.yaml")), ids=lambda p: p.name)
def test_every_recipe_is_an_executable_looprl_run(recipe):
    # `./recipes/x.yaml key=value` runs locally and `ray job submit ... -- recipes/x.yaml` on a cluster
    import os
    assert recipe.read_text().splitlines()[0] == "#!/usr/bin/env -S looprl run"
    assert os.access(recipe, os.X_OK), f"{recipe} lacks the run bit"


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("**/*.yaml")), ids=lambda p: p.name)
def test_every_recipe_validates(recipe):
    cfg = config.load(recipe)
    assert cfg.output_dir
    # every component and its parameters (engines included, less what looprl sets itself) and every stage, as
    # `looprl run` checks them before any actor starts
    from cluster.pipeline import check_recipe
    check_recipe(cfg, None)


def test_a_loss_that_needs_outputs_the_family_lacks_fails_at_start_up():
    from cluster.pipeline import check_recipe
    cfg = config.load(ROOT / "recipes/rltt_tiny.yaml", ["model.family=causal"])
    with pytest.raises(ValueError, match=r"loss 'rltt' needs \['loop_logp'\].*family 'causal'"):
        check_recipe(cfg, None)
    check_recipe(config.load(ROOT / "recipes/rltt_tiny.yaml"), None)  # auto: the tiny ouro arch is looped


@pytest.mark.parametrize("overrides,match", [
    (["learner.pack_sequences=true"], r"learner.pack_sequences: model family 'looped' cannot run packed"),
    (["rollout.top_p=0.9"], r"rollout.top_p / rollout.top_k: loss 'rltt' reads per-loop logprobs"),
])
def test_learner_options_the_model_family_or_loss_cannot_serve_fail_at_start_up(overrides, match):
    from cluster.pipeline import check_recipe
    with pytest.raises(ValueError, match=match):
        check_recipe(config.load(ROOT / "recipes/rltt_tiny.yaml", overrides), None)
    check_recipe(config.load(ROOT / "recipes/quickstart.yaml", [*overrides, "learner.max_tokens_per_micro_batch=512"]),
                     None)  # the causal family packs, and the ppo loss works on the truncated distribution


SP = ["learner.sequence_parallel_size=2", "learner.world_size=2", "learner.attn_implementation=sdpa"]


@pytest.mark.parametrize("recipe,overrides,match", [
    ("quickstart", ["learner.sequence_parallel_size=3", *SP[1:]], r"sequence_parallel_size 3: must .* divide"),
    ("llada_sft_tiny", SP, r"sequence_parallel_size: model family 'masked_diffusion' runs its own attention"),
    ("quickstart", [*SP, "learner.pack_sequences=true"], r"sequence_parallel_size: runs one sequence per row"),
    ("quickstart", SP[:2], r"sequence_parallel_size: needs learner.attn_implementation sdpa"),
    ("quickstart", [*SP[:2], "learner.attn_implementation=eager"], r"attn_implementation sdpa .* not 'eager'"),
])
def test_sequence_parallelism_is_refused_where_it_cannot_run(recipe, overrides, match):
    from cluster.pipeline import check_recipe
    with pytest.raises(ValueError, match=match):
        check_recipe(config.load(ROOT / f"recipes/{recipe}.yaml", overrides), None)
    check_recipe(config.load(ROOT / "recipes/quickstart.yaml", SP), None)
    check_recipe(config.load(ROOT / "recipes/rltt_tiny.yaml", SP), None)  # the looped family runs it too


@pytest.mark.parametrize("recipe,overrides,match", [
    ("rltt_tiny", [], r"learner.share_prompts: model family 'looped' runs its own forward"),
    ("quickstart", ["learner.pack_sequences=true", "learner.attn_implementation=flash_attention_2"],
     r"learner.share_prompts: a packed row shares its prompts through looprl's variable-length attention"),
    ("quickstart", ["model.gradient_checkpointing=true"], r"learner.share_prompts: model.gradient_checkpointing"),
])
def test_shared_prompts_are_refused_where_no_prompt_cache_can_run(recipe, overrides, match):
    from cluster.pipeline import check_recipe
    with pytest.raises(ValueError, match=match):
        check_recipe(config.load(ROOT / f"recipes/{recipe}.yaml", ["learner.share_prompts=true", *overrides]), None)
    check_recipe(config.load(ROOT / "recipes/quickstart.yaml", ["learner.share_prompts=true"]), None)
    # a packed row shares prompts without a KV cache, so with gradient checkpointing too
    check_recipe(config.load(ROOT / "recipes/quickstart.yaml", [
        "learner.share_prompts=true", "learner.pack_sequences=true", "model.gradient_checkpointing=true"]), None)


def test_compiled_position_wise_modules_are_refused_under_zero3():
    from cluster.pipeline import check_recipe
    with pytest.raises(ConfigError, match="learner.compile_position_wise: ZeRO-3 gathers"):
        check_recipe(config.load(ROOT / "recipes/quickstart.yaml", [
            "learner.compile_position_wise=true", "learner.zero_stage=3"]), None)
    check_recipe(config.load(ROOT / "recipes/quickstart.yaml", [
        "learner.compile_position_wise=true", "learner.zero_stage=2"]), None)


@pytest.mark.parametrize("override,match", [
    ("learner.optimizer.params.betaz=[0.9,0.99]", "learner.optimizer.params.betaz: optimizer 'adamw' has no parameter"),
    ("learner.optimizer.name=lion", "unknown optimizer 'lion'"),
    ("learner.scheduler.params.min_lr_ratio=0.2", "constant' has no parameter 'min_lr_ratio'"),
    ("learner.optimizer={name: mezo, params: {eps: 0.001}}", None),
])
def test_optimizer_and_scheduler_components_are_checked(override, match):
    from cluster.pipeline import check_recipe
    overrides = [override, "learner.zero_stage=1"] if "mezo" in override else [override]
    cfg = config.load(ROOT / "recipes/quickstart.yaml", overrides)
    with pytest.raises(Exception, match=match or "forward-only.*zero_stage 0"):
        check_recipe(cfg, None)


def test_decoding_methods_need_the_hf_engine_and_known_params():
    with pytest.raises(ConfigError, match="rollout.decoding.*rollout.engine: hf"):
        config.load(ROOT / "recipes/quickstart.yaml", ["rollout.engine=vllm", "rollout.decoding=plain"])
    from cluster.pipeline import check_recipe
    cfg = config.load(ROOT / "recipes/quickstart.yaml", ["rollout.eval_decoding=plain",
                                                         "rollout.eval_decoding_params={window: 3}"])
    with pytest.raises(Exception, match="rollout.eval_decoding_params.window: decoding 'plain' has no parameter"):
        check_recipe(cfg, None)


def test_in_flight_updates_run_on_both_engines_without_decoding_methods():
    for engine in ("hf", "vllm"):
        assert config.load(None, [f"rollout.engine={engine}", "rollout.in_flight_updates=true"]).rollout.in_flight_updates
    with pytest.raises(ConfigError, match="rollout.in_flight_updates.*rollout.decoding null"):
        config.load(None, ["rollout.in_flight_updates=true", "rollout.decoding=densesteer"])
    with pytest.raises(ConfigError, match="rollout.in_flight_updates.*single-turn"):
        config.load(None, ["rollout.in_flight_updates=true", "rollout.env=calculator"])


def test_engine_options_follow_the_engine():
    """The quickstart's options are the hf engine's: switching the engine from the command line takes the vllm
    section (none here) instead of handing vllm hf's `attn_implementation`."""
    from cluster.pipeline import check_recipe
    from rl.recipe import engine_options
    for engine, expected in (("hf", {"attn_implementation": "eager"}), ("vllm", {"max_model_len": 96})):
        cfg = config.load(ROOT / "recipes/quickstart.yaml", [f"rollout.engine={engine}",
                                                             "rollout.engine_params.vllm={max_model_len: 96}"])
        check_recipe(cfg, None)
        assert engine_options(cfg.rollout.engine_params, engine, "rollout.engine_params") == expected
    check_recipe(config.load(ROOT / "recipes/quickstart.yaml", ["rollout.engine=vllm"]), None)
    # an option the engine lacks is named under its section; options beside sections are refused
    with pytest.raises(Exception, match="rollout.engine_params.hf.max_model_len: engine 'hf' has no parameter"):
        check_recipe(config.load(ROOT / "recipes/quickstart.yaml", ["rollout.engine_params.hf.max_model_len=9"]), None)
    with pytest.raises(ConfigError, match=r"rollout.engine_params: \['max_model_len'\] sit beside the engine sections"):
        check_recipe(config.load(ROOT / "recipes/quickstart.yaml", ["rollout.engine_params.max_model_len=9"]), None)
    # the older flat form still reaches the configured engine, with a deprecation warning
    with pytest.warns(FutureWarning, match=r"write \{vllm: \{\"max_model_len\": 9\}\}"):
        assert engine_options({"max_model_len": 9}, "vllm", "rollout.engine_params") == {"max_model_len": 9}


def test_a_moved_key_names_its_new_place(tmp_path):
    p = _write(tmp_path, "learner:\n  betas: [0.9, 0.95]\n")
    with pytest.raises(ConfigError, match="'learner.betas' is now 'learner.optimizer.params.betas'"):
        config.load(p)


def test_a_tensor_parallel_judge_needs_as_many_gpus(tmp_path):
    bad = "reward.judges={j: {engine: vllm, num_gpus: 2, engine_params: {vllm: {tensor_parallel_size: 4}}}}"
    with pytest.raises(config.ConfigError, match=r"reward.judges.j.num_gpus"):
        config.load(ROOT / "recipes/quickstart.yaml", [bad])


@pytest.mark.parametrize("engine_params", ["{}", "{hf: {tensor_parallel_size: 2}}", "{vllm: {max_model_len: 512}}"])
def test_a_vllm_judge_that_reserves_more_gpus_than_its_engine_runs_on_is_refused(engine_params):
    """Two GPUs per worker with vLLM's options missing or under another engine's section: one GPU would idle."""
    bad = f"reward.judges={{j: {{engine: vllm, num_gpus: 2, engine_params: {engine_params}}}}}"
    with pytest.raises(config.ConfigError, match=r"reward.judges.j.num_gpus'*: reserves 2 GPUs .* tensor_parallel_size \(1\)"):
        config.load(ROOT / "recipes/quickstart.yaml", [bad])
    config.load(ROOT / "recipes/quickstart.yaml", [bad.replace("num_gpus: 2", "num_gpus: 1")])
    config.load(ROOT / "recipes/quickstart.yaml", [
        "reward.judges={j: {engine: vllm, num_gpus: 2, engine_params: {vllm: {tensor_parallel_size: 2}}}}"])


def test_cli_config_show_and_error_exit(tmp_path, capsys):
    """The CLI's entry point in process (`python -m cluster.cli` exits with what `main` returns)."""
    from cluster.cli import main
    assert main(["config", "show", str(ROOT / "recipes/quickstart.yaml"), "trainer.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "steps: 7" in out and "zero_stage: 0" in out
    assert main(["config", "show", str(ROOT / "recipes/quickstart.yaml"), "trainer.stepz=7"]) == 2
    err = capsys.readouterr().err
    assert "trainer.stepz" in err and "did you mean 'trainer.steps'" in err


def test_base_recipe_is_merged_first(tmp_path):
    (tmp_path / "a.yaml").write_text("trainer: {steps: 5, prompts_per_step: 8}\nlearner: {lr: 0.5}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\ntrainer: {steps: 9}\n")
    cfg = config.load(tmp_path / "b.yaml")
    assert (cfg.trainer.steps, cfg.trainer.prompts_per_step, cfg.learner.lr) == (9, 8, 0.5)
    (tmp_path / "c.yaml").write_text("base: d.yaml\n")
    (tmp_path / "d.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        config.load(tmp_path / "c.yaml")
    (tmp_path / "e.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml"):
        config.load(tmp_path / "e.yaml")
    (tmp_path / "f.yaml").write_text("base: a.yaml\nlearner: {lrr: 1}\n")
    with pytest.raises(ConfigError, match=r"f.yaml: unknown key 'learner.lrr'"):
        config.load(tmp_path / "f.yaml")


def test_a_whole_mapping_override_replaces_and_a_dotted_one_updates():
    # switching the loss must not keep the recipe's previous loss parameters
    cfg = config.load(ROOT / "recipes/rltt_tiny.yaml", ["algorithm.loss=ppo_clip", "algorithm.loss_params={eps_low: 0.1}"])
    assert dict(cfg.algorithm.loss_params) == {"eps_low": 0.1}
    cfg = config.load(ROOT / "recipes/quickstart.yaml", ["algorithm.loss_params.eps_low=0.1"])
    assert dict(cfg.algorithm.loss_params) == {"eps_low": 0.1, "eps_high": 0.2}


@pytest.mark.parametrize("overrides,key", [
    (["rollout.sleep_between_phases=true", "trainer.max_staleness=1"], "rollout.sleep_between_phases"),
    (["learner.offload_between_phases=true", "learner.zero_stage=2", "cluster.placement=split"],
     "learner.offload_between_phases"),
    (["learner.offload_between_phases=true", "learner.zero_stage=0"], "learner.offload_between_phases"),
])
def test_phase_swapping_needs_colocated_synchronous_zero(overrides, key):
    with pytest.raises(config.ConfigError, match=key):
        config.load(ROOT / "recipes/quickstart.yaml", overrides)


def test_a_reward_function_twice_needs_labels():
    twice = "reward.functions=[{name: math}, {name: math, weight: 0.0}]"
    with pytest.raises(config.ConfigError, match="appear more than once"):
        config.load(ROOT / "recipes/quickstart.yaml", [twice])
    cfg = config.load(ROOT / "recipes/quickstart.yaml",
                      ["reward.functions=[{name: math}, {name: math, weight: 0.0, label: math_heldout}]"])
    assert cfg.reward.functions[1].label == "math_heldout"

    with pytest.raises(config.ConfigError, match="eval_only"):
        config.load(ROOT / "recipes/quickstart.yaml", ["reward.functions=[{name: math, eval_only: true}]"])


@pytest.mark.parametrize("overrides,match", [
    (["rollout.tensor_parallel_size=2"], r"'rollout.tensor_parallel_size': the hf engine runs on one device"),
    (["rollout.tensor_parallel_size=2", "rollout.engine=vllm", "rollout.weight_sync=cuda_ipc"],
     r"'rollout.tensor_parallel_size': cuda_ipc pairs each rollout engine"),
    (["rollout.tensor_parallel_size=0", "rollout.engine=vllm"], r"'rollout.tensor_parallel_size': must be >= 1"),
])
def test_tensor_parallel_rollout_is_refused_where_it_cannot_run(overrides, match):
    with pytest.raises(config.ConfigError, match=match):
        config.load(ROOT / "recipes/quickstart.yaml", overrides)
    config.load(ROOT / "recipes/quickstart.yaml", ["rollout.tensor_parallel_size=2", "rollout.engine=vllm"])


def test_a_tensor_parallel_engine_on_gpus_needs_bundles_of_its_own():
    from rl.validation import check_tensor_parallel
    with pytest.raises(config.ConfigError, match="needs cluster.placement: split"):
        check_tensor_parallel(2, gpus=True, colocated=True)
    check_tensor_parallel(2, gpus=True, colocated=False)
    check_tensor_parallel(2, gpus=False, colocated=True)  # on CPU the engine's ranks split the actor's cores
    check_tensor_parallel(1, gpus=True, colocated=True)
