#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-perplexity` (CPU, static, native -march) from the
# llama.cpp sources vendored in the llama-cpp-python sdist on PyPI, and copy them to DEST/bin/.
# They are an external peer/reference for pdserve (same GGUF model); pdserve itself never needs them.
#
# This script is NEVER run by default (not by setup.sh, the tests, the launcher or Docker); run it
# by hand:
#   bash deploy/build-llama-server.sh [--force] [DEST]
#     DEST     install prefix, default $HOME/.cache/pdserve/peers/llama.cpp (binaries in DEST/bin/)
#     --force  re-download and rebuild even if DEST/bin already has both binaries
# On a shared machine run it as `nice -n 19 bash deploy/build-llama-server.sh ...`.
#
# Pinned input: llama-cpp-python==0.3.36 (sdist sha256 below), which vendors llama.cpp b11312
# (commit 0c1e57098). Override with LLAMA_CPP_PYTHON_VERSION / LLAMA_CPP_PYTHON_SHA256 (set the
# sha to "" to skip the check); the build number/commit then come from the sdist's CHANGELOG.
#
# Network: only PyPI (the sdist, and cmake if it is missing). The build itself is offline: no
# curl, no OpenSSL, no web UI download from Hugging Face (LLAMA_USE_PREBUILT_UI=OFF), no npm, so
# the server is built without the embedded web UI (the HTTP API is unaffected).
#
# Prerequisites (Debian: apt-get install build-essential python3 python3-venv):
#   a C/C++17 compiler (cc/c++, gcc >= 9 or clang), make, python3 with pip, tar.
#   cmake >= 3.18 is used from PATH if there, otherwise pip-installed into DEST/.tools-venv
#   (or `pip install --user cmake` as a last resort); no root needed.
#   Checked on Debian 12 (gcc 12.2, cmake 3.25): no extra Debian package was needed.
#
# Env: LLAMA_CPP_PYTHON_VERSION, LLAMA_CPP_PYTHON_SHA256, PYTHON (default python3), CFLAGS/CXXFLAGS,
#   LLAMA_ENABLE_AMX=1 (keep Intel AMX kernels; off by default, see below: they crash here).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
LLAMA_CPP_PYTHON_SHA256="${LLAMA_CPP_PYTHON_SHA256-832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e}"
# llama.cpp build number and commit of the vendored tree for the pinned version (the sdist has no
# .git, so cmake would otherwise report "b0 (unknown)").
PINNED_FOR_VERSION=0.3.36
PINNED_BUILD_NUMBER=11312
PINNED_BUILD_COMMIT=0c1e57098
TARGETS=(llama-server llama-perplexity)

force=0
dest=""
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "build-llama-server: unknown option $arg" >&2; exit 2 ;;
    *) [[ -z "$dest" ]] || { echo "build-llama-server: more than one DEST" >&2; exit 2; }; dest="$arg" ;;
  esac
done
dest="${dest:-$HOME/.cache/pdserve/peers/llama.cpp}"
mkdir -p "$dest/bin"
dest="$(cd "$dest" && pwd)"
bindir="$dest/bin"

log() { echo "build-llama-server: $*" >&2; }
die() { log "error: $*"; exit 1; }

report() {
  for t in "${TARGETS[@]}"; do echo "$bindir/$t"; done
  "$bindir/llama-server" --version 2>&1
}

if [[ $force == 0 ]] && [[ -x "$bindir/llama-server" && -x "$bindir/llama-perplexity" ]]; then
  log "already built in $bindir (use --force to rebuild)"
  report
  exit 0
fi

# --- prerequisites ------------------------------------------------------------------------------
for tool in cc c++ make tar; do
  command -v "$tool" >/dev/null || die "'$tool' not found; on Debian: apt-get install build-essential"
done

PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || die "'$PY' not found; on Debian: apt-get install python3 python3-venv"
if "$PY" -m pip --version >/dev/null 2>&1; then
  pipcmd=("$PY" -m pip)
elif [[ -x "$(dirname "$0")/../.venv/bin/python" ]] && "$(dirname "$0")/../.venv/bin/python" -m pip --version >/dev/null 2>&1; then
  pipcmd=("$(dirname "$0")/../.venv/bin/python" -m pip)   # the project's venv
elif command -v pip3 >/dev/null; then
  pipcmd=(pip3)
else
  pipcmd=()
fi

cmake_ok() {  # $1: cmake binary; needs >= 3.18
  local v
  v="$("$1" --version 2>/dev/null | sed -n 's/^cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')" || return 1
  [[ -n "$v" ]] || return 1
  set -- $v
  (( $1 > 3 || ($1 == 3 && $2 >= 18) ))
}
CMAKE=""
if command -v cmake >/dev/null && cmake_ok "$(command -v cmake)"; then
  CMAKE="$(command -v cmake)"
elif [[ -x "$dest/.tools-venv/bin/cmake" ]] && cmake_ok "$dest/.tools-venv/bin/cmake"; then
  CMAKE="$dest/.tools-venv/bin/cmake"
else
  log "cmake >= 3.18 not on PATH; installing it from PyPI into $dest/.tools-venv"
  if "$PY" -m venv "$dest/.tools-venv" >/dev/null 2>&1 \
     && "$dest/.tools-venv/bin/python" -m pip install -q --disable-pip-version-check cmake; then
    CMAKE="$dest/.tools-venv/bin/cmake"
  else
    rm -rf "$dest/.tools-venv"
    [[ ${#pipcmd[@]} -gt 0 ]] || die "no pip to install cmake with; install cmake (apt-get install cmake)"
    "${pipcmd[@]}" install -q --disable-pip-version-check --user cmake
    CMAKE="$("$PY" -m site --user-base)/bin/cmake"
  fi
  cmake_ok "$CMAKE" || die "could not get a working cmake >= 3.18"
fi
log "using $("$CMAKE" --version | head -1) ($CMAKE), $(c++ --version | head -1)"

# --- download and extract the sdist ------------------------------------------------------------
work="$(mktemp -d "${TMPDIR:-/tmp}/build-llama-server.XXXXXX")"
trap 'rm -rf "$work"' EXIT
sdist_name="llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"

log "downloading llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist from PyPI"
if [[ ${#pipcmd[@]} -gt 0 ]] && "${pipcmd[@]}" download -q --disable-pip-version-check --no-deps \
     --no-binary :all: -d "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2; then
  :
else
  # pip missing, or it failed (it also builds the sdist's metadata, which needs its build deps):
  # fetch the file straight from PyPI's JSON API.
  log "pip download failed or unavailable; fetching the sdist URL from the PyPI JSON API"
  "$PY" - "$LLAMA_CPP_PYTHON_VERSION" "$work" <<'EOF'
import json, sys, urllib.request, os
ver, out = sys.argv[1], sys.argv[2]
meta = json.load(urllib.request.urlopen(f"https://pypi.org/pypi/llama-cpp-python/{ver}/json", timeout=60))
sd = [u for u in meta["urls"] if u["packagetype"] == "sdist"]
if not sd:
    sys.exit(f"no sdist for llama-cpp-python {ver}")
urllib.request.urlretrieve(sd[0]["url"], os.path.join(out, sd[0]["filename"]))
EOF
fi
sdist="$(ls "$work"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)"
[[ -f "$sdist" ]] || die "sdist $sdist_name not downloaded"
if [[ -n "$LLAMA_CPP_PYTHON_SHA256" ]]; then
  got="$(sha256sum "$sdist" | cut -d' ' -f1)"
  [[ "$got" == "$LLAMA_CPP_PYTHON_SHA256" ]] \
    || die "sha256 mismatch for $(basename "$sdist"): got $got, want $LLAMA_CPP_PYTHON_SHA256"
  log "sha256 ok ($got)"
fi
tar -xzf "$sdist" -C "$work"
src="$(find "$work" -maxdepth 4 -type d -path '*/vendor/llama.cpp' | head -1)"
[[ -n "$src" && -f "$src/CMakeLists.txt" && -d "$src/tools/server" ]] \
  || die "vendor/llama.cpp (with tools/server) not found in the sdist"
log "llama.cpp sources: $src"

# Build info: pinned for the pinned version, else the commit named in the sdist's CHANGELOG.
if [[ "$LLAMA_CPP_PYTHON_VERSION" == "$PINNED_FOR_VERSION" ]]; then
  build_number="$PINNED_BUILD_NUMBER"; build_commit="$PINNED_BUILD_COMMIT"
else
  build_number=0
  build_commit="$(sed -n "/^## \[$LLAMA_CPP_PYTHON_VERSION\]/,/^## \[/p" "$src/../../CHANGELOG.md" 2>/dev/null \
    | grep -o 'llama.cpp@[0-9a-f]\{7,40\}' | head -1 | cut -d@ -f2)" || true
  build_commit="${build_commit:-unknown}"
fi

# --- configure and build -----------------------------------------------------------------------
jobs="$(nproc 2>/dev/null || echo 2)"
# AMX is left out even where -march=native would enable it (Sapphire Rapids and later): in this
# llama.cpp the AMX matmul loads a tile config that gcc (seen with 12.2) optimises away, so the
# first inference dies with a general protection fault in ggml_backend_amx_mul_mat (ldtilecfg);
# upstream ggml-org/llama.cpp#20824, fix proposed in PR #26954. Explicit -mno-amx-* wins over
# -march=native whatever the order. LLAMA_ENABLE_AMX=1 keeps AMX (then check a real inference).
cflags="${CFLAGS:-}"; cxxflags="${CXXFLAGS:-}"
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [[ "${LLAMA_ENABLE_AMX:-0}" != 1 ]] && c++ $no_amx -x c++ -E - </dev/null >/dev/null 2>&1; then
  cflags="${cflags:+$cflags }$no_amx"; cxxflags="${cxxflags:+$cxxflags }$no_amx"
  log "AMX disabled ($no_amx)"
fi
build="$work/build"
# The explicit LLAMA_BUILD_NUMBER/COMMIT win over git probing (which a tree without .git fails).
"$CMAKE" -S "$src" -B "$build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_NUMBER="$build_number" \
  -DLLAMA_BUILD_COMMIT="$build_commit" \
  -DCMAKE_C_FLAGS="$cflags" \
  -DCMAKE_CXX_FLAGS="$cxxflags" >&2
"$CMAKE" --build "$build" --config Release -j"$jobs" --target "${TARGETS[@]}" >&2

for t in "${TARGETS[@]}"; do
  [[ -x "$build/bin/$t" ]] || die "$build/bin/$t was not built"
  install -m 0755 "$build/bin/$t" "$bindir/$t.tmp"
  mv -f "$bindir/$t.tmp" "$bindir/$t"
done
log "installed into $bindir"
report
