"""Ship a ``decode_rows_sweep.py`` result as its GPU's per-GPU tile table (package data that
``kernels/decode_rows.py`` reads on the first lookup for a CUDA device of that name):

    python benchmarks/ship_decode_rows_table.py benchmarks/results/decode-rows-<gpu>-<sha>.json[.gz]
        [--out-dir dspark_trt/plugins/kernels/tables] [--buckets 1,2,4,8 [--keep]]

Writes ``decode-rows-<gpu>.json`` (the shapes' keys and winners, the sweep's git sha, GPU, file name
and command), replacing that GPU's table: one sweep per GPU (``decode_rows_sweep.py --rows
1,2,4,8,16`` covers every bucket; ``DSPARK_DECODE_ROWS_TABLE`` merges several for a trial run), or
with ``--keep`` only the ``--buckets`` given (the table's other rows stay, its head as ``kept_from``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_trt.plugins.kernels import decode_rows  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a decode_rows_sweep.py result (.json or .json.gz)")
    ap.add_argument("--out-dir", default=str(decode_rows.TABLES))
    ap.add_argument("--buckets", default=None,
                    help="ship only these token buckets (e.g. 1,2,4,8: the others keep the built-in tiles)")
    ap.add_argument("--keep", action="store_true",
                    help="with --buckets: keep the GPU's table's rows of the other buckets")
    args = ap.parse_args()
    if args.keep and args.buckets is None:
        ap.error("--keep needs --buckets (the buckets this result replaces)")
    buckets = None if args.buckets is None else [int(b) for b in args.buckets.split(",")]
    path = decode_rows.ship_table(args.result, args.out_dir, buckets, keep=args.keep)
    print(f"[ship] {len(decode_rows.read_table(path))} tiles of {args.result} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
