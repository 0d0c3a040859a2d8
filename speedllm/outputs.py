"""Outputs never touch inputs: collisions are refused before any work, files appear under their final name only
when complete (temp name, then rename), and only directories this program made (marked) are ever deleted.
"""

import os
import shutil
from pathlib import Path
from typing import Dict, Iterable

from speedllm import storage
from speedllm.errors import UserError

MARKER = ".speedllm"  # inside every directory we create and may later delete


def _real(path) -> str:
    return str(path).rstrip("/") if storage.is_url(path) else os.path.realpath(os.path.expanduser(str(path)))


def check_no_collision(outputs: Dict[str, Iterable[str]], inputs: Dict[str, Iterable[str]]) -> None:
    """Refuse when a file or directory an output would write is, holds, or lies inside an input.

    Args:
        outputs: key (e.g. "data.output_prefix") -> paths that key would write.
        inputs: key -> paths that key reads.
    """
    for in_key, in_paths in inputs.items():
        for in_path in in_paths:
            src = _real(in_path)
            for out_key, out_paths in outputs.items():
                for out_path in out_paths:
                    dst = _real(out_path)
                    if dst == src or dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
                        raise UserError(f"{out_key} would write {out_path}, which is the input {in_key}={in_path}; "
                                        f"choose another {out_key} so the input is kept")


def check_writable(key: str, path: str, directory: bool = False) -> None:
    """The output `path` (a file, or a directory when `directory`) can be created where it is asked for; a URL's
    protocol, bucket and credentials are checked (speedllm.storage.check)."""
    if storage.is_url(path):
        return storage.check(key, str(path), must_exist=False)
    p = Path(path).expanduser()
    if p.exists() and p.is_dir() != directory:
        kind = "a directory" if p.is_dir() else "a file"
        raise UserError(f"{key}={path} is {kind}; give a {'directory' if directory else 'file'} path instead")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{key}={path}: {parent} is a file, not a directory; choose another {key}")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{key}={path}: {parent} is not writable; choose another {key}")


def make_scratch_dir(path: Path, key: str) -> Path:
    """Create `path` empty and marked as ours; a leftover of ours is replaced, anything else is refused."""
    if path.exists():
        if not (path / MARKER).is_file():
            raise UserError(f"{path} exists and was not made by SpeedLLM, so it is left alone; remove it or choose "
                            f"another {key}")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARKER).touch()
    return path


def remove_ours(path: Path) -> bool:
    """Delete directory `path` if it carries our marker; return whether it did."""
    if not (path / MARKER).is_file():
        return False
    shutil.rmtree(path)
    return True
