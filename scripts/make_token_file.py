"""Write data/tokens/autopar-docs.bin: this repository's own prose as byte-level token ids, the
small real-text corpus the generated program's --tokens option is tested and demonstrated on.

Each ASCII byte of README.md, docs/architecture.md and hardware_profiles/README.md (in that
order, non-ASCII characters dropped) is one token id in [0, 128): the vocabulary of the tiny
models (`llama-tiny-hf` has 128). Written flat as uint16, the format nanoGPT's prepare scripts
write, so any tokenizer's output in that format reads the same way.

    python3 scripts/make_token_file.py
"""

from __future__ import annotations

from pathlib import Path

from autopar.runtime.data import write_tokens

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("README.md", "docs/architecture.md", "hardware_profiles/README.md")


def main() -> None:
    text = "\n".join((REPO / name).read_text() for name in SOURCES)
    ids = [b for b in text.encode("utf-8") if b < 128]
    path = write_tokens(REPO / "data/tokens/autopar-docs.bin", ids)
    print(f"wrote {len(ids):,} tokens to {path}")


if __name__ == "__main__":
    main()
