"""Write tests/autopar/codegen/data/megatron_lm_options.json from a Megatron-LM checkout: every
option of its own argument parser (names, flag or value, type, choices). The exporter's tests
parse `autopar export --to megatron` output with a parser rebuilt from this list, because
Megatron-LM's training package is not on PyPI.

    PYTHONPATH=/path/to/Megatron-LM python3 scripts/megatron_options.py COMMIT DATE

Megatron imports triton and, in places, Python 3.12's typing.override: install triton (or put
it on PYTHONPATH) and run with 3.12, or let this script supply a no-op `override` on 3.11.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests/autopar/codegen/data/megatron_lm_options.json"


def main() -> None:
    commit, date = sys.argv[1], sys.argv[2]
    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # type: ignore[attr-defined]
    sys.argv = sys.argv[:1]
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    flags = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)
    options = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        kind = getattr(action.type, "__name__", None)
        choices = None if action.choices is None else [str(c) for c in action.choices]
        nargs = action.nargs if isinstance(action.nargs, str | int) else None
        options.append(
            {
                "options": action.option_strings,
                "flag": isinstance(action, flags),
                "type": kind if kind in ("int", "float", "str") else None,
                "choices": choices,
                "nargs": nargs,
            }
        )
    source = (
        f"NVIDIA/Megatron-LM commit {commit} ({date}), "
        "megatron.training.arguments.add_megatron_arguments: every option of Megatron-LM's own "
        "parser, with its kind and choices (scripts/megatron_options.py writes this file)"
    )
    OUT.write_text(json.dumps({"source": source, "options": options}, indent=0) + "\n")
    print(f"wrote {len(options)} options to {OUT}")


if __name__ == "__main__":
    main()
