"""`--config` text: every config the tool prints (`ParallelConfig.as_text`) parses back to an
equal config, the key=value spelling still works, and bad text names the bad item."""

from __future__ import annotations

import pytest

from autopar.config import ParallelConfig
from autopar.config.text import parse_config
from autopar.errors import AutoparError, ConfigError
from autopar.solve.space import (
    SpaceLimits,
    axis_orders,
    degree_choices,
    inner_choices,
    recompute_layer_choices,
)

HAND_MADE = [
    ParallelConfig(),
    ParallelConfig(
        tp=8, pp=4, schedule="interleaved_1f1b", virtual_stages=2, sequence_parallel=True
    ),
    ParallelConfig(fsdp=4, zero_stage=3, recompute="full", recompute_layers=3),
    ParallelConfig(dp=2, fsdp=2, zero_stage=1, recompute="selective", recompute_layers=1),
    ParallelConfig(pp=2, schedule="dualpipe_v", virtual_stages=2, micro_batch_size=4),
    ParallelConfig(dp=4, tp=2, cp=2, ep=4, recompute="full", axis_order=("fsdp", "tp", "cp", "dp")),
    ParallelConfig(fsdp=2, tp=2, zero_stage=2, axis_order=("fsdp", "tp", "cp", "dp")),
    ParallelConfig(pp=4, schedule="gpipe", recompute="full", recompute_layers=12),
    ParallelConfig(pp=2, schedule="1f1b", pipeline_slots=("loss",)),
    ParallelConfig(tp=4, sequence_parallel=True, async_tp=True, offload_layers=3),
    ParallelConfig(tp=2, recompute="selective", recompute_modules=("mlp", "layernorm")),
]


def _searched() -> list[ParallelConfig]:
    """Every config the search prices for a small MoE model with long sequences on 8
    devices (so cp, ep, pp schedules, axis orders and per-layer recompute all appear)."""
    lim = SpaceLimits(
        recompute_modules=(("moe_act", "layernorm"), ("moe",)),
        world_size=8,
        devices_per_node=4,
        num_blocks=4,
        num_heads=4,
        seq_len=16384,
        num_experts=2,
        global_batch_size=16,
        micro_batch_sizes=(1, 2),
    )
    out = []
    for degrees in degree_choices(lim):
        for order in axis_orders(degrees):
            for cfg in inner_choices(lim, degrees, order):
                out.append(cfg)
                out += [
                    ParallelConfig(**{**cfg.__dict__, "recompute_layers": k})
                    for k in recompute_layer_choices(lim, cfg)
                ]
    return out


def test_printed_configs_parse_back_equal() -> None:
    configs = HAND_MADE + _searched()
    assert len(configs) > 1000
    seen = {"order=", "recompute=full:", "+sp", "v=2", "dualpipe_v", "ep=2", "slots=embedding+loss",
            "modules=moe_act+layernorm"}  # fmt: skip
    texts = [cfg.as_text() for cfg in configs]
    assert all(any(s in t for t in texts) for s in seen)  # the space covers every form
    for cfg, text in zip(configs, texts, strict=True):
        assert parse_config(text) == cfg, text


def test_key_value_spellings() -> None:
    cfg = parse_config("tp=8,pp=4,schedule=interleaved_1f1b,v=2,sp=on,zero=1,fsdp=2,mbs=2")
    assert (cfg.tp, cfg.pp, cfg.virtual_stages, cfg.zero_stage) == (8, 4, 2, 1)
    assert cfg.sequence_parallel and cfg.micro_batch_size == 2
    want = ParallelConfig(fsdp=2, zero_stage=3, recompute="full", recompute_layers=3)
    assert parse_config("fsdp=2,zero=3,recompute=full,recompute_layers=3") == want
    assert parse_config("fsdp=2, zero_stage=3, recompute=full:3") == want
    order = ("fsdp", "tp", "cp", "dp")
    assert parse_config("fsdp=2,tp=2,zero=1,axis_order=fsdp,tp,cp,dp").axis_order == order
    assert parse_config("fsdp=2 tp=2 zero=1 order=fsdp,tp,cp,dp mbs=2").micro_batch_size == 2
    assert parse_config("tp=2,order=tp,cp,fsdp,dp").axis_order is None  # the default order


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tp=eight", "'tp=eight': 'eight' is not an integer"),
        ("", "empty"),
        ("bogus=1", "'bogus=1' is not key=value"),
        ("tp=2,1f1bb", "'1f1bb' is neither key=value nor a schedule"),
        ("recompute=fulll", "'recompute=fulll': 'fulll' is not one of none, selective, full"),
        ("recompute=full:x", "'recompute=full:x': 'x' is not an integer"),
        ("recompute=full:2,recompute_layers=2", "sets recompute_layers a second time"),
        ("schedule=pipedream", "'pipedream' is not one of gpipe"),
        ("tp=2,sp=maybe", "'sp=maybe': sequence_parallel wants true or false"),
        ("tp=2,order=tp,cp,dp", "axis_order must list dp, fsdp, cp and tp once each"),
        ("tp=2,order=tp,cp,xp,dp", "'xp' is neither key=value"),
        ("recompute=none:2", "recompute_layers=2 needs recompute full or selective"),
        ("fsdp=2", "fsdp=2 shards nothing with zero_stage=0"),
        ("pp=1 slots=embedding", "pipeline_slots=('embedding',) needs pp > 1"),
        ("pp=2 slots=loss+embedding", "pipeline_slots must be one of (), ('embedding',)"),
        ("modules=mlp", "recompute_modules=mlp needs recompute=selective"),
        ("recompute=selective modules=mlp+attn", "recompute_modules must name parts of"),
        ("recompute=selective modules=moe+moe_act", "moe re-runs the whole MoE layer"),
        ("recompute=selective:2 modules=mlp", "Megatron recomputes named modules in every block"),
    ],
)
def test_bad_text_names_the_bad_item(text: str, message: str) -> None:
    with pytest.raises(AutoparError) as e:
        parse_config(text)
    assert message in str(e.value)


def test_rule_violations_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="--config 'pp=1 v=2 interleaved_1f1b'"):
        parse_config("pp=1 v=2 interleaved_1f1b")
