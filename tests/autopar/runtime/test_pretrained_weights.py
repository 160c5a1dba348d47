"""Pretrained weights in and out (issue 44): a Hugging Face checkpoint, written on the spot
with `save_pretrained`, starts a sharded run (`TrainOptions.init_from`, `train.py
--init-from`), and the trained model goes back out as a Hugging Face checkpoint
(`TrainOptions.save_hf`) that transformers loads.

Models: tiny Llama, Qwen3 with tied embeddings (saved in bf16: the run trains fp32 master
weights from it), Mixtral (its checkpoint keeps one tensor per expert, the model a stack) and
GPT-2 (a fused Conv1D projection). Styles on 4 gloo ranks: FSDP2 x TP2 (+SP), PP2 x DP2, CP2 x
DP2, and for Mixtral EP2 over FSDP4 and EP2 x ETP2 (each expert's width over the tp ranks).
Checked against one process:
- the first step's loss equals transformers' `from_pretrained` and one forward, within 1e-5;
- the 3 steps' losses and gradient norms equal the single-process run's from the same
  checkpoint (`reference_model`), within 1e-5;
- the exported checkpoint loads with `from_pretrained` and holds every tensor exactly as the
  run's own checkpoint does, and its logits are the single-process run's trained model's
  within 1e-4 of their largest magnitude.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path

import pytest
import torch
from harness import Case, max_rel_error, run_ranks, tp_of
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import autopar
from autopar.config import ParallelConfig as C
from autopar.models import hf
from autopar.models.source import HF_CONFIG_FACTORY
from autopar.runtime.checkpoint import CheckpointOptions
from autopar.runtime.startup.hf_checkpoint import CheckpointFormatError
from autopar.runtime.task import task_from_source
from autopar.runtime.trainer import TrainOptions, reference_model, train

transformers = pytest.importorskip("transformers")

GLOBAL_BATCH, SEQ = 8, 16
OPTIONS = TrainOptions(steps=3, lr=1e-3, log=False)


def _qwen3_tied() -> torch.nn.Module:
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(config)


def _saved(name: str, root: Path) -> Path:
    """A checkpoint written by transformers itself; Qwen3's in bf16."""
    model = _qwen3_tied() if name == "qwen3" else hf.build(f"{name}-tiny-hf", seed=1)
    if name == "qwen3":
        model = model.to(torch.bfloat16)
    path = root / name
    model.save_pretrained(path)
    return path


@dataclass(frozen=True)
class Run:
    model: str
    config: C


RUNS = [
    Run("llama", C(fsdp=2, tp=2, zero_stage=3, sequence_parallel=True)),
    Run("llama", C(pp=2, dp=2)),
    Run("qwen3", C(fsdp=2, tp=2, zero_stage=3)),
    Run("qwen3", C(pp=2, dp=2)),
    Run("mixtral", C(fsdp=4, ep=2, zero_stage=3)),
    Run("mixtral", C(fsdp=2, tp=2, zero_stage=3)),
    Run("mixtral", C(dp=2, tp=2, ep=2, etp=2, sequence_parallel=True)),
    Run("llama", C(cp=2, dp=2)),
    Run("gpt2", C(fsdp=2, tp=2, zero_stage=3)),
    Run("gpt2", C(pp=2, dp=2)),
]


def _task(checkpoint: Path):
    return task_from_source(
        HF_CONFIG_FACTORY,
        {"path": str(checkpoint / "config.json")},
        global_batch_size=GLOBAL_BATCH,
        seq_len=SEQ,
    )


def _options(checkpoint: Path, out: Path | None = None) -> TrainOptions:
    """From ``checkpoint``; with ``out``, the run's own checkpoint in out/dcp and its Hugging
    Face export in out/hf."""
    if out is None:
        return TrainOptions(steps=3, lr=1e-3, log=False, init_from=str(checkpoint))
    return TrainOptions(
        steps=3, lr=1e-3, log=False, init_from=str(checkpoint), save_hf=str(out / "hf"),
        checkpoint=CheckpointOptions(str(out / "dcp"), every=3),
    )  # fmt: skip


def _case(run: Run, root: Path) -> Case:
    """``run`` as its plan prices it: placements and the projections the trace splits (GPT-2's
    fused c_attn), which the generated program's TP plan spells out."""
    return _priced(run, root)[0]


def _priced(run: Run, root: Path, precision: str = "fp32") -> tuple[Case, autopar.Plan]:
    path = str(root / run.model / "config.json")
    model = hf.build_from_config(path, device="meta")
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=run.config.world_size)
    (ids,), _ = _task(root / run.model).batch(0, 0, 1)
    plan = autopar.evaluate(model, cluster, run.config, (ids,), global_batch_size=GLOBAL_BATCH,
                            precision=precision)  # fmt: skip
    case = Case(run.model, run.config, GLOBAL_BATCH, placements=plan.placements,
                overrides={"path": path}, seq_len=SEQ, factory=HF_CONFIG_FACTORY,
                roles=plan.tensor_parallel_roles, precision=precision)  # fmt: skip
    return case, plan


def _ranks(cases: list[Case], root: str) -> list[list[tuple[float, float]]]:
    out = []
    for i, case in enumerate(cases):
        checkpoint = Path(root, case.model)
        steps = train(
            _task(checkpoint),
            case.config,
            GLOBAL_BATCH,
            options=_options(checkpoint, Path(root, f"out{i}")),
            placements=case.placements,
            tp=tp_of(case),
        )
        out.append([(r.loss, r.grad_norm) for r in steps])
    return out


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_hugging_face_checkpoint_trains_sharded_and_goes_back_out(tmp_path):
    for name in dict.fromkeys(r.model for r in RUNS):
        _saved(name, tmp_path)
    cases = [_case(run, tmp_path) for run in RUNS]
    per_rank = run_ranks(4, _ranks, cases, str(tmp_path))
    for i, run in enumerate(RUNS):
        checkpoint = tmp_path / run.model
        task = _task(checkpoint)
        steps, trained = reference_model(task, GLOBAL_BATCH, _options(checkpoint))
        want = [(r.loss, r.grad_norm) for r in steps]
        (ids,), targets = task.batch(0, 0, GLOBAL_BATCH)
        pretrained = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).float()
        first = task.loss(pretrained(ids).logits, targets).item()
        label = f"{run.model} {run.config.as_text()}"
        assert abs(per_rank[0][i][0][0] - first) <= 1e-5 * abs(first), (label, first)
        err = max(max_rel_error(results[i], want) for results in per_rank)
        assert err <= 1e-5, f"{label}: {err:.2e} ({per_rank[0][i]} vs {want})"
        out = tmp_path / f"out{i}"
        # the export is the run's model: every tensor as the run's checkpoint holds it
        # (read by torch's own DCP converter; expert slices are joined by the export alone)
        dcp_to_torch_save(out / "dcp" / "step-00000003", out / "run.pt")
        run = torch.load(out / "run.pt", weights_only=True)["model"]
        exported = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
        state = exported.state_dict()
        for name, tensor in run.items():
            if "@" not in name:
                assert torch.equal(state[name], tensor), (label, name)
        # and the run's model is one process's: logits within 1e-4 of their largest (the
        # losses agree within 1e-5; AdamW's first steps, m / sqrt(v) of gradients that agree
        # to 1e-7, move a weight by up to lr, so three steps part the weights by more)
        got, ref = _logits(exported, ids), _logits(trained, ids)
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item(), label
        saved = json.loads((out / "hf" / "config.json").read_text())
        assert saved.get("dtype", saved.get("torch_dtype")) == "float32"


def test_precision_is_the_plans_whatever_the_checkpoint_stores(tmp_path):
    """A bf16 checkpoint (and config) starts fp32 master weights: the parameters' bytes are
    fp32's, as the plan prices them."""
    checkpoint = _saved("qwen3", tmp_path)
    assert json.loads((checkpoint / "config.json").read_text())["dtype"] == "bfloat16"
    _, model = reference_model(_task(checkpoint), GLOBAL_BATCH, TrainOptions(
        steps=0, init_from=str(checkpoint)))  # fmt: skip
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    for (name, p), q in zip(model.named_parameters(), pretrained.parameters(), strict=True):
        assert torch.equal(p, q.float()), name


def _bytes_of_one_step(case: Case, root: str) -> dict[str, float]:
    options = TrainOptions(steps=1, log=False, precision=case.precision)
    steps = train(_task(Path(root, case.model)), case.config, GLOBAL_BATCH, options=options,
                  placements=case.placements)  # fmt: skip
    return steps[0].memory_bytes


@pytest.mark.multiprocess
def test_a_bf16_config_trains_the_plans_bytes(tmp_path):
    """A config.json saying `torch_dtype: bfloat16` (as published ones do): the run's
    parameter, gradient and optimizer bytes are the plan's (fp32 master weights and AdamW
    moments), on each of 2 ranks under DP2 and FSDP2 (ZeRO-3), trained in fp32 and in bf16
    (autocast over the fp32 parameters)."""
    _saved("qwen3", tmp_path)
    for config, precision in product((C(dp=2), C(fsdp=2, zero_stage=3)), ("fp32", "bf16")):
        case, plan = _priced(Run("qwen3", config), tmp_path, precision)
        planned = plan.stages[0].memory_bytes
        for measured in run_ranks(2, _bytes_of_one_step, case, str(tmp_path)):
            for part in ("parameters", "gradients", "optimizer"):
                assert measured[part] == pytest.approx(planned[part], rel=1e-6), (
                    config.as_text(),
                    part,
                    measured[part],
                    planned[part],
                )


def test_a_checkpoint_of_another_shape_is_refused_naming_the_tensor(tmp_path):
    checkpoint = _saved("llama", tmp_path)
    other = hf.build("llama-tiny-hf", intermediate_size=96)  # the MLP's width differs
    other.save_pretrained(tmp_path / "other")
    options = TrainOptions(steps=0, init_from=str(tmp_path / "other"))
    with pytest.raises(
        CheckpointFormatError, match=r"mlp\.\w+_proj\.weight is \((96, 64|64, 96)\)"
    ):
        reference_model(_task(checkpoint), GLOBAL_BATCH, options)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointFormatError, match="no Hugging Face checkpoint here"):
        reference_model(_task(checkpoint), GLOBAL_BATCH, replace(options, init_from=str(
            tmp_path / "empty")))  # fmt: skip
