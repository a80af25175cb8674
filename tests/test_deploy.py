"""The deploy/ examples (Slurm, Kubernetes) kept true to the code: real `megascale executor` flags and
config keys, YAML that parses, addresses that agree, and Kubernetes resources that pass the API's schemas
(offline: no cluster here). The sbatch script itself runs under a real Slurm in tests/test_slurm.py."""

import argparse
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from megascale.config import all_keys, load_config
from megascale.resilience.executor import add_arguments

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SBATCH = DEPLOY / "slurm" / "megascale.sbatch"
KUBERNETES = DEPLOY / "kubernetes"
OVERRIDE = re.compile(r"--([a-z_]+(?:\.[a-z_]+)+)")


def executor_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {flag for action in parser._actions for flag in action.option_strings}


def flags_in(tokens: list[str]) -> list[str]:
    return [token.split("=", 1)[0] for token in tokens if token.startswith("--")]


def sbatch_executor_command() -> list[str]:
    """The tokens of `megascale executor ...` inside the script's `bash -c '...'`."""
    command = re.search(r"megascale executor (.*?)'", SBATCH.read_text(), re.DOTALL)
    assert command, "no `megascale executor` command in the sbatch script"
    return command.group(1).replace("\\\n", " ").split()


def documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]


def one(name: str, kind: str) -> dict:
    (found,) = [doc for doc in documents(name) if doc["kind"] == kind]
    return found


def container(workload: dict) -> dict:
    (found,) = workload["spec"]["template"]["spec"]["containers"]
    return found


def options(args: list[str]) -> dict[str, str]:
    """`--key=value` and `--key value` arguments as {key: value}."""
    found, i = {}, 0
    while i < len(args):
        if args[i].startswith("--"):
            key, sep, value = args[i].partition("=")
            if not sep and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            found[key] = value
        i += 1
    return found


def test_the_sbatch_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_sbatch_script_passes_shellcheck():
    result = subprocess.run(["shellcheck", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout


def test_every_executor_flag_in_the_examples_is_a_real_one():
    known = executor_flags()
    executors = one("executors.yaml", "StatefulSet")
    used = {
        "sbatch": flags_in(sbatch_executor_command()),
        "executors.yaml": flags_in(container(executors)["args"]),
    }
    for where, flags in used.items():
        assert "--store" in flags and "--job" in flags and "--run-dir" in flags, where
        assert set(flags) <= known, f"{where}: not flags of `megascale executor`: {set(flags) - known}"


def test_every_config_override_in_the_examples_is_a_real_key():
    keys = set(all_keys())
    texts = [SBATCH.read_text(), (DEPLOY / "README.md").read_text()]
    texts += [path.read_text() for path in KUBERNETES.glob("*.yaml")]
    used = {key for text in texts for key in OVERRIDE.findall(text)}
    assert "resilience.executors" in used and "training.run_dir" in used
    assert used <= keys, f"not config keys: {used - keys}"


def test_the_sbatch_driver_and_executors_share_store_job_and_run_dir():
    driver = SBATCH.read_text().split("megascale launch", 1)[1]
    executor = options(sbatch_executor_command())
    assert '--resilience.store="tcp://$HEAD:$STORE_PORT"' in driver
    assert executor["--store"] == '"tcp://$HEAD:$STORE_PORT"'
    assert '--resilience.job_id="$SLURM_JOB_ID"' in driver and executor["--job"] == '"$SLURM_JOB_ID"'
    assert '--training.run_dir="$RUN_DIR"' in driver and executor["--run-dir"] == '"$RUN_DIR"'
    assert (
        '--resilience.heartbeat_interval_s="$INTERVAL"' in driver and executor["--interval"] == '"$INTERVAL"'
    )
    assert "--resilience.executors=external" in driver


def test_the_kubernetes_files_parse_and_have_the_expected_kinds():
    kinds = {path.name: [doc["kind"] for doc in documents(path.name)] for path in KUBERNETES.glob("*.yaml")}
    assert kinds == {
        "shared.yaml": ["ConfigMap", "PersistentVolumeClaim"],
        "driver.yaml": ["Service", "Job"],
        "executors.yaml": ["Service", "StatefulSet"],
        "kustomization.yaml": ["Kustomization"],
    }
    assert sorted(one("kustomization.yaml", "Kustomization")["resources"]) == sorted(
        name for name in kinds if name != "kustomization.yaml"
    )


def test_the_configmap_holds_a_valid_job_config(tmp_path):
    config = one("shared.yaml", "ConfigMap")["data"]
    assert config["JOB_ID"]
    tomllib.loads(config["job.toml"])  # a clear message if the TOML itself is broken
    (tmp_path / "job.toml").write_text(config["job.toml"])
    load_config(tmp_path / "job.toml")  # every key real, every value in range


def test_executors_reach_the_driver_service_and_agree_with_the_driver():
    service, job = one("driver.yaml", "Service"), one("driver.yaml", "Job")
    statefulset = one("executors.yaml", "StatefulSet")
    driver, executor = container(job), container(statefulset)
    launch, serve = options(driver["args"]), options(executor["args"])
    (port,) = service["spec"]["ports"]
    # The executors' store is the Service; the Service leads to the driver's pod and the store's port.
    assert serve["--store"] == f"tcp://{service['metadata']['name']}:{port['port']}"
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert launch["--resilience.store"] == f"tcp://$(POD_IP):{port['targetPort']}"
    assert port["targetPort"] in [p["containerPort"] for p in driver["ports"]]
    # The same job id, run directory, heartbeat interval and config path on both sides.
    assert launch["--resilience.executors"] == "external"
    assert launch["--resilience.job_id"] == serve["--job"] == "$(JOB_ID)"
    for side in (driver, executor):
        (job_id,) = [env for env in side["env"] if env["name"] == "JOB_ID"]
        assert job_id["valueFrom"]["configMapKeyRef"] == {"name": "megascale-job", "key": "JOB_ID"}
    assert launch["--training.run_dir"] == serve["--run-dir"]
    assert float(launch["--resilience.heartbeat_interval_s"]) == float(serve["--interval"])
    config_dir = Path(launch["--config"]).parent.as_posix()
    for side in (driver, executor):
        assert config_dir in [mount["mountPath"] for mount in side["volumeMounts"]]
        assert "/shared" in [mount["mountPath"] for mount in side["volumeMounts"]]
    assert launch["--training.run_dir"].startswith("/shared/")
    claim = one("shared.yaml", "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for workload in (job, statefulset):
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        claims = [v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v]
        assert claims == [claim["metadata"]["name"]]
    # One pod per node and spare, one GPU per training process.
    nodes, spares = int(launch["--resilience.nodes"]), int(launch["--resilience.spares"])
    assert statefulset["spec"]["replicas"] == nodes + spares
    gpus = executor["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == int(launch["--resilience.nproc_per_node"])


def kustomized() -> list[dict]:
    """What `kubectl apply -k deploy/kubernetes` applies: the documents of the kustomization's resources (it
    lists resources only, nothing that would change them)."""
    kustomization = one("kustomization.yaml", "Kustomization")
    assert set(kustomization) == {"apiVersion", "kind", "resources"}, "a transformer: render with kubectl"
    return [doc for name in kustomization["resources"] for doc in documents(name)]


def test_the_kubernetes_manifests_pass_the_kubernetes_api_schemas():
    """Offline, without a cluster: every resource against the API's OpenAPI schemas (kubernetes-validate,
    strict: an unknown or misplaced field fails too), in the oldest and newest Kubernetes it carries.
    `kubectl apply --dry-run=client` cannot do this here: it downloads the schemas from a server."""
    validator = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    from kubernetes_validate.utils import all_versions

    versions = sorted(all_versions(), key=lambda v: tuple(int(part) for part in v.split(".")))
    for version in (versions[0], versions[-1]):
        for doc in kustomized():
            validator.validate(doc, version, strict=True)  # raises ValidationError, naming the field
    # The check has teeth: a misspelt field and a wrong type are caught.
    statefulset = one("executors.yaml", "StatefulSet")
    for broken in (
        {**statefulset, "spec": {**statefulset["spec"], "replica": 3}},
        {**statefulset, "spec": {**statefulset["spec"], "replicas": "three"}},
    ):
        with pytest.raises(validator.ValidationError):
            validator.validate(broken, versions[-1], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_renders_the_kustomization_as_its_resources():
    result = subprocess.run(
        ["kubectl", "kustomize", str(KUBERNETES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert sorted(rendered, key=kind_and_name) == sorted(kustomized(), key=kind_and_name)


def kind_and_name(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]
