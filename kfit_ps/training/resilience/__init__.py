"""How a `fit` lives through changes of its cluster, in the chief's process.

- `cluster_health`: every wait of the chief bounded; lost workers and lost ps named.
- `ps_recovery`: a lost ps restored in place from the last backup.
- `preemption`: SIGTERM taken at a step boundary, a final backup, then a stop.
- `elastic`: workers joining and leaving at a safe point (`kfit-ps scale`).

The launcher's side of the same events is `kfit_ps.launch` (`policy.RestartPolicy` decides).
"""
