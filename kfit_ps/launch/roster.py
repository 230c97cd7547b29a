"""`TF_CONFIG`'s workers as a roster: `kfit-ps scale` on the chief's host of a multi-host job.

With `kfit-ps run --tasks chief:0` (no `--discover-workers`), the workers the job
may use are `TF_CONFIG`'s worker list, in its order: the roster. The job starts
on the first `--workers N` of them (all by default); `kfit-ps scale --workers N`
on the chief's host then asks for the first N. Each worker host runs its own
launcher (`kfit-ps run --tasks worker:I`), so this launcher starts and stops
nothing:

- to grow, it waits up to `JOIN_SECONDS` for the new roster entries to serve
  (`kfit_ps.net`) and refuses the request, naming those that do not, if any
  still does not;
- to shrink, nothing is waited for: the chief drains the removed ones, then
  they are told they may stop (`task_removed`), as workers found through DNS are.

`ListedWorkers` is a worker source for `launch.discovery.DiscoveredWorkers`,
which publishes the lists (one change at a time, kept workers at their index)
exactly as it does for DNS.
"""

from kfit_ps import net

JOIN_SECONDS = 30.0  # the longest a scale request waits for its new workers to serve
SERVE_SECONDS = 1.0  # the longest one look asks a server whether it serves


def _answers(name, address):
    return net.answers_grpc(address, SERVE_SECONDS)


class ListedWorkers:
    """The first `wanted` of `addresses` (`TF_CONFIG`'s workers); `request()` changes it.

    It has `launch.discovery.DnsWorkers`' interface (`poll`, `request`, `close`):

    ```python
    roster = ListedWorkers(["w0:2222", "w1:2222", "w2:2222"], wanted=1)
    roster.poll([])                     # ["w0:2222"]
    roster.request(2, ["w0:2222"])      # once w1:2222 serves: "scaling to 2 workers: ..."
    roster.poll(["w0:2222"])            # ["w0:2222", "w1:2222"]
    ```

    Args:
        addresses: the roster, `host:port` each, in `TF_CONFIG`'s order.
        wanted: how many of them the job starts on. Defaults to None: all.
        wait: `wait(addresses, seconds)`, those of `addresses` still not serving after
            `seconds`. Defaults to `kfit_ps.net.wait_for_servers` on gRPC handshakes.
        join_seconds: the longest a request waits for its new workers. Defaults to
            `JOIN_SECONDS`.
    """

    def __init__(self, addresses, wanted=None, wait=None, join_seconds=JOIN_SECONDS):
        self.addresses = [str(address) for address in addresses]
        if not self.addresses:
            raise ValueError("kfit-ps run --tasks chief:0: TF_CONFIG's cluster lists no worker. "
                             "Received: no \"worker\" entry. Add the workers' host:port to "
                             "TF_CONFIG's \"worker\" list on every host.")
        if wanted is None:
            wanted = len(self.addresses)
        if not 1 <= wanted <= len(self.addresses):
            raise ValueError(
                f"--workers: a job with --tasks chief:0 starts on the first N of TF_CONFIG's "
                f"{len(self.addresses)} workers, so N must be between 1 and "
                f"{len(self.addresses)}. Received: --workers {wanted}. Pass a smaller N, or add "
                "workers to TF_CONFIG's \"worker\" list on every host.")
        self.wanted = wanted
        self._wait = wait or self._wait_for_grpc
        self.join_seconds = join_seconds

    @staticmethod
    def _wait_for_grpc(addresses, seconds):
        return net.wait_for_servers([(a, a) for a in addresses], seconds, ready=_answers)

    def poll(self, current):
        """The workers wanted now: the first `wanted` of the roster (`current` is not needed:
        the roster's order is the job's)."""
        return self.addresses[:self.wanted]

    def request(self, workers, current):
        """Takes a scale request to `workers`, given `current` (the list published last).
        Returns what to say: the change, or why it is refused (then nothing changes)."""
        if workers > len(self.addresses):
            return (f"scale to {workers} workers refused: TF_CONFIG lists {len(self.addresses)} "
                    f"workers, and a job with --tasks scales within them. Ask for at most "
                    f"{len(self.addresses)}, or add workers to TF_CONFIG on every host and "
                    "restart the job (it resumes from its backup)")
        if workers == self.wanted:
            return f"scale: the job already has {workers} workers"
        new = [a for a in self.addresses[:workers] if a not in current]
        missing = self._wait(new, self.join_seconds) if new else []
        if missing:
            tasks = ", ".join(f"worker:{self.addresses.index(a)}" for a in missing)
            return (f"scale to {workers} workers refused, the job keeps {self.wanted}: "
                    f"{', '.join(missing)} did not serve within {self.join_seconds:g} s. Start "
                    f"kfit-ps run --tasks on its host ({tasks}), then ask again")
        before, self.wanted = self.wanted, workers
        if workers > before:
            return (f"scaling to {workers} workers: {', '.join(new)} "
                    f"{'serve' if len(new) > 1 else 'serves'}; the chief takes "
                    f"{'them' if len(new) > 1 else 'it'} at its next safe point")
        return (f"scaling to {workers} workers: the chief drains "
                f"{', '.join(self.addresses[workers:before])}, then they may stop")

    def __str__(self):
        return "TF_CONFIG's worker list"

    def close(self):
        """Nothing to release: the workers are their own hosts' launchers'."""
