"""The `kfit-ps` command line: server from TF_CONFIG or flags, local cluster."""

import json
import signal
import subprocess
import sys

import pytest

from tests import helpers


def kfit_ps_cli(*args, env_extra=None, **kwargs):
    env = helpers.chief_env()
    env.pop("TF_CONFIG", None)
    env.update(env_extra or {})
    return helpers.popen([sys.executable, "-m", "kfit_ps.cli.main", *args], env=env,
                            cwd=helpers.ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kwargs)


BAD_TF_CONFIGS = [
    ("{bad json", "not valid JSON"),
    (json.dumps({"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker"}}),
     "no 'ps' task"),
    (json.dumps({"cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]},
                 "task": {"type": "ps", "index": 3}}), "out of range"),
    (json.dumps({"cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"],
                             "chief": ["localhost:3"]}, "task": {"type": "chief"}}),
     "runs a 'worker' or 'ps' task"),
]
OVERRIDING_FLAGS = ("server", "--cluster", '{"worker": ["localhost:1"], "ps": ["localhost:2"]}',
                    "--task-type", "worker", "--task-index", "4")
BAD_FLAGS = [
    (("quickstart", "--workers", "0"), "--workers"),
    (("quickstart", "--steps-per-epoch", "-5"), "--steps-per-epoch"),
    (("local", "--ps", "0"), "--ps"),
]


@pytest.fixture(scope="module")
def failures():
    """Each erroneous command line of this module -> (exit status, stderr), run at once."""
    cases = [(("server",), {"TF_CONFIG": tf_config}) for tf_config, _ in BAD_TF_CONFIGS]
    cases += [(("server",), None), (OVERRIDING_FLAGS, None)]
    cases += [(args, None) for args, _ in BAD_FLAGS]
    results = helpers.cli_failures(cases)
    return {(argv, (env or {}).get("TF_CONFIG")): result
            for (argv, env), result in zip(cases, results)}


@pytest.mark.parametrize("tf_config, fragment", BAD_TF_CONFIGS)
def test_server_rejects_bad_tf_config(failures, tf_config, fragment):
    status, err = failures[("server",), tf_config]
    assert status == 2
    assert fragment in err and "TF_CONFIG" in err


def test_server_without_tf_config_or_flags(failures):
    status, err = failures[("server",), None]
    assert status == 2 and "TF_CONFIG is not set" in err


def test_a_failing_command_exits_with_status_2_in_its_own_process():
    """The cases above run in one interpreter (`helpers.cli_failures`); this one as users do."""
    proc = kfit_ps_cli("server")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "TF_CONFIG is not set" in err


@pytest.mark.slow
def test_server_serves_from_tf_config_and_warns():
    cluster = {"worker": [f"localhost:{helpers.free_port()}"],
               "ps": [f"localhost:{helpers.free_port()}"]}
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}})
    proc = kfit_ps_cli("server", env_extra={"TF_CONFIG": tf_config})
    try:
        helpers.wait_listening(cluster["ps"][0], proc, timeout=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "listens on ALL network interfaces" in err
    assert "unauthenticated" in err
    assert "task=ps:0" in err  # effective configuration is logged


def test_server_flags_override_tf_config(failures):
    status, err = failures[OVERRIDING_FLAGS, None]
    assert status == 2
    assert "Invalid --cluster" in err and "out of range" in err


@pytest.mark.slow
def test_local_prints_tf_config_and_stops_cleanly():
    proc = kfit_ps_cli("local", "--workers", "1", "--ps", "1")
    line = proc.stdout.readline()
    tf_config = json.loads(json.loads(line)["TF_CONFIG"])
    assert tf_config["task"] == {"type": "chief", "index": 0}
    assert len(tf_config["cluster"]["worker"]) == 1
    children = [p for p in helpers.psutil.Process(proc.pid).children(recursive=True)
                if helpers.is_server(p)]
    assert len(children) == 2
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert helpers.wait_for_no_servers([c.pid for c in children], timeout=10) == []


@pytest.mark.parametrize("args, flag", BAD_FLAGS)
def test_bad_flags_are_named(failures, args, flag):
    status, err = failures[args, None]
    assert status == 2
    assert f"{flag}: must be an integer >= 1. Received: {flag}" in err


def test_launch_defaults_come_from_launch_config_alone(monkeypatch):
    """`kfit-ps run`'s defaults, and the "(default N)" of its help, are LaunchConfig's."""
    import dataclasses

    from kfit_ps import constants
    from kfit_ps.cli import launch_commands
    from kfit_ps.cli.main import build_parser
    from kfit_ps.launch.config import LaunchConfig

    for name in (constants.WORKERS_ENV, constants.PS_ENV, constants.STATUS_PORT_ENV):
        monkeypatch.delenv(name, raising=False)
    parser = build_parser()
    args = parser.parse_args(["run", "--", "python", "train.py"])
    # --workers is both fields' flag: `worker_counts` resolves it by the form (--tasks or not).
    counts = dict(zip(("num_workers", "initial_workers"),
                      launch_commands.worker_counts(args.workers, None)))
    flags = {"num_ps": "ps"}
    for field in dataclasses.fields(LaunchConfig):
        if field.name in ("command", "tasks", "run_dir", "backup_dir", "ps_failure_grace"):
            continue
        value = counts[field.name] if field.name in counts else getattr(
            args, flags.get(field.name, field.name))
        assert value == field.default, field.name
    run_help = next(a for a in parser._subparsers._group_actions[0].choices.items()
                    if a[0] == "run")[1].format_help()
    assert "(default 3)" in run_help and "(default 20;" in " ".join(run_help.split())


def test_main_in_process_gives_the_kfit_ps_logger_back(capsys):
    """`main` owns the `kfit_ps` logger while it runs (plain messages on the stderr of that moment)
    and hands it back as found: a caller's log capture still sees kfit_ps' warnings afterwards."""
    import contextlib
    import io
    import logging

    from kfit_ps.cli import main as cli

    logger = logging.getLogger("kfit_ps")
    before = (list(logger.handlers), logger.level, logger.propagate)
    assert cli.main(["manifests", "--name", "demo", "--image", "img:1", "--", "python",
                     "t.py"]) == 0
    assert (list(logger.handlers), logger.level, logger.propagate) == before
    err = io.StringIO()
    with cli._kfit_ps_logging(), contextlib.redirect_stderr(err):
        logging.getLogger("kfit_ps.training").warning("kfit_ps: a warning")
    assert err.getvalue() == "kfit_ps: a warning\n"
    assert "kind: StatefulSet" in capsys.readouterr().out
