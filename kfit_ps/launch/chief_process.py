"""The chief: the user's script as a child of the supervisor, its output live with a prefix."""

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

from kfit_ps import constants
from kfit_ps._tf_log_filter import is_tf_log_line
from kfit_ps.cluster.logs import read_tail

_PR_SET_PDEATHSIG = 1


def _die_with_supervisor():
    """In the child: its own process group, and SIGKILL when the supervisor dies (even by
    SIGKILL; Linux only).

    In a group of its own the chief gets a stop signal once, from the supervisor: a signal
    to the launcher's group (what `timeout`, systemd and Slurm send, and Ctrl-C) reaches the
    launcher alone, which forwards it. Delivered twice, a SIGTERM's second copy would end the
    chief before its final backup.
    """
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class ChiefProcess:
    """Runs `command` with `env`; copies each output line to `out` (prefixed) and `log_path`."""

    def __init__(self, command, env, log_path, out=None, prefix="[chief] "):
        self._log = open(log_path, "ab")
        self._out = out or sys.stdout
        self._prefix = prefix
        self.process = subprocess.Popen(
            list(command), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, preexec_fn=_die_with_supervisor)
        self._pump = threading.Thread(target=self._copy_output, name="kfit_ps-chief-output",
                                      daemon=True)
        self._pump.start()

    @property
    def pid(self):
        return self.process.pid

    def _copy_output(self):
        show_tf_logs, dropped = constants.show_tf_logs(), False
        for line in _segments(self.process.stdout):
            self._log.write(line)  # The log file keeps every line.
            self._log.flush()
            dropped = not show_tf_logs and is_tf_log_line(line, dropped)
            if dropped:  # Lines the chief wrote before `import kfit_ps` filtered its stderr.
                continue
            text = line.decode(errors="replace")
            try:
                self._out.write(self._prefix + text)
                self._out.flush()
            except (OSError, ValueError):
                pass

    def poll(self):
        """The exit status once the process ended and its output is copied, else None."""
        status = self.process.poll()
        if status is None:
            return None
        self._pump.join(5.0)
        return status

    def _signal_group(self, signum):
        """`signum` to the chief's process group: the chief and what the script started."""
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace=5.0, signum=signal.SIGTERM):
        """`signum` (SIGTERM), then SIGKILL after `grace` seconds, to the chief and its
        process group; returns the chief's exit status."""
        if self.process.poll() is None:
            self._signal_group(signum)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        self._signal_group(signal.SIGKILL)  # What the script left running in its group.
        self._pump.join(5.0)
        self._log.close()
        return self.process.returncode

    def log_tail(self, lines=20):
        return read_tail(self._log.name, lines)

    def close(self):
        if not self._log.closed:
            self._log.close()


def environment(tf_config, backup_dir=None, save_freq="epoch", run_dir=None, metrics_port=None,
                events=None, membership=None, ps_recovery="restart"):
    """The chief's environment: this process's, plus what the launcher tells it (where to
    serve its metrics and append its events, where it publishes the job's workers)."""
    env = dict(os.environ)
    env[constants.TF_CONFIG] = tf_config
    env[constants.LAUNCHED_ENV] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # A chief that crashes in TensorFlow's C++ (a segfault, an abort) prints every thread's
    # Python stack into its log: where each thread was is what names the cause.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.pop(constants.BACKUP_DIR_ENV, None)
    if backup_dir:
        env[constants.BACKUP_DIR_ENV] = str(backup_dir)
        env[constants.BACKUP_FREQ_ENV] = str(save_freq)
    if run_dir:
        env[constants.RUN_DIR_ENV] = str(run_dir)
    if metrics_port:
        env[constants.METRICS_PORT_ENV] = str(metrics_port)
    if events:
        env[constants.EVENTS_ENV] = str(events)
    env[constants.PS_RECOVERY_ENV] = ps_recovery
    env.pop(constants.MEMBERSHIP_ENV, None)
    if membership:
        env[constants.MEMBERSHIP_ENV] = str(membership)
    return env


def remove_backups(backup_dir):
    """The script succeeded (exit 0): its backups in `backup_dir` are no longer needed."""
    if not backup_dir:
        return
    if "://" not in str(backup_dir):  # Local: without TensorFlow (its import took 3-7 s).
        if os.path.isdir(backup_dir):
            shutil.rmtree(backup_dir)
        return
    import tensorflow as tf  # Only for remote storage (gs://...): the launcher runs without it.

    if tf.io.gfile.exists(backup_dir):
        tf.io.gfile.rmtree(backup_dir)


# A line end: "\r\n", "\n", or a "\r" that some other byte follows (a last "\r" waits to see
# whether "\n" comes next).
_CUT = re.compile(rb"\r\n|\n|\r(?=[^\n])")


def _segments(stream):
    """What `stream` carries, cut after each newline *and* carriage return ("\r\n" is one
    cut): a progress bar redrawing its line with "\r" is copied (and prefixed) at each
    redraw, not once its line ends. Each byte is scanned once (a long line costs its
    length, not its length squared)."""
    pending, scanned = b"", 0
    while True:
        chunk = stream.read1(65536)
        if not chunk:
            break
        pending += chunk
        start = 0
        for cut in _CUT.finditer(pending, max(scanned - 1, 0)):
            yield pending[start:cut.end()]
            start = cut.end()
        pending = pending[start:]
        scanned = len(pending)
    if pending:
        yield pending
