"""`ChiefWatch`: a host of ps tasks notices, once per chief incarnation, that it went away."""

from kfit_ps.launch.chief_watch import ChiefWatch


def test_gone_once_per_incarnation_and_never_before_the_chief_was_seen():
    now, up = [0.0], [False]
    watch = ChiefWatch("chief:2222", interval=0.5, misses=2,
                       probe=lambda address, timeout: up[0], clock=lambda: now[0])

    def tick(seconds=0.5):
        now[0] += seconds
        return watch.gone()

    assert not any(tick() for _ in range(10))  # the chief has not started yet: not "gone"
    up[0] = True
    assert not tick()
    up[0] = False
    assert [tick(), tick()] == [False, True]  # two misses in a row
    assert not any(tick() for _ in range(10))  # said once, until it is seen again
    up[0] = True
    assert not tick()
    up[0] = False
    assert not tick() and not watch.gone()  # probes are at most one per interval
    assert tick()


def test_liveness_watch_names_a_server_silent_for_the_timeout_once_per_process():
    from kfit_ps.launch.liveness import LivenessWatch

    now, answering = [0.0], {"worker:0": True, "ps:0": True}
    watch = LivenessWatch(timeout=6.0, interval=2.0, clock=lambda: now[0],
                          probe=lambda address, timeout: answering[address])
    servers = {"worker:0": (100, "worker:0"), "ps:0": (200, "ps:0")}

    def tick():
        now[0] += 2.0
        return watch.wedged(servers)

    assert [tick() for _ in range(3)] == [[], [], []]
    answering["worker:0"] = False  # stopped: still accepts connections, answers nothing
    assert [tick() for _ in range(3)] == [[], [], ["worker:0"]]  # 6 s after its last answer
    assert tick() == []  # named once, then counted afresh
    servers["worker:0"] = (101, "worker:0")  # its restart (still silent): counted from its start
    assert [tick() for _ in range(4)] == [[], [], [], ["worker:0"]]
    assert LivenessWatch(timeout=0).wedged(servers) == []  # 0: off
