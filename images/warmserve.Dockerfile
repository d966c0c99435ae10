# syntax=docker/dockerfile:1
# The operator / gateway image (and the CPU agent for --simulate-gpus clusters): `warmserve` on
# python:3.11, non-root. The CUDA agent image is images/agent-cuda.Dockerfile.
#
#   docker build -f images/warmserve.Dockerfile -t REGISTRY/warmserve:0.1.0 .
#
# Base images are pinned by version tag; pin digests (@sha256:...) when you publish (this
# repository's CI has no access to container registries, see docs/images.md).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- build: the wheel, then a virtual environment with every dependency pinned ---------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY warmserve ./warmserve
COPY operator ./operator
COPY agent ./agent
COPY gateway ./gateway
COPY images ./images
RUN images/build-wheel.sh /wheels \
 && images/install.sh operator /opt/warmserve /wheels

# ---- runtime: the venv only, no compilers, no sources ------------------------------------------
FROM ${PYTHON_IMAGE}
COPY --from=build /opt/warmserve /opt/warmserve
RUN groupadd --system --gid 65532 warmserve \
 && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --shell /usr/sbin/nologin warmserve
ENV PATH=/opt/warmserve/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["warmserve"]
CMD ["--help"]
