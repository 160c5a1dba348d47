"""The optimizer step's bytes per parameter (`optimizer_step_bytes`) against the bytes torch's
own optimizers read and write, counted op by op under a dispatch mode on the CPU."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.estimate.memory import (
    LOSS_SCALE_BYTES,
    OPTIMIZER_BYTES,
    UNFUSED_OPTIMIZER_BYTES,
    optimizer_step_bytes,
)

N = 1 << 18  # elements: the step's scalar bookkeeping (the step count) is negligible per element


class _Traffic(TorchDispatchMode):
    """Bytes each op reads (its distinct tensor arguments) and writes (the arguments its schema
    marks written, and its outputs), summed over the ops."""

    def __init__(self, ignore_writes_to: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        self.total = 0
        self._ignored = {t.untyped_storage().data_ptr() for t in ignore_writes_to}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reads = {
            t.untyped_storage().data_ptr(): t.nbytes
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        writes = {}
        for arg, value in zip(func._schema.arguments, args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write:
                writes.update(
                    (t.untyped_storage().data_ptr(), t.nbytes) for t in tree_flatten(value)[0]
                )
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                writes[t.untyped_storage().data_ptr()] = t.nbytes
        for ptr in self._ignored:
            writes.pop(ptr, None)
        self.total += sum(reads.values()) + sum(writes.values())
        return out


def _step_bytes(make, ignore_grad_writes: bool = False) -> float:
    param = torch.nn.Parameter(torch.randn(N))
    param.grad = torch.randn(N)
    opt = make(param)
    opt.step()  # the state exists from here on
    traffic = _Traffic((param.grad,) if ignore_grad_writes else ())
    with traffic:
        opt.step()
    return traffic.total / N


@pytest.mark.parametrize(
    ("optimizer", "make"),
    [
        ("adamw", lambda p: torch.optim.AdamW([p], foreach=False)),
        ("adamw", lambda p: torch.optim.AdamW([p], foreach=True)),
        ("adam", lambda p: torch.optim.Adam([p], foreach=False)),
        ("sgd_momentum", lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, foreach=False)),
        ("sgd", lambda p: torch.optim.SGD([p], lr=0.1, foreach=False)),
    ],
)
def test_unfused_step_moves_the_bytes_torch_moves(optimizer, make):
    assert _step_bytes(make) == pytest.approx(UNFUSED_OPTIMIZER_BYTES[optimizer], abs=0.01)
    # the measured step is also bf16 training's where the gradients reach it in fp32 over
    # fp32 parameters (FSDP2's reduce dtype, autocast): no casts of its own
    for precision in ("fp32", "bf16"):
        step = optimizer_step_bytes(optimizer, precision, 4, fused=False)
        assert step == UNFUSED_OPTIMIZER_BYTES[optimizer]


def test_fused_step_moves_each_tensor_once():
    # _fused_adamw_'s schema marks the gradients written (it unscales them in place under a
    # grad scaler); without one it only reads them
    measured = _step_bytes(lambda p: torch.optim.AdamW([p], fused=True), ignore_grad_writes=True)
    assert measured == pytest.approx(OPTIMIZER_BYTES[("adamw", False)], abs=0.01)
    assert optimizer_step_bytes("adamw", "fp32", 4) < optimizer_step_bytes(
        "adamw", "fp32", 4, fused=False
    )


def test_fp16_unscale_pass_is_priced():
    param = torch.nn.Parameter(torch.randn(N))
    opt = torch.optim.AdamW([param], fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(param.sum()).backward()  # the scale made; the gradient scaled
    traffic = _Traffic()
    with traffic:
        scaler.unscale_(opt)
    assert traffic.total / N == pytest.approx(LOSS_SCALE_BYTES[True], abs=0.01)
    bf16 = optimizer_step_bytes("adamw", "bf16", 4)
    assert optimizer_step_bytes("adamw", "fp16", 4) == bf16 + LOSS_SCALE_BYTES[True]
