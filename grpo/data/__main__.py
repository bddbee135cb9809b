"""Named sets as local files, for machines without the Hub:

    python -m grpo.data list                                  # the named sets (docs/data.md)
    python -m grpo.data fetch gsm8k_train gsm8k_test --out DIR

`fetch` runs where the Hugging Face Hub is reachable (or the HF cache holds the sets) and writes
DIR/<file> for each set: its rows exactly as published, one JSON object a line. A run then reads
them with `data.data_dir=DIR` (and `eval_data.data_dir=DIR`), never touching the Hub. Each file is
written under a temporary name and renamed into place, so a file that is there is complete.
Exit 2 with one line when a name is unknown, a set cannot be had or --out cannot be written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from grpo.data.load import DataConfig, DataError, named_set_rows
from grpo.data.sets import NAMED_SETS


def fetch(names: list[str], out: Path) -> None:
    unknown = [n for n in names if n not in NAMED_SETS]
    if unknown:
        raise DataError(f"unknown named set {', '.join(map(repr, unknown))} (named sets: {', '.join(NAMED_SETS)})")
    try:  # before anything is fetched: a folder that cannot be made (under /proc, under a file) is one line
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "it is a file" if isinstance(e, FileExistsError) else e.strerror or e
        raise DataError(f"--out {out}: cannot make the folder ({why})") from None
    for name in names:
        named = NAMED_SETS[name]
        _, origin, rows = named_set_rows(named, DataConfig(dataset=name))
        path = out / named.file
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for _, row in rows:
                    f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:  # no permission, a full disk: the file is not there, nor half of it
            tmp.unlink(missing_ok=True)
            raise DataError(f"--out {out}: cannot write {path.name} ({e.strerror or e})") from None
        print(f"{name}: {len(rows)} rows of {origin} -> {path}")
    print(f"read them with data.data_dir={out} (eval_data.data_dir={out} for a held-out set)")


def list_sets() -> None:
    for s in NAMED_SETS.values():
        print(f"{s.name:12s} {s.hub_id} (config {s.config or 'default'}, split {s.split}): {s.rows} rows, "
              f"question {s.question_key!r}, answer {s.answer_key!r} ({s.answer_format}) -> {s.file}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo.data", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the named sets")
    f = sub.add_parser("fetch", help="write named sets as local files (rows as published)")
    f.add_argument("names", nargs="+", metavar="NAME", help=", ".join(NAMED_SETS))
    f.add_argument("--out", required=True, type=Path, help="folder to write DIR/<file> into")
    args = ap.parse_args(argv)
    if args.command == "list":
        list_sets()
        return 0
    try:
        fetch(args.names, args.out)
    except DataError as e:
        print(f"python -m grpo.data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
