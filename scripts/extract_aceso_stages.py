"""Write data/aceso_stages.json: the per-stage layouts of data/published_grids.csv's Aceso rows.

The rows (source_id mist_artifact_aceso) name each plan's config JSON in the Mist artifact
(github.com/Dazz993/Mist, benchmark/superscaler/results-ref/.../aceso/configs/...). This copies
from each what pricing the plan needs, per pipeline stage: how many of Aceso's GPT operators
it holds (Aceso cuts stages between operators, not layers), its tensor- and data-parallel
degrees (the same for every operator of a stage in all these plans: checked here), and which
of its operators it recomputes, as a string of 0/1. Run against a checkout of the repository:

    python3 scripts/extract_aceso_stages.py /path/to/Mist [COMMIT]
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(repo: str, commit: str = "HEAD") -> None:
    sha = subprocess.run(["git", "-C", repo, "rev-parse", commit], capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    plans = {}
    with open(ROOT / "data" / "published_grids.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if "aceso" in r["source_id"]]
    for row in rows:
        path = re.search(r"config (\S+\.json)", row["source"]).group(1)
        text = subprocess.run(["git", "-C", repo, "show", f"{sha}:{path}"], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        config = json.loads(text)
        stages = []
        for i in range(config["num_stages"]):
            tp = set(config["model_parallel_size_of_each_op"][i])
            dp = set(config["data_parallel_size_of_each_op"][i])
            if len(tp) != 1 or len(dp) != 1:
                raise SystemExit(f"{path}: stage {i} mixes degrees {tp} x {dp}")
            flags = config["recompute_ops"][i]
            if len(flags) != config["num_ops_in_each_stage"][i]:
                raise SystemExit(f"{path}: stage {i}'s recompute list is not its operators'")
            stages.append({"ops": len(flags), "tp": tp.pop(), "dp": dp.pop(),
                           "recompute": "".join(str(int(f)) for f in flags)})  # fmt: skip
        plans[path] = {
            "num_layers": config["num_layers"],
            "hidden_size": config["hidden_size"],
            "seq_length": config["seq_length"],
            "micro_batch_size": config["micro_batch_size"],
            "global_batch_size": config["global_batch_size"],
            "stages": stages,
        }
    out = {
        "source": f"github.com/Dazz993/Mist at {sha}: the config JSON each row's source names "
        "(scripts/extract_aceso_stages.py)",
        "operators": "Aceso's GPT operators in order: the embedding, then per layer "
        "1st-layernorm, attention-qkv, attention-score, attention-softmax, attention-dropout, "
        "attention-context, attention-dense, post-attention-dropout, 2nd-layernorm, MLP-GEMM-1, "
        "MLP-gelu, MLP-GEMM-2, post-MLP-dropout, then final-layernorm and gpt-post-process "
        "(Aceso's model_ops_info.py)",
        "plans": plans,
    }
    target = ROOT / "data" / "aceso_stages.json"
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(plans)} plans -> {target}")


if __name__ == "__main__":
    main(*sys.argv[1:])
