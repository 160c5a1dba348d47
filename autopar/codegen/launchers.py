"""Launchers written beside train.py: a Slurm batch script and a Kubernetes PyTorchJob.

In: a Plan (its node count, devices per node, model and cluster). Out: text.

    launch.sbatch     sbatch launch.sbatch [train.py options]: one task per node, each running
                      torchrun with a c10d rendezvous on the job's first node, restarts on
                      failure (--max-restarts) resuming from --checkpoint-dir
    pytorchjob.yaml   kubectl apply -f pytorchjob.yaml (Kubeflow training operator): one Master
                      and nodes - 1 Worker replicas, nprocPerNode processes each, c10d
                      rendezvous, the devices per node as the container's GPU limit (the
                      operator sets PET_NNODES, PET_NPROC_PER_NODE and MASTER_ADDR, which
                      bash expands in the container's command)

Both start train.py with `--checkpoint-every auto` (the plan's goodput interval) and
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see train.py's restart note). A plan that trains in
replica groups over torchft (fault-tolerant groups, DiLoCo across sites) gets launchers that
start torchft's lighthouse and each group as its own job instead (`group_launchers`).
"""

from __future__ import annotations

import re
import shlex

from autopar.codegen.export.common import one_line
from autopar.codegen.group_launchers import kubernetes_documents, replica_groups, slurm_lines
from autopar.hardware import load_profile
from autopar.plan.types import Plan

MAX_RESTARTS = 3
PORT = 29500


def _uses_gpus(plan: Plan) -> bool:
    try:
        return load_profile(plan.cluster).kind == "gpu"
    except (OSError, ValueError):  # a profile that is not shipped: assume accelerators
        return True


def _job_name(plan: Plan) -> str:
    """A DNS-1123 name (Kubernetes) that Slurm takes too."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"autopar-{plan.model}".lower()).strip("-")
    return name[:50].rstrip("-")


def _training_text(plan: Plan) -> str:
    chosen = plan.chosen_training
    names = {"ft": "fault-tolerant replica groups", "diloco": "DiLoCo groups, one per site"}
    if chosen.get("name") not in names:
        return ""
    return f"; training: {chosen.get('replicas')} {names[chosen['name']]} (torchft)"


def slurm_script(plan: Plan) -> str:
    per_node = plan.world_size // plan.num_nodes
    gpus = [f"#SBATCH --gpus-per-node={per_node}"] if _uses_gpus(plan) else []
    try:
        groups = replica_groups(plan)
    except ValueError as e:  # groups this script cannot lay out: said where it would start
        return f"#!/bin/bash\necho {shlex.quote(str(e))} >&2\nexit 2\n"
    lines = [
        "#!/bin/bash",
        one_line(
            f"# Slurm launcher written by autopar for {plan.model} on {plan.cluster} x "
            f"{plan.num_nodes}: {plan.config.as_text()}{_training_text(plan)}"
        ),
        "# Submit from this directory: sbatch launch.sbatch [train.py options, e.g. --steps 1000]",
        f"#SBATCH --job-name={_job_name(plan)}",
        f"#SBATCH --nodes={plan.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        *gpus,
        "#SBATCH --exclusive",
    ]
    if groups is not None:
        return "\n".join(lines + slurm_lines(groups, _uses_gpus(plan))) + "\n"
    lines += [
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        "srun torchrun \\",
        '    --nnodes "$SLURM_NNODES" \\',
        f"    --nproc-per-node {per_node} \\",
        "    --rdzv-backend c10d \\",
        f'    --rdzv-endpoint "$head_node:{PORT}" \\',
        '    --rdzv-id "$SLURM_JOB_ID" \\',
        f"    --max-restarts {MAX_RESTARTS} \\",
        '    "$SLURM_SUBMIT_DIR/train.py" \\',
        '    --checkpoint-dir "$SLURM_SUBMIT_DIR/checkpoints" --checkpoint-every auto "$@"',
    ]
    return "\n".join(lines) + "\n"


def _limit(plan: Plan, devices: int) -> str:
    return f"nvidia.com/gpu: {devices}" if _uses_gpus(plan) else f'cpu: "{devices}"'


def _replica(role: str, count: int, command: str, limits: str) -> list[str]:
    """One replica spec of a PyTorchJob: ``count`` pods running ``command`` in bash."""
    return [
        f"    {role}:",
        f"      replicas: {count}",
        "      restartPolicy: OnFailure",
        "      template:",
        "        spec:",
        "          containers:",
        "            - name: pytorch",
        "              image: your-registry/your-training-image:tag  # holds this directory",
        "              workingDir: /workspace",
        f'              command: ["bash", "-c", "{command}"]',
        "              env:",
        "                - name: TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        '                  value: "1"',
        "              resources:",
        "                limits:",
        f"                  {limits}",
    ]


def pytorchjob_manifest(plan: Plan) -> str:
    per_node = plan.world_size // plan.num_nodes
    name = _job_name(plan)
    try:
        groups = replica_groups(plan)
    except ValueError as e:
        return one_line(f"# {e}") + "\n"
    head = one_line(
        f"# Kubernetes (Kubeflow training operator) job written by autopar for {plan.model} "
        f"on {plan.cluster} x {plan.num_nodes}: {plan.config.as_text()}{_training_text(plan)}"
    )
    if groups is not None:
        docs = kubernetes_documents(groups, name, _replica, _limit(plan, groups.procs))
        return "\n---\n".join("\n".join(d) for d in [[head, *docs[0]], *docs[1:]]) + "\n"
    command = (
        "torchrun --nnodes ${PET_NNODES} --nproc-per-node ${PET_NPROC_PER_NODE} "
        f"--rdzv-backend c10d --rdzv-endpoint ${{MASTER_ADDR}}:{PORT} --max-restarts "
        f"{MAX_RESTARTS} train.py --checkpoint-dir /workspace/checkpoints "
        "--checkpoint-every auto"
    )
    limits = _limit(plan, per_node)

    def replica(role: str, count: int) -> list[str]:
        return _replica(role, count, command, limits)

    lines = [
        head,
        "# Set the image (one holding this directory at /workspace), then: "
        "kubectl apply -f pytorchjob.yaml",
        "apiVersion: kubeflow.org/v1",
        "kind: PyTorchJob",
        "metadata:",
        f"  name: {name}",
        "spec:",
        f'  nprocPerNode: "{per_node}"',
        "  elasticPolicy:",
        "    rdzvBackend: c10d",
        f"    minReplicas: {plan.num_nodes}",
        f"    maxReplicas: {plan.num_nodes}",
        f"    maxRestarts: {MAX_RESTARTS}",
        "  pytorchReplicaSpecs:",
        *replica("Master", 1),
    ]
    if plan.num_nodes > 1:
        lines += replica("Worker", plan.num_nodes - 1)
    return "\n".join(lines) + "\n"


LAUNCHERS = {"launch.sbatch": slurm_script, "pytorchjob.yaml": pytorchjob_manifest}
