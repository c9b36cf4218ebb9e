"""The RL loop as a library, free of Ray: `RLTrainer` runs one step (rollout, rewards, logprobs, advantages,
update, weight sync) on the actor system it is handed (`RLRoles`, the contract `cluster.rl_roles` implements), and
the `rl` stage runs the steps with evaluation, checkpoints, resume and logging around them."""
