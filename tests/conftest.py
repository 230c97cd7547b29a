"""Shared fixtures: one real LocalCluster for the whole session, and orphan checks.

A chief process connects to one cluster for its lifetime, so tests that need
another cluster shape, or that kill processes, run their chief in a fresh
subprocess (`helpers.run_chief`).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Every process this test session starts inherits it: the orphan check below counts only this
# session's servers (pytest-xdist runs two sessions at once, `addopts` in pyproject.toml).
os.environ["KFIT_PS_TEST_SESSION"] = str(os.getpid())
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import collections  # noqa: E402
import shutil  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402

from tests import helpers, zygote  # noqa: E402


@pytest.fixture(scope="session")
def cluster():
    import kfit_ps

    with kfit_ps.LocalCluster(num_workers=2, num_ps=2) as c:
        yield c
    assert c.pids() == []


@pytest.fixture(scope="session")
def strategy(cluster):
    import kfit_ps

    return kfit_ps.ParameterServerStrategy(cluster.cluster_resolver)


@pytest.fixture(scope="session", autouse=True)
def children_tmpdir(tmp_path_factory):
    """A session directory as TMPDIR of the processes tests start (`helpers.chief_env`)."""
    path = tmp_path_factory.mktemp("children_tmp")
    helpers.CHILD_TMPDIR = str(path)
    yield path
    zygote.close()  # It was started with this TMPDIR (`helpers.run_chief`).
    helpers.CHILD_TMPDIR = None
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def no_orphan_servers():
    """Fails the session if any kfit_ps server process outlives the tests."""
    before = set(helpers.server_pids(session=os.environ["KFIT_PS_TEST_SESSION"]))
    yield
    import kfit_ps.cluster.local as local

    local._stop_live_clusters()
    leftover = helpers.wait_for_no_servers(
        helpers.server_pids(session=os.environ["KFIT_PS_TEST_SESSION"]), exclude=before,
        timeout=15)
    assert leftover == [], f"kfit_ps server processes left running: {leftover}"


@pytest.fixture(autouse=True)
def no_stray_children():
    """Every process a test spawned (`helpers.popen`) is gone after it, passed or failed."""
    yield
    helpers.reap_spawned()


@pytest.fixture
def children_reaped():
    """Asserts a test leaves none of the server processes (or server templates) it started
    behind."""
    me = psutil.Process()

    def servers():
        return {p.pid for p in me.children(recursive=True)
                if helpers.is_server(p, or_template=True)}

    before = servers()  # e.g. the session cluster's
    yield
    left = sorted(servers() - before)
    assert left == [], f"server processes left by the test: {left}"


# The order test files start in (pyproject's addopts turn xdist's own reordering off): the fault
# matrix first, a single test of about 7 minutes that no other worker can share (xdist's order,
# the files with the most tests first, started it last, and the suite ended on it alone for
# minutes), then the other files of a few long tests (in the most-tests-first order they came
# last, and one worker ended the suite on them alone for about 100 s), then the files with the
# most tests first, as xdist orders them (the longest files first measured slower: two heavy
# files at once).
FIRST = ("tests/test_fault_matrix.py", "tests/test_multi_host.py", "tests/test_ps_recovery.py",
         "tests/test_keras_scripts.py")


def pytest_collection_modifyitems(items):
    path = lambda item: item.nodeid.split("::", 1)[0]  # noqa: E731
    tests_in = collections.Counter(path(item) for item in items)
    first = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: (first.get(path(item), len(FIRST)), -tests_in[path(item)]))
