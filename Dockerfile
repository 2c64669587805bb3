# One image for every conveyor process: `conveyor api|tokenizer|inference|celery ...`.
#   docker build -t conveyor:latest .
# torch is installed first and on its own: the CPU build by default. For a GPU image, point the
# build arguments at a CUDA build, e.g. --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (or TORCH_INDEX= for PyPI's default build), and TORCH_SPEC for another version.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    XDG_CACHE_HOME=/cache \
    HOST=0.0.0.0

# g++: the inference worker compiles its CPU decode attention kernel for the node's CPU on first use
# (gpu_worker/engine/cpu_kernels.py; cached under XDG_CACHE_HOME); without it, torch ops only
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

RUN if [ -n "$TORCH_INDEX" ]; then pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"; \
    else pip install "$TORCH_SPEC"; fi

WORKDIR /src
COPY pyproject.toml ./
COPY api ./api
COPY workers ./workers
COPY gpu_worker ./gpu_worker
COPY shared ./shared
COPY infra ./infra
RUN pip install ".[gpu]" && rm -rf build ./*.egg-info

# The model cache (XDG_CACHE_HOME, so CONVEYOR_CACHE defaults to /cache/conveyor) is a volume:
# fill it once with `conveyor model pull`.
RUN useradd --uid 10001 --user-group --create-home app && mkdir -p /cache && chown app:app /cache
USER 10001
WORKDIR /home/app
VOLUME ["/cache"]
EXPOSE 8000
ENTRYPOINT ["conveyor"]
CMD ["api"]
