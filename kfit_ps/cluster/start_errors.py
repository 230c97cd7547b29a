"""Why a `LocalCluster` server did not start: errors its callers decide on."""


class ServerNotReady(TimeoutError):
    """A server process runs but did not start serving in time (it is left running).

    Attributes:
        task: `"worker:0"`-style name of the server; the first of them when several did
            not start serving (the message names each, with its log).
    """

    def __init__(self, message, task):
        super().__init__(message)
        self.task = task


class PortTaken(RuntimeError):
    """A server could not bind its port: another process took it after we picked it."""
