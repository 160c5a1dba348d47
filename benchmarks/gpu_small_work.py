"""Small work on a GPU: thin GEMMs, the host's time per op, and small GPT blocks against the
profile's price.

    python3 benchmarks/gpu_small_work.py [--profile dgx_h200] [--json FILE] [--smoke]

Issue 46's held-out runs of 0.15-1.3B GPT models price a median 24% faster than measured,
most at hidden 1024, micro-batch 1 and TP8: where the cost model's ops are small. This
measures that regime on one GPU (the project never needs one to pass; run it on a lent one):

    gemm    the four GEMMs of a GPT block (qkv, attention output, MLP up and down) on one
            tensor-parallel rank's shard, hidden 1024 and 2048, tp 1-8, 1024-8192 tokens, bf16:
            CUDA-event time against the profile's matmul curve at the same FLOPs
    host    the host's time to issue one small op, alone (an in-place add) and with autograd (a
            Linear's forward and backward): issued back to back, then synchronised, so the
            wall time per op is the host's pace when the device keeps up
    block   the zoo GPT's block (`autopar.models.gpt.GPTBlock`, flash attention, bf16) forward
            and backward at small shapes: the wall time per step of 20 steps issued back to
            back (host and device overlapped, as training runs them), the host's own time to
            issue one step, and the estimator's price of the same block on the profile
            (`Estimator.layer_times`, tp 1: compute forward + backward)

Printed per row: measured, predicted, and their ratio; --json writes the rows with the device,
torch and CUDA versions and the date, for data/measurements/. --smoke runs the code paths on
the CPU at tiny sizes (no figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import DEVICE, profile_efficiency, timed  # noqa: E402

from autopar.hardware import load_profile  # noqa: E402


def gemm_rows(args: argparse.Namespace, profile) -> list[dict]:
    peak = profile.device.peak_flops_per_s["bf16"]
    hiddens, tps, tokens = ([1024, 2048], [1, 2, 4, 8], [1024, 4096, 8192])
    if args.smoke:
        hiddens, tps, tokens = [64], [1, 2], [32]
    rows = []
    for h in hiddens:
        for tp in tps:
            for m in tokens:
                for name, n, k in (("qkv", 3 * h // tp, h), ("proj", h, h // tp),
                                   ("fc1", 4 * h // tp, h), ("fc2", h, 4 * h // tp)):  # fmt: skip
                    a = torch.randn(m, k, device=DEVICE, dtype=args.dtype)
                    b = torch.randn(k, n, device=DEVICE, dtype=args.dtype)
                    seconds = timed(lambda a=a, b=b: torch.mm(a, b), args.warmup, args.repeats)
                    flops = 2.0 * m * n * k
                    predicted = flops / (peak * profile_efficiency(profile, "matmul", flops))
                    rows.append({"section": "gemm", "shape": f"h{h} tp{tp} {name} M{m} N{n} K{k}",
                                 "flops": flops, "measured_s": seconds,
                                 "predicted_s": predicted})  # fmt: skip
    return rows


def _issue_rate(step, count: int) -> float:
    """Wall seconds per call of ``step`` issued ``count`` times back to back, then synced."""
    step()
    sync()
    start = time.perf_counter()
    for _ in range(count):
        step()
    sync()
    return (time.perf_counter() - start) / count


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_rows(args: argparse.Namespace, profile) -> list[dict]:
    count = 50 if args.smoke else 2000
    x = torch.zeros(1024, device=DEVICE, dtype=args.dtype)
    lin = torch.nn.Linear(64, 64, device=DEVICE, dtype=args.dtype)
    inp = torch.randn(8, 64, device=DEVICE, dtype=args.dtype)

    def linear_step() -> None:
        lin(inp).sum().backward()

    launch = profile.device.launch_overhead_s
    return [
        {"section": "host", "shape": "add_ (1024 elements)",
         "measured_s": _issue_rate(lambda: x.add_(1), count), "predicted_s": launch},
        # forward: linear, sum; backward: the sum's and the linear's gradients, accumulation
        {"section": "host", "shape": "Linear 64 forward+backward (about 8 kernels)",
         "measured_s": _issue_rate(linear_step, count // 4), "predicted_s": 8 * launch},
    ]  # fmt: skip


def block_rows(args: argparse.Namespace, profile_name: str) -> list[dict]:
    import autopar
    from autopar.config import ParallelConfig
    from autopar.estimate import Estimator, build_tables
    from autopar.models import zoo
    from autopar.models.gpt import GPTBlock

    shapes = [(1024, 16, 1024, 1), (1024, 16, 1024, 4), (2048, 16, 1024, 1), (2048, 16, 2048, 4)]
    if args.smoke:
        shapes = [(64, 4, 32, 1)]
    rows = []
    for hidden, heads, seq, mbs in shapes:
        # two layers: the tracer names repeated layers blocks; one of them is priced
        overrides = dict(hidden=hidden, num_heads=heads, seq_len=seq, num_layers=2)
        cfg = zoo.config("gpt-tiny", **overrides)
        block = GPTBlock(cfg).to(DEVICE, args.dtype)
        x = torch.randn(mbs, seq, hidden, device=DEVICE, dtype=args.dtype, requires_grad=True)

        def step(block=block, x=x) -> None:
            block(x).float().square().mean().backward()

        steps = 3 if args.smoke else 20
        wall = _issue_rate(step, steps)
        sync()
        start = time.perf_counter()
        step()  # the host's own time to issue one step, the device behind it
        host = time.perf_counter() - start
        sync()
        model = zoo.build("gpt-tiny", device="meta", **overrides)
        graph = autopar.trace(model, zoo.example_inputs("gpt-tiny", model))
        tables = build_tables(graph)
        name = next(t.name for t in tables.layers if t.kind == "block")  # blocks.0
        cluster = autopar.Cluster.from_profile(profile_name, num_devices=1)
        est = Estimator(tables, cluster, precision="bf16")
        pcfg = ParallelConfig(micro_batch_size=mbs)
        times = est.layer_times(pcfg, est.mesh(pcfg))[name]
        predicted = times.compute_forward_s + times.compute_backward_s
        rows.append({"section": "block", "shape": f"h{hidden} a{heads} s{seq} mbs{mbs}",
                     "measured_s": wall, "host_s": host, "predicted_s": predicted})  # fmt: skip
        del block, x
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="the profile to compare with (default: by device name)")
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="no GPU: tiny sizes on the CPU")
    args = parser.parse_args()
    if args.smoke:
        args.warmup, args.repeats = 1, 1
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_small_work.py measures a CUDA device; none is available here")
    args.dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)"
    profile_name = args.profile or ("dgx_h200" if "H200" in name else "dgx_h100")
    profile = load_profile(profile_name)
    print(f"{name}: torch {torch.__version__}, CUDA {torch.version.cuda}; profile {profile_name}")
    rows = []
    for title, measure in (("gemm", lambda: gemm_rows(args, profile)),
                           ("host", lambda: host_rows(args, profile)),
                           ("block", lambda: block_rows(args, profile_name))):  # fmt: skip
        print(f"\n== {title}: measured, predicted (us), measured / predicted")
        try:
            section = measure()
        except Exception as exc:  # a section that cannot run says so; the others still do
            print(f"{title}: failed: {type(exc).__name__}: {exc}")
            continue
        for row in section:
            extra = f"  host {row['host_s'] * 1e6:9.1f}" if "host_s" in row else ""
            print(f"  {row['shape']:40s} {row['measured_s'] * 1e6:9.1f} "
                  f"{row['predicted_s'] * 1e6:9.1f} {row['measured_s'] / row['predicted_s']:6.2f}"
                  f"{extra}")  # fmt: skip
        rows += section
    if args.json:
        out = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
               "date": datetime.date.today().isoformat(), "profile": profile_name,
               "rows": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"written {args.json}")


if __name__ == "__main__":
    main()
