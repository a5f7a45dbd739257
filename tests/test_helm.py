"""The Helm chart deploy/helm/jaxllm and the multi-host manifests deploy/kubernetes/tpu-multihost,
against the real command line, deploy/kubernetes/base and each other.

Without any tool: Chart.yaml and every values file parse; every `.Values` path the templates read
exists in values.yaml merged with each values file, every key of values.yaml is read, and the
values files set no key the chart does not know; every `--flag` in the chart and the multi-host
manifests is a `jaxllm serve` flag (or the init container's gcloud flag); the chart's defaults
are deploy/kubernetes' (params.env, probes, security context, grace period); the LeaderWorkerSet's
group size is the hosts of its slice's topology, and leader and workers run one command that the
real parser accepts for every pod's index. With kubectl: the tpu-multihost kustomization renders,
and every value of its params.env lands in the LeaderWorkerSet. With helm (not packaged for pip
or Debian, so skipped here unless it is on PATH): `helm lint --strict` and `helm template` of
each target, multi-host included, pass the same checks as the kustomize manifests, options
render what they say, and settings that cannot work fail the render. All offline, in seconds.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from test_deploy import (
    FLAG,
    K8S,
    ROOT,
    check_deployment,
    check_gcloud_flags,
    check_probes_and_scrape,
    container_argv,
    dockerfile_instructions,
    k8s_params,
    kustomize,
    load_yaml_docs,
    one,
    read_env_file,
    serve_help_flags,
    tool,
)

yaml = pytest.importorskip("yaml")

CHART = ROOT / "deploy" / "helm" / "jaxllm"
MULTIHOST = K8S / "tpu-multihost"
# The values files as they are installed (helm install -f A -f B), by target.
INSTALLS = {
    "default": [],
    "tpu": ["values-tpu.yaml"],
    "gpu": ["values-gpu.yaml"],
    "cpu": ["values-cpu.yaml"],
    "tpu-multihost": ["values-tpu.yaml", "values-tpu-multihost.yaml"],
    "pd-prefill": ["values-gpu.yaml", "values-pd-prefill.yaml"],
    "pd-decode": ["values-gpu.yaml", "values-pd-decode.yaml"],
}
VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_]\w*)+)")
OTHER_TOOLS = re.compile(r"\b(gcloud|kubectl|helm|docker|openssl)\b")
LWS_API = "leaderworkerset.x-k8s.io/v1"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
TPU_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
LIBTPU_PORT = 8476  # LeaderWorkerSet's TPU_PROCESS_ADDRESSES: not for jax.distributed


# ---- helpers --------------------------------------------------------------------------------


def load(path: Path):
    return yaml.safe_load(path.read_text())


def merge(base: dict, override: dict) -> dict:
    """Helm's coalescing of values files: maps merge key by key, anything else is replaced,
    null deletes."""
    out = dict(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def chart_values(target: str) -> dict:
    values = load(CHART / "values.yaml")
    for name in INSTALLS[target]:
        values = merge(values, load(CHART / name))
    return values


def leaf_paths(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every path to a value that is not a non-empty map."""
    paths = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            paths += leaf_paths(value, (*prefix, key))
        else:
            paths.append((*prefix, key))
    return paths


def get_path(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def has_path(tree: dict, path: tuple[str, ...]) -> bool:
    try:
        get_path(tree, path)
    except (KeyError, TypeError):
        return False
    return True


def template_texts() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((CHART / "templates").iterdir())}


def values_read() -> set[tuple[str, ...]]:
    """The `.Values.a.b` paths the templates read."""
    return {
        tuple(m[1].split(".")[1:])
        for text in template_texts().values()
        for m in VALUES_REF.finditer(text)
    }


def topology_chips(topology: str) -> int:
    return math.prod(int(n) for n in topology.split("x"))


def lws_env(name: str, size: int, index: int) -> list[dict]:
    """What the LeaderWorkerSet webhook adds to every container of group 0's pod `index`."""
    return [
        {"name": "LWS_LEADER_ADDRESS", "value": f"{name}-0.{name}.default"},
        {"name": "LWS_GROUP_SIZE", "value": str(size)},
        {"name": "LWS_WORKER_INDEX", "value": str(index)},
    ]


def server_container(pod: dict) -> dict:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "jaxllm"]
    return container


def sleep_seconds(container: dict) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


def check_group(lws: dict, params: dict[str, str]) -> dict:
    """A LeaderWorkerSet that runs `jaxllm serve` multi-host (from kustomize, whose args take
    $(VAR)s from `params` through the ConfigMap, or from helm): the checks of
    test_deploy.check_deployment on the leader, the workers running the same command as
    followers, and the group spanning the slice. Returns the leader's container and argv."""
    assert lws["apiVersion"] == LWS_API and lws["kind"] == "LeaderWorkerSet"
    name = lws["metadata"]["name"]
    spec = lws["spec"]
    group = spec["leaderWorkerTemplate"]
    size = group["size"]
    assert isinstance(size, int) and size >= 2, size
    # The leader is ready only once the workers have joined: they must not wait for it.
    assert spec["startupPolicy"] == "LeaderCreated"
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    lead, follow = server_container(leader), server_container(worker)
    assert lead["args"] == follow["args"], "every host runs the same command"
    for key in ("image", "resources", "securityContext", "volumeMounts"):
        assert lead[key] == follow[key], key
    for key in ("nodeSelector", "tolerations", "securityContext", "serviceAccountName"):
        assert leader["spec"].get(key) == worker["spec"].get(key), key

    # The slice: its topology's chips are the group's hosts times each pod's chips.
    selector = leader["spec"].get("nodeSelector", {})
    if TPU_TOPOLOGY in selector:
        chips = int(lead["resources"]["limits"]["google.com/tpu"])
        assert lead["resources"]["requests"]["google.com/tpu"] == str(chips)
        assert topology_chips(selector[TPU_TOPOLOGY]) == size * chips, (selector, size)
        exclusive = lws["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"]
        assert exclusive == "cloud.google.com/gke-nodepool"
        total = size * chips
    else:
        total = None

    from jaxllm.cli import build_parser

    for template, indices in ((leader, [0]), (worker, [1, size - 1])):
        container = server_container(template)
        for index in indices:
            argv = container_argv(
                dict(container, env=[*container.get("env", []), *lws_env(name, size, index)]),
                params,
            )
            assert argv[0] == "serve"
            args = build_parser().parse_args(argv)
            assert {a for a in argv if a.startswith("--")} <= serve_help_flags()
            assert args.process_id == index and args.num_processes == size
            host, port = args.coordinator_address.rsplit(":", 1)
            assert host == f"{name}-0.{name}.default", "the coordinator runs on the leader"
            assert int(port) != LIBTPU_PORT and args.lockstep_address is None
            # The mesh spans the slice: unset (the engine's default in a multi-host run) or
            # every chip; a smaller mesh would leave hosts without devices in it.
            assert total is None or args.tensor_parallel_size in (None, total)
        if template is leader:
            leader_argv, leader_args = argv, args

    # The leader is check_deployment's server; it also listens for the other hosts.
    port = leader_args.port
    assert {"name": "http", "containerPort": port} in lead["ports"]
    coordinator = int(leader_args.coordinator_address.rsplit(":", 1)[1])
    assert {"name": "coordinator", "containerPort": coordinator} in lead["ports"]
    assert {"name": "lockstep", "containerPort": coordinator + 1} in lead["ports"]
    check_probes_and_scrape(lead, leader, port)
    pause, drain = sleep_seconds(lead), leader_args.shutdown_timeout
    assert leader["spec"]["terminationGracePeriodSeconds"] >= pause + drain + 20
    api_key = [e for e in lead["env"] if e["name"] == "JAXLLM_API_KEY"]
    assert api_key and api_key[0]["valueFrom"]["secretKeyRef"]["optional"] is True

    # Workers serve nothing: no probes, ports or scrape annotations. They stay up through the
    # leader's pause and drain and its engine core's stop, inside their grace period.
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports"} & follow.keys()
    assert "prometheus.io/scrape" not in worker["metadata"].get("annotations", {})
    assert pause + drain + 20 <= sleep_seconds(follow)
    assert sleep_seconds(follow) < worker["spec"]["terminationGracePeriodSeconds"]

    # Models and the compilation cache on each host's own volume (a claim template).
    (mount,) = lead["volumeMounts"]
    claims = [c["metadata"]["name"] for c in group.get("volumeClaimTemplates", [])]
    volumes = [v["name"] for v in leader["spec"].get("volumes", [])]
    assert mount["name"] in claims + volumes and not set(claims) & set(volumes)
    assert leader_args.compilation_cache_dir.startswith(mount["mountPath"] + "/")
    env = {e["name"]: e.get("value") for e in lead["env"]}
    assert env["JAXLLM_CACHE_DIR"].startswith(mount["mountPath"] + "/")
    for template in (leader, worker):
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        for init in template["spec"].get("initContainers", []):
            assert init["volumeMounts"] == lead["volumeMounts"]
    return lead | {"argv": leader_argv, "size": size, "nodeSelector": selector}


def check_leader_service(docs: list[dict], lws: dict) -> None:
    """The Service reaches the group leaders only, and is not LeaderWorkerSet's headless one."""
    service = one(docs, "Service")
    selector = service["spec"]["selector"]
    assert selector[WORKER_INDEX] == "0"
    labels = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    assert {k: v for k, v in selector.items() if k != WORKER_INDEX}.items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert service["metadata"]["name"] != lws["metadata"]["name"]


def multihost_params(root: Path = K8S) -> dict[str, str]:
    return read_env_file(root / "base" / "params.env") | read_env_file(
        root / "tpu-multihost" / "params.env"
    )


def check_multihost_kustomization(docs: list[dict], params: dict[str, str]) -> None:
    """The rendered tpu-multihost overlay, each params.env value in its place."""
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "LeaderWorkerSet", "Service", "ServiceAccount"], kinds
    configmap = one(docs, "ConfigMap")
    assert configmap["data"] == params
    lws = one(docs, "LeaderWorkerSet")
    leader = check_group(lws, params)
    check_leader_service(docs, lws)
    group = lws["spec"]["leaderWorkerTemplate"]
    assert leader["size"] * int(params["GKE_TPU_CHIPS"]) == topology_chips(
        params["GKE_TPU_TOPOLOGY"]
    )
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        spec = template["spec"]
        container = server_container(template)
        assert container["image"] == params["JAXLLM_TPU_IMAGE"]
        (init,) = spec["initContainers"]
        assert init["image"] == params["MODEL_SYNC_IMAGE"]
        assert spec["nodeSelector"] == {
            TPU_ACCELERATOR: params["GKE_TPU_ACCELERATOR"],
            TPU_TOPOLOGY: params["GKE_TPU_TOPOLOGY"],
        }
        resources = container["resources"]
        for kind in ("requests", "limits"):
            assert resources[kind]["google.com/tpu"] == params["GKE_TPU_CHIPS"]
        assert resources["requests"]["cpu"] == params["CPU_REQUEST"]
        assert resources["requests"]["memory"] == params["MEMORY_REQUEST"]
        assert resources["limits"]["memory"] == params["MEMORY_LIMIT"]
        # kustomize renamed every reference to the generated ConfigMap (kustomizeconfig.yaml).
        for c in [*spec["containers"], *spec["initContainers"]]:
            for entry in c.get("env", []):
                ref = entry.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["name"] == configmap["metadata"]["name"], ref
    (claim,) = group["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == params["STORAGE_CLASS"]
    assert claim["spec"]["resources"]["requests"]["storage"] == params["STORAGE_SIZE"]
    argv = leader["argv"]
    assert argv[1] == params["JAXLLM_MODEL"]
    tp = argv[argv.index("--tensor-parallel-size") + 1]
    assert (
        int(tp)
        == topology_chips(params["GKE_TPU_TOPOLOGY"])
        == int(params["JAXLLM_TENSOR_PARALLEL_SIZE"])
    )
    # A worker's preStop covers the drain that params.env sets.
    worker = server_container(group["workerTemplate"])
    assert sleep_seconds(worker) >= 5 + int(params["JAXLLM_SHUTDOWN_TIMEOUT"]) + 20


# ---- the chart's files, without helm -----------------------------------------------------------


def test_chart_files_parse():
    chart = load(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2" and chart["name"] == CHART.name == "jaxllm"
    assert chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    for path in [CHART / "values.yaml", *CHART.glob("values-*.yaml")]:
        assert isinstance(load(path), dict), path
    assert {f"values-{t}.yaml" for t in ("tpu", "gpu", "cpu")} <= {
        p.name for p in CHART.glob("values-*.yaml")
    }
    assert {"_helpers.tpl", "NOTES.txt"} <= template_texts().keys()
    installed = {name for names in INSTALLS.values() for name in names}
    assert installed == {p.name for p in CHART.glob("values-*.yaml")}, "a values file untested"


@pytest.mark.parametrize("target", INSTALLS)
def test_templates_read_values_that_exist(target):
    values = chart_values(target)
    missing = [".".join(p) for p in values_read() if not has_path(values, p)]
    assert not missing, f"the templates read values that {target} lacks: {missing}"


def test_values_are_all_read_and_known():
    """Each key of values.yaml is read by some template (a read of a map covers its keys), and
    a values file sets only keys of values.yaml, or keys inside maps the chart passes on whole
    (resources, nodeSelector, ...)."""
    read = values_read()
    defaults = load(CHART / "values.yaml")
    unread = [".".join(p) for p in leaf_paths(defaults) if not any(p[: len(r)] == r for r in read)]
    assert not unread, f"values.yaml keys no template reads: {unread}"
    for path in CHART.glob("values-*.yaml"):
        for p in leaf_paths(load(path)):
            passed_on = any(
                p[:i] in read and isinstance(get_path(defaults, p[:i]), dict | list)
                for i in range(1, len(p))
                if has_path(defaults, p[:i])
            )
            assert has_path(defaults, p) or passed_on, f"{path.name}: unknown key {'.'.join(p)}"


def proxy_module():
    """scripts/pd_proxy.py, imported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pd_proxy", ROOT / "scripts" / "pd_proxy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def deploy_files() -> list[Path]:
    chart = [p for p in CHART.rglob("*") if p.is_file()]
    return sorted(chart + [p for p in MULTIHOST.iterdir() if p.is_file()])


def test_flags_are_real():
    """Every --flag in the chart and the multi-host manifests is `jaxllm serve`'s, except on
    lines that run another tool: the init container's gcloud (checked against gcloud's help
    where gcloud is installed), the kubectl, helm and docker commands of comments and
    NOTES.txt, and the routing sidecar's (scripts/pd_proxy.py's own)."""
    serve_flags, gcloud_lines = set(), set()
    proxy_flags = {f for a in proxy_module().build_parser()._actions for f in a.option_strings}
    for path in deploy_files():
        for line in path.read_text().splitlines():
            flags = set(FLAG.findall(line))
            if not flags:
                continue
            if "gcloud storage rsync" in line:
                gcloud_lines.add(line.strip())
            elif not OTHER_TOOLS.search(line):
                unknown = flags - serve_help_flags() - proxy_flags
                assert not unknown, f"{path.relative_to(ROOT)}: `jaxllm serve` has no {unknown}"
                serve_flags |= flags
    assert {"--coordinator-address", "--num-processes", "--process-id"} <= serve_flags
    assert {"--compilation-cache-dir", "--shutdown-timeout"} <= serve_flags
    assert gcloud_lines
    if tool("gcloud") is not None:
        for line in gcloud_lines:
            argv = shlex.split(line)
            check_gcloud_flags([a for a in argv if not a.startswith("$")])


def test_chart_defaults_match_kustomize():
    """The chart deploys what deploy/kubernetes does, with the same defaults."""
    params = k8s_params()
    base = load_yaml_docs((K8S / "base" / "deployment.yaml").read_text())[0]
    pod = base["spec"]["template"]["spec"]
    container = server_container(base["spec"]["template"])
    values = chart_values("default")
    assert values["model"]["path"] == params["JAXLLM_MODEL"]
    assert values["model"]["servedModelName"] == params["JAXLLM_SERVED_MODEL_NAME"]
    assert values["model"]["syncImage"] == params["MODEL_SYNC_IMAGE"]
    assert values["engine"]["maxNumSeqs"] == int(params["JAXLLM_MAX_NUM_SEQS"])
    assert values["engine"]["maxNumBatchedTokens"] == int(params["JAXLLM_MAX_NUM_BATCHED_TOKENS"])
    assert values["engine"]["tensorParallelSize"] in (
        None,
        int(params["JAXLLM_TENSOR_PARALLEL_SIZE"]),
    )
    assert values["server"]["maxQueuedRequests"] == int(params["JAXLLM_MAX_QUEUED_REQUESTS"])
    assert values["server"]["shutdownTimeout"] == int(params["JAXLLM_SHUTDOWN_TIMEOUT"])
    assert values["server"]["preStopSleepSeconds"] == sleep_seconds(container)
    # The chart's grace period (pause + drain + 35) is the base's.
    grace = values["server"]["preStopSleepSeconds"] + values["server"]["shutdownTimeout"] + 35
    assert grace == pod["terminationGracePeriodSeconds"]
    assert values["persistence"]["storageClass"] == params["STORAGE_CLASS"]
    assert values["persistence"]["size"] == params["STORAGE_SIZE"]
    assert values["resources"] == {
        "requests": {"cpu": params["CPU_REQUEST"], "memory": params["MEMORY_REQUEST"]},
        "limits": {"memory": params["MEMORY_LIMIT"]},
    }
    assert values["podSecurityContext"] == pod["securityContext"]
    assert values["securityContext"] == container["securityContext"]
    assert values["apiKey"] == {"secretName": "jaxllm-api-key", "secretKey": "api-key"}
    for probe in ("startup", "readiness", "liveness"):
        expected = {k: v for k, v in container[f"{probe}Probe"].items() if k != "httpGet"}
        assert values["probes"][probe] == expected, probe

    def image(target: str) -> str:
        v = chart_values(target)["image"]
        return f"{v['repository']}:{v['tag']}"

    tpu, gpu = chart_values("tpu"), chart_values("gpu")
    assert image("tpu") == params["JAXLLM_TPU_IMAGE"]
    assert tpu["nodeSelector"] == {
        TPU_ACCELERATOR: params["GKE_TPU_ACCELERATOR"],
        TPU_TOPOLOGY: params["GKE_TPU_TOPOLOGY"],
    }
    for kind in ("requests", "limits"):
        assert tpu["resources"][kind]["google.com/tpu"] == params["GKE_TPU_CHIPS"]
        assert gpu["resources"][kind]["nvidia.com/gpu"] == params["GKE_GPU_COUNT"]
    assert image("gpu") == params["JAXLLM_GPU_IMAGE"]
    assert gpu["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": params["GKE_GPU_ACCELERATOR"]
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu[
        "tolerations"
    ]
    cpu = chart_values("cpu")
    assert not cpu["nodeSelector"] and "tpu" not in str(cpu["resources"])

    # The multi-host values are the tpu-multihost overlay's.
    mh, mh_params = chart_values("tpu-multihost"), multihost_params()
    assert mh["multiHost"]["enabled"] is True
    lws = load_yaml_docs((MULTIHOST / "leaderworkerset.yaml").read_text())[0]
    assert mh["multiHost"]["hosts"] == lws["spec"]["leaderWorkerTemplate"]["size"]
    assert mh["nodeSelector"] == {
        TPU_ACCELERATOR: mh_params["GKE_TPU_ACCELERATOR"],
        TPU_TOPOLOGY: mh_params["GKE_TPU_TOPOLOGY"],
    }
    chips = mh["resources"]["limits"]["google.com/tpu"]
    assert chips == mh["resources"]["requests"]["google.com/tpu"] == mh_params["GKE_TPU_CHIPS"]
    assert topology_chips(mh_params["GKE_TPU_TOPOLOGY"]) == mh["multiHost"]["hosts"] * int(chips)
    assert mh["model"]["path"] == mh_params["JAXLLM_MODEL"]
    assert mh["model"]["gcsUri"] == mh_params["MODEL_GCS_URI"]
    assert mh["persistence"]["size"] == mh_params["STORAGE_SIZE"]


# ---- the LeaderWorkerSet manifest ----------------------------------------------------------------


def test_multihost_manifest_as_written():
    """leaderworkerset.yaml before kustomize: its placeholders are params.env's values, so the
    group is checked with the ConfigMap's keys read from the merged params."""
    docs = load_yaml_docs((MULTIHOST / "leaderworkerset.yaml").read_text())
    params = multihost_params()
    leader = check_group(one(docs, "LeaderWorkerSet"), params)
    assert leader["size"] * int(params["GKE_TPU_CHIPS"]) == topology_chips(
        params["GKE_TPU_TOPOLOGY"]
    )
    kustomization = load(MULTIHOST / "kustomization.yaml")
    for patch in kustomization["patches"]:
        assert load_yaml_docs(patch["patch"])
    # Every key of the overlay's params.env is one the base knows (a typo would add a new one).
    assert read_env_file(MULTIHOST / "params.env").keys() <= k8s_params().keys()


@pytest.mark.skipif(tool("kubectl") is None, reason="kubectl (with kustomize) is not installed")
def test_multihost_kustomization_renders():
    check_multihost_kustomization(kustomize("tpu-multihost"), multihost_params())


@pytest.mark.skipif(tool("kubectl") is None, reason="kubectl (with kustomize) is not installed")
def test_multihost_params_land(tmp_path):
    """Every value of the overlay's (and the base's) params.env reaches the LeaderWorkerSet:
    rendered from a copy whose params all differ from the manifests' placeholders."""
    root = tmp_path / "kubernetes"
    shutil.copytree(K8S, root)
    changes = {
        "base": {
            "JAXLLM_TPU_IMAGE": "registry.example/jaxllm:tpu-test",
            "MODEL_SYNC_IMAGE": "registry.example/cloud-cli:test",
            "STORAGE_CLASS": "premium-rwo",
            "JAXLLM_MAX_NUM_SEQS": "32",
        },
        "tpu-multihost": {
            "GKE_TPU_ACCELERATOR": "tpu-v5p-slice",
            "GKE_TPU_TOPOLOGY": "2x2x4",  # 16 chips on the manifest's 4 hosts of 4
            "CPU_REQUEST": "17",
            "MEMORY_REQUEST": "191Gi",
            "MEMORY_LIMIT": "383Gi",
            "STORAGE_SIZE": "301Gi",
            "JAXLLM_MODEL": "/data/models/other",
        },
    }
    for part, values in changes.items():
        path = root / part / "params.env"
        lines = path.read_text().splitlines()
        for key, value in values.items():
            (i,) = [i for i, line in enumerate(lines) if line.startswith(key + "=")]
            lines[i] = f"{key}={value}"
        path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [tool("kubectl"), "kustomize", str(root / "tpu-multihost")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    params = multihost_params(root)
    assert all(params[k] == v for values in changes.values() for k, v in values.items())
    check_multihost_kustomization(load_yaml_docs(proc.stdout), params)


# ---- helm ----------------------------------------------------------------------------------------

needs_helm = pytest.mark.skipif(
    tool("helm") is None,
    reason="helm is neither on PATH nor in .venv/bin (`make test` puts it there with npm)",
)


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [tool("helm"), *args], capture_output=True, text=True, timeout=60, cwd=CHART
    )


def helm_template(target: str = "default", *sets: str) -> list[dict]:
    files = [a for name in INSTALLS[target] for a in ("-f", name)]
    proc = helm("template", "jaxllm", ".", *files, *(a for s in sets for a in ("--set", s)))
    assert proc.returncode == 0, proc.stderr
    return load_yaml_docs(proc.stdout)


@needs_helm
@pytest.mark.parametrize("target", INSTALLS)
def test_helm_lint_and_template(target):
    files = [a for name in INSTALLS[target] for a in ("-f", name)]
    lint = helm("lint", "--strict", ".", *files)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = helm_template(target)
    values = chart_values(target)
    if values["multiHost"]["enabled"]:
        assert not [d for d in docs if d["kind"] in ("Deployment", "PersistentVolumeClaim")]
        lws = one(docs, "LeaderWorkerSet")
        leader = check_group(lws, {})
        check_leader_service(docs, lws)
        assert leader["size"] == values["multiHost"]["hosts"]
        (claim,) = lws["spec"]["leaderWorkerTemplate"]["volumeClaimTemplates"]
        assert claim["spec"]["resources"]["requests"]["storage"] == values["persistence"]["size"]
        (init,) = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["initContainers"]
        assert {"name": "MODEL_GCS_URI", "value": values["model"]["gcsUri"]} in init["env"]
    else:
        assert not [d for d in docs if d["kind"] == "LeaderWorkerSet"]
        leader = check_deployment(docs, {})
        assert one(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    image = values["image"]
    assert leader["image"] == f"{image['repository']}:{image['tag']}"
    assert leader["nodeSelector"] == values["nodeSelector"]
    assert leader["resources"] == values["resources"]
    argv = leader["argv"]
    assert argv[1] == values["model"]["path"]
    assert argv[argv.index("--served-model-name") + 1] == values["model"]["servedModelName"]
    assert argv[argv.index("--max-num-seqs") + 1] == str(values["engine"]["maxNumSeqs"])
    one(docs, "ServiceAccount")
    assert ("google.com/tpu" in str(leader["resources"])) == target.startswith("tpu")
    assert ("nvidia.com/gpu" in str(leader["resources"])) == ("values-gpu.yaml" in INSTALLS[target])


@needs_helm
def test_helm_options():
    """Options render what values.yaml says they do."""
    docs = helm_template(
        "default",
        "engine.maxModelLen=8192",
        "engine.extraArgs={--num-pages,4000}",
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.labels.release=prom",
        "model.gcsUri=gs://bucket/models/m",
        "model.path=/data/models/m",
    )
    container = check_deployment(docs, {})
    argv = container["argv"]
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    assert argv[-2:] == ["--num-pages", "4000"]
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (
        endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    )
    (init,) = one(docs, "Deployment")["spec"]["template"]["spec"]["initContainers"]
    assert {"name": "JAXLLM_MODEL", "value": "/data/models/m"} in init["env"]

    docs = helm_template(
        "default", "persistence.enabled=false", "apiKey.secretName=", "metrics.podAnnotations=false"
    )
    pod = one(docs, "Deployment")["spec"]["template"]
    assert pod["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert "JAXLLM_API_KEY" not in str(server_container(pod)["env"])
    assert "initContainers" not in pod["spec"] and "annotations" not in pod["metadata"]

    from jaxllm.cli import build_parser

    docs = helm_template(
        "gpu", "engine.tensorParallelSize=2", "resources.limits.nvidia\\.com/gpu=2"
    )
    argv = server_container(one(docs, "Deployment")["spec"]["template"])["args"]
    assert build_parser().parse_args(argv).tensor_parallel_size == 2

    docs = helm_template("default", "persistence.existingClaim=models")
    pod = one(docs, "Deployment")["spec"]["template"]
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "models"}
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]

    # Multi-host without a volume: an emptyDir per pod, no claim template.
    docs = helm_template("tpu-multihost", "persistence.enabled=false")
    group = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    assert "volumeClaimTemplates" not in group
    check_group(one(docs, "LeaderWorkerSet"), {})


@needs_helm
@pytest.mark.parametrize(
    "target, sets, message",
    [
        ("tpu-multihost", ["multiHost.hosts=2"], "is not the 16 chips of topology 4x4"),
        ("tpu", ["multiHost.enabled=true"], "is not the 1 chips of topology 1x1"),
        ("tpu-multihost", ["multiHost.hosts=1"], "multiHost.hosts must be 2 or more"),
        ("tpu-multihost", ["persistence.existingClaim=x"], "persistence.existingClaim"),
        ("default", ["model.gcsUri=gs://b/m"], "must be under /data"),
        ("default", ["disaggregation.role=prefiller"], "must be prefill, decode or both"),
        ("pd-prefill", ["disaggregation.sidecar.enabled=true"], "sidecar runs on decode pods"),
        ("pd-decode", ["disaggregation.sidecar.serverPort=8000"], "must differ from server.port"),
        ("tpu-multihost", ["disaggregation.role=decode"], "not served across hosts"),
        ("tpu-multihost", ["engine.dataParallelSize=2"], "not with multiHost"),
    ],
)
def test_helm_rejects_settings_that_cannot_work(target, sets, message):
    files = [a for name in INSTALLS[target] for a in ("-f", name)]
    proc = helm("template", "jaxllm", ".", *files, *(a for s in sets for a in ("--set", s)))
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def _serve_config(argv: list[str]):
    """The engine config a container's `jaxllm serve` argv makes (its JSON flags checked)."""
    from jaxllm.cli import build_parser
    from jaxllm.config import EngineConfig

    return EngineConfig.from_cli(build_parser().parse_args(argv))


@needs_helm
def test_helm_disaggregation_and_llm_d():
    """A prefill and a decode release (values-pd-*.yaml): vLLM's --kv-transfer-config and
    --kv-events-config as the engine parses them, the address decoders pull from (the pod's),
    llm-d's labels, and on the decode pods the routing sidecar in front of the server."""
    from jaxllm.config.kv_events import KVEventsConfig
    from jaxllm.config.kv_transfer import KVTransferConfig

    for target, role, kv_role in (("pd-prefill", "prefill", "kv_producer"),
                                  ("pd-decode", "decode", "kv_consumer")):  # fmt: skip
        docs = helm_template(target)
        container = check_deployment(docs, {})
        pod = one(docs, "Deployment")["spec"]["template"]
        config = _serve_config(container["argv"])
        transfer = KVTransferConfig.parse(config.cache.kv_transfer_config)
        assert (transfer.kv_role, transfer.kv_ip, transfer.kv_port) == (kv_role, "0.0.0.0", 5600)
        events = KVEventsConfig.parse(config.cache.kv_events_config)
        assert events.enabled and events.topic == "kv@10.8.0.7@smollm2-135m"
        assert config.cache.prefix_caching_hash_algo == "sha256_cbor"
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
        assert list(env).index("POD_IP") < list(env).index("VLLM_NIXL_SIDE_CHANNEL_HOST")
        assert env["PYTHONHASHSEED"]["value"] == "42"
        labels = pod["metadata"]["labels"]
        assert labels["llm-d.ai/role"] == role and labels["llm-d.ai/inferenceServing"] == "true"
        assert labels["llm-d.ai/model"] == "smollm2-135m"
        serves_blocks = {"name": "kv-transfer", "containerPort": 5600} in container["ports"]
        assert serves_blocks == (role == "prefill")
        sidecars = [c for c in pod["spec"]["containers"] if c["name"] == "routing-sidecar"]
        assert bool(sidecars) == (role == "decode")

    # The decode pod: the sidecar on the pod's port, the server behind it.
    (sidecar,) = sidecars
    args = proxy_module().build_parser().parse_args(sidecar["args"])
    argv = container["argv"]
    assert args.decode == [f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"]
    assert args.prefill == ["http://prefill-jaxllm:8000"] and args.port == 8000
    assert sidecar["image"] == container["image"]
    # The script is where the image puts it.
    (workdir, *_), copies = (
        [a for k, a in dockerfile_instructions() if k == "WORKDIR"],
        [a.split() for k, a in dockerfile_instructions() if k == "COPY"],
    )
    assert sidecar["command"][1] in {f"{workdir}/{dest.removeprefix('./')}" for *_, dest in copies}

    # Data parallelism, and llm-d's labels on a release without disaggregation.
    docs = helm_template("gpu", "engine.dataParallelSize=2", "llmd.enabled=true",
                         "model.servedModelName=meta-llama/Llama-3.1-8B-Instruct")  # fmt: skip
    container = check_deployment(docs, {})
    assert _serve_config(container["argv"]).parallel.data_parallel_size == 2
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels["llm-d.ai/role"] == "both"
    assert labels["llm-d.ai/model"] == "meta-llama-Llama-3.1-8B-Instruct"  # a label value
    assert "--kv-transfer-config" not in container["argv"]
