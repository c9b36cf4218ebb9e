"""The `memo` stage end to end on a tiny model made in code: TicTacToe tournaments on the rollout workers,
the analyzer being the same model; budget, replay isolation, per-generation records, resume after a
failure, a killed rollout worker restarted with no game played twice."""

import json
from pathlib import Path

import pytest
import ray

from cluster.pipeline import run
from rl import config
from rl.methods.memo.core import records
from rl.methods.memo.stage import MemoStage, ModelClient

ROOT = Path(__file__).resolve().parents[3]
TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=64", "model.tiny.max_position_embeddings=8192", "rollout.engine=hf",
        "reward.num_workers=1", "logging.progress_bar=false", "logging.tensorboard=false", "sft.enabled=false"]
MEMO = ("{game: TicTacToe-v0, generations: 2, population: 3, rounds: 2, eval_rounds: 1, replay_prob: 0.5, "
        "max_new_tokens: 6, analyzer_max_new_tokens: 24, observation_chars: 200, max_moves: 30, "
        "shares: {keep: 0.34, memory_guided: 0.33, crossover: 0.33}, seed: 1}")


def _cfg(tmp_path: Path, memo: str = MEMO):
    return config.load(ROOT / "recipes/quickstart.yaml", [f"output_dir={tmp_path / 'run'}", *TINY,
                                                          f"stages=[{{name: model}}, {{name: memo, params: {memo}}}]"])


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "run/stages/memo/metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_memo_plays_the_budget_keeps_replays_out_of_the_ratings_and_resumes(ray_cluster, tmp_path, monkeypatch):
    real_evaluate = MemoStage._evaluate

    def evaluate_then_fail(self, player, opponents, best, memory, rng, gen):
        if gen == 1:
            raise RuntimeError("interrupted in generation 1")
        return real_evaluate(self, player, opponents, best, memory, rng, gen)

    monkeypatch.setattr(MemoStage, "_evaluate", evaluate_then_fail)
    with pytest.raises(RuntimeError, match="interrupted in generation 1"):
        run(_cfg(tmp_path))
    first = _rows(tmp_path)
    assert [r["generation"] for r in first] == [0]
    monkeypatch.setattr(MemoStage, "_evaluate", real_evaluate)
    summary = run(_cfg(tmp_path))  # resumes after generation 0
    rows = _rows(tmp_path)
    assert [r["generation"] for r in rows] == [0, 1] and rows[0] == first[0]

    for gen, row in enumerate(rows):
        games = [json.loads(x) for x in (tmp_path / f"run/stages/memo/games/gen{gen}.jsonl").read_text().splitlines()]
        assert row["games"] == len(games) == 3 * 2 * 2  # population x rounds x both seat orders
        ids = [c["id"] for c in row["candidates"]]
        assert sorted(g["agents"][0] if g["agents"][1] == "baseline" else g["agents"][1] for g in games) == \
            sorted(ids * 4)
        counted = records(games)
        for c in row["candidates"]:
            rec = counted[c["id"]]
            fresh = [g for g in games if c["id"] in g["agents"] and not g["replayed"] and not g["failed"]]
            assert rec.games == len(fresh)  # replayed games count for no W/L/D
            assert c["win_rate"] == pytest.approx(rec.rate("wins"))
        assert row["replayed_games"] == sum(g["replayed"] for g in games)
        assert set(row["eval"]) == {"baseline"} and row["eval"]["baseline"]["games"] + \
            row["eval"]["baseline"]["failed"] == 2
        assert row["best"]["fitness"] == max(c["fitness"] for c in row["candidates"])
    assert rows[1]["replayed_games"] > 0  # the buffer filled in generation 0
    assert rows[0]["replay"]["size"] > 0
    # generation 1: the elite kept its id; the others were written by the analyzer (the tiny model)
    origins = [c["origin"] for c in rows[1]["candidates"]]
    assert origins.count("elite") == 1 and rows[1]["candidates"][0]["id"] == \
        max(rows[0]["candidates"], key=lambda c: c["fitness"])["id"]
    assert summary["memo"]["best_generation"] in (0, 1)
    prompt = Path(summary["stages"]["memo"]["artifacts"]["memo_prompt"]).read_text()
    context = json.loads(Path(summary["stages"]["memo"]["artifacts"]["memo_context"]).read_text())
    assert prompt.startswith(context["best"]["prompt"]) and context["game"] == "TicTacToe-v0"


@pytest.mark.slow
@pytest.mark.extended  # the fault variant of the run above (`make test-all`)
def test_a_killed_rollout_worker_is_restarted_and_no_game_is_played_twice(ray_cluster, tmp_path, monkeypatch):
    real_generate = ModelClient.generate
    calls = {"n": 0}

    def generate_after_a_kill(self, texts, seed, **kw):
        calls["n"] += 1
        if calls["n"] == 3 and self.workers:
            ray.kill(self.workers[0], no_restart=False)
        return real_generate(self, texts, seed, **kw)

    monkeypatch.setattr(ModelClient, "generate", generate_after_a_kill)
    memo = MEMO.replace("generations: 2", "generations: 1")
    summary = run(_cfg(tmp_path, memo))
    assert summary["memo"]["rollout_restarts"] >= 1
    games = [json.loads(x) for x in (tmp_path / "run/stages/memo/games/gen0.jsonl").read_text().splitlines()]
    assert len(games) == 12
    assert all(len(g["steps"]) <= 30 for g in games)
    # every game's moves alternate as the game dictates: no move batch was applied twice
    for g in games:
        if not g["failed"]:
            assert all(a["player"] != b["player"] or a["invalid"] for a, b in zip(g["steps"], g["steps"][1:]))


def test_an_rl_recipe_takes_memos_prompt_as_its_prompt_prefix(tmp_path):
    from rl.stages import StageContext, StageError, stage_cfg
    found = tmp_path / "memo_prompt.txt"
    found.write_text("Take the center first, then the corners.\n\nInsights from past games:\n1. Block.\n")
    cfg = config.load(ROOT / "recipes/quickstart.yaml", ["data.prompt_prefix=artifact:memo_prompt"])
    ctx = StageContext(cfg, "rl", {"memo": {"memo_prompt": str(found)}})
    resolved = stage_cfg(ctx)
    assert resolved.data.prompt_prefix == found.read_text().strip() + "\n\n"
    assert cfg.data.prompt_prefix == "artifact:memo_prompt"  # the recipe (and fingerprints) keep the reference
    with pytest.raises(StageError, match="memo_prompt"):
        stage_cfg(StageContext(cfg, "rl", {}))
    plain = config.load(ROOT / "recipes/quickstart.yaml")
    assert stage_cfg(StageContext(plain, "rl", {})) is plain
