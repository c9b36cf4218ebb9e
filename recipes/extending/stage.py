"""Stage plugin: a class built with the stage's params; `run(ctx)` returns artifacts (name → path) that later
stages read with `ctx.artifact(name)`. This one selects data before RL: the `train` it publishes replaces
the data stage's. Recipe: `stages: [..., {name: recipes/extending/stage.py:ShortestPrompts, params: {keep: 0.5}}, {name: rl}, ...]`."""

import json
from pathlib import Path


class ShortestPrompts:
    resources = {"num_cpus": 0.25}  # it runs as a Ray task with these resources

    def __init__(self, keep: float = 0.5):
        self.keep = keep

    def run(self, ctx) -> dict[str, str]:
        rows = [json.loads(line) for line in Path(ctx.require("train")).read_text().splitlines() if line.strip()]
        rows.sort(key=lambda r: len(str(r["prompt"])))
        kept = rows[: max(1, int(len(rows) * self.keep))]
        out = ctx.stage_dir / "train.jsonl"
        out.write_text("".join(json.dumps(r) + "\n" for r in kept))
        ctx.summary["selected_train_rows"] = len(kept)
        return {"train": str(out)}
