"""Run every notebook in notebooks/ and store it with its outputs (text and pictures), so that
GitHub and Jupyter show what each one prints without running it.

Each notebook is executed from the repository root by nbclient (as tests/test_notebooks.py runs
it) and written back with nbformat; its metadata records the SHA-256 of its cells' sources
(`sources_sha256`), and tests/test_notebooks.py fails when a cell's source changed after the
outputs were stored: re-run this script then. Run it after a change that moves what the
notebooks print (a cost-model change moves the plans' figures), on an idle machine:

    python3 scripts/render_notebooks.py            # all of them, about 2 minutes
    python3 scripts/render_notebooks.py 01_tour    # one
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"


def sources_digest(book: nbformat.NotebookNode) -> str:
    """The SHA-256 of the notebook's cell types and sources, in order."""
    text = "\0".join(f"{cell.cell_type}\0{cell.source}" for cell in book.cells)
    return hashlib.sha256(text.encode()).hexdigest()


def render(path: Path) -> float:
    """Execute ``path`` and store it with its outputs; returns the seconds it took."""
    import nbclient  # only here: the suite imports sources_digest without it

    book = nbformat.read(path, as_version=4)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    os.environ["MPLBACKEND"] = "Agg"
    client = nbclient.NotebookClient(
        book, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    )
    start = time.perf_counter()
    client.execute()
    for cell in book.cells:  # volatile: times and kernel ids would change every render
        cell.metadata.pop("execution", None)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    book.metadata["autopar"] = {"sources_sha256": sources_digest(book), "rendered_at": commit}
    nbformat.write(book, path)
    return time.perf_counter() - start


def main() -> None:
    names = sys.argv[1:]
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        if names and path.stem not in names:
            continue
        print(f"{path.relative_to(REPO)}: {render(path):.1f} s", flush=True)


if __name__ == "__main__":
    main()
