"""A real DNS server for tests: Debian's `dnsmasq`, inside a test host (`tests.netns`).

`Dnsmasq(hosts, host, directory, domain)` serves `domain` from a hosts file that
`set({name: address})` rewrites (then SIGHUP: dnsmasq reads it again at once).
Names of `domain` that the file does not hold are answered NXDOMAIN; no other
name is served. The hosts resolve through it after `hosts.use_nameserver(...)`.
The process is one of `hosts`' (killed by `hosts.close()`).
"""

import os
import shutil
import signal
import subprocess
import time


def unavailable():
    """Why dnsmasq cannot run here, or None (`.ci/run` installs it)."""
    if _binary() is None:
        return "dnsmasq is not installed (Debian: apt-get install dnsmasq-base)"
    return None


def _binary():
    found = shutil.which("dnsmasq")
    return found or ("/usr/sbin/dnsmasq" if os.path.exists("/usr/sbin/dnsmasq") else None)


class Dnsmasq:
    def __init__(self, hosts, host, directory, domain):
        self.hosts, self.host, self.domain = hosts, host, domain
        self.address = hosts.addresses[host]
        self.sentinel = f"dns.{domain}"  # its own name: it answers once it serves
        self.names_file = os.path.join(directory, "dns-hosts")
        self.log = os.path.join(directory, "dnsmasq.log")
        self._write({})
        with open(self.log, "w") as log:
            self.proc = hosts.run(host, [
                _binary(), "--keep-in-foreground", "--no-hosts", "--no-resolv",
                f"--addn-hosts={self.names_file}", f"--listen-address={self.address}",
                "--bind-interfaces", f"--local=/{domain}/", "--user=root", "--group=root",
                f"--pid-file={os.path.join(directory, 'dnsmasq.pid')}", "--log-queries",
                "--log-facility=-", "--local-ttl=0"], stdout=log, stderr=subprocess.STDOUT)
        # A SIGHUP before dnsmasq has its handler would end it: first it answers.
        self.wait_resolves(host, self.sentinel, self.address)

    def _write(self, names):
        names = dict(names, **{self.sentinel: self.address})
        text = "".join(f"{address} {name}\n" for name, address in sorted(names.items()))
        with open(self.names_file + ".new", "w") as f:
            f.write(text)
        os.replace(self.names_file + ".new", self.names_file)

    def set(self, names):
        """Serves exactly `names` ({name: IPv4 address}) from now on."""
        self._write(names)
        self.proc.send_signal(signal.SIGHUP)

    def resolve(self, host, name):
        """The IPv4 address `name` resolves to inside `host`, or None."""
        out = subprocess.run(["ip", "netns", "exec", self.hosts.namespaces[host], "getent",
                              "ahostsv4", name], capture_output=True, text=True, timeout=10)
        return out.stdout.split()[0] if out.returncode == 0 and out.stdout else None

    def wait_resolves(self, host, name, address, timeout=10.0):
        """Waits until `name` resolves to `address` (None: does not resolve) inside `host`;
        returns the wall-clock time it first did."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                with open(self.log) as log:
                    raise AssertionError(f"dnsmasq ended with {self.proc.returncode}: "
                                         + log.read()[-2000:])
            if self.resolve(host, name) == address:
                return time.time()
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} does not resolve to {address} in {host} after "
                                     f"{timeout:g} s")
            time.sleep(0.05)
