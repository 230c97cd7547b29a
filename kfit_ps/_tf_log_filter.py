"""Copies standard input to standard output without TensorFlow's C++ log lines.

Run as a script (`python -I -S _tf_log_filter.py`): it must start fast and
import nothing. (`kfit-ps run` also imports `is_tf_log_line` for the chief's
output.) Its input is
the chief's standard error (see `kfit_ps.tf_logs`). It drops TensorFlow's
C++ INFO, WARNING and ERROR lines (`I0000 00:00:... file.cc:12] ...`, absl's
"All log messages before absl::InitializeLog()" notice, the known
continuation lines of a dropped message, and the protocol buffer a dropped
message announces with "goo.gle/debug...", up to its closing blank line) and passes everything else through
at once, partial lines too (a progress bar on stderr). FATAL lines are kept.
It ignores SIGINT, SIGTERM and SIGHUP and exits when every writer has closed
its end, so the last words of a crashed or interrupted program still get
through.
"""

import os
import re
import signal
import sys

_HEADER = re.compile(rb"^[IWE]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [^\s:\]]+:\d+\] ")
_STARTS_LIKE_HEADER = re.compile(rb"^[IWE](\d|$)")
_ABSL_NOTICE = b"WARNING: All log messages before absl::InitializeLog() is called"
# How the later lines of TensorFlow's multi-line log messages start (gRPC error details).
_CONTINUATIONS = (b"To enable the following instructions:", b"Additional GRPC error information",
                  b":UNKNOWN:", b"This could happen if the remote target",
                  b"\tAdditional GRPC error information")
_SEGMENT_END = re.compile(rb"(?<=[\r\n])")
# A message that ends so is followed by a protocol buffer in text form and a blank line
# (tf.data's "Found an unshardable source dataset" carries a whole dataset node). Protobuf
# varies the marker from run to run: goo.gle/debugproto, goo.gle/debugonly, ...
_PROTO_FOLLOWS = re.compile(rb"goo\.gle/debug\w*\s*$")
IN_PROTO = "in_proto"  # Truthy: the line was dropped, and the announced proto goes on.


def is_tf_log_line(line, previous_dropped=False):
    """Whether `line` (bytes) is one of TensorFlow's C++ log lines (or a continuation).

    `previous_dropped`: this function's result for the line before. The result
    is truthy for a dropped line (`IN_PROTO` while an announced proto goes on).
    """
    if previous_dropped == IN_PROTO:
        return True if not line.strip() else IN_PROTO
    if _HEADER.match(line) or line.startswith(_ABSL_NOTICE):
        return IN_PROTO if _PROTO_FOLLOWS.search(line) else True
    return previous_dropped and line.startswith(_CONTINUATIONS)


def _could_become_dropped(partial):
    """Whether an unfinished line may still turn out to be a TensorFlow log line.

    A log message is one write() of less than the pipe's atomic size, so it arrives
    whole; only a line that starts like one is held back until its newline.
    """
    if partial.startswith(_ABSL_NOTICE) or _ABSL_NOTICE.startswith(partial):
        return True
    return bool(_STARTS_LIKE_HEADER.match(partial))


def main():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    out = sys.stdout.buffer
    pending, dropped = b"", False
    while True:
        try:
            chunk = os.read(0, 1 << 16)
        except InterruptedError:
            continue
        if not chunk:
            break
        pending += chunk
        # Lines end in "\n"; a progress bar's segments end in "\r".
        segments = _SEGMENT_END.split(pending)
        pending = segments.pop()
        for segment in segments:
            dropped = is_tf_log_line(segment, dropped)
            if not dropped:
                out.write(segment)
        if pending and dropped != IN_PROTO and not _could_become_dropped(pending):
            out.write(pending)  # A partial line that cannot be a log line: now, not later.
            pending = b""
        out.flush()
    if pending and not is_tf_log_line(pending, dropped):
        out.write(pending)
    out.flush()


if __name__ == "__main__":
    main()
