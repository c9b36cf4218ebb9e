"""The reward service against real worker processes: every kind of bad plugin becomes a recorded failure."""

import textwrap

import pytest

from rewards.service import RewardService, RewardSpec
from rl.registry import RegistryError

PLUGINS = textwrap.dedent('''
    import asyncio, math, time
    from rl.reward import batched

    def raises(prompt, response, **kw):
        raise RuntimeError("boom")

    def hangs(prompt, response, **kw):
        if response == "hang":
            time.sleep(60)
        return 1.0

    def nan(prompt, response, **kw):
        return math.nan

    def wrong_type(prompt, response, **kw):
        return "high"

    def maybe(prompt, response, ground_truth=None, **kw):
        return None if ground_truth is None else 0.5

    def with_components(prompt, response, **kw):
        return {"score": 2.0, "length": float(len(response)), "label": "x"}

    def validity(prompt, response, **kw):
        return {"score": float(len(response)), "valid": response.startswith("ok")}

    def bad_validity(prompt, response, **kw):
        return {"score": 1.0, "valid": "yes"}

    async def async_len(prompt, response, **kw):
        await asyncio.sleep(0)
        return float(len(response))

    @batched
    def batch_len(prompts, responses, **kw):
        return [float(len(r)) for r in responses]

    @batched
    def batch_short(prompts, responses, **kw):
        return [1.0]

    def scaled(prompt, response, factor=1.0, **kw):
        return factor

    def dies_once(prompt, response, marker="", **kw):
        import os, signal
        if response == "die" and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # the worker process is killed mid-task
        return float(len(response))

    def stuck_once(prompt, response, marker="", **kw):
        import os, signal, time
        if response == "stuck" and not os.path.exists(marker):
            open(marker, "w").close()
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # deaf to the per-sample timer
            time.sleep(3600)  # alive, not answering
        return float(len(response))
''')


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("plugins") / "plugins.py"
    p.write_text(PLUGINS)
    return str(p)


def _items(*responses, truth="1"):
    return [{"prompt": "q", "response": r, "ground_truth": truth, "metadata": {}} for r in responses]


def _service(plugin_file, *names, weights=None, timeout_s=5.0, **params):
    specs = [RewardSpec(f"{plugin_file}:{n}", (weights or {}).get(n, 1.0), params.get(n, {})) for n in names]
    return RewardService(specs, num_workers=2, timeout_s=timeout_s, failure_reward=-1.0)


def test_exception_is_recorded_per_sample(plugin_file):
    s = _service(plugin_file, "raises")
    try:
        out = s.score(_items("a", "b"))
    finally:
        s.close()
    assert all(o["failed"] and o["score"] == -1.0 for o in out)
    assert "RuntimeError: boom" in out[0]["error"] and "raises" in out[0]["error"]


def test_timeout_marks_only_the_hanging_sample(plugin_file):
    s = _service(plugin_file, "hangs", timeout_s=1.0)
    try:
        out = s.score(_items("ok", "hang", "ok2"))
    finally:
        s.close()
    # the hanging call was interrupted (had it run its 60 s sleep it would have scored 1.0)
    assert [o["failed"] for o in out] == [False, True, False]
    assert "timed out after 1.0s" in out[1]["error"]
    assert out[0]["score"] == 1.0


def test_nan_and_wrong_type_are_failures(plugin_file):
    s = _service(plugin_file, "nan")
    w = _service(plugin_file, "wrong_type")
    try:
        assert "returned nan" in s.score(_items("a"))[0]["error"]
        assert "returned str" in w.score(_items("a"))[0]["error"]
    finally:
        s.close()
        w.close()


def test_none_is_not_applicable_and_components_are_kept(plugin_file):
    s = _service(plugin_file, "maybe", "with_components", weights={"with_components": 0.5})
    try:
        out = s.score(_items("abc") + [{"prompt": "q", "response": "abcd", "ground_truth": None, "metadata": {}}])
    finally:
        s.close()
    # row 0: 0.5 (maybe) + 0.5 * 2.0 (with_components)
    assert out[0]["score"] == pytest.approx(1.5)
    assert out[0]["components"][f"{plugin_file}:with_components/length"] == 3.0
    # row 1: maybe says not applicable -> only the other function counts
    assert out[1]["score"] == pytest.approx(1.0) and not out[1]["failed"]


def test_a_validity_verdict_reaches_the_batch(plugin_file):
    """A reward's `valid` (MGPO's gate) is combined over functions, carried to `batch.valid`, and a non-bool
    verdict is a recorded failure naming the plugin."""
    from models.tiny import build_tiny_tokenizer
    from rl.sft_data import make_sft_batch
    from rl.step import attach_rewards
    s = _service(plugin_file, "validity", "with_components")
    bad = _service(plugin_file, "bad_validity")
    try:
        out = s.score(_items("ok1", "no"))
        failed = bad.score(_items("ok"))
    finally:
        s.close()
        bad.close()
    assert [o["valid"] for o in out] == [True, False]
    assert "valid" not in out[0]["components"]  # a verdict, not a numeric component
    assert failed[0]["failed"] and "bad_validity" in failed[0]["error"] and "'valid' must be a bool" in failed[0]["error"]
    batch = make_sft_batch(build_tiny_tokenizer(), ["q", "q"], ["ok1", "no"])
    attach_rewards(batch, out)
    assert batch.valid.tolist() == [True, False]


def test_async_batched_and_params(plugin_file):
    s = _service(plugin_file, "async_len", "batch_len", "scaled", scaled={"factor": 10.0})
    try:
        out = s.score(_items("ab", "abcde", "a"))
    finally:
        s.close()
    assert [o["score"] for o in out] == [2 + 2 + 10, 5 + 5 + 10, 1 + 1 + 10]


def test_one_function_twice_under_two_labels(plugin_file):
    spec = f"{plugin_file}:scaled"
    s = RewardService([RewardSpec(spec, 1.0, {"factor": 2.0}, "self_grade"),
                       RewardSpec(spec, 0.0, {"factor": 5.0}, "heldout")], num_workers=1)
    try:
        out = s.score(_items("ab", "c"))
    finally:
        s.close()
    # each copy keeps its own params and result; the weight-0 one is measured but not summed
    assert [o["score"] for o in out] == [2.0, 2.0]
    assert all(o["components"] == {"self_grade": 2.0, "heldout": 5.0} for o in out)
    with pytest.raises(ValueError, match="more than once"):
        RewardService([RewardSpec(spec, 1.0, {}), RewardSpec(spec, 0.0, {"factor": 5.0})], num_workers=1)


def test_eval_only_functions_run_on_evaluation_and_never_change_the_score(plugin_file):
    s = RewardService([RewardSpec(f"{plugin_file}:scaled", 1.0, {"factor": 2.0}),
                       RewardSpec(f"{plugin_file}:async_len", 1.0, {}, "judge", eval_only=True),
                       RewardSpec(f"{plugin_file}:raises", 1.0, {}, "broken_judge", eval_only=True)], num_workers=1)
    try:
        train, held_out = s.score(_items("abc")), s.score(_items("abc"), evaluation=True)
    finally:
        s.close()
    assert train[0]["components"] == {f"{plugin_file}:scaled": 2.0}  # not run while training
    assert held_out[0]["score"] == 2.0 and not held_out[0]["failed"]
    assert held_out[0]["components"]["judge"] == 3.0 and held_out[0]["components"]["broken_judge/failed"] == 1.0


def test_batched_wrong_length_is_failure(plugin_file):
    s = _service(plugin_file, "batch_short")
    try:
        out = s.score(_items("a", "b", "c", "d", "e"))
    finally:
        s.close()
    assert any(o["failed"] and "expected a list" in o["error"] for o in out)


def test_unloadable_plugin_fails_at_start(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise ImportError('missing dependency foo')\n")
    with pytest.raises(RegistryError, match="bad.py"):
        RewardService([RewardSpec(f"{bad}:fn")])
    with pytest.raises(RegistryError, match="unknown reward"):
        RewardService([RewardSpec("no_such_reward")])


def test_math_in_worker_processes():
    s = RewardService([RewardSpec("math")], num_workers=2, timeout_s=10)
    try:
        out = s.score(_items("\\boxed{1}", "\\boxed{2}", "no box"))
    finally:
        s.close()
    assert [o["score"] for o in out] == [1.0, 0.0, 0.0]


def test_killed_worker_is_replaced_and_its_samples_scored_again(plugin_file, tmp_path):
    s = _service(plugin_file, "dies_once", dies_once={"marker": str(tmp_path / "died")})
    try:
        out = s.score(_items("a", "bb", "die", "dddd", "eeeee", "ffffff"))
    finally:
        s.close()
    assert (tmp_path / "died").exists() and s.worker_deaths == 1
    # every sample scored exactly once, none lost to the dead worker
    assert [o["score"] for o in out] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert not any(o["failed"] for o in out)


def test_stuck_worker_is_killed_and_its_samples_scored_again(plugin_file, tmp_path):
    """A worker that blocks the per-sample timer and never answers is stuck, not dead: past every timer and
    the grace period the pool is killed and restarted, and the unfinished samples are scored again."""
    specs = [RewardSpec(f"{plugin_file}:stuck_once", 1.0, {"marker": str(tmp_path / "stuck")})]
    s = RewardService(specs, num_workers=2, timeout_s=0.5, failure_reward=-1.0, grace_s=3.0)
    try:
        s.score(_items("warm"))  # the pool is up before the timed call
        out = s.score(_items("a", "bb", "stuck", "dddd"))
    finally:
        s.close()
    assert (tmp_path / "stuck").exists() and s.worker_deaths == 1 and s.restarts == 1
    assert [o["score"] for o in out] == [1.0, 2.0, 5.0, 4.0] and not any(o["failed"] for o in out)
