"""Merge exit heads of several files into one: ``python -m train_heads.merge OUT SRC[:EXITS]...``

    python -m train_heads.merge outputs/heads_4_7_14.safetensors \
        outputs/train_heads/mlp/heads.safetensors:4,14 \
        outputs/train_heads/adapter7/heads.safetensors:7

``SRC:4,14`` takes exits 4 and 14 of ``SRC``; a bare ``SRC`` takes all of its exits.  The
files must be made for the same base model; the result is an ordinary exit-heads file
(``model.exit_heads=OUT``), its metadata saying where each exit came from
(``specflow.models.exit_heads.merge_heads``).
"""

from __future__ import annotations

import argparse

from specflow.errors import ConfigError
from specflow.models.exit_heads import merge_heads


def parse_source(text: str) -> tuple[str, list[int] | None]:
    """``"path:4,14" -> ("path", [4, 14])``; ``"path" -> ("path", None)``."""
    path, sep, exits = text.rpartition(":")
    if not sep or not exits.replace(",", "").isdigit():
        return text, None
    return path, [int(e) for e in exits.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("sources", nargs="+", metavar="SRC[:EXITS]")
    args = ap.parse_args(argv)
    try:
        path = merge_heads(args.out, [parse_source(s) for s in args.sources])
    except ConfigError as exc:
        raise SystemExit(f"train_heads.merge: error: {exc}") from None
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
