"""The benchmark scripts run and report (timings are recorded in docs, never asserted).

Each script runs at a tiny size in its own process. Most of such a run is starting processes
and TensorFlow, about one core's worth, so the scripts of the selected tests run two at a time
(`_Scripts`) while the tests, in order, wait for theirs: the module takes about half the time
of running them in turn. The scripts run with `KFIT_PS_BENCH_ONE_PROCESS=1`
(`bench/child_process.py`): the measurements that can share one process and one cluster run in
the script's own process instead of a fresh one each (the others still start theirs).
"""

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from tests import helpers

SCRIPTS_AT_ONCE = 2
ROOT_DOCS = os.path.join(helpers.ROOT, "docs")

LEDGER_EXAMPLES = 10_000  # bench/data_ledger.py --examples: 40 batches, kills at batches 5 and 12
LONG_RUN_STEPS, LONG_RUN_WINDOW = 500, 100  # bench/long_run.py --steps, --window
# `--steps-per-execution 1` where a script's default is 5: kfit_ps unrolls a function's steps
# (kfit_ps/training/step/functions.py), and tracing the 5 and optimizing them on the workers is
# most of a tiny run's CPU (fit_phases: 32 CPU-s at 5, 17 at 1). dlrm_throughput keeps its 5 (and
# data_ledger its fixed 5), so the scripts' default still runs here.
ONE_STEP = ["--steps-per-execution", "1"]

# name: (the script and its arguments, `{out}` standing for the module's output folder; timeout).
SCRIPTS = {
    "fit_overhead": (["bench/fit_overhead.py", "--repeats", "1", "--epochs", "1", "--steps", "20",
                      "--hidden", "16", "--json", "{out}/fit_overhead.json"], 600),
    "embedding_scaling": (["bench/embedding_scaling.py", "--small-rows", "2000", "--large-rows",
                           "40000", "--dim", "8", "--batch-size", "64", "--steps", "10", "--json",
                           "{out}/embedding_scaling.json"], 900),
    # One worker (the main job's tests train its model on two): tables still sharded over 2 ps.
    "dlrm_throughput": (["bench/dlrm_throughput.py", "--repeats", "1", "--steps", "10", "--rows",
                         "3000", "--workers", "1", "--json", "{out}/dlrm.json", "--png",
                         "{out}/dlrm.png"], 900),
    "fit_phases": (["bench/fit_phases.py", "--fits", "2", "--steps", "10", "--rows", "3000",
                    *ONE_STEP, "--json", "{out}/fit_phases.json"], 600),
    "exact_evaluation": (["bench/exact_evaluation.py", "--repeats", "1", "--rows", "5000",
                          "--files", "10", "--batch-size", "256", "--json",
                          "{out}/exact_evaluation.json"], 900),
    "long_run": (["bench/long_run.py", "--steps", str(LONG_RUN_STEPS), "--window",
                  str(LONG_RUN_WINDOW), "--interval", "0.1", "--pending", "50", "--json",
                  "{out}/long_run.json"], 900),
    "scaling": (["bench/scaling.py", "--workers", "1,2", "--ps", "1", "--steps", "10", "--rows",
                 "3000", *ONE_STEP, "--json", "{out}/scaling.json", "--png",
                 "{out}/scaling.png"], 900),
    "data_ledger": (["bench/data_ledger.py", "--repeats", "1", "--examples", str(LEDGER_EXAMPLES),
                     "--epochs", "2", "--kills", "2", "--index-megabytes", "8", "--json",
                     "{out}/data_ledger.json"], 900),
    "observability_overhead": (["bench/observability_overhead.py", "--repeats", "1", "--pairs",
                                "1", "--steps", "10", "--rows", "3000", *ONE_STEP, "--json",
                                "{out}/observability.json"], 600),
    "charts": (["bench/charts.py", "--out", "{out}/charts"], 300),
    # Its three parts in one process and one cluster, one JSON each, all at batch 256 (quality:
    # 9 steps over the 2,304 training examples of 3,000 rows).
    "dynamic_embeddings": (["bench/dynamic_embeddings.py", "--part", "quality,table_size,eviction",
                            "--repeats", "1", "--json", "{out}/{{part}}.json", "--rows", "3000",
                            "--small", "1000", "--large", "20000", "--steps", "20", *ONE_STEP,
                            "--stream", "20000", "--capacity", "2000"], 900),
}


def _scripts_of(item):
    """The scripts test `item` checks."""
    return {
        "test_fit_overhead_runs_and_reports_a_ratio": ["fit_overhead"],
        "test_data_ledger_reports_both_answers_to_worker_loss": ["data_ledger"],
        "test_embedding_scaling_runs_and_reports_all_four_figures": ["embedding_scaling"],
        "test_dlrm_throughput_runs_all_three_contenders": ["dlrm_throughput"],
        "test_fit_phases_add_up_to_each_fit": ["fit_phases"],
        "test_exact_evaluation_counts_every_example_on_both_paths": ["exact_evaluation"],
        "test_long_run_and_scaling_report": ["long_run", "scaling"],
        "test_observability_overhead_alternates_both_and_charts_draw": [
            "observability_overhead", "charts"],
        "test_dynamic_embeddings_parts_report": ["dynamic_embeddings"],
        "test_dynamic_embeddings_parts_need_a_json_path_each": [],
        "test_device_parts_travel_one_call_each_and_install_once_all_are_there": [],
    }[item.originalname]


class _Scripts:
    """The selected tests' scripts, `SCRIPTS_AT_ONCE` at a time, in the tests' order.

    Each runs in its own process group, which `close()` kills with whatever it started when a
    test fails or the run is interrupted: nothing outlives the module.
    """

    def __init__(self, names, out):
        self.out = out
        self._lock = threading.Lock()
        self._running = []
        self._closed = False
        self._pool = concurrent.futures.ThreadPoolExecutor(SCRIPTS_AT_ONCE)
        self._runs = {name: self._pool.submit(self._run, name) for name in names}

    def _run(self, name):
        argv, timeout = SCRIPTS[name]
        with self._lock:
            if self._closed:
                raise RuntimeError(f"bench script {name} not run: the module is closing")
            proc = subprocess.Popen(
                [sys.executable, *(a.format(out=self.out) for a in argv)], cwd=helpers.ROOT,
                env=dict(helpers.chief_env(), KFIT_PS_BENCH_ONE_PROCESS="1"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            self._running.append(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            stdout, stderr = proc.communicate()
            stderr += f"\n[test_bench: killed after {timeout} s]"
        finally:
            with self._lock:
                self._running.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    def result(self, name):
        """`name`'s finished process (`returncode`, `stdout`, `stderr`)."""
        return self._runs[name].result()

    def json(self, file_name):
        with open(os.path.join(self.out, file_name)) as f:
            return json.load(f)

    def close(self):
        with self._lock:
            self._closed = True
            for proc in self._running:
                _kill_group(proc)
        self._pool.shutdown(wait=True, cancel_futures=True)


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def scripts(request, tmp_path_factory):
    names = []
    for item in request.session.items:
        if item.module is request.module:
            names += [n for n in _scripts_of(item) if n not in names]
    runner = _Scripts(names, str(tmp_path_factory.mktemp("bench")))
    try:
        yield runner
    finally:
        runner.close()


def _succeeded(scripts, name):
    proc = scripts.result(name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_fit_overhead_runs_and_reports_a_ratio(scripts):
    proc = _succeeded(scripts, "fit_overhead")
    assert "ratio kfit_ps/tf_keras: median" in proc.stdout
    result = scripts.json("fit_overhead.json")
    assert result["median_ratio"] > 0
    assert result["iterations"] == {"kfit_ps": [40], "tf_keras": [40]}
    for tasks in result["cpu_ms_per_step"].values():  # each process' CPU per timed step
        assert set(tasks) == {"chief", "worker:0", "worker:1", "ps:0"}, tasks
        assert all(ms >= 0 for ms in tasks.values()) and tasks["chief"] > 0, tasks


@pytest.mark.slow
def test_embedding_scaling_runs_and_reports_all_four_figures(scripts):
    proc = _succeeded(scripts, "embedding_scaling")
    for fragment in ("1. table size:", "2. coordinator RSS", "3. examples/s", "4. bytes per step"):
        assert fragment in proc.stdout
    result = scripts.json("embedding_scaling.json")
    assert result["rss"]["shards"] == [[20000, 8], [20000, 8]]
    assert result["small"]["iterations"] == result["large"]["iterations"] == 30
    assert result["tf_keras"]["iterations"] == 30
    assert result["minimum_bytes_each_way"] > 0 and result["step_time_ratio"] > 0


@pytest.mark.slow
def test_observability_overhead_alternates_both_and_charts_draw(scripts):
    proc = _succeeded(scripts, "observability_overhead")
    assert "observed/unobserved: median" in proc.stdout
    result = scripts.json("observability.json")
    assert len(result["per_fit"]["observed"]) == len(result["per_fit"]["unobserved"]) == 1
    assert result["observed/unobserved"]["median"] > 0
    _succeeded(scripts, "charts")
    with open(os.path.join(ROOT_DOCS, "benchmarks.json")) as f:
        names = json.load(f)
    for name in names:  # one chart per benchmark of docs/benchmarks.json
        with open(os.path.join(scripts.out, "charts", f"{name}.png"), "rb") as f:
            assert f.read(4) == b"\x89PNG"


@pytest.mark.slow
def test_dlrm_throughput_runs_all_three_contenders(scripts):
    _succeeded(scripts, "dlrm_throughput")
    result = scripts.json("dlrm.json")
    assert result["iterations"] == {"kfit_ps": [30], "tf_keras": [30], "keras": [30]}
    assert result["kfit_ps/tf_keras"]["median"] > 0 and result["kfit_ps/keras"]["median"] > 0
    with open(os.path.join(scripts.out, "dlrm.png"), "rb") as f:
        assert f.read(4) == b"\x89PNG"


@pytest.mark.slow
def test_fit_phases_add_up_to_each_fit(scripts):
    proc = _succeeded(scripts, "fit_phases")
    assert "optimizer.iterations == 40: True" in proc.stdout
    result = scripts.json("fit_phases.json")
    assert result["iterations"] == result["expected_iterations"] == 40
    assert len(result["fits"]) == 2
    for fit in result["fits"]:
        phases = [fit[k] for k in ("before", "steps", "join", "after")]
        assert all(p >= 0 for p in phases) and 0 <= fit["busy"] <= 1
        assert abs(10 / sum(phases) - fit["steps_per_s"]) < 0.01 * fit["steps_per_s"]


@pytest.mark.slow
def test_exact_evaluation_counts_every_example_on_both_paths(scripts):
    _succeeded(scripts, "exact_evaluation")
    result = scripts.json("exact_evaluation.json")
    for name in ("shipped", "worker_read"):
        assert [run["examples"] for run in result["runs"][name]] == [5000.0]
    assert result["ratio_worker_read_over_shipped"]["median"] > 0


@pytest.mark.slow
def test_data_ledger_reports_both_answers_to_worker_loss(scripts):
    _succeeded(scripts, "data_ledger")
    result = scripts.json("data_ledger.json")
    [ledger] = result["runs"]["ledger_kills"]
    assert ledger["kills"] == 2 and ledger["lost"] == 0
    assert ledger["trained"] == LEDGER_EXAMPLES
    assert ledger["duplicated"] <= ledger["ledger_examples_rerun"] <= 2 * 5 * 256
    [service] = result["runs"]["data_service_kills"]
    assert service["kills"] == 2 and service["trained"] + service["lost"] == LEDGER_EXAMPLES
    assert result["ratio_ledger_over_stream"]["median"] > 0
    # tf.data service over the TFRecord files: throughput beside the files' ledger and stream,
    # and its count of examples lost and duplicated under the same kills.
    [files_service] = result["runs"]["files_data_service_kills"]
    assert files_service["kills"] == 2
    assert files_service["trained"] + files_service["lost"] == LEDGER_EXAMPLES
    assert result["ratio_files_data_service_over_stream"]["median"] > 0
    assert result["ratio_files_ledger_over_stream"]["median"] > 0  # TFRecord files
    assert result["examples_per_s"]["data_service"] > 0
    for kind, records in (("TFRecord", 8 * 2**20 // 4 // 200 * 4), ("text", None)):
        index = result["index"][kind]
        assert index["seconds_per_gb"] > 0 and index["gigabytes"] > 0.008, result["index"]
        assert records is None or index["records"] == records


@pytest.mark.slow
def test_long_run_and_scaling_report(scripts):
    _succeeded(scripts, "long_run")
    result = scripts.json("long_run.json")["default"]
    assert result["steps"] == LONG_RUN_STEPS and result["window"] == LONG_RUN_WINDOW
    assert result["first_steps_per_s"] > 0 and result["last_steps_per_s"] > 0
    assert result["rss_mb_end"] > 0

    _succeeded(scripts, "scaling")
    rows = scripts.json("scaling.json")["rows"]
    assert [(r["workers"], r["ps"]) for r in rows] == [(1, 1), (2, 1)]
    assert rows[0]["efficiency"] == 1.0
    # Each worker count beside single-process Keras 3 (here in the script's process: all of
    # its cores; a fresh process per worker count runs on as many cores as workers).
    assert all(r["keras_cores"] == len(os.sched_getaffinity(0)) for r in rows), rows
    assert all(r["keras_examples_per_s"] > 0 and r["kfit_ps/keras"] > 0 for r in rows), rows
    with open(os.path.join(scripts.out, "scaling.png"), "rb") as f:
        assert f.read(4) == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.parametrize("part", ["quality", "table_size", "eviction"])
def test_dynamic_embeddings_parts_report(scripts, part):
    _succeeded(scripts, "dynamic_embeddings")
    result = scripts.json(f"{part}.json")
    if part == "quality":
        assert set(result["median_auc"]) == {"hashed", "dynamic", "unbounded", "full"}
        assert all(0 < auc <= 1 for auc in result["median_auc"].values())
        rows = {kind: runs[0]["rows"] for kind, runs in result["results"].items()}
        assert rows["dynamic"] <= 1.2 * rows["hashed"] and rows["unbounded"] <= rows["full"]
    elif part == "table_size":
        assert [r["rows"] for r in result["results"]["large"]] == [20000]
        assert result["step_time_ratio"] > 0
    else:
        assert 0 < result["peak_rows_per_shard"] <= result["bound"]
        assert result["rows"] <= 2 * (result["shard_capacity"] + result["slack"])


def test_dynamic_embeddings_parts_need_a_json_path_each():
    """Several parts write one JSON each: a `--json` path without `{part}` is refused before
    anything runs (no TensorFlow is imported)."""
    proc = subprocess.run(
        [sys.executable, "bench/dynamic_embeddings.py", "--part", "quality,eviction", "--json",
         "dynamic.json"], cwd=helpers.ROOT, env=helpers.chief_env(), capture_output=True,
        text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--json: received 'dynamic.json' for 2 parts" in proc.stderr
    assert "put {part} in the path" in proc.stderr


def test_device_parts_travel_one_call_each_and_install_once_all_are_there(tmp_path):
    """bench/device: the wheels packed in parts here (`wheels.sh`, given stand-in wheels), each
    part carried by a call of its own to one machine (`receive.sh` in a checkout holding only
    that part), installed once the last arrives; a damaged part is refused."""
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    noise = os.urandom(150_000)  # incompressible: the wheel spans several 64 KiB parts
    with zipfile.ZipFile(wheels / "kfit_ps_probe-0.1-py3-none-any.whl", "w") as whl:
        whl.writestr("kfit_ps_probe.py", "VALUE = 42\n")
        whl.writestr("kfit_ps_probe_noise.bin", noise)
        info = "kfit_ps_probe-0.1.dist-info/"
        whl.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: kfit-ps-probe\n"
                     "Version: 0.1\n")
        whl.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(info + "RECORD", "")

    def checkout(name):  # a copy of the scripts, as a call's working tree has them
        root = tmp_path / name
        (root / "bench").mkdir(parents=True)
        shutil.copytree(os.path.join(helpers.ROOT, "bench", "device"), root / "bench" / "device")
        return root

    here = checkout("here")
    env = dict(os.environ, WHEELS_FROM=str(wheels), PART_SIZE="64K",
               KFIT_PS_DEVICE_DIR=str(tmp_path / "device"))
    packed = subprocess.run(["bench/device/wheels.sh"], cwd=here, env=env, capture_output=True,
                            text=True, timeout=60)
    assert packed.returncode == 0, packed.stderr
    parts = sorted(p.name for p in (here / ".whl").glob("part??"))
    assert parts == ["part00", "part01", "part02"], packed.stdout
    assert f"{len(parts)} parts in .whl" in packed.stdout

    calls = iter(range(100))

    def carry(part, damage=False):
        call = checkout(f"call{next(calls)}")
        (call / ".whl").mkdir()
        shutil.copy(here / ".whl" / "parts.sha256", call / ".whl")
        data = (here / ".whl" / part).read_bytes()
        (call / ".whl" / part).write_bytes(data[:-1] + bytes([data[-1] ^ 1]) if damage else data)
        return subprocess.run(["bench/device/receive.sh"], cwd=call, env=env,
                              capture_output=True, text=True, timeout=60)

    damaged = carry("part01", damage=True)
    assert damaged.returncode == 1 and "part01 does not match" in damaged.stderr
    first = carry("part00")
    assert first.returncode == 0, first.stderr
    assert "holding 1 of 3 parts; still to carry: part01 part02" in first.stdout
    assert not (tmp_path / "device" / "site").exists()
    carry("part02")
    last = carry("part01")
    assert last.returncode == 0, last.stderr
    assert "every part received; the wheels are installed" in last.stdout
    site = tmp_path / "device" / "site"
    probe = subprocess.run([sys.executable, "-c", "import kfit_ps_probe as p; print(p.VALUE)"],
                           env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True,
                           text=True, timeout=60)
    assert probe.stdout.strip() == "42", probe.stderr
    assert (site / "kfit_ps_probe_noise.bin").read_bytes() == noise
    # Other wheels (a new manifest): what the machine held goes, nothing stale is installed.
    (here / ".whl" / "parts.sha256").write_text("0" * 64 + "  part00\n")
    stale = carry("part00")
    assert stale.returncode == 1 and "part00 does not match" in stale.stderr
    assert not site.exists() and not list((tmp_path / "device" / "parts").iterdir())
