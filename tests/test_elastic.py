"""Workers that join and leave a running `fit` (`kfit-ps scale`), on real servers."""

import json
import os
import textwrap
import time

import pytest

import kfit_ps
from kfit_ps import membership
from tests import helpers
from tests.test_launcher import Job
from tests.test_observability import read_events, wait_for_event

STEPS = 4000
BATCH = 64

# One fit of STEPS steps. Until the file argv[1] exists, the chief schedules one step every
# 20 ms, so that the fit outlasts the scaling the test drives; then it runs at full speed.
ELASTIC = textwrap.dedent(f"""
    import json, sys
    import keras, kfit_ps
    import tensorflow as tf
    from tests import helpers as h

    release = sys.argv[1]
    strategy = kfit_ps.ParameterServerStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse", metrics=[h.counting_metric()])

    def data(context):
        x = tf.random.stateless_normal((4096, 8), seed=(1, 2))
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch({BATCH})

    history = model.fit(kfit_ps.DatasetCreator(data), epochs=1, steps_per_epoch={STEPS},
                        verbose=0, callbacks=[h.paced_until(release)])
    print("RESULT " + json.dumps({{"iterations": int(model.optimizer.iterations.numpy()),
                                  "batches": history.history["batches"][-1]}}), flush=True)
""")


def scale(job, workers):
    kfit_ps.scale(str(job.run_dir), workers)


def grow_and_shrink(job, workers, grown):
    """Scale a running job to `grown` workers, wait for each new one's first step, scale back to
    `workers` and wait until the added ones are removed."""
    added = [f"worker:{i}" for i in range(workers, grown)]
    for size, event in ((grown, "first_step"), (workers, "task_removed")):
        scale(job, size)
        for task in added:
            wait_for_event(job, lambda e, t=task, k=event: e["event"] == k and e["task"] == t, 60)


def resized_run(tmp_path, script, grown, settle=0.0):
    """Runs `script` under `kfit-ps run --workers 2`; once its fit trains (plus `settle` seconds),
    grows it to `grown` workers and back to 2, then lets it finish (the release file, argv[1])."""
    release = tmp_path / "release"
    job = Job(tmp_path, "--workers", "2", "--ps", "1", script=script, script_args=(release,))
    with job.running():
        wait_for_event(job, lambda e: e["event"] == "fit_begin", 180)
        time.sleep(settle)
        grow_and_shrink(job, 2, grown)
        release.write_text("")
        status = job.finish()
    assert status == 0, "\n".join(job.lines[-60:])
    return job


@pytest.mark.slow
def test_workers_join_and_leave_a_running_fit_without_losing_a_step(tmp_path):
    job = resized_run(tmp_path, ELASTIC, 4, settle=2.0)
    # Every step ran once: no step lost by draining the leaving workers, none run twice.
    assert job.result() == {"iterations": STEPS, "batches": float(STEPS)}
    events = read_events(job)
    ready = {e["task"]: e["time"] for e in events if e["event"] == "worker_ready"}
    first = {e["task"]: e["time"] for e in events if e["event"] == "first_step"}
    assert set(ready) == set(first) == {"worker:2", "worker:3"}, events
    for task in ready:  # A new worker's first step within 10 s of its server answering.
        assert first[task] - ready[task] <= 10.0, (task, ready[task], first[task])
    kinds = [e["event"] for e in events]
    workers = [e["workers"] for e in events if e["event"] == "workers"]
    assert workers == [4, 2], events
    # The leaving workers stopped on purpose: neither lost nor restarted.
    assert not [e for e in events if e["event"] in ("task_lost", "restart")], events
    assert kinds.index("task_removed") > max(i for i, k in enumerate(kinds) if k == "workers")
    output = "\n".join(job.lines)
    assert "[chief] kfit_ps: now training on 4 workers (was 2;" in output
    assert "worker:2, worker:3 stopped: the job has 2 workers" in output
    assert job.left_running() == []


# Two one-pass epochs (the data ledger) over N indexed examples, paced as ELASTIC until argv[1]
# exists (`helpers.paced_until`); the model counts how often each example was trained
# (`helpers.counting_model`).
N = 25_600
ONE_PASS = textwrap.dedent(f"""
    import json, sys
    import kfit_ps
    import numpy as np
    from tests import helpers as h

    release = sys.argv[1]
    strategy = kfit_ps.ParameterServerStrategy()
    with strategy.scope():
        model = h.counting_model({N}, saved=False)
        model.compile("adam", "mse")

    (x, index), y = h.indexed_arrays({N})
    logs = model.fit((x, index), y, batch_size=32, epochs=2, verbose=0,
                     callbacks=[h.paced_until(release)]).history
    print("RESULT " + json.dumps({{"counts": np.bincount(model.counts.numpy()).tolist(),
                                  "lost": logs["ledger_splits_lost"]}}), flush=True)
""")


@pytest.mark.slow
def test_one_pass_epochs_stay_exact_while_a_worker_joins_and_leaves(tmp_path):
    job = resized_run(tmp_path, ONE_PASS, 3)
    # Every example trained exactly once per epoch: twice; no split lost.
    assert job.result() == {"counts": [0, 0, N], "lost": [0.0, 0.0]}
    assert [e["workers"] for e in read_events(job) if e["event"] == "workers"] == [3, 2]
    assert job.left_running() == []


def test_a_resized_coordinator_keeps_variables_and_each_kept_workers_iterator():
    """`_tf_compat.resize_workers` through the strategy: two workers become three, then one.

    In a chief process of its own: a process's eager context serves one cluster.
    """
    result = helpers.run_chief("""
        import collections
        from kfit_ps import _tf_compat

        with kfit_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
            strategy = kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)
            with strategy.scope():
                total = tf.Variable(0.0)
            iterator = _tf_compat.track_per_worker(iter(
                strategy.coordinator.create_per_worker_dataset(
                    lambda: tf.data.Dataset.range(1_000_000))))

            @tf.function
            def step(iterator):
                total.assign_add(1.0)
                return next(iterator)

            def run(n):
                coordinator = strategy.coordinator
                results = [coordinator.schedule(step, args=(iterator,)) for _ in range(n)]
                coordinator.join()
                return collections.Counter(int(r.fetch()) for r in results)

            out = {"before": sum(run(100).values())}
            cluster.resize_workers(3)
            strategy.resize_workers(cluster.config.cluster["worker"])
            out["three"] = [strategy.num_workers, len(_tf_compat.worker_addresses())]
            after = run(300)
            out["after_zero"], out["after_total"] = after[0], float(total.numpy())
            strategy.resize_workers(cluster.config.cluster["worker"][:1])
            cluster.resize_workers(1)
            out["one"] = [sum(run(50).values()), float(total.numpy())]
            out["addresses_agree"] = (
                strategy.worker_addresses == tuple(cluster.config.cluster["worker"]))
            cluster.kill("worker", 0)
            cluster.restart("worker", 0)
            out["restarted"] = [sum(run(50).values()), float(total.numpy())]
            # TensorFlow's recovery thread busy updating the cluster (it holds this lock):
            # the resize leaves the cluster as it is and says why, within its wait.
            from kfit_ps._tf_compat import worker_set
            worker_set._QUIESCE_SECONDS = 1.0
            lock = strategy.coordinator._cluster.failure_handler._cluster_update_lock
            lock.acquire()
            started = time.monotonic()
            try:
                strategy.resize_workers(cluster.config.cluster["worker"])
            except kfit_ps.ClusterError as e:
                out["refused"] = [str(e), time.monotonic() - started,
                                  _tf_compat.worker_addresses() == list(
                                      cluster.config.cluster["worker"])]
            finally:
                lock.release()
        report(**out)
        os._exit(0)
    """)
    assert result["before"] == 100, result["_stderr"][-3000:]
    assert result["three"] == [3, 3]
    # The new worker's iterator starts at 0; the kept ones continue past their last element.
    assert result["after_zero"] == 1 and result["after_total"] == 400.0
    assert result["one"] == [50, 450.0] and result["addresses_agree"]
    # A worker restarted after the resize gets its iterator rebuilt by the new coordinator.
    assert result["restarted"] == [50, 500.0]
    message, took, unchanged = result["refused"]
    assert "worker recovery did not end within 1 s" in message and "rerun the script" in message
    assert took < 10 and unchanged


def test_scale_requests_and_worker_lists_are_published_data_then_marker(tmp_path):
    directory = tmp_path / membership.DIR_NAME
    directory.mkdir()
    assert membership.take_request(str(directory)) is None
    membership.request_scale(str(tmp_path), 4)
    membership.request_scale(str(tmp_path), 3)
    (directory / "request-99999999999999999999.json").write_text('{"workers": 9}')  # no marker
    assert membership.take_request(str(directory)) == 3  # The newest published one.
    assert membership.take_request(str(directory)) is None
    assert membership.latest(str(directory)) is None
    membership.publish(str(directory), 1, ["a:1", "b:2"])
    membership.publish(str(directory), 2, ["a:1"])
    (directory / "00000003.json").write_text(json.dumps({"generation": 3, "workers": []}))
    assert membership.latest(str(directory)) == (2, ["a:1"])
    assert not membership.applied(str(directory), 2)
    membership.acknowledge(str(directory), 2)
    assert membership.applied(str(directory), 1) and membership.applied(str(directory), 2)


def test_bad_scale_requests_name_the_argument_and_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match=r"`workers` must be an integer >= 1.*workers=0"):
        kfit_ps.scale(str(tmp_path), 0)
    with pytest.raises(ValueError, match=r"not the run directory.*--run-dir"):
        kfit_ps.scale(str(tmp_path), 2)
    [(status, err), (status2, err2)] = helpers.cli_failures([
        (("scale", "--run-dir", str(tmp_path), "--workers", "2"), None),
        (("scale", "--run-dir", str(tmp_path)), None)])
    assert status == 2 and "is not the run directory of a job" in err
    assert status2 == 2 and "--workers" in err2
    assert not os.listdir(tmp_path)


def test_a_scale_flap_before_a_safe_point_is_not_a_stop(strategy, monkeypatch):
    """2 -> 3 -> 2 within one window: the chief saw the new list, stopped scheduling and
    dropped its queued functions, but the list was back to its own workers before the running
    ones finished. The dropped steps run again on the same workers: `fit` completes, every
    step counted once, and never reads the flap as a SIGTERM (it raised `Preempted`)."""
    import keras
    from kfit_ps.training.resilience import elastic

    class Flap:  # The launcher's list as the chief reads it: new twice, then its own again.
        looks = 0

        def pending(self, strategy):
            self.looks += 1
            return self.looks in (5, 6)  # While scheduling, then while joining (dropping).

        def apply(self, strategy, monitor):
            raise AssertionError("a worker list that is no longer published was applied")

    flap = Flap()
    monkeypatch.setattr(elastic, "_current", [flap])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", metrics=[helpers.counting_metric()], steps_per_execution=5)
    before = int(model.optimizer.iterations.numpy())
    history = model.fit(kfit_ps.DatasetCreator(helpers.regression_dataset_fn()), epochs=1,
                        steps_per_epoch=200, verbose=0)
    assert flap.looks > 6
    assert int(model.optimizer.iterations.numpy()) - before == 200
    assert history.history["batches"] == [200.0]
