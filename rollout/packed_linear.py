"""Linear layers for the `hf` engine's decode loop on CPU with their weights packed once per generate into the
BLAS's blocked layout, instead of the plain layout that every `F.linear` call re-blocks.

Why: a decode step multiplies each weight by a thin block of rows (one token per sequence: 128 rows at the race's
batch). The plain `F.linear` packs its weight operand into the BLAS's blocked layout at every call, and with the
weights out of cache (an 85M model's fp32 weights are 330 MB) that packing, not the multiply, can set the pace: at
128 rows the matmuls ran at 105-130 GFLOP/s in fp32 on 2 cores of a Zen 4 against 170-190 with weights packed once;
in bf16 about 1.1-1.3x (measured on the race's shapes, weights cycled so that none stays in cache).

Which packing: in bf16, oneDNN's (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`: the path
torch's inductor takes for frozen CPU weights). In fp32 the faster of two depends on the CPU, so the engine's
`fp32_packing` picks (`resolve_fp32_packing`; `auto` by default: a fixed rule, so that every run of a machine
packs alike and a seed samples the same tokens):
- MKL's own packed sgemm (`torch.ops.mkl._mkl_reorder_linear_weight`, then `_mkl_linear`, inductor's path for
  frozen fp32 weights): the same kernels as `F.linear`'s sgemm on a pre-packed operand, so the products equal
  `F.linear`'s bit for bit at the decode's block sizes (64+ rows; to fp32 rounding at a few rows, where MKL picks
  other kernels). On an AMX Xeon, 2 threads, `[M, 768] x [768, 1536]` at M = 64-128 ran at 280-312 GFLOP/s against
  oneDNN's 228-273 and `F.linear`'s 229-285. `_mkl_linear` takes the packed operand only for the row count it is
  told; MKL's packed B depends on the columns and the reduction only (its size is the same for every row count, and
  the products are right for any: tested), so each call passes its own row count and one packing serves a loop
  whose batch shrinks as rows end.
- oneDNN's, as in bf16: equal to `F.linear` to fp32 rounding (another blocking order). On an AMD EPYC (Zen 3,
  AVX2), 2 threads, the decode's shapes at 16-128 rows ran at 1.1-1.8x MKL's packed rate, and the race's fp32
  rollout took 0.84x MKL's time with the same tokens (5 alternated pairs) (`benchmarks/packed_linear.py`).
`auto` takes MKL's where torch has MKL and the CPU is Intel's (where MKL was measured faster), oneDNN's elsewhere.

Used by `rollout.decoding.decode(packed_weights=True)` (the `hf` engine's `packed_linear_weights`, on by default)
while it runs: every `nn.Linear` module (exactly that type; a subclass or a wrapper that calls `F.linear` itself,
such as the fake-quantized layer, keeps its forward) on CPU in fp32 or bf16 has its `forward` replaced for the
duration. A weight is packed on its module's first call (so a wrapped layer that is never called is never packed)
and dropped on exit: the packed copies cost one more copy of the weights while the loop runs, and packing the 85M
model takes about 0.1-0.2 s a generate. A call that needs gradients, or whose input's dtype differs from the
weight's, runs the plain `F.linear`. bf16 products equal `F.linear`'s to rounding (the same oneDNN kernels in
another blocking order). Should the packed path fail on its first call (a build without oneDNN's bf16 support),
the loop warns once and decodes with `F.linear`.

Inside the compiled decode step (`rollout.compiled_decode`, `graph=True`) the same products run as one custom op,
`looprl::packed_linear`, that the graph calls with the plain weight: inductor cannot take packed tensors as
graph inputs, so the op looks the packed copy up by the weight's storage (packed on first use, dropped on exit, as
above); on a CPU it multiplies a 128-row decode block about 1.5x faster than the graph's own `mm` on plain weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F

from rollout.base import run_or_fall_back
from rollout.hardware import cpu_has_bf16_matmul, cpu_vendor

_state = {"ran": False, "failed": None}  # whether a packed product has run once; why the packed path could not
# the packed copies `looprl::packed_linear` reads, by weight storage, the row hint and the fp32 packing: set while a
# graph-mode `packed_linear_weights` runs
_graph: dict[str, Any] = {"packs": None, "rows": None, "packing": None}


def _supported(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and cpu_has_bf16_matmul()


def packs(module: torch.nn.Module) -> bool:
    """Whether `packed_linear_weights` replaces `module`'s forward: an `nn.Linear` (the type itself) on CPU in
    fp32 or bf16."""
    return (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
            and _supported(module.weight.dtype))


FP32_PACKINGS = ("auto", "mkl", "onednn")


def fp32_packing_for_this_cpu() -> str:
    """`auto`'s choice: `mkl` where torch has MKL and the CPU's vendor is Intel, `onednn` elsewhere (module docstring)."""
    return "mkl" if torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel" else "onednn"


def resolve_fp32_packing(packing: str) -> str:
    """The packed product fp32 weights use for the engine option `fp32_packing`: `auto`
    (`fp32_packing_for_this_cpu`), `mkl` or `onednn`; a value that is none of these, or `mkl` where torch has no MKL,
    is refused naming the option."""
    if packing not in FP32_PACKINGS:
        raise ValueError(f"rollout.engine_params.hf.fp32_packing: {packing!r} is none of {', '.join(FP32_PACKINGS)}")
    if packing == "mkl" and not torch.backends.mkl.is_available():
        raise ValueError("rollout.engine_params.hf.fp32_packing: 'mkl', but this torch was built without MKL "
                         "(use auto or onednn)")
    return fp32_packing_for_this_cpu() if packing == "auto" else packing


def uses_mkl(dtype: torch.dtype, packing: str) -> bool:
    """Whether weights of `dtype` pack for MKL's sgemm (fp32 with the packing `mkl`) rather than for oneDNN."""
    return dtype == torch.float32 and packing == "mkl"


def _pack(weight: torch.Tensor, rows: int | None, packing: str) -> torch.Tensor:
    """`weight [out, in]` in the blocked layout of `packing` (fp32; bf16 packs for oneDNN) for products with about
    `rows` rows (a hint)."""
    if uses_mkl(weight.dtype, packing):
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows or 1)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def _multiply(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              packing: str) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with `weight` as `_pack(weight, rows, packing)` laid it out in `packed`."""
    if uses_mkl(weight.dtype, packing):
        # MKL's packed B serves any row count: each call names its own (see the module's docstring)
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.numel() // max(x.shape[-1], 1))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("looprl::packed_linear", mutates_args=())
def graph_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with `weight`'s packed copy, made on first use while a graph-mode
    `packed_linear_weights` runs (outside one, the plain product)."""
    packs = _graph["packs"]
    if packs is None:
        return F.linear(x, weight, bias)
    key = (weight.data_ptr(), weight.dtype, tuple(weight.shape))
    if key not in packs:
        packs[key] = _pack(weight, _graph["rows"], _graph["packing"])
    return _multiply(x, packs[key], weight, bias, _graph["packing"])


@graph_product.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _graph_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.looprl.packed_linear(x, module.weight, module.bias)


def _packed_forward(module: torch.nn.Linear, packed: dict[torch.nn.Module, torch.Tensor], rows: int | None,
                    packing: str) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        plain = (_state["failed"] is not None or x.dtype != weight.dtype
                 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
        if not plain:
            def multiply() -> torch.Tensor:
                w = packed.get(module)
                if w is None:
                    w = packed[module] = _pack(weight, rows, packing)
                return _multiply(x, w, weight, module.bias, packing)
            # an op this build lacks, an ISA oneDNN's bf16 path does not run on: F.linear from then on
            out = run_or_fall_back(_state, multiply, "rollout.packed_linear: packed weights did not run",
                                   "decoding with F.linear")
            if out is not None:
                return out
        return F.linear(x, weight, module.bias)
    return forward


@contextmanager
def packed_linear_weights(model: torch.nn.Module, enabled: bool = True, rows: int | None = None,
                          graph: bool = False, fp32_packing: str = "auto") -> Iterator[dict[Any, torch.Tensor]]:
    """While inside, every module of `model` that `packs` runs its forward with its weight packed once (on its first
    call; `rows`: the number of rows a call multiplies, a hint to the layout; `fp32_packing`: fp32 weights' layout,
    `resolve_fp32_packing`). Yields the packed weights (by module; with `graph`, by weight storage: the forwards call
    `looprl::packed_linear`, which a compiled graph can hold), empty when not `enabled` or none packs; the modules'
    own forwards are restored and the packed copies dropped on exit."""
    packed: dict[Any, torch.Tensor] = {}
    modules = [m for m in model.modules() if packs(m)] if enabled and _state["failed"] is None else []
    packing = resolve_fp32_packing(fp32_packing) if modules else fp32_packing
    if graph and modules:
        _graph.update(packs=packed, rows=rows, packing=packing)
    for module in modules:
        module.forward = (MethodType(_graph_forward, module) if graph
                          else _packed_forward(module, packed, rows, packing))
    try:
        yield packed
    finally:
        for module in modules:
            module.__dict__.pop("forward", None)
        if graph and modules:
            _graph.update(packs=None, rows=None, packing=None)
        packed.clear()
