"""Synthetic tasks built in code (registry kind `task`, chosen by `data.synthetic.task`): each writes
its SFT, RL and held-out splits as JSONL files and returns their paths. A task is
`fn(out_dir, *, num_train, num_eval, sft_fraction, wrong_order_fraction, seed, **_) -> {split: path}`."""
