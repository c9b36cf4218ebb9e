"""Learner → rollout weight transfer through Ray's object store.

Tensors travel as numpy arrays: Ray stores those out-of-band and reads them back zero-copy, while a
pickled torch tensor is copied on both sides (measured for a 71M-parameter model on CPU: 0.95 s vs
0.1 s). bfloat16 has no numpy dtype, so it travels as its int16 bit pattern.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

PackedState = dict[str, tuple[np.ndarray, str]]


def pack_state(state: dict[str, torch.Tensor]) -> PackedState:
    out: PackedState = {}
    for name, t in state.items():
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            out[name] = (t.view(torch.int16).numpy(), "bfloat16")
        else:
            out[name] = (t.numpy(), str(t.dtype).removeprefix("torch."))
    return out


def unpack_state(packed: PackedState) -> dict[str, torch.Tensor]:
    """Tensors viewing the (read-only) received buffers; copy them into the model, do not keep them."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that object-store buffers are not writable
        for name, (arr, dtype) in packed.items():
            t = torch.from_numpy(arr)
            out[name] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return out
