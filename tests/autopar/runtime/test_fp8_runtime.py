"""FP8 and MXFP8 linears in the runtime (autopar.runtime.low_precision) and in the generated
program.

- The conversion swaps exactly the blocks' aligned nn.Linear layers for torchao's Float8Linear
  (the embedding and the head stay), gathers FP8 weights under ZeRO-3 with tensorwise scales
  only, and refuses what the runtime cannot run (NVFP4) by name.
  MXFP8 pads a linear's rows to whole blocks of 32 with zeros, which changes nothing else.
  MXFP8 wraps the weights of the blocks' bias-free linears whose dimensions are multiples of 32.
- Numerics: FSDP2 ZeRO-3, a 2-stage pipeline and TP2 (with and without SP) on 2 gloo ranks, 3
  steps of llama-tiny in bf16 and in the torchao recipes (FP8 GEMMs emulated on the CPU):
  losses within 1% and gradient norms within 5% of the BF16 run's (measured 2026-11-24: at
  most 1e-4 and 3.4e-3 relative; TP2 with SP 1.4e-4 and 1.9e-3). MXFP8 (torchao's emulated
  recipe) under FSDP2 ZeRO-3 and the pipeline, 64-token sequences (measured 2026-11-26: losses
  within 6.4e-5, norms within 7.6e-4 of BF16), and under TP2 with SP, EP2 and ETP2 with SP
  as unsplit (its linears' GEMMs on their shards, `run_mxfp8_locally`; an expert's rows
  padded to blocks; its slices wrapped again, `wrapped_like`).
- A plan priced in FP8 for an H100 (MXFP8 for a B200) writes a train.py whose default
  precision is the recipe; run on 2 CPU ranks it converts the linears and trains.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from harness import run_ranks  # noqa: E402

import autopar  # noqa: E402
from autopar.config.precision import RECIPES  # noqa: E402
from autopar.models import zoo  # noqa: E402
from autopar.runtime.low_precision import apply_low_precision, covered_linears  # noqa: E402
from autopar.runtime.task import task_from_source  # noqa: E402
from autopar.runtime.tensor_parallel import find_blocks  # noqa: E402
from autopar.runtime.trainer import TrainOptions, train  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
ZERO3 = autopar.ParallelConfig(fsdp=2, zero_stage=3, micro_batch_size=2)
CPU = torch.device("cpu")


def _model() -> nn.Module:
    return zoo.build("llama-tiny", seed=0)


def test_the_blocks_linears_are_converted_and_nothing_else():
    from torchao.float8.float8_linear import Float8Linear

    model = _model()
    blocks = find_blocks(model)
    record = apply_low_precision(model, blocks, "fp8", ZERO3, CPU)
    assert record is not None and record.recipe == "fp8-tensorwise" and record.emulated
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(record.modules) and len(converted) == 7 * len(blocks)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert linears - converted == {"lm_head"}  # the head stays BF16, as priced
    assert record.fsdp_float8_all_gather  # ZeRO-3 with per-tensor scales


@pytest.mark.parametrize(
    ("precision", "config", "gather"),
    [
        ("fp8-tensorwise", autopar.ParallelConfig(fsdp=2, zero_stage=1), False),  # not ZeRO-3
        ("fp8-rowwise", ZERO3, False),  # rowwise scales: torchao gathers BF16
        ("fp8-tensorwise", autopar.ParallelConfig(dp=2), False),
    ],
)
def test_fp8_gathers_only_under_zero3_with_tensorwise_scales(precision, config, gather):
    model = _model()
    record = apply_low_precision(model, find_blocks(model), precision, config, CPU)
    assert record.fsdp_float8_all_gather is gather


def test_fp8_pads_the_inner_dimension_only_where_experts_are_dispatched():
    """An expert under ep > 1 gets any number of tokens, the inner dimension of its weight
    gradient's GEMM, which torch._scaled_mm takes in multiples of 16 on a GPU."""
    from torchao.float8.float8_linear import Float8Linear

    for ep, pad in ((1, False), (2, True)):
        model = zoo.build("moe-tiny", seed=0)
        config = autopar.ParallelConfig(dp=2, ep=ep)
        apply_low_precision(model, find_blocks(model), "fp8", config, CPU)
        pads = {m.config.pad_inner_dim for m in model.modules() if isinstance(m, Float8Linear)}
        assert pads == {pad}


def test_plain_dtypes_convert_nothing_and_the_unrunnable_are_refused():
    model = _model()
    assert apply_low_precision(model, find_blocks(model), "bf16", ZERO3, CPU) is None
    with pytest.raises(RuntimeError, match="'nvfp4' is priced but not run.*mxfp8.*autopar export"):
        apply_low_precision(model, find_blocks(model), "nvfp4", ZERO3, CPU)
    tp = autopar.ParallelConfig(tp=2)  # converted before the plain DTensor TP styles apply
    assert apply_low_precision(model, find_blocks(model), "fp8", tp, CPU).recipe == "fp8-tensorwise"


def test_mxfp8_wraps_the_bias_free_linears_whose_blocks_of_32_divide():
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

    model = zoo.build("llama-tiny", seed=0, ffn_hidden=192)  # 176 is no multiple of 32
    model.layers[0].self_attn.q_proj.bias = nn.Parameter(torch.zeros(64))  # torchao drops it
    record = apply_low_precision(model, find_blocks(model), "mxfp8", ZERO3, CPU)
    wrapped = {
        n.removesuffix(".weight")
        for n, p in model.named_parameters()
        if isinstance(p.data, MXFP8TrainingWeightWrapperTensor)
    }
    assert wrapped == set(record.modules) and len(wrapped) == 7 * 2 - 1
    assert "layers.0.self_attn.q_proj" not in wrapped and "lm_head" not in wrapped
    assert record.describe() == "mxfp8: 13 linears in MXFP8 (emulated on the CPU)"
    small = _model()  # llama-tiny's 176-wide MLP: only the attention's projections
    assert len(covered_linears(find_blocks(small), RECIPES["mxfp8"])) == 4 * 2


def test_a_plan_says_which_linears_the_runtime_keeps_in_bf16():
    """The estimate prices every linear of the covered blocks in the recipe; where the runtime
    converts fewer, the plan's note says how many it keeps in BF16."""
    from autopar.models import hf
    from autopar.runtime.capability import recipe_coverage

    meta = zoo.build("llama-tiny", device="meta")
    assert "keeps 6 of the blocks' 14 linear layers in BF16" in recipe_coverage(meta, "mxfp8")
    assert recipe_coverage(meta, "fp8") == ""  # 176 divides by 16
    wide = zoo.build("llama-8b", device="meta", num_layers=2)
    assert recipe_coverage(wide, "mxfp8") == recipe_coverage(wide, "bf16") == ""
    gpt2 = hf.build("gpt2-tiny-hf")  # Conv1D projections: torchao converts none
    assert "keeps 8 of the blocks' 8 linear layers" in recipe_coverage(gpt2, "fp8")


def test_mxfp8_is_split_over_tp_only_where_its_shards_run():
    """MXFP8 under tp needs plain column/row splits whose shards keep whole blocks of 32:
    Phi-3's fused qkv_proj (strided pieces) rules tp out; Qwen2's narrowest split MXFP8
    linear (its biased q/k/v stay BF16) is 32 wide."""
    import model_factories

    from autopar.runtime.capability import mxfp8_tp_width, traced_roles

    def width(model: nn.Module) -> tuple[int, str]:
        graph = autopar.trace(model, (torch.zeros(1, 16, dtype=torch.long),))
        return mxfp8_tp_width(model, traced_roles(model, graph)[0])

    assert width(model_factories.qwen2()) == (32, "")
    wide, why = width(model_factories.phi3())
    assert wide == 0 and "qkv_proj would take the 'colwise/3' style" in why


@pytest.mark.parametrize("precision", ["fp8-tensorwise", "mxfp8"])
def test_expert_slices_keep_torchaos_weight_wrappers(precision):
    """Expert tensor parallelism slices each expert's weight by hand (`_slice`: its chunks
    concatenated), which returned plain tensors: MXFP8's slices ran BF16 GEMMs, FP8's were
    gathered by FSDP in BF16 where the plan prices FP8. The slice keeps the wrapper, its
    settings and the rank's rows; a plain weight stays plain."""
    from autopar.runtime.expert_tensor_parallel import _slice

    model = nn.Sequential(nn.Linear(64, 128, bias=False))
    apply_low_precision(model, [("0", model[0])], precision, ZERO3, CPU)
    weight = model[0].weight
    sliced = _slice(weight, 0, 1, 1, 2)
    (inner,), settings = weight.__tensor_flatten__()
    assert type(sliced) is type(weight) and sliced.__tensor_flatten__()[1] == settings
    assert torch.equal(getattr(sliced, inner), getattr(weight, inner)[64:])
    assert sliced.requires_grad
    assert type(_slice(nn.Linear(4, 4).weight, 0, 1, 0, 2)) is nn.Parameter


def test_mxfp8_pads_any_number_of_rows_to_its_blocks_and_changes_nothing_else():
    """A dispatched expert's rows come in any number; torchao takes blocks of 32 along them in
    the weight gradient's GEMM. 33 rows run as the same rows with 31 zero rows below them:
    the same outputs, input gradients and weight gradient."""
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(64, 128, bias=False))
    linear = nn.Sequential(nn.Linear(64, 128, bias=False))
    linear.load_state_dict(whole.state_dict())
    for m in (whole, linear):
        apply_low_precision(m, [("0", m[0])], "mxfp8", autopar.ParallelConfig(), CPU)
    x = torch.randn(1, 33, 64)
    rows = x.clone().requires_grad_()
    out = linear(rows)
    padded = torch.cat([x[0], torch.zeros(31, 64)]).requires_grad_()
    ref = whole(padded)  # 64 rows: whole blocks, nothing padded
    (out.pow(2).sum()).backward()
    ref[:33].pow(2).sum().backward()
    assert out.shape == (1, 33, 128)
    torch.testing.assert_close(out[0], ref[:33], rtol=0, atol=0)
    torch.testing.assert_close(rows.grad[0], padded.grad[:33], rtol=0, atol=0)
    torch.testing.assert_close(linear[0].weight.grad, whole[0].weight.grad, rtol=0, atol=0)


def test_nvfp4_would_keep_its_edge_blocks():
    blocks = find_blocks(zoo.build("llama-tiny", seed=0, num_layers=4))
    paths = covered_linears(blocks, RECIPES["nvfp4"])
    assert len(paths) == 2 * 7  # the two inner blocks' seven linears
    first, last = blocks[0][0], blocks[-1][0]
    assert not any(p.startswith((f"{first}.", f"{last}.")) for p in paths)


PIPELINE = autopar.ParallelConfig(pp=2, micro_batch_size=1)
TP_SP = autopar.ParallelConfig(tp=2, sequence_parallel=True)


def _train_precisions(runs: tuple[tuple, ...]) -> dict:
    """(label, config, precision, seq_len[, llama-tiny's overrides]) -> each step's (loss,
    gradient norm)."""
    torch.set_num_threads(1)
    out = {}
    for label, config, precision, seq_len, *overrides in runs:
        kwargs = {"name": "llama-tiny", "seed": 0, "seq_len": seq_len, **dict(*overrides)}
        task = task_from_source(
            "autopar.models.zoo:build", kwargs, global_batch_size=4, seq_len=seq_len
        )
        options = TrainOptions(steps=3, precision=precision, log=False)
        out[label] = [(r.loss, r.grad_norm) for r in train(task, config, 4, options=options)]
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fp8_under_fsdp2_pp_and_tp_trains_within_a_stated_bound_of_bf16():
    runs = [(f"fsdp {p}", ZERO3, p, 32) for p in ("bf16", "fp8-tensorwise", "fp8-rowwise")]
    runs += [(f"pp {p}", PIPELINE, p, 32) for p in ("bf16", "fp8-tensorwise")]
    runs += [(f"tp {p}", TP_SP, p, 32) for p in ("bf16", "fp8-tensorwise", "fp8-rowwise")]
    # MXFP8 takes each rank's tokens in blocks of 32: 64-token sequences
    for style, config in (("fsdp", ZERO3), ("pp", PIPELINE)):
        runs += [(f"{style}64 {p}", config, p, 64) for p in ("bf16", "mxfp8")]
    ranks = run_ranks(2, _train_precisions, tuple(runs))
    assert ranks[0] == ranks[1]  # every rank reports the same global loss and norm
    got = ranks[0]
    for label, low in got.items():
        style, precision = label.split()
        if precision == "bf16":
            continue
        bf16 = got[f"{style} bf16"]
        assert low != bf16  # the GEMMs did run in FP8 / MXFP8
        for (loss, norm), (ref_loss, ref_norm) in zip(low, bf16, strict=True):
            assert math.isfinite(loss) and abs(loss / ref_loss - 1) < 0.01
            assert abs(norm / ref_norm - 1) < 0.05


# every linear's width a multiple of 2 x 32: each TP2 shard takes MXFP8's blocks of 32
WIDE = {"hidden": 128, "ffn_hidden": 256}


# split -> (the split config, the same model's unsplit one, llama-tiny's overrides, bounds on
# every step's loss and gradient norm against the unsplit MXFP8 run)
MXFP8_SPLITS = {
    # TP2 with SP: each split linear's GEMMs on the rank's shards (`run_mxfp8_locally`)
    "tp": (TP_SP, autopar.ParallelConfig(dp=2, micro_batch_size=2), WIDE, 1e-3, 1e-2),
    # EP2: each expert's dispatched rows, any number, padded to blocks of 32 (`mx_padded`);
    # unsplit, every expert runs on every token (the unrouted ones weighted 0)
    "ep": (
        autopar.ParallelConfig(dp=2, ep=2), autopar.ParallelConfig(dp=2), {"name": "moe-tiny"},
        1e-4, 1e-3,
    ),
    # ETP2 with SP: each expert's width in two slices of 64, each rank's slices wrapped for
    # MXFP8 again (`wrapped_like`); the dense layers' linears on their TP shards
    "etp": (
        autopar.ParallelConfig(tp=2, etp=2, sequence_parallel=True),
        autopar.ParallelConfig(dp=2, micro_batch_size=2), {"name": "moe-tiny", **WIDE},
        1e-3, 1e-2,
    ),
    # all of them on 4 ranks: DP2 x TP2 with SP, EP2 folded over dp, ETP2
    "ep-etp": (
        autopar.ParallelConfig(dp=2, tp=2, ep=2, etp=2, sequence_parallel=True),
        autopar.ParallelConfig(dp=4, micro_batch_size=1), {"name": "moe-tiny", **WIDE},
        1e-3, 1e-2,
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("split", list(MXFP8_SPLITS))
def test_mxfp8_split_over_tp_ep_or_etp_trains_as_unsplit(split):
    """TP2 (with SP), EP2, ETP2 (with SP) and all three on 4 ranks in MXFP8: every converted
    linear's GEMM runs torchao's MXFP8 matmul on every rank, and the losses and gradient
    norms stay within the stated bounds of the same model in MXFP8 unsplit (data parallel).
    Through the DTensor styles alone torchao's weight ran BF16 GEMMs; a dispatched expert's
    rows were refused; ETP's slices of a wrapped weight lost the wrapper and ran BF16
    GEMMs. Measured 2026-11-26, the three steps' losses: TP within 6.3e-5 of the unsplit
    MXFP8 run's, EP 9e-6, ETP 9e-5, the three on 4 ranks 1.6e-4 (the split's partial sums
    are rounded to BF16, as in BF16, where the same splits measured 6.1e-5, 5.4e-6, 4e-5
    and 4e-5)."""
    config, unsplit, overrides, loss_bound, norm_bound = MXFP8_SPLITS[split]
    runs = (
        ("split mxfp8", config, "mxfp8", 64, overrides),
        ("unsplit mxfp8", unsplit, "mxfp8", 64, overrides),
        ("split bf16", config, "bf16", 64, overrides),
    )
    for got, (linears, mx_gemms) in run_ranks(config.world_size, _train_counting_mxfp8, runs):
        assert mx_gemms == linears > 0, (linears, mx_gemms)
        low, same, bf16 = (got[k] for k in ("split mxfp8", "unsplit mxfp8", "split bf16"))
        assert low != bf16
        for (loss, norm), (ref_loss, ref_norm) in zip(low, same, strict=True):
            assert abs(loss / ref_loss - 1) < loss_bound and abs(norm / ref_norm - 1) < norm_bound


def _train_counting_mxfp8(runs: tuple[tuple, ...]) -> tuple[dict, tuple[int, int]]:
    """`_train_precisions` of ``runs``, and over the first run (the split in MXFP8): how many
    forwards its converted linears ran (`low_precision._mx_linear`, which each calls) and how
    many of them torchao's MXFP8 matmul ran."""
    from torchao.prototype.moe_training import mxfp8_linear

    from autopar.runtime import low_precision

    counts = [0, 0]
    linear, matmul = low_precision._mx_linear, mxfp8_linear.mx_mm.forward

    def counted_linear(*args):
        counts[0] += 1
        return linear(*args)

    def counted_matmul(*args):
        counts[1] += 1
        return matmul(*args)

    low_precision._mx_linear = counted_linear
    mxfp8_linear.mx_mm.forward = staticmethod(counted_matmul)
    try:
        first = _train_precisions(runs[:1])
    finally:
        low_precision._mx_linear, mxfp8_linear.mx_mm.forward = linear, staticmethod(matmul)
    return {**first, **_train_precisions(runs[1:])}, tuple(counts)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("precision", "profile", "said"),
    [
        ("fp8", "dgx_h100", "fp8-tensorwise: 14 linears in FP8, FSDP gathers FP8 weights"),
        ("mxfp8", "dgx_b200", "mxfp8: 8 linears in MXFP8 (emulated on the CPU)"),
    ],
)
def test_a_generated_low_precision_program_converts_and_trains(tmp_path, precision, profile, said):
    model = zoo.build("llama-tiny", device="meta")
    cluster = autopar.Cluster.from_profile(profile, num_devices=2)
    plan = autopar.evaluate(
        model, cluster, ZERO3, zoo.example_inputs("llama-tiny", model), global_batch_size=4,
        precision=precision, model_factory=("autopar.models.zoo:build", {"name": "llama-tiny"}),
    )  # fmt: skip
    recipe = said.split(":")[0]
    assert plan.precision == recipe
    plan.save(tmp_path)
    text = (tmp_path / "train.py").read_text()
    assert f"default={recipe!r}" in text
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    done = subprocess.run(
        [*cmd, str(tmp_path / "train.py"), "--steps", "2", "--device", "cpu"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert said in done.stdout
    assert "step 2/2" in done.stdout
