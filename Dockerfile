# mhaserve images, one file, four targets:
#   server      ONNX Runtime + grpcio + numpy + mhaserve; no torch (the serving path never imports it)
#   export      server + torch (CPU build) + onnx: writes a validated model folder
#   server-gpu  server with onnxruntime-gpu[cuda,cudnn]: CUDA and cuDNN come from PyPI, no CUDA base image;
#               the server still checks that the CUDA provider is really active (--device cuda refuses otherwise)
#   prometheus  Debian's Prometheus scraping the compose file's servers (the monitoring profile)
# BASE_IMAGE: any Debian-like image with python3 (>= 3.11), venv and pip.
# Each Python image installs its dependencies (read from pyproject.toml alone) in a layer of its own, then
# mhaserve itself without them: a change to the code rebuilds only that last layer, in seconds. The layer is
# keyed by the image's requirements list, not by pyproject.toml: a change elsewhere in it (the test extra,
# pytest's settings) rebuilds nothing.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM scratch AS source
COPY pyproject.toml setup.py README.md /src/
COPY mhaserve /src/mhaserve
COPY model /src/model
COPY export /src/export
COPY server /src/server
COPY protos /src/protos

FROM ${BASE_IMAGE} AS requirements
WORKDIR /requirements
COPY pyproject.toml docker/requirements.py ./
RUN python3 requirements.py pyproject.toml > server.txt \
 && python3 requirements.py pyproject.toml export > export.txt \
 && python3 requirements.py pyproject.toml gpu > server-gpu.txt

FROM ${BASE_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv \
 && useradd --system --create-home --uid 10001 --home-dir /home/mhaserve mhaserve \
 && mkdir -p /models && chown mhaserve /models
WORKDIR /opt/mhaserve

FROM base AS server
COPY --from=requirements /requirements/server.txt requirements.txt
RUN pip install -r requirements.txt
COPY --from=source /src ./
RUN pip install --no-deps --no-build-isolation . && pip check
USER mhaserve
# Out of the source tree, so `python -c "import mhaserve"` finds the installed package.
WORKDIR /home/mhaserve
# gRPC, HTTP/REST and Prometheus metrics
EXPOSE 8001 8000 8002
ENV MHASERVE_HOST=0.0.0.0 MHASERVE_METRICS_HOST=0.0.0.0 MHASERVE_MODEL_DIR=/models/mha
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=3 CMD ["mhaserve", "health", "--url", "127.0.0.1:8001"]
# SIGTERM drains: health NOT_SERVING, in-flight requests finish within MHASERVE_GRACE_SECONDS.
STOPSIGNAL SIGTERM
ENTRYPOINT ["mhaserve"]
CMD ["serve"]

FROM base AS export
# torch must be the CPU build: from PyPI it pulls gigabytes of CUDA packages. Wheels put in
# docker/wheels/ (for example a local torch-2.13.0+cpu wheel) are used first; otherwise
# TORCH_INDEX_URL (PyTorch's CPU index) supplies it.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY docker/wheels/ /tmp/wheels/
COPY --from=requirements /requirements/export.txt requirements.txt
RUN pip install --find-links /tmp/wheels --extra-index-url "${TORCH_INDEX_URL}" -r requirements.txt \
 && rm -rf /tmp/wheels
COPY --from=source /src ./
RUN pip install --no-deps --no-build-isolation . && pip check
USER mhaserve
WORKDIR /home/mhaserve
ENTRYPOINT ["mhaserve"]
CMD ["export", "--out", "/models/mha"]

FROM base AS server-gpu
COPY --from=requirements /requirements/server-gpu.txt requirements.txt
RUN pip install -r requirements.txt
COPY --from=source /src ./
RUN pip install --no-deps --no-build-isolation . && pip check
USER mhaserve
WORKDIR /home/mhaserve
EXPOSE 8001 8000 8002
ENV MHASERVE_HOST=0.0.0.0 MHASERVE_METRICS_HOST=0.0.0.0 MHASERVE_MODEL_DIR=/models/mha MHASERVE_DEVICE=cuda
HEALTHCHECK --interval=5s --timeout=4s --start-period=90s --retries=3 CMD ["mhaserve", "health", "--url", "127.0.0.1:8001"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["mhaserve"]
CMD ["serve"]

FROM ${BASE_IMAGE} AS prometheus
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown prometheus /prometheus
COPY deploy/prometheus/prometheus.yml deploy/prometheus/alerts.yml /etc/prometheus/
USER prometheus
EXPOSE 9090
ENTRYPOINT ["prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
            "--web.listen-address=0.0.0.0:9090"]
