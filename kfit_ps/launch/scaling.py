"""`kfit-ps scale`: the launcher's side of workers joining and leaving a running job.

The supervisor calls `Scaler.poll()` from its loop. A scale request
(`kfit_ps.membership.request_scale`) to N workers, with M running:

- N > M: the launcher starts workers M..N-1 at new ports, waits until each
  serves, then publishes the new worker list; the chief takes them at its next
  safe point (`kfit_ps.training.resilience.elastic`: within a second during `fit`).
- N < M: the launcher publishes the shorter list first and keeps workers
  N..M-1 running until the chief acknowledges it (it drains them: the functions
  they run finish, the queued ones go to the others), or until no chief could
  still use them (the chief ended: its next start gets the shorter cluster);
  then it stops them. They are not failures: no restart, no budget spent.

One change at a time: a request that arrives while workers are leaving waits.
This is the scaler of a job whose servers this launcher started itself
(`kfit-ps run` without `--tasks`). On the chief's host of a multi-host job the
request is `launch.roster`'s (within `TF_CONFIG`'s workers), or refused when DNS
finds the workers (`launch.discovery`).
"""

import os

from kfit_ps import constants, membership
from kfit_ps.cluster.start_errors import ServerNotReady


class Scaler:
    """Carries out scale requests for one supervisor (see the module doc)."""

    def __init__(self, run_dir, say, view):
        self.directory = os.path.join(run_dir, membership.DIR_NAME)
        membership.reset(self.directory)  # A new job: generations start again from 1.
        self.say, self.view = say, view
        self.generation = 0
        self._leaving = None  # (generation, workers kept) until the chief lets the rest go

    def _publish(self, addresses):
        self.generation += 1
        membership.publish(self.directory, self.generation, addresses)

    def poll(self, cluster, chief_running):
        """Finishes a removal the chief has acknowledged; takes the next request."""
        if self._leaving is not None:
            generation, keep = self._leaving
            if not (membership.applied(self.directory, generation) or not chief_running):
                return
            self._leaving = None
            leaving = [f"{constants.WORKER}:{i}"
                       for i in range(keep, cluster.config.num_tasks(constants.WORKER))]
            cluster.resize_workers(keep)
            for task in leaving:
                self.view.removed_task(task, f"{task} left the job (drained by the chief)")
            self.say(f"{', '.join(leaving)} stopped: the job has {keep} workers")
            return True
        workers = membership.take_request(self.directory)
        if workers is None:
            return False
        self.view.emit("scale", None, f"scale to {workers} workers requested", workers=workers)
        if cluster is None or not cluster.resizable:
            self.say(f"scale to {workers} workers refused: this launcher did not pick its "
                     "servers' addresses, so it cannot start more; run the job with kfit-ps run "
                     "(one host), or with --tasks chief:0 and TF_CONFIG listing the workers")
            return False
        current = cluster.config.num_tasks(constants.WORKER)
        if workers == current:
            self.say(f"scale: the job already has {workers} workers")
            return False
        if workers > current:
            self.say(f"scaling to {workers} workers: starting worker:{current}"
                     + (f"..worker:{workers - 1}" if workers - current > 1 else ""))
            try:
                cluster.resize_workers(workers)
            except (ServerNotReady, RuntimeError) as e:
                cluster.resize_workers(current)
                self.say(f"scale to {workers} workers failed, the job keeps {current}: "
                         f"{str(e).splitlines()[0]}")
                return False
            for index in range(current, workers):
                task, pid = f"{constants.WORKER}:{index}", cluster.pid(constants.WORKER, index)
                self.view.started_task(task, pid)
                self.view.emit("worker_ready", task, f"{task} serves (pid {pid})", pid=pid)
            self._publish(cluster.config.cluster[constants.WORKER])
            self.say(f"{workers - current} new worker(s) serve; the chief takes them at its "
                     "next safe point")
            return True
        self._publish(cluster.config.cluster[constants.WORKER][:workers])
        self._leaving = (self.generation, workers)
        self.say(f"scaling to {workers} workers: the chief drains worker:{workers}"
                 + (f"..worker:{current - 1}" if current - workers > 1 else "")
                 + ", then they stop")
        return True

    def close(self):
        """Nothing to release: the workers are the cluster's (`LocalCluster.stop`)."""
