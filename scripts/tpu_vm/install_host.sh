#!/usr/bin/env bash
# Install jaxllm as a systemd service on this machine: a Cloud TPU VM (run for you by
# create_tpu_vm.sh) or a GPU host (run it yourself). Needs root; idempotent, so it also upgrades.
#
#   sudo bash scripts/tpu_vm/install_host.sh --source . --jax-extra tpu    --model smollm2-135m
#   sudo bash scripts/tpu_vm/install_host.sh --source . --jax-extra cuda13 --model /models/llama
#   bash scripts/tpu_vm/install_host.sh --dry-run ...     prints what it would do, changes nothing
#
# What it does:
#   1. finds Python >= 3.11 (installs python3.11 with apt-get when there is none)
#   2. creates the system user `jaxllm` (the service runs as it)
#   3. copies the project to /opt/jaxllm/src and installs it with JAX's build for the platform,
#      jax[EXTRA]==VERSION, into the virtual environment /opt/jaxllm/venv
#   4. installs /opt/jaxllm/bin/jaxllm-sync (GCS mirror of the model and compilation cache)
#   5. writes /etc/jaxllm/jaxllm.env (first run: from scripts/tpu_vm/jaxllm.env; later runs
#      change only the values given as flags) and generates an API key on the first run
#   6. installs /etc/systemd/system/jaxllm.service, enables it and (re)starts it
set -euo pipefail

PREFIX=/opt/jaxllm
ENV_FILE=/etc/jaxllm/jaxllm.env
UNIT_FILE=/etc/systemd/system/jaxllm.service
STATE_DIR=/var/lib/jaxllm
JAX_VERSION_DEFAULT=0.10.2

usage() {
    cat <<EOF
usage: install_host.sh --source DIR [options]

  --source DIR            a checkout (or extracted archive) of this repository
  --jax-extra NAME        JAX build: tpu, cuda13, cuda12 or cpu (default: tpu)
  --jax-version V         JAX version (default: $JAX_VERSION_DEFAULT)
  --model M               demo name, local HF directory or .gguf file, or gs://bucket/dir
                          (an HF directory in GCS, copied to $STATE_DIR/models/ before each start)
  --served-model-name N   name clients use (default: the demo name or the directory's name)
  --host H / --port P     where the server listens (default: 0.0.0.0:8000)
  --xla-cache-gcs URI     mirror the compilation cache to gs://... (pull on start, push on stop)
  --tensor-parallel-size N  split the model over N devices (default 1)
  --distributed           this host is one of a multi-host slice (jaxllm serve --distributed):
                          host 0 serves HTTP, the others follow it
  --extra-args "ARGS"     more \`jaxllm serve\` flags, e.g. "--max-model-len 8192"
  --api-key KEY           require this key on /v1 (default: a generated one on the first run)
  --no-api-key            no key (only on a private network)
  --service-user U        the user the service runs as (default: jaxllm)
  --python PATH           the Python to build the venv with (default: the newest >= 3.11)
  --no-start              install and enable, but do not (re)start
  --dry-run               print the commands, change nothing
EOF
}

# Print a command the way a shell would read it back (tests parse these lines with shlex).
quote() {
    local out=() a
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
    done
    echo "${out[*]}"
}
run() {
    echo "+ $(quote "$@")"
    if [[ $DRY_RUN == 0 ]]; then "$@"; fi
}
die() { echo "install_host.sh: $*" >&2; exit 2; }

SOURCE="" JAX_EXTRA=tpu JAX_VERSION=$JAX_VERSION_DEFAULT MODEL="" SERVED_NAME="" HOST="" PORT=""
XLA_GCS="" TP="" DISTRIBUTED=0 EXTRA_ARGS="" EXTRA_ARGS_SET=0 API_KEY="" API_KEY_MODE=generate SERVICE_USER=jaxllm
PYTHON="" START=1 DRY_RUN=0
need() { [[ $# -ge 2 ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
    arg=$1
    if [[ $arg == --*=* ]]; then set -- "${arg%%=*}" "${arg#*=}" "${@:2}"; arg=$1; fi
    case "$arg" in
    --source) need "$@"; SOURCE=$2; shift ;;
    --jax-extra) need "$@"; JAX_EXTRA=$2; shift ;;
    --jax-version) need "$@"; JAX_VERSION=$2; shift ;;
    --model) need "$@"; MODEL=$2; shift ;;
    --served-model-name) need "$@"; SERVED_NAME=$2; shift ;;
    --host) need "$@"; HOST=$2; shift ;;
    --port) need "$@"; PORT=$2; shift ;;
    --xla-cache-gcs) need "$@"; XLA_GCS=$2; shift ;;
    --tensor-parallel-size) need "$@"; TP=$2; shift ;;
    --extra-args) need "$@"; EXTRA_ARGS=$2; EXTRA_ARGS_SET=1; shift ;;
    --api-key) need "$@"; API_KEY=$2; API_KEY_MODE=given; shift ;;
    --no-api-key) API_KEY_MODE=none ;;
    --service-user) need "$@"; SERVICE_USER=$2; shift ;;
    --python) need "$@"; PYTHON=$2; shift ;;
    --no-start) START=0 ;;
    --distributed) DISTRIBUTED=1 ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $arg" ;;
    esac
    shift
done

[[ -n $SOURCE ]] || { usage >&2; die "--source is required"; }
[[ -f $SOURCE/pyproject.toml && -f $SOURCE/scripts/tpu_vm/jaxllm.service ]] ||
    die "--source $SOURCE is not a checkout of jaxllm"
case "$JAX_EXTRA" in tpu | cuda13 | cuda12 | cpu) ;; *) die "--jax-extra: tpu, cuda13, cuda12 or cpu" ;; esac
[[ $DRY_RUN == 1 || $(id -u) == 0 ]] || die "run as root (sudo), or with --dry-run"
SOURCE=$(cd "$SOURCE" && pwd)
[[ $DRY_RUN == 1 ]] && echo "# dry run: nothing is changed"

# 1. Python >= 3.11 (the TPU VM images' Ubuntu 22.04 ships 3.10; its python3.11 package works).
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
if [[ -z $PYTHON ]]; then
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null && py_ok "$candidate"; then
            PYTHON=$(command -v "$candidate")
            break
        fi
    done
fi
if [[ -z $PYTHON ]]; then
    command -v apt-get >/dev/null || [[ $DRY_RUN == 1 ]] || die "no Python >= 3.11 found; pass --python"
    run apt-get update
    run env DEBIAN_FRONTEND=noninteractive apt-get install -y python3.11 python3.11-venv
    PYTHON=/usr/bin/python3.11
fi
echo "# python: $PYTHON"

# 2. The service user; it joins the groups that own the accelerator device nodes, if any.
if ! id -u "$SERVICE_USER" >/dev/null 2>&1; then
    run useradd --system --home-dir "$STATE_DIR" --no-create-home --shell /usr/sbin/nologin "$SERVICE_USER"
fi
for dev in /dev/accel* /dev/vfio/[0-9]* /dev/nvidia[0-9]*; do
    [[ -e $dev ]] || continue
    group=$(stat -c %G "$dev")
    [[ $group == root ]] || run usermod -aG "$group" "$SERVICE_USER"
done

# 3. The project and JAX into a virtual environment of its own.
run mkdir -p "$PREFIX/src" "$PREFIX/bin"
for item in pyproject.toml README.md jaxllm pallas_kernels server scripts; do
    run rm -rf "${PREFIX:?}/src/$item"
    run cp -a "$SOURCE/$item" "$PREFIX/src/$item"
done
[[ -x $PREFIX/venv/bin/python ]] || run "$PYTHON" -m venv "$PREFIX/venv"
run "$PREFIX/venv/bin/pip" install --no-cache-dir --upgrade pip
# jinja2 renders chat templates; pyproject.toml does not list it yet (in development it comes
# with torch), and without it every chat completion fails.
run "$PREFIX/venv/bin/pip" install --no-cache-dir "$PREFIX/src" "jax[$JAX_EXTRA]==$JAX_VERSION" "jinja2>=3.1"
# A second pass so that an upgrade with an unchanged version number still replaces the code.
run "$PREFIX/venv/bin/pip" install --no-cache-dir --no-deps --force-reinstall "$PREFIX/src"

# 4. The GCS sync helper.
run install -m 0755 "$SOURCE/scripts/tpu_vm/jaxllm-sync.sh" "$PREFIX/bin/jaxllm-sync"

# 5. The configuration: created once, then only the values given as flags change.
set_env() {  # KEY VALUE: replace KEY's line in the env file (or append it)
    local value=$2
    [[ $value == *[[:space:]]* ]] && value="\"$value\""
    if [[ $1 == JAXLLM_API_KEY ]]; then echo "+ set $1=<hidden> in $ENV_FILE"; else echo "+ set $1=$value in $ENV_FILE"; fi
    [[ $DRY_RUN == 1 ]] && return
    K=$1 V=$value awk 'BEGIN { k = ENVIRON["K"]; v = ENVIRON["V"] }
        index($0, k "=") == 1 { print k "=" v; done = 1; next } { print }
        END { if (!done) print k "=" v }' "$ENV_FILE" >"$ENV_FILE.new"
    chmod 0640 "$ENV_FILE.new"
    chgrp "$SERVICE_USER" "$ENV_FILE.new"
    mv "$ENV_FILE.new" "$ENV_FILE"
}
first_install=0
if [[ ! -f $ENV_FILE ]]; then
    first_install=1
    run install -d -m 0755 "$(dirname "$ENV_FILE")"
    run install -m 0640 -o root -g "$SERVICE_USER" "$SOURCE/scripts/tpu_vm/jaxllm.env" "$ENV_FILE"
fi
if [[ $MODEL == gs://* ]]; then
    name=$(basename "${MODEL%/}")
    set_env JAXLLM_MODEL_GCS_URI "$MODEL"
    set_env JAXLLM_MODEL "$STATE_DIR/models/$name"
    set_env JAXLLM_SERVED_MODEL_NAME "${SERVED_NAME:-$name}"
elif [[ -n $MODEL ]]; then
    set_env JAXLLM_MODEL_GCS_URI ""
    set_env JAXLLM_MODEL "$MODEL"
    set_env JAXLLM_SERVED_MODEL_NAME "${SERVED_NAME:-$(basename "${MODEL%/}")}"
elif [[ -n $SERVED_NAME ]]; then
    set_env JAXLLM_SERVED_MODEL_NAME "$SERVED_NAME"
fi
[[ -n $HOST ]] && set_env JAXLLM_HOST "$HOST"
[[ -n $PORT ]] && set_env JAXLLM_PORT "$PORT"
[[ -n $XLA_GCS ]] && set_env JAXLLM_XLA_CACHE_GCS_URI "$XLA_GCS"
[[ -n $TP ]] && set_env JAXLLM_TENSOR_PARALLEL_SIZE "$TP"
[[ $DISTRIBUTED == 1 ]] && set_env JAXLLM_DISTRIBUTED --distributed
[[ $EXTRA_ARGS_SET == 1 ]] && set_env JAXLLM_EXTRA_ARGS "$EXTRA_ARGS"
case "$API_KEY_MODE" in
given) set_env JAXLLM_API_KEY "$API_KEY" ;;
none) set_env JAXLLM_API_KEY "" ;;
generate)
    if [[ $first_install == 1 && $DRY_RUN == 1 ]]; then
        echo "+ set JAXLLM_API_KEY=<generated> in $ENV_FILE"
    elif [[ $first_install == 1 ]]; then
        set_env JAXLLM_API_KEY "$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))')"
    fi
    ;;
esac

# 6. The unit, enabled so that it comes back after a reboot.
if [[ $SERVICE_USER == jaxllm ]]; then
    run install -m 0644 "$SOURCE/scripts/tpu_vm/jaxllm.service" "$UNIT_FILE"
else
    echo "+ install $SOURCE/scripts/tpu_vm/jaxllm.service as $UNIT_FILE with User=/Group=$SERVICE_USER"
    [[ $DRY_RUN == 1 ]] || sed -e "s/^User=.*/User=$SERVICE_USER/" -e "s/^Group=.*/Group=$SERVICE_USER/" \
        "$SOURCE/scripts/tpu_vm/jaxllm.service" >"$UNIT_FILE"
fi
run systemctl daemon-reload
run systemctl enable jaxllm
[[ $START == 1 ]] && run systemctl restart jaxllm

port=${PORT:-8000}
[[ -z $PORT && -f $ENV_FILE ]] && port=$(sed -n 's/^JAXLLM_PORT=//p' "$ENV_FILE")
cat <<EOF
# jaxllm is installed. It compiles every program a batch can need before it answers:
#   journalctl -u jaxllm -f                         the log (warmup progress, then requests)
#   curl -fsS http://127.0.0.1:$port/health   503 while warming up, 200 when ready
#   sudo grep ^JAXLLM_API_KEY= $ENV_FILE    the key clients send as "Authorization: Bearer KEY"
# Settings: $ENV_FILE, then: sudo systemctl restart jaxllm
EOF
