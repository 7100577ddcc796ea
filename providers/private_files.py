"""Files and folders only their owner may read (keys, seeds holding join secrets).

``Path.touch(mode=0o600)`` and ``mkdir(mode=0o700, exist_ok=True)`` leave a file or folder that
already exists at its old mode (one restored by ``cp``, a key file a crash left behind), so a new
key written into it could be group- or world-readable. These write a new file, 0600 from its first
byte, over the old one in one step, and set a folder's mode whatever it was.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_private(path: Path, content: str | bytes) -> None:
    """``content`` to ``path``, 0600 from the first byte, replacing it in one step."""
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb" if isinstance(content, bytes) else "w") as out:
        out.write(content)
    os.replace(partial, path)


def private_folder(path: Path) -> Path:
    """``path`` made (with its parents) if missing, and 0700 whatever it was."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    return path
