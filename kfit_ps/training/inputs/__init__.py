"""What a `fit`, `evaluate` or `predict` reads: Keras' inputs adapted for the workers.

- `adapters`: arrays, datasets, `DatasetCreator`s and generators checked and turned into a
  per-worker or shipped input; `validation_split` and `class_weight` as Keras means them.
- `dataset_creator`: `DatasetCreator`, the per-worker dataset function of Keras 2.
- `scheduling`: per-worker datasets and iterators, and the scheduling of steps on them.
- `shipped`: one-pass epochs read on the chief and shipped batch by batch.
"""
