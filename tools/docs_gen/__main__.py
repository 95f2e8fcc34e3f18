"""`python tools/docs_gen -o DIR`: write the generated reference pages into DIR (what the site build adds)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from docs_gen import generate_pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-o", "--out", type=Path, required=True, help="folder to write the pages into")
    args = parser.parse_args()
    for path, text in generate_pages().items():
        target = args.out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(target)


if __name__ == "__main__":
    main()
