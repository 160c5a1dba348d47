"""Write data/aceso_profiles.json: what Aceso's and Mist's profilers measured on the testbeds.

The Mist artifact (github.com/Dazz993/Mist) keeps the output of Aceso's profilers for each GPU
its rows ran on (benchmark/superscaler/results-ref/profiled-time-mist-all-{a10g,l4,...}). The
shipped profiles aws_g5_a10g and gcp_g2_l4 take their curves and links from these,
a100_40g_100gbe its inter-node link, and
tests/autopar/hardware/test_measured_aceso.py holds them against what is copied here:

- per GPT model, micro-batch and operator, the forward and backward times of the four GEMMs
  of a layer at tensor-parallel degree 1 (at tp > 1 Megatron's all-reduce runs inside the
  operator, so those times are not the GEMM's), with the GEMM's forward FLOPs;
- the GELU's forward time and the bytes it moves (its input and output);
- all-reduce times by group size and bytes, the 13B model's file (comm_profiler.py: the
  tensor's bytes, timed between two device synchronizations);
- send/recv rates within and between nodes, as the files give them (GB/s by MB sent);
- Mist's own network profile of each testbed, where its experiment template has one (its
  gpu_gpu_comm_params: per number of nodes and GPUs per node, an all-gather rate per rank in
  GiB/s and a latency in s, Mist's tools/optimize.py model), which a100_40g_100gbe's
  inter-node link takes (Aceso's send/recv file disagrees with it: hardware_profiles/); of
  the A100 nodes only the send/recv rates and this are copied.

Run against a checkout:

    python3 scripts/extract_aceso_profiles.py /path/to/Mist [COMMIT]
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICES = {"a10g": "aws_g5_a10g", "l4": "gcp_g2_l4"}
# the A100 nodes: their network only (their operator files time sequences of 4096, not SEQ)
NETWORK_ONLY = {"a100-sxm4-40gb": "a100_40g_100gbe"}
TEMPLATE = "benchmark/mist/configs/experiment/template-{}.yaml"  # Mist's network profile
HIDDEN = {"1_3B": 2048, "2_6B": 2560, "6_7B": 4096, "13B": 5120, "20B": 6144, "22B": 6144,
          "40B": 8192}  # fmt: skip
SEQ = 2048  # the profiles' sequence length (Aceso's GPT configs)
GEMMS = {"enc-attention-qkv": 3, "enc-attention-dense": 1, "enc-MLP-GEMM-1": 4,
         "enc-MLP-GEMM-2": 4}  # op -> its output width over the hidden size  # fmt: skip
MiB = 2**20


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def _device(repo: str, sha: str, files: list[str], folder: str) -> dict:
    gemms, gelu, all_reduce = [], [], []
    p2p = {}
    for path in files:
        if not path.startswith(folder):
            continue
        name = path.rsplit("/", 1)[1]
        text = _git(repo, "show", f"{sha}:{path}")
        op = re.fullmatch(r"gpt_(\w+?)_mbs(\d+)_tp1_algo0\.csv", name)
        if op and op.group(1) in HIDDEN:
            h, mbs = HIDDEN[op.group(1)], int(op.group(2))
            for row in csv.DictReader(io.StringIO(text)):
                fwd = float(row["forward-compute"]) * 1e-6
                bwd = float(row["backward-compute"]) * 1e-6
                if row["op_name"] in GEMMS:
                    flops = 2 * mbs * SEQ * h * GEMMS[row["op_name"]] * h
                    gemms.append({"model": op.group(1), "mbs": mbs, "op": row["op_name"],
                                  "forward_flops": flops, "forward_s": fwd,
                                  "backward_s": bwd})  # fmt: skip
                elif row["op_name"] == "enc-MLP-gelu":
                    moved = (float(row["input_size"]) + float(row["output_size"])) * MiB
                    gelu.append({"model": op.group(1), "mbs": mbs, "bytes": moved,
                                 "forward_s": fwd})  # fmt: skip
        # every model's file times the sizes its own tensors have; the 13B's span 20 MB-1 GB
        reduce = re.fullmatch(r"prim_gpt_(13B)_all_reduce_(\d+)gpus\.csv", name)
        if reduce:
            for row in csv.DictReader(io.StringIO(text)):
                all_reduce.append({"model": reduce.group(1), "gpus": int(reduce.group(2)),
                                   "bytes": float(row["data_size(MB)"]) * MiB,
                                   "s": float(row["time(ms)"]) * 1e-3})  # fmt: skip
        send = re.fullmatch(r"p2p_(intra|inter)_node\.csv", name)
        if send:
            lines = list(csv.reader(io.StringIO(text)))
            rates = [[float(x) for x in r] for r in lines[1:] if r]
            p2p[send.group(1)] = {"mb": [float(x) for x in lines[0]], "gb_per_s": rates}
    return {"gemms_tp1": gemms, "gelu_tp1": gelu, "all_reduce": all_reduce, "p2p": p2p}


def _mist_network(repo: str, sha: str, gpu: str) -> dict:
    """Mist's gpu_gpu_comm_params for ``gpu``'s nodes, where its template has them: 32
    numbers, (rate GiB/s, latency s) for nodes 1, 2, 4, 8 (outer) x GPUs per node 1, 2, 4, 8
    (inner); the ones the profiler left at their placeholder (4.5, 0) are dropped."""
    text = _git(repo, "show", f"{sha}:{TEMPLATE.format(gpu)}")
    found = re.search(r"^\s*gpu_gpu_comm_params:\s*\[([^\]]*)\]", text, re.M)
    if not found:
        return {}
    values = [float(x) for x in found.group(1).split(",")]
    rows = []
    for i in range(16):
        rate, latency = values[2 * i], values[2 * i + 1]
        if (rate, latency) != (4.5, 0.0):
            rows.append({"nodes": 2 ** (i // 4), "gpus_per_node": 2 ** (i % 4),
                         "gib_per_s": rate, "latency_s": latency})  # fmt: skip
    return {"source": TEMPLATE.format(gpu), "all_gather_rate_per_rank": rows}


def main(repo: str, commit: str = "HEAD") -> None:
    sha = _git(repo, "rev-parse", commit).strip()
    files = _git(repo, "ls-tree", "-r", "--name-only", sha).split()
    base = "benchmark/superscaler/results-ref/profiled-time-mist-all-"
    folders = ",".join([*DEVICES, *NETWORK_ONLY])
    out = {
        "source": f"github.com/Dazz993/Mist at {sha}, {base}{{{folders}}} "
        "(scripts/extract_aceso_profiles.py)",
        "seq_len": SEQ,
        "devices": {
            gpu: {
                "profile": DEVICES[gpu],
                **_device(repo, sha, files, f"{base}{gpu}/"),
                "mist_network": _mist_network(repo, sha, gpu),
            }
            for gpu in DEVICES
        },  # fmt: skip
    }
    for gpu, profile in NETWORK_ONLY.items():
        measured = _device(repo, sha, files, f"{base}{gpu}/")
        out["devices"][gpu] = {"profile": profile, "p2p": measured["p2p"],
                               "mist_network": _mist_network(repo, sha, gpu)}  # fmt: skip
    (ROOT / "data" / "aceso_profiles.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
