# syntax=docker/dockerfile:1
# kvrelay images.
#
#   docker build -t kvrelay:0.1.0 .                                  # the proxy (default target)
#   docker build --target vllm-worker -t kvrelay-vllm:0.1.0 .        # vLLM P/D worker + connector
#
# The proxy image holds only the proxy and its pure-Python dependencies (no torch, no nixl), runs
# as an unprivileged user and starts `kvrelay serve`; configure it with KVRELAY_* variables.
# The vllm-worker image is the official vLLM image plus the kvrelay connector; it keeps vLLM's
# own torch and entrypoint (see README "Deployment" for the P and D command lines).

ARG PYTHON_IMAGE=python:3.11-slim
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# ---- build: one wheel of this project, no dependencies resolved here ------------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvrelay ./kvrelay
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- proxy-venv: the proxy's runtime environment (base deps, Kubernetes discovery, OTel) ---
FROM ${PYTHON_IMAGE} AS proxy-venv
COPY --from=build /wheels /wheels
RUN python -m venv /opt/kvrelay \
    && wheel="$(echo /wheels/kvrelay-*.whl)" \
    && /opt/kvrelay/bin/pip install --no-cache-dir "${wheel}[kubernetes,otel]" \
    && /opt/kvrelay/bin/kvrelay serve --help > /dev/null

# ---- vllm-worker: official vLLM image + the kvrelay connector for P and D workers -----------
FROM ${VLLM_IMAGE} AS vllm-worker
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=build /wheels /wheels
# The connector extra minus torch: vLLM's CUDA torch stays exactly as the image ships it
# (pinned through a constraints file), nixl and numpy come from the extra.
RUN python3 -m pip freeze | grep -E '^torch==' > /tmp/keep-torch.txt \
    && python3 -m pip install --no-cache-dir -c /tmp/keep-torch.txt \
        /wheels/kvrelay-*.whl "nixl==1.5.1" "numpy>=1.26" \
    && python3 -c "import kvrelay.connector.vllm.adapter" \
    && rm -rf /wheels /tmp/keep-torch.txt
# vLLM's entrypoint (`vllm serve`) stays; pass --kv-transfer-config with KVRelayConnector.

# ---- proxy (default): slim, non-root, read-only friendly -------------------------------------
FROM ${PYTHON_IMAGE} AS proxy
ENV PATH=/opt/kvrelay/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 kvrelay \
    && useradd --system --uid 10001 --gid kvrelay --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin kvrelay
COPY --from=proxy-venv /opt/kvrelay /opt/kvrelay
WORKDIR /srv/kvrelay
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVRELAY_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["kvrelay"]
CMD ["serve"]
