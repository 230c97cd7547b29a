"""Partitioners for `ParameterServerStrategy(..., variable_partitioner=...)`.

These are TensorFlow's own (`tf.distribute.experimental.partitioners`),
re-exported. A partitioner is called as `partitioner(shape, dtype)` for each
variable created under the strategy scope and returns the number of shards
per axis. The strategy applies TensorFlow's rules:

- only axis 0 is sharded; a result with any element other than 1 after the
  first is a ValueError;
- rank-0 variables, and variables created under
  `strategy.extended.colocate_vars_with`, are never sharded;
- "div" layout: shard sizes differ by at most one, larger shards first
  (13 rows over 5 shards: 3, 3, 3, 2, 2); shards go round-robin to ps tasks.

```python
partitioner = kfit_ps.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10,
                                                      max_shards=2)
strategy = kfit_ps.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
with strategy.scope():
    table = keras.layers.Embedding(1024, 1024)   # 4 MB: 2 shards of (512, 1024)
```

Each shard of a Keras variable: `kfit_ps.shards(variable)`.
"""

import tensorflow as tf

FixedShardsPartitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner
MinSizePartitioner = tf.distribute.experimental.partitioners.MinSizePartitioner
MaxSizePartitioner = tf.distribute.experimental.partitioners.MaxSizePartitioner
Partitioner = tf.distribute.experimental.partitioners.Partitioner

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
