"""Stage layouts and stage modules, in one process: boundaries, placements, FQNs, composition."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import autopar
from autopar.config import ParallelConfig
from autopar.models import hf, zoo
from autopar.runtime import parts
from autopar.runtime.pipeline import SCHEDULES, check_schedule, layout_for
from autopar.runtime.stages import (
    ChunkLayout,
    build_stage_modules,
    even_layout,
    layout_from_sizes,
    layout_from_stages,
)


def test_even_layout_places_loop_and_v():
    loop = even_layout(8, pp=2, virtual_stages=2)
    assert loop.bounds == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert [loop.stage_of(k) for k in range(4)] == [0, 1, 0, 1]
    assert loop.chunks_on(1) == (1, 3)
    v = even_layout(8, pp=2, virtual_stages=2, style="v")
    assert [v.stage_of(k) for k in range(4)] == [0, 1, 1, 0]
    assert v.chunks_on(0) == (0, 3)
    assert even_layout(5, pp=2).bounds == ((0, 3), (3, 5))  # the extra block to the middle
    assert layout_from_sizes([1, 3], pp=2).bounds == ((0, 1), (1, 4))


def test_bad_layouts_are_refused_with_numbers():
    with pytest.raises(ValueError, match="4 chunks but the model has 3 blocks"):
        even_layout(3, pp=2, virtual_stages=2)
    with pytest.raises(ValueError, match="chunk 1 holds blocks"):
        ChunkLayout(2, ((0, 2), (3, 4)))
    with pytest.raises(ValueError, match="a V needs 2 \\* pp = 4 chunks"):
        ChunkLayout(2, ((0, 1), (1, 2)), "v")


def test_layout_from_stages_reads_loop_v_and_uneven():
    loop = layout_from_stages(
        [["tok_emb", "blocks.0", "blocks.2"], ["blocks.1", "blocks.3", "lm_head"]],
        "blocks",
        4,
        pp=2,
        virtual_stages=2,
    )
    assert loop.bounds == ((0, 1), (1, 2), (2, 3), (3, 4))
    v = layout_from_stages(
        [["blocks.0", "blocks.5"], ["blocks.1", "blocks.2", "blocks.3", "blocks.4"]],
        "blocks",
        6,
        pp=2,
        virtual_stages=2,
        style="v",
    )
    assert v.bounds == ((0, 1), (1, 3), (3, 5), (5, 6))  # the turn split in half
    uneven = layout_from_stages(
        [["blocks.0"], ["blocks.1", "blocks.2", "blocks.3"]], "blocks", 4, 2
    )
    assert uneven.bounds == ((0, 1), (1, 4))
    with pytest.raises(ValueError, match="place 3 of 4 blocks"):
        layout_from_stages([["blocks.0"], ["blocks.1", "blocks.2"]], "blocks", 4, 2)
    with pytest.raises(ValueError, match="do not form pp=2 x virtual_stages=1"):
        layout_from_stages([["blocks.0", "blocks.2"], ["blocks.1"]], "blocks", 3, 2)


@pytest.mark.parametrize(
    ("schedule", "v"), [("interleaved_1f1b", 2), ("dualpipe_v", 2), ("1f1b", 1)]
)
def test_layout_from_a_plan_matches_its_stages(schedule: str, v: int):
    model = zoo.build("gpt-tiny", device="meta", num_layers=4)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=2)
    config = ParallelConfig(pp=2, schedule=schedule, virtual_stages=v)
    plan = autopar.evaluate(
        model, cluster, config, zoo.example_inputs("gpt-tiny", model), global_batch_size=8
    )
    layout = layout_for(config, model, [s.layers for s in plan.stages])
    for stage in plan.stages:
        held = [
            f"blocks.{i}" for k in layout.chunks_on(stage.index) for i in range(*layout.bounds[k])
        ]
        assert held == [n for n in stage.layers if n.startswith("blocks.")]


def test_check_schedule_errors_name_the_numbers():
    with pytest.raises(ValueError, match="num_microbatches >= pp = 4, got 2"):
        check_schedule("1f1b", 4, 1, 2)
    with pytest.raises(ValueError, match="exactly 2 virtual stages .* got virtual_stages=3"):
        check_schedule("dualpipe_v", 2, 3, 8)
    with pytest.raises(ValueError, match="at least 2 virtual stages"):
        check_schedule("interleaved_1f1b", 2, 1, 4)
    with pytest.raises(ValueError, match="multiple of max\\(1, m // pp\\) = 2, got 5"):
        check_schedule("interleaved_1f1b", 2, 2, 5)
    with pytest.raises(ValueError, match="num_microbatches >= pp \\* 2 = 4, got 3"):
        check_schedule("dualpipe_v", 2, 2, 3)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'x'"):
        check_schedule("x", 2, 1, 4)
    check_schedule("zero_bubble", 2, 1, 4)


def test_each_schedule_names_a_torch_class_of_its_kind():
    """`SCHEDULES` names torch's classes (imported when a pipeline is built, not with the
    runtime): each resolves, and takes a list of stages exactly where `multi` says."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineSchedule

    for name, spec in SCHEDULES.items():
        cls = spec.torch_class()
        assert cls.__name__ == spec.name and issubclass(cls, _PipelineSchedule), name
        assert issubclass(cls, PipelineScheduleMulti) == spec.multi, name


def test_a_program_without_a_pipeline_does_not_import_torchs_pipelining():
    """What every generated train.py imports (`PROGRAM_IMPORTS`) leaves torch's pipelining and
    torch._dynamo (about 0.6 s of CPU per rank) to the runs that build a pipeline."""
    from autopar.codegen.program import PROGRAM_IMPORTS

    code = PROGRAM_IMPORTS + (
        "print([m for m in ('torch._dynamo', 'torch.distributed.pipelining') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("name", "style"), [("gpt-tiny", "loop"), ("gpt-tiny", "v"), ("llama-tiny", "loop")]
)
def test_chunks_keep_fqns_and_compose_to_the_model(name: str, style: str):
    model = zoo.build(name, num_layers=4)
    (ids,) = zoo.example_inputs(name, model, batch_size=2)
    want = model(ids)
    names = set(model.state_dict())
    layout = even_layout(4, pp=2, virtual_stages=2, style=style)
    chunks = {}
    for rank in range(2):
        for chunk in build_stage_modules(model, layout, rank):
            chunks[chunk.chunk] = chunk
    held = [k for c in chunks.values() for k in c.state_dict()]
    assert len(held) == len(set(held)) and set(held) == names  # every FQN once, as the model's
    h = ids
    for k in range(layout.num_chunks):
        h = chunks[k](h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)
    if name == "gpt-tiny":  # the head holds its own copy of the tied weight
        last = chunks[3]
        assert last.tied_copies == {"lm_head.weight": "tok_emb.weight"}
        assert last.lm_head.weight is not chunks[0].tok_emb.weight
        assert torch.equal(last.lm_head.weight, chunks[0].tok_emb.weight)


def test_hf_llama_chunks_compose_to_the_model():
    model = hf.build("llama-tiny-hf", num_hidden_layers=4)
    (ids,) = hf.example_inputs("llama-tiny-hf", model, batch_size=2)
    want = model(ids).logits
    layout = layout_from_sizes([1, 3], pp=2)
    first, last = (build_stage_modules(model, layout, r)[0] for r in range(2))
    assert [p for p, _ in last.named_blocks()] == [
        "model.layers.1",
        "model.layers.2",
        "model.layers.3",
    ]
    assert "model.layers.3.mlp.up_proj.weight" in last.state_dict()
    torch.testing.assert_close(last(first(ids)), want, rtol=0, atol=0)
    positions = torch.arange(ids.shape[1])
    p = parts.parts_of(model)
    assert p.blocks == "model.layers"
    torch.testing.assert_close(
        last(first(ids, positions=positions), positions=positions), want, rtol=0, atol=0
    )


def test_pipeline_slots_give_the_embedding_and_the_head_chunks_of_their_own():
    # Megatron's account_for_embedding/loss_in_pipeline_split: 2 blocks + 2 slots, 4 chunks
    layout = even_layout(2, pp=2, virtual_stages=2, slots=("embedding", "loss"))
    assert layout.bounds == ((0, 0), (0, 1), (1, 2), (2, 2))
    assert "chunk 0 no block on pp 0" in layout.as_text()
    assert even_layout(6, pp=2, slots=("embedding",)).bounds == ((0, 3), (3, 6))
    with pytest.raises(ValueError, match="4 chunks but the model has 1 blocks \\(\\+ 2 slots\\)"):
        even_layout(1, pp=2, virtual_stages=2, slots=("embedding", "loss"))
    with pytest.raises(ValueError, match="only the first and the last may be empty"):
        ChunkLayout(2, ((0, 1), (1, 1), (1, 2), (2, 3)))
    model = zoo.build("gpt-tiny", num_layers=2)  # a tied head: the last chunk's own copy
    (ids,) = zoo.example_inputs("gpt-tiny", model, batch_size=2)
    want = model(ids)
    chunks = {c.chunk: c for r in range(2) for c in build_stage_modules(model, layout, r)}
    assert "tok_emb.weight" in chunks[0].state_dict()
    assert "lm_head.weight" in chunks[3].state_dict()
    for k in (0, 3):
        assert not [name for name in chunks[k].state_dict() if name.startswith("blocks.")]
    h = ids
    for k in range(4):
        h = chunks[k](h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "dualpipe_v"])
def test_pipeline_slots_plan_and_layout_agree(schedule: str):
    """The estimator's chunks under slots are the runtime's: the plan's stages hold the
    blocks the layout puts on them, and a config the slots make possible is priced."""
    model = zoo.build("llama-tiny", device="meta", num_layers=2)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=2)
    inputs = zoo.example_inputs("llama-tiny", model)
    bare = ParallelConfig(pp=2, schedule=schedule, virtual_stages=2)
    with pytest.raises(autopar.ConfigError, match="pipeline_slots=\\('embedding', 'loss'\\)"):
        autopar.evaluate(model, cluster, bare, inputs, global_batch_size=8)
    config = ParallelConfig(
        pp=2, schedule=schedule, virtual_stages=2, pipeline_slots=("embedding", "loss")
    )
    plan = autopar.evaluate(model, cluster, config, inputs, global_batch_size=8)
    layout = layout_for(config, model, [s.layers for s in plan.stages])
    assert layout.bounds == ((0, 0), (0, 1), (1, 2), (2, 2))
    for stage in plan.stages:
        held = [
            f"layers.{i}" for k in layout.chunks_on(stage.index) for i in range(*layout.bounds[k])
        ]
        assert held == [n for n in stage.layers if n.startswith("layers.")]
    assert "embed_tokens" in plan.stages[layout.stage_of(0)].layers
    assert plan.stages[layout.stage_of(3)].layers[-1] == "lm_head"
