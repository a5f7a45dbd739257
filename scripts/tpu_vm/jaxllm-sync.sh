#!/usr/bin/env bash
# jaxllm-sync pull|push: mirror the model and the XLA compilation cache between GCS and local disk.
#
#   pull  (ExecStartPre)  JAXLLM_MODEL_GCS_URI     -> JAXLLM_MODEL
#                         JAXLLM_XLA_CACHE_GCS_URI -> JAXLLM_COMPILATION_CACHE_DIR
#   push  (ExecStopPost)  JAXLLM_COMPILATION_CACHE_DIR -> JAXLLM_XLA_CACHE_GCS_URI
#
# Each step runs only when its GCS URI is set, so with none set this is a no-op. Run by systemd
# with /etc/jaxllm/jaxllm.env in its environment; by hand, pass the file: `jaxllm-sync pull
# /etc/jaxllm/jaxllm.env`. Uses `gcloud storage rsync`, which copies only what changed and
# never deletes: the VM's service account needs read access to the buckets (and write access
# to the cache bucket for push).
set -euo pipefail

usage() { echo "usage: jaxllm-sync pull|push [ENV_FILE]" >&2; exit 2; }
[[ $# -ge 1 && $# -le 2 ]] || usage
if [[ $# -eq 2 ]]; then
    set -a
    # shellcheck disable=SC1090
    . "$2"
    set +a
fi

rsync_dir() {  # SRC DST
    echo "jaxllm-sync: $1 -> $2"
    gcloud storage rsync --recursive "$1" "$2"
}

case "$1" in
pull)
    if [[ -n "${JAXLLM_MODEL_GCS_URI:-}" ]]; then
        mkdir -p "$JAXLLM_MODEL"
        rsync_dir "$JAXLLM_MODEL_GCS_URI" "$JAXLLM_MODEL"
    fi
    if [[ -n "${JAXLLM_XLA_CACHE_GCS_URI:-}" ]]; then
        mkdir -p "$JAXLLM_COMPILATION_CACHE_DIR"
        chmod 700 "$JAXLLM_COMPILATION_CACHE_DIR"  # JAX executes what it loads from here
        rsync_dir "$JAXLLM_XLA_CACHE_GCS_URI" "$JAXLLM_COMPILATION_CACHE_DIR"
    fi
    ;;
push)
    if [[ -n "${JAXLLM_XLA_CACHE_GCS_URI:-}" && -d "${JAXLLM_COMPILATION_CACHE_DIR:-}" ]]; then
        rsync_dir "$JAXLLM_COMPILATION_CACHE_DIR" "$JAXLLM_XLA_CACHE_GCS_URI"
    fi
    ;;
*) usage ;;
esac
