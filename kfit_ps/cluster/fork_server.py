"""A `LocalCluster`'s server template: one process that imports a server's TensorFlow once and
forks each worker and ps from it.

A server process spends about 0.55 s of CPU before it serves, nearly all of it loading
TensorFlow's native libraries and server classes (`_server_main`); a job starts four or more
and starts them again after each loss. The template (`_server_main.py --fork-server OWNER LOG`)
pays that once per cluster; a forked server starts in a few milliseconds and shares the
template's pages until it writes them. What a forked server runs is what a spawned one runs
(`_server_main.main`, the same arguments): a process of its own, in a session of its own, its
output appended to its log file, its environment the one `LocalCluster` gives it, its name
(`ps`'s `comm`) its task ("worker:0"), and its exit status reported to the owner as
`subprocess` reports one (`-N` for signal N).

Protocol (JSON lines): the template says `{"ready": true}` once imported; the owner writes
`{"id", "argv", "log", "name"}` to its stdin; the template answers `{"id", "pid"}` once it
forked (`{"id", "error"}` if it could not: that server alone starts as a process of its own)
and `{"pid", "status"}` once that server ended. A forked server's environment is the
template's, which the owner gave it. The template forks only with one thread.

Lifetimes: the template exits when its stdin closes (`ForkServer.close`, after the servers
were stopped) or when its owner dies (polled as servers poll theirs); a forked server's parent
is the template, so servers follow it out (`server._die_with_parent`). Only where the template
cannot serve (not Linux, `KFIT_PS_SERVER_FORK=0`, an environment other than the template's:
settings TensorFlow reads at import) does `LocalCluster` spawn a server as before.
"""

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref

from kfit_ps import constants

log = logging.getLogger("kfit_ps.cluster")

TEMPLATE_NAME = "kfit_ps-servers"  # the template's `comm` (15 characters at most)
_PR_SET_NAME = 15
_FORK_SECONDS = 30.0


def _set_name(name):
    """This process' `comm` (what `ps -o comm`, `top` and psutil's `name()` show); Linux."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def enabled():
    """Whether `LocalCluster` forks its servers from a template here."""
    return (sys.platform.startswith("linux") and hasattr(os, "fork")
            and os.environ.get(constants.SERVER_FORK_ENV, "1") != "0")


# The template ---------------------------------------------------------------------------------


def serve(owner_pid, log_path, main):
    """The template's loop (`_server_main.py --fork-server OWNER_PID LOG`): forks `main(argv)`
    per request until stdin closes or the owner dies, then removes its log `log_path`."""
    _set_name(TEMPLATE_NAME)
    answers = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # Only answers go to the owner; TensorFlow's lines go to stderr.
    from kfit_ps._tf_compat import server_lib

    server_lib.server_api(bare=True)  # What each server would import: done once, here.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # Wakes select(): a server ended.

    def answer(**fields):
        try:
            answers.write(json.dumps(fields) + "\n")
            answers.flush()
        except OSError:  # The owner is gone.
            _exit(log_path)

    answer(ready=True)
    buffered = b""
    poll = constants.parent_poll_interval()
    while True:
        _reap(answer)
        if os.getppid() != owner_pid:  # The owner died: its servers follow the template out.
            _exit(log_path)
        ready, _, _ = select.select([0, wake_read], [], [], poll)
        if wake_read in ready:
            os.read(wake_read, 4096)
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # The owner closed the cluster (after stopping its servers), or died.
            _exit(log_path)
        buffered += data
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            try:
                request = json.loads(line)
                sys.stderr.flush()  # (nothing of the template's is copied into a server's log)
                template = os.getpid()
                pid = os.fork()
            except (ValueError, OSError) as e:  # One server fails (its owner starts it on its
                answer(id=_request_id(line), error=f"{type(e).__name__}: {e}")  # own), not all.
                continue
            if pid == 0:
                _run_forked(request, main, template, owner_pid,
                            (answers.fileno(), wake_read, wake_write), devnull)
            answer(id=request["id"], pid=pid)


def _request_id(line):
    try:
        return json.loads(line)["id"]
    except (ValueError, KeyError, TypeError):
        return None


def _exit(log_path):
    """Ends the template; its log goes too (an orphaned server removes its own log and then the
    folder, which must be empty by then; a closed cluster removes or keeps its folder)."""
    try:
        os.remove(log_path)
    except OSError:
        pass
    os._exit(0)


def ended_children():
    """`(pid, status)` of each child of this process that ended, reaped; the status as
    `subprocess` gives it (`-N` for signal N)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _reap(answer):
    for pid, status in ended_children():
        answer(pid=pid, status=status)


def _run_forked(request, main, template, owner_pid, template_fds, devnull):
    """In a forked server: becomes the server `request` names; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in template_fds:
            os.close(fd)
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        _set_name(request["name"])  # (its environment is the template's: the owner's request)
        argv = list(request["argv"])
        argv[1] = str(template)  # This server's parent: watched as such.
        main(argv, owner_pid=owner_pid)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as Python reports it, then exit 1
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


# The owner's side -----------------------------------------------------------------------------


class ForkServer:
    """The owner's handle on one template process (`LocalCluster` keeps one)."""

    def __init__(self, script, env, log_path):
        self.env = dict(env)
        self._owner = os.getpid()
        self._lock = threading.Condition()
        self._pids = {}  # request id -> pid, or the error that stopped its fork
        self._status = {}  # pid -> exit status
        self._abandoned = set()  # ids of forks whose caller was interrupted: killed on arrival
        self._next_id = 0
        self._ready = False
        self._eof = False  # every answer of the template was read
        self._log = open(log_path, "ab")
        self._proc = subprocess.Popen(
            [sys.executable, script, "--fork-server", str(os.getpid()), log_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=self.env,
            start_new_session=True)
        ready = False
        try:
            _OPEN.add(self)
            self._reader = threading.Thread(target=self._read, name="kfit_ps-fork-server",
                                            daemon=True)
            self._reader.start()
            with self._lock:
                ready = self._lock.wait_for(lambda: self._ready or self._eof,
                                            constants.startup_timeout()) and self._ready
        finally:  # Also when interrupted (Ctrl-C, the launcher's stop): no template is left.
            if not ready:
                self._proc.kill()
                self.close()
        if not ready:
            raise RuntimeError(f"the server template did not start; its log: {log_path}")

    def _gone(self):
        return self._proc.poll() is not None

    def _read(self):
        try:
            for line in self._proc.stdout:
                message = json.loads(line)
                with self._lock:
                    if message.get("ready"):
                        self._ready = True
                    elif "status" in message:
                        self._status[message["pid"]] = message["status"]
                    elif message["id"] in self._abandoned:
                        self._abandoned.discard(message["id"])
                        if "pid" in message:
                            _kill(message["pid"])
                    elif "pid" in message:  # A new server: a reused pid's old status goes.
                        self._status.pop(message["pid"], None)
                        self._pids[message["id"]] = message["pid"]
                    else:
                        self._pids[message["id"]] = RuntimeError(message.get("error"))
                    self._lock.notify_all()
        except (OSError, ValueError) as e:
            log.warning("kfit_ps: lost the server template's answers: %s", e)
        finally:  # Whatever it forked is on its way out, or is reported gone once it is.
            with self._lock:
                self._eof = True
                self._lock.notify_all()

    def alive(self):
        return not self._eof and not self._gone()

    def _foreign(self):
        """In a process forked from the owner: the template and its servers are not ours."""
        return os.getpid() != self._owner

    def spawn(self, argv, log_path, name):
        """Forks a server running `_server_main.main(argv)` in the template's environment
        (`LocalCluster._fork_server` asks only for servers with that one); returns its
        `ForkedServer`."""
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            request = {"id": request_id, "argv": list(argv), "log": log_path, "name": name}
            answered = False
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
                answered = self._lock.wait_for(lambda: request_id in self._pids or self._eof,
                                               _FORK_SECONDS) and request_id in self._pids
            except OSError:
                pass  # The template is gone: raised below.
            finally:
                if not answered:  # Failed or interrupted: a server forked later is killed.
                    self._abandoned.add(request_id)
            pid = self._pids.pop(request_id, None) if answered else None
            if not isinstance(pid, int):
                raise RuntimeError(f"the server template did not fork {name}: "
                                   f"{pid or 'no answer'}")
            return ForkedServer(self, pid)

    def status(self, pid, timeout=0.0):
        """`pid`'s exit status once the template reported it (within `timeout`), else None.
        A server of a template that ended is reported gone once its process is."""
        if self._foreign():
            return 0  # (as `subprocess` says of a process that is not its child)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if pid in self._status:
                    return self._status[pid]
                if self._eof and not running(pid):
                    return -signal.SIGKILL  # Its template died before reporting it.
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._lock.wait(0.1 if left is None else min(0.1, left))

    def close(self):
        """Ends the template (its servers, if any still run, follow it out)."""
        _OPEN.discard(self)
        if self._foreign():
            return
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(5)
        self._log.close()


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


_OPEN = weakref.WeakSet()  # templates of this process


def _close_inherited_pipes():
    """In a child forked from an owner: drops its copy of each template's stdin, or the
    template would never see the end of it when the owner closes the cluster."""
    for template in list(_OPEN):
        try:  # The descriptor now refers to /dev/null: the file object stays valid.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, template._proc.stdin.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
    _OPEN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_pipes)


def running(pid):
    """Whether process `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # A zombie (its template gone, not reaped yet by init) does not run.
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ForkedServer:
    """A forked server, with what `LocalCluster` uses of `subprocess.Popen`."""

    def __init__(self, template, pid):
        self._template = template
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            self.returncode = self._template.status(self.pid)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self._template.status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"server pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None and not self._template._foreign():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)
