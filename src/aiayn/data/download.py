"""`aiayn download`: fetch a named corpus into the user cache (or --data-dir), sha256-checked.

The command sits above both corpora's modules (`data` for Multi30k, `wmt14`), so neither imports the other.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from aiayn.data import text as data, wmt14
from aiayn.errors import AiaynError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", choices=("multi30k", "wmt14"), default="multi30k",
                        help="multi30k, or wmt14 (English-German, ~1.7 GB of archives, unpacked to ~1.5 GB of text)")
    parser.add_argument("--src", default="de", help=f"source language, one of {', '.join(data.LANGS)}")
    parser.add_argument("--tgt", default="en", help=f"target language, one of {', '.join(data.LANGS)}")
    parser.add_argument("--splits", nargs="+", default=list(data.SPLITS), metavar="SPLIT", help=f"of {', '.join(data.SPLITS)}")
    parser.add_argument(
        "--data-dir",
        default=None,
        help=f"download into DIR/multi30k/ (else ${data.DATA_ENV}/multi30k/, else the user cache, "
        f"{data.multi30k_cache_dir()}): where train looks; then pass --data-dir DIR or set ${data.DATA_ENV}=DIR",
    )


def run(args: argparse.Namespace) -> int:
    data.check_data_dir(args.data_dir)
    if args.data == "wmt14":
        wmt14.check_pair(args.src, args.tgt)
        folder = wmt14.wmt14_folder(args.data_dir)
        wmt14.download_wmt14(folder)
        print(folder)
        return 0
    data.check_pair(args.src, args.tgt)
    for split in args.splits:
        data.check_split(split)
    root = args.data_dir or os.environ.get(data.DATA_ENV)  # where `multi30k_paths` will look for them
    folder = data.download_folder(Path(root).expanduser()) if root else data.multi30k_cache_dir()
    kept: list[data.KeptFile] = []
    for split in args.splits:
        for lang in (args.src, args.tgt):
            try:
                path = data.download_multi30k(split, lang, folder, replace=not root)  # a user's folder: never replaced
            except data.KeptFile as e:  # the user's own, named at the end: the other files are still fetched
                print(f"aiayn download: note: {e}", file=sys.stderr)
                kept.append(e)
                continue
            print(f"{path}  ok (sha256 checked)", file=sys.stderr)
    if kept:
        raise AiaynError(f"{len(kept)} file(s) in {folder} kept, not Multi30k's (named above); the others were "
                         "downloaded: move those away, then run the download again")
    print(folder)
    return 0
