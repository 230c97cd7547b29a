"""`kfit-ps`: a thin command line over kfit_ps functions.

    kfit-ps quickstart              train the demo model on a local cluster
    kfit-ps run --workers 2 --ps 1 [--backup-dir D --save-freq N] -- python train.py ARGS
                                    run a script as the chief of a supervised job that
                                    survives the loss of any task
    kfit-ps status --run-dir D | --url URL
                                    show a running job: tasks, restarts, speed, events
    kfit-ps scale --run-dir D --workers N
                                    add or remove workers of a running job during fit
    kfit-ps manifests --name job --image IMG --workers 4 --ps 2 -- python /app/train.py
                                    print the job's Kubernetes manifests (YAML)
    kfit-ps server                  run this machine's worker/ps server (TF_CONFIG)
    kfit-ps local --workers 2 --ps 1
                                    start a local cluster and print the chief's TF_CONFIG
    kfit-ps evaluator --checkpoint-dir D --model-fn M:F --data-fn M:F
                                    evaluate each checkpoint training writes (side-car)

Each flag falls back to an environment variable, then to a default; the
effective configuration is printed at start. Only `quickstart`, `server` and
`evaluator` load TensorFlow, inside their handlers; `local` never does, and the
launcher's commands (`run`, `status`, `scale`, `manifests`) only to delete remote
(gs://) backups once a script succeeded.
"""

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading

from kfit_ps import constants
from kfit_ps.cli import launch_commands
from kfit_ps.cli.flags import flag_error


def _require_positive(parser, *flags):
    for flag, value in flags:
        if value < 1:
            flag_error(parser, flag, value, "must be an integer >= 1.")


def _cmd_quickstart(args, parser):
    from kfit_ps._setup import prepare_training
    from kfit_ps.jobs.quickstart import QUICKSTART_FLAGS, QuickstartConfig, run

    _require_positive(parser, *((flag, getattr(args, name))
                                for name, (flag, _) in QUICKSTART_FLAGS.items()
                                if name != "verbose" and getattr(args, name) is not None))
    if not constants.launched():  # Under `kfit-ps run`, its servers: their network decides.
        launch_commands.network(args.network, args.argv)
    config = QuickstartConfig(**{name: getattr(args, name) for name in QUICKSTART_FLAGS})
    print(f"kfit-ps quickstart: {config}", flush=True)
    prepare_training()  # Once the flags are checked: this loads TensorFlow and Keras.
    results = run(config)
    return 0 if results["auc"] > 0.5 else 1


def _server_config(args, parser):
    from kfit_ps.cluster.spec import ClusterConfig

    if args.cluster is not None:
        try:
            cluster = json.loads(args.cluster)
        except json.JSONDecodeError as e:
            flag_error(parser, "--cluster", args.cluster, f"must be JSON ({e.msg}), e.g. "
                        '\'{"worker": ["h:2222"], "ps": ["h:2223"]}\'.')
        task_type, task_index, source = args.task_type, args.task_index, "--cluster"
        if task_type is None:
            parser.error("--task-type is required with --cluster (worker or ps).")
        return ClusterConfig(cluster=cluster, task_type=task_type, task_index=task_index or 0,
                             source=source)
    config = ClusterConfig.from_tf_config()
    if args.task_type is not None or args.task_index is not None:
        config = ClusterConfig(
            cluster=dict(config.cluster),
            task_type=args.task_type if args.task_type is not None else config.task_type,
            task_index=args.task_index if args.task_index is not None else config.task_index,
            source=constants.TF_CONFIG + " with --task-type/--task-index")
    return config


def _cmd_server(args, parser):
    from kfit_ps.cluster.server import run_server

    try:
        config = _server_config(args, parser)
    except ValueError as e:
        parser.error(str(e))
    print(f"kfit-ps server: {config!r} worker_threads={args.worker_threads or 'auto'}",
          file=sys.stderr, flush=True)
    try:
        run_server(config, inter_op_threads=args.worker_threads)
    except ValueError as e:
        parser.error(str(e))
    return 0


def _cmd_local(args, parser):
    from kfit_ps.cluster.local import LocalCluster

    _require_positive(parser, ("--workers", args.workers), ("--ps", args.ps))
    cluster = LocalCluster(num_workers=args.workers, num_ps=args.ps)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # Before anyone can read the line.
    with cluster:
        print(json.dumps({"TF_CONFIG": cluster.config.to_tf_config()}), flush=True)
        print("kfit-ps local: servers running; press Ctrl-C to stop them.", file=sys.stderr,
              flush=True)
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
    return 0


def _local_default(name):
    """`LocalCluster`'s default for `name` (its module loads no TensorFlow)."""
    import inspect

    from kfit_ps.cluster.local import LocalCluster

    return inspect.signature(LocalCluster).parameters[name].default


def _load_callable(parser, flag, spec):
    """`package.module:function` or `path/to/file.py:function` -> the function."""
    import importlib
    import importlib.util

    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        flag_error(parser, flag, spec, "must be MODULE:FUNCTION or FILE.py:FUNCTION.")
    try:
        if module_name.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location("kfit_ps_user_entry",
                                                                 module_name)
            if loader_spec is None or not os.path.exists(module_name):
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        function = getattr(module, attr)
    except (ImportError, AttributeError) as e:
        flag_error(parser, flag, spec, f"could not be loaded ({e}).")
    if not callable(function):
        flag_error(parser, flag, spec, "does not name a function.")
    return function


def _cmd_evaluator(args, parser):
    from kfit_ps._setup import prepare_training
    from kfit_ps.cluster.spec import ClusterConfig

    if constants.tf_config():
        try:
            config = ClusterConfig.from_tf_config()
        except ValueError as e:
            parser.error(str(e))
        if config.task_type != "evaluator":
            parser.error(f"{constants.TF_CONFIG} says this task is {config.task_type!r}; "
                         "`kfit-ps evaluator` runs the 'evaluator' task. Set task.type to "
                         "'evaluator' (or unset TF_CONFIG).")
    if args.max_evaluations is not None:
        _require_positive(parser, ("--max-evaluations", args.max_evaluations))
    prepare_training()  # Before the user's modules load: they may build kfit_ps models.
    from kfit_ps.evaluator import SidecarEvaluator

    model_fn = _load_callable(parser, "--model-fn", args.model_fn)
    data_fn = _load_callable(parser, "--data-fn", args.data_fn)
    print(f"kfit-ps evaluator: checkpoint_dir={args.checkpoint_dir!r} model_fn={args.model_fn} "
          f"data_fn={args.data_fn} steps={args.steps} max_evaluations={args.max_evaluations} "
          f"log_dir={args.log_dir or args.checkpoint_dir!r} export_best={args.export_best!r}",
          file=sys.stderr, flush=True)
    evaluator = SidecarEvaluator(
        model_fn(), data_fn(), args.checkpoint_dir, steps=args.steps,
        max_evaluations=args.max_evaluations, log_dir=args.log_dir,
        export_best=args.export_best, monitor=args.monitor, mode=args.mode,
        idle_timeout=args.idle_timeout)
    for evaluation in evaluator.evaluate_as_they_come():
        print(json.dumps({"checkpoint": os.path.basename(evaluation.path),
                          "step": evaluation.step, **evaluation.logs}), flush=True)
    if evaluator.training_failed is not None:
        print(f"kfit-ps evaluator: training failed ({evaluator.training_failed}); stopped "
              f"after {len(evaluator.evaluations)} evaluations.", file=sys.stderr, flush=True)
        return 1
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="kfit-ps", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    quick = sub.add_parser("quickstart", help="train the demo recommendation model locally")
    from kfit_ps.jobs.quickstart import QUICKSTART_FLAGS, QUICKSTART_HELP  # No TensorFlow.

    from_env = {"num_workers": constants.WORKERS_ENV, "num_ps": constants.PS_ENV}
    for name, (flag, default) in QUICKSTART_FLAGS.items():
        if name in from_env:
            default = constants.env_int(from_env[name], default)
        quick.add_argument(flag, dest=name, metavar=flag[2:].upper().replace("-", "_"),
                           type=int, default=default, help=QUICKSTART_HELP.get(name),
                           choices=(0, 1, 2) if name == "verbose" else None)
    quick.add_argument("--network", choices=("isolated", "host"), default="isolated",
                       help="isolated (default where possible): servers in a private network "
                            "namespace; host: this machine's network")
    quick.set_defaults(handler=_cmd_quickstart)

    server = sub.add_parser("server", help="run a worker or ps server from TF_CONFIG or flags")
    server.add_argument("--cluster", default=None,
                        help='cluster JSON, e.g. \'{"worker": ["h:2222"], "ps": ["h:2223"]}\' '
                             "(default: TF_CONFIG's cluster)")
    server.add_argument("--task-type", choices=("worker", "ps"), default=None,
                        help="default: TF_CONFIG's task.type")
    server.add_argument("--task-index", type=int, default=None,
                        help="default: TF_CONFIG's task.index")
    server.add_argument("--worker-threads", type=int,
                        default=constants.env_int(constants.WORKER_THREADS_ENV, 0) or None,
                        help="inter-op threads of a worker (default: safe automatic value)")
    server.set_defaults(handler=_cmd_server)

    launch_commands.add_parsers(sub)

    local = sub.add_parser("local", help="start a local cluster and print its TF_CONFIG")
    local.add_argument("--workers", type=int, default=constants.env_int(
        constants.WORKERS_ENV, _local_default("num_workers")))
    local.add_argument("--ps", type=int, default=constants.env_int(
        constants.PS_ENV, _local_default("num_ps")))
    local.set_defaults(handler=_cmd_local)

    evaluator = sub.add_parser("evaluator", help="evaluate each new checkpoint (side-car)")
    evaluator.add_argument("--checkpoint-dir", required=True,
                           help="directory that training's ModelCheckpoint writes")
    evaluator.add_argument("--model-fn", required=True,
                           help="MODULE:FUNCTION or FILE.py:FUNCTION returning a compiled model")
    evaluator.add_argument("--data-fn", required=True,
                           help="MODULE:FUNCTION or FILE.py:FUNCTION returning evaluation data")
    evaluator.add_argument("--steps", type=int, default=None)
    evaluator.add_argument("--max-evaluations", type=int, default=None)
    evaluator.add_argument("--log-dir", default=None,
                           help="TensorBoard summaries go to LOG_DIR/validation "
                                "(default: the checkpoint directory)")
    evaluator.add_argument("--export-best", default=None, help="save the best model here (.keras)")
    evaluator.add_argument("--monitor", default="loss")
    evaluator.add_argument("--mode", choices=("min", "max"), default="min")
    evaluator.add_argument("--idle-timeout", type=float, default=None,
                           help="stop after this many seconds without a new checkpoint")
    evaluator.set_defaults(handler=_cmd_evaluator)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a message comes (a caller may have replaced it)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


@contextlib.contextmanager
def _kfit_ps_logging():
    """The `kfit_ps` logger's messages, plain, at `KFIT_PS_LOG_LEVEL`, for as long as `main` runs.

    `main` is the application, so it owns the logger while it runs; called in-process (a test, a
    notebook), it gives the logger back as it found it.
    """
    logger = logging.getLogger("kfit_ps")
    before = (logger.level, logger.propagate)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    try:
        logger.addHandler(handler)
        logger.setLevel(constants.log_level())
        logger.propagate = False
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before[0])
        logger.propagate = before[1]


def main(argv=None):
    with _kfit_ps_logging():
        parser = build_parser()
        args = parser.parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # to re-execute isolated
        status = args.handler(args, parser)
        sys.stdout.flush()
        sys.stderr.flush()
        if args.command in ("quickstart", "evaluator", "run"):
            # The servers are gone; skip interpreter teardown, where TensorFlow would try (and
            # loudly fail) to unregister functions from them. That skips autograph's clean-up
            # too (`run`, the launcher, loads no TensorFlow: its chief cleans up after itself).
            if args.command != "run":
                from kfit_ps._tf_compat import remove_autograph_files

                remove_autograph_files()
            os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
