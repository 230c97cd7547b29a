"""Kubernetes' first-match rule for a Job's `podFailurePolicy`, as documented: the manifests'
tests and the table in `docs/kubernetes.md` (`tests/doc_tables.py`) apply it to the chief
Job's rules, and `tests/jobset_policy.py` to every Job of the JobSet form."""


def first_matching_rule(rules, exit_code, conditions=(), container="chief"):
    """The action Kubernetes' Job controller takes for a failed pod (the chief's by default).

    As documented for `podFailurePolicy`: the rules are tried in order and the first
    that matches decides; `onExitCodes` looks at the named container's exit code (a
    code of 0 never matches); `onPodConditions` at the pod's conditions. A failed pod
    that no rule matches is counted against `backoffLimit` ("Count").
    """
    if exit_code == 0:
        return "Succeeded"  # Not a failure: the policy is not consulted.
    for rule in rules:
        on_codes = rule.get("onExitCodes")
        if on_codes is not None:
            assert on_codes["containerName"] == container
            values = on_codes["values"]
            assert values == sorted(set(values))  # the API's rule for `values`
            assert 0 not in values or on_codes["operator"] == "NotIn"  # likewise
            inside = exit_code in values
            if inside == (on_codes["operator"] == "In"):
                return rule["action"]
        for condition in rule.get("onPodConditions", []):
            if (condition["type"], condition["status"]) in conditions:
                return rule["action"]
    return "Count"


# The condition Kubernetes sets on a pod it disrupts (a drain, a preemption, an eviction).
DISRUPTED = {("DisruptionTarget", "True")}
