# syntax=docker/dockerfile:1
# The node agent for CUDA GPU nodes: `warmserve agent --gpus auto` with vLLM (pooled engine
# processes) and cuda-python (the VMM backend), non-root. GPUs and the driver come from the
# NVIDIA container toolkit / device plugin; torch's wheels bring the CUDA 13 runtime libraries.
#
#   docker build -f images/agent-cuda.Dockerfile -t REGISTRY/warmserve-agent-cuda:0.1.0 .
#
# Base images are pinned by version tag; pin digests when you publish (docs/images.md).
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

# ---- build: Ubuntu 24.04's CPython 3.12, the wheel, the pinned venv (vLLM, torch, ...) --------
FROM ${CUDA_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY warmserve ./warmserve
COPY operator ./operator
COPY agent ./agent
COPY gateway ./gateway
COPY images ./images
RUN python3 -m venv /opt/buildenv \
 && PYTHON=/opt/buildenv/bin/python images/build-wheel.sh /wheels \
 && images/install.sh agent-cuda /opt/warmserve /wheels
# The native slot allocator (agent/native/slot_allocator.c, the KV cache's CUDAPluggableAllocator)
# is not in the wheel: put its source where warmserve_agent.native looks for it and build it
# now, into the cache the runtime reads, so the runtime image needs no compiler.
RUN site=$(/opt/warmserve/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && mkdir -p "$site/native" /opt/warmserve/native-cache \
 && cp agent/native/slot_allocator.c "$site/native/" \
 && WARMSERVE_NATIVE_CACHE=/opt/warmserve/native-cache \
    /opt/warmserve/bin/python -c 'from warmserve_agent.native import build; print(build())'

# ---- runtime ---------------------------------------------------------------------------------
FROM ${CUDA_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 65532 warmserve \
 && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --shell /usr/sbin/nologin warmserve
COPY --from=build /opt/warmserve /opt/warmserve
ENV PATH=/opt/warmserve/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    WARMSERVE_NATIVE_CACHE=/opt/warmserve/native-cache \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HF_HUB_DISABLE_TELEMETRY=1
USER 65532:65532
ENTRYPOINT ["warmserve"]
CMD ["agent", "--help"]
