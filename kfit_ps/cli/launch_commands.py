"""`kfit-ps run`, `status`, `scale` and `manifests`: thin layers over `kfit_ps.launch`.

Also the network mode of a command (`network`): re-executed in a private
network namespace when isolation is asked for and possible.
"""

import argparse
import sys

from kfit_ps import constants
from kfit_ps.cli.flags import flag_error


def network(requested, argv, required_by=None):
    """Re-executes in a private network namespace when `requested` is "isolated" and that is
    possible (never returns then); returns the mode that runs, after saying which.

    `required_by`: the flag that asked for isolation explicitly (`--isolated`); where
    isolation is impossible, the command then stops with status 2 instead of running on
    the open network.
    """
    from kfit_ps.launch import isolation

    if isolation.inside():
        isolation.enter()
        print("kfit-ps: network isolated: the servers run in a private network namespace with "
              "loopback only; no other host or process can reach their ports.",
              file=sys.stderr, flush=True)
        return "isolated"
    if requested == "isolated":
        why = isolation.available()
        if why is None:
            isolation.reexec_isolated([sys.executable, "-m", "kfit_ps.cli.main", *argv])
        if required_by:
            print(f"kfit-ps: {required_by}: a private network namespace is not available here "
                  f"({why}); nothing was started. Fix that, or drop {required_by} to run on this "
                  "machine's network (see docs/security.md).", file=sys.stderr, flush=True)
            sys.exit(2)
        print(f"kfit-ps: network not isolated ({why}): the servers use this machine's "
              "network.", file=sys.stderr, flush=True)
    return "host"


def _parse_tasks(parser, text):
    tasks = []
    for item in (text or "").split(","):
        task_type, sep, index = item.strip().partition(":")
        if not sep or task_type not in ("chief", "worker", "ps") or not index.isdigit():
            flag_error(parser, "--tasks", text, "must be a comma-separated list of TYPE:INDEX "
                        "with TYPE chief, worker or ps, e.g. --tasks ps:0,worker:1.")
        tasks.append((task_type, int(index)))
    return tuple(tasks)


def _save_freq(value):
    """argparse type of `--save-freq`: 'epoch' or a positive number of steps."""
    if value == "epoch":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(
            f"must be 'epoch' or a positive number of steps. Received: --save-freq {value!r}.")
    return int(value)


def _chief_command(args):
    """The command after `--` (argparse keeps the `--` in a REMAINDER argument)."""
    command = list(args.chief_command)
    return command[1:] if command[:1] == ["--"] else command


def worker_counts(workers, tasks):
    """`LaunchConfig`'s `(num_workers, initial_workers)` from `--workers` (None: not given).

    Without --tasks, the servers to start: $KFIT_PS_WORKERS, else `num_workers`' default.
    With --tasks, the first N of TF_CONFIG's workers the chief starts on (default all; no
    environment variable: every host of a job shares its environment).
    """
    if tasks is not None:
        return _default("num_workers"), workers
    if workers is None:
        workers = constants.env_int(constants.WORKERS_ENV, _default("num_workers"))
    return workers, _default("initial_workers")


def cmd_run(args, parser):
    from kfit_ps.launch import LaunchConfig, Supervisor

    if args.isolated and args.tasks is not None:
        flag_error(parser, "--isolated", "with --tasks", "isolates a job that runs on this "
                    "machine alone; a host of a multi-host job needs its network.")
    network("isolated" if args.isolated else "host", args.argv, required_by="--isolated")
    tasks = _parse_tasks(parser, args.tasks) if args.tasks is not None else None
    num_workers, initial_workers = worker_counts(args.workers, tasks)
    try:
        config = LaunchConfig(command=_chief_command(args), num_workers=num_workers,
                              initial_workers=initial_workers,
                              num_ps=args.ps, max_restarts=args.max_restarts,
                              backup_dir=args.backup_dir, save_freq=args.save_freq,
                              run_dir=args.run_dir, tasks=tasks, backoff=args.backoff,
                              max_backoff=args.max_backoff, grace=args.grace,
                              healthy_period=args.healthy_period,
                              liveness_timeout=args.liveness_timeout,
                              status_port=args.status_port,
                              status_address=args.status_address,
                              ps_recovery=args.ps_recovery,
                              discover_workers=args.discover_workers,
                              max_workers=args.max_workers,
                              discovery_grace=args.discovery_grace)
    except ValueError as e:
        parser.error(str(e))
    return Supervisor(config).run()


def cmd_status(args, parser):
    from kfit_ps.launch import status_report

    if (args.run_dir is None) == (args.url is None):
        flag_error(parser, "--run-dir/--url", "both" if args.run_dir else "neither",
                   "pass one: the run directory `kfit-ps run` printed, or its status page's "
                   "address.")
    try:
        url = args.url or status_report.status_url(args.run_dir)
        status = status_report.fetch(url)
    except status_report.StatusUnavailable as e:
        fallback = args.run_dir and status_report.from_events(args.run_dir)
        if fallback:
            print(fallback)
            return 0
        print(f"kfit-ps status: {e}", file=sys.stderr)
        return 1
    if args.json:
        import json

        print(json.dumps(status, indent=1))
    else:
        print(status_report.render(status, url, events=args.events))
    return 0


def cmd_scale(args, parser):
    from kfit_ps import membership

    try:
        membership.request_scale(args.run_dir, args.workers)
    except ValueError as e:
        parser.error(str(e))
    print(f"kfit-ps scale: asked the job in {args.run_dir} for {args.workers} workers; its "
          "launcher's output and `kfit-ps status` show the change")
    return 0


def _resources(parser, flag, text):
    """`worker=2,ps=1` -> {"worker": "2", "ps": "1"}."""
    resources = {}
    for item in (text or "").split(","):
        if not item:
            continue
        task_type, sep, value = item.partition("=")
        if not sep or task_type not in ("chief", "worker", "ps", "evaluator") or not value:
            flag_error(parser, flag, text, "must be TYPE=VALUE pairs separated by commas, "
                        "e.g. worker=2,ps=1,chief=1.")
        resources[task_type] = value
    return resources


# `kfit-ps manifests --format`: each form, for the help and for the error of a wrong value.
_FORMATS = {
    "jobset": "one JobSet: needs the JobSet controller, v0.12 or later",
    "trainer-runtime": "a Kubeflow Trainer v2 ClusterTrainingRuntime named --name and a "
                       "TrainJob on it, written against Trainer v2.3.0",
    "statefulsets": "StatefulSets and Jobs, for any cluster",
}


def cmd_manifests(args, parser):
    import shlex

    from kfit_ps.launch import jobset, manifests, trainer_runtime

    if args.format not in _FORMATS:
        flag_error(parser, "--format", args.format, "must be " + " or ".join(
            f"'{name}' ({what})" for name, what in _FORMATS.items()) + ".")
    render = {"statefulsets": manifests.render, "jobset": jobset.render,
              "trainer-runtime": lambda config: trainer_runtime.render(config, args.train_job)}
    if args.ttl_after_finished is not None and args.format == "statefulsets":
        flag_error(parser, "--ttl-after-finished", args.ttl_after_finished,
                   "deletes a finished JobSet: pass it with --format jobset or trainer-runtime, "
                   "or drop it.")
    if args.train_job is not None and args.format != "trainer-runtime":
        flag_error(parser, "--train-job", args.train_job,
                   "names the TrainJob of a Kubeflow Trainer runtime: pass it with --format "
                   "trainer-runtime, or drop it (--name names the job).")
    try:
        config = manifests.ManifestConfig(
            name=args.name, image=args.image, command=_chief_command(args),
            num_workers=args.workers,
            num_ps=args.ps, namespace=args.namespace, port=args.port, claim=args.claim,
            evaluator_command=shlex.split(args.evaluator) if args.evaluator else None,
            backup_dir=args.backup_dir, save_freq=args.save_freq,
            max_restarts=args.max_restarts, grace=args.grace, status_port=args.status_port,
            cpu=_resources(parser, "--cpu", args.cpu),
            memory=_resources(parser, "--memory", args.memory),
            ttl_after_finished=args.ttl_after_finished, max_workers=args.max_workers)
        objects = render[args.format](config)
    except ValueError as e:
        parser.error(str(e))
    # The runtime's documents each under a comment on who applies it and what it fixes.
    write = trainer_runtime.to_yaml if args.format == "trainer-runtime" else manifests.to_yaml
    sys.stdout.write(write(objects))
    return 0


def _default(name):
    """`LaunchConfig`'s default for `name`: the one place launch defaults are set."""
    from kfit_ps.launch.config import LAUNCH_DEFAULTS

    return LAUNCH_DEFAULTS[name]


def _manifest_default(name):
    """`ManifestConfig`'s default for `name`: the one place manifest defaults are set."""
    from kfit_ps.launch.manifests import MANIFEST_DEFAULTS

    return MANIFEST_DEFAULTS[name]


def _shown(name, default=_default):
    value = default(name)
    return f"{value:g}" if isinstance(value, float) else str(value)


# The restart and stop flags of `kfit-ps run`: (flag, type, help with its {default}); each
# flag's default is `LaunchConfig`'s field of the same name.
_TIMING_FLAGS = (
    ("--max-restarts", int, "restarts allowed per task before the job fails ({default})"),
    ("--backoff", float, "seconds before a task's first restart; doubles with each further "
                         "one ({default})"),
    ("--max-backoff", float, "longest wait before a restart, in seconds ({default})"),
    ("--healthy-period", float, "seconds without a failure after which a task's restart "
                                "budget is full again ({default})"),
    ("--grace", float, "seconds the chief gets after SIGTERM to finish its steps in flight "
                       "and write a final backup ({default}; Kubernetes allows 30 unless "
                       "told otherwise)"),
    ("--liveness-timeout", float, "seconds a server may accept connections without "
                                  "answering before it is killed and restarted ({default}; "
                                  "0: off)"),
)


def add_parsers(sub):
    """Adds the `run`, `status`, `scale` and `manifests` subcommands to `sub` (argparse
    subparsers)."""
    from kfit_ps.launch.manifests import SHUTDOWN_MARGIN

    run = sub.add_parser(
        "run", help="run a script as the chief of a job that survives the loss of any task",
        description="Starts the worker and ps servers and the script (after --) as the chief, "
                    "with TF_CONFIG set; restarts lost tasks; returns the chief's exit status.")
    run.add_argument("--workers", type=int, default=None,
                     help="worker servers to start (default $KFIT_PS_WORKERS, else "
                          f"{_shown('num_workers')}); with --tasks chief:0, the chief starts "
                          "on the first N of TF_CONFIG's workers, and `kfit-ps scale` changes "
                          "N within them (default: all)")
    run.add_argument("--ps", type=int,
                     default=constants.env_int(constants.PS_ENV, _default("num_ps")))
    for flag, kind, what in _TIMING_FLAGS:
        field = flag[2:].replace("-", "_")
        run.add_argument(flag, type=kind, default=_default(field),
                         help=what.format(default=f"default {_shown(field)}"))
    run.add_argument("--backup-dir", default=None,
                     help="fit backs up here and resumes from it after a restart")
    run.add_argument("--save-freq", default=_default("save_freq"), type=_save_freq,
                     help="backup frequency: 'epoch' or a number of steps "
                          f"(default {_shown('save_freq')})")
    run.add_argument("--run-dir", default=None,
                     help="per-task logs and tasks.json (default: a new temporary directory)")
    run.add_argument("--status-port", type=int,
                     default=constants.env_int(constants.STATUS_PORT_ENV, _default("status_port")),
                     help="port of the status page and metrics (/, /status.json, /metrics); "
                          "the chief's metrics take the next port (default "
                          f"$KFIT_PS_STATUS_PORT, else {_shown('status_port')}: free ports, "
                          "printed at start)")
    run.add_argument("--status-address", default=_default("status_address"),
                     help="address the status page listens on (default "
                          f"{_shown('status_address')}: this machine only; 0.0.0.0 lets a "
                          "scraper on another host in)")
    run.add_argument("--ps-recovery", choices=constants.PS_RECOVERY_MODES,
                     default=_default("ps_recovery"),
                     help="a lost ps: 'in-place' restarts it and the chief restores its "
                          "variables from the last backup, the rest keeping their state; "
                          "'restart' restarts the whole job from the last backup (default "
                          f"{_shown('ps_recovery')})")
    run.add_argument("--isolated", action="store_true",
                     help="run the job in a private network namespace (loopback only); the "
                          "script then cannot reach remote data or gs://")
    run.add_argument("--tasks", default=None,
                     help="multi-host form: this host's tasks of TF_CONFIG's cluster, e.g. "
                          "ps:0,worker:1 (chief:0 runs the command)")
    run.add_argument("--discover-workers", default=None, metavar="PATTERN",
                     help="with --tasks chief:0: find the workers through DNS, as HOST:PORT "
                          "with {i} for the index (e.g. job-worker-{i}.job-worker.ns.svc:2222) "
                          "or a headless Service's HOST:PORT (its A records); workers join "
                          "as their names resolve and serve, and leave when they stop "
                          "resolving (default: TF_CONFIG's workers)")
    run.add_argument("--max-workers", type=int, default=_default("max_workers"),
                     help="with --discover-workers: the most workers, the indices 0..N-1 "
                          f"asked (default {_shown('max_workers')})")
    run.add_argument("--discovery-grace", type=float, default=_default("discovery_grace"),
                     help="with --discover-workers: seconds a worker's name may stop "
                          "resolving before it is removed (default "
                          f"{_shown('discovery_grace')})")
    run.add_argument("chief_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                     help="the chief's command, e.g. -- python train.py")
    run.set_defaults(handler=cmd_run)

    status = sub.add_parser(
        "status", help="show a running job: tasks, restarts, speed, CPU, memory, events",
        description="Reads the status page of a job's launcher (kfit-ps run) and prints it.")
    status.add_argument("--run-dir", default=None, help="the job's run directory")
    status.add_argument("--url", default=None,
                        help="the status page's address, e.g. http://host:9400/")
    status.add_argument("--events", type=int, default=8, help="recent events shown (default 8)")
    status.add_argument("--json", action="store_true", help="print status.json as it is")
    status.set_defaults(handler=cmd_status)

    scale = sub.add_parser(
        "scale", help="add or remove workers of a running job (kfit-ps run) during fit",
        description="Asks a job's launcher for a number of workers: new ones join the "
                    "chief's fit at its next safe point; removed ones are drained, then "
                    "stopped. On the chief's host of a multi-host job (--tasks chief:0), the "
                    "first N of TF_CONFIG's workers, once they serve. Returns at once.")
    scale.add_argument("--run-dir", required=True,
                       help="the job's run directory (printed by kfit-ps run at its start)")
    scale.add_argument("--workers", type=int, required=True,
                       help="the number of workers the job should have (at least 1)")
    scale.set_defaults(handler=cmd_scale)

    manifests = sub.add_parser(
        "manifests", help="print the Kubernetes manifests of a job (YAML)",
        description="Renders a JobSet (--format jobset), a Kubeflow Trainer v2 "
                    "ClusterTrainingRuntime and a TrainJob on it (--format trainer-runtime), or "
                    "Services, StatefulSets (workers, ps) and Jobs (chief, evaluator) (--format "
                    "statefulsets), with PodDisruptionBudgets and a NetworkPolicy; apply with "
                    "`kubectl apply -f -`.")
    manifests.add_argument("--format", default="statefulsets", help="; ".join(
        f"'{name}': {what}" for name, what in _FORMATS.items()) + " (default statefulsets)")
    manifests.add_argument("--ttl-after-finished", type=int, default=None,
                           help="with --format jobset or trainer-runtime: seconds after which "
                                "a finished JobSet is deleted (default: kept)")
    manifests.add_argument("--train-job", default=None,
                           help="with --format trainer-runtime: the example TrainJob's name "
                                "(default: --name)")
    manifests.add_argument("--name", required=True,
                           help="the job's name (a DNS label); with --format trainer-runtime "
                                "the runtime's")
    manifests.add_argument("--image", required=True, help="container image")
    manifests.add_argument("--workers", type=int, default=_manifest_default("num_workers"))
    manifests.add_argument("--max-workers", type=int, default=None,
                           help="workers found through DNS: the chief takes the workers "
                                "whose names resolve, up to this many, so `kubectl scale` of "
                                "the workers is all a change takes (default: --workers, fixed)")
    manifests.add_argument("--ps", type=int, default=_manifest_default("num_ps"))
    manifests.add_argument("--namespace", default=_manifest_default("namespace"))
    manifests.add_argument("--port", type=int, default=_manifest_default("port"))
    manifests.add_argument("--claim", default=None,
                           help="PersistentVolumeClaim mounted at "
                                f"{_manifest_default('mount_path')} in every pod")
    manifests.add_argument("--backup-dir", default=None,
                           help="the chief's --backup-dir (default "
                                f"{_manifest_default('mount_path')}/backup with --claim)")
    manifests.add_argument("--save-freq", default=_manifest_default("save_freq"),
                           type=_save_freq,
                           help="the chief's backup frequency (default "
                                f"{_shown('save_freq', _manifest_default)} steps)")
    manifests.add_argument("--max-restarts", type=int, default=_manifest_default("max_restarts"))
    manifests.add_argument("--grace", type=int, default=_manifest_default("grace"),
                           help="seconds the chief gets after SIGTERM to save (default "
                                f"{_shown('grace', _manifest_default)}); its pod's "
                                f"terminationGracePeriodSeconds is this + {SHUTDOWN_MARGIN}")
    manifests.add_argument("--evaluator", default=None,
                           help='the evaluator\'s command, e.g. "kfit-ps evaluator '
                                '--checkpoint-dir /shared/ckpt --model-fn m:f --data-fn m:g"')
    manifests.add_argument("--status-port", type=int, default=_manifest_default("status_port"),
                           help="each launcher's status page and metrics port, scraped by "
                                "Prometheus (default "
                                f"{_shown('status_port', _manifest_default)}; the chief's own "
                                "takes the next)")
    manifests.add_argument("--cpu", default="", help="CPU requests, e.g. worker=2,ps=1,chief=1")
    manifests.add_argument("--memory", default="", help="memory requests, e.g. ps=8Gi")
    manifests.add_argument("chief_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                           help="the chief's command, e.g. -- python /app/train.py")
    manifests.set_defaults(handler=cmd_manifests)
