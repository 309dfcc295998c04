#!/bin/sh
# pdserve-entrypoint ROLE [FLAGS...]: run one pdserve role in a container.
#
#   router          python -m router  --http-host 0.0.0.0 --http-port 8000 --registry-address 0.0.0.0:50050
#   prefill|decode  python -m ROLE    --router router:50050 --listen 0.0.0.0:50051
#                                     --advertise-host <this container's address> --transfer-engine tcp
#                                     --transfer-port 50061
#   anything else   run as given (bash, python -m loadtest ..., pdserve generate ...)
#
# FLAGS come after these defaults and argparse keeps the last occurrence, so any FLAG overrides them.
# The process replaces this shell (exec): it is PID 1, gets SIGTERM on `docker stop` and leaves the
# cluster cleanly. The cluster secret comes from $PDSERVE_SECRET or --secret-file (a mounted file).
set -eu

role=${1:---help}
[ $# -gt 0 ] && shift

container_address() {
    # The first address of this container on its network(s); what peers must dial.
    hostname -i 2>/dev/null | awk '{print $1}' | grep . || hostname
}

case "$role" in
    router)
        exec python -m router --http-host 0.0.0.0 --http-port 8000 --registry-address 0.0.0.0:50050 "$@" ;;
    prefill|decode)
        exec python -m "$role" --router router:50050 --listen 0.0.0.0:50051 \
            --advertise-host "$(container_address)" --transfer-engine tcp --transfer-port 50061 "$@" ;;
    -h|--help|help)
        sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *)
        exec "$role" "$@" ;;
esac
