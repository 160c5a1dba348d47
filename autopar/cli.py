"""The ``autopar`` command line (also ``python -m autopar``).

Verbs so far: ``demo`` (the README's main job), ``list-profiles``, ``cluster``, ``profile``.
Exit codes: 0 success, 2 bad input (argparse's convention, also used for profile errors).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from autopar.errors import AutoparError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar", description="Auto-parallelism planner for PyTorch training."
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    demo = verbs.add_parser(
        "demo",
        help="trace a Hugging Face model on meta and plan it on a shipped cluster",
        epilog="example: autopar demo --model llama3-8b --profile dgx_h100 --num-nodes 2",
    )
    demo.add_argument("--model", default="llama3-8b", help="autopar.models.hf preset")
    demo.add_argument("--profile", default="dgx_h100", help="shipped profile or .toml path")
    demo.add_argument("--num-nodes", type=int, default=2)
    demo.add_argument("--seq-len", type=int, default=8192)
    demo.add_argument("--out", default="out", help="directory for plan.json")

    verbs.add_parser(
        "list-profiles",
        help="list the shipped hardware profiles",
        epilog="example: autopar list-profiles",
    )

    cluster = verbs.add_parser(
        "cluster",
        help="show a cluster built from a profile",
        epilog="examples: autopar cluster dgx_h100 --num-nodes 4 | "
        "autopar cluster tpu_v5p --slice 4x4x8",
    )
    cluster.add_argument("profile", help="shipped profile name or .toml path")
    cluster.add_argument("--num-nodes", type=int, default=1)
    cluster.add_argument("--slice", help="TPU slice shape, e.g. 4x4x4")

    prof = verbs.add_parser(
        "profile",
        help="measure this machine (under torchrun) and write a hardware profile",
        epilog="example: autopar profile --out hardware_profiles/local_cpu.toml --node-devices 8",
    )
    prof.add_argument("--out", required=True, help="profile .toml to write")
    prof.add_argument("--nproc", type=int, default=2, help="ranks to launch (default 2)")
    prof.add_argument("--quick", action="store_true", help="few sizes, seconds (for tests)")
    prof.add_argument("--node-devices", type=int, help="node.devices to write (default: --nproc)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        text = _run(args)
        if text:  # `profile` prints on torchrun's rank 0 only
            print(text)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> str:
    # Imports inside the verbs keep `autopar --help` fast.
    if args.verb == "demo":
        from autopar.demo import run_demo

        return run_demo(args.model, args.profile, args.num_nodes, args.seq_len, args.out)
    if args.verb == "profile":
        from autopar.profiler import ProfileOptions, profile

        return profile(ProfileOptions(args.out, args.nproc, args.quick, args.node_devices))
    if args.verb == "list-profiles":
        from autopar.hardware import load_profile, shipped_profile_names

        return "\n".join(
            f"{name:<18} {load_profile(name).description}" for name in shipped_profile_names()
        )
    from autopar.cluster import Cluster

    shape = None
    if args.slice:
        try:
            shape = tuple(int(d) for d in args.slice.lower().split("x"))
        except ValueError:
            raise AutoparError(f"--slice wants dims like 4x4x4, got {args.slice!r}") from None
    return Cluster.from_profile(args.profile, args.num_nodes, slice_shape=shape).as_text()
