"""The plan's peak memory against the peak the runtime's tensors reach, in bf16 (one rank in
MXFP8 too) on CPU ranks.

Each case trains two steps of a small Llama (or MoE: TP2 with SP, EP2; a pipeline over FSDP on
4 ranks) with the real trainer
under `LiveBytes` (every storage counted from its making to its freeing: what an allocator's
`max_memory_allocated` reports) and holds the peak against the plan's live bytes (its peak less
the allocator's reserve), priced for the autopar stack at the same config. Two steps: the
second has the optimizer's state from the start, as every later step. The vocabulary is large
against the hidden size, so the loss's logit-sized tensors make the peak, as in a real language
model (Llama 3: 128256 x 4096).

Bounds: measured <= 1.02 x planned (the plan does not under-price what the runtime holds: an
H100 run of a plan that did, ran out of memory, data/measurements/h100_program_2026-11-26.json;
bytes are counted, not timed, so the bound holds on a busy machine) and measured >= 0.7 x
planned (the plan counts gradients and buffers a step's peak may not hold yet, so it is
conservative, but not by a factor). Before the fixes these pin, the single-rank case measured
1.44 x its plan (the logits held through backward, the loss's fp32 copies priced as 2 bf16
ones), its MXFP8 twin 1.07 (an fp32 copy of each linear's input) and the MoE under TP2 without
SP 1.05 (autocast's bf16 copy of the experts' fp32 input, one per expert linear). Measured
2026-11-26, once fused attention's saved q, k and v were priced and `LiveBytes` followed
FSDP2's resized storages: 0.94 and 0.96 on one rank in BF16, 0.96 and 1.01 in MXFP8, 0.87 and
0.93 under FSDP2 ZeRO-3 (one and four micro-batches; 1.15 for four before `LiveBytes` did),
0.97-0.99 under TP2 (Llama with SP, MoE with and without; 0.82-0.89 since 2026-11-27, when the
plan priced loss_parallel's fourth fp32 logit tensor, which `LiveBytes` cannot see, and the
runtime cut the embedding's whole-vocabulary gradient to its rows at the first micro-batch:
tests/autopar/estimate/test_loss_peak.py, test_vocab_embedding_grad.py), 0.78 under EP2 (the
plan's two DDP-sized gradient buckets are not held at the activations' peak: the runtime
reduces the gradients after the backward), 0.92 for PP2 x FSDP2 ZeRO-3 with two layers a stage
(1.4-1.7 before); the case here, four layers a stage, 0.95 (1.09 before the plan kept the stage
gathered over the step, as the pipeline does). On 2026-11-27 the plan priced the loss's peak
and a recomputed block apart, no gradient at the loss's peak of a step of one micro-batch and
each eager norm's upcast input at fp32's width (an H100's allocator history:
`autopar.estimate.memory.StagePhases`): 0.992 and 0.989 on one rank in BF16, 1.015 and 1.037
in MXFP8 (its own bound, below), 0.91 under FSDP2, 0.81-0.88 under TP2, 0.85 under EP2, 0.93
for the pipeline. `pytest -s` prints each case's ratio.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from harness import Case, run_ranks, task_of
from live_bytes import LiveBytes

import autopar
from autopar.config import ParallelConfig
from autopar.hardware import Cluster
from autopar.models import zoo
from autopar.runtime.collectives import all_reduce_flat
from autopar.runtime.trainer import TrainOptions, train
from cost_models.comm import DDP_BUCKET_BYTES, flat_chunks

SHAPE = dict(
    num_layers=2, hidden=256, ffn_hidden=1024, num_heads=4, num_kv_heads=2, seq_len=256,
    vocab_size=8192,
)  # fmt: skip
BATCH = 8
OPTIONS = TrainOptions(steps=2, precision="bf16", device="cpu", log=False)
ONE_RANK = [
    Case("llama-8b", ParallelConfig(micro_batch_size=8), BATCH, overrides=SHAPE),
    Case("llama-8b", ParallelConfig(micro_batch_size=2, recompute="selective"), BATCH,
         overrides=SHAPE),
]  # fmt: skip
MOE = dict(SHAPE, num_experts=4, top_k=2, expert_ffn_hidden=512)
TWO_RANKS = [
    Case("llama-8b", ParallelConfig(fsdp=2, zero_stage=3, micro_batch_size=4), BATCH,
         overrides=SHAPE),
    # four micro-batches: FSDP2 gathers each unit again, into storages it resized to 0 between
    Case("llama-8b", ParallelConfig(fsdp=2, zero_stage=3, micro_batch_size=4), 4 * BATCH,
         overrides=SHAPE),
    # DTensor activations: counted through their local shards (`LiveBytes`)
    Case("llama-8b", ParallelConfig(tp=2, sequence_parallel=True, micro_batch_size=4), BATCH,
         overrides=SHAPE),
    Case("moe-tiny", ParallelConfig(tp=2, sequence_parallel=True, micro_batch_size=4), BATCH,
         overrides=MOE),
    # without FSDP a norm's output is fp32: cast once for the 8 expert linears reading it
    Case("moe-tiny", ParallelConfig(tp=2, micro_batch_size=4), BATCH, overrides=MOE),
    Case("moe-tiny", ParallelConfig(dp=2, ep=2, micro_batch_size=4), BATCH, overrides=MOE),
]  # fmt: skip


# precision -> a profile whose device runs it (MXFP8: Blackwell)
PROFILES = {"bf16": "dgx_h100", "mxfp8": "dgx_b200"}


def measure_peaks(cases: list[Case], precision: str = "bf16") -> list[int]:
    """On every rank: per case, the most bytes its tensors held at once over two steps."""
    peaks = []
    options = replace(OPTIONS, precision=precision)
    for case in cases:
        mode = LiveBytes()
        with mode:
            train(task_of(case), case.config, case.global_batch_size, options=options)
        peaks.append(mode.peak)
    return peaks


def planned_live_bytes(case: Case, precision: str = "bf16") -> float:
    model = zoo.build(case.model, device="meta", **case.overrides)
    cluster = Cluster.from_profile(PROFILES[precision], num_devices=case.config.world_size)
    plan = autopar.evaluate(
        model,
        cluster,
        case.config,
        zoo.example_inputs(case.model, model),
        global_batch_size=case.global_batch_size,
        precision=precision,
    )
    # the fullest stage's, against the fullest rank's
    return max(sum(v for k, v in s.memory_bytes.items() if k != "reserve") for s in plan.stages)


def check(world_size: int, cases: list[Case], precision: str = "bf16", upper: float = 1.02) -> None:
    per_rank = run_ranks(world_size, measure_peaks, cases, precision)
    for i, case in enumerate(cases):
        measured = max(peaks[i] for peaks in per_rank)
        planned = planned_live_bytes(case, precision)
        ratio = measured / planned
        print(f"{case.label} ({precision}): measured / planned live bytes {ratio:.3f}")
        assert 0.7 <= ratio <= upper, (
            f"{case.label}: measured peak {measured / 2**20:.1f} MiB, planned live "
            f"{planned / 2**20:.1f} MiB ({ratio:.2f}x)"
        )


@pytest.mark.multiprocess
def test_one_rank_peak_is_the_plans():
    check(1, ONE_RANK)


@pytest.mark.multiprocess
def test_one_rank_peak_in_mxfp8_is_the_plans():
    """torchao's MXFP8 linears save the input and the weight as a BF16 linear under autocast
    does (`low_precision._mx_linear` casts the FP32 weight, not the input: casting the input
    up saved an FP32 copy per linear, 1.07 x the plan at the first case).

    Bound 1.05, not 1.02: at the peak the emulated MXFP8 run holds what its BF16 twin holds
    and a detached fp32 copy of each converted linear's weight besides (7.5 MiB here, from
    torchao's weight wrapper under `.to`), which the plan does not price; 1.015 and 1.037 on
    2026-11-27, 0.992 and 0.989 in BF16. Its recompute transient, priced beside the loss's
    peak until then, hid it (0.96 and 1.01)."""
    pytest.importorskip("torchao.prototype.moe_training")
    check(1, ONE_RANK, "mxfp8", upper=1.05)


@pytest.mark.multiprocess
def test_fsdp_tp_and_ep_peaks_on_2_ranks_are_the_plans():
    check(2, TWO_RANKS)


@pytest.mark.multiprocess
def test_pipeline_over_fsdp_peak_on_4_ranks_is_the_plans():
    """PP2 x FSDP2 ZeRO-3, 16 micro-batches of four layers a stage, a small vocabulary: torch's
    pipelining keeps an FSDP stage's gathered parameters and unsharded fp32 gradients from its
    first backward to the step's end (`backward_maybe_with_nosync`), all of the stage's, not
    two layers' as a ZeRO-3 plan without a pipeline holds (`CostOptions.pp_keeps_unsharded`:
    1.09 x the plan before it was priced)."""
    config = ParallelConfig(pp=2, fsdp=2, zero_stage=3, micro_batch_size=1)
    shape = dict(SHAPE, num_layers=8, vocab_size=2048)
    # ZeRO-1 runs as ZeRO-3 does under the pipeline, and is priced so (`Estimator.as_run`:
    # 0.80 of its plan before)
    cases = [Case("llama-8b", replace(config, zero_stage=z), 2 * BATCH, overrides=shape)
             for z in (3, 1)]  # fmt: skip
    check(4, cases)


def _bucketed_sums(bucket_bytes: int) -> tuple[list[list[float]], list[int]]:
    """On each rank: tensors of two dtypes holding the rank's number, some larger than a
    chunk, averaged over the ranks by `all_reduce_flat`; and the bytes of each all-reduce."""
    import torch.distributed as dist

    rank = dist.get_rank()
    shapes = [(3, 5), (40,), (2, 2, 2), (300,), (7,)]
    tensors = [torch.full(s, float(rank + i), dtype=torch.float32) for i, s in enumerate(shapes)]
    tensors.append(torch.full((9,), float(rank), dtype=torch.bfloat16))
    tensors.append(torch.arange(12.0).reshape(3, 4).t() * (rank + 1))  # not contiguous
    sent, reduce = [], dist.all_reduce

    def counted(t: torch.Tensor, *args, **kwargs):
        sent.append(t.numel() * t.element_size())
        return reduce(t, *args, **kwargs)

    dist.all_reduce = counted
    try:
        all_reduce_flat(tensors, dist.group.WORLD, divide_by=2, bucket_bytes=bucket_bytes)
    finally:
        dist.all_reduce = reduce
    return [t.float().flatten().tolist() for t in tensors], sent


@pytest.mark.multiprocess
def test_the_gradient_sync_averages_in_chunks_on_2_ranks():
    """Chunks of 256 bytes: chunks spanning tensors, a tensor spanning chunks, a strided one
    copied in and out; every rank ends with the mean, and the all-reduces are the sizes
    `flat_chunks` gives the plan (per dtype: 382 fp32 elements, then 9 bf16)."""
    (values, sent), other = run_ranks(2, _bucketed_sums, 256)
    assert other == (values, sent)
    for i, n in enumerate((15, 40, 8, 300, 7)):
        assert values[i] == [i + 0.5] * n
    assert values[5] == [0.5] * 9
    assert values[6] == (torch.arange(12.0).reshape(3, 4).t() * 1.5).flatten().tolist()
    want = flat_chunks((15 + 40 + 8 + 300 + 7 + 12) * 4, 256) + flat_chunks(9 * 2, 256)
    assert sent == want and len(sent) == 7, sent


def test_the_gradient_sync_holds_one_bucket_beside_the_gradients():
    """96 MiB of gradients, one of them 40 MiB: the sync holds at most one 25 MiB chunk more
    (one flat copy of them all held 96 MiB more), and halves each exactly."""
    with LiveBytes() as mode:  # counts what is made inside it
        grads = [torch.full((2**21,), float(i)) for i in range(7)]  # 8 MiB each
        grads.append(torch.ones(10 * 2**20))  # 40 MiB: across two chunks
        held = mode.live
        all_reduce_flat(grads, None, divide_by=2)
    assert held == 96 * 2**20 and mode.peak - held <= DDP_BUCKET_BYTES, mode.peak / 2**20
    assert all(bool((g == i / 2).all()) for i, g in enumerate(grads[:7]))
    assert bool((grads[7] == 0.5).all())


def test_linears_reading_one_fp32_value_share_its_bf16_cast_and_compile():
    """Three linears read one fp32 value under autocast (q, k and v over a norm's output
    without FSDP): with the runtime's hook they keep one bf16 copy of it, not three, and the
    same outputs; inside a compiled module the hook steps aside and the module still runs."""
    from torch import nn

    from autopar.runtime.data_parallel import _SharedCasts

    torch.manual_seed(0)
    linears = nn.ModuleList(nn.Linear(512, 64, bias=False) for _ in range(3))
    leaf = torch.randn(1024, 512, requires_grad=True)

    def forward() -> tuple[list[torch.Tensor], int]:
        with LiveBytes() as mode, torch.autocast("cpu", dtype=torch.bfloat16):
            x = leaf * 2  # 2 MiB fp32, 1 MiB in bf16 (autocast caches a leaf's cast only)
            outs = [linear(x) for linear in linears]
            held = mode.live
        return outs, held

    plain, plain_held = forward()
    shared_casts = _SharedCasts(torch.bfloat16)  # one for the model, as the runtime's
    for linear in linears:
        linear.register_forward_pre_hook(shared_casts)
    shared, shared_held = forward()
    assert all(torch.equal(a, b) for a, b in zip(plain, shared, strict=True))
    assert plain_held - shared_held == 2 * 2**20  # two of the three 1 MiB casts
    compiled = torch.compile(lambda v: sum(linear(v) for linear in linears))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(leaf * 2), sum(shared), rtol=5e-2, atol=1e-1)
