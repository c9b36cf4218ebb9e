"""The learner: DeepSpeed ranks driven as a group.

- `strategy`: how one rank trains (DeepSpeed engine, optimizer and scheduler, ZeRO gathers, offloading, checkpoints);
- `worker`: what one rank runs (the model family's forward and the injected loss; it knows no algorithm);
- `loss_parameters`: the trainable parameters a loss declares, with their own optimizer;
- `group`: the driver's handle on the ranks (batch split, failure detection).
"""

from cluster.learner.group import LearnerDied, LearnerFailed, LearnerGroup, LearnerStuck
from cluster.learner.strategy import DeepSpeedStrategy
from cluster.learner.worker import LearnerWorker

__all__ = ["DeepSpeedStrategy", "LearnerDied", "LearnerFailed", "LearnerGroup", "LearnerStuck", "LearnerWorker"]
