#!/usr/bin/env bash
# A private Docker engine for tests and local builds: its own socket, data root and pid file, so it
# never touches (or is touched by) a system dockerd. Needs root.
#
#   deploy/docker/dockerd.sh start    # prints the DOCKER_HOST to use; idempotent
#   deploy/docker/dockerd.sh stop     # stops the engine this script started; idempotent
#   deploy/docker/dockerd.sh status   # exit 0 when the engine this script starts is running
#   deploy/docker/dockerd.sh install  # Debian's docker.io (dockerd, containerd, runc) if missing
#
# Layout (override with the variables below):
#   PDSERVE_DOCKER_ROOT  data root kept between runs, so built images are cached (/var/lib/pdserve-docker)
#   PDSERVE_DOCKER_RUN   socket, pid file, exec root and log (/run/pdserve-docker)
#   PDSERVE_DOCKER_STORAGE  storage driver: auto (default: overlay2 when an overlay mount works
#                        here, else vfs), overlay2 or vfs. vfs works everywhere but stores every
#                        layer and every container as a full copy (15 s per container of a 1.7 GB image).
set -euo pipefail

ROOT=${PDSERVE_DOCKER_ROOT:-/var/lib/pdserve-docker}
RUN=${PDSERVE_DOCKER_RUN:-/run/pdserve-docker}
SOCK="unix://$RUN/docker.sock"
PIDFILE="$RUN/dockerd.pid"
LOG="$RUN/dockerd.log"
START_TIMEOUT_S=${PDSERVE_DOCKERD_TIMEOUT_S:-60}

die() { echo "dockerd.sh: $*" >&2; exit 1; }

storage_driver() {
    local want=${PDSERVE_DOCKER_STORAGE:-auto}
    [[ "$want" != auto ]] && { echo "$want"; return; }
    local t; t=$(mktemp -d "$ROOT/.overlay-probe.XXXXXX")
    mkdir -p "$t"/{lower,upper,work,merged}
    if mount -t overlay overlay -o "lowerdir=$t/lower,upperdir=$t/upper,workdir=$t/work" "$t/merged" 2>/dev/null; then
        umount "$t/merged"; echo overlay2
    else
        echo vfs
    fi
    rm -rf "$t"
}

running() { [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

install_engine() {
    command -v dockerd >/dev/null && command -v containerd >/dev/null && command -v runc >/dev/null && return 0
    [[ $EUID -eq 0 ]] || die "dockerd is missing and installing it needs root"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update failed"
    # docker.io brings dockerd, containerd and runc; iptables for its bridge networks.
    apt-get install -y -qq --no-install-recommends docker.io iptables >/dev/null \
        || die "apt-get install docker.io failed"
}

start() {
    [[ $EUID -eq 0 ]] || die "starting dockerd needs root"
    if running; then echo "$SOCK"; return 0; fi
    install_engine
    mkdir -p "$ROOT" "$RUN"
    local driver; driver=$(storage_driver)
    # A bridge network forwards between containers and to the published ports.
    sysctl -qw net.ipv4.ip_forward=1 2>/dev/null || true
    # --bridge=none: no default docker0 (compose makes its own networks; builds use the host network),
    # so this engine can run beside a system dockerd.
    setsid dockerd \
        --host "$SOCK" \
        --data-root "$ROOT" \
        --exec-root "$RUN/exec" \
        --pidfile "$PIDFILE" \
        --storage-driver="$driver" \
        --bridge=none \
        --log-level=warn \
        >"$LOG" 2>&1 </dev/null &
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until DOCKER_HOST="$SOCK" docker version >/dev/null 2>&1; do
        if (( SECONDS > deadline )); then
            tail -n 30 "$LOG" >&2 || true
            die "dockerd did not answer on $SOCK within ${START_TIMEOUT_S}s (log: $LOG)"
        fi
        if ! kill -0 $! 2>/dev/null && ! running; then
            tail -n 30 "$LOG" >&2 || true
            die "dockerd exited during start (log: $LOG)"
        fi
        sleep 0.5
    done
    echo "dockerd.sh: dockerd up on $SOCK (storage $driver, data root $ROOT)" >&2
    echo "$SOCK"
}

stop() {
    if running; then
        local pid; pid=$(cat "$PIDFILE")
        kill -TERM "$pid"
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "dockerd.sh: dockerd $pid did not stop in 30s; sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$PIDFILE"
    # dockerd leaves its default network namespace mounted under the exec root.
    awk -v run="$RUN/" 'index($2, run) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do
        umount "$m" 2>/dev/null || true
    done
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) running ;;
    install) install_engine ;;
    *) die "usage: $0 start|stop|status|install" ;;
esac
