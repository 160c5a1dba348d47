#!/usr/bin/env bash
# Installs autopar and its development tools into the current Python (a virtual environment if
# one is active). torch is installed first, pinned to 2.13.0, and only when no torch is
# importable: an existing torch (a CUDA build, a nightly) is kept, and pip is never left to
# resolve a bare `torch` requirement, which would pull the newest CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
    echo "setup: no torch found, installing torch==2.13.0"
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[dev]"
echo "setup: autopar installed (editable) with the dev extras"
