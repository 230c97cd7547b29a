"""Chief processes forked from one interpreter that imported TensorFlow, Keras and kfit_ps.

`helpers.run_chief` runs each test snippet as a fresh chief process. Starting
Python and importing TensorFlow and Keras costs about 5 s of CPU per chief; a
zygote pays it once per test session and forks a chief per snippet, as
`test_public_api` does for module imports. A forked chief is a process of its
own: its own eager context, its own `LocalCluster` (server processes started
from it), its own exit status, and its standard output and error are pipes the
test reads to their end, as `subprocess.run` did (its TensorFlow log filter,
`kfit_ps.tf_logs`, is its own too). It runs as `python -c` would: in a
`__main__` module, Ctrl-C a `KeyboardInterrupt`, an uncaught exception printed
by `sys.excepthook` and exit status 1, `sys.exit` and `atexit` as usual. It
inherits only what `import tensorflow, keras, kfit_ps` left in memory (no
TensorFlow runtime: that starts with the first op, in the child), and the
zygote's environment at import time: a test whose environment differs in a
setting read at import (`IMPORT_SETTINGS`) gets a `python -c` chief instead.

Protocol: the zygote says `{"ready": true}` once imported; the test writes one
JSON request per line to its stdin (`{"id", "code", "env", "stdout", "stderr"}`,
the last two FIFOs the test reads); the zygote answers `{"id", "pid"}` once it
forked and `{"id", "status"}` (a `subprocess` return code) once that child
ended. The zygote has one thread when it forks.

Set `KFIT_PS_TEST_FORK=0` to start every chief with `python -c` instead.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

# Read when TensorFlow, Keras or Python start: a chief that needs other values is not forked.
IMPORT_SETTINGS = ("KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS",
                   "TF_USE_LEGACY_KERAS", "CUDA_VISIBLE_DEVICES", "KFIT_PS_TF_LOGS",
                   "PYTHONPATH", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED")

ZYGOTE = r"""
import json, os, select, signal, sys, types
import numpy as np
import kfit_ps, keras, tensorflow as tf
from kfit_ps import tf_logs
from kfit_ps.cluster.fork_server import ended_children

children = {}  # pid -> request id
answers = os.fdopen(os.dup(1), "w")


def answer(**fields):
    answers.write(json.dumps(fields) + "\n")
    answers.flush()


def reap():
    for pid, code in ended_children():
        request = children.pop(pid, None)  # (the log filter is a child too)
        if request is not None:
            answer(id=request, status=code)


def serve():
    # Unbuffered reads: select() must see every request that is not handled yet.
    buffered = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            data = os.read(0, 1 << 16)
            if not data:
                return None  # The test session ended: its children are its own to stop.
            buffered += data
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return request
            children[pid] = request["id"]
            answer(id=request["id"], pid=pid)
        reap()


answer(ready=True)
request = serve()
if request is None:
    os._exit(0)
# The chief: `python -c` from here on.
signal.signal(signal.SIGINT, signal.default_int_handler)
import faulthandler
faulthandler.register(signal.SIGUSR1, all_threads=True)  # A timed-out chief's stacks (`run`).
answers.close()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
    pipe = os.open(path, os.O_WRONLY)
    os.dup2(pipe, fd)
    os.close(pipe)
os.environ.clear()
os.environ.update(request["env"])
tf_logs._installed.clear()  # This process's own filter, on its own standard error.
tf_logs.install()
main = types.ModuleType("__main__")
main.__builtins__ = __builtins__
sys.modules["__main__"] = main
del request["env"]
exec(compile(request["code"], "<string>", "exec"), main.__dict__)
"""


def _import_settings(env):
    return {key: env.get(key) for key in IMPORT_SETTINGS}


class Zygote:
    """The forking interpreter of one test session (started on first use)."""

    READY_SECONDS = 300  # Importing TensorFlow on a loaded 2-core host.
    FORK_SECONDS = 60

    def __init__(self, env, cwd):
        self.settings = _import_settings(env)
        # Its own errors go to a file: started during some test, it would write into that
        # test's captured output for the rest of the session.
        self.log = tempfile.NamedTemporaryFile(prefix="kfit_ps-zygote-", suffix=".log",
                                               delete=False)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, env=env, cwd=cwd)
        self._lock = threading.Lock()
        self._next = 0
        self._ready = threading.Event()
        self._waiting = {}  # id -> {"pid", "pid_set", "status", "status_set"}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self._proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # Not the protocol: something the imports printed.
            if not isinstance(message, dict):
                continue
            if message.get("ready"):
                self._ready.set()
                continue
            with self._lock:
                slot = self._waiting.get(message["id"])
            if slot is None:
                continue
            for key in ("pid", "status"):
                if key in message:
                    slot[key] = message[key]
                    slot[key + "_set"].set()
        self._ready.set()
        with self._lock:  # The zygote ended: nobody will answer (its chiefs run on).
            for slot in self._waiting.values():
                slot["lost"] = True
                slot["pid_set"].set()
                slot["status_set"].set()

    def alive(self):
        return self._proc.poll() is None

    def run(self, code, env, stdout, stderr):
        """Asks for a chief that runs `code` and writes to the FIFOs `stdout` and `stderr`;
        returns its `Forked` handle at once (its pid comes with `Forked.started`)."""
        if not self._ready.wait(self.READY_SECONDS) or not self.alive():
            raise RuntimeError(f"the chief zygote did not start (alive: {self.alive()}); its "
                               f"log: {self.log.name}")
        with self._lock:
            self._next += 1
            request_id = self._next
            slot = {"pid_set": threading.Event(), "status_set": threading.Event()}
            self._waiting[request_id] = slot
            self._proc.stdin.write(json.dumps({"id": request_id, "code": code, "env": env,
                                               "stdout": stdout, "stderr": stderr}) + "\n")
            self._proc.stdin.flush()
        return Forked(self, request_id, slot)

    def forget(self, request_id):
        with self._lock:
            self._waiting.pop(request_id, None)

    def close(self):
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self.log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log.name)


class Forked:
    """A chief asked of the zygote: its pid once forked, its return code once it ended."""

    def __init__(self, zygote, request_id, slot):
        self._zygote, self._id, self._slot = zygote, request_id, slot

    @property
    def pid(self):
        return self._slot.get("pid")

    def started(self, timeout):
        """Waits until it was forked; RuntimeError if it was not within `timeout` s."""
        if not self._slot["pid_set"].wait(timeout) or self.pid is None:
            raise RuntimeError(f"the chief zygote did not fork (alive: {self._zygote.alive()}); "
                               f"its log: {self._zygote.log.name}")

    def wait(self, timeout):
        """The return code (negative for a signal); None if it still runs after `timeout`;
        RuntimeError if the zygote died (nobody can tell its status: it is killed)."""
        if not self._slot["status_set"].wait(timeout):
            return None
        self._zygote.forget(self._id)
        if self._slot.get("lost"):
            self.stop()
            raise RuntimeError(f"the chief zygote died while chief {self.pid} ran; its log: "
                               f"{self._zygote.log.name}")
        return self._slot["status"]

    def stop(self, timeout=30):
        """Kills it (once forked, waiting a little for that) and waits until it is gone."""
        if self.pid is None:
            self._slot["pid_set"].wait(10)
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout  # Reaped by the zygote, or by init without it.
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        return
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(0.05)


class _Drain:
    """A FIFO read to its end in a thread: what the chief (and its log filter) wrote."""

    def __init__(self, path):
        self.path, self.chunks = path, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        with open(self.path, "rb") as pipe:  # Returns once the chief opened it.
            for chunk in iter(lambda: pipe.read1(1 << 16), b""):
                self.chunks.append(chunk)

    def text(self, deadline):
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            try:  # Nobody opened it (the fork failed): an end of file for the reader.
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            self._thread.join(1)
        return b"".join(self.chunks).decode(errors="replace")


_zygotes = []
_zygote_lock = threading.Lock()


def enabled(env):
    """Whether a chief with environment `env` can be forked from the session's zygote."""
    if os.environ.get("KFIT_PS_TEST_FORK", "1") == "0":
        return False
    with _zygote_lock:
        return not _zygotes or _zygotes[0].settings == _import_settings(env)


def _get(env, cwd):
    with _zygote_lock:
        if not _zygotes or not _zygotes[0].alive():
            for dead in _zygotes:
                dead.close()
            _zygotes[:] = [Zygote(env, cwd)]
        return _zygotes[0]


def run(code, env, cwd, timeout):
    """Runs `code` in a forked chief: a `subprocess.CompletedProcess`; `TimeoutExpired` after
    `timeout` s (the chief killed). Interrupted, it kills the chief before raising."""
    with tempfile.TemporaryDirectory(prefix="kfit_ps-chief-") as folder:
        paths = [os.path.join(folder, name) for name in ("stdout", "stderr")]
        for path in paths:
            os.mkfifo(path)
        drains = [_Drain(path) for path in paths]
        chief = None
        try:
            chief = _get(env, cwd).run(code, env, *paths)
            chief.started(Zygote.FORK_SECONDS)
            status = chief.wait(timeout)
        except BaseException:
            if chief is not None:  # Interrupted, or not forked in time: nobody watches it.
                chief.stop()
            deadline = time.monotonic() + 1
            for drain in drains:
                drain.text(deadline)
            raise
        if status is None:  # Where each of its threads waits goes to its stderr first.
            with contextlib.suppress(ProcessLookupError):
                os.kill(chief.pid, signal.SIGUSR1)
            time.sleep(2)
            chief.stop()
        deadline = time.monotonic() + 30  # One bound for both pipes (a grandchild may hold one).
        stdout, stderr = (drain.text(deadline) for drain in drains)
    if status is None:
        raise ChiefTimeout(["chief"], timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(["chief"], status, stdout, stderr)


class ChiefTimeout(subprocess.TimeoutExpired):
    """A forked chief that ran past its timeout; its message ends with the ends of what it
    wrote, its threads' stacks last."""

    def __str__(self):
        return (f"{super().__str__()}\nstdout:\n{(self.output or '')[-3000:]}\n"
                f"stderr:\n{(self.stderr or '')[-12000:]}")


def close():
    with _zygote_lock:
        for zygote in _zygotes:
            zygote.close()
        _zygotes.clear()
