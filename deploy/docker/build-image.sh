#!/usr/bin/env bash
# Build the pdserve image with the classic builder, torch coming from a local wheel directory.
#
#   deploy/docker/build-image.sh [TAG] [BASE_IMAGE]      # defaults: pdserve:latest python:3.11-slim
#
# Environment:
#   PDSERVE_WHEELS   wheel directory (default deploy/wheels); when it has no torch wheel, one is
#                    fetched with `pip download torch==$TORCH_VERSION --no-deps` (on machines whose
#                    pip has the CPU wheel at hand that is a local copy; elsewhere point pip at
#                    PyTorch's CPU wheel index, or a multi-GB CUDA wheel is downloaded)
#   PYTHON           interpreter for pip download and the context tar (default python3)
#   DOCKER_BUILD_NETWORK  network of the build's RUN steps (default host: pip reaches PyPI
#                    through the host's own network set-up, no bridge or NAT needed)
# The build uses the repository as context through deploy/docker/context.py (no .venv, .git, caches).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TAG=${1:-pdserve:latest}
BASE_IMAGE=${2:-python:3.11-slim}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
WHEELS=${PDSERVE_WHEELS:-$REPO/deploy/wheels}
PYTHON=${PYTHON:-python3}

mkdir -p "$WHEELS"
if ! compgen -G "$WHEELS/torch-${TORCH_VERSION}*.whl" >/dev/null; then
    echo "build-image.sh: fetching torch==$TORCH_VERSION into $WHEELS" >&2
    "$PYTHON" -m pip download -q "torch==$TORCH_VERSION" --no-deps -d "$WHEELS"
fi

"$PYTHON" "$HERE/context.py" --wheels "$WHEELS" --repo "$REPO" \
    | DOCKER_BUILDKIT=0 docker build -f deploy/Dockerfile \
        --network "${DOCKER_BUILD_NETWORK:-host}" \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TORCH_VERSION=$TORCH_VERSION" \
        -t "$TAG" -
