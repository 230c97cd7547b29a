"""What runs on a worker: the step functions the coordinator schedules.

- `functions`: the train, test and predict functions, traced once per model.
- `metric_state`: metric variables per worker, folded exactly on the chief.
- `sharded_updates`: the gradient step on sharded variables, applied on their ps.
- `sparse_updaters`: the one sparse optimizer path (duplicates summed first).
- `transfers`: the model's small variables packed into one read per step.
- `moving_averages`: `use_ema`'s averages as one atomic update on their ps.
"""
