"""Cluster specifications: `TF_CONFIG` parsing and validation.

A `ClusterConfig` is the validated, immutable form of what TensorFlow calls a
cluster spec plus "this task". It is built from `TF_CONFIG` (the JSON format
TensorFlow uses), from CLI flags, or by `LocalCluster`, and turns into the
`tf.distribute.cluster_resolver.ClusterResolver` the strategy needs.

Example:

```python
config = ClusterConfig.from_tf_config('''{
    "cluster": {"chief": ["c:2222"], "worker": ["w0:2222"], "ps": ["p0:2222"]},
    "task": {"type": "chief", "index": 0}}''')
resolver = config.cluster_resolver()
```
"""

import dataclasses
import json
import types

from kfit_ps import constants

_ORDER = (constants.CHIEF, constants.WORKER, constants.PS, constants.EVALUATOR)


def _fail(source, problem, fix):
    raise ValueError(f"Invalid {source}: {problem} {fix}")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster: addresses per task type, and which task this is.

    Args:
        cluster: mapping of task type (`chief`, `worker`, `ps`, `evaluator`) to
            a sequence of `host:port` addresses.
        task_type: the task this process plays, or None for a pure client.
        task_index: index of this task within `task_type`. Defaults to 0.
        source: where the configuration came from, used in error messages.
            Defaults to `"TF_CONFIG"`.
    """

    cluster: types.MappingProxyType
    task_type: str = None
    task_index: int = 0
    source: str = constants.TF_CONFIG

    def __post_init__(self):
        src = self.source
        if not isinstance(self.cluster, dict) and not isinstance(
            self.cluster, types.MappingProxyType
        ):
            _fail(src, f'"cluster" must be an object. Received: {self.cluster!r}.',
                  'Example: {"cluster": {"worker": ["host:port"], "ps": ["host:port"]}}.')
        normalized = {}
        seen = {}
        for task_type, addresses in self.cluster.items():
            if task_type not in constants.TASK_TYPES:
                _fail(src, f"unknown task type {task_type!r} in \"cluster\".",
                      f"Use only {', '.join(constants.TASK_TYPES)}.")
            if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
                _fail(src, f'"cluster.{task_type}" must be a list of "host:port" strings. '
                      f"Received: {addresses!r}.", f'Example: "{task_type}": ["localhost:2222"].')
            for i, address in enumerate(addresses):
                _check_address(src, f"cluster.{task_type}[{i}]", address)
                if address in seen:
                    _fail(src, f"address {address!r} appears twice: as {seen[address]} and as "
                          f"{task_type}[{i}].", "Give every task its own host:port.")
                seen[address] = f"{task_type}[{i}]"
            normalized[task_type] = tuple(addresses)
        for required in (constants.WORKER, constants.PS):
            if not normalized.get(required):
                _fail(src, f'"cluster" has no {required!r} task; parameter-server training needs '
                      "at least one worker and one ps.",
                      f'Add "{required}": ["host:port"] to "cluster".')
        for single in (constants.CHIEF, constants.EVALUATOR):
            if len(normalized.get(single, ())) > 1:
                _fail(src, f'"cluster.{single}" has {len(normalized[single])} addresses; at most '
                      "one is allowed.", f"Keep one {single} address.")
        if self.task_type is not None:
            if self.task_type not in constants.TASK_TYPES:
                _fail(src, f"unknown task type {self.task_type!r} in \"task.type\".",
                      f"Use one of {', '.join(constants.TASK_TYPES)}.")
            if not isinstance(self.task_index, int) or isinstance(self.task_index, bool):
                _fail(src, f'"task.index" must be an integer. Received: {self.task_index!r}.',
                      'Example: "task": {"type": "worker", "index": 0}.')
            count = len(normalized.get(self.task_type, ()))
            if self.task_type == constants.EVALUATOR and count == 0:
                pass  # TensorFlow allows an evaluator outside the cluster.
            elif not 0 <= self.task_index < count:
                _fail(src, f'"task.index" {self.task_index} is out of range for task type '
                      f"{self.task_type!r}, which has {count} address(es).",
                      f"Use an index from 0 to {max(count - 1, 0)}.")
        ordered = {k: normalized[k] for k in _ORDER if k in normalized}
        object.__setattr__(self, "cluster", types.MappingProxyType(ordered))

    @classmethod
    def from_tf_config(cls, raw=None):
        """Parses `TF_CONFIG` (the environment variable when `raw` is None)."""
        if raw is None:
            raw = constants.tf_config()
            if not raw:
                raise ValueError(
                    "TF_CONFIG is not set. Set it to a JSON object such as "
                    '{"cluster": {"worker": ["host:port"], "ps": ["host:port"]}, '
                    '"task": {"type": "worker", "index": 0}}, or pass the cluster explicitly.'
                )
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"Invalid TF_CONFIG: it is not valid JSON ({e.msg} at line {e.lineno} column "
                f"{e.colno}). Received: {raw[:200]!r}. Fix the JSON, e.g. "
                '{"cluster": {"worker": ["host:port"], "ps": ["host:port"]}, '
                '"task": {"type": "worker", "index": 0}}.'
            ) from None
        if not isinstance(data, dict) or "cluster" not in data:
            _fail(constants.TF_CONFIG, f'it must be a JSON object with a "cluster" key. '
                  f"Received: {raw[:200]!r}.", 'Add "cluster": {"worker": [...], "ps": [...]}.')
        task = data.get("task") or {}
        if not isinstance(task, dict):
            _fail(constants.TF_CONFIG, f'"task" must be an object. Received: {task!r}.',
                  'Example: "task": {"type": "worker", "index": 0}.')
        return cls(cluster=data["cluster"], task_type=task.get("type"),
                   task_index=task.get("index", 0), source=constants.TF_CONFIG)

    def to_tf_config(self, task_type=None, task_index=None):
        """Returns the `TF_CONFIG` JSON for a task of this cluster."""
        task_type = self.task_type if task_type is None else task_type
        task_index = self.task_index if task_index is None else task_index
        data = {"cluster": {k: list(v) for k, v in self.cluster.items()}}
        if task_type is not None:
            data["task"] = {"type": task_type, "index": task_index}
        return json.dumps(data)

    def num_tasks(self, task_type):
        return len(self.cluster.get(task_type, ()))

    def address(self, task_type, index):
        return self.cluster[task_type][index]

    def training_cluster(self):
        """The cluster spec dict that servers and the strategy see (no evaluator)."""
        return {k: list(v) for k, v in self.cluster.items() if k != constants.EVALUATOR}

    def cluster_resolver(self):
        """A `tf.distribute.cluster_resolver.ClusterResolver` for this task."""
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.training_cluster()),
            task_type=self.task_type,
            task_id=self.task_index,
            rpc_layer="grpc",
        )

    def __repr__(self):
        parts = [f"{k}={list(v)}" for k, v in self.cluster.items()]
        if self.task_type is not None:
            parts.append(f"task={self.task_type}:{self.task_index}")
        return f"ClusterConfig({', '.join(parts)})"


def _check_address(source, where, address):
    if not isinstance(address, str) or ":" not in address:
        _fail(source, f'"{where}" must be a "host:port" string. Received: {address!r}.',
              'Example: "localhost:2222".')
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        _fail(source, f'"{where}" has no valid port. Received: {address!r}.',
              "Use host:port with a port from 1 to 65535.")
