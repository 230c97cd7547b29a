"""What watching a job costs: the DLRM job's `fit` with and without kfit_ps' monitoring.

The main job's model and data (`bench/dlrm_throughput.py`'s `kfit_ps` contender, 2 workers +
2 ps). Each repeat is a fresh process with its own cluster; after a warm-up it alternates
`--pairs` pairs of timed `fit`s of `--steps` steps:

- `unobserved`: a `NullMonitor` (what `KFIT_PS_MONITOR=0` gives): no closure hook, no
  sampler, no events;
- `observed`: everything `kfit-ps run` turns on: per-function metrics, the sampler and
  diagnosis (every `KFIT_PS_DIAGNOSIS_INTERVAL` s, reading each ps' `/proc/self/stat` on the
  ps), the event log, and the chief's `/metrics` served and scraped every second by a thread
  of the chief (a Prometheus server scrapes every 15 to 60 s).

The two alternate within one process, on one cluster, so the machine's slow and fast spells
(docs/benchmarks.md) fall on both alike. Prints examples/s and the per-pair ratios
observed/unobserved, and their median over every pair of every repeat. (With
`KFIT_PS_BENCH_ONE_PROCESS=1` the repeats run in the script's own process and cluster:
`child_process`.)

    python bench/observability_overhead.py                    # as in docs/benchmarks.md
    python bench/observability_overhead.py --repeats 1 --pairs 1 --steps 100   # quick
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import urllib.request

import child_process
import dlrm_throughput as dlrm


def _scrape(url, seconds, active, stop):
    while not stop.wait(seconds):
        if not active.is_set():
            continue
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                response.read()
        except OSError:
            pass


def run_child(args):
    from kfit_ps import net
    from kfit_ps.training import monitor

    port = net.free_port("127.0.0.1")
    os.environ["KFIT_PS_METRICS_PORT"] = str(port)
    os.environ["KFIT_PS_EVENTS"] = os.path.join(tempfile.mkdtemp(), "events.jsonl")
    observed, unobserved = monitor.JobMonitor(), monitor.NullMonitor()
    active, stop = threading.Event(), threading.Event()
    threading.Thread(target=_scrape, args=(f"http://127.0.0.1:{port}/metrics", 1.0, active,
                                           stop), daemon=True).start()
    paths = sorted(os.path.join(args.data_dir, f) for f in os.listdir(args.data_dir))
    rates = {"observed": [], "unobserved": []}
    with child_process.local_cluster(args.workers, args.ps,
                                     **dlrm.kfit_strategy_args(args)) as (_, strategy):
        model, data = dlrm.make_kfit(strategy, paths, args)
        for warm in (observed, unobserved):
            monitor.use_monitor(warm)
            dlrm.timed_fit(model, data, dlrm.WARMUP_STEPS)
        for pair in range(args.pairs):
            order = ("observed", "unobserved") if pair % 2 == 0 else ("unobserved", "observed")
            for name in order:
                monitor.use_monitor(observed if name == "observed" else unobserved)
                (active.set if name == "observed" else active.clear)()
                seconds = dlrm.timed_fit(model, data, args.steps)
                rates[name].append(args.steps * args.batch_size / seconds)
        active.clear()
        iterations = int(model.optimizer.iterations.numpy())
        del model, data
    stop.set()
    child_process.report({"rates": rates, "iterations": iterations})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dlrm.add_arguments(parser)
    parser.set_defaults(repeats=3, steps=500)
    parser.add_argument("--pairs", type=int, default=4, help="timed pairs of fits per repeat")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    child_process.run_if_child(args, run_child)

    data_dir = dlrm.write_data(args)
    child_argv = [a for a in argv if a not in (args.json, "--json")] + ["--data-dir", data_dir]
    rates = {"observed": [], "unobserved": []}
    ratios = []
    expected = 2 * dlrm.WARMUP_STEPS + 2 * args.pairs * args.steps
    for repeat in range(args.repeats):
        result = child_process.measure(
            os.path.abspath(__file__), "pairs", child_argv,
            run=lambda: run_child(parser.parse_args([*child_argv, "--child", "pairs"])))
        assert result["iterations"] == expected, (result["iterations"], expected)
        for name in rates:
            rates[name].extend(result["rates"][name])
        ratios += [o / u for o, u in zip(result["rates"]["observed"],
                                          result["rates"]["unobserved"])]
        print(f"repeat {repeat + 1}/{args.repeats}: observed/unobserved per pair "
              + ", ".join(f"{r:.3f}" for r in ratios[-args.pairs:]), flush=True)
    result = {"config": {k: v for k, v in vars(args).items() if k != "child"},
              "examples_per_s": {n: statistics.median(r) for n, r in rates.items()},
              "per_fit": rates,
              "observed/unobserved": {"median": statistics.median(ratios), "per_pair": ratios}}
    print("examples/s (medians): " + ", ".join(
        f"{n} {v:,.0f}" for n, v in result["examples_per_s"].items()))
    print(f"observed/unobserved: median {statistics.median(ratios):.3f} over {len(ratios)} "
          f"pairs (min {min(ratios):.3f}, max {max(ratios):.3f}); optimizer.iterations == "
          f"{expected} after every repeat")
    child_process.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
