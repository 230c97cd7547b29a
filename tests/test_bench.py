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
