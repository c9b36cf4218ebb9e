"""Trainable parameters a loss declares (`trainable_parameters`, see `rl.losses`), e.g. a learned temperature or
baseline: replicated on every learner rank, stepped by an AdamW of their own beside the model's optimizer."""

from __future__ import annotations

from typing import Any

import torch


class LossParameters:
    """Made on first use from the family outputs of the first micro-batch, then kept (and checkpointed)."""

    def __init__(self, model_lr: float, device: Any, all_reduce: Any, world_size: int):
        self.model_lr, self.device, self.all_reduce, self.world_size = model_lr, device, all_reduce, world_size
        self.params: dict[str, torch.nn.Parameter] | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def for_loss(self, loss_fn: Any, outputs: dict[str, torch.Tensor], loss_params: dict[str, Any]
                 ) -> dict[str, torch.nn.Parameter]:
        """The parameters `loss_fn` declares (none for most losses), made on its first call."""
        if self.params is None:
            factory = getattr(loss_fn, "trainable_parameters", None)
            declared = factory(outputs, **loss_params) if factory is not None else {}
            self._make({name: p.init for name, p in declared.items()},
                       {name: p.lr_scale for name, p in declared.items()})
        return self.params

    def _make(self, init: dict[str, torch.Tensor], lr_scales: dict[str, float]) -> None:
        """Replicated on every rank, with their own AdamW (`lr_scale` × the model lr, no weight decay)."""
        self.params = {name: torch.nn.Parameter(t.detach().clone().float().to(self.device))
                       for name, t in init.items()}
        self.optimizer = torch.optim.AdamW(
            [{"params": [p], "lr": self.model_lr * lr_scales[name]} for name, p in self.params.items()],
            lr=self.model_lr, weight_decay=0.0) if self.params else None

    def step(self) -> None:
        """Average the gradients over ranks as DeepSpeed does for the model, then step (no-op without any)."""
        if self.optimizer is None:
            return
        stepped = False
        for p in self.params.values():
            if p.grad is not None:
                self.all_reduce(p.grad)
                p.grad.div_(self.world_size)  # each rank's backward ran on loss * world_size
                stepped = True
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        """For the checkpoint's client state (empty when the loss declares none)."""
        if self.optimizer is None:
            return {}
        return {"loss_parameters": {k: p.detach().cpu() for k, p in self.params.items()},
                "loss_parameter_optimizer": self.optimizer.state_dict()}

    def load(self, client_state: dict[str, Any]) -> None:
        """Back from a checkpoint's client state (its entries are removed); the optimizer state restores their
        learning rates."""
        if "loss_parameters" in client_state:
            saved = client_state.pop("loss_parameters")
            self._make(saved, {name: 1.0 for name in saved})
            self.optimizer.load_state_dict(client_state.pop("loss_parameter_optimizer"))
