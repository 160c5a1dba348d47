"""``python -m autopar``: the same as the ``autopar`` console script."""

from autopar.cli import main

raise SystemExit(main())
