# kvrelay proxy image (the vLLM P/D worker image is Dockerfile.vllm-worker).
#
#   docker build --secret id=pip-cert,src=<CA bundle> -t kvrelay:0.1.0 .   (secret: optional)
#
# The image holds only the proxy and its pure-Python dependencies (no torch, no nixl), pinned by
# deploy/proxy-constraints.txt; it runs `kvrelay serve` as an unprivileged user with a read-only
# root; configure it with KVRELAY_* variables. pip inside the build reaches the package index
# with the optional secrets `pip-cert` (a CA bundle) and `pip-conf` (a pip.conf); neither is
# kept in any image layer. scripts/build-image.sh passes this machine's.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: one wheel of this project, built with the pinned build backend -------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY deploy/proxy-constraints.txt /constraints.txt
COPY pyproject.toml README.md ./
COPY kvrelay ./kvrelay
# PIP_CONSTRAINT (not -c) so the isolated build environment gets the pinned setuptools too.
RUN --mount=type=secret,id=pip-cert --mount=type=secret,id=pip-conf \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
    && if [ -s /run/secrets/pip-conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip-conf; fi \
    && python -m venv /opt/build \
    && PIP_CONSTRAINT=/constraints.txt /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .

# ---- proxy-venv: the runtime environment (base deps, Kubernetes discovery, OTel), pinned -----
FROM ${PYTHON_IMAGE} AS proxy-venv
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=build /constraints.txt /constraints.txt
COPY --from=build /wheels /wheels
# No bytecode (compiled on import instead; the root is read-only anyway) and no pip or
# setuptools: the running proxy installs nothing.
RUN --mount=type=secret,id=pip-cert --mount=type=secret,id=pip-conf \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
    && if [ -s /run/secrets/pip-conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip-conf; fi \
    && python -m venv /opt/kvrelay \
    && wheel="$(echo /wheels/kvrelay-*.whl)" \
    && /opt/kvrelay/bin/pip install --no-compile -c /constraints.txt "${wheel}[kubernetes,otel,kv-events]" \
    && /opt/kvrelay/bin/kvrelay serve --help > /dev/null \
    && /opt/kvrelay/bin/pip uninstall --yes pip setuptools \
    && find /opt/kvrelay -depth -name __pycache__ -type d -exec rm -rf {} +

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
# Asks the proxy itself, at the address `serve` listens on (same env, env file and flags).
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["kvrelay", "healthcheck"]
ENTRYPOINT ["kvrelay"]
CMD ["serve"]
