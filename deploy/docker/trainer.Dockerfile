# A training image: torch, the agent and the S3 store (no FastAPI, no SQLAlchemy). Its
# default command is the demo job; build your own on top of it or copy these steps.
#   docker build -f deploy/docker/trainer.Dockerfile -t ckpt-trainer .
# CUDA: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 (any index of
# PyTorch wheels); torch is installed first so that installing the project keeps it.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 ckpt \
    && useradd --system --uid 10001 --gid ckpt --home-dir /home/ckpt --create-home ckpt

RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
# The four packages of the distribution (pyproject.toml).
COPY ckpt/ ckpt/
COPY agent/ agent/
COPY service/ service/
COPY migrations/ migrations/
RUN pip install '.[agent,s3]' && rm -rf /src

WORKDIR /home/ckpt
USER 10001:10001

# The demo job; CKPT_RUN and CKPT_STORE name the run and the store.
CMD ["sh", "-c", "exec python -m agent.demo.train --run \"$CKPT_RUN\" --store \"$CKPT_STORE\" --out /tmp/final.pt"]
