"""Plan: what evaluate() and parallelize() return; plain data that saves as JSON.

Invariants: every time is seconds and every size bytes; `breakdown` terms sum to
`step_time_s`; `peak_memory_bytes` is the largest stage's; the JSON carries a schema version
and loads without executing code.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.config import ParallelConfig
from autopar.errors import AutoparError

# 2: model_source (factory, kwargs, fingerprint) and cluster_fingerprint, so that a saved
# plan rebuilds its model and its program refuses another model
SCHEMA_VERSION = 2
GiB = 2**30


class PlanError(AutoparError, ValueError):
    """A plan file is corrupt, truncated or of an unknown schema version."""


@dataclass(frozen=True)
class StagePlan:
    index: int
    layers: tuple[str, ...]
    forward_s: float  # one micro-batch
    backward_s: float
    memory_bytes: dict[
        str, float
    ]  # parameters, gradients, optimizer, activations, buffers, reserve
    peak_memory_bytes: float


@dataclass(frozen=True)
class ModelSource:
    """How the generated program builds the model: ``factory`` ("module:function") called with
    ``kwargs`` (JSON values); ``fingerprint`` hashes the parameter names and shapes
    (`autopar.runtime.task.model_fingerprint`) so the program refuses a different model."""

    factory: str
    kwargs: dict[str, Any]
    fingerprint: str

    def as_text(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.factory}({args})  [fingerprint {self.fingerprint}]"


@dataclass(frozen=True)
class Plan:
    model: str
    num_params: int
    seq_len: int
    cluster: str
    num_nodes: int
    world_size: int
    memory_capacity_bytes: float
    config: ParallelConfig
    global_batch_size: int
    num_microbatches: int
    precision: str
    optimizer: str
    step_time_s: float
    peak_memory_bytes: float
    mfu: float
    breakdown: dict[str, float]
    stages: tuple[StagePlan, ...]
    alternatives: tuple[dict[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    report: dict[str, Any] = field(default_factory=dict)  # the search's figures (parallelize)
    # per repeated-layer class at the chosen tp: parameter and node placements, collectives
    placements: dict[str, Any] = field(default_factory=dict)
    # the model's factory (None: the model came with no factory; plan.save then writes no
    # program) and a hash of the cluster (profile, nodes, devices per node, world size)
    model_source: ModelSource | None = None
    cluster_fingerprint: str = ""
    schema_version: int = field(default=SCHEMA_VERSION)
    # wall-clock figures of this run (trace, search, ILP seconds): shown by summary() and
    # explain() but not saved, so the same inputs give a byte-identical plan.json
    timings: dict[str, float] = field(default_factory=dict, compare=False, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch_size * self.seq_len / self.step_time_s

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_capacity_bytes

    # ------------------------------------------------------------------ text

    def summary(self) -> str:
        cfg = self.config
        lines = [
            f"Plan for {self.model} ({self.num_params / 1e9:.2f} B params, seq {self.seq_len}) on "
            f"{self.cluster} x {self.num_nodes} = {self.world_size} devices",
            f"  config      {cfg.as_text()}",
            f"  batch       {self.global_batch_size} sequences = {self.num_microbatches} "
            f"micro-batches of {cfg.micro_batch_size} x {cfg.data_parallel_size} data-parallel",
            f"  step time   {self.step_time_s:.3f} s   MFU {self.mfu:.1%}   "
            f"{self.tokens_per_s:,.0f} tokens/s",
            f"  memory      peak {self.peak_memory_bytes / GiB:.1f} GiB of "
            f"{self.memory_capacity_bytes / GiB:.1f} GiB"
            + ("" if self.fits else "   DOES NOT FIT"),
            "",
            "  step-time breakdown:",
        ]
        for name, seconds in self.breakdown.items():
            if seconds > 0:
                share = seconds / self.step_time_s
                lines.append(f"    {name:<18} {seconds:9.4f} s  {share:6.1%}")
        lines += [
            "",
            f"  {'stage':<6} {'layers':>6} {'fwd/mb s':>10} {'bwd/mb s':>10} {'memory GiB':>11}",
        ]
        for st in self.stages:
            lines.append(
                f"  {st.index:<6} {len(st.layers):>6} {st.forward_s:10.4f} {st.backward_s:10.4f} "
                f"{st.peak_memory_bytes / GiB:11.1f}"
            )
        if self.alternatives:
            lines += ["", "  nearest alternatives:"]
            lines += [f"    {a['config']}: {a['why']}" for a in self.alternatives]
        if self.model_source is not None:
            lines.append(f"  model from  {self.model_source.as_text()}")
        lines += [f"  note: {n}" for n in self.notes]
        if self.timings:
            lines.append(
                "  planned in " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items())
            )
        return "\n".join(lines)

    def explain(self) -> str:
        terms = {k: v for k, v in self.breakdown.items() if v > 0}
        top = max(terms, key=terms.__getitem__) if terms else "none"
        worst = max(self.stages, key=lambda s: s.peak_memory_bytes)
        biggest = max(worst.memory_bytes, key=worst.memory_bytes.__getitem__)
        lines = [
            f"Bottleneck: {top} takes {terms.get(top, 0.0) / self.step_time_s:.0%} of the step.",
            f"Memory: stage {worst.index} is the fullest at {worst.peak_memory_bytes / GiB:.1f} "
            f"GiB of {self.memory_capacity_bytes / GiB:.1f} GiB; its largest part is {biggest} "
            f"({worst.memory_bytes[biggest] / GiB:.1f} GiB).",
        ]
        for alt in self.alternatives:
            lines.append(f"Alternative {alt.get('config')}: {alt.get('why', '')}")
        if self.report:
            lines.append(f"Search: {self.report.get('text', '')}")
        if self.timings:
            lines.append("Timings: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items()))
        return "\n".join(lines)

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> str:
        data = asdict(self)
        del data["timings"]  # wall clock differs run to run; the plan does not
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON (truncated or corrupt?): {e}") from None
        if not isinstance(data, dict) or "schema_version" not in data:
            raise PlanError("plan JSON has no schema_version: not an autopar plan")
        if data["schema_version"] != SCHEMA_VERSION:
            raise PlanError(
                f"plan schema version {data['schema_version']} is not the {SCHEMA_VERSION} "
                "this autopar reads; re-create the plan with this version"
            )
        try:
            data["config"] = ParallelConfig(**data["config"])
            data["stages"] = tuple(
                StagePlan(**{**s, "layers": tuple(s["layers"])}) for s in data["stages"]
            )
            data["alternatives"] = tuple(data.get("alternatives", ()))
            data["notes"] = tuple(data.get("notes", ()))
            if data.get("model_source") is not None:
                data["model_source"] = ModelSource(**data["model_source"])
            return cls(**data)
        except (KeyError, TypeError) as e:
            raise PlanError(f"plan JSON is missing or has unexpected fields: {e}") from None

    def save(self, directory: str | Path, *, program: bool = True) -> Path:
        """Write ``plan.json`` into ``directory`` (created if needed) and, when the plan knows
        its model factory and ``program`` is true, the generated ``train.py`` beside it
        (`autopar.codegen.generate`); returns the plan's path.

        Run the program with ``torchrun --nproc-per-node=N directory/train.py``.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "plan.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # never leave a half-written plan behind
        if program and self.model_source is not None:
            from autopar.codegen import generate  # codegen imports torch; plans need not

            generate(self, out)
        return path
