"""Where a build writes: the output-directory policy, the atomic write, stale temporary directories.

The builder only ever deletes what it wrote itself:

* an output path that does not exist, or an empty directory, is used (the empty directory's mode
  is kept);
* a directory that holds one of our engines (a ``manifest.json`` of ours, and no file it does
  not list) is replaced as a whole, atomically;
* any other existing path is refused up front, before models load (``OutputError`` names it);
  with ``force`` the engine goes into the sub-directory ``DIR/<model>`` instead and nothing in
  ``DIR`` is touched.

The engine is written into a temporary sibling ``.NAME.building-<host>-<pid>-XXXX`` and renamed
into place as the last step (the rename is not interrupted by SIGINT / SIGTERM). Temporary
directories left behind by builds that died (process gone on this host, or older than
``STALE_AFTER_S``) are removed at the next build of the same output.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..interrupts import deferred_interrupts
from ..engine.manifest import MANIFEST, EngineError

STALE_AFTER_S = 6 * 3600          # a temporary directory this old is stale whatever its owner
_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:40] or "host"
_TEMP_KINDS = ("building", "old")


class OutputError(EngineError):
    """The build output path cannot be used without deleting files the builder did not write."""


# ---- what is at the output path ---------------------------------------------------------------

def unlisted_files(engine_dir: Path) -> list[str] | None:
    """Files in ``engine_dir`` that its manifest does not list (None: no manifest of ours)."""
    try:
        m = json.loads((engine_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(m, dict) and "format_version" in m and isinstance(m.get("files"), dict)
            and "backend" in m):
        return None
    listed = set(m["files"]) | {MANIFEST}
    holders = {str(parent) for f in listed for parent in Path(f).parents}       # dirs of listed files
    extra = []
    for p in engine_dir.rglob("*"):
        rel = str(p.relative_to(engine_dir))
        if p.is_dir() and not p.is_symlink():
            if rel not in holders:                  # e.g. an (empty) directory of the user's
                extra.append(rel)
        elif rel not in listed:
            extra.append(rel)
    return sorted(extra)


def holds_engine(path: Path) -> bool:
    """True when ``path`` is a directory holding only one of our engines' files."""
    return path.is_dir() and not path.is_symlink() and unlisted_files(path) == []


def _why_not_usable(path: Path) -> str | None:
    """None when a build may write ``path``; else why not (to put in the error)."""
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_dir():
        return "it exists and is not a directory"
    try:
        names = sorted(p.name for p in path.iterdir())
        extra = unlisted_files(path) if names else []
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if extra is None:
        return (f"it holds files that are not an engine ({_few(names)}); the build would replace "
                "the whole directory")
    if extra:
        return f"it holds an engine plus files the engine does not list ({_few(extra)})"
    cwd = _cwd()
    if cwd is not None and (path == cwd or path in cwd.parents):
        return "it is (or contains) the current directory"
    return None


def _cwd() -> Path | None:
    try:
        return Path.cwd().resolve()
    except OSError:                                 # the current directory was deleted
        return None


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def safe_name(model: str) -> str:
    """A directory name for ``model`` (``org/name`` -> ``org_name``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", model).strip(".") or "engine"


def choose_output(output: str | Path, model: str, force: bool = False) -> tuple[Path, str | None]:
    """-> (directory to write, note for the user or None); raises ``OutputError`` up front when
    ``output`` holds files that are not ours (with ``force``: ``output/<model>`` is used instead,
    and must itself be absent, empty or an engine)."""
    path = Path(output).expanduser().resolve()
    why = _why_not_usable(path)
    if why is None:
        return path, None
    is_dir = path.is_dir() and not path.is_symlink()
    if not force or not is_dir:
        hint = (f", or add --force to build into {path / safe_name(model)} (files in {path} are "
                "never deleted)") if is_dir else ""
        raise OutputError(f"--output {path}: refusing to build there: {why}. Nothing was changed; "
                          f"choose another --output{hint}")
    sub = path / safe_name(model)
    why_sub = _why_not_usable(sub)
    if why_sub is not None:
        raise OutputError(f"--output {path} --force: refusing to build into {sub} too: {why_sub}. "
                          "Nothing was changed; choose another --output")
    return sub, (f"--force: {path} holds files that are not an engine; writing the engine to {sub} "
                 f"instead (nothing in {path} is touched)")


# ---- temporary directories of builds ----------------------------------------------------------

def _temp_prefix(output: Path, kind: str) -> str:
    return f".{output.name}.{kind}-{_HOST}-{os.getpid()}-"


def _temp_owner(output: Path, entry: Path) -> tuple[str, str | None, int | None] | None:
    """(kind, host, pid) of one of our temporary directories next to ``output``; else None.
    Names of older builds (``.NAME.building-XXXX``) have no host and pid."""
    for kind in _TEMP_KINDS:
        head = f".{output.name}.{kind}-"
        if entry.name.startswith(head):
            rest = entry.name[len(head):]
            m = re.fullmatch(r"(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-[a-z0-9_]{8}", rest)
            if m:
                return kind, m["host"], int(m["pid"])
            if kind == "building" and re.fullmatch(r"[a-z0-9_]{8}", rest):   # tempfile's suffix
                return kind, None, None
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:              # someone else's live process
        return True
    return True


def stale_temp_dirs(output: str | Path, max_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Our temporary directories next to ``output`` whose build is over: the process that made
    it is gone (same host), or it is older than ``max_age_s``. An ``.old`` directory (a replaced
    engine being deleted) counts only once ``output`` exists again."""
    output = Path(output).expanduser().resolve()
    if not output.parent.is_dir():
        return []
    now, out = time.time(), []
    for entry in output.parent.iterdir():
        owner = _temp_owner(output, entry)
        if owner is None or not entry.is_dir() or entry.is_symlink():
            continue
        kind, host, pid = owner
        if kind == "old" and not output.exists():
            continue
        mine = host == _HOST and pid is not None
        if mine and (pid == os.getpid() or _alive(pid)):
            continue                                  # a live build on this host: never stale
        try:
            old = now - entry.stat().st_mtime > max_age_s
        except FileNotFoundError:
            continue
        if mine or old:                               # its process is gone, or age decides
            out.append(entry)
    return sorted(out)


def clean_stale_temp_dirs(output: str | Path, max_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove ``stale_temp_dirs(output)``; returns what was removed."""
    stale = stale_temp_dirs(output, max_age_s)
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    return stale


# ---- the atomic write --------------------------------------------------------------------------

def _default_dir_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


@contextmanager
def atomic_engine_dir(output: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to ``output``; on success it replaces ``output``.

    ``output`` must be absent, an empty directory (its mode is kept) or one of our engines; any
    other content raises ``OutputError`` (checked again at the swap) and is left untouched. Any
    exception inside the block removes the temporary directory and leaves ``output`` as it was.
    """
    output = Path(output).expanduser().resolve()
    why = _why_not_usable(output)
    if why is not None:
        raise OutputError(f"{output}: refusing to replace it: {why}")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(output, "building"), dir=output.parent))
    try:
        yield tmp
        with deferred_interrupts():                 # the swap runs to its end once started
            _swap_into_place(tmp, output)
    except BaseException:
        with deferred_interrupts():                 # a second Ctrl-C does not stop the clean-up
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp: Path, output: Path) -> None:
    why = _why_not_usable(output)                  # files may have appeared during the build
    if why is not None:
        raise OutputError(f"{output}: not replaced, {why} (it changed during the build); the "
                          "engine was not written")
    mode = output.stat().st_mode & 0o7777 if output.is_dir() else _default_dir_mode()
    os.chmod(tmp, mode)
    if output.is_dir() and any(output.iterdir()):  # an engine of ours: move aside, then delete
        old = Path(tempfile.mkdtemp(prefix=_temp_prefix(output, "old"), dir=output.parent))
        os.replace(output, old / output.name)
        os.replace(tmp, output)
        shutil.rmtree(old, ignore_errors=True)
    else:                                          # absent, or an empty directory
        os.replace(tmp, output)
