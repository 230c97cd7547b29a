"""The benchmark scripts run and report (timings are recorded in docs, never asserted)."""

import json
import subprocess
import sys

import pytest

from tests import helpers


@pytest.mark.slow
def test_fit_overhead_runs_and_reports_a_ratio(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "bench/fit_overhead.py", "--repeats", "1", "--epochs", "1",
         "--steps", "20", "--hidden", "16", "--json", str(out)],
        cwd=helpers.ROOT, env=helpers.chief_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio kfit_ps/tf_keras: median" in proc.stdout
    result = json.loads(out.read_text())
    assert result["median_ratio"] > 0
    assert result["iterations"] == {"kfit_ps": [40], "tf_keras": [40]}


@pytest.mark.slow
def test_embedding_scaling_runs_and_reports_all_four_figures(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "bench/embedding_scaling.py", "--small-rows", "2000", "--large-rows",
         "40000", "--dim", "8", "--batch-size", "64", "--steps", "10", "--json", str(out)],
        cwd=helpers.ROOT, env=helpers.chief_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for fragment in ("1. table size:", "2. coordinator RSS", "3. examples/s", "4. bytes per step"):
        assert fragment in proc.stdout
    result = json.loads(out.read_text())
    assert result["rss"]["shards"] == [[20000, 8], [20000, 8]]
    assert result["small"]["iterations"] == result["large"]["iterations"] == 30
    assert result["tf_keras"]["iterations"] == 30
    assert result["minimum_bytes_each_way"] > 0 and result["step_time_ratio"] > 0


@pytest.mark.slow
def test_dlrm_throughput_runs_all_three_contenders(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "bench/dlrm_throughput.py", "--repeats", "1", "--steps", "10",
         "--rows", "3000", "--json", str(out), "--png", str(tmp_path / "dlrm.png")],
        cwd=helpers.ROOT, env=helpers.chief_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["iterations"] == {"kfit_ps": [30], "tf_keras": [30], "keras": [30]}
    assert result["kfit_ps/tf_keras"]["median"] > 0 and result["kfit_ps/keras"]["median"] > 0
    assert (tmp_path / "dlrm.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_exact_evaluation_counts_every_example_on_both_paths(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "bench/exact_evaluation.py", "--repeats", "1", "--rows", "5000",
         "--files", "10", "--batch-size", "256", "--json", str(out)],
        cwd=helpers.ROOT, env=helpers.chief_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in ("shipped", "worker_read"):
        assert [run["examples"] for run in result["runs"][name]] == [5000.0]
    assert result["ratio_worker_read_over_shipped"]["median"] > 0


@pytest.mark.slow
def test_long_run_and_scaling_report(tmp_path):
    out = tmp_path / "long.json"
    proc = subprocess.run(
        [sys.executable, "bench/long_run.py", "--steps", "2500", "--interval", "0.1",
         "--pending", "50", "--json", str(out)],
        cwd=helpers.ROOT, env=helpers.chief_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["default"]
    assert result["steps"] == 2500
    assert result["first_steps_per_s"] > 0 and result["last_steps_per_s"] > 0
    assert result["rss_mb_end"] > 0

    out = tmp_path / "scaling.json"
    proc = subprocess.run(
        [sys.executable, "bench/scaling.py", "--workers", "1,2", "--ps", "1", "--steps", "10",
         "--rows", "3000", "--json", str(out), "--png", str(tmp_path / "scaling.png")],
        cwd=helpers.ROOT, env=helpers.chief_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workers"], r["ps"]) for r in rows] == [(1, 1), (2, 1)]
    assert rows[0]["efficiency"] == 1.0
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.parametrize("part, extra", [
    ("quality", ["--rows", "3000", "--batch-size", "128"]),
    ("table_size", ["--small", "1000", "--large", "20000", "--steps", "20"]),
    ("eviction", ["--stream", "20000", "--capacity", "2000"]),
])
def test_dynamic_embeddings_parts_report(tmp_path, part, extra):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "bench/dynamic_embeddings.py", "--part", part, "--repeats", "1",
         "--json", str(out), *extra],
        cwd=helpers.ROOT, env=helpers.chief_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
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
