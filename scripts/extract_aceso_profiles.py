"""Write data/aceso_profiles.json: what Aceso's profiler measured on the A10G and L4 testbeds.

The Mist artifact (github.com/Dazz993/Mist) keeps the output of Aceso's profilers for each GPU
its rows ran on (benchmark/superscaler/results-ref/profiled-time-mist-all-{a10g,l4}). The
shipped profiles aws_g5_a10g and gcp_g2_l4 take their curves and links from these, and
tests/autopar/hardware/test_measured_aceso.py holds them against what is copied here:

- per GPT model, micro-batch and operator, the forward and backward times of the four GEMMs
  of a layer at tensor-parallel degree 1 (at tp > 1 Megatron's all-reduce runs inside the
  operator, so those times are not the GEMM's), with the GEMM's forward FLOPs;
- the GELU's forward time and the bytes it moves (its input and output);
- all-reduce times by group size and bytes, the 13B model's file (comm_profiler.py: the
  tensor's bytes, timed between two device synchronizations);
- send/recv rates within and between nodes, as the files give them (GB/s by MB sent).

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


def main(repo: str, commit: str = "HEAD") -> None:
    sha = _git(repo, "rev-parse", commit).strip()
    files = _git(repo, "ls-tree", "-r", "--name-only", sha).split()
    base = "benchmark/superscaler/results-ref/profiled-time-mist-all-"
    out = {
        "source": f"github.com/Dazz993/Mist at {sha}, {base}{{a10g,l4}} "
        "(scripts/extract_aceso_profiles.py)",
        "seq_len": SEQ,
        "devices": {
            gpu: {"profile": DEVICES[gpu], **_device(repo, sha, files, f"{base}{gpu}/")}
            for gpu in DEVICES
        },  # fmt: skip
    }
    (ROOT / "data" / "aceso_profiles.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
