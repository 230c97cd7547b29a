"""The one gate to private TensorFlow and Keras APIs.

Everything in kfit_ps that touches `keras.src...`, a private attribute of a
Keras or TensorFlow object, or patches a Keras class goes through this
package. Each use is guarded by `check_versions()` (the ranges below are the
ones `pyproject.toml` pins and the tests cover) and tested in
`tests/test_tf_compat.py`, so a TensorFlow or Keras upgrade breaks here, in
one place, with a clear message.
"""

from kfit_ps._tf_compat.versions import SUPPORTED, check_versions
from kfit_ps._tf_compat.autograph_files import remove_autograph_files
from kfit_ps._tf_compat.closure_hook import observe_closures
from kfit_ps._tf_compat.worker_set import (RecoveryInProgress, resize_workers, track_per_worker,
                                          worker_addresses)
from kfit_ps._tf_compat import ps_restore
from kfit_ps._tf_compat.eager_context import (
    forget_servers,
    track_coordinator,
    wait_for_closures,
    cancel_queued_closures,
    remote_value_ready,
)
from kfit_ps._tf_compat.keras_variables import (
    install_atomic_updates,
    is_kfit_variable,
    mark_kfit_variable,
    redirected_assigns,
    storage,
)
from kfit_ps._tf_compat.batch_norm import install_exact_batch_norm
from kfit_ps._tf_compat.executors import install_quiet_executor_teardown
from kfit_ps._tf_compat.result_copies import install_safe_result_copies, read_where_it_lives
from kfit_ps._tf_compat.seed_generator import install_exact_seed_generator
from kfit_ps._tf_compat.metric_scope import LocalStateScope
from kfit_ps._tf_compat.pinned_variables import pinned_variable
from kfit_ps._tf_compat.hash_tables import critical_section, hash_table
from kfit_ps._tf_compat.keras_data import (class_weight_map_fn, class_weight_to_sample_weights,
                                          train_validation_split)
from kfit_ps._tf_compat.read_cache import CachedReadScope
from kfit_ps._tf_compat.datasets import (external_state, shard_dataset, shard_policy, shuffle_ops,
                                         with_shard_policy)
from kfit_ps._tf_compat.dataset_graph import Unserializable, on_this_context
from kfit_ps._tf_compat.fused_adam import apply_adam, can_fuse as can_fuse_adam
from kfit_ps._tf_compat.keras_sharding import (
    embedding_inputs,
    embedding_table,
    install_sharding_support,
    standardized_inputs,
    shards,
    sharded_storage,
    variable_partitioner,
)
from kfit_ps._tf_compat.keras_trainer import (
    build_for_predict,
    flatten_metrics_in_order,
    improvement_test,
    print_msg,
    has_stock_step,
    has_stock_train_step,
    install_load_weights_hook,
    optimizer_scalars,
    keras_averages_off,
    moving_average_pairs,
    learning_rate_at,
    optimizer_slots,
    sublayers,
    train_step_with,
    uses_weight_decay,
    initial_epoch_override,
    install_dispatch,
    model_strategy,
    symbolic_build,
)

__all__ = [
    "observe_closures",
    "RecoveryInProgress",
    "resize_workers",
    "ps_restore",
    "track_per_worker",
    "worker_addresses",
    "CachedReadScope",
    "LocalStateScope",
    "SUPPORTED",
    "shard_dataset",
    "shard_policy",
    "shuffle_ops",
    "on_this_context",
    "Unserializable",
    "external_state",
    "with_shard_policy",
    "apply_adam",
    "remove_autograph_files",
    "can_fuse_adam",
    "build_for_predict",
    "check_versions",
    "improvement_test",
    "print_msg",
    "flatten_metrics_in_order",
    "has_stock_step",
    "has_stock_train_step",
    "embedding_inputs",
    "embedding_table",
    "install_sharding_support",
    "standardized_inputs",
    "optimizer_slots",
    "critical_section",
    "class_weight_map_fn",
    "class_weight_to_sample_weights",
    "train_validation_split",
    "hash_table",
    "pinned_variable",
    "sharded_storage",
    "sublayers",
    "shards",
    "train_step_with",
    "optimizer_scalars",
    "keras_averages_off",
    "moving_average_pairs",
    "learning_rate_at",
    "uses_weight_decay",
    "variable_partitioner",
    "forget_servers",
    "initial_epoch_override",
    "install_atomic_updates",
    "install_exact_batch_norm",
    "install_exact_seed_generator",
    "install_quiet_executor_teardown",
    "install_safe_result_copies",
    "read_where_it_lives",
    "install_dispatch",
    "install_load_weights_hook",
    "is_kfit_variable",
    "mark_kfit_variable",
    "redirected_assigns",
    "model_strategy",
    "storage",
    "symbolic_build",
    "track_coordinator",
    "wait_for_closures",
    "cancel_queued_closures",
    "remote_value_ready",
]
