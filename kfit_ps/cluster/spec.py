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

from kfit_ps import constants, validation
from kfit_ps.validation import cluster_error as _fail


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
        cluster = validation.check_cluster(self.cluster, self.task_type, self.task_index,
                                           source=self.source)
        object.__setattr__(self, "cluster", types.MappingProxyType(cluster))

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

