"""Parse a ParallelConfig from the command line's ``--config`` text.

In: a string in either of two spellings, or a mix of them,

    tp=8,pp=4,schedule=interleaved_1f1b,v=2,sp=1,recompute=full,recompute_layers=3
    dp=1 fsdp=1 cp=1 tp=8 pp=4 ep=1 | zero=0 mbs=1 interleaved_1f1b v=2 recompute=full:3 +sp

(the second is `ParallelConfig.as_text`, what plan summaries, `compare`, `explain` and the
alternatives print). Out: the ParallelConfig, checked by `ParallelConfig.validate` (without a
cluster). Invariant: ``parse_config(cfg.as_text()) == cfg`` for every valid config.

Grammar: items separated by commas, spaces or ``|``; an item is ``key=value`` (a field name or
a short name: zero, mbs, v, sp, order, slots, offload, cp_attn, modules), a bare schedule name,
``+sp`` or ``+async_tp``.
``recompute`` takes ``policy`` or ``policy:k`` (k = recompute_layers). ``order`` /
``axis_order`` take the four axes innermost first, joined by commas (``order=fsdp,tp,cp,dp``):
the axis names after it continue it. ``slots`` / ``pipeline_slots`` take ``embedding``,
``loss`` or ``embedding+loss``; ``modules`` / ``recompute_modules`` the parts of a block
selective recompute re-runs, joined by ``+`` (``modules=mlp+layernorm``).
Every error names the item it could not read.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from autopar.config.parallel import (
    CP_ATTENTION,
    DEFAULT_AXIS_ORDER,
    RECOMPUTE,
    SCHEDULES,
    ParallelConfig,
)
from autopar.errors import AutoparError, ConfigError

ALIASES = {"zero": "zero_stage", "mbs": "micro_batch_size", "v": "virtual_stages",
           "sp": "sequence_parallel", "order": "axis_order",
           "slots": "pipeline_slots", "offload": "offload_layers",
           "cp_attn": "cp_attention", "modules": "recompute_modules"}  # fmt: skip
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
_SEPARATORS = str.maketrans({",": " ", "|": " "})


def parse_config(text: str) -> ParallelConfig:
    """``"tp=8,pp=4,schedule=interleaved_1f1b,v=2,sp=1"`` or a config's `as_text()` ->
    ParallelConfig.

    >>> parse_config("tp=2 pp=2 | zero=0 mbs=1 gpipe recompute=full:1").recompute_layers
    1

    Raises:
        AutoparError: an unknown key or bare word, a key given twice, a value of the wrong
            type (each message quotes the item); ConfigError: the fields break a rule of
            `ParallelConfig.problems`.
    """
    values: dict[str, Any] = {}
    order: list[str] | None = None  # the axis_order being read, while its axes follow
    for item in text.translate(_SEPARATORS).split():
        key, sep, raw = item.partition("=")
        if not sep:
            if order is not None and item in DEFAULT_AXIS_ORDER:
                order.append(item)
                continue
            order = None
            if item in SCHEDULES:
                _put(values, "schedule", item, item)
            elif item == "+sp":
                _put(values, "sequence_parallel", True, item)
            elif item == "+async_tp":
                _put(values, "async_tp", True, item)
            else:
                raise AutoparError(
                    f"--config: {item!r} is neither key=value nor a schedule "
                    f"({', '.join(SCHEDULES)}) nor +sp nor +async_tp"
                )
            continue
        order = None
        key = ALIASES.get(key, key)
        if key not in _FIELDS:
            known = ", ".join([*_FIELDS, *ALIASES])
            raise AutoparError(f"--config: {item!r} is not key=value with a key of: {known}")
        if key == "axis_order":
            order = [raw]
            _put(values, key, order, item)
        elif key == "recompute":
            policy, colon, layers = raw.partition(":")
            _put(values, key, _choice(policy, RECOMPUTE, item), item)
            if colon:
                _put(values, "recompute_layers", _integer(layers, item), item)
        elif key == "schedule":
            _put(values, key, _choice(raw, SCHEDULES, item), item)
        elif key == "cp_attention":
            _put(values, key, _choice(raw, CP_ATTENTION, item), item)
        elif key in ("pipeline_slots", "recompute_modules"):  # a+b, a, or none
            _put(values, key, () if raw == "none" else tuple(raw.split("+")), item)
        elif key in ("sequence_parallel", "async_tp"):
            if raw.lower() not in _TRUE + _FALSE:
                raise AutoparError(f"--config: {item!r}: {key} wants true or false")
            _put(values, key, raw.lower() in _TRUE, item)
        elif key == "recompute_layers" and raw.lower() == "none":
            _put(values, key, None, item)
        else:
            _put(values, key, _integer(raw, item), item)
    if not values:
        raise AutoparError("--config is empty: give e.g. tp=8,pp=2")
    if "axis_order" in values:
        values["axis_order"] = tuple(values["axis_order"])
    config = ParallelConfig(**values)
    problems = config.problems()
    if problems:
        raise ConfigError(f"--config {text!r}:\n  - " + "\n  - ".join(problems))
    return config


_FIELDS = tuple(f.name for f in fields(ParallelConfig))


def _put(values: dict[str, Any], key: str, value: Any, item: str) -> None:
    if key in values:
        raise AutoparError(f"--config: {item!r} sets {key} a second time")
    values[key] = value


def _integer(raw: str, item: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise AutoparError(f"--config: {item!r}: {raw!r} is not an integer") from None


def _choice(raw: str, choices: tuple[str, ...], item: str) -> str:
    if raw not in choices:
        raise AutoparError(f"--config: {item!r}: {raw!r} is not one of {', '.join(choices)}")
    return raw
