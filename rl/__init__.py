"""The Ray-free library: the contracts (stage, env, reward, registry, batch, recipe schema and checks), estimators,
losses, optimizers, the SFT loop, synthetic tasks, and one folder per method under `rl/methods/`."""
