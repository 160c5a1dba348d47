"""The ``autopar`` command line (also ``python -m autopar``).

Verbs: ``demo`` (the README's main job), ``plan``, ``explain``, ``compare``, ``replan``,
``generate``, ``export``, ``export-hf``, ``list-models``, ``list-profiles``, ``cluster``,
``profile``; each planning verb lives in a module of `autopar.cli` and is imported only when
it runs. Every verb that sizes a cluster takes ``--nodes`` / ``--devices`` (``--num-nodes`` /
``--num-devices`` still work). Exit codes: 0 success, 2 a usage error (argparse), 1 a user
error -- an autopar error (bad
profile, unknown model, a config that does not fit, ...), a file that cannot be read or written,
a value that cannot be parsed -- with its message on stderr and no traceback (``--traceback``
shows it), 130 interrupted. Output into a closed pipe (``autopar ... | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from autopar.errors import AutoparError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar", description="Auto-parallelism planner for PyTorch training."
    )
    parser.add_argument(
        "--traceback", action="store_true", help="on an error, show the Python traceback too"
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    demo = verbs.add_parser(
        "demo",
        help="trace a Hugging Face model on meta and plan it on a shipped cluster",
        epilog="example: autopar demo --model llama3-8b --profile dgx_h100 --nodes 2",
    )
    demo.add_argument("--model", default="llama3-8b", help="autopar.models.hf preset")
    demo.add_argument("--profile", default="dgx_h100", help="shipped profile or .toml path")
    demo.add_argument("--nodes", "--num-nodes", dest="num_nodes", type=int, default=2)
    demo.add_argument("--seq-len", type=int, default=8192)
    demo.add_argument("--out", default="out", help="directory for plan.json")
    demo.add_argument(
        "--local-groups",
        type=int,
        default=1,
        help="run the local plan as this many fault-tolerant replica groups over torchft "
        "(its lighthouse started here; default 1: one job)",
    )

    verbs.add_parser(
        "list-profiles",
        help="list the shipped hardware profiles",
        epilog="example: autopar list-profiles",
    )

    cluster = verbs.add_parser(
        "cluster",
        help="show a cluster built from a profile",
        epilog="examples: autopar cluster dgx_h100 --nodes 4 | "
        "autopar cluster tpu_v5p --slice 4x4x8",
    )
    cluster.add_argument("profile", help="shipped profile name or .toml path")
    cluster.add_argument("--nodes", "--num-nodes", dest="num_nodes", type=int, default=1)
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
    _add_planning_verbs(verbs)
    return parser


TRUST_HELP = (
    "import and call the model factory the plan file names even when it is not one of "
    "autopar's own (zoo, Hugging Face preset, config.json): only for a plan you trust"
)


def _add_planning_verbs(verbs: argparse._SubParsersAction) -> None:
    from autopar.cli.plan import PRECISIONS

    plan = verbs.add_parser(
        "plan",
        help="find the fastest parallel plan of a model on a cluster; write plan.json",
        epilog="example: autopar plan llama3-8b --profile dgx_h100 --nodes 2 --batch 512 "
        "-o out/  (MODEL: a zoo name or Hugging Face preset from `autopar list-models`, a "
        "config.json path, or module:factory)",
    )
    plan.add_argument("model", help="zoo name, Hugging Face preset, config.json or module:factory")
    plan.add_argument("--profile", default="dgx_h100", help="shipped profile or .toml path")
    plan.add_argument("--nodes", type=int, help="nodes of the profile (default 1)")
    plan.add_argument("--devices", type=int, help="total devices instead of --nodes")
    plan.add_argument("--batch", type=int, help="global batch in sequences (default ~4M tokens)")
    plan.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
    plan.add_argument(
        "--precision",
        default="bf16",
        choices=PRECISIONS,
        help="training dtype, a low-precision recipe for the linears (fp8 = fp8-tensorwise, "
        "fp8-rowwise, mxfp8, nvfp4), or auto: the fastest the device runs (default bf16)",
    )
    plan.add_argument(
        "--stack", help="software stack that will run the plan (default: autopar's runtime)"
    )
    plan.add_argument(
        "--loss", metavar="MODULE:FN", help="the loss to train with, fn(outputs, targets)"
    )
    plan.add_argument(
        "--moe-imbalance",
        type=float,
        help="MoE: the busiest ep rank's routed rows over the mean to price (default 1.0; a "
        "run's program prints the figure it measured)",
    )
    plan.add_argument(
        "--time-limit", type=float, help="search time limit in seconds (0: the first that fits)"
    )
    plan.add_argument(
        "--sites", type=int, default=1, help="the nodes split over this many sites (default 1)"
    )
    plan.add_argument(
        "--site-link-gbps", type=float, help="each site's wide-area uplink, Gb/s per direction"
    )
    plan.add_argument(
        "--site-latency-ms", type=float, default=10.0, help="latency between sites (default 10)"
    )
    plan.add_argument(
        "--algorithm",
        default="auto",
        choices=("auto", "sync", "ft", "diloco"),
        help="training algorithm: priced and chosen (auto), or one of synchronous, "
        "fault-tolerant replica groups, DiLoCo across sites",
    )
    plan.add_argument("--token-budget", type=float, help="tokens to train (default 20 a parameter)")
    plan.add_argument(
        "--diloco-token-overhead",
        type=float,
        default=0.05,
        help="assumed extra tokens DiLoCo needs to reach synchronous training's loss "
        "(default 0.05)",
    )
    plan.add_argument("-o", "--out", default="out", help="directory for plan.json (default out/)")
    plan.add_argument("--json", action="store_true", help="print the plan's JSON only")
    plan.add_argument("--plots", metavar="DIR", help="write pipeline/memory/breakdown PNGs here")

    explain = verbs.add_parser(
        "explain",
        help="why a saved plan: bottleneck, binding constraint, runners-up, sensitivity",
        epilog="example: autopar explain out/plan.json --summary",
    )
    explain.add_argument("plan", help="a plan.json")
    explain.add_argument("--summary", action="store_true", help="print the summary first")
    explain.add_argument("--plots", metavar="DIR", help="write the plan's PNGs here")

    compare = verbs.add_parser(
        "compare",
        help="a saved plan beside a config you give, on the same model, cluster and batch",
        epilog="example: autopar compare out/plan.json --config "
        "tp=8,pp=2,schedule=interleaved_1f1b,v=2,sp=1,recompute=full:3  (keys: dp fsdp tp pp "
        "cp ep zero mbs schedule v recompute[=policy:k] recompute_layers sp order=tp,cp,fsdp,dp; "
        "a config as plan summaries print it is read too)",
    )
    compare.add_argument("plan", help="a plan.json")
    compare.add_argument(
        "--config", required=True, help="key=value,... (ParallelConfig fields) or a config's text"
    )
    compare.add_argument("--profile", help="profile .toml path when the plan's is not shipped")
    compare.add_argument("--json", action="store_true", help="print both plans' JSON")
    compare.add_argument("--trust-factory", action="store_true", help=TRUST_HELP)

    replan = verbs.add_parser(
        "replan",
        help="plan a saved plan's model again for another cluster size; writes plan.json and "
        "train.py (resume from the old plan's checkpoints)",
        epilog="example: autopar replan out/plan.json --nodes 2 -o out-2/",
    )
    replan.add_argument("plan", help="a plan.json (with a model factory)")
    replan.add_argument(
        "--nodes", "--num-nodes", dest="num_nodes", type=int, help="nodes of the plan's profile"
    )
    replan.add_argument(
        "--devices", "--num-devices", dest="num_devices", type=int, help="total devices"
    )
    replan.add_argument("--config", help="price this config instead of searching (key=value,...)")
    replan.add_argument("--profile", help="profile .toml path when the plan's is not shipped")
    replan.add_argument("-o", "--out", default="out", help="directory for plan.json + train.py")
    replan.add_argument("--json", action="store_true", help="print the new plan's JSON only")
    replan.add_argument("--trust-factory", action="store_true", help=TRUST_HELP)

    generate = verbs.add_parser(
        "generate",
        help="write the torchrun program (train.py) of a saved plan",
        epilog="example: autopar generate out/plan.json -o run/ && "
        "torchrun --nproc-per-node=8 run/train.py",
    )
    generate.add_argument("plan", help="a plan.json (with a model factory)")
    generate.add_argument("-o", "--out", required=True, help="directory for plan.json + train.py")
    generate.add_argument("--trust-factory", action="store_true", help=TRUST_HELP)

    export = verbs.add_parser(
        "export",
        help="write a saved plan as another framework's configuration",
        epilog="example: autopar export out/plan.json --to torchtitan  (writes "
        "out/torchtitan.toml; megatron: megatron_args.sh, deepspeed: deepspeed.json, "
        "accelerate: accelerate.yaml)",
    )
    export.add_argument("plan", help="a plan.json")
    export.add_argument(
        "--to", required=True, choices=("torchtitan", "megatron", "deepspeed", "accelerate")
    )
    export.add_argument("-o", "--out", help="directory for the file (default: the plan's)")
    export.add_argument(
        "--no-price", action="store_true", help="skip re-pricing on the target's stack"
    )
    export.add_argument("--trust-factory", action="store_true", help=TRUST_HELP)

    weights = verbs.add_parser(
        "export-hf",
        help="write a training checkpoint as a Hugging Face checkpoint (safetensors)",
        epilog="example: autopar export-hf ckpt/ --plan out/plan.json --out hf/  (then "
        "AutoModelForCausalLM.from_pretrained('hf/'))",
    )
    weights.add_argument("checkpoint", help="train.py's --checkpoint-dir, or one step-N in it")
    weights.add_argument("-o", "--out", required=True, help="directory for the weights")
    weights.add_argument("--plan", help="the plan the run trained: its model's config is written")
    weights.add_argument("--config", help="a config.json to write beside the weights instead")
    weights.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    weights.add_argument("--max-shard-gb", type=float, default=5.0, help="largest file (GiB)")
    weights.add_argument("--trust-factory", action="store_true", help=TRUST_HELP)

    verbs.add_parser(
        "list-models",
        help="list the zoo models and Hugging Face presets",
        epilog="example: autopar list-models",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        text = _run(args)
        if text:  # `profile` prints on torchrun's rank 0 only
            print(text)
            sys.stdout.flush()  # a closed pipe shows here, inside the try
    except BrokenPipeError:
        # the reader went away (`| head`): nothing more to say; keep the interpreter's final
        # flush from raising again on the dead pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except (AutoparError, OSError, ValueError) as e:
        if args.traceback:
            raise
        print(f"autopar: error: {_message(e)}", file=sys.stderr)
        return 1
    return 0


def _message(error: BaseException) -> str:
    """The user's error in one line: an OS error with its path, a decoding error as such."""
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    if isinstance(error, UnicodeDecodeError):
        return f"a file that should be text is not (its bytes are not UTF-8): {error.reason}"
    return str(error) or type(error).__name__


_PLANNING_VERBS = {
    "plan": "autopar.cli.plan:run_plan",
    "explain": "autopar.cli.plan:run_explain",
    "compare": "autopar.cli.compare:run_compare",
    "list-models": "autopar.cli.models:run_list_models",
    "replan": "autopar.cli.replan:run_replan",
    "generate": "autopar.cli.generate:run_generate",
    "export": "autopar.cli.generate:run_export",
    "export-hf": "autopar.cli.weights:run_export_hf",
}


def _run(args: argparse.Namespace) -> str:
    # Imports inside the verbs keep `autopar --help` fast.
    if args.verb in _PLANNING_VERBS:
        import importlib

        module, function = _PLANNING_VERBS[args.verb].split(":")
        return getattr(importlib.import_module(module), function)(args)
    if args.verb == "demo":
        from autopar.cli.demo import run_demo

        return run_demo(
            args.model, args.profile, args.num_nodes, args.seq_len, args.out,
            local_groups=args.local_groups,
        )  # fmt: skip
    if args.verb == "profile":
        from autopar.profiler import ProfileOptions, profile

        return profile(ProfileOptions(args.out, args.nproc, args.quick, args.node_devices))
    if args.verb == "list-profiles":
        from autopar.hardware.profile import load_profile, shipped_profile_names

        return "\n".join(
            f"{name:<18} {load_profile(name).description}" for name in shipped_profile_names()
        )
    from autopar.hardware import Cluster

    shape = None
    if args.slice:
        try:
            shape = tuple(int(d) for d in args.slice.lower().split("x"))
        except ValueError:
            raise AutoparError(f"--slice wants dims like 4x4x4, got {args.slice!r}") from None
    return Cluster.from_profile(args.profile, args.num_nodes, slice_shape=shape).as_text()
