# The control plane: `ckpt server` (FastAPI, SQLAlchemy, Alembic; no torch).
#   docker build -f deploy/docker/service.Dockerfile -t ckpt-service .
# Configure it with CKPT_* variables (service/settings.py); CKPT_DATABASE_URL and
# CKPT_ADMIN_TOKEN come from a secret.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 ckpt \
    && useradd --system --uid 10001 --gid ckpt --home-dir /home/ckpt --create-home ckpt

WORKDIR /src
COPY pyproject.toml README.md ./
# The four packages of the distribution (pyproject.toml).
COPY ckpt/ ckpt/
COPY agent/ agent/
COPY service/ service/
COPY migrations/ migrations/
RUN pip install '.[server]' && rm -rf /src

WORKDIR /home/ckpt
USER 10001:10001

# Listen on every interface inside the container (the embedded default is 127.0.0.1).
ENV CKPT_HOST=0.0.0.0 \
    CKPT_PORT=8470
EXPOSE 8470

# Ready means: the database answers, its schema is at head, the store answers.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('CKPT_PORT', '8470') + '/readyz', timeout=4)"]

CMD ["ckpt", "server"]
