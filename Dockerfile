# syntax=docker/dockerfile:1
# One image for the WeightSync operator and its runtime pods.
#   operator (default CMD):  kopf run -m weightsync_operator --standalone --all-namespaces
#   runtime (set by the operator on each runtime pod):
#                            weightsync run --kubernetes --namespace <ns> --name <weightsync>
# Dependencies are pyproject.toml's requirements under constraints.txt's exact pins, installed the
# way tools/venv.sh installs them; tests/test_dockerfile.py checks for drift.

FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependency layer: only pyproject.toml and the pins, so source edits do not reinstall torch and ray.
COPY pyproject.toml constraints.txt ./
RUN pip install -c constraints.txt setuptools \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt
COPY README.md ./
COPY sync_runtime ./sync_runtime
COPY operator ./operator
RUN pip install --no-deps --no-build-isolation .

FROM python:3.12-slim
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
RUN groupadd --gid 10001 weightsync \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin weightsync
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 8081
CMD ["kopf", "run", "-m", "weightsync_operator", "--standalone", "--all-namespaces", "--liveness=http://127.0.0.1:8081/healthz"]
