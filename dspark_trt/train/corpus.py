"""The training text: the running interpreter's standard-library sources, split by module name.

Files are ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded), in sorted
relative-path order, read as UTF-8 (files that are not valid UTF-8 are skipped and counted). A file
is *held out* when one component of its dotted module name, with a ``test_`` prefix removed, is in
``HELDOUT``: ``json/decoder.py`` and ``test/test_json/test_fail.py`` both go to evaluation. The rule
depends on names only, so the split is the same on every machine; the stdlib itself differs a little
between Python versions, which ``CorpusManifest.files_sha256`` records.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# Held-out top-level modules (present in Python 3.11 and 3.12).
HELDOUT = ("argparse", "calendar", "csv", "difflib", "fractions", "heapq", "json", "pprint",
           "statistics", "textwrap")
# The shipped default pair's held-out stdlib modules: every stdlib module of its run's evaluation
# split (benchmarks/results/train-h200-f85e5cd; the target and the drafts never saw them).
# Prompts for benchmarks of that pair come from these (HELDOUT above is the one-shot recipe's).
DEFAULT_PAIR_HELDOUT = ("dis", "nturl2path", "pickle", "poplib", "secrets", "ssl")
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


@dataclass
class SourceFile:
    module: str          # dotted module name, e.g. "json.decoder"
    text: str
    sha256: str          # of the raw bytes


@dataclass
class CorpusManifest:
    """What the data pipeline read: enough to tell whether two runs saw the same files."""

    stdlib_dir: str
    python_version: str
    train_files: int = 0
    heldout_files: int = 0
    train_bytes: int = 0
    heldout_bytes: int = 0
    skipped_not_utf8: list[str] = field(default_factory=list)
    files_sha256: str = ""      # sha256 over "split module sha256\n" lines in reading order
    heldout_sha256: str = ""    # the same over the held-out lines only (what evaluation reads)


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] or ["__init__"]
    return ".".join(parts)


def is_heldout(module: str, heldout: tuple[str, ...] = HELDOUT) -> bool:
    return any(p.removeprefix("test_") in heldout for p in module.split("."))


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_stdlib(root: Path | None = None, heldout: tuple[str, ...] = HELDOUT,
                every: int = 1) -> tuple[list[SourceFile], list[SourceFile], CorpusManifest]:
    """-> (train files, held-out files, manifest). ``every=k`` keeps every k-th training file (smoke
    runs); held-out files are always all kept."""
    import platform
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory {root} does not exist")
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    paths = sorted(p for p in root.rglob("*.py")
                   if not any(s in p.relative_to(root).parts for s in SKIP_DIRS))
    man = CorpusManifest(str(root), platform.python_version())
    train, held, digest, held_digest = [], [], hashlib.sha256(), hashlib.sha256()
    n_train_seen = 0
    for p in paths:
        mod = module_name(p.relative_to(root))
        if not is_heldout(mod, heldout):
            n_train_seen += 1
            if (n_train_seen - 1) % every:
                continue
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            man.skipped_not_utf8.append(mod)
            continue
        f = SourceFile(mod, text, hashlib.sha256(raw).hexdigest())
        split = "heldout" if is_heldout(mod, heldout) else "train"
        (held if split == "heldout" else train).append(f)
        digest.update(f"{split} {mod} {f.sha256}\n".encode())
        if split == "heldout":
            held_digest.update(f"{split} {mod} {f.sha256}\n".encode())
    man.train_files, man.heldout_files = len(train), len(held)
    man.train_bytes = sum(len(f.text.encode()) for f in train)
    man.heldout_bytes = sum(len(f.text.encode()) for f in held)
    man.files_sha256, man.heldout_sha256 = digest.hexdigest(), held_digest.hexdigest()
    if not train or not held:
        raise ValueError(f"stdlib split under {root} is empty: {len(train)} train, {len(held)} "
                         f"held-out files (every={every}, held-out modules {heldout})")
    return train, held, man
