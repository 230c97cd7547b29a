"""The launcher's decisions (policy) and configuration, without processes."""

import io

import pytest

from kfit_ps import exit_status
from kfit_ps.launch import Action, Decision, LaunchConfig, RestartPolicy, Supervisor, TaskExit
from kfit_ps.launch.chief_watch import ChiefWatch
from kfit_ps.launch.liveness import LivenessWatch


def decide(policy, task, status, server_lost=False):
    return policy.decide(TaskExit(task, status, "last line"), server_lost=server_lost)


@pytest.mark.parametrize("task, status, server_lost, action", [
    ("chief:0", 0, False, Action.FINISH),
    ("chief:0", 1, False, Action.FAIL),                 # the program failed: not retried
    ("chief:0", 2, False, Action.FAIL),
    ("chief:0", -9, False, Action.RESTART_JOB),         # chief lost (SIGKILL)
    ("chief:0", exit_status.CLUSTER_ERROR, False, Action.RESTART_JOB),  # a ClusterError
    ("chief:0", 1, True, Action.RESTART_JOB),           # it failed because a server was lost
    ("chief:0", exit_status.PREEMPTED, False, Action.RESTART_JOB),  # stopped on SIGTERM
    ("chief:0", exit_status.KILLED, False, Action.RESTART_JOB),
    ("chief:0", exit_status.RESTARTS_EXHAUSTED, False, Action.FAIL),
    ("chief:0", 139, False, Action.FAIL),
    ("worker:1", -9, False, Action.RESTART_TASK),
    ("worker:0", 0, False, Action.RESTART_TASK),
    ("ps:0", -9, False, Action.WAIT_FOR_CHIEF),
])
def test_decisions(task, status, server_lost, action):
    decision = decide(RestartPolicy(), task, status, server_lost)
    assert decision.action is action, decision
    if action is Action.FAIL:
        assert decision.exit_status == status and "not retried" in decision.reason


def test_a_lost_ps_with_the_chief_running_restores_in_place_and_counts_against_its_budget():
    policy = RestartPolicy(max_restarts=1)
    first = policy.decide(TaskExit("ps:1", -9, "last line"), ps_in_place=True)
    assert first.action is Action.RESTART_TASK and first.delay == 1.0
    assert "restores its variables in place" in first.reason
    assert policy.decide(TaskExit("ps:1", -9, ""), ps_in_place=True).action is Action.FAIL
    # The chief then failing with a cluster error (it could not restore): the job restarts.
    assert decide(policy, "chief:0", exit_status.CLUSTER_ERROR).action is Action.RESTART_JOB
    assert LaunchConfig(command=("x",)).ps_recovery == "in-place"
    with pytest.raises(ValueError, match="--ps-recovery.*Received: ps_recovery='later'"):
        LaunchConfig(command=("x",), ps_recovery="later")


def test_the_decisions_beside_a_task_exit_are_the_policys_and_cost_no_budget():
    policy = RestartPolicy(ps_failure_grace=60.0)
    assert policy.chief_overdue(59.9) is None
    overdue = policy.chief_overdue(60.1)
    assert overdue.action is Action.STOP_CHIEF and "within 60 s of the ps loss" in overdue.reason
    gone = policy.chief_gone("host:2222")
    assert gone.action is Action.RESTART_TASK and gone.delay == 0
    assert "the chief (host:2222) went away" in gone.reason
    wedged = policy.wedged("ps:1", 30)
    assert wedged.action is Action.KILL_TASK
    assert wedged.reason == ("ps:1 accepts connections but has not answered for 30 s "
                             "(--liveness-timeout): killing it")
    assert not policy.restarts and not policy.failures  # None of them counted.


def test_restarts_back_off_and_are_limited_per_task():
    policy = RestartPolicy(max_restarts=3, backoff=1.0, max_backoff=3.0)
    delays = [decide(policy, "worker:0", -9).delay for _ in range(3)]
    assert delays == [1.0, 2.0, 3.0]  # doubling, capped
    assert decide(policy, "worker:1", -9).delay == 1.0  # counted per task
    final = decide(policy, "worker:0", -9)
    assert final.action is Action.FAIL and final.exit_status == exit_status.RESTARTS_EXHAUSTED
    assert "worker:0 ended with signal SIGKILL" in final.reason
    assert "failed 4 times" in final.reason and "--max-restarts 3" in final.reason
    assert "last line" in final.reason  # the task's last log lines
    ps = RestartPolicy(max_restarts=3, backoff=1.0, max_backoff=3.0)
    # On a host without the chief the ps restarts alone: with the same back-off.
    remote = [ps.decide(TaskExit("ps:0", -9, ""), chief_elsewhere=True) for _ in range(3)]
    assert [d.delay for d in remote] == [1.0, 2.0, 3.0]
    assert {d.action for d in remote} == {Action.RESTART_TASK}
    assert ("a chief connected to it (on its own host) restores its variables in place"
            in remote[0].reason)
    assert "else the job restarts from that backup" in remote[0].reason
    spent = ps.decide(TaskExit("ps:0", -9, ""), chief_elsewhere=True)
    assert spent.action is Action.FAIL and spent.exit_status == exit_status.RESTARTS_EXHAUSTED
    policy = RestartPolicy(max_restarts=1)
    assert decide(policy, "ps:0", -9).action is Action.WAIT_FOR_CHIEF
    assert decide(policy, "ps:0", -9).action is Action.FAIL
    assert decide(policy, "chief:0", -15).action is Action.RESTART_JOB
    assert decide(policy, "chief:0", -15).action is Action.FAIL


class _Servers:
    """A host's servers as the supervisor sees them, recording what it does to them."""

    def __init__(self):
        self.done = []
        self.config = self

    def server_tasks(self):
        return [("worker", 0), ("ps", 0), ("ps", 1)]

    def pid(self, task_type, index):
        return 100 + 10 * (task_type == "ps") + index

    def address(self, task_type, index):
        return f"localhost:{2000 + self.pid(task_type, index)}"

    def exited(self):
        return {}

    def kill(self, task_type, index):
        self.done.append(("kill", f"{task_type}:{index}"))

    def restart(self, task_type, index):
        self.done.append(("restart", f"{task_type}:{index}"))


class _View:
    def __init__(self):
        self.due = {}

    def restart_is_due(self, task, reason):
        self.due[task] = reason

    def started_task(self, task, pid):
        pass

    def write_tasks(self, tasks, restarts):
        pass


def supervised(tmp_path, policy):
    """A supervisor of a host of servers (no processes), its chief gone and worker:0
    wedged: what it does on those findings is up to `policy`."""
    supervisor = Supervisor(LaunchConfig(tasks=[("worker", 0), ("ps", 0), ("ps", 1)],
                                         run_dir=str(tmp_path)), policy=policy, out=io.StringIO())
    supervisor.cluster, supervisor.view = _Servers(), _View()
    answers = iter([True, False, False])  # up, then two probes missed: gone
    supervisor._chief_watch = ChiefWatch("chief:2222", interval=0, clock=lambda: 1.0,
                                         probe=lambda address, timeout: next(answers))
    now = [0.0]
    supervisor._liveness = LivenessWatch(5.0, interval=0, clock=lambda: now[0],
                                         probe=lambda address, timeout: "2100" not in address)
    for _ in range(3):
        supervisor._restart_ps_when_the_chief_went_away()
    supervisor._kill_wedged_servers()  # worker:0 silent from now...
    now[0] = 10.0
    supervisor._kill_wedged_servers()  # ...for 10 s: wedged
    return supervisor


def test_the_supervisor_carries_out_the_policys_decisions_beside_a_task_exit(tmp_path):
    supervisor = supervised(tmp_path, RestartPolicy())
    # The chief went away: each ps restarted at once, its exit not decided on (RESTART_TASK);
    # worker:0 wedged: killed only, its exit decided on later (KILL_TASK).
    assert supervisor.cluster.done == [("kill", "ps:0"), ("restart", "ps:0"),
                                       ("kill", "ps:1"), ("restart", "ps:1"),
                                       ("kill", "worker:0")]
    assert supervisor._seen == {("ps:0", 110), ("ps:1", 111)}
    assert supervisor.view.due == {"ps:0": "chief_gone", "ps:1": "chief_gone",
                                   "worker:0": "wedged"}
    said = supervisor.out.getvalue()
    assert "the chief (chief:2222) went away" in said and "worker:0 accepts connections" in said

    class Swapped(RestartPolicy):  # Another policy's decisions, carried out as they say.
        @staticmethod
        def chief_gone(address):
            return Decision(Action.KILL_TASK, reason=f"{address} went away: killing the ps")

        @staticmethod
        def wedged(task, timeout):
            return Decision(Action.RESTART_TASK, reason=f"{task} is wedged: restarting it")

    supervisor = supervised(tmp_path, Swapped())
    assert supervisor.cluster.done == [("kill", "ps:0"), ("kill", "ps:1"),
                                       ("kill", "worker:0"), ("restart", "worker:0")]
    assert supervisor._seen == {("worker:0", 100)}
    assert "chief:2222 went away: killing the ps" in supervisor.out.getvalue()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(command=()), "the chief needs a command"),
    (dict(command=("python", "x.py"), num_workers=0), "`num_workers` must be a positive"),
    (dict(command=("python", "x.py"), max_restarts=-1), "max_restarts=-1"),
    (dict(command=("python", "x.py"), save_freq=0), "save_freq=0"),
    (dict(command=("python", "x.py"), tasks=(("ps", 0),)), "has no 'chief:0'"),
    (dict(command=("python", "x.py"), backoff=-1), "backoff=-1"),
])
def test_config_errors_name_the_argument(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        LaunchConfig(**kwargs)
    assert fragment in str(e.value)


def test_config_repr_shows_what_differs_from_defaults():
    config = LaunchConfig(command=["python", "train.py"], num_ps=2, save_freq=100)
    assert repr(config) == ("LaunchConfig(command=('python', 'train.py'), num_ps=2, "
                            "save_freq=100)")
    assert LaunchConfig(tasks=[("ps", 0)]).runs_chief is False


def test_a_task_that_ran_healthy_long_enough_gets_a_fresh_budget():
    now = [0.0]
    policy = RestartPolicy(max_restarts=2, healthy_period=100.0, clock=lambda: now[0])
    for t in (0.0, 10.0):
        now[0] = t
        assert decide(policy, "ps:0", -9).action is Action.WAIT_FOR_CHIEF
    # 100 s after the last failure, the budget is full again: two more restarts, then FAIL.
    for t in (110.0, 120.0):
        now[0] = t
        assert decide(policy, "ps:0", -9).action is Action.WAIT_FOR_CHIEF
    now[0] = 130.0
    spent = decide(policy, "ps:0", -9)
    assert spent.action is Action.FAIL and spent.exit_status == exit_status.RESTARTS_EXHAUSTED
    assert policy.failures["ps:0"] == 5  # tasks.json counts every failure
    early = RestartPolicy(max_restarts=2, healthy_period=100.0, clock=lambda: 0.0)
    assert [decide(early, "ps:0", -9).action for _ in range(3)][-1] is Action.FAIL


def test_exit_status_table():
    assert exit_status.RETRY == (75, 130, 137, 143)
    assert exit_status.from_returncode(-15) == exit_status.PREEMPTED
    assert exit_status.is_retry(-9) and exit_status.is_retry(75) and not exit_status.is_retry(1)
    assert exit_status.is_program_error(1) and exit_status.is_program_error(139)
    assert not exit_status.is_program_error(exit_status.RESTARTS_EXHAUSTED)
    assert exit_status.describe(75) == "exit code 75 (cluster error)"
    assert exit_status.describe(2) == "exit code 2 (program error)"
