"""The command line (``autopar``, ``python -m autopar``): it parses, dispatches and prints.

    main.py      the parser and the dispatcher; exit 0, 2 on a usage error, 1 on an autopar
                 error (its message on stderr, no traceback)
    plan.py      plan     models.load_model -> parallelize -> plan.json (+ pictures)
                 explain  plan.json -> Plan.explain()
    compare.py   compare  plan.json + a config -> evaluate on the same model and cluster
    replan.py    replan   plan.json + a new size -> replan -> plan.json + train.py
    generate.py  generate plan.json -> train.py
    models.py    which model a command means (zoo, Hugging Face preset, config.json,
                 module:factory); list-models
    demo.py      demo     the README's main job

Each verb returns the text to print; errors are `AutoparError`s with the numbers in the
message. The verbs call `autopar.api`, never a phase's internals.
"""

from __future__ import annotations

from autopar.cli.main import main

__all__ = ["main"]
