"""The loss's peak in logit-sized tensors, measured by the allocator, against what the stacks
price for it.

A language model's loss over upcast logits (`pred.float()` then cross-entropy: the zoo's task,
transformers', torchtitan's) runs forward and backward on one rank under torch's profiler with
memory events, whose running sum of allocations and frees is what `max_memory_allocated`
reports. The dispatch-mode counter of the memory-peak test (`LiveBytes`) cannot be used here: a
tensor subclass runs its own handlers below the mode, and torch's `loss_parallel()` computes
its log-softmax and the backward inside DTensor's, so their transients go unseen.

Measured (2026-11-27, torch 2.13, 256 tokens x 16384 vocabulary): the fused kernels' path peaks
at 6 bf16 logit units (3 fp32 tensors, in the backward: the kept log-probabilities, the NLL's
gradient and the log-softmax's); under `loss_parallel()`, with the logits a DTensor split over
the vocabulary, at 8 (4 fp32: its backward's zeros, exp, sum and product beside the kept
log-probabilities). The stacks whose loss runs under `loss_parallel()` with tp > 1 (autopar's
runtime, torchtitan) price that one more fp32 tensor (`CostOptions.loss_parallel_fp32_copies`),
and the estimator adds it only where the head's logits are split over tp > 1.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile

import autopar
from autopar.config import ParallelConfig
from autopar.estimate import CostOptions
from autopar.models import zoo

TOKENS, HIDDEN, VOCAB = 256, 64, 16384
UNIT = TOKENS * VOCAB * 2  # one bf16 logit-sized tensor


def _peak(prof) -> int:
    """The most bytes allocated at once, from the profiler's allocation and free events."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _loss_peak_units(parallel: bool) -> float:
    """The loss's forward and backward (logits made, upcast, dropped before the backward, as
    torchtitan's train step and autopar's trainer do) in bf16 logit units."""
    torch.manual_seed(0)
    head = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (TOKENS,))
    if parallel:
        mesh = init_device_mesh("cpu", (1,))
        head = DTensor.from_local(head, mesh, [Shard(0)])  # the vocabulary split over tp
        x = DTensor.from_local(x, mesh, [Replicate()])
        labels = DTensor.from_local(labels, mesh, [Replicate()])
    head.requires_grad_()
    context = loss_parallel() if parallel else torch.enable_grad()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, context:
        pred = x @ head.t()
        loss = F.cross_entropy(pred.float(), labels)
        del pred
        loss.backward()
    return _peak(prof) / UNIT


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_loss_parallel_holds_one_more_fp32_logit_tensor_than_the_fused_kernels():
    fused, parallel = _loss_peak_units(False), _loss_peak_units(True)
    # the head's weight gradient and the input's are tiny against the logits
    assert fused == pytest.approx(6.0, abs=0.1)
    assert parallel == pytest.approx(8.0, abs=0.1)
    for name in ("autopar", "autopar-compile", "torchtitan", "torchtitan-compile"):
        options = autopar.load_stack(name).options
        assert (parallel - fused) / 2 == pytest.approx(options.loss_parallel_fp32_copies, abs=0.05)
    # autopar's runtime: no logits of the training precision beside its fp32 copies
    options = autopar.load_stack("autopar").options
    assert options.logit_copies + 2 * options.logit_fp32_copies == pytest.approx(fused, abs=0.1)


@pytest.fixture(scope="module")
def llama():
    shape = dict(num_layers=2, hidden=256, ffn_hidden=512, num_heads=4, num_kv_heads=2,
                 vocab_size=8192, seq_len=128)  # fmt: skip
    model = zoo.build("llama-8b", device="meta", **shape)
    return model, autopar.trace(model, zoo.example_inputs("llama-8b", model))


def _activations(llama, cfg: ParallelConfig, copies: float) -> float:
    model, graph = llama
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=cfg.world_size)
    options = replace(CostOptions(), logit_fp32_copies=3.0, loss_parallel_fp32_copies=copies)
    plan = autopar.evaluate(model, cluster, cfg, global_batch_size=8, graph=graph,
                            options=options)  # fmt: skip
    return plan.stages[-1].memory_bytes["activations"]


def test_the_extra_fp32_tensor_is_priced_only_for_logits_split_over_tp(llama):
    # one fp32 logit tensor of a rank: micro-batch 2 x 128 tokens x 8192 / tp x 4 bytes
    tp2 = ParallelConfig(tp=2, micro_batch_size=2)
    extra = _activations(llama, tp2, 1.0) - _activations(llama, tp2, 0.0)
    assert extra == pytest.approx(2 * 128 * 8192 / 2 * 4, rel=1e-6)
    dp2 = ParallelConfig(dp=2, micro_batch_size=2)  # no tp: the fused kernels' loss
    assert _activations(llama, dp2, 1.0) == _activations(llama, dp2, 0.0)
