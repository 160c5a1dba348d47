"""A plan's JSON checked before it becomes a Plan: types, ranges and the plan's own invariants.

In: the dict `json.loads` made of a plan file. Out: the list of problems, each naming its field
(``stages[1].forward_s``) and the value; empty for a sound plan. `Plan.from_json` refuses a plan
with any, so a hand-edited or damaged file stops at load with its field named instead of deep
in a printout, a comparison or a generated program.

Checked:
- every field has its type (an integer is not a string, a boolean or a float), every number is
  finite, times and sizes are >= 0, the step time and the capacity > 0;
- the config is a ParallelConfig that passes its own rules, and its degrees multiply to the
  plan's world size; the global batch is micro-batch size x micro-batches x data-parallel
  ranks; there is one stage per pipeline rank, each with its layers, and the plan's peak
  memory is its fullest stage's;
- on a shipped hardware profile, the config against the cluster the plan names (its nodes
  and devices per node: `ParallelConfig.validate`; not a TPU slice, whose shape the plan
  does not record);
- the records in its lists and report (mesh axes, communication, alternatives, sensitivity,
  refine's candidates) typed as the printouts read them: names strings, counts integers,
  times and bytes numbers, configs as plans print them (`_records`, `_field`);
- every string and key is one printable line of at most `MAX_TEXT` characters (a newline in a
  model's name would end a comment of the generated program or a line of an exported shell
  script), and the stack is a name.
"""

from __future__ import annotations

import math
import re
from typing import Any

from autopar.config import ParallelConfig
from autopar.config.precision import PRECISIONS
from autopar.config.text import parse_config
from autopar.errors import AutoparError
from autopar.hardware import Cluster, shipped_profile_names
from autopar.hardware.cluster import cluster_fingerprint, priced_sites
from autopar.hardware.profile import load_profile

_INTEGERS = {"num_params": 0, "seq_len": 1, "num_nodes": 1, "world_size": 1}
_INTEGERS |= {"global_batch_size": 1, "num_microbatches": 1, "schema_version": 1}
_STRINGS = ("model", "cluster", "optimizer", "cluster_fingerprint", "stack")
# the longest string a plan file may hold (a model's name, a layer's path, a note)
MAX_TEXT = 4096
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# number fields: the smallest value allowed, and whether it must be exceeded
_NUMBERS = {"memory_capacity_bytes": True, "step_time_s": True}
_NUMBERS |= {"peak_memory_bytes": False, "mfu": False}


def plan_problems(data: dict[str, Any]) -> list[str]:
    """Every problem of a plan's JSON (module docstring); [] when it is sound."""
    out: list[str] = []
    for name, least in _INTEGERS.items():
        value = data.get(name)
        if not _is_int(value) or value < least:
            out.append(f"{name} must be an integer >= {least}, got {value!r}")
    for name in _STRINGS:
        if name in data and not isinstance(data[name], str):
            out.append(f"{name} must be a string, got {data[name]!r}")
    for name, strict in _NUMBERS.items():
        out += _number(name, data.get(name), strict)
    if data.get("precision") not in PRECISIONS:
        out.append(
            f"precision must be one of {', '.join(PRECISIONS)}, got {data.get('precision')!r}"
        )
    out += _mapping_of_numbers("breakdown", data.get("breakdown"))
    config, problems = _config(data.get("config"))
    out += problems
    if config is not None and not out:
        out += _against_plan(data, config)
    out += _stages(data.get("stages"), config, data.get("peak_memory_bytes"))
    out += _model_source(data.get("model_source"))
    for name in ("alternatives", "notes", "mesh", "sensitivity", "communication"):
        if name in data and not isinstance(data[name], list):
            out.append(f"{name} must be a list, got {type(data[name]).__name__}")
        elif name in data:
            out += _records(name, data[name])
    if data.get("goodput"):
        out += _mapping_of_numbers("goodput", data["goodput"])
        for key, value in data["goodput"].items():  # a checkpoint interval is whole steps
            if (
                key.endswith("interval_steps")
                and isinstance(value, int | float)
                and not (value >= 1 and float(value).is_integer())
            ):
                out.append(f"goodput.{key} must be a whole number of steps >= 1, got {value!r}")
    if data.get("experts"):
        out += _mapping_of_numbers("experts", data["experts"])
    for name in ("report", "placements", "tensor_parallel_roles", "training"):
        if name in data and not isinstance(data[name], dict):
            out.append(f"{name} must be an object, got {type(data[name]).__name__}")
    if isinstance(data.get("report"), dict):  # the search's and refine's records
        out += _fields("report", data["report"])
    if isinstance(data.get("training"), dict):  # the algorithms priced (plan.training)
        out += _fields("training", data["training"])
    out += free_text_problems(data)
    if isinstance(data.get("stack"), str) and not _NAME.fullmatch(data["stack"]):
        out.append(f"stack must be a stack's name (letters, digits, . _ -), got {data['stack']!r}")
    return out


def free_text_problems(value: Any, path: str = "plan") -> list[str]:
    """Every string (and key) in ``value`` that is not one printable line of at most
    `MAX_TEXT` characters: what a plan file may carry into a generated program's comments and
    docstring, an exported shell script, TOML or YAML (each also escapes what it writes)."""
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            return [f"{path} is {len(value)} characters long; at most {MAX_TEXT}"]
        if not value.isprintable():
            bad = next(c for c in value if not c.isprintable())
            return [f"{path} holds the control character {bad!r}: one printable line only"]
        return []
    if isinstance(value, dict):
        return [
            p
            for k, v in value.items()
            for p in free_text_problems(k, f"{path} key") + free_text_problems(v, _at(path, k))
        ]
    if isinstance(value, list | tuple):
        return [p for i, v in enumerate(value) for p in free_text_problems(v, f"{path}[{i}]")]
    return []


def _at(path: str, key: Any) -> str:
    """The path of ``key`` below ``path``: ``.key``, or ``[repr]`` where the key is not a plain
    name (a key holding a newline or quotes stays inside the one-line message)."""
    plain = isinstance(key, str) and key.replace("_", "a").replace("-", "a").isalnum()
    return f"{path}.{key}" if plain else f"{path}[{key!r}]"


def non_finite_fields(value: Any, path: str = "plan") -> list[str]:
    """The paths of infinite or NaN numbers inside ``value`` (nested dicts, lists, tuples)."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [f"{path} = {value!r}"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_finite_fields(v, _at(path, k))]
    if isinstance(value, list | tuple):
        return [p for i, v in enumerate(value) for p in non_finite_fields(v, f"{path}[{i}]")]
    return []


def _torus(profile: str) -> bool:
    return load_profile(profile).torus is not None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value: Any, strict: bool) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return [f"{name} must be a number, got {value!r}"]
    if not math.isfinite(value):
        return [f"{name} must be finite, got {value!r}"]
    if value < 0 or (strict and value == 0):
        return [f"{name} must be {'> 0' if strict else '>= 0'}, got {value!r}"]
    return []


def _mapping_of_numbers(name: str, value: Any) -> list[str]:
    if not isinstance(value, dict):
        return [f"{name} must be an object of numbers, got {value!r}"]
    return [p for k, v in value.items() for p in _number(_at(name, k), v, strict=False)]


# the fields of the records in a plan's lists (mesh axes, communication, alternatives,
# sensitivity): each read by the plan's printouts as its type
_RECORD_STRINGS = frozenset({"axis", "level", "kind", "layer", "part", "config", "why", "what",
                             "skipped"})  # fmt: skip
_RECORD_INTEGERS = frozenset({"size", "num_nodes", "domain_devices", "count"})
_RECORD_NUMBER_ENDS = ("_s", "bytes", "_per_s", "_ratio", "speedup")


def _records(name: str, items: list) -> list[str]:
    """The items of a plan's list field, typed as the printouts read them: notes are strings;
    the others records (a communication entry: a list of records per stage)."""
    out: list[str] = []
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        if name == "notes":
            if not isinstance(item, str):
                out.append(f"{where} must be a string, got {item!r}")
        elif isinstance(item, list) and name == "communication":
            out += _records(where, item)
        elif not isinstance(item, dict):
            out.append(f"{where} must be an object, got {item!r}")
        else:
            out += _fields(where, item)
    return out


def _fields(where: str, record: dict) -> list[str]:
    return [p for key, value in record.items() for p in _field(_at(where, key), key, value)]


def _field(where: str, key: Any, value: Any) -> list[str]:
    if key == "config" and isinstance(value, str):  # read back by the printouts: as printed
        try:
            printed = parse_config(value).as_text()
        except AutoparError:
            printed = None
        ok = printed == value
        return [] if ok else [f"{where} must be a config as plans print it, got {value!r}"]
    if key in _RECORD_STRINGS:
        return [] if isinstance(value, str) else [f"{where} must be a string, got {value!r}"]
    if key in _RECORD_INTEGERS:
        ok = _is_int(value) and value >= 0
        return [] if ok else [f"{where} must be an integer >= 0, got {value!r}"]
    if key == "ranks":
        ok = isinstance(value, list) and all(_is_int(r) and r >= 0 for r in value)
        return [] if ok else [f"{where} must be a list of ranks, got {value!r}"]
    if key == "breakdown":
        return _mapping_of_numbers(where, value)
    if isinstance(key, str) and key.endswith(_RECORD_NUMBER_ENDS):
        return _number(where, value, strict=False)
    if isinstance(value, dict):  # a nested record (a plan's report)
        return _fields(where, value)
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _field(f"{where}[{i}]", key, v)]
    return []


def _config(value: Any) -> tuple[ParallelConfig | None, list[str]]:
    if not isinstance(value, dict):
        return None, [f"config must be an object, got {value!r}"]
    kinds = {"schedule": str, "recompute": str, "sequence_parallel": bool, "async_tp": bool,
             "cp_attention": str, "pipeline_slots": list, "recompute_modules": list}  # fmt: skip
    for key, raw in value.items():
        if key == "axis_order" or (key == "recompute_layers" and raw is None):
            continue
        kind = kinds.get(key, int)
        if kind is int and not _is_int(raw) or kind is not int and not isinstance(raw, kind):
            return None, [f"config.{key} must be {kind.__name__}, got {raw!r}"]
    try:
        config = ParallelConfig(**value)
    except TypeError as e:
        return None, [f"config has an unknown or missing field: {e}"]
    problems = [f"config: {p}" for p in config.problems()]
    return (None if problems else config), problems


def _against_plan(data: dict[str, Any], config: ParallelConfig) -> list[str]:
    out = []
    world, nodes = data["world_size"], data["num_nodes"]
    if config.world_size != world:
        out.append(
            f"config {config.as_text()} runs on {config.world_size} devices "
            f"(dp x fsdp x cp x tp x pp), but the plan's world_size is {world}"
        )
    if world % nodes:
        out.append(f"world_size={world} is not a multiple of num_nodes={nodes}")
    per_step = config.micro_batch_size * data["num_microbatches"] * config.data_parallel_size
    if per_step != data["global_batch_size"]:
        out.append(
            f"global_batch_size={data['global_batch_size']} is not micro_batch_size="
            f"{config.micro_batch_size} x num_microbatches={data['num_microbatches']} x "
            f"dp x fsdp={config.data_parallel_size} = {per_step}"
        )
    # a TPU slice's shape is not in the plan file: its config is checked when it is made
    if not out and data["cluster"] in shipped_profile_names() and not _torus(data["cluster"]):
        try:
            cluster = Cluster.from_profile(data["cluster"], nodes, devices_per_node=world // nodes)
            out += [f"config on {data['cluster']}: {p}" for p in config.problems(cluster)]
        except AutoparError as e:
            out.append(f"cluster {data['cluster']} x {nodes} nodes of {world // nodes}: {e}")
    recorded = data.get("cluster_fingerprint")
    named = data.get("cluster")
    sites = _own_sites(data)
    if (
        not out
        and recorded
        and isinstance(named, str)
        and cluster_fingerprint(named, nodes, world // nodes, sites) != recorded
    ):
        over = " over {} sites joined by {:g} Gb/s ({:g} s)".format(*sites) if sites[0] > 1 else ""
        out.append(
            f"cluster {named!r} x {nodes} nodes of {world // nodes}{over} is not the cluster the "
            f"plan was priced on (cluster_fingerprint {recorded!r}): re-plan for it (autopar "
            "replan, or autopar plan)"
        )
    return out


def _own_sites(data: dict[str, Any]) -> tuple[int, float, float]:
    """The sites of the cluster the plan was priced on, from its training record (a record
    the file's checks refuse counts as none: that is said where the record is checked)."""
    try:
        return priced_sites(data.get("training"), own=True)
    except (AttributeError, TypeError, ValueError, KeyError):
        return 1, 0.0, 0.0


def _stages(value: Any, config: ParallelConfig | None, peak: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        return [f"stages must be a non-empty list, got {value!r}"]
    out = []
    if config is not None and len(value) != config.pp:
        out.append(f"stages: {len(value)} given, but pp={config.pp} needs one per pipeline rank")
    for i, stage in enumerate(value):
        where = f"stages[{i}]"
        if not isinstance(stage, dict):
            out.append(f"{where} must be an object, got {stage!r}")
            continue
        if stage.get("index") != i:
            out.append(f"{where}.index must be {i}, got {stage.get('index')!r}")
        layers = stage.get("layers")
        if (
            not isinstance(layers, list)
            or not layers
            or not all(isinstance(x, str) for x in layers)
        ):
            out.append(f"{where}.layers must be a non-empty list of layer names, got {layers!r}")
        for name in ("forward_s", "backward_s", "peak_memory_bytes"):
            out += _number(f"{where}.{name}", stage.get(name), strict=False)
        out += _mapping_of_numbers(f"{where}.memory_bytes", stage.get("memory_bytes"))
    peaks = [s.get("peak_memory_bytes") for s in value if isinstance(s, dict)]
    if not out and isinstance(peak, int | float) and not math.isclose(peak, max(peaks)):
        out.append(f"peak_memory_bytes={peak!r} is not the fullest stage's, {max(peaks)!r}")
    return out


def _model_source(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, dict):
        return [f"model_source must be an object or null, got {value!r}"]
    factory = value.get("factory")
    out = []
    if not isinstance(factory, str) or ":" not in factory:
        out.append(f"model_source.factory must be 'module:function', got {factory!r}")
    if not isinstance(value.get("kwargs"), dict):
        out.append(f"model_source.kwargs must be an object, got {value.get('kwargs')!r}")
    if not isinstance(value.get("fingerprint"), str):
        out.append(f"model_source.fingerprint must be a string, got {value.get('fingerprint')!r}")
    loss = value.get("loss")
    if loss is not None and (not isinstance(loss, str) or ":" not in loss):
        out.append(f"model_source.loss must be 'module:function' or null, got {loss!r}")
    root = value.get("import_root")
    if root is not None and not isinstance(root, str):
        out.append(f"model_source.import_root must be a path or null, got {root!r}")
    return out
