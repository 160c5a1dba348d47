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
from autopar.plan.check import non_finite_fields, plan_problems
from autopar.plan.files import ensure_directory, write_atomic
from autopar.plan.text import explain_text, summary_text

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
    (`autopar.models.source.model_fingerprint`) so the program refuses a different model."""

    factory: str
    kwargs: dict[str, Any]
    fingerprint: str
    # the user's loss, "module:function" called as loss(outputs, targets) -> scalar; None: the
    # factory's default (next-token cross-entropy for causal LMs)
    loss: str | None = None
    # the directory the factory's (and the loss's) top-level module imports from, put on
    # sys.path by the generated program so torchrun needs no PYTHONPATH; None: importable
    import_root: str | None = None

    def as_text(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        loss = f", loss {self.loss}" if self.loss else ""
        return f"{self.factory}({args}){loss}  [fingerprint {self.fingerprint}]"


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
    # how each mesh axis lies on the topology (`autopar.estimate.layout.mesh_axes`), and the
    # what-if re-plans (`autopar.solve.whatif.sensitivity`): data, so summary() and explain()
    # need no cluster
    mesh: tuple[dict[str, Any], ...] = ()
    sensitivity: tuple[dict[str, Any], ...] = ()
    # per stage, the collectives of one step on one of its ranks (part, kind, axis, count,
    # bytes, layer: `autopar.estimate.communication`), what the program is checked against
    communication: tuple[tuple[dict[str, Any], ...], ...] = ()
    # the software stack the plan is priced for (`autopar.estimate.stacks`)
    stack: str = "autopar"
    # goodput under failures: checkpoint and restart cost, intervals in steps for synchronous
    # and asynchronous checkpoints (`autopar.estimate.goodput.GoodputEstimate`); empty where
    # the profile has no [reliability] data and none was given
    goodput: dict[str, float] = field(default_factory=dict)
    # a mixture-of-experts model's routing as priced: MoE layers, experts, top k, parameters
    # active per token, and the load-imbalance factor the expert time and all-to-alls assume
    # (1.0: tokens spread evenly); empty for a dense model
    experts: dict[str, float] = field(default_factory=dict)
    # block linears outside the Megatron names that the trace made column ("col") or row
    # ("row") parallel and autopar's runtime splits so (`runtime.capability.traced_roles`):
    # module path -> role; empty where the names cover every split projection
    tensor_parallel_roles: dict[str, str] = field(default_factory=dict)
    # the training algorithm chosen and every one priced -- synchronous, fault-tolerant
    # replica groups, DiLoCo across sites -- with the token budget and the convergence
    # assumption (`autopar.plan.training`); empty where none was priced (evaluate)
    training: dict[str, Any] = field(default_factory=dict)
    schema_version: int = field(default=SCHEMA_VERSION)
    # wall-clock figures of this run (trace, search, ILP seconds): shown by summary() and
    # explain() but not saved, so the same inputs give a byte-identical plan.json
    timings: dict[str, float] = field(default_factory=dict, compare=False, repr=False)
    # whether the user consented to run model_source.factory: true for a plan made in this
    # process from the user's model or factory, false for one read from a file (not saved;
    # `autopar.models.source.refuse_untrusted`)
    trusted_factory: bool = field(default=False, compare=False, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch_size * self.seq_len / self.step_time_s

    @property
    def chosen_training(self) -> dict[str, Any]:
        """The training algorithm the plan chose (`training`'s "chosen": name, replicas, ...);
        empty where none was priced (`evaluate`)."""
        return self.training.get("chosen", {}) if self.training else {}

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_capacity_bytes

    # ------------------------------------------------------------------ views
    # The text views belong to this package (`autopar.plan.text`, which needs this type only
    # for annotations). plot() and save() need later phases (matplotlib, codegen and torch), so
    # they are shortcuts to the driver's `autopar.api.plot` / `autopar.api.save`, as
    # torch.Tensor's methods are to torch's functions: the data type never imports a phase.

    def summary(self) -> str:
        """One screen: config, where each mesh axis runs, step-time breakdown, MFU, stages,
        the nearest alternatives (`autopar.plan.text.summary_text`)."""
        return summary_text(self)

    def explain(self) -> str:
        """Why this plan: bottleneck, binding constraint, what each runner-up loses, and the
        sensitivity to 2x inter-node bandwidth and +50% HBM (`autopar.plan.text`)."""
        return explain_text(self)

    def plot(self, kind: str, path: str | Path) -> Path:
        """Save a PNG: ``kind`` is "pipeline" (Gantt per stage), "memory" (per stage) or
        "breakdown" (step time by term); shortcut for `autopar.api.plot` (needs matplotlib)."""
        from autopar.api import plot  # the driver: the one call back up (docs/architecture.md)

        return plot(self, kind, path)

    def save(
        self, directory: str | Path, *, program: bool = True, trust_factory: bool = False
    ) -> Path:
        """Write ``plan.json`` into ``directory`` (created if needed) and, when the plan knows
        its model factory and ``program`` is true, the generated ``train.py`` beside it;
        returns the plan's path. Shortcut for `autopar.api.save` (``trust_factory``: see it).

        Run the program with ``torchrun --nproc-per-node=N directory/train.py``.
        """
        from autopar.api import save  # the driver: the one call back up (docs/architecture.md)

        return save(self, directory, program=program, trust_factory=trust_factory)

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> str:
        """The plan as JSON (sorted keys: the same plan gives the same bytes).

        Raises:
            PlanError: a number is infinite or NaN (JSON has no such numbers; naming them).
        """
        data = asdict(self)
        del data["timings"]  # wall clock differs run to run; the plan does not
        del data["trusted_factory"]  # consent is the reader's to give, not the file's
        data["config"] = self.config.to_dict()  # recompute_layers only when set
        bad = non_finite_fields(data)
        if bad:
            raise PlanError(f"the plan holds numbers JSON cannot: {', '.join(bad)}")
        return json.dumps(data, indent=1, sort_keys=True, allow_nan=False)

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
        problems = plan_problems(data)
        if problems:
            raise PlanError("the plan is not sound: " + "; ".join(problems))
        try:
            data["config"] = ParallelConfig(**data["config"])
            data["stages"] = tuple(
                StagePlan(**{**s, "layers": tuple(s["layers"])}) for s in data["stages"]
            )
            data["alternatives"] = tuple(data.get("alternatives", ()))
            data["notes"] = tuple(data.get("notes", ()))
            data["mesh"] = tuple(data.get("mesh", ()))
            data["sensitivity"] = tuple(data.get("sensitivity", ()))
            data["communication"] = tuple(tuple(s) for s in data.get("communication", ()))
            if data.get("model_source") is not None:
                data["model_source"] = ModelSource(**data["model_source"])
            return cls(**data)
        except (KeyError, TypeError) as e:
            raise PlanError(f"plan JSON is missing or has unexpected fields: {e}") from None

    def write_json(self, directory: str | Path) -> Path:
        """Write only ``plan.json`` into ``directory`` (created if needed), atomically: a
        reader sees the old file or the new one, never half of it. Returns its path."""
        return write_atomic(ensure_directory(directory) / "plan.json", self.to_json())
