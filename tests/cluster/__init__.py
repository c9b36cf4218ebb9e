# Overrides for a few-second `looprl run` of the quickstart recipe, shared by the launcher tests.
TINY_RUN = ["sft.enabled=false", "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
            "data.synthetic.num_train=40", "data.synthetic.num_eval=4", "rollout.n=2", "rollout.max_new_tokens=8",
            "trainer.prompts_per_step=2", "reward.num_workers=1", "logging.progress_bar=false"]
