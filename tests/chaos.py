"""Seeded worker kills during a fit: the one helper that tests and `bench/` use.

`WorkerKills` SIGKILLs a serving training worker (never one still restarting)
each time the job's progress reaches one of `points`, and restarts it shortly after, so
the kills land inside the fit at places a seed fixes.
"""

import threading
import time


def kill_points(rng, low, high, count, step=1):
    """`count` sorted distinct progress points of `range(low, high, step)`, drawn from `rng`."""
    return sorted(rng.sample(range(low, high, step), count))


class WorkerKills:
    """A thread that SIGKILLs a serving worker of `cluster` (a `LocalCluster`) when
    `progress()` reaches each of `points`; the worker is restarted `restart_after` s later.

    The worker is drawn from `rng` among those serving; `jitter` adds a random pause of up
    to that many seconds before each kill. `kills` records `(task, progress)` of each kill.
    Use as a context manager around the fit: on leaving, the thread and every restart are
    joined.
    """

    def __init__(self, cluster, progress, points, rng, workers, jitter=0.0, restart_after=0.3):
        self._cluster, self._progress, self.points = cluster, progress, list(points)
        self._rng, self._workers, self._jitter = rng, workers, jitter
        self._restart_after = restart_after
        self.kills, self._restarts = [], []
        self._stop = threading.Event()  # Set when the fit failed: no more kills or restarts.
        self._up = [threading.Event() for _ in range(workers)]  # set while a worker serves
        for event in self._up:
            event.set()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, kind, *exc):
        if kind is not None:  # The fit failed: its progress may never reach the next point.
            self._stop.set()
        self._thread.join()
        for restart in self._restarts:
            restart.join()

    def _restart(self, task):
        if self._stop.wait(self._restart_after):
            return
        self._cluster.restart("worker", task)
        self._up[task].set()

    def _run(self):
        for point in self.points:
            while not self._stop.is_set() and self._progress() < point:
                time.sleep(0.01)
            if self._stop.is_set():
                return
            serving = [task for task in range(self._workers) if self._up[task].is_set()]
            task = self._rng.choice(serving) if serving else self._rng.randrange(self._workers)
            while not self._up[task].wait(0.1):  # never a worker still restarting
                if self._stop.is_set():
                    return
            if self._jitter:
                time.sleep(self._rng.uniform(0, self._jitter))
            self._up[task].clear()
            self._cluster.kill("worker", task)
            self.kills.append((task, self._progress()))
            self._restarts.append(threading.Thread(target=self._restart, args=(task,)))
            self._restarts[-1].start()


def killed_one_pass_epoch(cluster, model, dataset, rng, low, high, kills=5):
    """One one-pass epoch of `model` (a `helpers.counting_model`, its counts zeroed first) on
    `dataset`, with `kills` worker SIGKILLs at seeded points in `[low, high)` batches, each
    killed worker restarted. Returns what the fit, the counts and the ledger's report say."""
    import kfit_ps
    import tensorflow as tf

    model.counts.assign(tf.zeros_like(model.counts))
    iterations = model.optimizer.iterations
    start = int(iterations.numpy())
    points = kill_points(rng, low, high, kills)
    with WorkerKills(cluster, lambda: int(iterations.numpy()) - start, points, rng,
                     workers=2, jitter=0.05) as killer:
        history = model.fit(dataset, epochs=1, verbose=0).history
    report = kfit_ps.ledger.reports(model)[0]
    return dict(killed=history, counts=model.counts.numpy().tolist(), kills=killer.kills,
                points=points, lost=report.lost, once=report.trained_once,
                splits=report.splits,
                reruns=[[r.first_batch, r.batches, r.starts, r.examples] for r in report.reruns])
