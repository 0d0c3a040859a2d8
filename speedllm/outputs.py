"""Outputs never touch inputs: collisions are refused before any work (speedllm.config.locations), files appear
under their final name only when complete (temp name, then rename), and only directories this program made (marked)
are ever deleted.
"""

import os
import shutil
import tempfile
from pathlib import Path

from speedllm import storage
from speedllm.errors import UserError

MARKER = ".speedllm"  # inside every directory we create and may later delete


def check_writable(key: str, path: str, directory: bool = False, probe: bool = False) -> None:
    """The output `path` (a file, or a directory when `directory`) can be created where it is asked for; a URL's
    protocol, bucket and credentials are checked (speedllm.storage.check). With `probe`, a file is written and
    deleted where the directory is (or would be made): os.access says yes on a read-only mount as root."""
    if storage.is_url(path):
        return storage.check(key, str(path), must_exist=False, probe=probe)
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
    if probe:
        where = p if p.is_dir() else parent
        try:
            with tempfile.NamedTemporaryFile(prefix=".speedllm-probe-", dir=where):
                pass
        except OSError as e:
            raise UserError(f"{key}={path}: a file cannot be written in {where} ({e.strerror or e}); choose "
                            f"another {key}") from None


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
