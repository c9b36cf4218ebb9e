"""DeepSpeed learners: one Ray actor per data-parallel rank, driven as a group.

Each rank owns a DeepSpeed engine (ZeRO stage 0-3, gloo on CPU, NCCL on GPU) around a transformers
causal LM, and optionally a frozen reference copy for KL. The group splits a batch across ranks
and micro-batches; losses are normalised by *global* token/sequence counts and gradients are not
rescaled by DeepSpeed's gradient-accumulation factor, so the update equals the full-batch one for
any world size or micro-batch size (tested).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from models.adapters import reference_forward
from models.common import kv_bytes_per_token
from rl.batch import Batch
from rl.optim import is_forward_only
from rl.registry import get
from rl.validation import check_compile_position_wise, check_forward_only, check_learner
from rollout.probes import ActorProbes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class LearnerWorker(ActorProbes):
    """One learner rank. Plain class; `LearnerGroup` wraps it as a Ray actor.

    It knows no algorithm: per micro-batch it runs the model family's forward (`models/families.py`) for
    the outputs the injected loss names, calls the loss, and steps the recipe's optimizer — by backward
    through DeepSpeed, or with a loss closure and no backward for forward-only optimizers (`rl/optim.py`).
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str,
                 *, lr: float, weight_decay: float = 0.0, optimizer: dict[str, Any] | None = None,
                 scheduler: dict[str, Any] | None = None, warmup_steps: int = 0, total_steps: int = 1,
                 family: str = "causal", zero_stage: int = 0, micro_batch_size: int = 8, grad_accum: int = 1,
                 grad_clip: float = 1.0, dtype: str = "float32", backend: str = "auto", with_ref: bool = False,
                 gradient_checkpointing: bool = False, seed: int = 0, threads: int = 1,
                 trust_remote_code: bool = False, offload_between_phases: bool = False, pack_sequences: bool = False,
                 logprob_chunk_tokens: int = 512, attn_implementation: str | None = None,
                 adapter: dict[str, Any] | None = None, share_prompts: bool = False,
                 compile_position_wise: bool = False):
        self.lr = lr
        family_cls = get("family", family)
        check_learner(family, family_cls, share_prompts=share_prompts, pack_sequences=pack_sequences,
                      gradient_checkpointing=gradient_checkpointing, attn_implementation=attn_implementation)
        check_compile_position_wise(compile_position_wise, zero_stage)
        self.family = family_cls(chunk_tokens=logprob_chunk_tokens, **({"share_prompts": True} if share_prompts
                                                                       else {}))
        self.pack = pack_sequences
        self.loss_parameters: dict[str, torch.nn.Parameter] | None = None  # declared by the loss (rl.losses)
        self.loss_parameter_opt: torch.optim.Optimizer | None = None
        self.backward_passes = 0
        self._init_distributed(rank, world_size, master_addr, master_port, backend, threads)
        self.rank, self.world_size, self.zero_stage = rank, world_size, zero_stage
        torch.manual_seed(seed)
        bf16 = dtype == "bfloat16"
        # Plain fp32 data parallelism (stage 0): we clip ourselves, which also yields the norm that
        # DeepSpeed computes but discards on this path; one pass over the gradients instead of two.
        self.manual_clip = zero_stage == 0 and not bf16
        self.grad_clip = grad_clip
        self.ds_config = deepspeed_config(zero_stage, micro_batch_size, grad_accum, world_size,
                                          0.0 if self.manual_clip else grad_clip, bf16)
        self.grad_accum = grad_accum
        # ZeRO-3: transformers must see the DeepSpeed config *before* from_pretrained so that the
        # weights are partitioned at load time; the object must stay alive.
        from transformers.integrations import HfDeepSpeedConfig
        self._hf_ds = HfDeepSpeedConfig(self.ds_config) if zero_stage == 3 else None
        # With an adapter (`learner.adapter`, models/adapters.py) only its parameters train, and the reference
        # policy is the base model itself with the adapter disabled: no second copy of the weights.
        self.adapted, self.adapter_spec = adapter is not None, adapter
        load = {"dtype": torch.bfloat16 if bf16 else torch.float32, "trust_remote_code": trust_remote_code,
                **({"attn_implementation": attn_implementation} if attn_implementation else {})}
        self.ref = self._load_reference(model_path, load) if with_ref and not self.adapted else None
        self.with_ref = with_ref
        model = self._load_policy(model_path, load, share_prompts and pack_sequences, compile_position_wise,
                                  gradient_checkpointing)
        self.offload_between_phases, self.offloaded = offload_between_phases, False
        optim, sched = self._optimizer_and_scheduler(model, lr, weight_decay, optimizer, scheduler, warmup_steps,
                                                     total_steps)
        self._init_engine(model, optim, sched, optimizer)

    def _init_distributed(self, rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
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
            model = make_adapter(model, self.adapter_spec, get("adapter", self.adapter_spec["name"]))
        if compile_position_wise:
            from models.blocks import compile_position_wise as compile_modules
            compile_modules(model)
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
            optim = get("optimizer", opt_spec["name"])(trainable(model), lr=lr, weight_decay=weight_decay,
                                                       **opt_spec["params"])
        sched = get("scheduler", sched_spec["name"])(optim, warmup_steps=warmup_steps, total_steps=total_steps,
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

    # ------------------------------------------------------------------ forward-only
    @torch.no_grad()
    def compute_logprobs(self, micro_batches: list[Batch], which: str = "policy", temperature: float = 1.0,
                         top_k: int = 0, top_p: float = 1.0, output: str = "logp") -> list[torch.Tensor]:
        """Sampled-token logprobs `[n, L]` of each micro-batch under the policy or the reference, of the
        distribution the rollout sampled from (`temperature`, `top_k`, `top_p`) — or another per-token output
        of the family (`values` of a critic)."""
        self.reload_states()  # every entry point that computes with the model first brings offloaded states back
        base_as_ref = which == "ref" and self.adapted and self.with_ref
        model = self.engine if which != "ref" or base_as_ref else self.ref
        if model is None:
            raise RuntimeError("reference logprobs requested but no reference model was loaded (kl_coef is 0)")
        was_training = model.training
        model.eval()
        with reference_forward(model) if base_as_ref else contextlib.nullcontext():
            outs = [self.family.forward(model, mb, temperature=temperature, top_k=top_k, top_p=top_p,
                                        pack=self.pack, outputs={output})[output].cpu() for mb in micro_batches]
        model.train(was_training)
        return outs

    # ------------------------------------------------------------------ training
    def train_step(self, micro_batches: list[Batch], loss_fn_spec: str, loss_params: dict[str, Any],
                   temperature: float = 1.0, need_entropy: bool = False,
                   rollout_correction: dict[str, Any] | None = None, top_k: int = 0, top_p: float = 1.0
                   ) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (its share of the global batch).

        `loss_params` carries the global `num_tokens`/`num_seqs`, so each micro-batch loss is its
        share of the global loss; DeepSpeed averages gradients over ranks, hence `* world_size`.
        The loss also gets, by the names of its keyword parameters, the family's extra outputs, the
        Batch fields and extras, and the trainable parameters it declares (see `rl.losses`).
        `rollout_correction` (`level`, `mode`, `cap`) weights each token's advantage by the importance
        weight between the learner's old logprobs and the rollout engine's; every built-in loss is
        linear in the advantage, so this equals weighting the per-token policy-gradient term (KL and
        entropy terms stay unweighted, as in verl and TRL).
        """
        import inspect

        from rl.losses import rollout_importance_weights
        loss_fn = get("loss", loss_fn_spec)
        parameters = inspect.signature(loss_fn).parameters
        named = set(parameters)
        if next(iter(parameters)) != "logp":
            return self._named_loss_step(micro_batches, loss_fn, loss_params)
        entropy_grad = bool(loss_params.get("entropy_coef"))
        outputs = (named & set(self.family.outputs)) | {"logp"}
        if need_entropy or entropy_grad:
            outputs.add("entropy")

        def micro_loss(mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            out = self.family.forward(self.engine, mb, temperature=temperature, outputs=outputs,
                                      entropy_grad=entropy_grad, top_k=top_k, top_p=top_p, pack=self.pack)
            logp, entropy = out["logp"], out.get("entropy")
            extra = {k: v for k, v in out.items() if k in named and k not in ("logp", "entropy")}
            extra.update(self._loss_parameters(loss_fn, out, loss_params))
            extra.update({k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                          for k, v in mb.named_fields(loss_fn).items()})
            old = mb.old_logp.to(self.device) if mb.old_logp is not None else logp.detach()
            ref = mb.ref_logp.to(self.device) if mb.ref_logp is not None else None
            mask = mb.response_mask.to(self.device)
            advantages = mb.advantages.to(self.device)
            metrics: dict[str, float] = {}
            if mb.rollout_logp is not None:  # measured every step; applied when a correction is configured
                weights, metrics = rollout_importance_weights(
                    old, mb.rollout_logp.to(self.device), mask, **(rollout_correction or {"level": "none"}))
                if weights is not None:
                    advantages = advantages * weights
            loss, loss_metrics = loss_fn(logp, old, advantages, mask, ref_logp=ref, entropy=entropy, **loss_params,
                                         **extra)
            metrics.update(loss_metrics)
            if entropy is not None:
                m = mask.to(entropy.device)
                metrics["entropy"] = float((entropy.detach() * m).sum() / m.sum().clamp(min=1))
            return loss, metrics

        return self._optimize(micro_batches, micro_loss)

    def _named_loss_step(self, micro_batches: list[Batch], loss_fn: Any, loss_params: dict[str, Any]
                         ) -> dict[str, float]:
        """A loss that is not a policy loss (its first parameter is not `logp`, e.g. a critic's value loss):
        it gets the family outputs, `response_mask`, the Batch fields and extras it names, and `loss_params`."""
        import inspect
        named = set(inspect.signature(loss_fn).parameters)
        outputs = named & set(self.family.outputs)

        def micro_loss(mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            out = self.family.forward(self.engine, mb, outputs=outputs, pack=self.pack)
            kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                      for k, v in mb.named_fields(loss_fn).items()}
            kwargs.update({k: v for k, v in out.items() if k in named})  # the model's outputs win over batch data
            kwargs["response_mask"] = mb.response_mask.to(self.device)
            params = {k: v for k, v in loss_params.items() if k in named}
            return loss_fn(**kwargs, **params)

        return self._optimize(micro_batches, micro_loss)

    def sft_step(self, micro_batches: list[Batch], num_tokens: float, loop_readouts: str = "final"
                 ) -> dict[str, float]:
        """Supervised step: token-mean negative log-likelihood of the response tokens (global count). A looped
        model's `loop_readouts: all` trains the readout after every loop (the NLL averaged over loops)."""

        if loop_readouts == "all" and "loop_logp" not in self.family.outputs:
            raise ValueError(f"sft loop_readouts=all: model family {type(self.family).__name__} has no per-loop "
                             f"readouts (a looped model such as Ouro has)")

        def micro_loss(mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            if loop_readouts == "all":
                logp = self.family.forward(self.engine, mb, outputs={"loop_logp"})["loop_logp"].mean(-1)
            else:
                logp = self.family.forward(self.engine, mb, pack=self.pack)["logp"]
            return -(logp * mb.response_mask.to(logp.device)).sum() / num_tokens, {}

        return self._optimize(micro_batches, micro_loss)

    def _optimize(self, micro_batches: list[Batch],
                  micro_loss: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]]) -> dict[str, float]:
        """One optimizer step over `micro_batches`, each contributing `micro_loss(mb)` (its share of the
        global loss, and metrics averaged over micro-batches). Returns this rank's metrics, `loss` its share."""
        self.reload_states()
        t_start = time.perf_counter()
        self.engine.train()
        if self.forward_only:
            sums = self._forward_only_step(micro_batches, micro_loss)
        else:
            sums, total_loss, grad_norm = {}, 0.0, None
            for i, mb in enumerate(micro_batches):
                loss, metrics = micro_loss(mb)
                last = i == len(micro_batches) - 1
                norm = self._backward_and_step(loss, last=last)
                if last and self.loss_parameter_opt is not None:
                    self._step_loss_parameters()
                grad_norm = norm if norm is not None else grad_norm
                total_loss += float(loss.detach())
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v / len(micro_batches)
            sums["loss"] = total_loss  # this rank's share; the group sums shares to the global loss
            sums["grad_norm"] = self._grad_norm_after_step(grad_norm)
        sums["lr"] = float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else 0.0
        sums["compute_s"] = time.perf_counter() - t_start  # inside the rank, without Ray transfer
        return sums

    @torch.no_grad()
    def _forward_only_step(self, micro_batches: list[Batch],
                           micro_loss: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]]) -> dict[str, float]:
        """A forward-only optimizer's step: it calls the closure (the global loss: this rank's micro-batch
        shares summed, then all-reduced, so every rank sees the same value and takes the same step) as
        often as it needs; no backward pass runs."""
        import torch.distributed as dist
        last_metrics: dict[str, float] = {}

        def closure() -> torch.Tensor:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            last_metrics.clear()
            for mb in micro_batches:
                loss, metrics = micro_loss(mb)
                total += loss.double()
                for k, v in metrics.items():
                    last_metrics[k] = last_metrics.get(k, 0.0) + v / len(micro_batches)
            if self.world_size > 1:
                dist.all_reduce(total)
            return total

        loss = float(self.optimizer.step(closure))
        self.scheduler.step()
        sums = dict(last_metrics)  # of the last loss evaluation
        sums.update({f"zo/{k}": v for k, v in getattr(self.optimizer, "last", {}).items()})
        sums["loss"] = loss / self.world_size  # the group sums the ranks' shares
        sums["grad_norm"] = float("nan")  # no gradient exists
        return sums

    def _loss_parameters(self, loss_fn: Any, outputs: dict[str, torch.Tensor], loss_params: dict[str, Any]
                         ) -> dict[str, torch.nn.Parameter]:
        """The trainable parameters the loss declares (`trainable_parameters`, see rl.losses), made on
        first use from the family outputs of the first micro-batch, then kept."""
        if self.loss_parameters is None:
            factory = getattr(loss_fn, "trainable_parameters", None)
            declared = factory(outputs, **loss_params) if factory is not None else {}
            self._make_loss_parameters({name: p.init for name, p in declared.items()},
                                       {name: p.lr_scale for name, p in declared.items()})
        return self.loss_parameters

    def _make_loss_parameters(self, init: dict[str, torch.Tensor], lr_scales: dict[str, float]) -> None:
        """Replicated on every rank, with their own AdamW (`lr_scale` × the model lr, no weight decay)."""
        self.loss_parameters = {name: torch.nn.Parameter(t.detach().clone().float().to(self.device))
                                for name, t in init.items()}
        self.loss_parameter_opt = torch.optim.AdamW(
            [{"params": [p], "lr": self.lr * lr_scales[name]} for name, p in self.loss_parameters.items()],
            lr=self.lr, weight_decay=0.0) if self.loss_parameters else None

    def _step_loss_parameters(self) -> None:
        """Average the loss parameters' gradients over ranks as DeepSpeed does for the model, then step."""
        import torch.distributed as dist
        stepped = False
        for p in self.loss_parameters.values():
            if p.grad is not None:
                if dist.is_initialized() and self.world_size > 1:
                    dist.all_reduce(p.grad)
                p.grad.div_(self.world_size)  # each rank's backward ran on loss * world_size
                stepped = True
        if stepped:
            self.loss_parameter_opt.step()
        self.loss_parameter_opt.zero_grad(set_to_none=True)

    def _backward_and_step(self, loss: torch.Tensor, last: bool) -> float | None:
        """Backward of one micro-batch's share of the global loss, then DeepSpeed's step (which only
        updates at the accumulation boundary). DeepSpeed averages gradients over ranks, hence
        `* world_size`; the loss is already a share, hence no division by the accumulation steps. The
        boundary is set explicitly, so a step may have any number of micro-batches (token budgets).
        Returns the stage-0 pre-clip gradient norm on the last micro-batch, else None."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        self.backward_passes += 1
        norm = self._grad_norm_before_step() if last else None
        self.engine.step()
        return norm

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

    def _grad_norm_after_step(self, before: float | None) -> float:
        if before is not None:
            return before
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    # ------------------------------------------------------------------ weights and checkpoints
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

    def weights_for_sync(self):
        """Rank 0's full weights packed for the object store (see rollout.weight_sync); None elsewhere."""
        from rollout.weight_sync import pack_state
        sd = self.sync_state_dict()
        if sd is None:
            return None
        self.sync_bytes = sum(v.numel() * v.element_size() for v in sd.values())
        return pack_state(sd)

    def last_sync_bytes(self) -> int:
        """The bytes of tensors the last weight sync sent from this rank (rank 0; 0 before any)."""
        return getattr(self, "sync_bytes", 0)

    # ------------------------------------------------------------------ collective weight sync
    def weight_sync_endpoint(self) -> tuple[str, int]:
        """Address for the weight-sync group's rendezvous, hosted by this rank (call on rank 0)."""
        return ray.util.get_node_ip_address(), free_port()

    def init_weight_sync_group(self, host: str, port: int, world_size: int, backend: str) -> list | None:
        """Rank 0 joins the weight-sync group as its rank 0 and returns the tensor metadata the
        receivers need; all ranks must call (ZeRO-3 gathers the full weights to read their shapes)."""
        from rollout.weight_sync import make_sync_group, state_meta
        sd = self.sync_state_dict()
        self.sync_device = "cuda" if backend == "nccl" else "cpu"
        if self.rank != 0:
            return None
        self.sync_meta = state_meta(sd)
        self.sync_group = make_sync_group(host, port, 0, world_size, backend)
        return self.sync_meta

    def broadcast_weights(self, bucket_bytes: int) -> float:
        """Rank 0 broadcasts its full weights to the rollout workers; all ranks must call (ZeRO-3)."""
        from rollout.weight_sync import broadcast_state
        t0 = time.perf_counter()
        sd = self.sync_state_dict(self.sync_device)
        if self.rank == 0:
            self.sync_bytes = sum(v.numel() * v.element_size() for v in sd.values())
            broadcast_state(self.sync_group, sd, self.sync_meta, bucket_bytes, self.sync_device)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ CUDA IPC weight sync (colocated)
    def share_weights_ipc(self, bucket_bytes: int, keep_versions: int) -> dict:
        """This rank's full weights copied into GPU buckets, returned as CUDA IPC handles for the rollout
        worker on the same GPU; all ranks must call. The buckets of the last `keep_versions` calls stay
        alive: with asynchronous rollout a worker opens them only after its queued generations."""
        from rollout.weight_sync import gpu_uuid, share_state_ipc, state_meta
        t0 = time.perf_counter()
        sd = self.full_state_dict("cuda", every_rank=True)
        meta = state_meta(sd)
        buckets, handles = share_state_ipc(sd, meta, bucket_bytes)
        del sd
        self.ipc_live = (getattr(self, "ipc_live", []) + [buckets])[-keep_versions:]
        torch.cuda.synchronize()  # the copies must be done before another process reads them
        return {"gpu": gpu_uuid(), "meta": meta, "handles": handles, "bucket_bytes": bucket_bytes,
                "pack_s": time.perf_counter() - t0}

    # ------------------------------------------------------------------ colocated phases
    def offload_states(self) -> float:
        """Move optimizer states, master weights and gradients to host memory while the colocated rollout
        engine generates (`learner.offload_between_phases`; DeepSpeed's offload_states, ZeRO 1-3)."""
        t0 = time.perf_counter()
        if self.offload_between_phases and not self.offloaded:
            self.engine.offload_states(pin_memory=torch.cuda.is_available())
            self.offloaded = True
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def reload_states(self) -> float:
        """Bring the offloaded states back before the learner computes (no-op when none are offloaded)."""
        t0 = time.perf_counter()
        if self.offloaded:
            self.engine.reload_states()
            self.offloaded = False
        return time.perf_counter() - t0

    def gpu_memory_gib(self) -> float:
        """GPU memory held by this process's tensors now (0 on CPU)."""
        return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0

    def save_checkpoint(self, path: str, client_state: dict) -> None:
        self.reload_states()  # a checkpoint reads the optimizer states where DeepSpeed expects them
        if self.loss_parameter_opt is not None:
            client_state = {**client_state,
                            "loss_parameters": {k: p.detach().cpu() for k, p in self.loss_parameters.items()},
                            "loss_parameter_optimizer": self.loss_parameter_opt.state_dict()}
        if self.forward_only:  # DeepSpeed does not hold the optimizer: it travels in the client state
            client_state = {**client_state, "optimizer": self.optimizer.state_dict(),
                            "scheduler": self.scheduler.state_dict()}
        # with an adapter only its tensors are saved; the frozen base is the model folder the run started from
        self.engine.save_checkpoint(path, tag="ds", client_state=client_state, exclude_frozen_parameters=self.adapted)

    def load_checkpoint(self, path: str) -> dict:
        self.reload_states()
        _, client_state = self.engine.load_checkpoint(path, tag="ds", load_module_strict=not self.adapted)
        client_state = client_state or {}
        if "loss_parameters" in client_state:  # the optimizer state restores their learning rates
            saved = client_state.pop("loss_parameters")
            self._make_loss_parameters(saved, {name: 1.0 for name in saved})
            self.loss_parameter_opt.load_state_dict(client_state.pop("loss_parameter_optimizer"))
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

    def shutdown(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class LearnerFailed(RuntimeError):
    """A learner rank died or stopped answering: the run stops (a DeepSpeed rank cannot rejoin its process
    group) and resumes from a checkpoint."""


class LearnerDied(LearnerFailed):
    """A learner rank's process died (killed, out of memory, a crashed collective)."""


class LearnerStuck(LearnerFailed):
    """A learner call did not finish within its deadline (`trainer.deadlines.learner_s`)."""


class LearnerGroup:
    """Driver-side handle on `world_size` LearnerWorker actors."""

    def __init__(self, world_size: int, model_path: str, *, placement_group=None, bundle_indices=None,
                 num_cpus: float = 0.5, num_gpus: float = 0.0, env: dict[str, str] | None = None,
                 max_tokens_per_micro_batch: int = 0, deadline_s: float = 0.0, wait: bool = True,
                 share_prompts: bool = False, **worker_kwargs: Any):
        """`max_tokens_per_micro_batch > 0` forms micro-batches by token count (`rl.batch.plan_micro_batches`)
        instead of `grad_accum` equal splits of each rank's share; logprob passes use it too. `share_prompts`: the
        rows that repeat a prompt share its forward, so a token budget keeps them in one micro-batch and counts the
        prompt once. `deadline_s > 0`
        bounds every call on the ranks (`LearnerStuck` past it). `wait=False` returns while the ranks still start
        (other actors can start meanwhile); call `wait_ready` before using them."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.world_size = world_size
        self.max_tokens = max_tokens_per_micro_batch
        self.share_prompts = share_prompts
        if share_prompts:
            worker_kwargs["share_prompts"] = True
        self.deadline_s = deadline_s
        self.broken = False  # a rank missed its deadline: shutdown skips the barrier it would never reach
        self.logprob_micro_batch_size = 64  # sequences per logprob forward without a token budget
        port = free_port()
        addr = "127.0.0.1" if placement_group is None else ray.util.get_node_ip_address()
        actor_cls = ray.remote(LearnerWorker)
        self.workers = []
        for rank in range(world_size):
            opts: dict[str, Any] = {"num_cpus": num_cpus, "runtime_env": {"env_vars": env or {}}}
            if num_gpus:
                opts["num_gpus"] = num_gpus
            if placement_group is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle_indices[rank])
            self.workers.append(actor_cls.options(**opts).remote(rank, world_size, addr, port, model_path,
                                                                 **worker_kwargs))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until every rank has loaded its model and joined the process group (raises a rank's start-up error)."""
        ray.get([w.__ray_ready__.remote() for w in self.workers])

    def get_all(self, futures: list[Any], what: str) -> list[Any]:
        """`ray.get` of one call per rank; a dead rank becomes a `LearnerDied` naming it, a call still running
        after `deadline_s` a `LearnerStuck` naming the ranks (a DeepSpeed rank cannot rejoin its process
        group, so the run stops and resumes from a checkpoint)."""
        from cluster.ray_utils import unfinished
        stuck = unfinished(futures, self.deadline_s)
        if stuck:
            self.broken = True  # no graceful shutdown: the stuck ranks will not reach the barrier
            raise LearnerStuck(f"learner rank(s) {stuck} did not finish {what} within {self.deadline_s:g} s "
                               f"(trainer.deadlines.learner_s)")
        try:
            return ray.get(futures)
        except ray.exceptions.RayActorError as exc:
            dead = []
            for rank, f in enumerate(futures):
                try:
                    ray.get(f, timeout=10)
                except ray.exceptions.RayActorError:
                    dead.append(rank)
                except Exception:  # noqa: BLE001 - a rank that failed otherwise, or is still busy, is not dead
                    pass
            raise LearnerDied(f"learner rank(s) {dead or '?'} died during {what}") from exc

    def plan(self, batch: Batch, micro_batches: int) -> list[list[list[int]]]:
        """Row indices per rank and micro-batch: by token budget when one is set, else contiguous shards
        split into `micro_batches` each."""
        from rl.batch import contiguous_plan, plan_micro_batches, plan_prompt_groups, sequence_tokens
        if self.max_tokens and self.share_prompts:
            return plan_prompt_groups(batch, self.world_size, self.max_tokens)
        if self.max_tokens:
            return plan_micro_batches(sequence_tokens(batch), self.world_size, self.max_tokens)
        return contiguous_plan(len(batch), self.world_size, micro_batches)

    def compute_logprobs(self, batch: Batch, which: str = "policy", temperature: float = 1.0, top_k: int = 0,
                         top_p: float = 1.0, output: str = "logp") -> torch.Tensor:
        """`[N, L]` sampled-token logprobs of `batch` (or the family's `output`, e.g. a critic's `values`, a
        looped model's `[N, L, T]` `loop_logp`)."""
        from rl.batch import micro_batches_of
        per_rank = -(-len(batch) // self.world_size)
        plan = self.plan(batch, max(1, -(-per_rank // self.logprob_micro_batch_size)))
        futures = [w.compute_logprobs.remote(mbs, which, temperature, top_k, top_p, output)
                   for w, mbs in zip(self.workers, micro_batches_of(batch, plan))]
        out = None
        for bins, parts in zip(plan, self.get_all(futures, f"{which} logprobs")):
            for rows, logp in zip(bins, parts):
                if out is None:
                    out = torch.zeros((*batch.response_ids.shape, *logp.shape[2:]))
                if rows:  # empty bins ran a filler row
                    out[rows, :logp.shape[1]] = logp
        return out

    def train_step(self, batch: Batch, grad_accum: int, loss_fn_spec: str, loss_params: dict[str, Any],
                   temperature: float = 1.0, need_entropy: bool = False,
                   rollout_correction: dict[str, Any] | None = None, top_k: int = 0, top_p: float = 1.0
                   ) -> dict[str, float]:
        """Split `batch` over ranks and micro-batches (`plan`); one optimizer step."""
        from rl.batch import micro_batches_of
        mask = batch.response_mask
        params = dict(loss_params)
        params["num_tokens"] = float(mask.sum())
        params["num_seqs"] = float((mask.sum(-1) > 0).sum())
        futures = [w.train_step.remote(mbs, loss_fn_spec, params, temperature, need_entropy, rollout_correction,
                                       top_k, top_p)
                   for w, mbs in zip(self.workers, micro_batches_of(batch, self.plan(batch, grad_accum)))]
        results = self.get_all(futures, "a training step")
        out = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
        out["loss"] = sum(r["loss"] for r in results)
        out["grad_norm"] = results[0]["grad_norm"]
        return out

    def sft_step(self, batch: Batch, grad_accum: int, loop_readouts: str = "final") -> dict[str, float]:
        from rl.batch import micro_batches_of
        num_tokens = float(batch.response_mask.sum())
        results = self.get_all([w.sft_step.remote(mbs, num_tokens, loop_readouts)
                                for w, mbs in zip(self.workers, micro_batches_of(batch, self.plan(batch, grad_accum)))],
                               "an SFT step")
        return {"loss": sum(r["loss"] for r in results), "grad_norm": results[0]["grad_norm"],
                "lr": results[0]["lr"]}

    def counters(self) -> list[dict[str, int]]:
        """Every rank's counters (backward passes run)."""
        return self.get_all([w.counters.remote() for w in self.workers], "reading counters")

    def offload_states(self) -> float:
        return max(self.get_all([w.offload_states.remote() for w in self.workers], "offloading learner states"))

    def gpu_memory_gib(self) -> float:
        """The largest GPU memory any rank's tensors hold now (0 on CPU)."""
        return max(ray.get([w.gpu_memory_gib.remote() for w in self.workers]))

    def reload_states(self) -> float:
        return max(self.get_all([w.reload_states.remote() for w in self.workers], "reloading learner states"))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return ray.get([w.full_state_dict.remote() for w in self.workers])[0]

    def save_checkpoint(self, path: str, client_state: dict) -> None:
        self.get_all([w.save_checkpoint.remote(path, client_state) for w in self.workers], "a checkpoint save")

    def load_checkpoint(self, path: str) -> dict:
        return ray.get([w.load_checkpoint.remote(path) for w in self.workers])[0]

    def save_hf(self, path: str, tokenizer_path: str | None = None) -> None:
        ray.get([w.save_hf.remote(path, tokenizer_path) for w in self.workers])

    def shutdown(self) -> None:
        try:
            if self.broken:
                raise RuntimeError("a rank is stuck")
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception:  # a rank that is already gone cannot take part in the barrier
            pass
        for w in self.workers:
            ray.kill(w)
