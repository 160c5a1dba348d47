"""Print the cost model's figures next to the published ones they are checked against.

    python3 benchmarks/cost_model_checks.py

Collectives: nccl-tests bus bandwidth on DGX H100 (data/hardware_specs.csv notes).
Activation memory: Korthikanti et al. 2022, sec 4 formulas, for the paper's model shapes.
Pipeline: bubble fractions of the event simulation against the closed forms.
The same comparisons are asserted by tests in tests/; this script shows the numbers.
"""

from __future__ import annotations

from autopar import Cluster
from cost_models.memory import model_state_bytes, transformer_layer_activation_bytes
from cost_models.pipeline import simulate_pipeline

GiB = 2**30


def collectives() -> None:
    print("Collectives on DGX H100 (predicted vs measured bus bandwidth)")
    one = Cluster.from_profile("dgx_h100")
    est = one.collective_time("all_reduce", 8 * GiB, range(8))
    bw = est.bus_bandwidth_bytes_per_s / 1e9
    print(
        f"  8 GPUs, 1 node, all-reduce 8 GiB: {est.algorithm:<12} {bw:6.1f} GB/s   "
        f"measured 480.2  error {bw / 480.16 - 1:+.1%}"
    )
    two = Cluster.from_profile("dgx_h100", num_nodes=2)
    est = two.collective_time("all_reduce", 8 * GiB, range(16))
    per_nic = est.bus_bandwidth_bytes_per_s / 8 / 1e9
    print(
        f"  16 GPUs, 2 nodes, all-reduce 8 GiB: {est.algorithm:<11} {per_nic:6.1f} GB/s per NIC"
        f"   measured 46-48  error {per_nic / 47 - 1:+.1%} vs 47"
    )
    for size in (2**10, 2**20, 2**30):
        e = two.collective_time("all_reduce", size, range(16))
        print(f"    {size:>10} B: {e.algorithm:<12} {e.time_s * 1e6:10.1f} us")


def activations() -> None:
    print("\nActivation bytes per layer (ours vs Korthikanti et al. 2022)")
    shapes = {"GPT-3 175B": (12288, 96), "MT-NLG 530B": (20480, 128), "1T": (25600, 160)}
    s, b, t = 2048, 1, 8
    for name, (h, a) in shapes.items():
        cases = {
            "none": ({}, s * b * h * (34 + 5 * a * s / h)),
            "tp": ({"tp": t}, s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
            "tp+sp": ({"tp": t, "sequence_parallel": True}, s * b * h / t * (34 + 5 * a * s / h)),
            "tp+sp+selective": (
                {"tp": t, "sequence_parallel": True, "recompute": "selective"},
                34 * s * b * h / t,
            ),
            "tp+sp+full": (
                {"tp": t, "sequence_parallel": True, "recompute": "full"},
                2 * s * b * h / t,
            ),
        }
        for case, (kwargs, paper) in cases.items():
            ours = transformer_layer_activation_bytes(
                seq_len=s, micro_batch_size=b, hidden=h, num_heads=a, **kwargs
            ).total_bytes
            print(
                f"  {name:<12} {case:<16} ours {ours / GiB:8.3f} GiB  paper {paper / GiB:8.3f}"
                f" GiB  error {ours / paper - 1:+.2%}"
            )


def model_state() -> None:
    print("\nModel state, 7.5B params, 64 devices, mixed-precision Adam (ZeRO paper Figure 1)")
    paper = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in paper.items():
        ours = (
            model_state_bytes(
                7.5e9, precision="bf16", optimizer="adamw", zero_stage=stage, shard_degree=64
            ).total_bytes
            / 1e9
        )
        print(
            f"  ZeRO-{stage}: ours {ours:6.1f} GB  paper {gb:6.1f} GB  error {ours / gb - 1:+.2%}"
        )


def pipelines() -> None:
    print("\nPipeline bubble, uniform stages f=1, b_input=1, b_weight=1")
    for p, m in ((4, 8), (4, 16), (8, 32)):
        for schedule, v, closed in (
            ("gpipe", 1, (p - 1) / m),
            ("1f1b", 1, (p - 1) / m),
            ("interleaved_1f1b", 2, (p - 1) / (2 * m)),
            ("zero_bubble", 1, None),
            ("dualpipe_v", 2, None),
        ):
            r = simulate_pipeline(
                schedule,
                p,
                m,
                forward_s=[1.0] * p,
                backward_input_s=[1.0] * p,
                backward_weight_s=[1.0] * p,
                virtual_stages=v,
            )
            ref = "" if closed is None else f"  closed form {closed:.4f}"
            peak = ", ".join(f"{x:g}" for x in r.peak_inflight_microbatches)
            print(
                f"  p={p} m={m:<3} {schedule:<17} bubble {r.bubble_fraction:.4f}{ref:<22}"
                f" step {r.step_time_s:6.1f}  in-flight [{peak}]"
            )


if __name__ == "__main__":
    collectives()
    activations()
    model_state()
    pipelines()
