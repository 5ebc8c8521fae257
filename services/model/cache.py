"""The model cache directory, and building a directory in it exactly once (atomically, safe across processes)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def default_cache_dir() -> Path:
    """$RECONFIG_CACHE_DIR, else $XDG_CACHE_HOME/reconfig, else ~/.cache/reconfig."""
    if explicit := os.environ.get("RECONFIG_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "reconfig"


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target`, first running `build(staging)` and renaming the staging directory into place if it is
    missing. A complete directory only ever appears by rename, so a crash leaves nothing and two processes
    racing both succeed (the loser removes its staging directory and uses the winner's identical build)."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(staging)
        os.rename(staging, target)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        if error.errno in (errno.EEXIST, errno.ENOTEMPTY) and target.is_dir():
            return target
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
