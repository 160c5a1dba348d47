"""Exporters (autopar.codegen.export, autopar.export): each file is read back by the target
framework's own parser where its package installs here (torchtitan's ConfigManager, DeepSpeed's
DeepSpeedConfig, Accelerate's launch command), Megatron-LM's arguments by a parser rebuilt from
the option list of its own parser (tests/autopar/codegen/data), and the degrees, batch and
recompute they carry are the plan's; what a target cannot express is named, not dropped."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import autopar
from autopar.codegen.export import TARGETS, export_plan, model_shape
from autopar.models import hf

DATA = Path(__file__).parent / "data"
TINY = ("autopar.models.hf:build", {"name": "llama-tiny-hf", "num_hidden_layers": 4})

# (config, global batch) on dgx_h100 x 2 = 16 devices
CONFIGS = {
    "fsdp16": (autopar.ParallelConfig(fsdp=16, zero_stage=3, micro_batch_size=2), 64),
    "hsdp-tp-pp": (
        autopar.ParallelConfig(
            dp=2, fsdp=2, tp=2, pp=2, zero_stage=1, sequence_parallel=True, recompute="full"
        ),
        32,
    ),
    "tp-cp-interleaved": (
        autopar.ParallelConfig(
            dp=2,
            cp=2,
            tp=2,
            pp=2,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            recompute="selective",
            sequence_parallel=True,
        ),
        16,
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def tiny():
    model = hf.build(TINY[1]["name"], num_hidden_layers=4)
    inputs = (torch.randint(0, model.config.vocab_size, (1, 256), device="meta"),)
    return model, autopar.trace(model, inputs)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def plan(request, tiny):
    model, graph = tiny
    config, batch = CONFIGS[request.param]
    cluster = autopar.Cluster.from_profile("dgx_h100", 2)
    return autopar.evaluate(
        model, cluster, config, global_batch_size=batch, graph=graph, model_factory=TINY
    )


def _needs(package: str) -> None:
    """Skip where the framework is not installed (scripts/setup.sh installs all three); found,
    not imported: torchtitan's package __init__ needs triton (see `_torchtitan_load`)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")


def _shape(tiny):
    return model_shape(tiny[0].config)


def _torchtitan_load(path: Path) -> dict:
    """torchtitan's own ConfigManager on the file, in a fresh interpreter. torchtitan 0.2's
    package __init__ imports its MoE triton kernels, which a CPU machine lacks, so the package
    is entered without it: the config modules need neither."""
    code = f"""
import importlib.util, json, sys, types, warnings, dataclasses
warnings.simplefilter("error", UserWarning)  # a value outside a Literal's choices
spec = importlib.util.find_spec("torchtitan")
pkg = types.ModuleType("torchtitan")
pkg.__path__ = list(spec.submodule_search_locations)
sys.modules["torchtitan"] = pkg
from torchtitan.config import ConfigManager
config = ConfigManager().parse_args(["--job.config_file", {str(path)!r}])
print(json.dumps(dataclasses.asdict(config)))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_torchtitan_loads_the_plans_degrees_batch_and_recompute(plan, tiny, tmp_path):
    _needs("torchtitan")
    done = export_plan(plan, "torchtitan", _shape(tiny))
    (tmp_path / done.filename).write_text(done.text)
    job = _torchtitan_load(tmp_path / done.filename)
    c, par, train = plan.config, job["parallelism"], job["training"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (
        c.dp,
        c.fsdp,
    )
    assert (par["tensor_parallel_degree"], par["context_parallel_degree"]) == (c.tp, c.cp)
    assert par["pipeline_parallel_degree"] == c.pp
    assert train["seq_len"] == plan.seq_len and train["global_batch_size"] == (
        plan.global_batch_size
    )
    # torchtitan accumulates global / (local x data-parallel ranks) times; with pp the local
    # batch runs through the pipeline in micro-batches of pipeline_parallel_microbatch_size
    accumulate = plan.global_batch_size // (train["local_batch_size"] * c.dp * c.fsdp)
    per_step = accumulate * (train["local_batch_size"] // c.micro_batch_size)
    assert per_step == plan.num_microbatches
    if c.pp > 1:
        assert par["pipeline_parallel_microbatch_size"] == c.micro_batch_size
    assert job["activation_checkpoint"]["mode"] == c.recompute
    assert job["checkpoint"]["interval"] == plan.goodput["sync_interval_steps"]
    # the tiny model is not one torchtitan defines: said, in the file too
    assert any("torchtitan builds models it defines" in gap for gap in done.gaps)
    assert all(f"#   - {gap}" in done.text for gap in done.gaps)


def _megatron_parser() -> argparse.ArgumentParser:
    """Megatron-LM's options as its own parser declares them (names, flag or value, type,
    choices), from the list that scripts/megatron_options.py extracted."""
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    types = {"int": int, "float": float, "str": str, None: None}
    for option in json.loads((DATA / "megatron_lm_options.json").read_text())["options"]:
        if option["flag"]:
            parser.add_argument(*option["options"], action="store_true")
        elif option["nargs"] == 0:  # --x / --no-x
            parser.add_argument(option["options"][0], action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(
                *option["options"],
                type=types[option["type"]],
                choices=option["choices"],
                nargs=option["nargs"],
            )
    return parser


def _megatron_argv(text: str) -> list[str]:
    body = text.split("MEGATRON_ARGS=(", 1)[1].rsplit(")", 1)[0]
    return shlex.split(body)


def test_megatron_arguments_parse_with_megatrons_options(plan, tiny):
    done = export_plan(plan, "megatron", _shape(tiny))
    subprocess.run(["bash", "-n"], input=done.text, text=True, check=True)
    args = _megatron_parser().parse_args(_megatron_argv(done.text))
    c = plan.config
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (c.tp, c.pp)
    assert (args.context_parallel_size, args.expert_model_parallel_size) == (c.cp, c.ep)
    assert args.micro_batch_size == c.micro_batch_size
    assert args.global_batch_size == plan.global_batch_size and args.seq_length == plan.seq_len
    assert args.sequence_parallel == c.sequence_parallel
    # Megatron's data-parallel size is what the model-parallel degrees leave
    assert plan.world_size // (c.tp * c.pp * c.cp) == c.dp * c.fsdp
    shape = _shape(tiny)
    assert (args.num_layers, args.hidden_size) == (shape.num_layers, shape.hidden_size)
    assert args.num_query_groups == shape.num_kv_heads and args.swiglu
    assert args.recompute_granularity == (None if c.recompute == "none" else c.recompute)
    if c.virtual_stages > 1:
        assert args.num_virtual_stages_per_pipeline_rank == c.virtual_stages
    if c.fsdp > 1 and c.zero_stage < 3:
        assert args.use_distributed_optimizer


def test_megatron_per_layer_recompute_is_megatrons_block_method(tiny):
    model, graph = tiny
    config = autopar.ParallelConfig(
        tp=2, pp=2, recompute="full", recompute_layers=1, micro_batch_size=1
    )
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=4)
    plan = autopar.evaluate(model, cluster, config, global_batch_size=8, graph=graph)
    args = _megatron_parser().parse_args(_megatron_argv(export_plan(plan, "megatron").text))
    assert (args.recompute_method, args.recompute_num_layers) == ("block", 1)
    # no model factory: Megatron's model arguments are missing, and the file says so
    assert args.num_layers is None
    assert any("the model's shape" in gap for gap in export_plan(plan, "megatron").gaps)


def test_megatron_pipeline_slots_are_megatrons_split_accounting(tiny):
    """A layout the slots make possible (4 blocks, 6 chunks) reaches Megatron as its own
    account-for-embedding/loss flags, and a plan without them sets neither."""
    model, graph = tiny
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    parser = _megatron_parser()
    for slots, v in (((), 2), (("embedding", "loss"), 3)):
        config = autopar.ParallelConfig(
            pp=2, schedule="interleaved_1f1b", virtual_stages=v, pipeline_slots=slots
        )
        plan = autopar.evaluate(model, cluster, config, global_batch_size=8, graph=graph)
        args = parser.parse_args(_megatron_argv(export_plan(plan, "megatron").text))
        assert args.account_for_embedding_in_pipeline_split == bool(slots)
        assert args.account_for_loss_in_pipeline_split == bool(slots)


def test_activation_offload_reaches_megatron_and_the_others_name_the_gap(tiny):
    model, graph = tiny
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    config = autopar.ParallelConfig(dp=2, offload_layers=2)
    plan = autopar.evaluate(model, cluster, config, global_batch_size=8, graph=graph)
    args = _megatron_parser().parse_args(_megatron_argv(export_plan(plan, "megatron").text))
    assert args.cpu_offloading_num_layers == 2
    for target in ("torchtitan", "deepspeed", "accelerate"):
        gaps = export_plan(plan, target).gaps
        assert any(g.startswith("offload_layers=2: ") for g in gaps), target
    assert not any("offload" in g for g in export_plan(plan, "megatron").gaps)


def test_async_tp_reaches_torchtitan_and_megatron_as_their_own_switches(tiny, tmp_path):
    _needs("torchtitan")
    model, graph = tiny
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    config = autopar.ParallelConfig(tp=2, sequence_parallel=True, async_tp=True)
    plan = autopar.evaluate(
        model, cluster, config, global_batch_size=8, graph=graph, stack="torchtitan-compile"
    )
    done = export_plan(plan, "torchtitan", _shape(tiny))
    (tmp_path / done.filename).write_text(done.text)
    job = _torchtitan_load(tmp_path / done.filename)
    assert job["parallelism"]["enable_async_tensor_parallel"] is True
    assert job["compile"]["enable"] is True
    args = _megatron_parser().parse_args(_megatron_argv(export_plan(plan, "megatron").text))
    assert args.tp_comm_overlap


def test_cp_attention_reaches_torchtitan_and_megatron(tiny, tmp_path):
    _needs("torchtitan")
    model, graph = tiny
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    ways = (("ring", "alltoall", "p2p"), ("all_gather", "allgather", "allgather"))
    for kind, rotate, megatron in ways:
        config = autopar.ParallelConfig(cp=2, cp_attention=kind)
        plan = autopar.evaluate(model, cluster, config, global_batch_size=8, graph=graph)
        done = export_plan(plan, "torchtitan", _shape(tiny))
        (tmp_path / done.filename).write_text(done.text)
        job = _torchtitan_load(tmp_path / done.filename)
        assert job["parallelism"]["context_parallel_rotate_method"] == rotate
        args = _megatron_parser().parse_args(_megatron_argv(export_plan(plan, "megatron").text))
        assert args.cp_comm_type == [megatron]


def _deepspeed_load(config: dict, data_parallel_ranks: int) -> dict:
    """DeepSpeed's own DeepSpeedConfig on ``config``, in a fresh interpreter with a one-rank
    gloo group (DeepSpeed reads the world from its communication backend); the data-parallel
    size comes through DeepSpeed's model-parallel-unit hook, as Megatron-style models give it.
    The group meets through a file store of its own, not a fixed TCP port, which a test on
    another pytest-xdist worker may hold."""
    with tempfile.TemporaryDirectory() as directory:
        return _deepspeed_parse(config, data_parallel_ranks, Path(directory) / "store")


def _deepspeed_parse(config: dict, data_parallel_ranks: int, store: Path) -> dict:
    code = f"""
import json, os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="0")
import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
# the CPU backend would first compile its shared-memory collective kernel (a minute of g++),
# which reading a config never calls
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="gloo", verbose=False, init_method="file://{store}",
                           rank=0, world_size=1)

class DataParallelRanks:
    def get_data_parallel_world_size(self):
        return {data_parallel_ranks}

parsed = DeepSpeedConfig(json.loads(sys.stdin.read()), mpu=DataParallelRanks())
print(json.dumps(dict(train_batch_size=parsed.train_batch_size,
    micro=parsed.train_micro_batch_size_per_gpu, accumulate=parsed.gradient_accumulation_steps,
    zero=parsed.zero_optimization_stage, bf16=parsed.bfloat16_config.enabled)))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(config), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_deepspeed_config_is_accepted_by_deepspeed(plan):
    _needs("deepspeed")
    done = export_plan(plan, "deepspeed")
    c = plan.config
    parsed = _deepspeed_load(json.loads(done.text), c.dp * c.fsdp)
    assert parsed["train_batch_size"] == plan.global_batch_size
    assert parsed["micro"] == c.micro_batch_size
    assert parsed["accumulate"] == plan.num_microbatches
    assert parsed["zero"] == (min(c.zero_stage, 1) if c.pp > 1 else c.zero_stage)
    assert parsed["bf16"] == (plan.precision == "bf16")
    if c.pp > 1:
        assert any("PipelineModule" in gap for gap in done.gaps)


def test_accelerate_config_is_accepted_by_accelerate_launch(plan, tmp_path):
    _needs("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    done = export_plan(plan, "accelerate")
    path = tmp_path / done.filename
    path.write_text(done.text)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    c = plan.config
    assert args.num_processes == plan.world_size and args.num_machines == plan.num_nodes
    assert args.use_fsdp and int(args.fsdp_version) == 2
    sizes = (args.parallelism_config_dp_replicate_size, args.parallelism_config_dp_shard_size)
    assert sizes == (c.dp, c.fsdp * c.pp)
    assert args.parallelism_config_tp_size == c.tp and args.parallelism_config_cp_size == c.cp
    assert (c.pp > 1) == any("no pipeline parallelism" in gap for gap in done.gaps)


def test_what_a_target_cannot_express_is_named():
    config = autopar.ParallelConfig(
        dp=2,
        pp=2,
        schedule="zero_bubble",
        micro_batch_size=1,
        axis_order=("cp", "tp", "dp", "fsdp"),
    )
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=4)
    model = hf.build("llama-tiny-hf")
    inputs = (torch.randint(0, 128, (1, 64), device="meta"),)
    plan = autopar.evaluate(model, cluster, config, inputs, global_batch_size=8, precision="fp16")
    megatron = " ".join(export_plan(plan, "megatron").gaps)
    assert "schedule zero_bubble" in megatron and "axis order cp,tp,dp,fsdp" in megatron
    titan = " ".join(export_plan(plan, "torchtitan").gaps)
    assert "fp16" in titan and "axis order" in titan
    with pytest.raises(ValueError, match="choose one of torchtitan, megatron"):
        export_plan(plan, "colossalai")


def test_a_plan_trained_by_diloco_names_the_algorithm_in_every_target():
    """A plan whose training is DiLoCo across sites is one replica group's: every exported
    file says so and where the algorithm runs (torchtitan's torchft section, or autopar's
    train.py), and its gaps list it; a synchronous plan's do not."""
    model = hf.build("llama-tiny-hf")
    inputs = (torch.randint(0, 128, (1, 64), device="meta"),)
    sites = autopar.Cluster.from_profile("dgx_h100", 2, sites=2, site_link_gbps=0.001)
    options = autopar.PlanOptions(sensitivity=False)
    plan = autopar.parallelize(model, sites, inputs, global_batch_size=16, options=options)
    assert plan.training["chosen"]["name"] == "diloco"
    for target in ("torchtitan", "megatron", "deepspeed", "accelerate"):
        done = export_plan(plan, target)
        named = [g for g in done.gaps if g.startswith("DiLoCo over 2 replica groups")]
        assert len(named) == 1 and "--diloco-group G" in named[0], done.gaps
        assert named[0] in done.text
    assert "[fault_tolerance]" in export_plan(plan, "torchtitan").gaps[-1]
    sync = autopar.evaluate(model, sites.one_site(), plan.config, inputs, global_batch_size=8)
    assert not any("DiLoCo" in g for g in export_plan(sync, "torchtitan").gaps)


@pytest.mark.slow
def test_cli_plan_llama3_8b_then_export_to_torchtitan(tmp_path):
    """The issue's acceptance: plan Llama 3 8B on 2 DGX H100 nodes, export it, and torchtitan's
    own parser loads the plan's degrees; the file names the price on torchtitan's stack."""
    _needs("torchtitan")
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "autopar"]
    plan_cmd = [*cli, "plan", "llama3-8b", "--profile", "dgx_h100", "--nodes", "2"]
    subprocess.run([*plan_cmd, "-o", str(out)], check=True, capture_output=True)
    done = subprocess.run(
        [*cli, "export", str(out / "plan.json"), "--to", "torchtitan"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert f"wrote {out / 'torchtitan.toml'}" in done.stdout
    plan = autopar.Plan.from_json((out / "plan.json").read_text())
    job = _torchtitan_load(out / "torchtitan.toml")
    assert (job["model"]["name"], job["model"]["flavor"]) == ("llama3", "8B")
    par = job["parallelism"]
    got = [par[f"{k}_degree"] for k in ("tensor_parallel", "pipeline_parallel")]
    assert got == [plan.config.tp, plan.config.pp]
    assert par["data_parallel_shard_degree"] == plan.config.fsdp
    assert "re-priced on the torchtitan stack" in (out / "torchtitan.toml").read_text()


def test_every_target_has_a_stack_that_prices_it():
    names = set(autopar.stack_names())
    assert all(stack in names for _, stack in TARGETS.values())


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-rowwise", "mxfp8", "nvfp4"])
def test_low_precision_plans_reach_torchtitan_and_megatron_as_their_own_recipes(
    tiny, tmp_path, recipe
):
    model, graph = tiny
    profile = "dgx_h100" if recipe.startswith("fp8") else "dgx_b200"
    cluster = autopar.Cluster.from_profile(profile, num_devices=8)
    config = autopar.ParallelConfig(fsdp=8, zero_stage=3, micro_batch_size=1)
    plan = autopar.evaluate(
        model, cluster, config, global_batch_size=8, graph=graph, precision=recipe
    )
    args = _megatron_parser().parse_args(_megatron_argv(export_plan(plan, "megatron").text))
    assert args.bf16
    if recipe == "nvfp4":
        assert (args.fp4_format, args.fp4_recipe) == ("e2m1", "nvfp4")
    else:
        want = {"fp8-tensorwise": "tensorwise", "fp8-rowwise": "tensorwise", "mxfp8": "mxfp8"}
        assert args.fp8_recipe == want[recipe]
    if importlib.util.find_spec("torchtitan") is None:
        return
    done = export_plan(plan, "torchtitan")
    (tmp_path / done.filename).write_text(done.text)
    job = _torchtitan_load(tmp_path / done.filename)
    converters = job["model"]["converters"]
    if recipe.startswith("fp8"):
        float8 = job["quantize"]["linear"]["float8"]
        assert converters == ["quantize.linear.float8"]
        assert float8["recipe_name"] == recipe.split("-")[1]
        assert float8["enable_fsdp_float8_all_gather"] is (recipe == "fp8-tensorwise")
        assert job["compile"]["enable"]
    elif recipe == "mxfp8":
        assert converters == ["quantize.linear.mx"]
    else:
        assert converters == [] and any("no converter" in gap for gap in done.gaps)


def test_module_recompute_reaches_megatron_and_the_others_name_the_gap(tiny):
    model, graph = tiny
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    config = autopar.ParallelConfig(dp=2, recompute="selective", recompute_modules=("mlp",))
    plan = autopar.evaluate(
        model, cluster, config, global_batch_size=8, graph=graph, stack="megatron-core"
    )
    done = export_plan(plan, "megatron")
    args = _megatron_parser().parse_args(_megatron_argv(done.text))
    assert (args.recompute_granularity, args.recompute_modules) == ("selective", ["mlp"])
    assert not any("recompute" in g for g in done.gaps)
    for target in ("torchtitan", "deepspeed", "accelerate"):
        gaps = export_plan(plan, target).gaps
        assert any(g.startswith("recompute_modules=mlp: ") for g in gaps), target
    # autopar's own selective (torch's op policy) is not Megatron's default core attention
    plain = autopar.evaluate(
        model, cluster, replace(config, recompute_modules=()), global_batch_size=8, graph=graph
    )
    assert any("Megatron's selective re-runs core attention" in g
               for g in export_plan(plain, "megatron").gaps)  # fmt: skip
