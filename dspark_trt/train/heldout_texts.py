"""The shipped default pair's held-out texts, frozen: the stdlib modules of its training run's
evaluation split (``corpus.DEFAULT_PAIR_HELDOUT``), as the Python of that run (3.12 on the H200)
had them.

Prompts cut from the running interpreter's stdlib differ between Python versions (``dis.py`` and
``pickle.py`` changed from 3.11 to 3.12), so the CPU (3.11) and the GPU machine (3.12) benchmarked
the pair on different text: session 45 found the two machines' first rounds parting at requests 0
and 2 for that reason alone. ``bench --prompts heldout`` reads this file instead, the same bytes on
every machine. CPython's sources, under the PSF license (https://docs.python.org/3/license.html).

    python -m dspark_trt.train.heldout_texts [--out PATH]   # written from this interpreter's stdlib
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import platform
import sys
from pathlib import Path

from ..atomic_write import write_bytes_atomic
from ..config.source import DEFAULT_ASSETS
from .corpus import DEFAULT_PAIR_HELDOUT, read_stdlib

HELDOUT_TEXTS = DEFAULT_ASSETS / "heldout_texts.json.gz"


class HeldoutTextsError(ValueError):
    """The frozen held-out texts are missing or not what they say they are."""


def write_heldout_texts(path: str | Path = HELDOUT_TEXTS) -> dict:
    """This interpreter's held-out stdlib files -> ``path`` (gzipped JSON; written to a temporary
    file and renamed, so a half-written file never exists). Returns the written record."""
    _, held, man = read_stdlib(heldout=DEFAULT_PAIR_HELDOUT)
    record = {"python_version": platform.python_version(), "heldout": list(DEFAULT_PAIR_HELDOUT),
              "license": "CPython sources, PSF license", "heldout_sha256": man.heldout_sha256,
              "files": [{"module": f.module, "sha256": f.sha256, "text": f.text} for f in held]}
    write_bytes_atomic(path, gzip.compress(json.dumps(record).encode("utf-8"), compresslevel=9))
    return record


def load_heldout_texts(path: str | Path = HELDOUT_TEXTS) -> list[str]:
    """The frozen texts, in the stdlib's sorted order, each checked against its sha256."""
    path = Path(path)
    if not path.is_file():
        raise HeldoutTextsError(f"{path}: the default pair's held-out texts are missing (the package's "
                                f"assets are incomplete; reinstall it)")
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            files = json.load(fh)["files"]
        texts = [(f["module"], f["sha256"], f["text"]) for f in files]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
        raise HeldoutTextsError(f"{path}: not a held-out texts file ({type(e).__name__}: {e})") from None
    for module, sha, text in texts:
        if hashlib.sha256(text.encode("utf-8")).hexdigest() != sha:
            raise HeldoutTextsError(f"{path}: the text of {module} does not match its sha256")
    if not texts:
        raise HeldoutTextsError(f"{path}: holds no texts")
    return [t for _, _, t in texts]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HELDOUT_TEXTS))
    a = ap.parse_args(argv)
    rec = write_heldout_texts(a.out)
    print(f"[heldout-texts] Python {rec['python_version']}: {len(rec['files'])} files "
          f"({', '.join(f['module'] for f in rec['files'])}), heldout_sha256 {rec['heldout_sha256'][:12]} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
