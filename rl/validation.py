"""Every rule a recipe must satisfy across its keys, written once with one message, checked before any actor
starts: `check_values` when a recipe is loaded (`rl.config.load`), `check_components` once its components can be
resolved (the driver calls it with the model folder before it starts Ray). The learner checks the rules that
concern its own arguments with the same functions (`check_learner`), so a learner started outside a recipe
fails with the same message."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from rl.batch import NAMED_FIELDS
from rl.losses import LOSS_INPUTS
from rl.recipe import (
    ConfigError,
    as_container,
    engine_options,
    model_family,
    model_type_of,
    needs_critic,
    policy_loss_params,
)
from rl.registry import check_params, lookup, required_parameters


def need(cond: bool, key: str, msg: str) -> None:
    """Raise the recipe error for `key` unless `cond`."""
    if not cond:
        raise ConfigError(f"invalid value for {key!r}: {msg}")


# ------------------------------------------------------------------------------------------------- values
def check_values(cfg: DictConfig) -> None:
    """The recipe's values, alone and against each other (no component is resolved)."""
    _check_rollout_values(cfg)
    _check_learner_values(cfg)
    _check_algorithm_values(cfg)
    _check_trainer_values(cfg)
    _check_reward_and_stage_values(cfg)


def _check_rollout_values(cfg: DictConfig) -> None:
    r = cfg.rollout
    need(r.n >= 1, "rollout.n", "must be >= 1")
    need(r.num_workers >= 1, "rollout.num_workers", "must be >= 1")
    need(r.eval_runs >= 1, "rollout.eval_runs", "must be >= 1")
    need(r.eval_runs == 1 or r.eval_temperature > 0, "rollout.eval_runs",
         "independent runs need sampling: set rollout.eval_temperature > 0 (greedy runs are all the same)")
    need(0 < r.eval_top_p <= 1, "rollout.eval_top_p", "must be in (0, 1]")
    need(r.weight_sync in ("object_store", "collective", "cuda_ipc"), "rollout.weight_sync",
         "must be object_store, collective or cuda_ipc")
    need(r.weight_sync != "cuda_ipc" or (cfg.cluster.placement == "colocated"
                                         and r.num_workers <= cfg.learner.world_size),
         "rollout.weight_sync", "cuda_ipc needs cluster.placement: colocated and rollout.num_workers <= "
         "learner.world_size (each rollout worker shares a GPU with a learner rank)")
    need(r.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1")
    need(r.tensor_parallel_size == 1 or r.engine == "vllm", "rollout.tensor_parallel_size",
         f"the {r.engine} engine runs on one device; tensor parallelism needs rollout.engine vllm")
    need(r.tensor_parallel_size == 1 or r.weight_sync != "cuda_ipc", "rollout.tensor_parallel_size",
         "cuda_ipc pairs each rollout engine with one learner rank's GPU; use collective or object_store")
    for key in ("decoding", "eval_decoding"):
        method = r[key]
        need(method is None or r.engine != "vllm", f"rollout.{key}",
             f"the vllm engine cannot serve decoding method {method!r} (its hooks run in the hf engine's decode "
             f"loop): set rollout.engine: hf")
    need(r.max_turns >= 1, "rollout.max_turns", "must be >= 1")
    need(r.max_episode_tokens >= 1, "rollout.max_episode_tokens", "must be >= 1")
    need(r.agent_loop in ("lockstep", "per_episode"), "rollout.agent_loop",
         f"must be lockstep or per_episode, got {r.agent_loop!r}")
    need(r.env_workers >= 1, "rollout.env_workers", "must be >= 1")
    if r.partial_tokens:
        need(r.partial_tokens > 0, "rollout.partial_tokens", "must be >= 0")
        need(r.env is None and r.agent is None and r.decoding is None and not r.in_flight_updates,
             "rollout.partial_tokens", "partial rollouts continue plain single-turn responses: no rollout.env, "
             "agent, decoding or in_flight_updates")
        need(r.partial_groups == 0 or r.partial_groups >= cfg.trainer.prompts_per_step, "rollout.partial_groups",
             "must be 0 or at least trainer.prompts_per_step")
        need(not cfg.algorithm.dynamic_sampling, "rollout.partial_tokens",
             "the pool already trains on the groups that finish first: algorithm.dynamic_sampling false")
    if r.in_flight_updates:
        need(r.decoding is None, "rollout.in_flight_updates",
             "weights are swapped between decode steps of the hf engine's plain loop or vLLM's engine steps: "
             "rollout.decoding null")
        need(r.weight_sync in ("object_store", "collective"), "rollout.in_flight_updates",
             "needs rollout.weight_sync object_store or collective")
        need(r.env is None and r.agent is None, "rollout.in_flight_updates", "single-turn generation only")
    need(r.agent is None or r.env is None, "rollout.agent",
         "an agent program drives its own episodes: set rollout.env or rollout.agent, not both")
    need(r.agent_timeout_s > 0, "rollout.agent_timeout_s", "must be > 0")
    need(r.env_step_timeout_s >= 0, "rollout.env_step_timeout_s", "must be >= 0 (0: no deadline)")
    need(r.sandbox in ("bwrap", "process"), "rollout.sandbox", f"must be bwrap or process, got {r.sandbox!r}")


def _check_learner_values(cfg: DictConfig) -> None:
    lc = cfg.learner
    need(lc.zero_stage in (0, 1, 2, 3), "learner.zero_stage", "must be 0, 1, 2 or 3")
    need(lc.world_size >= 1, "learner.world_size", "must be >= 1")
    need(cfg.cluster.placement in ("colocated", "split"), "cluster.placement", "must be colocated or split")
    need(cfg.model.dtype in ("float32", "bfloat16"), "model.dtype", "must be float32 or bfloat16")
    for key, on in (("rollout.sleep_between_phases", cfg.rollout.sleep_between_phases),
                    ("learner.offload_between_phases", lc.offload_between_phases)):
        need(not on or (cfg.cluster.placement == "colocated" and cfg.trainer.max_staleness == 0), key,
             "needs cluster.placement: colocated and trainer.max_staleness: 0 (the roles take turns on one device)")
    need(not lc.offload_between_phases or lc.zero_stage >= 1, "learner.offload_between_phases",
         "needs learner.zero_stage 1-3 (DeepSpeed offloads the states of its ZeRO optimizers)")


def _check_algorithm_values(cfg: DictConfig) -> None:
    a = cfg.algorithm
    need(a.kl_estimator in ("k1", "k2", "k3"), "algorithm.kl_estimator", "must be k1, k2 or k3")
    need(a.loss_agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
         "algorithm.loss_agg", "must be token-mean, seq-mean-token-mean or seq-mean-token-sum-norm")
    total = cfg.trainer.prompts_per_step * cfg.rollout.n
    per_update = total // max(a.mini_batches, 1)
    need(total % a.mini_batches == 0, "algorithm.mini_batches", f"must divide prompts_per_step*n = {total}")
    need(per_update % cfg.learner.world_size == 0, "learner.world_size",
         f"must divide the samples per optimizer step ({per_update})")
    need(a.is_correction in ("none", "token", "sequence"), "algorithm.is_correction",
         "must be none, token or sequence")
    need(a.is_mode in ("truncate", "mask"), "algorithm.is_mode", "must be truncate or mask")
    need(a.is_cap > 0, "algorithm.is_cap", "must be > 0")
    need(a.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds", "must be >= 1")
    need(0 <= a.overlong_buffer <= cfg.rollout.max_new_tokens, "algorithm.overlong_buffer",
         "must be between 0 and rollout.max_new_tokens")
    need(a.distill_coef >= 0, "algorithm.distill_coef", "must be >= 0")
    need(a.distill_reward_weight >= 0, "algorithm.distill_reward_weight", "must be >= 0 (0: distillation alone)")


def _check_trainer_values(cfg: DictConfig) -> None:
    t, s = cfg.trainer, cfg.sft
    need(t.select_mode in ("max", "min"), "trainer.select_mode", "must be max or min")
    need(t.select_by is None or t.select_by.startswith("eval/"), "trainer.select_by",
         "must name a held-out metric (eval/accuracy or eval/reward/<label>), not a training one")
    need(t.max_staleness >= 0, "trainer.max_staleness", "must be >= 0")
    need(s.loop_readouts in ("final", "all"), "sft.loop_readouts", "must be final or all")
    need(s.format in ("auto", "prompt_response", "messages"), "sft.format",
         f"must be auto, prompt_response or messages, got {s.format!r}")
    need(s.sampler in ("auto", "shuffle", "sequential"), "sft.sampler",
         f"must be auto, shuffle or sequential, got {s.sampler!r}")
    need(cfg.data.bad_rows in ("error", "drop"), "data.bad_rows", f"must be error or drop, got {cfg.data.bad_rows!r}")
    need(s.bad_rows in ("error", "drop"), "sft.bad_rows", f"must be error or drop, got {s.bad_rows!r}")
    need(0.0 <= s.eval_fraction < 1.0, "sft.eval_fraction", f"must be in [0, 1), got {s.eval_fraction}")
    need(cfg.resume in ("no", "auto") or Path(cfg.resume).exists(), "resume",
         f"must be no, auto or an existing checkpoint folder, got {cfg.resume!r}")


def _check_reward_and_stage_values(cfg: DictConfig) -> None:
    rw = cfg.reward
    need(rw.failed_samples in ("exclude", "train"), "reward.failed_samples", "must be exclude or train")
    need(len(rw.functions) >= 1, "reward.functions", "at least one reward function is needed")
    need(any(not f.eval_only for f in rw.functions), "reward.functions",
         "at least one function must not be eval_only (the training reward)")
    keys = [f.label or f.remote or f.name for f in rw.functions]
    need(len(set(keys)) == len(keys), "reward.functions",
         f"{sorted({k for k in keys if keys.count(k) > 1})} appear more than once: give each a distinct label")
    for name, judge in rw.judges.items():
        tp = int(engine_options(judge.engine_params, judge.engine, f"reward.judges.{name}.engine_params")
                 .get("tensor_parallel_size", 1))
        need(tp <= max(judge.num_gpus, 1) or judge.num_gpus == 0, f"reward.judges.{name}.num_gpus",
             f"must be >= engine_params.tensor_parallel_size ({tp}): one GPU per tensor-parallel rank")
        need(judge.engine != "vllm" or judge.num_gpus <= 1 or tp >= judge.num_gpus, f"reward.judges.{name}.num_gpus",
             f"reserves {judge.num_gpus:g} GPUs per worker, but its vLLM engine runs on tensor_parallel_size ({tp}) "
             f"of them: set engine_params.vllm.tensor_parallel_size, or num_gpus {tp}")
        need(judge.repetition_penalty > 0, f"reward.judges.{name}.repetition_penalty", "must be > 0 (1: none)")
        need(judge.top_k >= 0, f"reward.judges.{name}.top_k", "must be >= 0 (0: all tokens)")
    labels = [s.label or s.name for s in cfg.stages]
    need(len(set(labels)) == len(labels), "stages",
         f"{sorted({x for x in labels if labels.count(x) > 1})} appear more than once: give each a distinct label")


# ------------------------------------------------------------------------------- rules the learner shares
def check_compile_position_wise(compile_position_wise: bool, zero_stage: int) -> None:
    if compile_position_wise and zero_stage == 3:
        raise ConfigError("learner.compile_position_wise: ZeRO-3 gathers partitioned weights in module hooks that "
                          "a compiled module would trace; use learner.zero_stage 0-2 or set it false")


def check_forward_only(optimizer: str, forward_only: bool, zero_stage: int) -> None:
    if forward_only and zero_stage != 0:
        raise ConfigError(f"learner.optimizer {optimizer!r} is forward-only (it perturbs the full weights on every "
                          f"rank): it needs learner.zero_stage 0, got {zero_stage}")


def check_learner(family_name: str, family: Any, *, share_prompts: bool, pack_sequences: bool,
                  gradient_checkpointing: bool, attn_implementation: str | None) -> None:
    """What the learner's batching needs from the model family and the attention kernel."""
    shares = getattr(family, "supports_shared_prompts", False)
    packed_flash = pack_sequences and str(attn_implementation or "").startswith("flash")
    if share_prompts and (not shares or packed_flash or (gradient_checkpointing and not pack_sequences)):
        why = (f"model family {family_name!r} runs its own forward (the causal family can share prompts)"
               if not shares else
               f"a packed row shares its prompts through looprl's variable-length attention, not "
               f"learner.attn_implementation {attn_implementation!r} (set it to eager or sdpa)" if packed_flash
               else "model.gradient_checkpointing turns the KV cache off in training (learner.pack_sequences "
                    "shares prompts without one)")
        raise ConfigError(f"learner.share_prompts: {why}; set learner.share_prompts false")
    if pack_sequences and not getattr(family, "supports_packing", False):
        raise ConfigError(f"learner.pack_sequences: model family {family_name!r} cannot run packed sequences "
                          f"(its attention builds its own masks); set learner.pack_sequences false")


def check_sequence_parallel(family_name: str, family: Any, size: int, *, world_size: int, share_prompts: bool,
                            pack_sequences: bool, attn_implementation: str | None, forward_only: bool = False) -> None:
    """What `learner.sequence_parallel_size` needs: a family that runs it, ranks it divides, an attention kernel
    that takes no mask (right padding is masked by causality), padded rows and gradients."""
    if size == 1:
        return
    key = "learner.sequence_parallel_size"
    if size < 1 or world_size % size:
        raise ConfigError(f"{key} {size}: must be at least 1 and divide learner.world_size ({world_size})")
    if not getattr(family, "supports_sequence_parallel", False):
        raise ConfigError(f"{key}: model family {family_name!r} runs its own attention (the causal and looped "
                          f"families run sequence parallelism); set it to 1")
    if share_prompts or pack_sequences:
        raise ConfigError(f"{key}: runs one sequence per row; set learner.share_prompts and learner.pack_sequences "
                          f"false")
    if attn_implementation in (None, "eager"):
        raise ConfigError(f"{key}: needs learner.attn_implementation sdpa or a flash-attention kernel (DeepSpeed's "
                          f"Ulysses attention takes no mask), not {attn_implementation!r}")
    if forward_only:
        raise ConfigError(f"{key}: a forward-only optimizer steps outside DeepSpeed; set it to 1")


def check_tensor_parallel(size: int, gpus: bool, colocated: bool) -> None:
    """Where a tensor-parallel rollout engine can run (known once Ray has placed the run)."""
    if size > 1 and gpus and colocated:
        raise ConfigError(f"rollout.tensor_parallel_size {size} on GPUs needs cluster.placement: split (an engine "
                          f"spans {size} GPUs of a bundle of its own; colocated bundles hold one GPU each)")


def check_weight_sync(weight_sync: str, gpus: bool, colocated: bool) -> None:
    """What a weight-sync transport needs from the placement the run got (known once Ray has placed it)."""
    if weight_sync == "cuda_ipc" and not gpus:
        raise ConfigError("rollout.weight_sync=cuda_ipc needs GPUs (learners and rollout workers on CUDA); "
                          "on CPU use object_store or collective")
    if weight_sync == "collective" and gpus and colocated:
        # NCCL refuses a communicator with two ranks on one device (learner rank 0, rollout worker 0)
        raise ConfigError("rollout.weight_sync=collective on GPUs needs cluster.placement: split (NCCL cannot "
                          "join learner rank 0 and the rollout worker sharing its GPU); with colocated "
                          "placement use cuda_ipc")


# --------------------------------------------------------------------------------------------- components
def check_components(cfg: DictConfig, model_path: str) -> None:
    """Resolve every named component of the recipe and check its parameters: advantage, loss (its inputs against
    the model family's outputs), adapter, architecture against the engine, the learner's batching, optimizer,
    decoding methods, task, sampler, environment, schedulers, engines. (The stages are built by the stage runner, which
    checks their parameters the same way before any actor starts.)"""
    family_name = model_family(cfg, model_path)
    family = lookup("family", family_name)
    _check_algorithm(cfg, family_name, family)
    _check_family(cfg, family_name, model_path)
    _check_adapter(cfg, family_name)
    lc = cfg.learner
    check_learner(family_name, family, share_prompts=lc.share_prompts, pack_sequences=lc.pack_sequences,
                  gradient_checkpointing=cfg.model.gradient_checkpointing,
                  attn_implementation=lc.attn_implementation)
    check_sequence_parallel(family_name, family, lc.sequence_parallel_size, world_size=lc.world_size,
                            share_prompts=lc.share_prompts, pack_sequences=lc.pack_sequences,
                            attn_implementation=lc.attn_implementation)
    _check_plugins(cfg)


def _check_algorithm(cfg: DictConfig, family_name: str, family: Any) -> None:
    a = cfg.algorithm
    check_params("advantage", a.advantage, as_container(a.advantage_params), "algorithm.advantage_params",
                 supplied=("rewards", "group_id", "response_mask", *NAMED_FIELDS))
    check_params("loss", a.loss, as_container(a.loss_params), "algorithm.loss_params",
                 supplied=(*LOSS_INPUTS, *family.outputs))
    loss = lookup("loss", a.loss)
    missing = [n for n in required_parameters(loss)[4:]
               if n not in (*LOSS_INPUTS, *family.outputs, *NAMED_FIELDS, *a.loss_params)]
    if missing:
        raise ConfigError(f"algorithm.loss: loss {a.loss!r} needs {missing}, which model family {family_name!r} "
                          f"(model.family: {cfg.model.family}) does not provide; it provides {list(family.outputs)}")
    if needs_critic(cfg) and cfg.critic.model_path is None and family_name != "causal":
        raise ConfigError(f"critic: algorithm.advantage {a.advantage!r} trains a value model on the policy's "
                          f"architecture, which model family {family_name!r} has no value head for; set "
                          f"critic.model_path to a causal LM folder")
    policy_loss_params(cfg, loss)  # the KL and entropy terms have a loss that takes them
    if cfg.sft.enabled and cfg.sft.loop_readouts == "all" and "loop_logp" not in family.outputs:
        raise ConfigError(f"sft.loop_readouts: all trains every loop's readout, which model family {family_name!r} "
                          f"does not have (a looped model such as Ouro does); use final")
    loop_inputs = {"loop_logp", "exit_pdf"} & set(inspect.signature(loss).parameters)
    if loop_inputs and (cfg.rollout.top_k > 0 or cfg.rollout.top_p < 1.0):
        raise ConfigError(f"rollout.top_p / rollout.top_k: loss {a.loss!r} reads per-loop logprobs "
                          f"({sorted(loop_inputs)}) of each loop's full distribution, which a truncated rollout "
                          f"does not sample from; use top_p 1.0 and top_k 0 with it")


def _check_family(cfg: DictConfig, family_name: str, model_path: str) -> None:
    if family_name == "masked_diffusion" and any(st.name == "rl" for st in cfg.stages):
        raise ConfigError("stages: model family 'masked_diffusion' trains by SFT (the MDLM loss) and samples by "
                          "diffusion decoding; its per-token terms are not sampling log-probabilities, so the 'rl' "
                          "stage cannot train it (use stages model, data, sft, evaluate)")
    if family_name == "masked_diffusion" and cfg.rollout.engine != "hf":
        raise ConfigError(f"rollout.engine: {cfg.rollout.engine!r} cannot sample a masked-diffusion model; the hf "
                          f"engine runs its block sampler (rollout.eval_decoding: diffusion)")
    simplegpt = (cfg.model.tiny.norm_placement == "simplenorm" if cfg.model.path is None
                 else model_type_of(model_path or cfg.model.path) == "simplegpt")
    if simplegpt and cfg.rollout.engine == "vllm":
        raise ConfigError("rollout.engine: vllm has no SimpleGPT architecture (model_type simplegpt, "
                          "model.tiny.norm_placement: simplenorm); the hf engine serves it")


def _check_adapter(cfg: DictConfig, family_name: str) -> None:
    adapter, engine = cfg.learner.adapter, cfg.rollout.engine
    if not adapter:
        return
    lookup("adapter", adapter.name)  # an unknown adapter name fails here
    check_params("adapter", adapter.name, as_container(adapter.params), "learner.adapter.params", supplied=("model",))
    if family_name != "causal":
        raise ConfigError(f"learner.adapter: adapters apply to the causal family's models, not {family_name!r}")
    if engine not in ("hf", "vllm"):
        raise ConfigError(f"learner.adapter: rollout.engine {engine!r} cannot take the adapter's tensors; the hf "
                          f"engine serves the adapter unmerged, vllm as a LoRA adapter")
    if cfg.rollout.weight_sync == "cuda_ipc":
        raise ConfigError("learner.adapter: rollout.weight_sync cuda_ipc shares full weights; use object_store or "
                          "collective, which send the adapter's tensors alone")
    if adapter.name == "ulora" and engine == "vllm":
        raise ConfigError("learner.adapter: ulora gates its directions per token, which vLLM's LoRA kernels do "
                          "not; the hf engine serves it unmerged (rollout.engine: hf)")


def check_sandbox(env: str, mode: str) -> None:
    """An environment that runs model-written code (`runs_model_code = True`, e.g. the Python tool) needs its
    sandbox: refused before start-up when this host cannot provide it (checked where the run starts; a rollout
    worker on another node checks its own host before its first episode, and a tool refused mid-run stops the
    rollout rather than failing every step)."""
    if getattr(lookup("env", env), "runs_model_code", False):
        from rl.tools import SandboxUnavailable, require_sandbox
        try:
            require_sandbox(mode)
        except SandboxUnavailable as exc:
            raise ConfigError(f"rollout.env: {env!r} runs model-written code; {exc}") from exc


def _check_plugins(cfg: DictConfig) -> None:
    lc = cfg.learner
    check_params("optimizer", lc.optimizer.name, as_container(lc.optimizer.params), "learner.optimizer.params",
                 supplied=("params", "lr", "weight_decay"))
    check_compile_position_wise(lc.compile_position_wise, lc.zero_stage)
    check_forward_only(lc.optimizer.name, getattr(lookup("optimizer", lc.optimizer.name), "forward_only", False),
                       lc.zero_stage)
    for key, name, params in (("rollout.decoding", cfg.rollout.decoding, cfg.rollout.decoding_params),
                              ("rollout.eval_decoding", cfg.rollout.eval_decoding, cfg.rollout.eval_decoding_params)):
        if name is not None:
            check_params("decoding", name, as_container(params), f"{key}_params")
    synth = cfg.data.synthetic
    check_params("task", synth.task, as_container(synth.params), "data.synthetic.params",
                 supplied=tuple(k for k in as_container(synth) if k != "params"))
    check_params("sampler", cfg.trainer.prompt_sampler.name, as_container(cfg.trainer.prompt_sampler.params),
                 "trainer.prompt_sampler.params", supplied=("rows", "seed"))
    if cfg.rollout.env is not None:
        check_params("env", cfg.rollout.env, as_container(cfg.rollout.env_params), "rollout.env_params")
        check_sandbox(cfg.rollout.env, cfg.rollout.sandbox)
    for key, sched in (("learner.scheduler", lc.scheduler), ("sft.scheduler", cfg.sft.scheduler)):
        check_params("scheduler", sched.name, as_container(sched.params), f"{key}.params",
                     supplied=("optimizer", "warmup_steps", "total_steps"))
    _check_engine(cfg.rollout.engine, cfg.rollout.engine_params, "rollout.engine_params",
                  supplied=("model_path", "dtype", "device", "trust_remote_code", "batch_size"))
    for name, judge in cfg.reward.judges.items():
        _check_engine(judge.engine, judge.engine_params, f"reward.judges.{name}.engine_params",
                      supplied=("model_path", "dtype", "device"))


def _check_engine(engine: str, engine_params: Any, key: str, supplied: tuple[str, ...]) -> None:
    """`engine`'s options from `engine_params` (`engine_options`) are parameters it takes; messages name its
    section (`key.<engine>`) when `engine_params` has one."""
    options = engine_options(engine_params, engine, key)
    sectioned = engine in (as_container(engine_params) or {})
    check_params("engine", engine, options, f"{key}.{engine}" if sectioned else key, supplied=supplied)
