"""A learner rank: the model family's forward and the injected loss, on a DeepSpeed strategy.

It knows no algorithm: per micro-batch it runs the model family's forward (`models/families.py`) for the outputs
the injected loss names, calls the loss, and has the strategy (`cluster.learner.strategy`: DeepSpeed engine,
optimizer, scheduler, ZeRO gathers, checkpoints) take the step — by backward, or with a loss closure and no backward
for forward-only optimizers (`rl/optim.py`). Losses are normalised by *global* token/sequence counts and gradients
are not rescaled by DeepSpeed's gradient-accumulation factor, so the update equals the full-batch one for any world
size or micro-batch size (tested). `cluster.learner.group` drives the ranks as Ray actors.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from cluster.learner.loss_parameters import LossParameters
from cluster.learner.strategy import DeepSpeedStrategy
from cluster.weight_sync import SENDERS
from models.adapters import reference_forward
from rl.batch import Batch
from rl.registry import lookup
from rl.validation import check_learner, check_sequence_parallel
from rollout.probes import ActorProbes


class LearnerWorker(ActorProbes):
    """One learner rank. Plain class; `LearnerGroup` wraps it as a Ray actor.

    `family` names the model family, `logprob_chunk_tokens` its logprob chunking, `share_prompts` and
    `pack_sequences` how micro-batches run through it; every other keyword configures the `DeepSpeedStrategy`
    (optimizer, scheduler, ZeRO stage, precision, reference model, adapter...).
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str, *,
                 family: str = "causal", logprob_chunk_tokens: int = 512, share_prompts: bool = False,
                 pack_sequences: bool = False, sequence_parallel_size: int = 1, **strategy_options: Any):
        family_cls = lookup("family", family)
        attn = strategy_options.get("attn_implementation")
        check_learner(family, family_cls, share_prompts=share_prompts, pack_sequences=pack_sequences,
                      gradient_checkpointing=strategy_options.get("gradient_checkpointing", False),
                      attn_implementation=attn)
        check_sequence_parallel(family, family_cls, sequence_parallel_size, world_size=world_size,
                                share_prompts=share_prompts, pack_sequences=pack_sequences, attn_implementation=attn)
        self.family = family_cls(chunk_tokens=logprob_chunk_tokens, **({"share_prompts": True} if share_prompts
                                                                       else {}))
        self.pack = pack_sequences
        self.strategy = DeepSpeedStrategy(rank, world_size, master_addr, master_port, model_path, family=self.family,
                                          shared_packed=share_prompts and pack_sequences,
                                          sequence_parallel_size=sequence_parallel_size, **strategy_options)
        check_sequence_parallel(family, family_cls, sequence_parallel_size, world_size=world_size,
                                share_prompts=False, pack_sequences=False, attn_implementation=attn,
                                forward_only=self.strategy.forward_only)
        self.family.sequence_parallel = self.strategy.sequence_parallel
        self.loss_parameters = LossParameters(self.strategy.lr, self.strategy.device, self.strategy.all_reduce,
                                              world_size)
        self.senders: dict[str, Any] = {}  # weight-sync transport name -> this rank's sender
        self.last_sender: Any = None

    # ------------------------------------------------------------------ forward-only
    @torch.no_grad()
    def compute_logprobs(self, micro_batches: list[Batch], which: str = "policy", temperature: float = 1.0,
                         top_k: int = 0, top_p: float = 1.0, output: str = "logp") -> list[torch.Tensor]:
        """Sampled-token logprobs `[n, L]` of each micro-batch under the policy, the reference or the teacher, of the
        distribution the rollout sampled from (`temperature`, `top_k`, `top_p`) — or another per-token output
        of the family (`values` of a critic)."""
        ds = self.strategy
        ds.reload_states()  # every entry point that computes with the model first brings offloaded states back
        base_as_ref = which == "ref" and ds.adapted and ds.with_ref
        model = {"policy": ds.engine, "ref": ds.engine if base_as_ref else ds.ref, "teacher": ds.teacher}[which]
        if model is None:
            raise RuntimeError(f"{which} logprobs requested but no {which} model was loaded "
                               f"({'kl_coef is 0' if which == 'ref' else 'algorithm.teacher_path is null'})")
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
        loss_fn = lookup("loss", loss_fn_spec)
        parameters = inspect.signature(loss_fn).parameters
        named = set(parameters)
        if next(iter(parameters)) != "logp":
            return self._named_loss_step(micro_batches, loss_fn, loss_params)
        entropy_grad = bool(loss_params.get("entropy_coef"))
        outputs = (named & set(self.family.outputs)) | {"logp"}
        if need_entropy or entropy_grad:
            outputs.add("entropy")

        def micro_loss(mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            out = self.family.forward(self.strategy.engine, mb, temperature=temperature, outputs=outputs,
                                      entropy_grad=entropy_grad, top_k=top_k, top_p=top_p, pack=self.pack)
            logp, entropy = out["logp"], out.get("entropy")
            extra = {k: v for k, v in out.items() if k in named and k not in ("logp", "entropy")}
            extra.update(self.loss_parameters.for_loss(loss_fn, out, loss_params))
            extra.update({k: v.to(self.strategy.device) if isinstance(v, torch.Tensor) else v
                          for k, v in mb.named_fields(loss_fn).items()})
            old = mb.old_logp.to(self.strategy.device) if mb.old_logp is not None else logp.detach()
            ref = mb.ref_logp.to(self.strategy.device) if mb.ref_logp is not None else None
            mask = mb.response_mask.to(self.strategy.device)
            advantages = mb.advantages.to(self.strategy.device)
            metrics: dict[str, float] = {}
            if mb.rollout_logp is not None:  # measured every step; applied when a correction is configured
                weights, metrics = rollout_importance_weights(
                    old, mb.rollout_logp.to(self.strategy.device), mask, **(rollout_correction or {"level": "none"}))
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
            out = self.family.forward(self.strategy.engine, mb, outputs=outputs, pack=self.pack)
            kwargs = {k: v.to(self.strategy.device) if isinstance(v, torch.Tensor) else v
                      for k, v in mb.named_fields(loss_fn).items()}
            kwargs.update({k: v for k, v in out.items() if k in named})  # the model's outputs win over batch data
            kwargs["response_mask"] = mb.response_mask.to(self.strategy.device)
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
                logp = self.family.forward(self.strategy.engine, mb, outputs={"loop_logp"})["loop_logp"].mean(-1)
            else:
                logp = self.family.forward(self.strategy.engine, mb, pack=self.pack)["logp"]
            return -(logp * mb.response_mask.to(logp.device)).sum() / num_tokens, {}

        return self._optimize(micro_batches, micro_loss)

    def _optimize(self, micro_batches: list[Batch],
                  micro_loss: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]]) -> dict[str, float]:
        """One optimizer step over `micro_batches`, each contributing `micro_loss(mb)` (its share of the
        global loss, and metrics averaged over micro-batches). Returns this rank's metrics, `loss` its share."""
        ds = self.strategy
        ds.reload_states()
        t_start = time.perf_counter()
        ds.engine.train()
        if ds.forward_only:
            sums = self._forward_only_step(micro_batches, micro_loss)
        else:
            sums, total_loss, grad_norm = {}, 0.0, None
            for i, mb in enumerate(micro_batches):
                loss, metrics = micro_loss(mb)
                last = i == len(micro_batches) - 1
                norm = ds.backward_and_step(loss, last=last)
                if last:
                    self.loss_parameters.step()
                grad_norm = norm if norm is not None else grad_norm
                total_loss += float(loss.detach())
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v / len(micro_batches)
            sums["loss"] = total_loss  # this rank's share; the group sums shares to the global loss
            sums["grad_norm"] = ds.grad_norm(grad_norm)
        sums["lr"] = ds.current_lr()
        sums["compute_s"] = time.perf_counter() - t_start  # inside the rank, without Ray transfer
        return sums

    @torch.no_grad()
    def _forward_only_step(self, micro_batches: list[Batch],
                           micro_loss: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]]) -> dict[str, float]:
        """A forward-only optimizer's step: it calls the closure (the global loss: this rank's micro-batch
        shares summed, then all-reduced, so every rank sees the same value and takes the same step) as
        often as it needs; no backward pass runs."""
        last_metrics: dict[str, float] = {}

        def closure() -> torch.Tensor:
            total = torch.zeros((), dtype=torch.float64, device=self.strategy.device)
            last_metrics.clear()
            for mb in micro_batches:
                loss, metrics = micro_loss(mb)
                total += loss.double()
                for k, v in metrics.items():
                    last_metrics[k] = last_metrics.get(k, 0.0) + v / len(micro_batches)
            return self.strategy.all_reduce(total)

        loss = self.strategy.forward_only_step(closure)
        sums = dict(last_metrics)  # of the last loss evaluation
        sums.update({f"zo/{k}": v for k, v in getattr(self.strategy.optimizer, "last", {}).items()})
        sums["loss"] = loss / self.strategy.world_size  # the group sums the ranks' shares
        sums["grad_norm"] = float("nan")  # no gradient exists
        return sums

    # ------------------------------------------------------------------ weight sync (cluster.weight_sync)
    def sender_call(self, transport: str, method: str, *args: Any) -> Any:
        """`method(*args)` of this rank's sender for weight-sync `transport` (made on first use)."""
        if transport not in self.senders:
            self.senders[transport] = SENDERS[transport](self.strategy)
        self.last_sender = self.senders[transport]
        return getattr(self.last_sender, method)(*args)

    def last_sync_bytes(self) -> int:
        """The bytes of tensors the last weight sync sent from this rank (rank 0; 0 before any)."""
        return self.last_sender.bytes_sent if self.last_sender is not None else 0

    # ------------------------------------------------------------------ the strategy's services, for the group
    def offload_states(self) -> float:
        """Optimizer states, master weights and gradients to host memory while the colocated rollout engine
        generates (`learner.offload_between_phases`); returns the seconds it took."""
        t0 = time.perf_counter()
        self.strategy.offload_states()
        return time.perf_counter() - t0

    def reload_states(self) -> float:
        """The offloaded states back before the learner computes (no-op when none are offloaded)."""
        t0 = time.perf_counter()
        self.strategy.reload_states()
        return time.perf_counter() - t0

    def gpu_memory_gib(self) -> float:
        """GPU memory held by this process's tensors now (0 on CPU)."""
        return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0

    def full_state_dict(self, device: str = "cpu", every_rank: bool = False, merged: bool = True
                        ) -> dict[str, torch.Tensor] | None:
        return self.strategy.full_state_dict(device, every_rank, merged)

    def save_checkpoint(self, path: str, client_state: dict) -> None:
        self.strategy.save_checkpoint(path, {**client_state, **self.loss_parameters.state()})

    def load_checkpoint(self, path: str) -> dict:
        client_state = self.strategy.load_checkpoint(path)
        self.loss_parameters.load(client_state)
        return client_state

    def save_hf(self, path: str, tokenizer_path: str | None = None) -> None:
        self.strategy.save_hf(path, tokenizer_path)

    def model_numbers(self) -> dict[str, float]:
        return self.strategy.model_numbers()

    def counters(self) -> dict[str, int]:
        return self.strategy.counters()

    def shutdown(self) -> None:
        self.strategy.shutdown()
