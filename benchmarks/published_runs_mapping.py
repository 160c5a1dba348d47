"""Published training runs (data/calibration_runs.csv) -> what autopar needs to price.

In: the csv's rows (columns described in data/README.md). Out: one frozen `PublishedRun`
per row: the model's dimensions (as overrides of the zoo's GPT), the shipped hardware profile,
the parallel configuration in `autopar.ParallelConfig` terms, the cost options the source's
framework implies, and the ONE measured quantity the benchmark compares: seconds per step.
Invariant: every value not read from the row itself is listed in the run's `assumptions`, and a
row that cannot be priced carries a `skip_reason` instead of guessed degrees.

Measured step time, in this order of preference:
  (a) `step_time_s=` in the row's notes, as the source printed it;
  (b) tokens/s per device T:  step = B * s / (T * N);
  (c) TFLOP/s per device R:   step = F_source / (R * 1e12 * N), where F_source is the FLOP count
      per step under the formula the source itself used to produce R, which inverts its figure
      exactly:
        Megatron-LM 2021 (Narayanan et al.): `megatron_2021_eq3_flops` (counts the recompute fwd)
        Megatron-Core 2024 README:           `megatron_core_2024_flops`
Notation: B global batch (sequences), s sequence length, l layers, h hidden, f FFN width,
V vocabulary, N devices.

Our own FLOP count, used for every "measured MFU" printed, is `model_flops` (no recompute;
attention counted over the full s x s score matrix as torch's FLOP counter and Megatron do).

This module imports autopar but not torch, so a dry run needs no tracing.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, replace
from pathlib import Path

from published_flops import (  # noqa: F401  (the benchmarks import them from here too)
    SOURCE_FLOP_FORMULA,
    ModelDims,
    megatron_2021_eq3_flops,
    megatron_core_2024_flops,
    model_flops,
)

DEFAULT_CSV = Path(__file__).resolve().parents[1] / "data" / "calibration_runs.csv"

# Megatron-LM's GPT-2 BPE vocabulary (50257) padded to a multiple of 128 * tp: 51200, the value
# the csv gives for every other Megatron GPT row (Narayanan et al. 2021 sec 5.1 uses V = 51200).
MEGATRON_GPT2_VOCAB = 51200

# MosaicML MPT shapes: not in the csv; from mosaicml/llm-foundry
# scripts/train/yamls/pretrain/mpt-{7b,13b,70b}.yaml (d_model, n_heads, n_layers,
# expansion_ratio 4, vocab_size 50368, max_seq_len 2048). The benchmark table's NumParams equal
# our GPT's parameter count exactly (6,658,859,008 / 12,853,954,560 / 64,862,437,376) only with
# linear and LayerNorm biases (MPTConfig's no_bias defaulted to False at that commit), a learned
# position table of 2048 rows (learned_pos_emb default True) and tied embeddings, which is what
# GPT(bias=True, tie_embeddings=True) builds. `check_params` re-verifies this on every run.
MPT_VOCAB = 50368
MPT_SHAPES = {  # name: (n_layers, d_model, n_heads)
    "mpt-7b": (32, 4096, 32),
    "mpt-13b": (40, 5120, 40),
    "mpt-70b": (80, 8192, 64),
}

# Fraction of tensor-parallel communication hidden by Megatron-Core's --tp-comm-overlap
# (Transformer Engine userbuffers split each all-gather/reduce-scatter + GEMM into tp chunks and
# hide all but about one: 1 - 1/tp = 0.875 at tp 8). estimate: one general value for every
# mcore24 row, not fitted per row; the cost model's owner fits it (--tp-comm-overlap).
MCORE_TP_COMM_OVERLAP = 0.8

TAGS = ("[A]", "[B]")


@dataclass(frozen=True)
class PublishedRun:
    """One csv row, interpreted. Degrees are None where the source does not give them."""

    id: str
    tag: str  # "[A]" primary table or log, "[B]" partial or secondary
    source_key: str  # id prefix: meg20, meg21, kor22, mcore24, mosaic23
    dims: ModelDims
    published_params_b: float | None
    global_batch_seqs: int
    num_devices: int
    hardware: str
    profile: str
    precision: str  # autopar precision: "bf16" | "fp16" | "fp32"
    # parallel configuration (autopar.ParallelConfig fields)
    dp: int | None
    fsdp: int
    zero_stage: int
    tp: int | None
    pp: int | None
    micro_batch_size: int | None
    schedule: str
    virtual_stages: int
    recompute: str
    sequence_parallel: bool
    # cost options implied by the source's framework (autopar.estimate.CostOptions fields)
    tp_comm_overlap: float
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    # measured figures as published
    step_time_s: float | None
    tflops_per_device: float | None
    mfu_pct: float | None
    hfu_pct: float | None
    tokens_per_s_per_device: float | None
    notes: str
    assumptions: tuple[str, ...] = ()
    skip_reason: str | None = None
    fsdp_per_tensor: bool = False
    fsdp_list_copies: bool = False
    fsdp_prefetch: bool = True
    grad_bytes: int = 4
    measured_step_s: float | None = None
    measured_from: str = ""

    @property
    def num_microbatches(self) -> int | None:
        if self.micro_batch_size is None or self.dp is None:
            return None
        return self.global_batch_seqs // (self.micro_batch_size * self.dp * self.fsdp)

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch_seqs * self.dims.seq_len

    def parallel_config_kwargs(self) -> dict[str, object]:
        """The `autopar.ParallelConfig(**kwargs)` of this run (only when not skipped)."""
        assert self.skip_reason is None, self.skip_reason
        return {
            "dp": self.dp,
            "fsdp": self.fsdp,
            "tp": self.tp,
            "pp": self.pp,
            "cp": 1,
            "ep": 1,
            "zero_stage": self.zero_stage,
            "micro_batch_size": self.micro_batch_size,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "recompute": self.recompute,
            "sequence_parallel": self.sequence_parallel,
        }

    def cost_options_kwargs(self) -> dict[str, object]:
        """The `autopar.estimate.CostOptions(**kwargs)` of this run."""
        return {
            "tp_comm_overlap": self.tp_comm_overlap,
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "overlap_param_gather": self.overlap_param_gather,
            "fsdp_per_tensor": self.fsdp_per_tensor,
            "fsdp_list_copies": self.fsdp_list_copies,
            "fsdp_prefetch": self.fsdp_prefetch,
            "grad_bytes": self.grad_bytes,
        }

    def config_text(self) -> str:
        """Short config: degrees, micro-batch x count, schedule, recompute, ZeRO."""
        if self.skip_reason is not None and self.tp is None:
            return "degrees not given"
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        parts.append(f"fsdp{self.fsdp}/z{self.zero_stage}" if self.fsdp > 1 else f"dp{self.dp}")
        parts.append(f"mb{self.micro_batch_size}x{self.num_microbatches}")
        if self.pp and self.pp > 1:
            sched = {"1f1b": "1f1b", "interleaved_1f1b": "i1f1b", "gpipe": "gpipe"}
            parts.append(sched.get(self.schedule, self.schedule))
            if self.virtual_stages > 1:
                parts[-1] += f"v{self.virtual_stages}"
        rc = {"none": "", "selective": "sel", "full": "full"}[self.recompute]
        if rc:
            parts.append(rc)
        if self.sequence_parallel:
            parts.append("sp")
        return " ".join(parts)


# ---------------------------------------------------------------------------------------------
# Row parsing: one helper per column family.


def read_runs(path: Path = DEFAULT_CSV) -> list[PublishedRun]:
    """All rows of the csv, interpreted, in file order."""
    with open(path, newline="") as fh:
        return [parse_row(row) for row in csv.DictReader(fh)]


def parse_row(row: dict[str, str]) -> PublishedRun:
    notes = row["notes"].strip()
    tag = notes[:3]
    if tag not in TAGS:
        raise ValueError(f"{row['id']}: notes must begin with [A] or [B], got {notes[:12]!r}")
    source_key = row["id"].split("_", 1)[0]
    assumptions: list[str] = []
    dims = _dims(row, source_key, assumptions)
    profile = _profile(row, assumptions)
    run = PublishedRun(
        id=row["id"],
        tag=tag,
        source_key=source_key,
        dims=dims,
        published_params_b=_float(row["params_b"]),
        global_batch_seqs=_global_batch(row),
        num_devices=int(row["num_devices"]),
        hardware=row["hardware"],
        profile=profile,
        precision=_precision(row, assumptions),
        dp=None,
        fsdp=1,
        zero_stage=0,
        tp=_int(row["tp"]),
        pp=_int(row["pp"]),
        micro_batch_size=_int(row["micro_batch"]),
        schedule="1f1b",
        virtual_stages=1,
        recompute="none",
        sequence_parallel=False,
        tp_comm_overlap=0.0,
        overlap_grad_reduce=True,
        overlap_param_gather=False,
        step_time_s=_step_time_from_notes(notes),
        tflops_per_device=_float(row["measured_tflops_per_device"]),
        mfu_pct=_float(row["measured_mfu_pct"]),
        hfu_pct=_float(row["measured_hfu_pct"]),
        tokens_per_s_per_device=_float(row["tokens_per_sec_per_device"]),
        notes=notes,
    )
    run = _with_degrees(run, row, assumptions)
    run = _with_measured_step(run, assumptions)
    return replace(run, assumptions=tuple(assumptions))


def _dims(row: dict[str, str], source_key: str, assumptions: list[str]) -> ModelDims:
    seq_len = int(row["seq_len"])
    if source_key == "mosaic23":
        name, (layers, hidden, heads) = _mpt_shape(row, seq_len)
        assumptions.append(
            f"shape of {name} from llm-foundry yamls/pretrain/{name}.yaml (not in the csv)"
        )
        return ModelDims(layers, hidden, 4 * hidden, heads, heads, MPT_VOCAB, seq_len)
    hidden = int(row["hidden"])
    heads = int(row["heads"])
    vocab = _int(row["vocab"])
    if vocab is None:
        vocab = MEGATRON_GPT2_VOCAB
        assumptions.append(f"vocab not given: Megatron's padded GPT-2 BPE vocab {vocab}")
    # Megatron-Core's 2024 table: the published sizes (1.7B for l=24, h=2048, V=131072, ...)
    # count the output layer apart from the input embedding: untied.
    tie = source_key != "mcore24"
    if not tie:
        assumptions.append("untied embeddings (the table's param counts include both)")
    # Megatron's GPT recipes train with hidden and attention dropout 0.1 (GPT-3 paper,
    # Megatron-LM examples; Megatron-Core's TransformerConfig defaults).
    unfused = source_key in ("meg20", "meg21", "kor22")
    assumptions.append(
        "dropout 0.1; "
        + (
            "unfused attention as pre-FlashAttention Megatron ran it (scale in the score GEMM, "
            "mask and softmax one kernel)"
            if unfused
            else "fused attention"
        )
    )
    return ModelDims(
        num_layers=int(row["layers"]),
        hidden=hidden,
        ffn_hidden=_int(row["ffn_hidden"]) or 4 * hidden,
        num_heads=heads,
        num_kv_heads=_int(row["kv_heads"]) or heads,
        vocab_size=vocab,
        seq_len=seq_len,
        tie_embeddings=tie,
        attention="megatron" if unfused else "flash",
        dropout=0.1,
    )


def _mpt_shape(row: dict[str, str], seq_len: int) -> tuple[str, tuple[int, int, int]]:
    """The llm-foundry shape whose parameter count equals the row's params_b exactly."""
    published = round(float(row["params_b"]) * 1e9)
    for name, (layers, hidden, heads) in MPT_SHAPES.items():
        dims = ModelDims(layers, hidden, 4 * hidden, heads, heads, MPT_VOCAB, seq_len)
        if dims.num_params() == published:
            return name, (layers, hidden, heads)
    raise ValueError(f"{row['id']}: no llm-foundry MPT shape has {published:,} parameters")


def _profile(row: dict[str, str], assumptions: list[str]) -> str:
    hw = row["hardware"]
    if "V100" in hw:
        if "DGX-2" in hw:
            assumptions.append(
                "DGX-2 (16 V100, NVSwitch, 150 GB/s/GPU all-to-all) priced on dgx_v100, a DGX-1 "
                "(8 V100, hybrid cube-mesh NVLink)"
            )
        return "dgx_v100"
    if "H100" in hw:
        if "variant not stated" in hw:
            assumptions.append("H100 variant not stated: SXM 80GB (dgx_h100)")
        return "dgx_h100"
    if "A100" in hw:
        if "RoCE" in hw:
            assumptions.append(
                "1600 Gb/s RoCE per 8-GPU node = 200 Gb/s per GPU, as the profile's HDR IB"
            )
        if "40GB" in hw:
            return "dgx_a100_40g"
        if "80GB" in hw:
            return "dgx_a100_80g"
        if row["year"] == "2020":
            assumptions.append("A100 memory not stated: 40GB (the 80GB part shipped Nov 2020)")
            return "dgx_a100_40g"
        assumptions.append("A100 memory not stated: Selene's 80GB (as its 2021 paper runs)")
        return "dgx_a100_80g"
    raise ValueError(f"{row['id']}: no shipped profile for hardware {hw!r}")


def _precision(row: dict[str, str], assumptions: list[str]) -> str:
    text = row["precision"].lower()
    if "bf16" in text:
        return "bf16"
    if "fp16" in text or "16-bit" in text:
        return "fp16"
    if not text:
        assumptions.append("precision not stated: bf16 (TFLOP/s / MFU = 990, the BF16 peak)")
        return "bf16"
    raise ValueError(f"{row['id']}: unknown precision {row['precision']!r}")


def _with_degrees(run: PublishedRun, row: dict[str, str], notes: list[str]) -> PublishedRun:
    """Degrees, ZeRO, schedule, recompute, micro-batch and overlaps; or a skip reason."""
    if run.tp is None or run.pp is None:
        return replace(run, skip_reason="parallel degrees not given: " + _degree_gap(row))
    dp = _int(row["dp"])
    if dp is None:
        dp = run.num_devices // (run.tp * run.pp)
        notes.append(f"dp derived as N/(tp*pp) = {dp}")
    if dp * run.tp * run.pp != run.num_devices:
        reason = f"tp {run.tp} x pp {run.pp} x dp {dp} != {run.num_devices} devices"
        return replace(run, skip_reason=reason)
    zero_text, key = row["zero_stage_or_fsdp"], run.source_key
    fsdp, zero_stage = 1, 0
    if "ZeRO-3" in zero_text or "FULL_SHARD" in zero_text:
        dp, fsdp, zero_stage = 1, dp, 3
    elif key == "mcore24":
        # --overlap-param-gather exists only with --use-distributed-optimizer: optimizer state
        # (and the reduce-scattered gradients) sharded over the data-parallel ranks.
        dp, fsdp, zero_stage = 1, dp, 1
        notes.append("distributed optimizer (implied by --overlap-param-gather): fsdp=dp, ZeRO-1")
    run = replace(run, dp=dp, fsdp=fsdp, zero_stage=zero_stage)
    run = _with_micro_batch(run, notes)
    run = _with_schedule(run, row["vpp_or_schedule"], notes)
    run = _with_recompute(run, row["recompute"], notes)
    return _with_overlaps(run, zero_text, notes)


def _degree_gap(row: dict[str, str]) -> str:
    if "TP*PP" in row["notes"] or "(TP*PP)" in row["notes"]:
        return "only the model-parallel size TP*PP is known"
    return "TP/PP not stated"


def _with_micro_batch(run: PublishedRun, notes: list[str]) -> PublishedRun:
    dp_total = run.dp * run.fsdp
    mbs = run.micro_batch_size
    if mbs is None and run.source_key == "meg20":
        # Megatron-LM before pipelining (Sep 2020) had no gradient accumulation: --batch-size
        # was the per-replica batch, so micro-batch = global / dp.
        mbs = run.global_batch_seqs // dp_total
        notes.append(f"micro-batch not stated: {mbs} = global/dp (no grad accumulation in 2020)")
    elif mbs is None:
        mbs = 1
        notes.append("micro-batch not stated: 1")
    if run.global_batch_seqs % (mbs * dp_total):
        reason = f"global batch {run.global_batch_seqs} not divisible by mbs {mbs} x dp {dp_total}"
        return replace(run, micro_batch_size=mbs, skip_reason=reason)
    return replace(run, micro_batch_size=mbs)


def _with_schedule(run: PublishedRun, text: str, notes: list[str]) -> PublishedRun:
    if run.pp == 1:
        return replace(run, schedule="1f1b", virtual_stages=1)
    m = re.search(r"--num-layers-per-virtual-pipeline-stage (\d+)", text)
    if m:
        per_chunk = int(m.group(1))
        v = run.dims.num_layers // (run.pp * per_chunk)
        notes.append(f"virtual stages = layers/(pp*{per_chunk}) = {v}")
        return replace(run, schedule="interleaved_1f1b", virtual_stages=v)
    m = re.search(r"m=(\d+)", text)
    if m and "interleav" in text:
        return replace(run, schedule="interleaved_1f1b", virtual_stages=int(m.group(1)))
    if "not stated" in text or not text:
        notes.append("pipeline schedule not stated: 1F1B, no virtual stages")
    elif "script sets no virtual-stage flag" in text:
        notes.append("1F1B as the run script sets (the paper text says interleaved)")
    return replace(run, schedule="1f1b", virtual_stages=1)


def _with_recompute(run: PublishedRun, text: str, notes: list[str]) -> PublishedRun:
    low = text.lower()
    sp = "sequence parallel" in low and "no sequence parallel" not in low
    if "selective" in low:
        recompute = "selective"
    elif "full" in low:
        recompute = "full"
    elif low.startswith("none"):
        recompute = "none"
    elif run.source_key == "meg21":
        # Table 2 (ZeRO-3, mbs 4): without recompute a 175B layer stack keeps 34 s b h bytes per
        # layer = 330 GB at mbs 4; and the row's FLOP formula counts the recompute forward.
        recompute = "full"
        notes.append("recompute not stated: full (no-recompute activations need ~330 GB)")
    elif run.source_key == "meg20":
        # The 8.3B examples pass --checkpoint-activations; without it model state (~17 GB) plus
        # activations (~25 GB at mbs 8, tp 8) exceed a 32 GB V100.
        recompute = "full"
        notes.append("recompute not stated: full (Megatron 2020 scripts, memory)")
    elif run.source_key == "mcore24":
        sp = run.tp > 1  # --tp-comm-overlap requires --sequence-parallel
        recompute = "none"
        notes.append("recompute not stated: none (Megatron default; flash attention)")
        if sp:
            notes.append("sequence parallel (required by --tp-comm-overlap)")
    else:
        raise ValueError(f"{run.id}: cannot read recompute {text!r}")
    return replace(run, recompute=recompute, sequence_parallel=sp and run.tp > 1)


def _with_overlaps(run: PublishedRun, zero_text: str, notes: list[str]) -> PublishedRun:
    """Which communication the source's framework overlaps (properties of the framework)."""
    if run.source_key in ("meg20", "meg21", "kor22") and run.precision == "fp16":
        # Megatron's fp16 training (apex-style loss scaling) all-reduces the fp16 .grad
        # buffers; fp32 main-grad accumulation came with the later distributed optimizer
        notes.append("gradients reduced in fp16 (Megatron fp16 training before 2022)")
        run = replace(run, grad_bytes=2)
    if run.source_key == "mcore24":
        return replace(
            run,
            tp_comm_overlap=MCORE_TP_COMM_OVERLAP,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        )
    if run.fsdp > 1 and "DeepSpeed" in zero_text:
        # DeepSpeed's 2021 ZeRO-3 gathers and reduces parameter by parameter (each call pays
        # the group's latency) rather than one flat buffer per layer as FSDP units do
        notes.append("ZeRO-3 collectives per parameter tensor (DeepSpeed 2021)")
        # each on a list of world-size views (DeepSpeed 0.3 partition_parameters.py:
        # _allgather_param calls torch.distributed.all_gather(partitions, ...) and
        # _reduce_scatter_gradient reduce_scatter(out, input_list)), so torch copies every
        # rank's piece with its own kernel: n copies per call, which grow with the group
        notes.append("ZeRO-3 collectives on lists of per-rank views: n copies per call")
        # and overlapped little: Narayanan et al. 2021 sec 5.3.2 attribute its drop from 384 to
        # 1536 GPUs to the exposed cross-node parameter traffic
        return replace(
            run,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            fsdp_per_tensor=True,
            fsdp_list_copies=True,
            fsdp_prefetch=False,
        )
    if run.fsdp > 1:  # Composer FSDP prefetches parameters per unit
        return replace(run, overlap_grad_reduce=True, overlap_param_gather=True)
    if "DDP-impl local" in zero_text or "no grad all-reduce overlap" in zero_text:
        return replace(run, overlap_grad_reduce=False)
    if run.source_key == "meg20" and run.dp > 1:
        notes.append("gradient all-reduce not overlapped (Megatron 2020 default --DDP-impl local)")
        return replace(run, overlap_grad_reduce=False)
    return run


def _with_measured_step(run: PublishedRun, notes: list[str]) -> PublishedRun:
    if run.step_time_s is not None:
        return replace(run, measured_step_s=run.step_time_s, measured_from="step_time_s")
    n = run.num_devices
    if run.tokens_per_s_per_device is not None:
        step = run.global_batch_tokens / (run.tokens_per_s_per_device * n)
        return replace(run, measured_step_s=step, measured_from="tokens/s")
    formula = SOURCE_FLOP_FORMULA.get(run.source_key)
    if run.tflops_per_device is not None and formula is not None:
        flops = formula(run.dims, run.global_batch_seqs)
        step = flops / (run.tflops_per_device * 1e12 * n)
        return replace(run, measured_step_s=step, measured_from=f"TFLOP/s {formula.__name__}")
    if run.skip_reason is None:
        return replace(run, skip_reason="no step time, tokens/s or invertible TFLOP/s")
    return run


def measured_mfu(run: PublishedRun, peak_flops_per_s: float) -> float | None:
    """MFU of the measured step under `model_flops` (our one formula)."""
    if run.measured_step_s is None:
        return None
    flops = model_flops(run.dims, run.global_batch_seqs)
    return flops / (run.measured_step_s * run.num_devices * peak_flops_per_s)


def source_tflops_from_step(run: PublishedRun) -> float | None:
    """The source's own TFLOP/s implied by the step time (cross-check of the inversion)."""
    formula = SOURCE_FLOP_FORMULA.get(run.source_key)
    if formula is None or run.measured_step_s is None:
        return None
    flops = formula(run.dims, run.global_batch_seqs)
    return flops / (run.measured_step_s * run.num_devices) / 1e12


def _step_time_from_notes(notes: str) -> float | None:
    m = re.search(r"step_time_s=(\d+(?:\.\d+)?)", notes)
    return float(m.group(1)) if m else None


def _global_batch(row: dict[str, str]) -> int:
    m = re.match(r"\s*(\d+)\s*seqs", row["global_batch_tokens_or_seqs"])
    if not m:
        raise ValueError(
            f"{row['id']}: cannot read global batch {row['global_batch_tokens_or_seqs']!r}"
        )
    return int(m.group(1))


def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text else None


def _float(text: str) -> float | None:
    text = text.strip()
    return float(text) if text else None
