"""Time and memory of tracing the Llama 3 family on meta tensors, and FLOP error vs analytic.

    python3 benchmarks/trace_speed.py [llama3-8b llama3-70b llama3-405b]

Each model is traced in its own process (so peak RSS is that model's alone) at sequence length
8192. Prints: build time, trace time (autopar.trace: torch.export + per-op measurements),
peak RSS of the process, and the traced forward+backward FLOPs against the analytic count
6 x (params without input embedding) x tokens + 12 x layers x seq x hidden per token.
Targets (issue 3): 70B traced in <= 15 s, 405B in <= 30 s, peak RSS < 4 GiB.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

SEQ = 8192


def measure(name: str) -> dict[str, float]:
    import torch

    from autopar.models import hf
    from autopar.tracing import trace

    t0 = time.perf_counter()
    model = hf.build(name)
    build_s = time.perf_counter() - t0
    inputs = hf.example_inputs(name, model, seq_len=SEQ)
    t0 = time.perf_counter()
    graph = trace(model, inputs)
    trace_s = time.perf_counter() - t0
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    analytic = (6 * (params - embedding) + 12 * cfg.num_hidden_layers * SEQ * cfg.hidden_size) * SEQ
    traced = graph.forward_flops + graph.backward_flops
    del torch
    return {
        "build_s": build_s,
        "trace_s": trace_s,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "flop_error": traced / analytic - 1,
        "params_exact": float(graph.num_params == params),
        "nodes": len(graph.nodes),
        "classes": len(graph.classes),
    }


def main(names: list[str]) -> None:
    print(
        f"{'model':<12} {'build s':>8} {'trace s':>8} {'peak RSS GiB':>13} {'FLOP err':>9} "
        f"{'params exact':>12} {'nodes':>6}"
    )
    for name in names:
        out = subprocess.run(
            [sys.executable, __file__, "--one", name], capture_output=True, text=True, check=True
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{name:<12} {r['build_s']:8.2f} {r['trace_s']:8.2f} {r['peak_rss_gib']:13.2f} "
            f"{r['flop_error']:+9.4%} {bool(r['params_exact'])!s:>12} {r['nodes']:>6}"
        )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(measure(sys.argv[2])))
    else:
        main(sys.argv[1:] or ["llama3-8b", "llama3-70b", "llama3-405b"])
