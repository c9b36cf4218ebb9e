"""What a resolved recipe means beyond its values: the error a bad recipe raises, plain containers of its
sections, the model family it trains, whether it trains a critic, and the keywords its policy loss is called
with. Shared by the schema (`rl.config`), the checks (`rl.validation`) and the trainer."""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from models.families import family_for_model_type
from rl.registry import known, lookup


class ConfigError(ValueError):
    """A recipe cannot be loaded: names the file and the key."""


def as_container(node: Any) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def model_family(cfg: DictConfig, model_path: str | None) -> str:
    """`model.family`, with `auto` resolved from the model folder's `model_type` (the tiny model's `arch`
    when the recipe builds one; causal when the folder is not there to read)."""
    if cfg.model.family != "auto":
        return cfg.model.family
    if cfg.model.path is None:
        return family_for_model_type(cfg.model.tiny.arch)
    return family_for_model_type(model_type_of(model_path or cfg.model.path))


def model_type_of(model_path: str) -> str:
    """The `model_type` of a model folder's config ('' when the folder is not there to read)."""
    config = Path(model_path) / "config.json"
    return json.loads(config.read_text()).get("model_type", "") if config.is_file() else ""


def needs_critic(cfg: DictConfig) -> bool:
    """Whether the recipe's advantage estimator reads a value model's `values` (PPO's `gae`)."""
    return "values" in inspect.signature(lookup("advantage", cfg.algorithm.advantage)).parameters


def policy_loss_params(cfg: DictConfig, loss_fn: Any) -> dict[str, Any]:
    """The keywords every policy loss is called with: the recipe's `algorithm.loss_params` plus what the
    algorithm section decides. `algorithm.kl_coef` / `kl_in_reward` are the single source of truth for the KL
    term: a loss that takes `kl_coef` always receives it (0 when no reference is loaded or the KL is in the
    reward), so no loss's own default can add a KL term the recipe did not ask for."""
    a = cfg.algorithm
    params = {**as_container(a.loss_params), "agg": a.loss_agg, "norm_len": float(cfg.rollout.max_new_tokens)}
    accepted = inspect.signature(loss_fn).parameters
    kl_in_loss = a.kl_coef if (a.kl_coef > 0 and not a.kl_in_reward) else 0.0
    if "kl_coef" in accepted:
        params.update(kl_coef=kl_in_loss, kl_estimator=a.kl_estimator)
    elif kl_in_loss:
        raise ConfigError(f"algorithm.kl_coef: loss {a.loss!r} takes no kl_coef; put the KL in the reward "
                          f"(algorithm.kl_in_reward: true) or set algorithm.kl_coef 0")
    if "entropy_coef" in accepted:
        params["entropy_coef"] = a.entropy_coef
    elif a.entropy_coef:
        raise ConfigError(f"algorithm.entropy_coef: loss {a.loss!r} takes no entropy_coef; set it to 0")
    return params


def engine_options(engine_params: Any, engine: str, key: str) -> dict[str, Any]:
    """The keyword options of `engine` from an `engine_params` mapping that holds one section per engine
    (`{hf: {attn_implementation: eager}, vllm: {max_model_len: 512}}`): switching `rollout.engine` (or a judge's
    engine) from the command line then takes that engine's own options, and an engine without a section gets
    none. A mapping without engine sections is the older flat form: its options go to the configured engine,
    with a deprecation warning. `key` names the recipe key in messages."""
    params = dict(as_container(engine_params) or {})
    engines = set(known("engine")) | {engine}
    sections = [k for k in params if k in engines]
    if not sections:
        if params:
            warnings.warn(f"{key}: options without an engine section are deprecated; write "
                          f"{{{engine}: {json.dumps(params)}}} so that they follow the engine", FutureWarning,
                          stacklevel=2)
        return params
    options = sorted(k for k in params if k not in engines)
    if options:
        raise ConfigError(f"{key}: {options} sit beside the engine sections {sorted(sections)}; put each option "
                          "under the engine it belongs to")
    bad = [k for k in sections if not isinstance(params[k], dict)]
    if bad:
        raise ConfigError(f"{key}.{bad[0]}: an engine section must be a mapping of options, got {params[bad[0]]!r}")
    return dict(params.get(engine) or {})
