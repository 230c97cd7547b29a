"""Argument checks shared by every layer, with errors that name the argument.

Each check returns the normalised value or raises `ValueError` in three parts:
what was received, what is expected, and (where useful) how to fix it.
"""

import os

import numpy as np

from kfit_ps import constants

_ORDER = (constants.CHIEF, constants.WORKER, constants.PS, constants.EVALUATOR)


def check_int(name, value, minimum, *, owner=None, hint=None):
    """`int(value)` if `value` is an integer (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        prefix = f"{owner}: " if owner else ""
        suffix = f" {hint}" if hint else ""
        raise ValueError(f"{prefix}`{name}` must be {expected}. Received: {name}={value!r}."
                         f"{suffix}")
    return int(value)


def check_optional_int(name, value, minimum, *, owner=None, hint=None):
    """Like `check_int`, but None passes through."""
    return None if value is None else check_int(name, value, minimum, owner=owner, hint=hint)


def path(value):
    """A path argument as a string (`str`, `pathlib.Path`, or a URL such as `gs://b/d`)."""
    return os.fspath(value)


def cluster_error(source, problem, fix):
    raise ValueError(f"Invalid {source}: {problem} {fix}")


def check_cluster(cluster, task_type=None, task_index=0, *, source=constants.TF_CONFIG):
    """The cluster's rules, checked without touching the network: {task type: addresses}.

    Known task types only; lists of `host:port` strings; no address twice; at
    least one worker and one ps; at most one chief and one evaluator; this
    task (`task_type`, `task_index`) inside the cluster (an evaluator may be
    outside it). `ClusterConfig` and `ParameterServerStrategy` both check
    here, before any server is waited for. Errors start "Invalid {source}:".
    """
    if not isinstance(cluster, dict) and not hasattr(cluster, "items"):
        cluster_error(source, f'"cluster" must be an object. Received: {cluster!r}.',
                      'Example: {"cluster": {"worker": ["host:port"], "ps": ["host:port"]}}.')
    normalized, seen = {}, {}
    for kind, addresses in cluster.items():
        if kind not in constants.TASK_TYPES:
            cluster_error(source, f"unknown task type {kind!r} in \"cluster\".",
                          f"Use only {', '.join(constants.TASK_TYPES)}.")
        if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
            cluster_error(source, f'"cluster.{kind}" must be a list of "host:port" strings. '
                          f"Received: {addresses!r}.", f'Example: "{kind}": ["localhost:2222"].')
        for i, address in enumerate(addresses):
            _check_address(source, f"cluster.{kind}[{i}]", address)
            if address in seen:
                cluster_error(source, f"address {address!r} appears twice: as {seen[address]} "
                              f"and as {kind}[{i}].", "Give every task its own host:port.")
            seen[address] = f"{kind}[{i}]"
        normalized[kind] = tuple(addresses)
    for required in (constants.WORKER, constants.PS):
        if not normalized.get(required):
            cluster_error(source, f'"cluster" has no {required!r} task; parameter-server '
                          "training needs at least one worker and one ps.",
                          f'Add "{required}": ["host:port"] to "cluster".')
    for single in (constants.CHIEF, constants.EVALUATOR):
        if len(normalized.get(single, ())) > 1:
            cluster_error(source, f'"cluster.{single}" has {len(normalized[single])} addresses; '
                          "at most one is allowed.", f"Keep one {single} address.")
    if task_type is not None:
        if task_type not in constants.TASK_TYPES:
            cluster_error(source, f"unknown task type {task_type!r} in \"task.type\".",
                          f"Use one of {', '.join(constants.TASK_TYPES)}.")
        if not isinstance(task_index, (int, np.integer)) or isinstance(task_index, bool):
            cluster_error(source, f'"task.index" must be an integer. Received: {task_index!r}.',
                          'Example: "task": {"type": "worker", "index": 0}.')
        count = len(normalized.get(task_type, ()))
        outside = task_type == constants.EVALUATOR and count == 0  # TensorFlow allows it.
        if not outside and not 0 <= task_index < count:
            cluster_error(source, f'"task.index" {task_index} is out of range for task type '
                          f"{task_type!r}, which has {count} address(es).",
                          f"Use an index from 0 to {max(count - 1, 0)}.")
    return {k: normalized[k] for k in _ORDER if k in normalized}


def _check_address(source, where, address):
    if not isinstance(address, str) or ":" not in address:
        cluster_error(source, f'"{where}" must be a "host:port" string. Received: {address!r}.',
                      'Example: "localhost:2222".')
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        cluster_error(source, f'"{where}" has no valid port. Received: {address!r}.',
                      "Use host:port with a port from 1 to 65535.")
