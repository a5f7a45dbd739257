#!/usr/bin/env bash
# Create a Cloud TPU VM and make it a jaxllm endpoint, from your workstation (gcloud logged in).
#
#   scripts/tpu_vm/create_tpu_vm.sh --name jaxllm-1 --zone us-east5-b --accelerator-type v6e-8
#   scripts/tpu_vm/create_tpu_vm.sh ... --model gs://my-bucket/Qwen2.5-1.5B-Instruct --dry-run
#
# The steps (--dry-run prints them and runs nothing):
#   1. gcloud compute tpus tpu-vm create    the VM, with the runtime version of its generation
#   2. git archive HEAD                     the project as a tarball (committed files only)
#   3. gcloud compute tpus tpu-vm scp       the tarball onto the VM
#   4. gcloud compute tpus tpu-vm ssh       unpack it and run scripts/tpu_vm/install_host.sh:
#                                           jax[tpu], the systemd unit, /etc/jaxllm/jaxllm.env
#
# Multi-host slices (v5litepod-16, v6e-16, v5p-16 and up): the same install on every host, with
# --distributed and the tensor parallel size set to every chip of the slice; host 0 (worker 0)
# serves HTTP, the others follow it. See docs/deploy.md, "Multi-host TPU slices".
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
JAX_VERSION_DEFAULT=0.10.2

usage() {
    cat <<EOF
usage: create_tpu_vm.sh --name NAME --zone ZONE --accelerator-type TYPE [options]

  --name NAME               the TPU VM's name
  --zone ZONE               e.g. us-east5-b; the accelerator type must be offered there
  --accelerator-type TYPE   v5litepod-N (v5e), v5p-N or v6e-N, e.g. v5litepod-8, v6e-8, v5p-8
  --runtime-version V       TPU software version (default by generation: v5e v2-alpha-tpuv5-lite,
                            v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e)
  --project P               GCP project (default: gcloud's configured one)
  --spot                    a Spot VM (cheaper, can be preempted)
  --model M                 demo name (the first install's default: smollm2-135m), or
                            gs://bucket/dir holding an HF checkpoint (copied to the VM's disk
                            before each start)
  --served-model-name N     the name clients use (default: the demo name or the directory's name)
  --port P                  server port on the VM (the first install's default: 8000)
  --xla-cache-gcs URI       mirror the compilation cache to gs://... as well as local disk
  --tensor-parallel-size N  split the model over N chips (default 1 on one host, every chip of
                            a multi-host slice; the model's attention heads must divide by N)
  --extra-args "ARGS"       more \`jaxllm serve\` flags, e.g. "--max-model-len 8192"
  --jax-version V           JAX version to install with the TPU extra (default $JAX_VERSION_DEFAULT)
  --source-tarball PATH     ship this tarball (made by git archive --prefix=jaxllm/) instead of HEAD
  --skip-create             install on an existing TPU VM
  --dry-run                 print the commands, run nothing
EOF
}

quote() {  # print a command the way a shell would read it back
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
die() { echo "create_tpu_vm.sh: $*" >&2; exit 2; }
need() { [[ $# -ge 2 ]] || die "$1 needs a value"; }

NAME="" ZONE="" ACCEL="" RUNTIME="" PROJECT="" SPOT=0 MODEL="" SERVED_NAME="" PORT=""
XLA_GCS="" TP="" EXTRA_ARGS="" JAX_VERSION=$JAX_VERSION_DEFAULT TARBALL="" SKIP_CREATE=0 DRY_RUN=0
while [[ $# -gt 0 ]]; do
    arg=$1
    if [[ $arg == --*=* ]]; then set -- "${arg%%=*}" "${arg#*=}" "${@:2}"; arg=$1; fi
    case "$arg" in
    --name) need "$@"; NAME=$2; shift ;;
    --zone) need "$@"; ZONE=$2; shift ;;
    --accelerator-type) need "$@"; ACCEL=$2; shift ;;
    --runtime-version) need "$@"; RUNTIME=$2; shift ;;
    --project) need "$@"; PROJECT=$2; shift ;;
    --spot) SPOT=1 ;;
    --model) need "$@"; MODEL=$2; shift ;;
    --served-model-name) need "$@"; SERVED_NAME=$2; shift ;;
    --port) need "$@"; PORT=$2; shift ;;
    --xla-cache-gcs) need "$@"; XLA_GCS=$2; shift ;;
    --tensor-parallel-size) need "$@"; TP=$2; shift ;;
    --extra-args) need "$@"; EXTRA_ARGS=$2; shift ;;
    --jax-version) need "$@"; JAX_VERSION=$2; shift ;;
    --source-tarball) need "$@"; TARBALL=$2; shift ;;
    --skip-create) SKIP_CREATE=1 ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $arg" ;;
    esac
    shift
done
[[ -n $NAME && -n $ZONE && -n $ACCEL ]] || { usage >&2; die "--name, --zone and --accelerator-type are required"; }

# The generation decides the runtime version and how many chips one host holds: v5e and v6e
# count chips (8 per host at most), v5p counts TensorCores (2 per chip, 4 chips per host).
count=${ACCEL##*-}
[[ $count =~ ^[0-9]+$ ]] || die "--accelerator-type $ACCEL: expected GENERATION-COUNT, e.g. v6e-8"
case "$ACCEL" in
v5litepod-*) default_runtime=v2-alpha-tpuv5-lite; chips=$count; per_host=8 ;;
v6e-*) default_runtime=v2-alpha-tpuv6e; chips=$count; per_host=8 ;;
v5p-*) default_runtime=v2-alpha-tpuv5; chips=$((count / 2)); per_host=4 ;;
*) die "--accelerator-type $ACCEL: supported generations are v5litepod-N (v5e), v5p-N and v6e-N" ;;
esac
RUNTIME=${RUNTIME:-$default_runtime}
multi_host=0
((chips > per_host)) && multi_host=1

gcloud_scope=()
[[ -n $PROJECT ]] && gcloud_scope+=("--project=$PROJECT")
gcloud_scope+=("--zone=$ZONE")

if [[ $multi_host == 1 ]]; then
    TP=${TP:-$chips}
    echo "# $ACCEL is a multi-host slice ($chips chips, $per_host per host): one engine over all of them"
fi
[[ $DRY_RUN == 1 ]] && echo "# dry run: $ACCEL ($chips chips), runtime $RUNTIME; nothing is run"

# 1. The TPU VM.
create=(gcloud compute tpus tpu-vm create "$NAME" "${gcloud_scope[@]}" "--accelerator-type=$ACCEL" "--version=$RUNTIME")
((SPOT)) && create+=(--spot)
# GCS access from the VM (model, compilation cache) goes through its service account.
[[ $MODEL == gs://* || -n $XLA_GCS ]] && create+=("--scopes=https://www.googleapis.com/auth/cloud-platform")
if [[ $SKIP_CREATE == 0 ]]; then run "${create[@]}"; fi

# 2. The project, as committed.
if [[ -z $TARBALL ]]; then
    TARBALL=${TMPDIR:-/tmp}/jaxllm-src-$NAME.tar.gz
    if [[ -n $(git -C "$REPO" status --porcelain 2>/dev/null) ]]; then
        echo "# note: uncommitted changes are not shipped (git archive HEAD)" >&2
    fi
    run git -C "$REPO" archive --format=tar.gz --prefix=jaxllm/ -o "$TARBALL" HEAD
fi

# 3. Onto every host of the VM.
run gcloud compute tpus tpu-vm scp "$TARBALL" "$NAME:/tmp/jaxllm-src.tar.gz" "${gcloud_scope[@]}" --worker=all

# 4. Unpack and install there: jax[tpu], the systemd unit, the env file; then start.
# Only the settings given here: a re-run (--skip-create, to upgrade) keeps the others on the VM.
install=(sudo bash /tmp/jaxllm/scripts/tpu_vm/install_host.sh --source /tmp/jaxllm --jax-extra tpu
    --jax-version "$JAX_VERSION")
[[ -n $MODEL ]] && install+=(--model "$MODEL")
[[ -n $PORT ]] && install+=(--port "$PORT")
[[ -n $SERVED_NAME ]] && install+=(--served-model-name "$SERVED_NAME")
[[ -n $XLA_GCS ]] && install+=(--xla-cache-gcs "$XLA_GCS")
[[ -n $TP ]] && install+=(--tensor-parallel-size "$TP")
[[ $multi_host == 1 ]] && install+=(--distributed)
[[ -n $EXTRA_ARGS ]] && install+=(--extra-args "$EXTRA_ARGS")
remote="set -e; rm -rf /tmp/jaxllm; tar -xzf /tmp/jaxllm-src.tar.gz -C /tmp; $(quote "${install[@]}")"
run gcloud compute tpus tpu-vm ssh "$NAME" "${gcloud_scope[@]}" --worker=all "--command=$remote"
if [[ $multi_host == 1 ]]; then
    echo "# Every host runs jaxllm.service: host 0 (--worker=0) serves HTTP once all hosts have joined,"
    echo "# the others follow it and serve no HTTP. Reach host 0 only; restart all hosts together:"
    echo "#   gcloud compute tpus tpu-vm ssh $NAME $(quote "${gcloud_scope[@]}") --worker=all --command='sudo systemctl restart jaxllm'"
fi

cat <<EOF
# Next: watch the warmup, then reach the server through an SSH tunnel (or open port ${PORT:-8000} in
# a firewall rule for your clients):
#   gcloud compute tpus tpu-vm ssh $NAME $(quote "${gcloud_scope[@]}") --command='journalctl -u jaxllm -f'
#   gcloud compute tpus tpu-vm ssh $NAME $(quote "${gcloud_scope[@]}") -- -N -L ${PORT:-8000}:127.0.0.1:${PORT:-8000}
#   curl -fsS http://127.0.0.1:${PORT:-8000}/health
EOF
