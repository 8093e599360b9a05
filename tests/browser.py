"""The headless browser of the page test (tests/test_serve.py): found, or installed where it can be.

The README's test command is the whole set-up, so the page test gets its browser itself: the
system's Chromium when it is on PATH, else Debian's ``chromium`` package installed with
``apt-get`` (as root, on a Debian or Ubuntu machine: the package registries are all this needs;
about a minute, once per machine). Anywhere else the test fails with the command to run, since a
skipped page test would hide a broken page.
"""

from __future__ import annotations

import os
import shutil
import subprocess

NAMES = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "apt-get install -y chromium"


def find() -> str | None:
    """The path of an installed Chromium (or Chrome), or None."""
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def find_or_install() -> str:
    """The browser's path, installing Debian's chromium first where it is missing (root + apt-get)."""
    path = find()
    if path:
        return path
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise RuntimeError(f"the page test needs Chromium and cannot install it here (not root with apt-get): "
                           f"install it yourself ({INSTALL} on Debian/Ubuntu) and run the tests again")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"installing Chromium for the page test failed at `{' '.join(command)}` "
                               f"(exit {done.returncode}):\n{done.stderr[-2000:]}")
    path = find()
    if path is None:
        raise RuntimeError(f"`{INSTALL}` succeeded but no chromium is on PATH")
    return path
