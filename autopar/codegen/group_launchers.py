"""Launchers for a plan whose training runs in replica groups over torchft.

In: a Plan whose `training` record chose fault-tolerant replica groups ("ft") or DiLoCo across
sites ("diloco"). Out: the text of launch.sbatch and pytorchjob.yaml (`launchers`) that start
torchft's lighthouse and each group as its own torchrun job.

    ft       one Slurm job over the plan's nodes: the lighthouse on the first node, then each
             of the M groups on its 1/M of the nodes (or, on one node, its 1/M of the devices)
             with its own rendezvous, restarted alone by torchrun when one of its ranks dies,
             and healed from a peer group (`autopar.runtime.fault_tolerance`); on Kubernetes a
             lighthouse Deployment and Service and one PyTorchJob per group
    diloco   the plan is one site's group: the same script at every site, GROUP=g; site 0's
             starts the lighthouse on its first node and prints its address, the others are
             given it (LIGHTHOUSE=http://HOST:PORT); on Kubernetes the lighthouse is applied
             at one site and every site's job is given its address

Timeouts, ordered as torchft needs them (`runtime.replica_groups.ft_timeouts`): a collective
with a dead group fails after --ft-timeout (at least 3 planned steps, 30 s at least), before the
quorum gives up and long before a group's first connection does.

Checkpoints: every group passes --checkpoint-dir and --checkpoint-every auto, as the one-job
launchers do; each group saves under its own group<g>/ there (`runtime.replicas`).
Fault-tolerant groups: a job started again resumes from the newest any group holds; a group
that dies alone heals from a live one, so the checkpoints only matter when every group is down
at once. DiLoCo: each site's group saves its outer state beside its weights, on outer steps,
so the sites started again resume together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.plan.types import Plan

LIGHTHOUSE_PORT = 29510
RDZV_PORT = 29500
MAX_RESTARTS = 3


@dataclass(frozen=True)
class Groups:
    """How a plan's replica groups lie on its nodes."""

    kind: str  # "ft" | "diloco"
    count: int
    nodes: int  # nodes of one group's job
    procs: int  # processes per node of one group's job
    shared_node: bool  # the groups share one node, each on its slice of the devices
    timeout_s: float  # --ft-timeout

    @property
    def min_replicas(self) -> int:
        """The lighthouse's quorum floor: one live group steps on (ft); DiLoCo's outer step
        waits for every site."""
        return 1 if self.kind == "ft" else self.count


def replica_groups(plan: Plan) -> Groups | None:
    """The plan's groups, or None where it trains as one synchronous job.

    Raises:
        ValueError: fault-tolerant groups that split neither the nodes nor one node's devices
            evenly (the message says to start each group by hand).
    """
    chosen = plan.chosen_training
    kind, count = chosen.get("name"), int(chosen.get("replicas", 1))
    if kind not in ("ft", "diloco") or count < 2:
        return None
    per_node = plan.world_size // plan.num_nodes
    timeout = max(30.0, math.ceil(3 * plan.step_time_s))
    if kind == "diloco":  # the plan is one site's: every site runs all of it
        return Groups(kind, count, plan.num_nodes, per_node, False, timeout)
    if plan.num_nodes % count == 0:
        return Groups(kind, count, plan.num_nodes // count, per_node, False, timeout)
    if plan.num_nodes == 1 and per_node % count == 0:
        return Groups(kind, count, 1, per_node // count, True, timeout)
    raise ValueError(
        f"{count} fault-tolerant groups split neither the plan's {plan.num_nodes} nodes nor "
        f"one node's {per_node} devices evenly: start each group by hand (train.py's "
        "docstring: torchft_lighthouse, then one torchrun per group with --ft-group G)"
    )


def _lighthouse_command(groups: Groups, port: str, quote: str = '"') -> str:
    return (
        f"torchft_lighthouse --min_replicas {groups.min_replicas} --quorum_tick_ms 100 "
        f"--join_timeout_ms 10000 --bind {quote}[::]:{port}{quote}"
    )


def _group_flags(groups: Groups, index: str, lighthouse: str, checkpoints: str) -> str:
    # every group: torchft's lighthouse, and its own checkpoints under the directory
    common = f'--lighthouse "{lighthouse}" --checkpoint-dir "{checkpoints}" --checkpoint-every auto'
    if groups.kind == "ft":
        return (
            f'--ft-group "{index}" --ft-groups {groups.count} --ft-timeout '
            f"{groups.timeout_s:g} {common}"
        )
    return f'--diloco-group "{index}" --diloco-groups {groups.count} {common}'


def slurm_lines(groups: Groups, uses_gpus: bool) -> list[str]:
    """The body of launch.sbatch after its #SBATCH lines (module docstring). Ports come from
    LIGHTHOUSE_PORT and RDZV_PORT where set (group g's rendezvous: RDZV_PORT + g)."""
    lines = [
        "set -euo pipefail",
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"lighthouse_port=${{LIGHTHOUSE_PORT:-{LIGHTHOUSE_PORT}}}",
        f"rdzv_port=${{RDZV_PORT:-{RDZV_PORT}}}",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
    ]
    start = [
        "# torchft's lighthouse on the first node: each step's quorum of the groups alive",
        'srun --nodes=1 --ntasks=1 --overlap --nodelist="${nodes[0]}" '
        + _lighthouse_command(groups, "$lighthouse_port")
        + " &",
        "lighthouse_pid=$!",
        "trap 'kill $lighthouse_pid 2>/dev/null || true' EXIT",
    ]
    flags = _group_flags(groups, "$g", "$lighthouse", "$SLURM_SUBMIT_DIR/checkpoints")
    run = (
        f"srun --nodes={groups.nodes} --ntasks={groups.nodes} --ntasks-per-node=1 --overlap "
        '--nodelist="$group_nodes" $devices torchrun --nnodes '
        f"{groups.nodes} --nproc-per-node {groups.procs} --rdzv-backend c10d "
        '--rdzv-endpoint "${nodes[$first]}:$((rdzv_port + g))" '
        f'--rdzv-id "$SLURM_JOB_ID-g$g" --max-restarts {MAX_RESTARTS} '
        '"$SLURM_SUBMIT_DIR/train.py" ' + flags + ' "$@"'
    )
    slice_devices = (
        'devices="env CUDA_VISIBLE_DEVICES=$(seq -s, $((g * '
        f'{groups.procs})) $((g * {groups.procs} + {groups.procs - 1})))"'
    )
    if groups.kind == "diloco":
        return [
            *lines,
            "g=${GROUP:-0}  # this site's group: 0 .. " + str(groups.count - 1),
            "lighthouse=${LIGHTHOUSE:-}",
            'if [ -z "$lighthouse" ]; then',
            '    if [ "$g" != 0 ]; then',
            '        echo "GROUP=$g needs LIGHTHOUSE=http://HOST:PORT (what site 0 printed)" >&2',
            "        exit 2",
            "    fi",
            *("    " + x for x in start),
            '    lighthouse="http://${nodes[0]}:$lighthouse_port"',
            '    echo "lighthouse: $lighthouse (the other sites: LIGHTHOUSE=$lighthouse '
            'GROUP=g sbatch launch.sbatch)"',
            "fi",
            "first=0",
            'group_nodes=$(IFS=,; echo "${nodes[*]}")',
            'devices=""',
            run,
        ]
    return [
        *lines,
        *start,
        'lighthouse="http://${nodes[0]}:$lighthouse_port"',
        "pids=()",
        f"for g in $(seq 0 {groups.count - 1}); do",
        f"    first={0 if groups.shared_node else f'$((g * {groups.nodes}))'}",
        f'    group_nodes=$(IFS=,; echo "${{nodes[*]:$first:{groups.nodes}}}")',
        "    " + (slice_devices if groups.shared_node and uses_gpus else 'devices=""'),
        "    " + run + " &",
        "    pids+=($!)",
        "done",
        "status=0",
        'for pid in "${pids[@]}"; do wait "$pid" || status=$?; done',
        'exit "$status"',
    ]


def kubernetes_documents(
    groups: Groups, name: str, replica, per_node_limit: str
) -> list[list[str]]:
    """The YAML documents of pytorchjob.yaml (module docstring), each a list of lines;
    ``replica(role, count, command, limit)`` writes one PyTorchJob replica spec."""
    service = f"{name}-lighthouse"
    url = f"http://{service}:{LIGHTHOUSE_PORT}"
    serve = _lighthouse_command(groups, str(LIGHTHOUSE_PORT), quote="'")
    lighthouse = [
        [
            "# torchft's lighthouse: each step's quorum of the groups alive"
            + (
                " (apply it at one site; give the others its address)"
                if groups.kind == "diloco"
                else ""
            ),  # fmt: skip
            "apiVersion: apps/v1",
            "kind: Deployment",
            "metadata:",
            f"  name: {service}",
            "spec:",
            "  replicas: 1",
            "  selector:",
            f"    matchLabels: {{app: {service}}}",
            "  template:",
            "    metadata:",
            f"      labels: {{app: {service}}}",
            "    spec:",
            "      containers:",
            "        - name: lighthouse",
            "          image: your-registry/your-training-image:tag  # holds torchft",
            f'          command: ["bash", "-c", "{serve}"]',
            f"          ports: [{{containerPort: {LIGHTHOUSE_PORT}}}]",
        ],
        [
            "apiVersion: v1",
            "kind: Service",
            "metadata:",
            f"  name: {service}",
            "spec:",
            f"  selector: {{app: {service}}}",
            f"  ports: [{{port: {LIGHTHOUSE_PORT}, targetPort: {LIGHTHOUSE_PORT}}}]",
        ],
    ]
    jobs = []
    indices = range(groups.count) if groups.kind == "ft" else ["${GROUP:-0}"]
    for g in indices:
        lighthouse_url = "${LIGHTHOUSE:-" + url + "}"
        flags = _group_flags(groups, str(g), lighthouse_url, "/workspace/checkpoints")
        flags = flags.replace('"', "")
        command = (
            "torchrun --nnodes ${PET_NNODES} --nproc-per-node ${PET_NPROC_PER_NODE} "
            f"--rdzv-backend c10d --rdzv-endpoint ${{MASTER_ADDR}}:{RDZV_PORT} --max-restarts "
            f"{MAX_RESTARTS} train.py {flags}"
        )
        suffix = f"g{g}" if groups.kind == "ft" else "site"
        job = [
            f"# replica group {g} of {groups.count}" if groups.kind == "ft" else
            "# this site's group: set GROUP (0 .. "
            f"{groups.count - 1}) and, away from the lighthouse's site, LIGHTHOUSE",
            "apiVersion: kubeflow.org/v1",
            "kind: PyTorchJob",
            "metadata:",
            f"  name: {name}-{suffix}",
            "spec:",
            f'  nprocPerNode: "{groups.procs}"',
            "  pytorchReplicaSpecs:",
            *replica("Master", 1, command, per_node_limit),
        ]  # fmt: skip
        if groups.nodes > 1:
            job += replica("Worker", groups.nodes - 1, command, per_node_limit)
        jobs.append(job)
    return lighthouse + jobs
