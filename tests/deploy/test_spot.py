"""Every training pod that any kustomization under deploy/ renders lands on spot nodes only,
tolerates their taints, and gives the agent its save budget before SIGKILL: the
single-node Job, its cloud overlays and the multi-node Job alike."""

from __future__ import annotations

import pytest

from tests.deploy.test_manifests import (
    KUSTOMIZATIONS,
    TRAINING,
    Doc,
    env_value,
    pod_spec,
    render,
)

# The node label of spot capacity, and its value, on the common clouds; each cloud's spot
# nodes may carry a NoSchedule taint of the same key and value.
SPOT = {
    "cloud.google.com/gke-spot": "true",  # GKE Spot VMs
    "eks.amazonaws.com/capacityType": "SPOT",  # EKS managed node groups
    "karpenter.sh/capacity-type": "spot",  # Karpenter
    "kubernetes.azure.com/scalesetpriority": "spot",  # AKS spot node pools
}
GKE, EKS, _, AKS = SPOT


def training_jobs(docs: list[Doc]) -> list[Doc]:
    return [
        d
        for d in docs
        if d["kind"] == "Job"
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer"
    ]


def spot_terms(spec: Doc) -> dict[str, str]:
    """The spot label and value of each alternative of the pod's required node affinity;
    fails on an alternative that admits a node without a spot label."""
    required = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    found: dict[str, str] = {}
    for term in required["nodeSelectorTerms"]:
        spot = [
            e
            for e in term["matchExpressions"]
            if e["key"] in SPOT and e["operator"] == "In" and e["values"] == [SPOT[e["key"]]]
        ]
        assert spot, f"a node affinity term without a spot label: {term}"
        found |= {e["key"]: e["values"][0] for e in spot}
    return found


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_training_pod_is_fitted_to_spot_nodes(directory: str) -> None:
    jobs = training_jobs(render(directory))
    assert bool(jobs) == (directory in TRAINING), [j["metadata"]["name"] for j in jobs]
    for job in jobs:
        spec = pod_spec(job)
        terms = spot_terms(spec)
        assert {GKE, EKS, AKS} <= terms.keys(), "spot nodes of GKE, EKS and AKS"
        # A nodeSelector may narrow the choice to one cloud's spot nodes, never widen it.
        selector = spec.get("nodeSelector", {})
        assert selector.items() <= terms.items(), selector
        for key in terms.keys() | selector.keys():
            taint = {"key": key, "operator": "Equal", "value": SPOT[key], "effect": "NoSchedule"}
            assert taint in spec["tolerations"], f"{directory}: no toleration of {key}"
        # SIGTERM to SIGKILL: the agent's save budget, and a little more.
        (trainer,) = spec["containers"]
        budget = float(env_value(trainer, "CKPT_GRACE_SECONDS")["value"])
        grace = spec["terminationGracePeriodSeconds"]
        assert 0.75 * grace <= budget < grace, (directory, budget, grace)
