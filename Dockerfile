# One image for every Grove process: API, coordinator, workers, dashboard, migrations.
FROM python:3.11-slim-bookworm
# bubblewrap boxes every command Grove runs for a study (see docs/security.md).
RUN apt-get update && apt-get install -y --no-install-recommends git bubblewrap && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml requirements.lock README.md ./
COPY backend ./backend
COPY agents ./agents
COPY frontend ./frontend
COPY client ./client
# learning: torch + transformers for the gpu worker's jobs (PyPI's Linux torch wheel carries CUDA).
ARG GROVE_EXTRAS=example,learning
RUN pip install --no-cache-dir -c requirements.lock ".[${GROVE_EXTRAS}]"
ENV GROVE_DATA_DIR=/data GROVE_WORKTREES_DIR=/worktrees PYTHONUNBUFFERED=1
RUN useradd --uid 1000 --create-home grove && mkdir -p /data /worktrees /repos && chown grove /data /worktrees /repos
USER grove
EXPOSE 8000
CMD ["grove", "--help"]
