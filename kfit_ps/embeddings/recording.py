"""The lookups of one training step, recorded for its gradient step.

A dynamic table's rows are not variables, so Keras' tape cannot see them. In
kfit_ps' training step (`training.step.functions`) a `Recorder` is active: each
`DynamicEmbedding` lookup hands it the rows it read (which the recorder has
the step's tape watch), the keys and their counts; the gradient step then
takes gradients with respect to those rows and sends them to the shards'
ps tasks (`training.step.sharded_updates.GradientStep`).
"""

import dataclasses
import threading

import tensorflow as tf

_active = threading.local()


@dataclasses.dataclass(frozen=True)
class Lookup:
    table: object  # table.DynamicTable
    shard: int
    keys: tf.Tensor
    counts: tf.Tensor
    rows: tf.Tensor

    @property
    def device(self):
        return self.table.shards[self.shard].device


class Recorder:
    """Collects a training step's `Lookup`s; `with Recorder() as r:` makes it current."""

    def __init__(self):
        self.lookups = []
        self.tape = None

    def set_tape(self, tape):
        self.tape = tape

    def record(self, lookup):
        if self.tape is None:
            raise RuntimeError("Recorder.record outside the training step's GradientTape")
        self.tape.watch(lookup.rows)
        self.lookups.append(lookup)

    def __enter__(self):
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _active.stack.pop()


def current():
    """The active `Recorder`, or None outside kfit_ps' training step."""
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None
