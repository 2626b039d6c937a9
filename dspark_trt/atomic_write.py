"""Files written whole or not at all: a temporary sibling, flushed, then renamed over the target."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that a reader (or a crash) sees the old file or the new one,
    never a part: the new bytes go to ``<name>.tmp<pid>`` beside it and replace ``path`` in one
    rename. On an error the old file stays and the temporary one is removed."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``text`` (UTF-8) through ``write_bytes_atomic``."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, obj, indent: int = 2) -> Path:
    """``obj`` as JSON (and a final newline) through ``write_text_atomic``."""
    return write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")
