"""A real headless browser for tests: Debian's `chromium`, as CI installs it (`.ci/run`)."""

import shutil
import subprocess

from tests import helpers

INSTALL = "apt-get install -y chromium  (Debian/Ubuntu, as root; `.ci/run` does it)"
# The flags the machine's closed network needs (no background connections), as root.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")


def chromium():
    """The browser's path; without one the test fails in CI and is skipped elsewhere,
    saying how to install it (`helpers.missing_tool`)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    helpers.missing_tool(f"no headless Chromium on this machine; install it: {INSTALL}")


def rendered_dom(url, profile_dir, wait_ms=4000):
    """The page at `url` after its scripts ran for `wait_ms` (virtual time), as HTML."""
    proc = subprocess.run(
        [chromium(), *FLAGS, f"--user-data-dir={profile_dir}",
         f"--virtual-time-budget={wait_ms}", "--dump-dom", url],
        capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
