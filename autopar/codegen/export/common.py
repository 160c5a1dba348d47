"""What every exporter shares: the result, the header naming what the target cannot express,
the model's shape read from its config, and the few value formats the targets' files need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.estimate.goodput import goodput_interval
from autopar.plan.types import Plan


@dataclass(frozen=True)
class Priced:
    """The plan re-priced on the target's software stack (`autopar.api.export`)."""

    stack: str
    step_time_s: float
    peak_memory_bytes: float


@dataclass(frozen=True)
class Exported:
    target: str  # torchtitan, megatron, deepspeed, accelerate
    filename: str  # the file's name as written beside the plan
    text: str
    gaps: tuple[str, ...]  # what the target cannot express; also comments in the text


@dataclass(frozen=True)
class ModelShape:
    """The architecture figures a framework that builds its own model needs (Megatron)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_positions: int
    rope_theta: float | None
    norm: str  # "RMSNorm" or "LayerNorm"
    gated_mlp: bool  # SwiGLU
    tied_embeddings: bool
    bias: bool


def model_shape(config: Any) -> ModelShape | None:
    """A Hugging Face (or zoo) config's shape, when it has the decoder fields; else None."""
    get = getattr
    layers = get(config, "num_hidden_layers", None) or get(config, "n_layer", None)
    hidden = get(config, "hidden_size", None) or get(config, "n_embd", None)
    heads = get(config, "num_attention_heads", None) or get(config, "n_head", None)
    vocab = get(config, "vocab_size", None)
    if not all(isinstance(v, int) for v in (layers, hidden, heads, vocab)):
        return None
    kind = str(get(config, "model_type", ""))
    rms = hasattr(config, "rms_norm_eps")
    ffn = get(config, "intermediate_size", None) or get(config, "n_inner", None) or 4 * hidden
    positions = get(config, "max_position_embeddings", None) or get(config, "n_positions", 0)
    return ModelShape(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=int(ffn),
        num_heads=heads,
        num_kv_heads=get(config, "num_key_value_heads", None) or heads,
        vocab_size=vocab,
        max_positions=int(positions or 0),
        rope_theta=get(config, "rope_theta", None),
        norm="RMSNorm" if rms else "LayerNorm",
        gated_mlp=rms or kind in ("llama", "mistral", "qwen2", "mixtral"),
        tied_embeddings=bool(get(config, "tie_word_embeddings", False)),
        bias=bool(get(config, "attention_bias", not rms)),
    )


def header_lines(plan: Plan, target: str, gaps: list[str], priced: Priced | None) -> list[str]:
    """Comment lines (without the comment marker) that open every exported file, each one
    printable line (`one_line`). The plan's training algorithm, where it is not synchronous,
    is appended to ``gaps`` first (`training_gap`): no target's file runs it as planned; so are
    activation offload and module recompute where ``target`` does not run them."""
    gaps += training_gap(plan, target) + offload_gap(plan, target)
    if target != "Megatron-LM":
        gaps += modules_gap(plan, target)
    c = plan.config
    lines = [
        f"{target} configuration exported by autopar from the plan for {plan.model} on "
        f"{plan.cluster} x {plan.num_nodes} ({plan.world_size} devices)",
        f"plan: {c.as_text()}",
        f"autopar's prediction on its own runtime ({plan.stack}): {plan.step_time_s:.3f} s a step, "
        f"peak {plan.peak_memory_bytes / 2**30:.1f} GiB per device",
    ]
    if priced is not None:
        lines.append(
            f"re-priced on the {priced.stack} stack: {priced.step_time_s:.3f} s a step, peak "
            f"{priced.peak_memory_bytes / 2**30:.1f} GiB per device"
        )
    if gaps:
        lines.append(f"what {target} cannot express as planned:")
        lines += [f"  - {gap}" for gap in gaps]
    else:
        lines.append(f"{target} expresses every decision of the plan")
    return [one_line(line) for line in lines]


# the targets whose file writes activation offloading (Megatron-LM: --cpu-offloading-num-layers)
OFFLOADING_TARGETS = ("Megatron-LM",)


def offload_gap(plan: Plan, target: str) -> list[str]:
    """What a target that does not offload activations leaves out of a plan that does."""
    k = plan.config.offload_layers
    if not k or target in OFFLOADING_TARGETS:
        return []
    return [
        f"offload_layers={k}: {target} keeps every block's activations on the device (more "
        "activation memory than planned); autopar's train.py and Megatron-LM offload them"
    ]


def modules_gap(plan: Plan, target: str) -> list[str]:
    """What a target without Megatron's module recompute leaves out of a plan with it."""
    mods = plan.config.recompute_modules
    if not mods:
        return []
    return [
        f"recompute_modules={'+'.join(mods)}: {target} does not recompute named parts of a "
        "block (Megatron-Core's --recompute-modules); its own selective recompute keeps other "
        "activations than planned"
    ]


def training_gap(plan: Plan, target: str) -> list[str]:
    """What the exported file leaves out of a plan whose training algorithm is DiLoCo or
    fault-tolerant replica groups (`Plan.training`): the file configures one replica group's
    synchronous training; autopar's own train.py runs the algorithm over torchft."""
    chosen = plan.chosen_training
    name = chosen.get("name", "sync")
    if name == "sync":
        return []
    what = (
        f"DiLoCo over {chosen['replicas']} replica groups (H={chosen['inner_steps']}, "
        f"{chosen['fragments']} fragment(s)): this file is one group's plan"
        if name == "diloco"
        else f"{chosen['replicas']} fault-tolerant replica groups over the data-parallel axis"
    )
    where = {"torchtitan": "torchtitan's [fault_tolerance] section (torchft) can run it"}.get(
        target, f"{target} has no such algorithm"
    )
    return [f"{what}; {where}; autopar's train.py runs it (--{name}-group G --lighthouse URL)"]


def one_line(text: str) -> str:
    """``text`` as one printable line (a control character written as its escape): what a
    comment of a shell script, TOML or YAML file may hold without ending early."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


_TOML_ESCAPES = {chr(i): f"\\u{i:04X}" for i in (*range(0x20), 0x7F)} | {'"': '\\"', "\\": "\\\\"}


def toml_value(value: object) -> str:
    """A TOML value for the types the exporters write (tomllib only reads TOML, and the few
    scalar and list forms needed do not justify a dependency on a writer)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):  # a TOML basic string: quote, backslash, controls escaped
        # (not json.dumps: it writes a character beyond U+FFFF as a surrogate pair, which
        # TOML refuses)
        return '"' + "".join(_TOML_ESCAPES.get(c, c) for c in value) + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def checkpoint_interval(plan: Plan, async_save: bool) -> int | None:
    """The plan's goodput interval in steps for the save mode (`autopar.estimate.goodput`)."""
    return goodput_interval(plan.goodput, async_save)
