"""Where a DLRM step goes: CPU per step per process, and per kind of work within each.

The DLRM job of `bench/dlrm_throughput.py` (same model, data, batch,
`steps_per_execution`), two contenders, each measurement in a fresh process:

- `kfit_ps`: `model.fit` on a `LocalCluster` of `--workers` workers and `--ps` ps
  tasks (the main job's partitioner);
- `keras`: single-process Keras 3 `model.fit` on the same model and data.

Each measurement warms up (20 steps), then runs two timed `fit`s of `--steps` steps:

1. CPU seconds of every process (the chief is the measuring process; each worker
   and ps server) from `/proc/PID/stat` (user + system) before and after: CPU ms per
   step per process, and steps/s. Nothing else runs in the processes meanwhile.
2. The same `fit` under `perf record -g` (one per process, `--frequency` Hz): a
   sample in the kernel is put in one kind of work by the system call its kernel call
   chain comes from (`KERNEL_KINDS`), one in user space by its function and library
   (`USER_KINDS`), first match wins; each kind's share of a process' samples times
   that process' CPU ms per step of the first `fit` is its ms per step. Without
   `perf` on the PATH (or with `--no-perf`) only the first `fit` runs.

Repeats alternate the contenders; the report gives medians over the repeats, the
load average of the machine at each measurement, and the top functions of each
process.

    python bench/step_profile.py --repeats 3 --json profile.json     # docs/performance.md
    python bench/step_profile.py --repeats 1 --steps 200              # quick
"""

import argparse
import collections
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import child_process
import dlrm_throughput

CONTENDERS = ("kfit_ps", "keras")

# What a sample in the kernel was doing, by the system call it came from (its kernel call chain),
# first match wins: a thread waiting for or waking another (futex), moving bytes over loopback
# TCP or polling for them (gRPC's sockets and epoll), any other call (file reads, mmap, ...), or
# no call at all (interrupts, page faults, preemption). Context switches count where they block.
KERNEL_KINDS = (
    ("kernel: futex (thread hand-offs)", re.compile(r"futex")),
    ("kernel: sockets and epoll (gRPC)",
     re.compile(r"sock_|tcp_|inet_|unix_stream|epoll|__sys_send|__sys_recv")),
    ("kernel: other system calls", re.compile(r"__x64_sys_|__ia32_sys_")),
    ("kernel: interrupts, faults, preemption", re.compile(r"")),
)
# What a sample in user space was doing, by its function (`dso symbol`), first match wins.
USER_KINDS = (
    ("gRPC and protobuf", re.compile(r"grpc|gpr_|upb_|protobuf|absl::.*[Cc]ord")),
    ("tf.data: the pipeline and its parse ops",
     re.compile(r"tensorflow::data::|DecodeCSV|ToHashBucket|StringToNumber")),
    ("Python", re.compile(r"^\S*(python|libpython)\S* ")),
    ("thread pools: Eigen work stealing, spinning",
     re.compile(r"Eigen::(ThreadPoolTempl|RunQueue|EventCount)")),
    ("op kernels (Eigen expressions, oneDNN and its JIT code, math)",
     re.compile(r"Eigen::|dnnl|mkl|functor|^\S*libm[.-]|^perf-\d+\.map |"
                r"tensorflow::.*(Op|Kernel)\w*(<.*>)?::Compute")),
    ("TF executor: scheduling ops",
     re.compile(r"tensorflow::.*(Executor|Propagator|PendingCounts|OpKernelContext|"
                r"Device::Compute|ImmutableExecutorState)")),
    ("TF remote calls: eager service, rendezvous, functions",
     re.compile(r"tensorflow::.*([Ee]ager|Rendezvous|FunctionLibraryRuntime|Remote|Grpc|"
                r"Worker|Cancellation|CallOptions)")),
    ("TF runtime: tensors, allocators, other",
     re.compile(r"tensorflow::|tsl::|_pywrap_tensorflow|libtensorflow")),
    ("libc, libstdc++: malloc, memcpy, locks",
     re.compile(r"^\S*(libc|libstdc|ld-linux|libgcc)")),
    ("other", re.compile(r"")),
)
KINDS = tuple(kind for kind, _ in KERNEL_KINDS + USER_KINDS)


def kind_of(frames):
    """The kind of work of one sample: `frames` its call chain, leaf first, as (dso, symbol)."""
    dso, symbol = frames[0]
    if dso.startswith("[kernel"):
        chain = " ".join(s for d, s in frames if d.startswith("[kernel"))
        return next(kind for kind, regex in KERNEL_KINDS if regex.search(chain))
    line = f"{dso} {symbol}"
    return next(kind for kind, regex in USER_KINDS if regex.search(line))


_FRAME = re.compile(r"\s*[0-9a-f]+ (.*?)(?:\+0x[0-9a-f]+)? \(([^()]*)\)$")


def _perf_samples(path):
    """[(thread name, period, [(dso, symbol) leaf first])] of one `perf record -g` file."""
    out = subprocess.run(
        ["perf", "script", "-i", path, "-F", "comm,tid,period,ip,sym,dso"],
        capture_output=True, text=True, timeout=600).stdout
    samples, frames, head = [], [], None
    for line in out.splitlines() + [""]:
        if not line.strip():
            if head and frames:
                samples.append((head[0], head[1], frames))
            frames, head = [], None
        elif not line[0].isspace():
            fields = line.split()
            head = (" ".join(fields[:-2]), int(fields[-1]))
        else:
            m = _FRAME.match(line)
            if m:
                frames.append((os.path.basename(m.group(2)) if not m.group(2).startswith("[")
                               else m.group(2), m.group(1)))
    return samples


class PerfRecord:
    """`perf record` of each of `pids` (name -> pid) while the `with` block runs."""

    def __init__(self, pids, frequency, directory):
        self.pids, self.frequency, self.directory = pids, frequency, directory
        self.procs = {}

    def __enter__(self):
        for name, pid in self.pids.items():
            path = os.path.join(self.directory, f"{name}.data")
            self.procs[name] = (path, subprocess.Popen(
                ["perf", "record", "-q", "-g", "-F", str(self.frequency), "-p", str(pid),
                 "-o", path],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # perf attaches to every thread of the process before the fit starts
        return self

    def __exit__(self, *exc):
        for _, proc in self.procs.values():
            proc.send_signal(signal.SIGINT)
        for _, proc in self.procs.values():
            proc.wait(timeout=120)

    def breakdown(self, top=8):
        """name -> {"kinds": {kind: share}, "functions": [(share, dso, symbol)] of the top
        functions (by their own samples), "threads": [(share, thread name)] of the top threads,
        "kind_functions": {kind: [(share, symbol)] of its top 3 functions}}."""
        result = {}
        for name, (path, _) in self.procs.items():
            kinds, functions, threads = (collections.Counter() for _ in range(3))
            kind_functions = collections.defaultdict(collections.Counter)
            samples = _perf_samples(path)
            total = sum(period for _, period, _ in samples) or 1
            for thread, period, frames in samples:
                kind = kind_of(frames)
                kinds[kind] += period / total
                kind_functions[kind][frames[0][1]] += period / total
                functions[frames[0]] += period / total
                threads[re.sub(r"\d+$", "N", thread)] += period / total
            result[name] = {
                "kinds": dict(kinds),
                "functions": [(s, d, f) for (d, f), s in functions.most_common(top)],
                "threads": [(s, t) for t, s in threads.most_common(top)],
                "kind_functions": {k: [(s, f) for f, s in c.most_common(3)]
                                   for k, c in kind_functions.items()}}
        return result


def _timed(model, data, steps, pids):
    cpu = {name: child_process.cpu_seconds(pid) for name, pid in pids.items()}
    seconds = dlrm_throughput.timed_fit(model, data, steps)
    cpu = {name: 1000 * (child_process.cpu_seconds(pid) - cpu[name]) / steps for name, pid in pids.items()}
    return seconds, cpu


def _profile(model, data, args, pids):
    dlrm_throughput.timed_fit(model, data, dlrm_throughput.WARMUP_STEPS)
    load = os.getloadavg()[0]
    seconds, cpu = _timed(model, data, args.steps, pids)
    report = {"steps_per_s": args.steps / seconds, "cpu_ms_per_step": cpu, "load_average": load}
    if args.perf and shutil.which("perf"):
        with tempfile.TemporaryDirectory(prefix="kfit_ps_perf_") as directory:
            with PerfRecord(pids, args.frequency, directory) as perf:
                perf_seconds, perf_cpu = _timed(model, data, args.steps, pids)
            report["perf_steps_per_s"] = args.steps / perf_seconds
            report["perf_cpu_ms_per_step"] = perf_cpu
            report["breakdown"] = perf.breakdown()
    return report


def run_child(args):
    paths = sorted(os.path.join(args.data_dir, f) for f in os.listdir(args.data_dir))
    if args.child == "keras":
        model, data = dlrm_throughput.make_keras(paths, args)
        child_process.report(_profile(model, data, args, {"process": os.getpid()}))
        return
    with child_process.local_cluster(args.workers, args.ps,
                                     **dlrm_throughput.kfit_strategy_args(args)) as (
            cluster, strategy):
        model, data = dlrm_throughput.make_kfit(strategy, paths, args)
        pids = {"chief": os.getpid()}
        pids.update({f"worker:{i}": cluster.pid("worker", i) for i in range(args.workers)})
        pids.update({f"ps:{i}": cluster.pid("ps", i) for i in range(args.ps)})
        child_process.report(_profile(model, data, args, pids))
        del model, data


def summarize(reports):
    """Medians over repeats: {contender: {process: {"cpu": ms, kind: ms}}} and steps/s."""
    table = {}
    for name, runs in reports.items():
        processes = runs[0]["cpu_ms_per_step"].keys()
        rows = {}
        for process in processes:
            row = {"cpu": statistics.median(r["cpu_ms_per_step"][process] for r in runs)}
            for kind in KINDS:
                values = [r["cpu_ms_per_step"][process]
                          * r["breakdown"][process]["kinds"].get(kind, 0)
                          for r in runs if "breakdown" in r]
                if values:
                    row[kind] = statistics.median(values)
            rows[process] = row
        table[name] = {"steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
                       "processes": rows}
    return table


def print_table(table, args):
    examples = {n: t["steps_per_s"] * args.batch_size for n, t in table.items()}
    for name, t in table.items():
        print(f"\n{name}: {t['steps_per_s']:.1f} steps/s ({examples[name]:,.0f} examples/s); "
              "CPU ms per step (medians)")
        processes = list(t["processes"])
        print(f"  {'':52s}" + "".join(f"{p:>10s}" for p in processes) + f"{'total':>10s}")
        for key in ["cpu"] + list(KINDS):
            values = [t["processes"][p].get(key) for p in processes]
            if all(v is None for v in values):
                continue
            label = "CPU (/proc/PID/stat)" if key == "cpu" else key
            print(f"  {label:52s}" + "".join(f"{v or 0:10.2f}" for v in values)
                  + f"{sum(v or 0 for v in values):10.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dlrm_throughput.add_arguments(parser)
    parser.set_defaults(repeats=3, steps=500)
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated, of {', '.join(CONTENDERS)}")
    parser.add_argument("--frequency", type=int, default=499, help="perf samples/s per CPU")
    parser.add_argument("--no-perf", dest="perf", action="store_false",
                        help="CPU per process only")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--child", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    child_process.run_if_child(args, run_child)

    contenders = [c for c in args.contenders.split(",") if c]
    data_dir = dlrm_throughput.write_data(args)
    child_argv = [a for a in argv if a not in (args.json, "--json")] + ["--data-dir", data_dir]
    reports = {name: [] for name in contenders}
    for repeat in range(args.repeats):
        order = contenders if repeat % 2 == 0 else list(reversed(contenders))
        for name in order:
            result = child_process.measure(os.path.abspath(__file__), name, child_argv)
            reports[name].append(result)
            cpu = result["cpu_ms_per_step"]
            print(f"repeat {repeat + 1}/{args.repeats} {name}: load {result['load_average']:.2f}, "
                  f"{result['steps_per_s']:.1f} steps/s, CPU ms/step "
                  + ", ".join(f"{p} {v:.2f}" for p, v in cpu.items()), flush=True)
            for process, profile in result.get("breakdown", {}).items():
                print(f"  {process} top functions: " + "; ".join(
                    f"{share:.1%} {symbol[:50]} ({dso})"
                    for share, dso, symbol in profile["functions"][:5]))
                print(f"  {process} threads: " + ", ".join(
                    f"{thread} {share:.0%}" for share, thread in profile["threads"][:6]))
    table = summarize(reports)
    print_table(table, args)
    child_process.write_json(args.json, {"config": {k: v for k, v in vars(args).items()
                                                    if k != "child"},
                                         "kinds": KINDS, "medians": table, "runs": reports})
    return table


if __name__ == "__main__":
    main()
