"""A memory plan before start-up: what each role of a recipe holds on each device, from the model's `config.json`
alone (`models.memory`), and whether the run fits the cluster's devices.

Per learner rank (the policy, and PPO's critic beside it): weights, gradients, fp32 master weights and Adam's two
moments at the recipe's ZeRO stage (the ZeRO paper's accounting: 2 + 2 + 12 bytes a trained parameter in bf16,
4 + 4 + 8 in fp32; stage 1 partitions the optimizer states over the ranks, 2 the gradients too, 3 the weights too),
the frozen reference policy when the KL term needs one, the activations of one micro-batch (all layers, or
their inputs and one layer under gradient checkpointing) and one chunk of the vocabulary projection. Per rollout
engine: its weights and the KV cache it keeps: the `hf` engine's for one generate call
(`rollout.generation_batch_size` sequences), vLLM's whatever its `gpu_memory_utilization` share leaves after the
weights and its own working memory (activations of a prefill chunk, sampling logits, about 1 GiB of runtime and
CUDA graphs), in tokens and in concurrent sequences at the recipe's lengths. Placement follows
`cluster.make_placement`: colocated roles share a device (taking turns when `rollout.sleep_between_phases` /
`learner.offload_between_phases` free their memory for the other's phase), split roles have their own; each
judge worker has its `num_gpus`.

The prompt length is not in a recipe: `prompt_tokens` (default 1024) stands for it. Figures are estimates of the
framework's kernels; `tests/cluster/test_plan.py` checks them against measured peaks of CPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from models.memory import (
    DTYPE_BYTES,
    ModelShape,
    activation_bytes,
    kv_bytes_per_token,
    layer_activation_elements,
    logit_bytes,
    lora_params,
    model_shape,
)
from rl.config import as_container

GIB = 1 << 30
VLLM_RUNTIME_BYTES = GIB  # CUDA graphs, the allocator's reserve and the runtime's buffers (vLLM's profiling)


@dataclass(frozen=True)
class Devices:
    """The cluster's GPUs (`gpus_per_node` 0: their number is not known, and only each device's load is checked).
    `cpu`: the roles run on CPUs instead (what the `hf` engine then holds besides: see `engine_use`)."""
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    cpu: bool = False

    @property
    def count(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)


@dataclass
class RoleUse:
    """What one actor of a role holds on its device, item by item (bytes)."""
    role: str
    items: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    kv_floor: int = 0  # an engine's KV cache must hold at least this much (one sequence)

    @property
    def total(self) -> int:
        return sum(self.items.values())


def _optimizer_is_mezo(cfg: Any) -> bool:
    return cfg.learner.optimizer.name == "mezo"


def trained_params(cfg: Any, shape: ModelShape) -> int:
    """The learner's trained parameters: a LoRA adapter's, or every one."""
    adapter = cfg.learner.adapter
    if adapter is None:
        return shape.params
    params = as_container(adapter.params) or {}
    return lora_params(shape, int(params.get("r", 8)), params.get("target_modules", "all-linear"))


def sequence_tokens(cfg: Any, prompt_tokens: int) -> int:
    """A training sequence's length: the prompt and the response (a multi-turn episode's token budget)."""
    response = cfg.rollout.max_episode_tokens if cfg.rollout.env else cfg.rollout.max_new_tokens
    return prompt_tokens + response


def micro_batch_tokens(cfg: Any, prompt_tokens: int) -> int:
    lc = cfg.learner
    return lc.max_tokens_per_micro_batch or lc.micro_batch_size * sequence_tokens(cfg, prompt_tokens)


def model_states(cfg: Any, shape: ModelShape, trained: int) -> dict[str, int]:
    """Weights, gradients, master weights and optimizer moments per rank at the recipe's ZeRO stage."""
    b, z, n = DTYPE_BYTES[cfg.model.dtype], cfg.learner.zero_stage, max(1, cfg.learner.world_size)
    mezo = _optimizer_is_mezo(cfg)
    states = {"weights": shape.params * b // (n if z >= 3 else 1)}  # frozen and trained alike
    if not mezo:
        states["gradients"] = trained * b // (n if z >= 2 else 1)
        if b == 2:
            states["master weights (fp32)"] = trained * 4 // (n if z >= 1 else 1)
        states["optimizer moments (fp32)"] = trained * 8 // (n if z >= 1 else 1)
    return states


def learner_use(cfg: Any, shape: ModelShape, prompt_tokens: int) -> RoleUse:
    """One policy learner rank (and the reference model it holds)."""
    b, lc = DTYPE_BYTES[cfg.model.dtype], cfg.learner
    use = RoleUse("learner rank", model_states(cfg, shape, trained_params(cfg, shape)))
    sp = max(1, lc.sequence_parallel_size)
    tokens = micro_batch_tokens(cfg, prompt_tokens) // sp  # each rank of a sequence-parallel group: 1/s of them
    use.items["activations"] = activation_bytes(shape, tokens, b, cfg.model.gradient_checkpointing)
    # the gradients flowing through a layer: half a layer's activations, as measured (tests/cluster/test_plan.py)
    use.items["backward working memory"] = layer_activation_elements(shape) * tokens * b // 2
    use.items["vocabulary projection chunk"] = logit_bytes(shape, min(tokens, lc.logprob_chunk_tokens))
    use.notes.append(f"{tokens} tokens a micro-batch{f' per rank (sequence parallelism over {sp})' if sp > 1 else ''}"
                     f"{', gradient checkpointing' if cfg.model.gradient_checkpointing else ''}")
    frozen_copy = shape.params * b // (max(1, lc.world_size) if lc.zero_stage >= 3 else 1)  # ZeRO-3 partitions it
    if cfg.algorithm.kl_coef > 0 and lc.adapter is None:
        use.items["reference weights"] = frozen_copy
    if cfg.algorithm.get("teacher_path"):  # assumed shaped like the policy (its own size is not read here)
        use.items["teacher weights"] = frozen_copy
    return use


def critic_use(cfg: Any, shape: ModelShape, prompt_tokens: int) -> RoleUse | None:
    """PPO's critic rank beside each policy rank (a full model with its states), when the estimator reads values."""
    if cfg.algorithm.advantage != "gae":
        return None
    b = DTYPE_BYTES[cfg.model.dtype]
    use = RoleUse("critic rank", model_states(cfg, shape, shape.params))
    use.items["activations"] = activation_bytes(shape, micro_batch_tokens(cfg, prompt_tokens), b,
                                                cfg.model.gradient_checkpointing)
    return use


def engine_use(cfg: Any, shape: ModelShape, prompt_tokens: int, devices: Devices) -> RoleUse:
    """One device of a rollout engine: weights and KV cache (see the module docstring); a tensor-parallel engine's
    `k` ranks each hold `1/k` of the weights and of every token's keys and values."""
    from rl.recipe import engine_options
    b, ro = DTYPE_BYTES[cfg.model.dtype], cfg.rollout
    k = max(1, ro.tensor_parallel_size)
    seq, kv_token = sequence_tokens(cfg, prompt_tokens), kv_bytes_per_token(shape, b) // k
    use = RoleUse(f"rollout engine ({ro.engine}{f', tensor parallel over {k}' if k > 1 else ''}), per device",
                  {"weights": shape.params * b // k})
    if ro.engine != "vllm":
        batch = ro.generation_batch_size
        use.items["KV cache"] = batch * seq * kv_token
        use.items["sampling logits"] = batch * shape.vocab * 4
        use.notes.append(f"KV cache of {batch} sequences of {seq} tokens")
        if devices.cpu:  # the CPU decode loop's packed copy of the weights and its reused KV storage (rollout/hf_engine)
            use.items["packed weights (CPU decode)"] = use.items["weights"]
            use.items["KV storage kept for reuse (CPU)"] = use.items["KV cache"]
        return use
    opts = engine_options(ro.engine_params, "vllm", "rollout.engine_params")
    share = float(opts.get("gpu_memory_utilization", 0.9))
    chunk = int(opts.get("max_num_batched_tokens", 8192))
    use.items["working memory"] = (layer_activation_elements(shape) * chunk * b
                                   + int(opts.get("max_num_seqs", 256)) * shape.vocab * 4 + VLLM_RUNTIME_BYTES)
    kv = int(share * devices.bytes) - use.total
    use.kv_floor = seq * kv_token
    use.items["KV cache"] = max(0, kv)
    tokens = max(0, kv) // kv_token
    use.notes.append(f"gpu_memory_utilization {share:g}: KV cache for {tokens} tokens, {tokens // seq} sequences "
                     f"of {seq} at once")
    return use


def judge_uses(cfg: Any, policy: ModelShape) -> dict[str, tuple[float, int, RoleUse]]:
    """Each judge on GPUs: (GPUs per worker, workers, a worker's weights), when its config can be read."""
    out = {}
    for name, judge in cfg.reward.judges.items():
        if judge.num_gpus <= 0:
            continue
        shape = policy if judge.model_path in (None, "") or str(judge.model_path).startswith("artifact:") else None
        if shape is None:
            try:
                shape = model_shape(judge.model_path)
            except (FileNotFoundError, KeyError):
                continue
        use = RoleUse(f"judge {name} (a worker)", {"weights": shape.params * DTYPE_BYTES[judge.dtype]})
        out[name] = (float(judge.num_gpus), int(judge.num_workers), use)
    return out


@dataclass
class Plan:
    shape: ModelShape
    devices: Devices
    roles: list[RoleUse]
    loads: list[tuple[str, int]]  # per kind of device: (what shares it, bytes at its peak)
    gpus_needed: float
    prompt_tokens: int

    @property
    def problems(self) -> list[str]:
        out = [f"{what}: needs {gib(need)} GiB at its peak, a device has {self.devices.gpu_memory_gib:g}"
               for what, need in self.loads if need > self.devices.bytes]
        if self.devices.count and self.gpus_needed > self.devices.count:
            out.append(f"the placement needs {self.gpus_needed:g} GPUs, the cluster has {self.devices.count}")
        out += [f"{r.role}: its KV cache ({gib(r.items['KV cache'])} GiB) cannot hold one sequence "
                f"({gib(r.kv_floor)} GiB)" for r in self.roles if r.items.get("KV cache", 0) < r.kv_floor]
        return out


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def policy_shape(cfg: Any) -> ModelShape:
    """The policy's shape: from `model.path`'s config.json, or the tiny model the recipe builds in code."""
    if cfg.model.path is not None:
        return model_shape(cfg.model.path, cfg.model.trust_remote_code)
    from models.tiny import build_tiny_model, build_tiny_tokenizer
    t = cfg.model.tiny
    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=t.hidden_size, num_layers=t.num_layers,
                             num_heads=t.num_heads, intermediate_size=t.intermediate_size,
                             max_position_embeddings=t.max_position_embeddings)
    return model_shape(model.config.to_dict())


def device_loads(cfg: Any, learner: RoleUse, critic: RoleUse | None, engine: RoleUse) -> list[tuple[str, int]]:
    """Each kind of device's peak: colocated roles add up, less what turn-taking frees in the other's phase."""
    training = learner.total + (critic.total if critic else 0)
    if cfg.cluster.placement == "split":
        return [("learner device", training), ("rollout device", engine.total)]
    transient = ("activations", "backward working memory", "vocabulary projection chunk")
    offloaded = ("gradients", "master weights (fp32)", "optimizer moments (fp32)")
    resident = sum(v for r in (learner, critic) if r for k, v in r.items.items()
                   if k not in transient and not (cfg.learner.offload_between_phases and k in offloaded))
    train_phase = training + (0 if cfg.rollout.sleep_between_phases else engine.total)
    generate_phase = engine.total + resident
    return [("learner + rollout device (colocated)", max(train_phase, generate_phase))]


def make_plan(cfg: Any, devices: Devices, prompt_tokens: int = 1024, shape: ModelShape | None = None) -> Plan:
    shape = shape or policy_shape(cfg)
    learner = learner_use(cfg, shape, prompt_tokens)
    critic = critic_use(cfg, shape, prompt_tokens)
    engine = engine_use(cfg, shape, prompt_tokens, devices)
    ws, nw = cfg.learner.world_size, cfg.rollout.num_workers
    bundles = max(ws, nw) if cfg.cluster.placement == "colocated" else ws + nw * cfg.rollout.tensor_parallel_size
    judges = judge_uses(cfg, shape)
    loads = device_loads(cfg, learner, critic, engine)
    loads += [(f"judge {name} worker ({gpus:g} GPU)", use.total // max(1, int(gpus))) for name, (gpus, _, use)
              in judges.items()]
    roles = [learner, *([critic] if critic else []), engine, *(use for _, _, use in judges.values())]
    return Plan(shape, devices, roles, loads, bundles + sum(g * n for g, n, _ in judges.values()), prompt_tokens)


# changes tried, in order, when a plan does not fit: the first that makes it fit is named
def _fixes(cfg: Any) -> list[str]:
    lc, out = cfg.learner, []
    if not cfg.model.gradient_checkpointing:
        out.append("model.gradient_checkpointing=true")
    out += [f"learner.zero_stage={z}" for z in range(lc.zero_stage + 1, 4) if lc.world_size > 1]
    if cfg.cluster.placement == "colocated":
        out += [k for k, on in (("learner.offload_between_phases=true", lc.offload_between_phases),
                                ("rollout.sleep_between_phases=true", cfg.rollout.sleep_between_phases)) if not on]
        out.append("cluster.placement=split")
    tokens = lc.max_tokens_per_micro_batch or lc.micro_batch_size * 2048
    out += [f"learner.max_tokens_per_micro_batch={tokens // f}" for f in (2, 4, 8)]
    out += [f"learner.world_size={lc.world_size * f}" for f in (2, 4) if lc.zero_stage >= 1]
    out += [f"learner.sequence_parallel_size={s}" for s in (2, 4, 8)
            if s > lc.sequence_parallel_size and lc.world_size % s == 0]
    return out


def suggest_fix(cfg: Any, devices: Devices, prompt_tokens: int, shape: ModelShape) -> str | None:
    """The first single change (`key=value`) under which the plan fits, or None."""
    from omegaconf import OmegaConf
    for change in _fixes(cfg):
        tried = OmegaConf.merge(cfg, OmegaConf.from_dotlist([change]))
        if not make_plan(tried, devices, prompt_tokens, shape).problems:
            return change
    return None


def render(plan: Plan) -> str:
    s, d = plan.shape, plan.devices
    lines = [f"model: {s.model_type}, {s.params / 1e9:.2f}B parameters ({s.counted}), {s.layers} layers"
             f"{f' x {s.loops} loops' if s.loops > 1 else ''}, KV heads {s.kv_heads} x {s.head_dim}",
             f"cluster: {d.nodes} node(s) x {d.gpus_per_node} GPUs of {d.gpu_memory_gib:g} GiB; prompts of "
             f"{plan.prompt_tokens} tokens assumed", ""]
    for role in plan.roles:
        lines.append(f"{role.role}: {gib(role.total)} GiB")
        lines += [f"  {k:<30} {gib(v):>8} GiB" for k, v in role.items.items()]
        lines += [f"  ({n})" for n in role.notes]
    lines += ["", "per device at its peak:"]
    lines += [f"  {what:<45} {gib(need):>8} GiB of {d.gpu_memory_gib:g}" for what, need in plan.loads]
    lines.append(f"GPUs: {plan.gpus_needed:g}" + (f" of {d.count}" if d.count else ""))
    return "\n".join(lines)


def check_fits(cfg: Any, devices: Devices, prompt_tokens: int = 1024) -> None:
    """Refuse a run that cannot fit, naming what does not and the change that would make it fit."""
    from rl.config import ConfigError
    plan = make_plan(cfg, devices, prompt_tokens)
    if plan.problems:
        fix = suggest_fix(cfg, devices, prompt_tokens, plan.shape)
        raise ConfigError("the memory plan does not fit: " + "; ".join(plan.problems)
                          + (f". It would fit with {fix}" if fix else ". No single change tried makes it fit")
                          + " (looprl plan RECIPE shows every figure)")


def run_devices(cfg: Any) -> Devices | None:
    """The devices `looprl run` plans for: `cluster.gpu_memory_gib` when set, else the driver's first CUDA device;
    None on a machine without GPUs (a CPU run is not planned)."""
    if cfg.cluster.gpu_memory_gib > 0:
        return Devices(1, 0, float(cfg.cluster.gpu_memory_gib))
    import torch
    if not torch.cuda.is_available():
        return None
    return Devices(1, 0, torch.cuda.get_device_properties(0).total_memory / GIB)
