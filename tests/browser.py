"""A real headless Chromium for the dashboard tests, installed from Debian's `chromium` package when missing.

No browser download from the web is used (playwright's own browser builds are not fetched): playwright drives
the system Chromium through `executable_path`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
# Flags from the project's notes: no GPU, no sandbox (we run as root), nothing that phones home.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def find_chromium() -> str | None:
    for path in CHROMIUM_CANDIDATES:
        if Path(path).is_file() and os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


def ensure_chromium(timeout_s: float = 900) -> str:
    """The Chromium executable, installed with apt-get (as root) when it is not there yet."""
    found = find_chromium()
    if found:
        return found
    if shutil.which("apt-get") is None:
        raise RuntimeError("chromium is not installed and apt-get is not available to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    found = find_chromium()
    if not found:
        raise RuntimeError("apt-get installed chromium but no executable was found")
    return found


if __name__ == "__main__":
    print(ensure_chromium())
