"""Published grids (data/published_grids.csv) -> what autopar needs to price each row.

In: the csv's rows (columns in data/README.md). Out: one frozen `GridRun` per row: the model's
shape (`ModelDims`, a zoo GPT or Llama, or the DeepSeek-V3 Hugging Face preset), the shipped
hardware profile, the ParallelConfig, the global batch and sequence length, the software stack
that ran it, and what was measured: seconds per step, and peak memory per device where the
source gives it. A row autopar cannot
express carries a `skip` reason instead of guessed degrees; every value not read from the row
is listed in `assumptions`.

Measured step time, by what the row measured (N devices, B global batch in sequences, s the
sequence length):
    tokens/s per device T              step = B s / (T N)
    TFLOP/s per device R (Megatron)    step = F / (R 1e12 N), F = `megatron_core_2024_flops`
    samples/s S (DeepSpeed autotuner)  step = B / S (the autotuner's fwd + bwd + step timers)
Peak memory: torchtitan's `mem=` (GiB, the CUDA caching allocator's peak reserved bytes).

This module imports autopar but not torch, so listing the rows needs no tracing.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from published_flops import ModelDims, megatron_core_2024_flops

import autopar

DEFAULT_CSV = Path(__file__).resolve().parents[1] / "data" / "published_grids.csv"
GiB = 2**30

# torchtitan's Llama 3 training length (torchtitan/models/llama3/train_configs: seq_len 8192),
# what its benchmark tables ran where the row does not state it.
TORCHTITAN_SEQ = 8192
# DeepSpeedExamples' HF autotuning scripts: run_clm with block size 1024 for GPT-2 (their
# README's command), the GPT-2 context.
DSAT_GPT2_SEQ = 1024
# DeepSpeedExamples training/autotuning/hf/bert-large: transformers' run_glue.py (its
# max_seq_length default, 128) on bert-large-uncased (vocab 30522), in fp32 ("The training use
# fp32", the README; no --fp16, no fp16 section in its DeepSpeed config)
DSAT_BERT_SEQ = 128
BERT_VOCAB = 30522
# The shapes of the MPT models llm-foundry benchmarks (mosaicml/llm-foundry scripts/train/yamls
# /pretrain/mpt-*.yaml: d_model, n_layers, n_heads; expansion_ratio 4, vocab 50368, no biases,
# ALiBi instead of position embeddings).
MPT_VOCAB = 50368
MPT_SHAPES = {
    "mpt-1b": (24, 2048, 16),
    "mpt-3b": (32, 2560, 32),
    "mpt-7b": (32, 4096, 32),
    "mpt-13b": (40, 5120, 40),
    "mpt-30b": (48, 7168, 64),
}
GPT2_VOCAB = 50257
# A GB200 or GB300 NVL72 rack holds 72 GPUs; a job of more GPUs that is not a multiple of 72 (the
# Megatron-Bridge DeepSeek-V3 rows' 256) uses 64 per rack: 16 of its 18 compute trays, the
# power-of-two slice SLURM segments hand out.
NVL72, NVL72_JOB_GPUS = 72, 64
# The DeepSeek-V3 rows leave recompute and the optimizer blank. Megatron-Bridge's DeepSeek-V3
# recipe keeps Adam's moments in BF16 (src/megatron/bridge/recipes/deepseek/deepseek_v3.py:
# use_precision_aware_optimizer, exp_avg_dtype and exp_avg_sq_dtype bfloat16), and its
# performance configs name the modules each layout recomputes
# (scripts/performance/configs/deepseek/deepseek_workload_base_configs.py). Where the config of
# the row's own layout is known (GB200 BF16: pp4 vp4 ep64, recompute_modules ["mla_up_proj"],
# in both the V1 and V2 presets), its recompute is priced (ParallelConfig.recompute_modules);
# elsewhere none is, which only raises the peak: a row priced under its capacity is checked,
# one priced over it is listed as not checked. The step time is priced as stated.
MBRIDGE_DSV3_RECOMPUTE_MODULES = {("GB200", "bf16"): ("mla_up_proj",)}
MBRIDGE_DSV3_RECOMPUTE = (
    "recompute unstated: no Megatron-Bridge DeepSeek-V3 performance config has this row's "
    "layout (its GB300 presets: BF16 at pp4 vp4 ep64 recomputing moe_act, with mlp in an older "
    "one; FP8 at pp2 vp8 ep32 recomputing mla_up_proj); priced without recompute, an upper "
    "bound of the peak"
)

PROFILES = (  # hardware text -> shipped profile (first match)
    ("H100 96GB", "h100_grand_teton"),
    ("H100 95GB", "h100_grand_teton"),
    ("H100", "dgx_h100"),
    ("A100 80GB", "dgx_a100_80g"),
    ("A100 40GB", "dgx_a100_40g"),
    ("A100-SXM4-40GB", "a100_40g_100gbe"),  # the Aceso rows: the Mist artifact's A100 nodes
    ("16x V100 (1 node)", "dgx2_v100"),  # 16 V100 in one node: a DGX-2 (NVSwitch)
    ("V100", "dgx_v100"),
    ("DGX-GB200", "gb200_nvl72"),
    ("DGX-GB300", "gb300_nvl72"),
    ("A10G", "aws_g5_a10g"),  # the Aceso rows' AWS nodes, as the Mist artifact measured them
    ("L4 24GB (GCP)", "gcp_g2_l4"),  # likewise its Google Cloud nodes
)
# source_id prefix -> the stack that ran the row (autopar/hardware/stacks.py)
STACKS = {
    "torchtitan": "torchtitan",
    "megatron": "megatron-core",
    "mbridge": "megatron-bridge",  # NeMo 2 / Megatron-Bridge containers
    "llmfoundry": "llm-foundry",
    "ds_": "deepspeed",
    # NVIDIA's DGX Cloud benchmarks ran NeMo 24.12: Megatron-Core with TransformerEngine
    # (data/README.md)
    "dgxc": "megatron-core",
}
# GPT-3 175B as NeMo's gpt3 175b config builds it (the DGX Cloud rows name it without a shape):
# 96 layers, hidden 12288, 96 heads, FFN 4h, the GPT-2 vocabulary
GPT3_175B = (96, 12288, 96)
# data/README.md on the DGX Cloud 405B rows: the benchmark repository's own 405B yaml, with 16
# query groups and the GPT-2 vocabulary, whatever the row's model text says
DGXC_405B_KV = 16


@dataclass(frozen=True)
class GridRun:
    id: str
    grid: str
    source: str
    trust: str
    dims: ModelDims | None = None
    family: str = "gpt"  # "gpt" (zoo GPT), "llama" (zoo Llama), "deepseek-v3", "bert" (HF)
    profile: str = ""
    num_devices: int = 0
    devices_per_node: int | None = None  # fewer than the profile's (an NVL72 rack's 64)
    memory_unstated: str = ""  # what the stated config leaves out that lowers the peak
    config: autopar.ParallelConfig | None = None
    global_batch: int = 0
    precision: str = "bf16"
    stack: str = ""
    measured_step_s: float | None = None
    measured_from: str = ""
    measured_memory_bytes: float | None = None
    ran: bool = True  # False: the source reports the config as not runnable
    # an Aceso plan: its key in data/aceso_stages.json (stages of their own meshes)
    stage_plan: str = ""
    # settings the row states that differ from its stack's defaults (CostOptions fields)
    option_changes: tuple[tuple[str, object], ...] = ()
    assumptions: tuple[str, ...] = ()
    skip: str | None = None

    @property
    def label(self) -> str:
        cfg = self.config.as_text() if self.config else "-"
        return f"{self.id}: {cfg} [{self.stack}]"


def read_grids(path: Path = DEFAULT_CSV) -> list[GridRun]:
    """Every row of the csv, interpreted, in file order; ids are grid_id#k."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    counts: dict[str, int] = {}
    out = []
    for row in rows:
        counts[row["grid_id"]] = counts.get(row["grid_id"], 0) + 1
        out.append(parse_row(row, f"{row['grid_id']}#{counts[row['grid_id']]}"))
    return out


def parse_row(row: dict[str, str], run_id: str) -> GridRun:
    base = GridRun(run_id, row["grid_id"], row["source_id"], row["trust"])
    skip = _unsupported(row)
    if skip:
        return GridRun(**{**base.__dict__, "skip": skip, "precision": _precision(row["precision"])})
    notes: list[str] = []
    if "aceso" in row["source_id"]:
        return _aceso(row, base, notes)
    dims, family = _dims(row, notes)
    num_devices = _int(row["hardware"].split("x")[0])
    profile = _profile(row)
    config, batch = _config(row, num_devices, notes)
    per_node = None
    if profile in ("gb200_nvl72", "gb300_nvl72") and num_devices > NVL72 and num_devices % NVL72:
        per_node = NVL72_JOB_GPUS
        notes.append(f"{num_devices} GPUs as racks of {per_node} (of the NVL72's {NVL72})")
    stack = next(s for key, s in STACKS.items() if row["source_id"].startswith(key))
    if "compile" in (row["notes"] + row["precision"]).lower():
        stack += "-compile"
    elif stack == "torchtitan" and _precision(row["precision"]) != "bf16":
        # torchtitan's docs/float8.md: --training.compile is "required for competitive
        # performance" (it fuses the float8 scaling and casts)
        stack += "-compile"
        notes.append("Float8 under torch.compile (torchtitan's float8 docs require it)")
    step, how = _measured_step(row, dims, batch, num_devices)
    memory = re.search(r"mem=([0-9.]+)GiB", row["measured"])
    ran = not (row["source_id"].startswith("ds_") and step is None)
    return GridRun(
        **{
            **base.__dict__,
            "dims": dims,
            "family": family,
            "profile": profile,
            "num_devices": num_devices,
            "devices_per_node": per_node,
            "memory_unstated": MBRIDGE_DSV3_RECOMPUTE
            if _deepseek_v3(row) and not _dsv3_recompute(row)
            else "",
            "config": config,
            "global_batch": batch,
            "precision": "fp32" if family == "bert" else _precision(row["precision"]),
            "stack": stack,
            "measured_step_s": step,
            "measured_from": how,
            "measured_memory_bytes": float(memory.group(1)) * GiB if memory else None,
            "ran": ran,
            "option_changes": _option_changes(row, notes),
            "assumptions": tuple(notes),
        }
    )


def _profile(row: dict[str, str]) -> str:
    """The shipped profile of the row's hardware (`PROFILES`' first match), "" for none."""
    return next((p for key, p in PROFILES if key in row["hardware"]), "")


def _aceso(row: dict[str, str], base: GridRun, notes: list[str]) -> GridRun:
    """An Aceso row: its plan's stages (data/aceso_stages.json, `aceso_plans`) on the row's
    devices, priced as Megatron-LM (Aceso's runtime is built on it) in FP16."""
    shape = re.search(r"(\d+)L h(\d+) (\d+)H", row["model"])
    layers, hidden, heads = (int(x) for x in shape.groups())
    seq = int(row["seq_len"])
    # Aceso's Megatron: attention step by step (its score, softmax, dropout and context
    # operators; the scale in the score GEMM, the mask in the softmax kernel: its runs' logs
    # in the artifact print masked_softmax_fusion True), GPT-2's vocabulary, dropout 0.1
    dims = ModelDims(layers, hidden, 4 * hidden, heads, heads, GPT2_VOCAB, seq,
                     attention="megatron", dropout=0.1)  # fmt: skip
    notes.append(f"vocab {GPT2_VOCAB} (GPT-2's), ffn 4h, Megatron's unfused attention, dropout 0.1")
    notes.append("each stage's tp, dp, operators and recompute list: data/aceso_stages.json")
    num_devices = _int(row["hardware"].split("x")[0])
    mbs, batch, pp = _int(row["mbs"]), _int(row["gbs"]), _int(row["pp"])
    config = autopar.ParallelConfig(pp=pp, micro_batch_size=mbs, recompute="selective")
    step = re.search(r"iteration_time=([0-9.]+)ms", row["measured"])
    return GridRun(
        **{
            **base.__dict__,
            "dims": dims,
            "profile": _profile(row),
            "num_devices": num_devices,
            "config": config,
            "global_batch": batch,
            "precision": _precision(row["precision"]),
            "stack": "megatron-lm",
            "measured_step_s": float(step.group(1)) / 1e3,
            "measured_from": "iteration time (Aceso's runtime csv, stage 0 rank 0)",
            "stage_plan": re.search(r"config (\S+\.json)", row["source"]).group(1),
            "assumptions": tuple(notes),
        }
    )


def _option_changes(row: dict[str, str], notes: list[str]) -> tuple[tuple[str, object], ...]:
    """Settings the row states that differ from its stack's defaults."""
    changes: list[tuple[str, object]] = []
    if "PURE" in row["precision"]:
        changes.append(("grad_bytes", 2))
    elif _deepseek_v3(row) and row["source_id"].startswith("mbridge"):
        # Megatron-Bridge's DeepSeek-V3 recipe: ddp grad_reduce_in_fp32=False, main grads in
        # BF16 (src/megatron/bridge/recipes/deepseek/deepseek_v3.py)
        changes.append(("grad_bytes", 2))
        notes.append("gradients reduced in BF16 (the DeepSeek-V3 recipe)")
        changes.append(("moment_bytes", 2))
        notes.append("Adam's moments in BF16 (the recipe's precision-aware optimizer)")
    if row["source_id"].startswith("ds_autotuning_hf"):
        # The autotuning's DeepSpeed configs have no optimizer section (DeepSpeedExamples
        # training/autotuning/hf/dsconfigs), so transformers 4.12's deepspeed_init passes
        # the Trainer's own AdamW, one kernel per op; not DeepSpeed's FusedAdam, DeepSpeed
        # wraps it in FP16_UnfusedOptimizer (ZeRO-0: engine._configure_fp16_optimizer) or
        # runs it over ZeRO's flat fp32 partition, casting and unscaling in passes of its own
        changes.append(("optimizer_fused", False))
        notes.append("transformers' AdamW, unfused (no optimizer in the DeepSpeed config)")
    return tuple(changes)


def _precision(text: str) -> str:
    """The row's precision as autopar names it (`autopar.config.precision`)."""
    text = text.lower()
    if "nvfp4" in text:
        return "nvfp4"
    if "mxfp8" in text or "fp8-mx" in text:
        return "mxfp8"
    if "fp8" in text or "float8" in text:
        # torchtitan's Float8 default and TransformerEngine's delayed / current scaling
        return "fp8-tensorwise"
    return "fp16" if "fp16" in text else "bf16"


def _unsupported(row: dict[str, str]) -> str | None:
    source = row["source_id"]
    if source.startswith("maxtext"):
        return "MaxText runs JAX/XLA: autopar prices PyTorch stacks only"
    if ("experts" in row["model"] or "DeepSeek" in row["model"]) and not _deepseek_v3(row):
        return "MoE other than DeepSeek-V3: no preset of its shape"
    if not _profile(row):
        return f"no shipped profile for {row['hardware']!r}"
    return None


def _dims(row: dict[str, str], notes: list[str]) -> tuple[ModelDims, str]:
    model = row["model"]
    seq = _seq_len(row, notes)
    shape = re.search(r"(\d+)L h(\d+)(?: ffn(\d+))? (\d+)H(?: (\d+)KV)?(?: vocab(\d+))?", model)
    if model.startswith("MPT"):
        name = "mpt-" + model.split()[0].split("-")[1].lower()
        layers, hidden, heads = MPT_SHAPES[name]
        notes.append(f"{name}: {layers}L h{hidden} {heads}H (llm-foundry's yaml), ALiBi as no PE")
        dims = ModelDims(layers, hidden, 4 * hidden, heads, heads, MPT_VOCAB, seq, bias=False)
        return dims, "gpt"
    if model.startswith("BERT"):  # DSAT_BERT_SEQ's source: GLUE fine-tuning of BERT-large
        layers, hidden, heads = (int(shape.group(i)) for i in (1, 2, 4))
        notes.append(f"BERT: sequence classification, vocab {BERT_VOCAB}, fp32 (the source's "
                     "README; the csv says fp16)")  # fmt: skip
        return ModelDims(layers, hidden, 4 * hidden, heads, heads, BERT_VOCAB, seq), "bert"
    if _deepseek_v3(row):  # transformers' DeepseekV3 preset, the row's shape (hf.py)
        notes.append("DeepSeek-V3: the hf preset (MLA, 256 experts top 8, 3 dense layers)")
        return ModelDims(61, 7168, 18432, 128, 128, 129280, seq, bias=False), "deepseek-v3"
    truncated = re.search(r"truncated to (\d+) layers", model)
    if row["source_id"].startswith("dgxc") and "405B" in model:
        # every 405B row: the full model's shape (the first rows' text), the row's layers
        notes.append(f"405B: {DGXC_405B_KV} query groups, vocab {GPT2_VOCAB} (data/README.md)")
        layers = int(truncated.group(1)) if truncated else 126
        if truncated:
            notes.append(f"truncated to {layers} layers (the row's model)")
        dims = ModelDims(layers, 16384, 53248, 128, DGXC_405B_KV, GPT2_VOCAB, seq)
        return dims, "llama"
    if model.startswith("GPT3-175B"):
        layers, hidden, heads = GPT3_175B
        # hidden_dropout and attention_dropout 0.1: the benchmark's own config
        # (NVIDIA/dgxc-benchmarking nemo_megatron/gpt3_175b_hydra.yaml)
        notes.append(f"GPT-3 175B: {layers}L h{hidden} {heads}H, ffn 4h, vocab {GPT2_VOCAB}, "
                     "hidden and attention dropout 0.1 (the benchmark's hydra config)")  # fmt: skip
        dims = ModelDims(layers, hidden, 4 * hidden, heads, heads, GPT2_VOCAB, seq, dropout=0.1)
        return dims, "gpt"
    if shape is None:
        raise ValueError(f"{row['grid_id']}: cannot read a shape from {model!r}")
    layers, hidden, ffn, heads, kv, vocab = shape.groups()
    layers, hidden, heads = int(layers), int(hidden), int(heads)
    if "Llama" in model:
        dims = ModelDims(layers, hidden, int(ffn), heads, int(kv), int(vocab), seq)
        return dims, "llama"
    if vocab is None:
        vocab = GPT2_VOCAB
        notes.append(f"vocab {GPT2_VOCAB} (GPT-2's)")
    if ffn is None:
        notes.append("ffn 4h")
    hf_eager = row["source_id"].startswith("ds_")
    if hf_eager:  # transformers' GPT2Model in 2022: attention step by step, GPT-2's dropout
        notes.append("HF GPT-2: eager (math) attention, dropout 0.1 (GPT2Config defaults)")
    megatron = row["source_id"].startswith("megatron")
    if megatron:  # as benchmarks/published_runs_mapping.py prices Megatron's GPT recipes
        notes.append("hidden and attention dropout 0.1 (Megatron-LM's GPT defaults)")
    dims = ModelDims(
        layers, hidden, int(ffn or 4 * hidden), heads, int(kv or heads), int(vocab), seq,
        attention="math" if hf_eager else "flash",
        dropout=0.1 if hf_eager or megatron else 0.0,
    )  # fmt: skip
    return dims, "gpt"


def _dsv3_recompute(row: dict[str, str]) -> tuple[str, ...]:
    """The recompute modules of the Megatron-Bridge DeepSeek-V3 config of the row's layout
    (`MBRIDGE_DSV3_RECOMPUTE_MODULES`), () where unknown."""
    device = next((d for d, _ in MBRIDGE_DSV3_RECOMPUTE_MODULES if d in row["hardware"]), "")
    return MBRIDGE_DSV3_RECOMPUTE_MODULES.get((device, _precision(row["precision"])), ())


def _deepseek_v3(row: dict[str, str]) -> bool:
    """A DeepSeek-V3 671B row without multi-token prediction (the preset has none)."""
    return row["model"].startswith("DeepSeek-V3 671B") and "w/o MTP" in row["model"]


def _seq_len(row: dict[str, str], notes: list[str]) -> int:
    if row["seq_len"].isdigit():
        return int(row["seq_len"])
    if row["source_id"].startswith("torchtitan"):
        notes.append(f"seq {TORCHTITAN_SEQ} (torchtitan's Llama 3 config)")
        return TORCHTITAN_SEQ
    if "BERT" in row["model"]:
        notes.append(f"seq {DSAT_BERT_SEQ} (run_glue.py's max_seq_length default)")
        return DSAT_BERT_SEQ
    notes.append(f"seq {DSAT_GPT2_SEQ} (the HF example's block size)")
    return DSAT_GPT2_SEQ


def _config(
    row: dict[str, str], num_devices: int, notes: list[str]
) -> tuple[autopar.ParallelConfig, int]:
    tp, pp = _int(row["tp"]) or 1, _int(row["pp"]) or 1
    cp = _int(row["cp"]) or 1
    zero_text = row["fsdp_zero"]
    sharded = zero_text.startswith(("FSDP", "ZeRO stage", "Megatron-FSDP", "dist-optimizer"))
    zero = 0
    if zero_text.startswith(("FSDP", "Megatron-FSDP")):
        zero = 3
    elif zero_text.startswith("dist-optimizer"):
        zero = 1  # Megatron's distributed optimizer: ZeRO-1 over the data-parallel ranks
    elif zero_text.startswith("ZeRO stage"):
        zero = _int(zero_text.split("stage")[1])
    data = num_devices // (tp * pp * cp)
    if row["source_id"].startswith("megatron") and "overlap" in row["notes"]:
        # --overlap-param-gather is a flag of Megatron's distributed optimizer: ZeRO-1 over
        # the data-parallel ranks (megatron/core/optimizer/distrib_optimizer.py)
        sharded, zero = True, 1
        notes.append("distributed optimizer (ZeRO-1 over dp): the README's overlap flags")
    elif row["source_id"].startswith("dgxc") and not zero_text:
        # NeMo 24.12's Megatron-Core recipes: the distributed optimizer (data/README.md)
        sharded, zero = True, 1
        notes.append("distributed optimizer (ZeRO-1 over dp): NeMo's recipes")
    elif row["source_id"].startswith("mbridge") and not zero_text:
        # every Megatron-Bridge recipe builds its optimizer with
        # distributed_fused_adam_with_cosine_annealing (src/megatron/bridge/recipes/utils/
        # optimizer_utils.py: use_distributed_optimizer=True), ZeRO-1 over the dp ranks
        sharded, zero = True, 1
        notes.append("distributed optimizer (ZeRO-1 over dp): Megatron-Bridge's recipes")
    fsdp, dp = (data, 1) if sharded and zero else (1, data)
    mbs = _int(row["mbs"]) or 1
    batch = _int(row["gbs"])
    recompute = _recompute(row["recompute"], notes)
    vp = _int(row["vp"]) or 1
    titan = row["source_id"].startswith("torchtitan")
    if titan and pp > 1 and not _int(row["mbs"]):
        # torchtitan's default: as many micro-batches as pipeline stages
        # (parallelisms/pipelining_utils.py build_pipeline_schedule at 9dec370)
        mbs = max(1, batch // (dp * fsdp * pp))
        notes.append(f"micro-batch {mbs}: torchtitan's default of pp micro-batches")
    if titan and pp > 1 and "interleaved" in row["schedule"].lower() and vp == 1:
        # generate_split_points: two stages per rank for a multi-stage schedule
        vp = 2
        notes.append("2 model chunks per rank: torchtitan's default for interleaved 1F1B")
    schedule = "interleaved_1f1b" if pp > 1 and vp > 1 else "1f1b"
    slots: tuple[str, ...] = ()
    if row["source_id"].startswith("mbridge") and "405B" in row["model"] and pp > 1:
        # Megatron-Bridge's llama31_405b_pretrain_config (src/megatron/bridge/recipes/llama/
        # llama3.py) sets account_for_embedding_in_pipeline_split and ..._loss_...: 126
        # layers + 2 slots split over pp x vp chunks
        slots = ("embedding", "loss")
        notes.append("embedding and loss take a pipeline slot each: Megatron-Bridge's recipe")
    mbridge_dsv3 = _deepseek_v3(row) and row["source_id"].startswith("mbridge")
    modules = _dsv3_recompute(row) if mbridge_dsv3 else ()
    if modules:  # the recipe's --recompute-modules: Megatron's selective granularity
        recompute = "selective"
        notes.append(f"recompute_modules {'+'.join(modules)} (the performance config's)")
    config = autopar.ParallelConfig(
        recompute_modules=modules,
        dp=dp,
        fsdp=fsdp,
        tp=tp,
        pp=pp,
        cp=cp,
        zero_stage=zero,
        micro_batch_size=mbs,
        schedule=schedule,
        virtual_stages=vp if schedule == "interleaved_1f1b" else 1,
        recompute=recompute,
        sequence_parallel=tp > 1,
        ep=_int(row["ep"]) or 1,
        pipeline_slots=slots,
        # Megatron-Core's context parallelism passes K/V around the ring by default
        # (--cp-comm-type p2p: megatron/training/arguments.py; TransformerEngine's
        # AttnFuncWithCPAndKVP2P); torchtitan's and llm-foundry's gather them
        cp_attention="ring" if cp > 1 and _megatron_core(row) else "all_gather",
        # torchtitan's async TP: the config's, priced by the stack's async_tp_overlap
        async_tp="async" in (row["precision"] + row["notes"]).lower() and tp > 1,
    )
    if tp > 1:
        notes.append("sequence parallelism with tp (Megatron's and torchtitan's default)")
    return config, batch


def _megatron_core(row: dict[str, str]) -> bool:
    """Whether the row ran on Megatron-Core (Megatron-LM, NeMo, Megatron-Bridge)."""
    return row["source_id"].startswith(("megatron", "mbridge", "dgxc"))


def _recompute(text: str, notes: list[str]) -> str:
    text = text.lower()
    if text.startswith(("full", "activation che")):
        return "full"
    if text.startswith("selective"):
        return "selective"
    if text.strip() in ("none", ""):
        return "none"
    notes.append(f"recompute {text!r}: none")
    return "none"


def _measured_step(
    row: dict[str, str], dims: ModelDims, batch: int, n: int
) -> tuple[float | None, str]:
    text = row["measured"]
    stated = re.search(r"step_time=([0-9.]+)s", text)
    if stated:
        return float(stated.group(1)), "step time"
    tokens = re.search(r"(?:TPS/GPU|WPS(?:\(tokens/s/GPU\))?|tokens/s/GPU)=([0-9.]+)", text)
    if tokens:
        return batch * dims.seq_len / (float(tokens.group(1)) * n), "tokens/s/GPU"
    tflops = re.search(r"TFLOPs/GPU=([0-9.]+)", text)
    if tflops:
        flops = megatron_core_2024_flops(dims, batch)
        return flops / (float(tflops.group(1)) * 1e12 * n), "TFLOP/s/GPU (Megatron-Core count)"
    samples = re.search(r"\)=([0-9.]+)", text)
    if samples and float(samples.group(1)) > 0:
        return batch / float(samples.group(1)), "samples/s (autotuner fwd+bwd+step)"
    return None, "not runnable (the source's 0)"


def _int(text: str) -> int:
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match else 0
