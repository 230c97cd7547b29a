"""What a failing or interrupted `fit` / `evaluate` / `predict` shows: one error, one line.

- **A step that fails on a worker** (a failed assertion, a bad shape, a NaN
  check): TensorFlow raises its error with the whole remote chain in the
  message: where each node was "defined at" (twice), then "Additional GRPC
  error information from remote target ..." with the same text again, escaped.
  `condensed(error)` is an error of the *same* class (code that catches
  `tf.errors.InvalidArgumentError` still does) whose message names the task,
  TensorFlow's own first line, the node and the user's line that defined it;
  the original is kept as its `tf_error` attribute.
- **Ctrl-C** (`KeyboardInterrupt`) while kfit_ps waits on the cluster: the
  functions no worker started are dropped, and a `KeyboardInterrupt` whose
  text is one line saying so is raised in its place (of that exact class:
  Python ends a process on an uncaught one by SIGINT, status 130 in a shell,
  after `atexit` hooks; for a subclass it would exit 1). Uncaught, the
  excepthook `install_excepthook()` sets prints that line instead of a
  traceback through kfit_ps and TensorFlow.
"""

import functools
import re
import sys

import tensorflow as tf

from kfit_ps import _tf_compat

_GRPC_TAIL = "Additional GRPC error information"
_REMOTE_TASK = re.compile(r"from remote target (/job:(\w+)/replica:\d+/task:(\d+))")
_DEFINED_AT = re.compile(r"^Detected at node (.+?) defined at \(most recent call last\):$")
_NODE = re.compile(r"\[\[\{\{node ([^}]+)\}\}\]\]")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_NO_STACK = "<stack traces unavailable>"


_ONE_LINE = "_kfit_ps_one_line"  # Marks the KeyboardInterrupt kfit_ps raised in place of one.


def _user_frame(frames):
    """The last frame of a "defined at" listing outside TensorFlow, Keras and kfit_ps."""
    for path, line, name in reversed(frames):
        if not re.search(r"/(tensorflow|keras|kfit_ps|threading\.py)|__autograph_generated", path):
            return f"{path}:{line} ({name})"
    return None


def _first_root_error(lines):
    """TensorFlow's text of the first root error (its kind prefix dropped), and its node."""
    text, node = [], None
    for line in lines:
        if re.fullmatch(r"\d+ root error\(s\) found\.", line):
            continue
        if re.match(r"\(\d+\) ", line):
            if text:
                break  # The next root error: the first one is enough.
            line = re.sub(r"^\(\d+\) [A-Z_]+:\s*", "", line)
        found = _NODE.search(line)
        if found:
            node = node or found.group(1)
            line = _NODE.sub("", line).strip()
        if line:
            text.append(line)
    return " ".join(text), node


def condensed(error):
    """`error` (a `tf.errors.OpError` from a remote function) as one short error of its class,
    or `error` itself when it carries no remote chain to condense."""
    message = getattr(error, "message", "")
    if not isinstance(error, tf.errors.OpError) or _GRPC_TAIL not in message:
        return error
    task = _REMOTE_TASK.search(message)
    local, _, _ = message.partition(_GRPC_TAIL)
    frames, lines, collecting, listings = [], [], False, 0
    for line in local.splitlines():
        stripped = line.strip()
        detected = _DEFINED_AT.match(stripped)
        frame = _FRAME.match(line)
        if detected:  # The first listing is kept (even when unavailable); TensorFlow repeats it.
            collecting, listings = listings == 0, listings + 1
        elif stripped == _NO_STACK:  # A listing TensorFlow did not record (seen under load).
            continue
        elif frame:
            if collecting:
                frames.append(frame.groups())
        elif stripped and stripped != "Graph execution error:":
            collecting = False
            lines.append(stripped)
    where = f"on {task.group(2)}:{task.group(3)}" if task else "on a worker"
    first, node = _first_root_error(lines)
    text = f"A step failed {where}: {first}"
    if node:
        text += f"\n  at node {node}"
    user = _user_frame(frames)
    if user:
        text += f"\n  defined at {user}"
    if type(error) is tf.errors.OpError:
        short = tf.errors.OpError(error.node_def, error.op, text, error.error_code)
    else:
        short = type(error)(error.node_def, error.op, text)
    short.tf_error = error
    return short


def _drop_queued_functions(strategy):
    coordinator = getattr(strategy, "coordinator", None) if strategy is not None else None
    if coordinator is None:
        return 0
    try:
        return len(_tf_compat.cancel_queued_closures(coordinator))
    except Exception:  # noqa: BLE001 - a queue already torn down holds nothing to drop
        return 0


def clean(method, name, strategy_of):
    """Wraps a `fit`/`evaluate`/... implementation: step errors condensed, Ctrl-C as one line.

    `strategy_of(model)` gives the strategy whose queued functions a Ctrl-C drops.
    """

    @functools.wraps(method)
    def wrapped(model, *args, **kwargs):
        try:
            return method(model, *args, **kwargs)
        except KeyboardInterrupt as e:
            if getattr(e, _ONE_LINE, False):
                raise  # A nested call already said it.
            dropped = _drop_queued_functions(strategy_of(model))
            interrupt = KeyboardInterrupt(
                f"kfit_ps: {name} interrupted by Ctrl-C; {dropped} queued function(s) dropped, "
                "and no backup written on the way out (a SIGTERM stops at a safe point and "
                "saves one).")
            setattr(interrupt, _ONE_LINE, True)
            raise interrupt from None
        except tf.errors.OpError as e:
            short = condensed(e)
            if short is e:
                raise
            raise short from None

    return wrapped


@functools.cache
def install_excepthook():
    """An uncaught Ctrl-C that kfit_ps stopped on prints its one line, not a traceback;
    once per process."""
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if getattr(value, _ONE_LINE, False):
            print(value, file=sys.stderr, flush=True)
            return
        previous(kind, value, traceback)

    sys.excepthook = excepthook
