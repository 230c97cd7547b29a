"""The contract tables the docs print: written from the code's own tables, never by hand.

Each table sits in its doc between `<!-- table: NAME -->` and `<!-- end table -->`.
`python -m tests.doc_tables` rewrites them; `tests/test_doc_tables.py` fails while a doc
differs from what this writes, so the docs cannot drift from the code.

| name | source | doc |
| --- | --- | --- |
| `exit_status` | the table in `kfit_ps.exit_status`' docstring | `docs/fault_tolerance.md` |
| `restart_policy` | the table in `kfit_ps.launch.policy`' docstring | `docs/fault_tolerance.md` |
| `events` | `kfit_ps.observe.events.KINDS` | `docs/observability.md` |
| `metrics` | `kfit_ps.observe.metrics.TABLE` | `docs/observability.md` |
| `settings` | the table in `kfit_ps.constants`' docstring | `docs/configuration.md` |
| `pod_failure` | `kfit_ps.exit_status`' table under `pod_failure_rules` | `docs/kubernetes.md` |
| `jobset_failure` | `tests/jobset_policy.SCENARIOS` on the JobSet form | `docs/kubernetes.md` |
| `ledger_logs` | `kfit_ps.ledger.ledger.LOG_KEYS` | `docs/training_input.md` |
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _docstring_table(module):
    return "\n".join(line for line in module.__doc__.splitlines() if line.startswith("|"))


def _docstring_rows(module):
    """The cells of each row of `module`'s docstring table, below its header and rule."""
    lines = _docstring_table(module).splitlines()[2:]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def exit_status():
    from kfit_ps import exit_status as module

    return _docstring_table(module)


# Exit codes of a program error shown in `pod_failure` (an exception, argparse, a segfault).
_PROGRAM_ERRORS = (1, 2, 139)


def pod_failure():
    """What the chief Job's `podFailurePolicy` does with each exit status of the contract."""
    from kfit_ps import exit_status as module
    from tests.pod_failure_policy import DISRUPTED, first_matching_rule

    rules = module.pod_failure_rules("chief")

    def action(codes, conditions):
        [taken] = {first_matching_rule(rules, code, conditions) for code in codes}
        return "succeeded" if taken == "Succeeded" else f"`{taken}`"

    rows = ["| exit code | name | meaning | action | with `DisruptionTarget` |",
            "| --- | --- | --- | --- | --- |"]
    for status, name, _, meaning, *_ in _docstring_rows(module):
        codes = (int(status),) if status.isdigit() else _PROGRAM_ERRORS
        if not status.isdigit():
            status += f" ({', '.join(map(str, _PROGRAM_ERRORS))}, ...)"
        rows.append(f"| {status} | {name} | {meaning} | {action(codes, ())} | "
                    f"{action(codes, DISRUPTED)} |")
    return "\n".join(rows)


def jobset_failure():
    """What the JobSet form's Jobs and the JobSet do with each failure of `SCENARIOS`."""
    from kfit_ps.launch import jobset
    from kfit_ps.launch.manifests import ManifestConfig
    from tests.jobset_policy import SCENARIOS, outcome

    obj = jobset.jobset(ManifestConfig(name="ctr", image="img", command=("python", "t.py"),
                                       evaluator_command=("kfit-ps", "evaluator")))
    new_pod = {"Ignore": "`Ignore`: a new pod, not counted", "Count": "`Count`: a new pod",
               "Complete": "completes"}
    rows = ["| what happened | replicated job | exit code | its Job | the JobSet |",
            "| --- | --- | --- | --- | --- |"]
    for scenario in SCENARIOS:
        (decision, reason), taken = outcome(obj, scenario)
        code = f"{scenario.exit_code}" + (" with `DisruptionTarget`" if scenario.conditions
                                          else "")
        job = f"fails (`{reason}`)" if decision == "Failed" else new_pod[decision]
        if decision == "Count" and scenario.replicated_job == "evaluator":
            job = "`OnFailure`: restarted in place, counted"
        if taken is None:
            action = "nothing: its Jobs run on"
        elif taken == "Completed":
            action = "Completed: the Jobs still running deleted"
        elif taken[0] == "ReachedMaxRestarts":
            action = "fails (`ReachedMaxRestarts`)"
        else:
            action = f"`{taken[0]}` (rule `{taken[1]}`)"
        rows.append(f"| {scenario.case} | `{scenario.replicated_job}` | {code} | {job} | "
                    f"{action} |")
    return "\n".join(rows)


def ledger_logs():
    from kfit_ps.ledger.ledger import LOG_KEYS

    rows = ["| key | meaning |", "| --- | --- |"]
    rows += [f"| `{key}` | {meaning} |" for key, (_, meaning) in LOG_KEYS.items()]
    return "\n".join(rows)


def restart_policy():
    from kfit_ps.launch import policy

    return _docstring_table(policy)


def settings():
    from kfit_ps import constants

    return _docstring_table(constants)


def events():
    from kfit_ps.observe.events import KINDS

    rows = ["| event | meaning |", "| --- | --- |"]
    rows += [f"| `{kind}` | {meaning} |" for kind, meaning in KINDS.items()]
    return "\n".join(rows)


def metrics():
    from kfit_ps.observe.metrics import TABLE

    rows = ["| metric | type | served by | meaning |", "| --- | --- | --- | --- |"]
    for name, (kind, help_text, labels, served_by) in TABLE.items():
        kind = kind.__name__.lower()
        exposed = f"{name}_total" if kind == "counter" else name
        kind += "".join(f", `{label}`" for label in labels)
        rows.append(f"| `{exposed}` | {kind} | {served_by} | {help_text} |")
    return "\n".join(rows)


TABLES = {
    "exit_status": (exit_status, "docs/fault_tolerance.md"),
    "restart_policy": (restart_policy, "docs/fault_tolerance.md"),
    "events": (events, "docs/observability.md"),
    "metrics": (metrics, "docs/observability.md"),
    "settings": (settings, "docs/configuration.md"),
    "pod_failure": (pod_failure, "docs/kubernetes.md"),
    "jobset_failure": (jobset_failure, "docs/kubernetes.md"),
    "ledger_logs": (ledger_logs, "docs/training_input.md"),
}


def _block(name):
    return re.compile(rf"(<!-- table: {name} -->\n)(.*?)(<!-- end table -->)", re.S)


def rendered(name, text):
    """`text` (a doc) with table `name` written from its source; ValueError without markers."""
    make, doc = TABLES[name]
    block = _block(name)
    if not block.search(text):
        raise ValueError(f"{doc} has no `<!-- table: {name} -->` ... `<!-- end table -->` block")
    return block.sub(lambda m: m.group(1) + make() + "\n" + m.group(3), text, count=1)


def write():
    """Rewrites every table in its doc; returns the docs that changed."""
    changed = []
    for name, (_, doc) in TABLES.items():
        path = os.path.join(ROOT, doc)
        with open(path) as f:
            text = f.read()
        new = rendered(name, text)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            changed.append(doc)
    return sorted(set(changed))


if __name__ == "__main__":
    print("\n".join(write()) or "every table is current", file=sys.stderr)
