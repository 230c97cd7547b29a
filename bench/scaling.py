"""Scaling sweep: DLRM examples/s and efficiency over workers x ps tasks.

For every configuration of `--workers` x `--ps`, one fresh chief process
runs the main job's DLRM model (`dlrm_throughput.py`'s kfit_ps contender:
tables of 64 KB and more sharded over the ps tasks, batch `--batch-size`
per worker step, `--steps` timed steps after a warm-up) on a `LocalCluster`
of that shape on this machine. Efficiency = examples/s / (workers x the
examples/s of 1 worker with the same ps count); 1.0 is linear scaling.
Beside each worker count, single-process Keras 3 (`dlrm_throughput.py`'s
`keras` contender) trains the same model and data on as many cores as there are
workers, with as many intra- and inter-op threads (`--threads`: the process'
CPU affinity, which also sizes tf.data's threads), in a fresh process once per
worker count: what as many cores give without distribution. (With
`KFIT_PS_BENCH_ONE_PROCESS=1`, `child_process`, the first configuration and the
Keras 3 runs share this process, and Keras 3 runs on all its cores, which its
rows say; the other configurations need clusters of other shapes.) The JSON is
written after each configuration.

Every process of a configuration shares this machine's cores, so a figure
is bounded by the cores once workers + ps + 1 exceed them (the script says
so). For a scaling figure, run it on a machine with at least
workers + ps + 2 cores for the largest configuration (8 workers + 4 ps:
14 cores), and 1 GB of memory per process.

    python bench/scaling.py --workers 1,2,4,8 --ps 1,2,4 --png scaling.png
    python bench/scaling.py --workers 1,2 --ps 1,2 --steps 300    # on 2 cores

On a lent 16-core device machine (the sweep in one call, once the wheels have travelled there
in parts, one call each): `bench/device/README.md`.
"""

import argparse
import os
import sys

import child_process
import dlrm_throughput
import plots


def _ints(text):
    return [int(v) for v in text.split(",") if v]


def _in_this_process(child_argv, child="kfit_ps"):
    """`dlrm_throughput`'s `child` measurement of `child_argv`, run in this process (a Keras 3
    run with this process' threads: they are set once, before TensorFlow starts)."""
    parser = argparse.ArgumentParser()
    dlrm_throughput.add_arguments(parser)
    args = parser.parse_args(child_argv)
    args.child, args.threads = child, 0
    return lambda: dlrm_throughput.run_child(args)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=_ints, default=[1, 2, 4, 8])
    parser.add_argument("--ps", type=_ints, default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps-per-execution", type=int, default=5)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--png", default=None, help="write the figure to this file")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    cores = os.cpu_count() or 1
    data = argparse.Namespace(scale=1e-3, rows=args.rows)
    data_dir = dlrm_throughput.write_data(data)
    script = os.path.abspath(dlrm_throughput.__file__)
    rows, base, keras = [], {}, {}
    for ps in args.ps:
        for workers in args.workers:
            common = ["--steps", str(args.steps), "--batch-size", str(args.batch_size),
                      "--steps-per-execution", str(args.steps_per_execution),
                      "--data-dir", data_dir]
            child_argv = ["--workers", str(workers), "--ps", str(ps), *common]
            result = child_process.measure(  # (in one process: the first one only)
                script, "kfit_ps", child_argv, timeout=3600,
                run=None if rows else _in_this_process(child_argv))
            if workers not in keras:  # once per worker count, beside its first configuration
                keras_argv = ["--threads", str(workers), *common]
                keras[workers] = child_process.measure(
                    script, "keras", keras_argv, timeout=3600,
                    run=_in_this_process(keras_argv, "keras"))
            rate = result["examples_per_s"]
            base.setdefault(ps, rate / workers)
            row = {"workers": workers, "ps": ps, "examples_per_s": rate,
                   "efficiency": rate / (workers * base[ps]),
                   "keras_cores": keras[workers]["cores"],
                   "keras_examples_per_s": keras[workers]["examples_per_s"],
                   "kfit_ps/keras": rate / keras[workers]["examples_per_s"],
                   "processes": workers + ps + 1, "bounded_by_cores": workers + ps + 1 > cores}
            rows.append(row)
            shape = f"{workers} worker{'s' if workers > 1 else ''} + {ps} ps"
            print(f"{shape}: {rate:,.0f} examples/s, efficiency "
                  f"{row['efficiency']:.2f}; Keras 3 on {row['keras_cores']} core"
                  f"{'s' if row['keras_cores'] > 1 else ''}: "
                  f"{row['keras_examples_per_s']:,.0f} examples/s, "
                  f"kfit_ps/Keras 3 {row['kfit_ps/keras']:.2f}"
                  + (f" (bounded by the {cores} cores: {row['processes']} processes)"
                     if row["bounded_by_cores"] else ""), flush=True)
            child_process.write_json(args.json, {"cores": cores, "config": vars(args),
                                                 "rows": rows})
    if any(r["bounded_by_cores"] for r in rows):
        print(f"note: this machine has {cores} cores; figures marked above share them and "
              "measure the machine, not the scaling. Run on a machine with at least "
              "workers + ps + 2 cores.")
    if args.png:
        plots.scaling_chart(args.png, rows, f"kfit_ps DLRM scaling ({cores} cores, batch "
                            f"{args.batch_size}/worker step)")
    return rows


if __name__ == "__main__":
    main()
