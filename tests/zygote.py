"""Chief processes forked from one interpreter that imported TensorFlow, Keras and kfit_ps.

`helpers.run_chief` runs each test snippet as a fresh chief process. Starting
Python and importing TensorFlow and Keras costs about 5 s of CPU per chief; a
zygote pays it once per test session and forks a chief per snippet, as
`test_public_api` does for module imports. A forked chief is a process of its
own: its own eager context, its own `LocalCluster` (server processes started
from it), its own standard output and error (files the test reads), its own
exit status. It inherits only what `import tensorflow, keras, kfit_ps` left in
memory (no TensorFlow runtime: that starts with the first op, in the child).

Protocol: the test writes one JSON request per line to the zygote's stdin
(`{"id", "code", "env", "stdout", "stderr"}`); the zygote answers
`{"id", "pid"}` once it forked and `{"id", "status"}` (a `subprocess` return
code) once that child ended. The zygote has one thread when it forks.

Set `KFIT_PS_TEST_FORK=0` to start every chief with `python -c` instead.
"""

import json
import os
import subprocess
import sys
import threading

ZYGOTE = r"""
import json, os, select, signal, sys, time, traceback
import numpy as np
import kfit_ps, keras, tensorflow as tf
from kfit_ps import tf_logs

children = {}  # pid -> request id
requests = os.fdopen(0, "r")
answers = os.fdopen(os.dup(1), "w")
devnull = os.open(os.devnull, os.O_RDWR)


def answer(**fields):
    answers.write(json.dumps(fields) + "\n")
    answers.flush()


def fork(request):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        children[pid] = request["id"]
        answer(id=request["id"], pid=pid)
        return
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        answers.close()  # The protocol's pipes stay with the zygote (stdin is /dev/null now).
        os.close(devnull)
        os.environ.clear()
        os.environ.update(request["env"])
        tf_logs._installed.clear()  # The filter of this process, on its own stderr.
        tf_logs.install()
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(request["code"], "<chief>", "exec"), namespace)
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def reap():
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        answer(id=children.pop(pid), status=code)


while True:
    ready, _, _ = select.select([requests], [], [], 0.05)
    if ready:
        line = requests.readline()
        if not line:
            break  # The test session ended: its children are its to stop.
        fork(json.loads(line))
    reap()
os._exit(0)
"""


class Zygote:
    """The forking interpreter of one test session (started on first use)."""

    def __init__(self, env, cwd):
        self._proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd=cwd, start_new_session=False)
        self._lock = threading.Lock()
        self._next = 0
        self._waiting = {}  # id -> {"pid": Event + value, "status": ...}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self._proc.stdout:
            if not line.startswith("{"):
                continue
            message = json.loads(line)
            with self._lock:
                slot = self._waiting.get(message["id"])
            if slot is None:
                continue
            for key in ("pid", "status"):
                if key in message:
                    slot[key] = message[key]
                    slot[key + "_set"].set()
        with self._lock:  # The zygote ended: nobody will answer.
            for slot in self._waiting.values():
                slot["pid_set"].set()
                slot["status_set"].set()

    def alive(self):
        return self._proc.poll() is None

    def run(self, code, env, stdout, stderr):
        """Forks a chief that runs `code`; returns a `Forked` handle."""
        with self._lock:
            self._next += 1
            request_id = self._next
            slot = {"pid_set": threading.Event(), "status_set": threading.Event()}
            self._waiting[request_id] = slot
            self._proc.stdin.write(json.dumps({"id": request_id, "code": code, "env": env,
                                               "stdout": stdout, "stderr": stderr}) + "\n")
            self._proc.stdin.flush()
        if not slot["pid_set"].wait(60) or "pid" not in slot:
            raise RuntimeError(f"the chief zygote did not fork (alive: {self.alive()})")
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


class Forked:
    """A chief forked by the zygote: its pid, and its return code once it ended."""

    def __init__(self, zygote, request_id, slot):
        self._zygote, self._id, self._slot = zygote, request_id, slot
        self.pid = slot["pid"]

    def wait(self, timeout):
        """The return code (negative for a signal); None if it still runs after `timeout`."""
        if not self._slot["status_set"].wait(timeout):
            return None
        self._zygote.forget(self._id)
        return self._slot.get("status", -1)

    def kill(self):
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


_zygote = []
_zygote_lock = threading.Lock()


def enabled():
    return os.environ.get("KFIT_PS_TEST_FORK", "1") != "0"


def get(env, cwd):
    """The session's zygote, started with `env` on first use (and again if it died)."""
    with _zygote_lock:
        if not _zygote or not _zygote[0].alive():
            _zygote[:] = [Zygote(env, cwd)]
        return _zygote[0]


def close():
    with _zygote_lock:
        for zygote in _zygote:
            zygote.close()
        _zygote.clear()
