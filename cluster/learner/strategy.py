"""The DeepSpeed strategy of one learner rank: everything about *how* a model is trained, nothing about *what*.

It owns the process group, the DeepSpeed engine around the policy (ZeRO stage 0-3, gloo on CPU, NCCL on GPU), the
frozen reference, the recipe's optimizer and scheduler, backward and step with global-count normalisation, gradient
clipping, ZeRO gathers of the full weights, offloading between colocated phases, and checkpoints. The worker
(`cluster.learner.worker`) runs the model family's forward and the injected loss through it; as OpenRLHF's
`DeepspeedStrategy` serves its Ray actors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from models.adapters import finish_optimizer_step
from models.common import kv_bytes_per_token
from rl.optim import is_forward_only
from rl.registry import lookup
from rl.validation import check_compile_position_wise, check_forward_only
from rollout.hardware import warn_slow_bf16


def deepspeed_config(zero_stage: int, micro_batch_size: int, grad_accum: int, world_size: int,
                     grad_clip: float, bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "gradient_clipping": grad_clip if grad_clip > 0 else 0.0,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of them, or an adapter's alone (the base is frozen)."""
    return [p for p in model.parameters() if p.requires_grad]


def check_teacher(policy: torch.nn.Module, teacher: torch.nn.Module, teacher_path: str) -> None:
    """The teacher scores the student's token ids: it must read them with the same vocabulary."""
    def vocab(model: torch.nn.Module) -> int | None:
        return getattr(getattr(getattr(model, "module", model), "config", None), "vocab_size", None)
    if vocab(policy) != vocab(teacher):
        raise ValueError(f"algorithm.teacher_path {teacher_path}: a vocabulary of {vocab(teacher)} tokens, the "
                         f"policy's has {vocab(policy)}; the teacher must use the policy's tokenizer")


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
                     threads: int) -> None:
    """This rank's process group (gloo on CPU, nccl on CUDA) through DeepSpeed."""
    import deepspeed
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0",  # Ray gives each rank its own visible device
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(threads)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.cuda.is_available():
        # DeepSpeed's CPU backend JIT-compiles its shared-memory all-reduce op when it starts (about a minute
        # on a cold cache, again whenever the compiler's view of the build changes). Only its
        # `inference_all_reduce` uses that op; training collectives go through torch.distributed (gloo).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)


class DeepSpeedStrategy:
    """One rank's DeepSpeed engine, optimizer, scheduler, reference model, ZeRO gathers and checkpoints.

    `family` is the model family instance (`rl.registry` kind `family`): the strategy loads the policy and the
    reference through it. With an adapter (`adapter`, `models/adapters.py`) only its parameters train, and the
    reference policy is the base model with the adapter disabled: no second copy of the weights.
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str, *,
                 family: Any, lr: float, weight_decay: float = 0.0, optimizer: dict[str, Any] | None = None,
                 scheduler: dict[str, Any] | None = None, warmup_steps: int = 0, total_steps: int = 1,
                 zero_stage: int = 0, micro_batch_size: int = 8, grad_accum: int = 1, grad_clip: float = 1.0,
                 dtype: str = "float32", backend: str = "auto", with_ref: bool = False,
                 gradient_checkpointing: bool = False, seed: int = 0, threads: int = 1,
                 trust_remote_code: bool = False, offload_between_phases: bool = False,
                 attn_implementation: str | None = None, adapter: dict[str, Any] | None = None,
                 shared_packed: bool = False, compile_position_wise: bool = False, sequence_parallel_size: int = 1,
                 teacher_path: str | None = None):
        check_compile_position_wise(compile_position_wise, zero_stage)
        self.family, self.lr = family, lr
        self.rank, self.world_size, self.zero_stage = rank, world_size, zero_stage
        self.backward_passes = 0
        init_distributed(rank, world_size, master_addr, master_port, backend, threads)
        # Ulysses groups of `sequence_parallel_size` ranks (`models.sequence_parallel`); gradients are averaged over
        # every rank, the data-parallel size is world / s
        self.sp_size, self.sequence_parallel = sequence_parallel_size, None
        if sequence_parallel_size > 1:
            from models.sequence_parallel import register
            self.sequence_parallel = register(model_path, attn_implementation or "sdpa", sequence_parallel_size,
                                              micro_batch_size)
        torch.manual_seed(seed)
        bf16 = dtype == "bfloat16"
        if rank == 0:
            warn_slow_bf16(dtype, "cuda" if torch.cuda.is_available() else "cpu")
        # Plain fp32 data parallelism (stage 0): we clip ourselves, which also yields the norm that
        # DeepSpeed computes but discards on this path; one pass over the gradients instead of two.
        self.manual_clip = zero_stage == 0 and not bf16
        self.grad_clip = grad_clip
        self.ds_config = deepspeed_config(zero_stage, micro_batch_size, grad_accum, world_size,
                                          0.0 if self.manual_clip else grad_clip, bf16)
        # ZeRO-3: transformers must see the DeepSpeed config *before* from_pretrained so that the
        # weights are partitioned at load time; the object must stay alive.
        from transformers.integrations import HfDeepSpeedConfig
        self.hf_ds_config = HfDeepSpeedConfig(self.ds_config) if zero_stage == 3 else None
        self.adapted, self.adapter_spec = adapter is not None, adapter
        load = {"dtype": torch.bfloat16 if bf16 else torch.float32, "trust_remote_code": trust_remote_code,
                **({"attn_implementation": attn_implementation} if attn_implementation else {})}
        self.ref = self._load_reference(model_path, load) if with_ref and not self.adapted else None
        self.with_ref = with_ref
        # on-policy distillation's frozen teacher (algorithm.teacher_path), held like the reference
        if teacher_path and not Path(teacher_path, "config.json").exists():
            raise FileNotFoundError(f"algorithm.teacher_path: {teacher_path} holds no model (no config.json)")
        self.teacher = self._load_reference(teacher_path, load) if teacher_path else None
        model = self._load_policy(model_path, load, shared_packed, compile_position_wise, gradient_checkpointing)
        if self.teacher is not None:
            check_teacher(model, self.teacher, teacher_path)
        if self.sequence_parallel is not None:  # what the family's own attention needs (a looped model's)
            for loaded in (model, self.ref, self.teacher):
                if loaded is not None:
                    self.family.prepare_sequence_parallel(loaded, self.sequence_parallel)
        self.offload_between_phases, self.offloaded = offload_between_phases, False
        optim, sched = self._optimizer_and_scheduler(model, lr, weight_decay, optimizer, scheduler, warmup_steps,
                                                     total_steps)
        self._init_engine(model, optim, sched, optimizer)

    def _load_reference(self, model_path: str, load: dict[str, Any]) -> Any:
        """The frozen reference: it only runs forward. Under ZeRO-3 it is partitioned like the policy (each rank
        holds 1/world_size of it, gathered layer by layer in the forward) inside a DeepSpeed engine without an
        optimizer; otherwise it is a plain copy on every rank."""
        import deepspeed
        ref = self.family.load(model_path, **load).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        if self.zero_stage == 3:
            ref_config = {k: v for k, v in self.ds_config.items() if k != "gradient_clipping"}
            ref, *_ = deepspeed.initialize(model=ref, config=ref_config)
            ref.eval()
        return ref

    def _load_policy(self, model_path: str, load: dict[str, Any], shared_packed: bool, compile_position_wise: bool,
                     gradient_checkpointing: bool) -> torch.nn.Module:
        """The policy, with its adapter, compiled position-wise modules and gradient checkpointing as asked."""
        model = self.family.load(model_path, **load)
        if shared_packed:
            from models.varlen_attention import require
            require(model)
        if self.adapted:
            from models.adapters import make_adapter
            model = make_adapter(model, self.adapter_spec, lookup("adapter", self.adapter_spec["name"]))
        if compile_position_wise:
            from models.blocks import compile_decoder_layers
            from models.blocks import compile_position_wise as compile_modules
            # packed rows with shared prompts pass no KV cache through the layers: each compiles whole (not under
            # gradient checkpointing, whose layer call recomputes the forward)
            (compile_decoder_layers if shared_packed and not gradient_checkpointing else compile_modules)(model)
        if gradient_checkpointing:
            # non-reentrant: works under ZeRO-3 and with inputs that need no grad
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def _optimizer_and_scheduler(self, model: torch.nn.Module, lr: float, weight_decay: float,
                                 optimizer: dict[str, Any] | None, scheduler: dict[str, Any] | None,
                                 warmup_steps: int, total_steps: int) -> tuple[Any, Any]:
        """The recipe's optimizer over the trainable parameters (DeepSpeed's FusedAdam when ZeRO-3 states are
        offloaded between phases) and its scheduler."""
        opt_spec = {"name": "adamw", "params": {}, **(optimizer or {})}
        sched_spec = {"name": "constant", "params": {}, **(scheduler or {})}
        if self.offload_between_phases and self.zero_stage == 3:
            # DeepSpeed moves ZeRO-3 states only for its own FusedAdam (a CUDA kernel)
            if not torch.cuda.is_available():
                raise ValueError("learner.offload_between_phases with zero_stage 3 needs CUDA (DeepSpeed offloads "
                                 "ZeRO-3 states only for its FusedAdam); on CPU there is nothing to offload")
            if opt_spec["name"] != "adamw":
                raise ValueError("learner.offload_between_phases with zero_stage 3 needs learner.optimizer adamw "
                                 "(DeepSpeed offloads ZeRO-3 states only for its FusedAdam)")
            from deepspeed.ops.adam import FusedAdam
            p = opt_spec["params"]
            optim = FusedAdam(trainable(model), lr=lr, betas=tuple(p.get("betas", (0.9, 0.999))),
                              eps=p.get("eps", 1e-8), weight_decay=weight_decay, adam_w_mode=True)
        else:
            optim = lookup("optimizer", opt_spec["name"])(trainable(model), lr=lr, weight_decay=weight_decay,
                                                       **opt_spec["params"])
        sched = lookup("scheduler", sched_spec["name"])(optim, warmup_steps=warmup_steps, total_steps=total_steps,
                                                     **sched_spec["params"])
        return optim, sched

    def _init_engine(self, model: torch.nn.Module, optim: Any, sched: Any, optimizer: dict[str, Any] | None) -> None:
        """The DeepSpeed engine around the policy; a forward-only optimizer steps itself, outside DeepSpeed."""
        import deepspeed
        self.forward_only = is_forward_only(optim)
        check_forward_only((optimizer or {}).get("name", "adamw"), self.forward_only, self.zero_stage)
        if self.forward_only:
            # DeepSpeed only runs the forward (and places/casts the model); the optimizer steps itself
            self.engine, _, _, _ = deepspeed.initialize(model=model, config=self.ds_config)
            self.optimizer, self.scheduler = optim, sched
        else:
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optim, lr_scheduler=sched, config=self.ds_config)
        if self.world_size == 1 and self.zero_stage == 0:
            # Nothing to all-reduce with a single rank; skipping DeepSpeed's flatten/reduce/unflatten
            # copies of every gradient saves ~20% of a CPU training step. Stage 0 only: the ZeRO
            # optimizers fill their gradient partitions in that reduction (skipping it fails their step).
            self.engine.enable_backward_allreduce = False
        self.device = self.engine.device

    # ------------------------------------------------------------------ backward and step
    def backward_and_step(self, loss: torch.Tensor, last: bool) -> float | None:
        """Backward of one micro-batch's share of the global loss, then DeepSpeed's step (which only
        updates at the accumulation boundary). DeepSpeed averages gradients over ranks, hence
        `* world_size` (over data-parallel ranks: a sequence-parallel group's `s` ranks each backpropagate `s x`
        their tokens' share, `models.sequence_parallel`); the loss is already a share, hence no division by the
        accumulation steps. The
        boundary is set explicitly, so a step may have any number of micro-batches (token budgets).
        Returns the stage-0 pre-clip gradient norm on the last micro-batch, else None."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * (self.world_size // self.sp_size), scale_wrt_gas=False)
        self.backward_passes += 1
        norm = self._grad_norm_before_step() if last else None
        self.engine.step()
        if last:  # what layers keep once per optimizer step (U-LoRA's EMA prior)
            finish_optimizer_step(self.engine.module)
        return norm

    def _grad_norm_before_step(self) -> float | None:
        """Stage 0 fp32: gradients are reduced and still in `.grad` before step(); clip them here and
        return the pre-clip norm. Other paths: DeepSpeed clips and reports the norm after step()."""
        if not self.manual_clip:
            return None
        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm)
        return float(norm)

    def grad_norm(self, before_step: float | None) -> float:
        """The step's gradient norm: the one measured before the step (stage 0 fp32), else DeepSpeed's."""
        if before_step is not None:
            return before_step
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def forward_only_step(self, closure: Any) -> float:
        """A forward-only optimizer's step (it calls `closure` for the global loss as often as it needs)."""
        loss = float(self.optimizer.step(closure))
        self.scheduler.step()
        finish_optimizer_step(self.engine.module)
        return loss

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place (nothing to do with one rank)."""
        import torch.distributed as dist
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(tensor)
        return tensor

    def current_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else 0.0

    # ------------------------------------------------------------------ colocated phases
    def offload_states(self) -> None:
        """Optimizer states, master weights and gradients to host memory (DeepSpeed's offload_states, ZeRO 1-3)."""
        if self.offload_between_phases and not self.offloaded:
            self.engine.offload_states(pin_memory=torch.cuda.is_available())
            self.offloaded = True
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def reload_states(self) -> None:
        """The offloaded states back on the device (no-op when none are offloaded)."""
        if self.offloaded:
            self.engine.reload_states()
            self.offloaded = False

    # ------------------------------------------------------------------ full weights (ZeRO gathers)
    def full_state_dict(self, device: str = "cpu", every_rank: bool = False, merged: bool = True
                        ) -> dict[str, torch.Tensor] | None:
        """Full weights on `device` from rank 0 (None elsewhere, unless `every_rank`). Collective under
        ZeRO-3: call on all ranks. With an adapter: the base weights plus its update (`merged`), or the base's
        alone."""
        self.reload_states()
        module = self.engine.module
        keep = every_rank or self.rank == 0
        if self.adapted:  # under the base model's names
            from models.adapters import base_state_dict, merged_state_dict
            state_of = merged_state_dict if merged else base_state_dict
        else:
            state_of = lambda m: m.state_dict()  # noqa: E731
        if self.zero_stage == 3:
            import deepspeed
            params = list(module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                sd = {k: v.detach().to(device).clone() for k, v in state_of(module).items()} if keep else None
            return sd
        if not keep:
            return None
        # No clone: Ray serialises (copies) the tensors when the result is stored; the GPU paths copy
        # them into buckets.
        return {k: v.detach().to(device) for k, v in state_of(module).items()}

    def sync_state_dict(self, device: str = "cpu") -> dict[str, torch.Tensor] | None:
        """What the rollout engines need after a step, on rank 0 (None elsewhere; collective under ZeRO-3): the
        full weights, or with an adapter only the adapter's tensors (the engines hold the base)."""
        if not self.adapted:
            return self.full_state_dict(device)
        from models.adapters import adapter_state_dict
        module = self.engine.module
        if self.zero_stage == 3:
            import deepspeed
            params = [p for p in module.parameters() if p.requires_grad]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                sd = {k: v.detach().to(device).clone() for k, v in adapter_state_dict(module).items()}
        else:
            sd = {k: v.detach().to(device) for k, v in adapter_state_dict(module).items()}
        return sd if self.rank == 0 else None

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, client_state: dict) -> None:
        """DeepSpeed's checkpoint of the engine (with the optimizer it holds) and `client_state`."""
        self.reload_states()  # a checkpoint reads the optimizer states where DeepSpeed expects them
        if self.forward_only:  # DeepSpeed does not hold the optimizer: it travels in the client state
            client_state = {**client_state, "optimizer": self.optimizer.state_dict(),
                            "scheduler": self.scheduler.state_dict()}
        # with an adapter only its tensors are saved; the frozen base is the model folder the run started from
        self.engine.save_checkpoint(path, tag="ds", client_state=client_state, exclude_frozen_parameters=self.adapted)

    def load_checkpoint(self, path: str) -> dict:
        """The engine (and optimizer) from `path`; returns the client state saved with it."""
        self.reload_states()
        _, client_state = self.engine.load_checkpoint(path, tag="ds", load_module_strict=not self.adapted)
        client_state = client_state or {}
        if self.forward_only:
            self.optimizer.load_state_dict(client_state.pop("optimizer"))
            self.scheduler.load_state_dict(client_state.pop("scheduler"))
        return client_state

    def save_hf(self, path: str, tokenizer_path: str | None = None) -> None:
        """`save_pretrained` export (rank 0 writes; all ranks must call under ZeRO-3). With an adapter: the merged
        model and the peft adapter folder in `adapter/`; an adapter that cannot be merged (U-LoRA) is saved unmerged
        beside the base weights, and the hf engine applies it on load (`models.adapters.load_unmerged`)."""
        from models.adapters import is_mergeable, save_unmerged
        mergeable = not self.adapted or is_mergeable(self.engine.module)
        sd = self.full_state_dict(merged=mergeable)
        if self.rank == 0:
            module = self.engine.module
            if self.adapted:
                if mergeable:
                    module.save_pretrained(str(Path(path) / "adapter"))
                else:
                    save_unmerged(module, self.adapter_spec, path)
                module = module.get_base_model()
            module.save_pretrained(path, state_dict=sd)
            if tokenizer_path:
                from models.tokenizer import load_tokenizer
                load_tokenizer(tokenizer_path).save_pretrained(path)

    # ------------------------------------------------------------------ accounting
    def model_numbers(self) -> dict[str, float]:
        """For FLOP and bandwidth accounting: `matmul_params` (parameters a token's forward multiplies by:
        all but an untied input embedding, which is a lookup), `param_bytes` (the weights' bytes),
        `kv_bytes_per_token` (a cached position's keys and values over all layers, and over all loops of a looped
        model; 0 where the config does not name its layers and heads)."""
        module = self.engine.module
        numel = {id(p): getattr(p, "ds_numel", p.numel()) for p in module.parameters()}
        emb = module.get_input_embeddings().weight
        out = module.get_output_embeddings()
        tied = out is not None and out.weight is emb
        total = sum(numel.values())
        size = 2 if self.ds_config["bf16"]["enabled"] else 4
        return {"matmul_params": float(total - (0 if tied else numel[id(emb)])), "param_bytes": float(total * size),
                "kv_bytes_per_token": kv_bytes_per_token(module.config, size)}

    def counters(self) -> dict[str, int]:
        """How many backward passes this rank has run (forward-only optimizers run none), and how many
        parameter elements of the policy and of the reference this rank holds (partitions under ZeRO-3)."""
        def held(module: torch.nn.Module | None) -> int:
            if module is None:
                return 0
            return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in module.parameters())
        return {"backward_passes": self.backward_passes, "policy_numel": held(self.engine.module),
                "ref_numel": held(getattr(self.ref, "module", self.ref))}

    def shutdown(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
