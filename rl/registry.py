"""Name → object registry for pluggable pieces (advantage estimators, losses, rewards, engines, ...).

`lookup(kind, spec)` resolves, in order:
  * a short name registered with `@register(kind, name)`;
  * `package.module:attr` (imported);
  * `path/to/file.py:attr` (loaded from the file);
  * an entry point named `spec` in the group `looprl.<kind>`.
Unknown names fail with one error that lists the known ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
import warnings
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

KINDS = ("advantage", "loss", "reward", "engine", "env", "stage", "decoding", "family", "optimizer", "scheduler",
         "task", "sampler", "adapter")

_REGISTRY: dict[str, dict[str, Any]] = {k: {} for k in KINDS}

# The modules of this library that register the built-ins of a kind; imported lazily so that the library stays
# light. Each method folder (`rl/methods/NAME/`) declares its own in a `BUILTINS` mapping in its `__init__.py`. The packages above it (`rollout`, `rewards`, `cluster`) declare their own in a `BUILTINS` mapping
# of the same shape, published through the entry-point group `looprl.builtins` (pyproject.toml), so that this
# module names none of them.
LIBRARY_BUILTINS = {
    "advantage": ["rl.advantages"],
    "loss": ["rl.losses"],
    "env": ["rl.env"],
    "optimizer": ["rl.optim"],
    "task": ["rl.tasks.arithmetic", "rl.tasks.domains"],
    "scheduler": ["rl.optim"],
    "sampler": ["rl.data"],
    "stage": ["rl.loop.stage"],
}
BUILTINS_GROUP = "looprl.builtins"
# Built-ins named by `module:attr`, for modules that may not import the registry (`models/` imports only
# torch and transformers); resolved on first use.
_BUILTIN_ATTRS = {
    "family": {"causal": "models.families:CausalFamily", "looped": "models.families:LoopedFamily",
               "value": "models.families:ValueFamily", "sequence_score": "models.families:SequenceScoreFamily",
               "masked_diffusion": "models.families:MaskedDiffusionFamily"},
    "adapter": {"lora": "models.adapters:lora", "ulora": "models.adapters:ulora"},
}


# Resolvers for specs that are not names (e.g. reward servers named by URL): kind -> [(matches, make)],
# added by the modules that know them (`rewards.remote`), so that this core module imports none of them.
_RESOLVERS: dict[str, list[tuple[Callable[[str], bool], Callable[[str], Any]]]] = {k: [] for k in KINDS}


def register_resolver(kind: str, matches: Callable[[str], bool], make: Callable[[str], Any]) -> None:
    """Specs of `kind` for which `matches(spec)` is true resolve to `make(spec)` (kept once made)."""
    _RESOLVERS[kind].append((matches, make))


# Former names kept working: kind -> {old name: new name}; `lookup` warns once per name and returns the new entry.
_ALIASES: dict[str, dict[str, str]] = {k: {} for k in KINDS}


def register_alias(kind: str, old: str, new: str) -> None:
    """Keep the former name `old` of `kind`'s `new` working, with a deprecation warning naming the new one."""
    _ALIASES[kind][old] = new


class RegistryError(LookupError):
    """A spec could not be resolved to a registered or importable object."""


def register(kind: str, name: str) -> Callable[[Any], Any]:
    """Decorator: register `obj` under `kind`/`name`. Registering a taken name is an error."""
    if kind not in _REGISTRY:
        raise RegistryError(f"unknown registry kind {kind!r}; kinds are {list(KINDS)}")

    def deco(obj: Any) -> Any:
        if name in _REGISTRY[kind] and _REGISTRY[kind][name] is not obj:
            raise RegistryError(f"{kind} {name!r} is already registered ({_REGISTRY[kind][name]!r})")
        _REGISTRY[kind][name] = obj
        return obj

    return deco


def builtin_modules(kind: str) -> list[str]:
    """The modules that register the built-ins of `kind`: the library's, each method folder's and those every
    installed package declares in the entry-point group `looprl.builtins` (a `BUILTINS` mapping of kind to module names)."""
    modules = list(LIBRARY_BUILTINS.get(kind, []))
    import rl.methods
    for info in sorted(pkgutil.iter_modules(rl.methods.__path__), key=lambda m: m.name):
        if info.ispkg:
            modules += getattr(importlib.import_module(f"rl.methods.{info.name}"), "BUILTINS", {}).get(kind, [])
    for ep in sorted(entry_points(group=BUILTINS_GROUP), key=lambda e: e.name):
        try:
            declared = ep.load()
        except Exception as exc:
            raise RegistryError(f"entry point {ep.name!r} of {BUILTINS_GROUP} ({ep.value}) failed to load: "
                                f"{type(exc).__name__}: {exc}") from exc
        modules += declared.get(kind, [])
    return modules


_LOADED_KINDS: set[str] = set()  # kinds whose built-in modules are imported (entry points are read once per kind)


def _load_builtins(kind: str) -> None:
    if kind not in _LOADED_KINDS:
        for mod in builtin_modules(kind):
            importlib.import_module(mod)
        _LOADED_KINDS.add(kind)
    for name, target in _BUILTIN_ATTRS.get(kind, {}).items():
        if name not in _REGISTRY[kind]:
            module, attr = target.split(":")
            _REGISTRY[kind][name] = getattr(importlib.import_module(module), attr)


def known(kind: str) -> list[str]:
    """Short names registered for `kind` (built-ins included)."""
    _load_builtins(kind)
    return sorted(_REGISTRY[kind])


def _load_file_attr(path: str, attr: str, kind: str, spec: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        raise RegistryError(f"{kind} plugin {spec!r}: file {str(file)!r} does not exist")
    mod_name = f"looprl_plugin_{abs(hash(str(file.resolve())))}"
    if mod_name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(mod_name, file)
        module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
        try:
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:  # the plugin's own import error, reported with its name
            raise RegistryError(f"{kind} plugin {spec!r}: importing {str(file)!r} failed: "
                                f"{type(exc).__name__}: {exc}") from exc
        sys.modules[mod_name] = module
    module = sys.modules[mod_name]
    if not hasattr(module, attr):
        raise RegistryError(f"{kind} plugin {spec!r}: {str(file)!r} has no attribute {attr!r}")
    return getattr(module, attr)


def lookup(kind: str, spec: str) -> Any:
    """Resolve `spec` (short name, `module:attr`, `file.py:attr` or entry point) for `kind`."""
    if kind not in _REGISTRY:
        raise RegistryError(f"unknown registry kind {kind!r}; kinds are {list(KINDS)}")
    if not isinstance(spec, str) or not spec:
        raise RegistryError(f"{kind} spec must be a non-empty string, got {spec!r}")
    _load_builtins(kind)
    if spec in _REGISTRY[kind]:
        return _REGISTRY[kind][spec]
    if spec in _ALIASES[kind]:
        new = _ALIASES[kind][spec]
        warnings.warn(f"{kind} {spec!r} is now called {new!r}; the old name will be removed, rename it in your recipe",
                      FutureWarning, stacklevel=2)
        return lookup(kind, new)
    for matches, make in _RESOLVERS[kind]:
        if matches(spec):
            _REGISTRY[kind][spec] = make(spec)
            return _REGISTRY[kind][spec]
    if ":" in spec:
        target, attr = spec.rsplit(":", 1)
        if target.endswith(".py") or "/" in target:
            return _load_file_attr(target, attr, kind, spec)
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise RegistryError(f"{kind} plugin {spec!r}: cannot import module {target!r}: "
                                f"{type(exc).__name__}: {exc}") from exc
        if not hasattr(module, attr):
            raise RegistryError(f"{kind} plugin {spec!r}: module {target!r} has no attribute {attr!r}")
        return getattr(module, attr)
    for ep in entry_points(group=f"looprl.{kind}"):
        if ep.name == spec:
            try:
                return ep.load()
            except Exception as exc:
                raise RegistryError(f"{kind} entry point {spec!r} ({ep.value}) failed to load: "
                                    f"{type(exc).__name__}: {exc}") from exc
    eps = sorted(ep.name for ep in entry_points(group=f"looprl.{kind}"))
    raise RegistryError(f"unknown {kind} {spec!r}; known: {sorted(_REGISTRY[kind]) + eps} "
                        f"(or give 'package.module:attr' / 'path/to/file.py:attr')")


def get(kind: str, spec: str) -> Any:
    """The former name of `lookup` (it read as `ray.get` beside it); kept for plug-ins written against it."""
    warnings.warn("rl.registry.get is now rl.registry.lookup", FutureWarning, stacklevel=2)
    return lookup(kind, spec)


def check_params(kind: str, spec: str, params: dict[str, Any], key: str,
                 supplied: tuple[str, ...] = ()) -> None:
    """Fail early when recipe `params` name keywords that the `kind` function `spec` does not take.

    `supplied` are keywords the framework passes itself (they may not be set in the recipe either).
    """
    import inspect
    fn = lookup(kind, spec)
    sig = inspect.signature(fn)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    if takes_any and not any(p.kind is inspect.Parameter.KEYWORD_ONLY for p in sig.parameters.values()):
        return  # a function taking only **kwargs accepts anything
    accepted = [n for n, p in sig.parameters.items()
                if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for name in params:
        if name in supplied:
            raise RegistryError(f"{key}.{name}: looprl sets {name!r} itself (from the recipe's algorithm "
                                f"section or the batch); remove it here")
        if name not in accepted:
            raise RegistryError(f"{key}.{name}: {kind} {spec!r} has no parameter {name!r}; "
                                f"its parameters are {[a for a in accepted if a not in supplied]}")


def required_parameters(fn: Any) -> list[str]:
    """Names of `fn`'s parameters that have no default, in order."""
    import inspect
    return [n for n, p in inspect.signature(fn).parameters.items()
            if p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
