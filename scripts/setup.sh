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
# every later install keeps that torch: packages that depend on torch (torchtitan, accelerate,
# deepspeed) must not replace it
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$("$PY" -c 'import torch; print(torch.__version__)')" > "$constraints"
"$PY" -m pip install --quiet -c "$constraints" -e ".[dev]"
# DeepSpeed ships only a source package; built without its CUDA ops against the torch above, it
# gives the exporter tests DeepSpeed's own config parser (they skip where it did not install)
DS_BUILD_OPS=0 "$PY" -m pip install --quiet -c "$constraints" --no-build-isolation \
    "deepspeed==0.19.8" || echo "setup: deepspeed did not install; its exporter test will skip"
echo "setup: autopar installed (editable) with the dev extras, torch $("$PY" -c 'import torch; print(torch.__version__)')"
