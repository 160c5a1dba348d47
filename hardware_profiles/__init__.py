"""Shipped hardware profiles: one TOML per machine type (format in README.md beside this file).

This is a package only so that the TOML files ship inside the wheel and are found with
``importlib.resources`` from an installed copy; it holds no code.
"""
