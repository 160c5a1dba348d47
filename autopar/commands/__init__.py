"""The command line's planning verbs, one module each; `autopar.cli` only parses and dispatches.

    plan      models.load_model -> parallelize -> plan.json (+ pictures)      plan_verb.py
    explain   plan.json -> Plan.explain()                                     plan_verb.py
    compare   plan.json + a config -> evaluate on the same model and cluster  compare.py
    list-models  the zoo and the Hugging Face presets                         models.py

Each verb returns the text to print; errors are `AutoparError`s with the numbers in the
message (the dispatcher prints them without a traceback and exits 1).
"""
