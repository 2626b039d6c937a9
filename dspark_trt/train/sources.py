"""The training corpus: ``.py`` sources of the standard library and of installed packages,
recorded file by file and split three ways.

A *root* is a name (``stdlib``, ``torch``, ...) and a directory. Every ``*.py`` file under it
(``site-packages``/``__pycache__`` excluded, files over ``max_file_bytes`` skipped) is one entry
``{root, path, sha256, bytes, split}``. The split is decided per *unit* (the root plus the first
``unit_depth`` path components, e.g. ``torch/nn`` or ``stdlib/json``) by a seeded hash of the
unit's name alone, so a unit lands in the same split whatever other files or packages a machine
has, and a whole module tree is either seen by the target or not:

  target    the target is trained on it
  distill   prompts for the self-distilled draft data (the target never saw these files)
  eval      held-out evaluation (acceptance prompts, held-out generated text)

The manifest (``corpus_manifest.json`` in the run directory) is the definition of the corpus:
later stages read the recorded list and check every file's hash, never rediscover files.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

SPLITS = ("target", "distill", "eval")
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
DEFAULT_PACKAGES = ("torch", "numpy", "triton", "tqdm", "safetensors", "tokenizers")
MANIFEST = "corpus_manifest.json"
BIG_DIRS = ("test", "tests", "testing")


class CorpusError(ValueError):
    """The recorded corpus does not match the files on this machine."""


@dataclass
class SplitSpec:
    """Fractions of units per split (the rest trains the target), the unit depth and the seed."""

    eval_frac: float = 0.06
    distill_frac: float = 0.14
    unit_depth: int = 1
    seed: int = 0
    max_file_bytes: int = 400_000


@dataclass
class Manifest:
    spec: dict
    roots: dict[str, str]                       # root name -> directory
    files: list[dict] = field(default_factory=list)   # {root, path, sha256, bytes, split}
    skipped: list[str] = field(default_factory=list)  # "root/path: why"
    python_version: str = ""

    def by_split(self, split: str) -> list[dict]:
        return [f for f in self.files if f["split"] == split]

    def sha256(self, split: str | None = None) -> str:
        """Digest over ``split root path sha256`` lines (all files, or one split)."""
        h = hashlib.sha256()
        for f in self.files:
            if split is None or f["split"] == split:
                h.update(f"{f['split']} {f['root']} {f['path']} {f['sha256']}\n".encode())
        return h.hexdigest()

    def counts(self) -> dict:
        return {s: {"files": len(self.by_split(s)), "bytes": sum(f["bytes"] for f in self.by_split(s))}
                for s in SPLITS}

    def to_json(self) -> str:
        return json.dumps({"spec": self.spec, "roots": self.roots, "python_version": self.python_version,
                           "counts": self.counts(), "sha256": {s: self.sha256(s) for s in SPLITS},
                           "skipped": self.skipped, "files": self.files}, indent=0)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        d = json.loads(text)
        return cls(d["spec"], d["roots"], d["files"], d.get("skipped", []), d.get("python_version", ""))


def default_roots(packages=DEFAULT_PACKAGES) -> dict[str, Path]:
    """The stdlib plus every package of ``packages`` importable here (absent ones are left out)."""
    roots = {"stdlib": Path(sysconfig.get_paths()["stdlib"])}
    for name in packages:
        spec = importlib.util.find_spec(name)
        locs = list(spec.submodule_search_locations or []) if spec else []
        if locs:
            roots[name] = Path(locs[0])
    return roots


def unit_of(root: str, rel: str, depth: int) -> str:
    """``torch``, ``nn/modules/linear.py``, depth 1 -> ``torch/nn``; a top-level file is its own
    unit (``stdlib/json`` for ``json/decoder.py``, ``stdlib/heapq`` for ``heapq.py``); under a test
    directory one level more (``stdlib/test/test_json``)."""
    parts = rel.split("/")
    if parts[0] in BIG_DIRS:              # stdlib's test/ is a third of it: split one level down
        depth += 1
    head = parts[:-1][:depth] or [parts[-1].removesuffix(".py")]
    return "/".join([root] + head)


def split_of(unit: str, spec: SplitSpec) -> str:
    """Seeded hash of the unit name -> one of SPLITS (independent of every other file)."""
    u = int.from_bytes(hashlib.sha256(f"{spec.seed}:{unit}".encode()).digest()[:8], "big") / 2**64
    if u < spec.eval_frac:
        return "eval"
    if u < spec.eval_frac + spec.distill_frac:
        return "distill"
    return "target"


def scan(roots: dict[str, Path], spec: SplitSpec) -> Manifest:
    """Walk the roots (sorted) and record every file with its hash and split."""
    man = Manifest(spec.__dict__.copy(), {k: str(v) for k, v in roots.items()},
                   python_version=platform.python_version())
    for name in sorted(roots):
        root = Path(roots[name])
        if not root.is_dir():
            raise CorpusError(f"corpus root '{name}' ({root}) is not a directory")
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(root)
            if any(s in rel.parts for s in SKIP_DIRS):
                continue
            raw = p.read_bytes()
            key = f"{name}/{rel.as_posix()}"
            if len(raw) > spec.max_file_bytes:
                man.skipped.append(f"{key}: {len(raw)} bytes > {spec.max_file_bytes}")
                continue
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                man.skipped.append(f"{key}: not UTF-8")
                continue
            man.files.append({"root": name, "path": rel.as_posix(),
                              "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw),
                              "split": split_of(unit_of(name, rel.as_posix(), spec.unit_depth), spec)})
    for s in SPLITS:
        if not man.by_split(s):
            raise CorpusError(f"split '{s}' is empty ({len(man.files)} files over roots "
                              f"{sorted(roots)}): use more roots or other fractions")
    return man


def read_texts(man: Manifest, split: str) -> list[str]:
    """The recorded files of ``split``, in manifest order; a missing or changed file is an error
    (the run directory was made from other sources)."""
    out = []
    for f in man.by_split(split):
        p = Path(man.roots[f["root"]]) / f["path"]
        if not p.exists():
            raise CorpusError(f"{f['root']}/{f['path']} of the recorded corpus is missing ({p})")
        raw = p.read_bytes()
        if hashlib.sha256(raw).hexdigest() != f["sha256"]:
            raise CorpusError(f"{p}: sha256 differs from the recorded corpus")
        out.append(raw.decode("utf-8"))
    return out


def load_or_scan(run_dir: Path, roots: dict[str, Path] | None, spec: SplitSpec) -> Manifest:
    """The run's manifest: read it if the run has one, else scan ``roots`` and write it."""
    path = Path(run_dir) / MANIFEST
    if path.exists():
        return Manifest.from_json(path.read_text())
    man = scan(roots if roots is not None else default_roots(), spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(man.to_json())
    return man
