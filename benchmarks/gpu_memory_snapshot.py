"""What is live on one GPU at a generated program's allocated peak, by the CUDA allocator's own
history.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 \\
    SNAP_OUT=snap.txt python3 benchmarks/gpu_memory_snapshot.py DIR/train.py --device cuda \\
        --steps 2

Needs a CUDA device (a lent GPU machine; `benchmarks/gpu_program.py prepare` writes the
programs). It records the caching allocator's history
(`torch.cuda.memory._record_memory_history`, Python frames), runs the program in this process
(the environment above stands in for torchrun's single rank) and, as the program exits, replays
the history's allocations and frees to find the most bytes allocated at once. It writes to
SNAP_OUT each allocation live at that moment of 64 MiB or more, with the frames of autopar,
train.py and torch's functional and autograd modules that made it, the smaller ones summed,
and the events around the peak. `torch.cuda.memory_summary` gives the totals; this says which
tensors make them, against the plan's terms (`autopar.estimate.memory.StagePhases`).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

import torch

MiB = 2**20
KEEP = ("autopar", "train.py", "torch/nn/functional", "torch/autograd")


def frames(event: dict) -> str:
    kept = [f for f in event.get("frames") or [] if any(k in f["filename"] for k in KEEP)]
    return " <- ".join(
        f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in kept[:4]
    )


def dump(out: str) -> None:
    """The allocations live at the history's allocated peak, written to ``out``. Replayed by
    hand: torch.cuda._memory_viz draws the history (HTML, for a browser) but has no call that
    returns the allocations live at one moment."""
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    live: dict[int, dict] = {}
    now = peak = at_index = 0
    at: dict[int, dict] = {}
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            now += event["size"]
            if now > peak:
                peak, at, at_index = now, dict(live), i
        elif event["action"] in ("free_requested", "free_completed"):
            freed = live.pop(event["addr"], None)
            now -= freed["size"] if freed else 0
    lines = [
        f"events {len(trace)}; peak of traced live bytes {peak / 2**30:.2f} GiB at event "
        f"{at_index}; max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    ]
    held = sorted(at.values(), key=lambda e: -e["size"])
    big = [e for e in held if e["size"] >= 64 * MiB]
    lines += [f"{e['size'] / MiB:10.1f} MiB  {frames(e)}" for e in big]
    small = [e for e in held if e["size"] < 64 * MiB]
    lines.append(f"{sum(e['size'] for e in small) / MiB:10.1f} MiB in {len(small)} smaller")
    lines.append("--- events around the peak")
    for e in trace[max(0, at_index - 6) : at_index + 6]:
        lines.append(f"{e['action']} {e['size'] / MiB:.1f} MiB {frames(e)}")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    out = os.environ["SNAP_OUT"]
    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    atexit.register(dump, out)
    exit_now = os._exit

    def exit_after_dump(code: int) -> None:  # the generated train.py ends with os._exit
        dump(out)
        exit_now(code)

    os._exit = exit_after_dump
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
