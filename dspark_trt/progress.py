"""Progress bars for long work (weight loading, build stages, training, bench sweeps).

tqdm on standard error, shown only when it is a terminal (``disable=None``), so logs and CI output
stay line-oriented; ``DSPARK_PROGRESS=0`` turns them off, ``=1`` forces them on.
"""
from __future__ import annotations

import os

from tqdm.auto import tqdm


def bar(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it", leave: bool = False):
    flag = os.environ.get("DSPARK_PROGRESS")
    disable = None if flag is None else flag == "0"
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, disable=disable, dynamic_ncols=True)
