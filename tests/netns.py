"""Test hosts as Linux network namespaces: each its own network stack and address.

`Hosts(names)` creates one namespace per name, plus a "switch" namespace with a
bridge; each host gets a veth pair to the bridge and the address 10.213.0.<10+i>/24.
Nothing is added to this machine's own network namespace (the veth pairs are
moved out as soon as they are made). `run(host, args)` starts a process inside
a host; `use_nameserver(address)` gives every host its own /etc/resolv.conf
(`ip netns exec` mounts /etc/netns/<namespace>/ over /etc). `close()` kills those
processes and deletes every namespace and its /etc/netns folder; a
session-level sweep (`remove_leftovers`) removes namespaces of earlier runs
that died before their cleanup.

Needs root and the `ip` command; `unavailable()` says why when they are missing.
"""

import os
import shutil
import subprocess
import uuid

PREFIX = "kfitps-"
SUBNET = "10.213.0"
ETC = "/etc/netns"


def unavailable():
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _remove_if_empty(path):
    try:
        os.rmdir(path)
    except OSError:
        pass  # Not empty (another run's hosts), or never made.


def _left_behind(name):
    """Whether namespace `name` is ours and its owner (the pid in its name) is gone: two
    test files at a time must not delete each other's live hosts."""
    if not name.startswith(PREFIX):
        return False
    owner = name[len(PREFIX):].split("-", 1)[0]
    if not owner.isdigit():
        return True  # Named before owners were recorded.
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove_leftovers():
    """Deletes namespaces that a killed test run left behind (their owner process is gone)."""
    listing = _ip("netns", "list", check=False).stdout.split()
    for name in listing:
        if _left_behind(name):
            _ip("netns", "del", name, check=False)
    for name in os.listdir(ETC) if os.path.isdir(ETC) else ():
        if _left_behind(name):
            shutil.rmtree(os.path.join(ETC, name), ignore_errors=True)


class Processes:
    """Processes started for a test's hosts; `close` kills those still running."""

    def __init__(self):
        self.processes = []

    def run(self, host, args, **popen_kwargs):
        """Starts `args` for `host` (here: on this machine; the caller reaps it)."""
        from tests import helpers

        proc = helpers.popen(self._command(host, args), **popen_kwargs)
        self.processes.append(proc)
        return proc

    @staticmethod
    def _command(host, args):
        return list(args)

    def close(self):
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


class Hosts(Processes):
    def __init__(self, names):
        super().__init__()
        self.tag = uuid.uuid4().hex[:6]  # In the veth names too (15 characters at most).
        owned = f"{PREFIX}{os.getpid()}-{self.tag}"  # The owner: `remove_leftovers` reads it.
        self.switch = f"{owned}-sw"
        self.namespaces = {name: f"{owned}-{name}" for name in names}
        self.addresses = {name: f"{SUBNET}.{10 + i}" for i, name in enumerate(names)}
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(names):
                self._add_host(i, name)
        except BaseException:
            self.close()
            raise

    def _add_host(self, i, name):
        ns, inside, outside = self.namespaces[name], f"kv{self.tag}{i}", f"kb{self.tag}{i}"
        _ip("netns", "add", ns)
        # Made in the switch namespace, so this machine's own namespace never holds them.
        _ip("-n", self.switch, "link", "add", inside, "type", "veth", "peer", "name", outside)
        _ip("-n", self.switch, "link", "set", inside, "netns", ns)
        _ip("-n", self.switch, "link", "set", outside, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def use_nameserver(self, address):
        """Every host resolves names through the DNS server at `address` (only)."""
        for ns in self.namespaces.values():
            os.makedirs(os.path.join(ETC, ns), exist_ok=True)
            with open(os.path.join(ETC, ns, "resolv.conf"), "w") as f:
                f.write(f"nameserver {address}\noptions timeout:1 attempts:1\n")

    def _command(self, host, args):
        """`args` inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *args]

    def close(self):
        super().close()
        for ns in [*self.namespaces.values(), self.switch]:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(os.path.join(ETC, ns), ignore_errors=True)
        _remove_if_empty(ETC)
