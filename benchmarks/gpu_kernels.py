"""Kernel efficiencies and usable memory of this machine's GPU, beside its profile's curves.

    python3 benchmarks/gpu_kernels.py [--profile dgx_h100] [--json FILE] [--quick]

Needs a CUDA device (run it on a lent GPU machine; the project never needs one to pass). Each
section times real kernels with CUDA events (median of --repeats timed calls after warm-up)
and prints measured TFLOP/s or TB/s, the efficiency over the profile's peak, and what the
profile's curve `max * x / (x + half_size)` predicts at the same size:

    memory      what PyTorch's caching allocator can take: total_memory, mem_get_info, and the
                sum of 256 MiB then 16 MiB blocks allocated until the first OOM (the figure a
                profile's memory_bytes stands for: hardware_profiles/README.md)
    matmul      bf16 torch.mm, square sizes and the GEMMs of a Llama layer (x = 2MNK FLOPs)
    matmul-fp32 the same in fp32 with TF32 off (CUDA cores), over the fp32 peak
    fp8         torch._scaled_mm e4m3 x e4m3 -> bf16, per-tensor and per-row scales
    attention   scaled_dot_product_attention (causal, head dim 128, bf16) forward and
                forward+backward per backend: flash, cuDNN, memory-efficient (x = FLOPs of
                the causal half: forward 2 * 2BHS^2D / 2, backward 2.5x forward)
    hbm         a device-to-device copy (x = bytes read + written)

Per curve it prints the least-squares fit of (max, half_size) to the points (1/eff is linear in
1/x), so a profile's curve can be checked or refitted against it. --json writes everything,
with the device, driver, torch and CUDA versions and the date, for data/measurements/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autopar.hardware import load_profile  # noqa: E402

GiB = 2**30
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --smoke only


def timed(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median seconds of one call of ``fn`` on the current stream (CUDA events; on the CPU,
    for --smoke, the wall clock)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if not torch.cuda.is_available():
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def fit_curve(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(max, half_size) of eff = max * x / (x + half) by least squares on 1/eff = a + b / x."""
    pts = [(x, e) for x, e in points if e > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    b, a = statistics.linear_regression([1 / x for x, _ in pts], [1 / e for _, e in pts])
    return (1 / a, b / a) if a > 0 else None


def usable_memory() -> dict[str, float]:
    """What the caching allocator can take: blocks until the first OOM, then freed."""
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    blocks, taken = [], 0
    for size in (256 * 2**20, 16 * 2**20):
        while True:
            try:
                blocks.append(torch.empty(size, dtype=torch.uint8, device=DEVICE))
            except torch.OutOfMemoryError:
                break
            taken += size
    reserved = torch.cuda.memory_reserved()
    del blocks
    torch.cuda.empty_cache()
    return {
        "total_memory_bytes": float(props.total_memory),
        "free_at_start_bytes": float(free),
        "mem_get_info_total_bytes": float(total),
        "allocated_until_oom_bytes": float(taken),
        "reserved_at_oom_bytes": float(reserved),
    }


def matmul_shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K): square sizes and a Llama 3 8B layer's GEMMs at 8192 tokens."""
    if DEVICE == "cpu":  # --smoke
        return [("square 64", 64, 64, 64), ("qkv 64->96", 32, 96, 64)]
    squares = [256, 512, 1024, 2048, 4096, 8192] + ([] if quick else [16384])
    out = [(f"square {n}", n, n, n) for n in squares]
    tokens = 2048 if quick else 8192
    out += [
        ("qkv 4096->6144", tokens, 6144, 4096),
        ("o 4096->4096", tokens, 4096, 4096),
        ("gate_up 4096->28672", tokens, 28672, 4096),
        ("down 14336->4096", tokens, 4096, 14336),
        ("lm_head 4096->128256", tokens, 128256, 4096),
        ("tp8 down 1792->4096", tokens, 4096, 1792),
    ]
    return out


def _row(kernel: str, shape: str, x: float, seconds: float, peak: float, **extra) -> dict:
    """One timed kernel: x its size (FLOPs or bytes), its rate and its share of ``peak``."""
    rate = x / seconds
    return {"kernel": kernel, "shape": shape, **extra, "x": x, "seconds": seconds,
            "rate": rate, "efficiency": rate / peak}  # fmt: skip


def matmul_rows(
    args: argparse.Namespace, peak: float, dtype: torch.dtype = torch.bfloat16, kernel="matmul"
) -> list[dict]:
    rows = []
    for name, m, n, k in matmul_shapes(args.quick):
        if dtype == torch.float32 and (name == "square 16384" or name.startswith("lm_head")):
            continue  # a minute each at fp32's rate
        a = torch.randn(m, k, device=DEVICE, dtype=dtype)
        b = torch.randn(k, n, device=DEVICE, dtype=dtype)
        seconds = timed(lambda a=a, b=b: torch.mm(a, b), args.warmup, args.repeats)
        rows.append(_row(kernel, name, 2.0 * m * n * k, seconds, peak))
        del a, b
    return rows


def fp32_matmul_rows(args: argparse.Namespace, peak: float) -> list[dict]:
    """fp32 torch.mm on the CUDA cores (TF32 off, PyTorch's default for matmuls): the share of
    the fp32 peak that GEMMs without tensor cores reach, against the bf16 share above (the
    profiles price every dtype on one curve)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return matmul_rows(args, peak, torch.float32, "matmul-fp32")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def fp8_rows(args: argparse.Namespace, peak: float) -> list[dict]:
    rows = []
    e4m3 = torch.float8_e4m3fn
    for recipe in ("tensorwise", "rowwise"):
        for name, m, n, k in matmul_shapes(args.quick):
            a = torch.randn(m, k, device=DEVICE).to(e4m3)
            b = torch.randn(n, k, device=DEVICE).to(e4m3).t()  # column-major, as cuBLASLt takes
            if recipe == "tensorwise":
                sa = torch.ones((), device=DEVICE)
                sb = torch.ones((), device=DEVICE)
            else:
                sa = torch.ones(m, 1, device=DEVICE)
                sb = torch.ones(1, n, device=DEVICE)

            def call(a=a, b=b, sa=sa, sb=sb):
                return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

            try:
                seconds = timed(call, args.warmup, args.repeats)
            except RuntimeError as exc:  # a device or build without this recipe
                rows.append({"kernel": f"fp8-{recipe}", "shape": name, "error": str(exc)[:200]})
                break
            rows.append(_row(f"fp8-{recipe}", name, 2.0 * m * n * k, seconds, peak))
            del a, b
    return rows


def attention_rows(args: argparse.Namespace, peak: float) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    heads, dim = 32, 128
    tokens = 8192 if args.quick else 32768  # per call: batch x seq, as a training micro-batch
    seqs = [512, 1024, 2048, 4096, 8192] + ([] if args.quick else [16384, 32768])
    if DEVICE == "cpu":  # --smoke
        heads, tokens, seqs = 2, 64, [32, 64]
    rows = []
    for label, backend in backends.items():
        for seq in seqs:
            batch = max(1, tokens // seq)
            q, k, v = (
                torch.randn(
                    batch, heads, seq, dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True
                )
                for _ in range(3)
            )
            grad = torch.randn_like(q)
            fwd_flops = 4.0 * batch * heads * seq * seq * dim / 2  # the causal half

            def fwd(q=q, k=k, v=v, backend=backend):
                with sdpa_kernel(backend):
                    return sdpa(q, k, v, is_causal=True)

            def fwd_bwd(q=q, k=k, v=v, grad=grad, backend=backend):
                with sdpa_kernel(backend):
                    out = sdpa(q, k, v, is_causal=True)
                torch.autograd.grad(out, (q, k, v), grad)  # no .grad accumulation timed

            try:
                t_fwd = timed(fwd, args.warmup, args.repeats)
                t_both = timed(fwd_bwd, args.warmup, args.repeats)
            except RuntimeError as exc:  # no kernel of this backend for these inputs
                rows.append(
                    {"kernel": f"attention-{label}", "shape": f"seq {seq}", "error": str(exc)[:200]}
                )
                continue
            t_bwd = max(t_both - t_fwd, 1e-9)
            shape = f"{batch}x{heads}x{seq}x{dim}"
            for part, flops, seconds in (
                ("fwd", fwd_flops, t_fwd),
                ("bwd", 2.5 * fwd_flops, t_bwd),
            ):
                rows.append(_row(f"attention-{label}-{part}", shape, flops, seconds, peak, seq=seq))
            del q, k, v, grad
    return rows


def hbm_rows(args: argparse.Namespace, peak: float) -> list[dict]:
    rows = []
    sizes = [2**20 * s for s in (1, 4, 16, 64, 256, 1024)] + ([] if args.quick else [4 * GiB])
    if DEVICE == "cpu":  # --smoke
        sizes = [2**16, 2**20]
    for size in sizes:
        src = torch.empty(size, dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        seconds = timed(lambda s=src, d=dst: d.copy_(s), args.warmup, args.repeats)
        rows.append(_row("hbm", f"copy {size / 2**20:.0f} MiB", 2.0 * size, seconds, peak))
        del src, dst
    return rows


def profile_efficiency(profile, kernel: str, x: float) -> float:
    """What the profile prices a kernel of size ``x`` at, as a fraction of its peak: the
    device's curve, times the recipe's GEMM factor for FP8 (`autopar.config.precision`)."""
    from autopar.config.precision import RECIPES

    family = kernel.split("-")[0]
    curve = {
        "matmul": profile.device.matmul_curve("fp32" if kernel == "matmul-fp32" else "bf16"),
        "fp8": profile.device.matmul,
        "attention": profile.device.attention,
        "hbm": profile.device.memory,
    }[family]
    factor = RECIPES[kernel].gemm_efficiency if family == "fp8" else 1.0
    return factor * curve.max * x / (x + curve.half_size)


def print_rows(rows: list[dict], profile, unit: str) -> None:
    print(f"{'kernel':26} {'shape':24} {'measured':>10} {'eff':>6} {'profile':>7}")
    for row in rows:
        if "error" in row:
            print(f"{row['kernel']:26} {row['shape']:24} error: {row['error']}")
            continue
        predicted = profile_efficiency(profile, row["kernel"], row["x"])
        print(
            f"{row['kernel']:26} {row['shape']:24} {row['rate'] / 1e12:8.1f} {unit} "
            f"{row['efficiency']:6.3f} {predicted:7.3f}"
        )


def fits(rows: list[dict]) -> dict[str, dict[str, float]]:
    by_kernel: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        if "error" not in row:
            by_kernel.setdefault(row["kernel"], []).append((row["x"], row["efficiency"]))
    out = {}
    for kernel, points in by_kernel.items():
        fitted = fit_curve(points)
        best = max(e for _, e in points)
        out[kernel] = {"best": best}
        if fitted:
            out[kernel].update(max=fitted[0], half_size=fitted[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="the profile to compare with (default: by device name)")
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller sizes")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="no GPU: run the code paths on the CPU at tiny sizes (no figures)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.quick, args.warmup, args.repeats = True, 1, 1
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_kernels.py measures a CUDA device; none is available here")
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)"
    profile_name = args.profile or ("dgx_h200" if "H200" in name else "dgx_h100")
    profile = load_profile(profile_name)
    peaks = profile.device.peak_flops_per_s
    print(
        f"{name}: torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"compared with profile {profile_name}"
    )
    out: dict = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
        "profile": profile_name,
        "peaks": {
            "bf16": peaks["bf16"],
            "fp32": peaks["fp32"],
            "fp8": peaks.get("fp8"),
            "hbm": profile.device.memory_bandwidth_bytes_per_s,
        },
        "profile_memory_bytes": profile.device.memory_bytes,
    }
    memory = usable_memory() if DEVICE == "cuda" else {}
    out["memory"] = memory
    print(
        "memory: "
        + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in memory.items())
        + f"; profile memory_bytes {profile.device.memory_bytes / GiB:.2f} GiB"
    )
    rows = []
    sections = [
        ("matmul", matmul_rows, peaks["bf16"], "TF/s"),
        ("matmul-fp32", fp32_matmul_rows, peaks["fp32"], "TF/s"),
        ("fp8", fp8_rows, peaks.get("fp8") or peaks["bf16"], "TF/s"),
        ("attention", attention_rows, peaks["bf16"], "TF/s"),
        ("hbm", hbm_rows, profile.device.memory_bandwidth_bytes_per_s, "TB/s"),
    ]
    for title, measure, peak, unit in sections:
        print(f"\n== {title} (efficiency over {peak / 1e12:.0f} {unit[:2]}/s peak)")
        try:
            section = measure(args, peak)
        except Exception as exc:  # a section that cannot run says so; the others still do
            print(f"{title}: failed: {type(exc).__name__}: {exc}")
            continue
        print_rows(section, profile, unit)
        rows += section
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    out["rows"] = rows
    out["fits"] = fits(rows)
    print("\nfits of max * x / (x + half_size):")
    for kernel, fit in out["fits"].items():
        extra = f"max {fit['max']:.3f} half_size {fit['half_size']:.3g}" if "max" in fit else ""
        print(f"  {kernel:26} best {fit['best']:.3f}  {extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"written {args.json}")


if __name__ == "__main__":
    main()
