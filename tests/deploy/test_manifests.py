"""The Kubernetes manifests: every kustomization under deploy/ renders with
``kubectl kustomize``, every object validates offline against a pinned Kubernetes
version, and the objects have the properties deploy/README.md promises."""

from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped, unused-ignore]
import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]

from service.settings import DEFAULT_PORT
from tests.deploy.common import PORT, ROOT, UID, unknown

DEPLOY = ROOT / "deploy"
# The oldest Kubernetes the manifests support (podReplacementPolicy is on by default from
# 1.29, the batch.kubernetes.io/job-name pod label exists from 1.27).
KUBERNETES_VERSION = "1.30.0"

CONTROL_PLANE = ("overlays/production", "overlays/dev")
SINGLE_NODE = ("training/base", "training/aws", "training/gke")
MULTINODE = "training/multinode"
TRAINING = (*SINGLE_NODE, MULTINODE)
KUSTOMIZATIONS = sorted(
    str(path.parent.relative_to(DEPLOY)) for path in DEPLOY.rglob("kustomization.yaml")
)

Doc = dict[str, Any]


def test_the_kustomizations_are_the_ones_this_file_checks() -> None:
    assert set(KUSTOMIZATIONS) == {"base", *CONTROL_PLANE, *TRAINING}
    assert PORT == DEFAULT_PORT


@functools.cache
def _render(directory: str) -> tuple[Doc, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CKPT_REQUIRE_KUBECTL"):
            pytest.fail("kubectl is not installed and CKPT_REQUIRE_KUBECTL is set")
        pytest.skip("kubectl is not installed (apt-get install kubernetes-client)")
    done = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize deploy/{directory}:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(directory: str) -> list[Doc]:
    """The objects ``kubectl kustomize deploy/<directory>`` renders (a fresh copy)."""
    return copy.deepcopy(list(_render(directory)))


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def containers(spec: Doc) -> Iterator[Doc]:
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def env_value(container: Doc, name: str) -> Doc:
    entries: list[Doc] = [e for e in container.get("env", []) if e["name"] == name]
    (entry,) = entries
    return entry


def config_map_data(docs: list[Doc], container: Doc) -> dict[str, str]:
    """The ConfigMap keys a container takes through envFrom."""
    data: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            data |= one(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {})
    return data


def ckpt_workloads(docs: list[Doc]) -> list[Doc]:
    """The Deployments and Jobs that run ckpt's own images (not dev's Postgres or MinIO)."""
    return [
        d
        for d in docs
        if d["kind"] in ("Deployment", "Job")
        and d["metadata"]["labels"]["app.kubernetes.io/name"] == "ckpt"
    ]


# --- every object is valid Kubernetes ------------------------------------------------------


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_object_validates_against_the_pinned_kubernetes(directory: str) -> None:
    docs = render(directory)
    assert docs
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(part) for part in err.path)
            pytest.fail(f"deploy/{directory}: {name}: {path}: {err.message}")


def test_the_example_secret_validates_and_names_only_real_settings() -> None:
    (secret,) = yaml.safe_load_all((DEPLOY / "overlays/production/secret.example.yaml").read_text())
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    assert set(secret["stringData"]) == {"CKPT_DATABASE_URL", "CKPT_ADMIN_TOKEN"}
    assert secret["metadata"]["name"] == "ckpt-control-plane"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_ckpt_variable_is_one_the_code_reads(directory: str) -> None:
    docs = render(directory)
    names: set[str] = set()
    for doc in docs:
        if doc["kind"] in ("ConfigMap", "Secret"):
            names |= set(doc.get("data", {})) | set(doc.get("stringData", {}))
    for workload in ckpt_workloads(docs):
        for container in containers(pod_spec(workload)):
            names |= {entry["name"] for entry in container.get("env", [])}
    assert not unknown(names), f"deploy/{directory} sets variables no code reads: {unknown(names)}"


# --- the control plane ---------------------------------------------------------------------


def test_production_runs_several_replicas_on_postgres_with_an_existing_secret() -> None:
    docs = render("overlays/production")
    deployment = one(docs, "Deployment", "ckpt-control-plane")
    assert deployment["spec"]["replicas"] >= 2
    assert not [d for d in docs if d["kind"] == "Secret"], "production must not render a Secret"
    for container in containers(pod_spec(deployment)):
        refs = [s["secretRef"] for s in container["envFrom"] if "secretRef" in s]
        assert refs == [{"name": "ckpt-control-plane", "optional": False}]
        config = config_map_data(docs, container)
        assert config["CKPT_STORE"].startswith("s3://")
        assert "CKPT_DATABASE_URL" not in config, "the database URL holds a password"
    example = yaml.safe_load((DEPLOY / "overlays/production/secret.example.yaml").read_text())
    assert example["stringData"]["CKPT_DATABASE_URL"].startswith("postgresql+psycopg://")


def test_dev_runs_one_replica_without_a_disruption_budget() -> None:
    docs = render("overlays/dev")
    assert one(docs, "Deployment", "ckpt-control-plane")["spec"]["replicas"] == 1
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    secret = one(docs, "Secret", _generated(docs, "Secret", "ckpt-control-plane"))
    assert "CKPT_DATABASE_URL" in secret["data"]
    config = config_map_data(
        docs, pod_spec(one(docs, "Deployment", "ckpt-control-plane"))["containers"][0]
    )
    assert config["CKPT_S3_ENDPOINT"] == "http://minio:9000"


def _generated(docs: list[Doc], kind: str, prefix: str) -> str:
    """The name kustomize gave a generated object (``prefix-<hash>``)."""
    names: list[str] = [
        d["metadata"]["name"]
        for d in docs
        if d["kind"] == kind and d["metadata"]["name"].rsplit("-", 1)[0] == prefix
    ]
    (name,) = names
    return name


@pytest.mark.parametrize("directory", CONTROL_PLANE)
def test_the_control_plane_serves_on_8470_with_probes_and_a_drain(directory: str) -> None:
    docs = render(directory)
    deployment = one(docs, "Deployment", "ckpt-control-plane")
    spec = pod_spec(deployment)
    (server,) = spec["containers"]
    assert server["command"] == ["ckpt", "server"]
    assert {"containerPort": PORT, "name": "http", "protocol": "TCP"} in server["ports"]
    assert server["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": PORT}
    assert server["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": PORT}
    config = config_map_data(docs, server)
    assert config["CKPT_HOST"] == "0.0.0.0"
    assert config["CKPT_PORT"] == str(PORT)
    assert config["CKPT_AUTO_MIGRATE"] in ("0", "false"), "the migrations Job migrates"
    # preStop keeps the pod serving while endpoints drain; the grace period covers it.
    pre_stop = server["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > int(pre_stop[1])
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    service = one(docs, "Service", "ckpt-control-plane")
    assert service["spec"]["ports"] == [
        {"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}
    ]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


@pytest.mark.parametrize("directory", CONTROL_PLANE)
def test_one_worker_runs_the_periodic_tasks_and_the_servers_none(directory: str) -> None:
    docs = render(directory)
    worker = one(docs, "Deployment", "ckpt-worker")
    assert worker["spec"]["replicas"] == 1
    (process,) = pod_spec(worker)["containers"]
    assert process["command"] == ["ckpt", "worker"]
    assert "ports" not in process  # it serves nothing
    (server,) = pod_spec(one(docs, "Deployment", "ckpt-control-plane"))["containers"]
    assert config_map_data(docs, server)["CKPT_MAINTENANCE"] == "worker"
    # the same catalog, store and settings
    assert _env_sources(process) == _env_sources(server)
    service = one(docs, "Service", "ckpt-control-plane")
    pod_labels = worker["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= pod_labels.items()  # gets no traffic


def _env_sources(container: Doc) -> list[tuple[str, str]]:
    return [(kind, ref["name"]) for source in container["envFrom"] for kind, ref in source.items()]


def test_production_keeps_a_replica_through_disruptions() -> None:
    docs = render("overlays/production")
    budget = one(docs, "PodDisruptionBudget", "ckpt-control-plane")
    assert budget["spec"]["minAvailable"] == 1
    pod_labels = one(docs, "Deployment", "ckpt-control-plane")["spec"]["template"]["metadata"][
        "labels"
    ]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


@pytest.mark.parametrize("directory", CONTROL_PLANE)
def test_migrations_run_before_pods_serve(directory: str) -> None:
    docs = render(directory)
    job = one(docs, "Job", "ckpt-migrate")
    spec = pod_spec(job)
    assert spec["restartPolicy"] == "Never"
    (migrate,) = spec["containers"]
    assert migrate["command"] == ["ckpt", "migrate"]
    deployment = one(docs, "Deployment", "ckpt-control-plane")
    (init,) = pod_spec(deployment)["initContainers"]
    assert init["command"] == ["ckpt", "migrate"]
    assert init["image"] == migrate["image"] == pod_spec(deployment)["containers"][0]["image"]
    assert init["envFrom"] == migrate["envFrom"] == pod_spec(deployment)["containers"][0]["envFrom"]
    # deploy/README.md: apply what is not component=control-plane first (it holds the Job
    # and everything the Job needs), wait for the Job, then apply the rest.
    first = [
        d
        for d in docs
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") != "control-plane"
    ]
    assert job in first and deployment not in first
    needed = {("ServiceAccount", spec["serviceAccountName"])} | {
        ("ConfigMap", s["configMapRef"]["name"]) for s in migrate["envFrom"] if "configMapRef" in s
    }
    assert needed <= {(d["kind"], d["metadata"]["name"]) for d in first}


@pytest.mark.parametrize("directory", [*CONTROL_PLANE, *TRAINING])
def test_ckpt_pods_are_locked_down(directory: str) -> None:
    docs = render(directory)
    workloads = ckpt_workloads(docs)
    assert workloads
    for workload in workloads:
        spec = pod_spec(workload)
        where = f"deploy/{directory}: {workload['kind']}/{workload['metadata']['name']}"
        assert spec["automountServiceAccountToken"] is False, where
        account = one(docs, "ServiceAccount", spec["serviceAccountName"])
        assert account["automountServiceAccountToken"] is False, where
        assert spec["enableServiceLinks"] is False, f"{where}: a Service named ckpt sets CKPT_PORT"
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == UID, where
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in containers(spec):
            context = container["securityContext"]
            name = f"{where} container {container['name']}"
            assert context["runAsNonRoot"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"] == {"drop": ["ALL"]}, name
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), name
            assert "memory" in resources["limits"], name
            (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert "emptyDir" in volumes[tmp["name"]], f"{name}: /tmp must be writable"


@pytest.mark.parametrize("directory", CONTROL_PLANE)
def test_images_are_pinned(directory: str) -> None:
    for workload in ckpt_workloads(render(directory)):
        for container in containers(pod_spec(workload)):
            name, _, tag = container["image"].rpartition(":")
            assert name and tag and tag != "latest", container["image"]


# --- the training Job ----------------------------------------------------------------------


@pytest.mark.parametrize("directory", TRAINING)
def test_preemptions_do_not_count_against_the_backoff_limit(directory: str) -> None:
    job = one(render(directory), "Job")
    spec = job["spec"]
    assert spec["backoffLimit"] >= 1
    assert pod_spec(job)["restartPolicy"] == "Never", "podFailurePolicy requires Never"
    assert {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    } in spec["podFailurePolicy"]["rules"]
    assert spec["podReplacementPolicy"] == "Failed"


@pytest.mark.parametrize(
    ("directory", "grace"),
    [("training/base", 120), ("training/aws", 120), ("training/gke", 15), (MULTINODE, 120)],
)
def test_the_save_budget_fits_the_grace_period(directory: str, grace: int) -> None:
    job = one(render(directory), "Job")
    spec = pod_spec(job)
    (trainer,) = spec["containers"]
    budget = float(env_value(trainer, "CKPT_GRACE_SECONDS")["value"])
    assert spec["terminationGracePeriodSeconds"] == grace
    assert 0 < budget < grace, "the agent must be done before SIGKILL"


@pytest.mark.parametrize("directory", TRAINING)
def test_the_trainer_is_wired_through_the_downward_api(directory: str) -> None:
    docs = render(directory)
    job = one(docs, "Job")
    (trainer,) = pod_spec(job)["containers"]
    fields = {
        "CKPT_RUN": "metadata.labels['batch.kubernetes.io/job-name']",
        "CKPT_POD": "metadata.name",
        "CKPT_POD_UID": "metadata.uid",
        "CKPT_NODE": "spec.nodeName",
    }
    for name, path in fields.items():
        assert env_value(trainer, name)["valueFrom"] == {"fieldRef": {"fieldPath": path}}
    token = env_value(trainer, "CKPT_TOKEN")["valueFrom"]["secretKeyRef"]
    assert token == {"name": "ckpt-run-token", "key": "token"}
    config = config_map_data(docs, trainer)
    assert config["CKPT_STORE"].startswith("s3://")
    # The control plane's Service, in the namespace the production overlay deploys it to.
    production = render("overlays/production")
    service = one(production, "Service", "ckpt-control-plane")
    namespace = service["metadata"]["namespace"]
    assert (
        config["CKPT_SERVER"] == f"http://ckpt-control-plane.{namespace}.svc.cluster.local:{PORT}"
    )
    # The Job's name is a valid run name (it becomes CKPT_RUN).
    from ckpt.core.storage.keys import check_run_name

    check_run_name(job["metadata"]["name"])


@pytest.mark.parametrize("directory", SINGLE_NODE)
def test_the_trainer_command_is_one_the_demo_accepts(directory: str) -> None:
    from agent.demo.train import parse_args

    docs = render(directory)
    (trainer,) = pod_spec(one(docs, "Job"))["containers"]
    assert trainer["command"] == ["python", "-m", "agent.demo.train"]
    expanded = {
        "$(CKPT_RUN)": "a-job",
        "$(CKPT_STORE)": config_map_data(docs, trainer)["CKPT_STORE"],
    }
    args = parse_args([expanded.get(arg, arg) for arg in trainer["args"]])
    assert (args.run, args.store) == ("a-job", expanded["$(CKPT_STORE)"])
    # Kubernetes expands $(VAR) only for variables the container defines.
    defined = {e["name"] for e in trainer["env"]} | set(config_map_data(docs, trainer))
    references = {arg[2:-1] for arg in trainer["args"] if arg.startswith("$(")}
    assert references <= defined, shlex.join(trainer["args"])


@pytest.mark.parametrize(
    ("directory", "selector"),
    [
        ("training/aws", {"karpenter.sh/capacity-type": "spot"}),
        ("training/gke", {"cloud.google.com/gke-spot": "true"}),
    ],
)
def test_the_cloud_overlays_land_on_spot_nodes(directory: str, selector: dict[str, str]) -> None:
    spec = pod_spec(one(render(directory), "Job"))
    assert spec["nodeSelector"] == selector
    ((key, value),) = selector.items()
    assert {"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"} in spec[
        "tolerations"
    ]


# --- the multi-node training Job -----------------------------------------------------------

# The label the Job controller sets on every pod of a Job (Kubernetes 1.27+).
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


def torchrun_args(docs: list[Doc], trainer: Doc, *, index: str) -> tuple[Any, list[str]]:
    """``ckpt launch``'s command in pod ``index``, with $(VAR) expanded, as torchrun parses
    it; and the words ckpt launch runs."""
    from torch.distributed.run import get_args_parser

    from agent.launch.supervisor import parse_args
    from agent.launch.torchrun import is_torchrun

    job = one(docs, "Job")
    values = {
        "CKPT_RUN": job["metadata"]["name"],  # from the job-name label (the wiring test)
        "JOB_COMPLETION_INDEX": index,
        **config_map_data(docs, trainer),
    }
    # Kubernetes expands $(VAR) only for variables the container defines.
    defined = {e["name"] for e in trainer["env"]} | set(config_map_data(docs, trainer))
    words = []
    for word in [*trainer["command"][1:], *trainer["args"]]:
        references = set(re.findall(r"\$\((\w+)\)", word))
        assert references <= defined, word
        words.append(re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], word))
    assert trainer["command"][0] == "ckpt"
    assert words[0] == "launch"
    policy = parse_args(words[1:])
    assert is_torchrun(policy.command) and policy.command[0] == "torchrun"
    return get_args_parser().parse_args(policy.command[1:]), policy.command


def test_the_multinode_job_runs_one_pod_per_node_of_one_torchrun_group() -> None:
    docs = render(MULTINODE)
    job = one(docs, "Job")
    (trainer,) = pod_spec(job)["containers"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] >= 2
    index = env_value(trainer, "JOB_COMPLETION_INDEX")["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    for node in range(spec["completions"]):
        torchrun, _ = torchrun_args(docs, trainer, index=str(node))
        assert torchrun.nnodes == str(spec["completions"])
        assert torchrun.node_rank == node
        assert torchrun.rdzv_backend == "static"
    # ckpt launch runs once (the Job replaces pods); it reads torchrun's exit for the
    # policy below: 143 when the ranks were preempted.
    assert one(docs, "Job")["spec"]["backoffLimit"] >= spec["completions"]


def test_the_headless_service_gives_the_jobs_pods_their_names() -> None:
    docs = render(MULTINODE)
    job = one(docs, "Job")
    service = one(docs, "Service")
    name = job["metadata"]["name"]
    # Pod i of an Indexed Job is host <job>-i; in the subdomain of a headless Service that
    # selects it, it resolves as <job>-i.<service>.
    assert pod_spec(job)["subdomain"] == service["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True  # resolvable before ready
    # The selector matches the Job's pods (and no other Job's): the controller's label.
    pod_labels = {**job["spec"]["template"]["metadata"]["labels"], JOB_NAME_LABEL: name}
    assert service["spec"]["selector"] == {JOB_NAME_LABEL: name}
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_every_node_meets_at_pod_0() -> None:
    docs = render(MULTINODE)
    job = one(docs, "Job")
    (trainer,) = pod_spec(job)["containers"]
    service = one(docs, "Service")
    torchrun, _ = torchrun_args(docs, trainer, index="1")
    assert torchrun.master_addr == f"{job['metadata']['name']}-0.{pod_spec(job)['subdomain']}"
    (port,) = service["spec"]["ports"]
    assert torchrun.master_port == port["port"] == port["targetPort"]
    assert {"name": "rendezvous", "containerPort": port["port"], "protocol": "TCP"} in trainer[
        "ports"
    ]


def test_the_multinode_ranks_have_their_save_budget_before_torchrun_kills_them() -> None:
    """torchrun passes SIGTERM on to the ranks and SIGKILLs them --shutdown-timeout later
    (30 s by default): that must outlast the agent's budget and fit the grace period."""
    docs = render(MULTINODE)
    job = one(docs, "Job")
    (trainer,) = pod_spec(job)["containers"]
    torchrun, _ = torchrun_args(docs, trainer, index="0")
    budget = float(env_value(trainer, "CKPT_GRACE_SECONDS")["value"])
    assert budget < torchrun.shutdown_timeout < pod_spec(job)["terminationGracePeriodSeconds"]


def test_the_other_nodes_stopped_with_a_preempted_one_are_not_held_against_the_job() -> None:
    job = one(render(MULTINODE), "Job")
    assert {
        "action": "Ignore",
        "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [143]},
    } in job["spec"]["podFailurePolicy"]["rules"]


def test_the_multinode_command_is_one_the_demo_accepts() -> None:
    from agent.demo.ranks import parse_args

    docs = render(MULTINODE)
    (trainer,) = pod_spec(one(docs, "Job"))["containers"]
    torchrun, _ = torchrun_args(docs, trainer, index="0")
    assert torchrun.module and torchrun.training_script == "agent.demo.ranks"
    args = parse_args(torchrun.training_script_args)
    assert args.store == config_map_data(docs, trainer)["CKPT_STORE"]
    # No --run: torchrun would take it for its own --run-path; the run is CKPT_RUN.
    assert not [a for a in torchrun.training_script_args if a.startswith("--run")]
