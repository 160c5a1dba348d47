"""Write data/aceso_stages.json: the per-stage layouts of data/published_grids.csv's Aceso rows.

The rows (source_id mist_artifact_aceso) name each plan's config JSON in the Mist artifact
(github.com/Dazz993/Mist, benchmark/superscaler/results-ref/.../aceso/configs/...). This copies
from each what pricing the plan needs, per pipeline stage: how many of Aceso's GPT operators
it holds (Aceso cuts stages between operators, not layers), its tensor- and data-parallel
degrees (the same for every operator of a stage in all these plans: checked here), which of
its operators it recomputes, as a string of 0/1, and, where the artifact holds the runtime csv
of one of its ranks (the first node's), what that rank measured in the step the row reports:
its forward and backward compute (Megatron's timers, seconds over the step) and its peak
allocated and reserved bytes (PyTorch's caching allocator). The artifact ran most plans twice
(a full log per run beside the csvs, which hold one run's figures); per plan, `runs` keeps what
each run's log says: its step (the last "elapsed time per iteration") and, per stage of the
first node, one rank's forward + backward compute. And per stage what Aceso's own cost model
predicted when it chose the plan (the info csv beside the config: `aceso_predicted`, its time
for the step and its memory). Run against a checkout:

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
    files = subprocess.run(["git", "-C", repo, "ls-tree", "-r", "--name-only", sha],
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    plans = {}
    with open(ROOT / "data" / "published_grids.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if "aceso" in r["source_id"]]
    for row in rows:
        path = re.search(r"config (\S+\.json)", row["source"]).group(1)
        text = _show(repo, sha, path)
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
        for stage, measured in _measured(repo, sha, files, path).items():
            stages[stage]["measured"] = measured
        runs = _runs(repo, sha, files, path)
        for stage, predicted in _predicted(repo, sha, files, path).items():
            stages[stage]["aceso_predicted"] = predicted
        plans[path] = {
            "num_layers": config["num_layers"],
            "hidden_size": config["hidden_size"],
            "seq_length": config["seq_length"],
            "micro_batch_size": config["micro_batch_size"],
            "global_batch_size": config["global_batch_size"],
            "stages": stages,
            "runs": runs,
        }
    out = {
        "source": f"github.com/Dazz993/Mist at {sha}: the config JSON each row's source names "
        "and the runtime csvs beside its log (scripts/extract_aceso_stages.py)",
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


def _show(repo: str, sha: str, name: str) -> str:
    """File ``name`` of ``repo`` at commit ``sha``."""
    return subprocess.run(["git", "-C", repo, "show", f"{sha}:{name}"], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip


def _stem(path: str) -> str:
    """A plan's config file name without .json: the csvs and logs of its runs begin with it."""
    return path.rsplit("/", 1)[1].removesuffix(".json")


def _runtime_dir(path: str) -> str:
    """Where the runs of the plan at config ``path`` left their csvs and logs."""
    return path.split("/configs/")[0] + "/runtime/"


def _measured(repo: str, sha: str, files: list[str], path: str) -> dict[int, dict]:
    """Per stage with a runtime csv beside the plan's config, what its first rank measured."""
    stem, where = _stem(path), _runtime_dir(path)
    out: dict[int, dict] = {}
    for name in sorted(files):
        found = re.fullmatch(re.escape(where) + r".*/csv/" + re.escape(stem) +
                             r"_stage(\d+)_rank(\d+)\.csv", name)  # fmt: skip
        if not found or int(found.group(1)) in out:
            continue
        text = _show(repo, sha, name)
        row = next(csv.DictReader(text.splitlines()))
        out[int(found.group(1))] = {
            "rank": int(found.group(2)),
            "forward_compute_s": float(row["forward-compute"]) / 1e3,
            "backward_compute_s": float(row["backward-compute"]) / 1e3,
            "step_s": float(row["time"]) / 1e3,
            "max_allocated_bytes": float(row["max_allocated"]) * 2**20,
            "max_reserved_bytes": float(row["max_reserved"]) * 2**20,
        }
    return out


def _predicted(repo: str, sha: str, files: list[str], path: str) -> dict[int, dict]:
    """Per stage, Aceso's prediction for the plan (its search's info csv), where there is one:
    the step's time as that stage sees it and its memory (total, the allocator's reserve in)."""
    info = f"{path.rsplit('/', 1)[0]}/csv/info_{_stem(path)}.csv"
    if info not in files:
        return {}
    text = _show(repo, sha, info)
    out = {}
    for row in csv.DictReader(text.splitlines()):
        stage = int(row["stage-index"].removeprefix("stage-"))
        out[stage] = {"step_s": float(row["time"]) / 1e3,
                      "memory_bytes": float(row["memory(total)"]) * 2**20}  # fmt: skip
    return out


_STEP = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
_TIMES = re.compile(r"Time \(ms\) \| \[stage (\d+), virtual 0, rank (\d+)\] \| (.*)")


def _runs(repo: str, sha: str, files: list[str], path: str) -> list[dict]:
    """Per full log of the plan's runs, in the order they ran: the last step time it logged
    (None: it logged none) and per stage one rank's (the lowest logged) forward + backward
    compute over the step, from Megatron's timers in the log."""
    stem, where = _stem(path), _runtime_dir(path)
    out = []
    for name in sorted(files):
        if not (name.startswith(where) and f"/full_log_{stem}_rank" in name):
            continue
        text = _show(repo, sha, name)
        steps = _STEP.findall(text)
        busy: dict[tuple[int, int], float] = {}  # (stage, rank) -> its last step's
        for stage, rank, rest in _TIMES.findall(text):
            timers = dict(t.split(": ") for t in rest.split(" | "))
            if "forward-compute" in timers:  # not the setup timers
                work = float(timers["forward-compute"]) + float(timers["backward-compute"])
                busy[int(stage), int(rank)] = work / 1e3
        compute = {}
        for (stage, _), seconds in sorted(busy.items()):
            compute.setdefault(str(stage), round(seconds, 3))  # the stage's lowest rank
        out.append({
            "log": name.rsplit("/", 1)[1],
            "step_s": float(steps[-1]) / 1e3 if steps else None,
            "compute_s": compute,
        })  # fmt: skip
    return out


if __name__ == "__main__":
    main(*sys.argv[1:])
