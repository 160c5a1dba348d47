"""Suite-wide collection order: the heaviest test files first.

The README's test command runs files on pytest-xdist workers (`--dist loadfile`), which hand
out whole files in collection order as workers free up. Collected alphabetically, the files
of README blocks, notebooks and packaging come last, and one worker runs them alone after
the others are done. Files are ordered here by how many of their tests are marked ``slow``
or ``multiprocess`` (those start ranks, notebooks or wheel builds), most first, so that the
light files fill the end instead; the tests of a file keep their order.
"""

from __future__ import annotations

from collections import Counter

HEAVY = ("slow", "multiprocess")


def pytest_collection_modifyitems(session, config, items) -> None:
    weight: Counter[str] = Counter(
        str(item.path) for item in items if any(item.get_closest_marker(m) for m in HEAVY)
    )
    # a stable sort: files of equal weight, and each file's tests, keep the collection order
    items.sort(key=lambda item: -weight[str(item.path)])
