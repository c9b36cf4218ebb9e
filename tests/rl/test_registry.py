import sys
import textwrap

import pytest

from rl import registry
from rl.registry import RegistryError, lookup, register


def test_short_name_and_unknown_lists_known():
    assert callable(lookup("reward", "math"))
    with pytest.raises(RegistryError) as e:
        lookup("advantage", "gpro")
    assert "grpo" in str(e.value)


def test_module_attr_spec():
    from rl.losses import ppo_clip_loss
    assert lookup("loss", "rl.losses:ppo_clip_loss") is ppo_clip_loss
    with pytest.raises(RegistryError, match="has no attribute"):
        lookup("loss", "rl.losses:nope")
    with pytest.raises(RegistryError, match="cannot import module"):
        lookup("loss", "not_a_module_xyz:fn")


def test_file_path_spec(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def length_reward(prompt, response, **kw):\n    return float(len(response))\n")
    fn = lookup("reward", f"{f}:length_reward")
    assert fn("p", "abc") == 3.0
    with pytest.raises(RegistryError, match="does not exist"):
        lookup("reward", f"{tmp_path}/missing.py:fn")


def test_file_plugin_import_error_is_named(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("import not_a_real_package_xyz\n")
    with pytest.raises(RegistryError, match="broken.py.*ModuleNotFoundError"):
        lookup("reward", f"{f}:fn")


def test_entry_point(tmp_path, monkeypatch):
    # A real installed-distribution layout on sys.path: importlib.metadata discovers it.
    (tmp_path / "ep_plugin_mod.py").write_text("def score(prompt, response, **kw):\n    return 0.25\n")
    dist = tmp_path / "ep_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""
        [looprl.reward]
        quarter = ep_plugin_mod:score
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = lookup("reward", "quarter")
    assert fn("p", "r") == 0.25
    assert "ep_plugin_mod" in sys.modules


def test_register_conflict_and_bad_kind():
    @register("advantage", "test_unique_estimator")
    def est(r, g, m):
        return m

    assert lookup("advantage", "test_unique_estimator") is est
    with pytest.raises(RegistryError, match="already registered"):
        register("advantage", "test_unique_estimator")(lambda r, g, m: m)
    with pytest.raises(RegistryError, match="unknown registry kind"):
        register("nope", "x")
    registry._REGISTRY["advantage"].pop("test_unique_estimator")


def test_the_packages_above_the_library_declare_their_builtins_through_entry_points():
    import ast
    from pathlib import Path

    from rl import registry
    # the registry's own text names no module of a package above it ...
    source = Path(registry.__file__).read_text()
    strings = [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert [s for s in strings if s.split(".")[0] in ("rollout", "rewards", "cluster") and " " not in s] == []
    # ... and their built-ins arrive through the installed `looprl.builtins` entry points
    assert "cluster.pipeline" in registry.builtin_modules("stage")
    assert "rollout.hf_engine" in registry.builtin_modules("engine")
    assert {"rl", "grpo"} <= set(registry.known("stage")) | set(registry.known("advantage"))


def test_former_names_resolve_to_the_renamed_entries_with_a_deprecation_warning():
    renamed = {("stage", "select_bliss"): "bliss", ("stage", "compress_lowrank"): "decomper",
               ("decoding", "kv_beacon"): "beaconkv", ("decoding", "steer"): "densesteer",
               ("task", "memo_games"): "memo", ("env", "agentic_proposer"): "agentic_proposing"}
    for (kind, old), new in renamed.items():
        with pytest.warns(FutureWarning, match=f"{kind} '{old}' is now called '{new}'"):
            assert lookup(kind, old) is lookup(kind, new)
    with pytest.raises(RegistryError, match="unknown stage"):
        lookup("stage", "select_blis")
