"""The library's contracts are Protocols that the driver's classes satisfy without importing them as bases: each
implementation must offer every method of its contract with the same parameters."""

import inspect

import pytest

from cluster.rl_roles import RayRLRoles
from cluster.runtime import Runtime
from rl.loop.roles import RLRoles
from rl.stages import StageRuntime


def contract_gaps(contract: type, impl: type) -> list[str]:
    """What `impl` lacks or declares differently among `contract`'s methods."""
    gaps = []
    for name, fn in vars(contract).items():
        if name.startswith("_") or not callable(fn):
            continue
        if not callable(getattr(impl, name, None)):
            gaps.append(f"{name}: missing")
            continue
        want = list(inspect.signature(fn).parameters)
        got = list(inspect.signature(getattr(impl, name)).parameters)
        if want != got:
            gaps.append(f"{name}: {got} instead of {want}")
    return gaps


@pytest.mark.parametrize("contract, impl", [(RLRoles, RayRLRoles), (StageRuntime, Runtime)])
def test_the_driver_implements_every_method_of_the_contract(contract, impl):
    assert contract_gaps(contract, impl) == []


def test_a_missing_or_changed_method_is_named():
    class Partial:
        def rollout_turn(self) -> None: ...

        def score(self, batch) -> list: ...

    gaps = contract_gaps(RLRoles, Partial)
    assert "learner_turn: missing" in gaps and "score: ['self', 'batch'] instead of ['self', 'batch', 'step']" in gaps
