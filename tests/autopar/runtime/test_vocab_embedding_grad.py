"""A vocabulary-split token embedding keeps only its rows' gradient from the first micro-batch.

DTensor's embedding backward gives the whole vocabulary's weight gradient on every tp rank (a
Replicate gradient from the replicated output gradient), tp times the planned gradient bytes;
the runtime cut it to the rank's rows only after the last micro-batch, so every later
micro-batch's activations and loss were held beside a whole-vocabulary fp32 table (measured by
the allocator's events on the memory-peak test's TP2 Llama case: 4 of its 8 MiB not planned).
`tp_apply._keep_rows` cuts it as it is accumulated. Here on 2 gloo ranks, Llama with TP2 and
SP: after the first micro-batch the gradient is the weight's Shard(0) rows; after two, it
equals the single-process gradient of the same two micro-batches.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from autopar.config import ParallelConfig
from autopar.models import zoo
from autopar.runtime.tensor_parallel import tp_plan
from autopar.runtime.tp_apply import apply_tensor_parallel, loss_context

SHAPE = dict(num_layers=1, hidden=64, ffn_hidden=128, num_heads=4, num_kv_heads=2,
             vocab_size=512, seq_len=32)  # fmt: skip


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["seq_len"]), generator=g)
            for _ in range(2)]  # fmt: skip


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.build("llama-8b", device="cpu", **SHAPE)


def _sharded_grads() -> tuple[tuple, tuple[int, ...], torch.Tensor]:
    model = _model()
    config = ParallelConfig(tp=2, sequence_parallel=True)
    plan = tp_plan(model, config, vocab_parallel=True)
    embedding = next(p for p, s in plan.items() if s.startswith("vocab_embedding"))
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), plan)
    weight = model.get_submodule(embedding).weight
    after_first = None
    for ids in _batches():
        with loss_context(plan):
            zoo.lm_loss(model(ids), ids).backward()
        if after_first is None:
            grad = weight.grad
            after_first = (tuple(grad.placements), tuple(grad.to_local().shape))
    return after_first, tuple(weight.to_local().shape), weight.grad.full_tensor()


@pytest.mark.multiprocess
def test_the_embedding_gradient_is_the_ranks_rows_from_the_first_micro_batch():
    (placements, local_shape), weight_shape, grad = run_ranks(2, _sharded_grads)[0]
    assert placements == (Shard(0),)
    assert local_shape == weight_shape == (SHAPE["vocab_size"] // 2, SHAPE["hidden"])
    model = _model()
    for ids in _batches():
        zoo.lm_loss(model(ids), ids).backward()
    want = model.get_submodule("embed_tokens").weight.grad
    assert isinstance(grad, torch.Tensor) and not isinstance(grad, DTensor)
    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6)
