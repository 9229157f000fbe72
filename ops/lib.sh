# shellcheck shell=bash
# Shared helpers for the ops/ scripts. Source it; do not run it.
#
#   . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# Repository root (the directory above ops/).
KFS_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export KFS_ROOT

KFS_PG_HOST=127.0.0.1
KFS_PG_PORT=5432
KFS_AMQP_HOST=127.0.0.1
KFS_AMQP_PORT=5672
KFS_DEFAULT_DATABASE_URL="postgres://postgres@${KFS_PG_HOST}:${KFS_PG_PORT}/postgres"
KFS_DEFAULT_AMQP_URL="amqp://guest:guest@${KFS_AMQP_HOST}:${KFS_AMQP_PORT}/%2f"

# Name of the calling script, for messages ("ops/services: ...").
KFS_ME="ops/$(basename "$0")"

kfs_say() { printf '%s: %s\n' "$KFS_ME" "$*" >&2; }
kfs_die() {
    kfs_say "$*"
    exit 1
}
kfs_have() { command -v "$1" >/dev/null 2>&1; }

# kfs_count FLAG VALUE: dies naming FLAG unless VALUE is a whole number ≥ 1.
kfs_count() {
    [[ $2 =~ ^[0-9]+$ && $2 -ge 1 ]] || kfs_die "$1 needs a whole number ≥ 1, got '$2'"
}

# kfs_tcp_probe HOST PORT: true when something accepts a TCP connection.
kfs_tcp_probe() {
    # shellcheck disable=SC2016 # expanded by the inner bash
    timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" >/dev/null 2>&1
}

# kfs_pg_up: true when Postgres accepts connections on 127.0.0.1:5432.
kfs_pg_up() {
    if kfs_have pg_isready; then
        pg_isready -q -t 3 -h "$KFS_PG_HOST" -p "$KFS_PG_PORT" >/dev/null 2>&1
    else
        kfs_tcp_probe "$KFS_PG_HOST" "$KFS_PG_PORT"
    fi
}

# kfs_amqp_up: true when an AMQP broker answers on 127.0.0.1:5672. Sends the
# AMQP 0-9-1 protocol header and expects the first byte of a method frame
# (Connection.Start) back, so a port that merely accepts TCP (docker-proxy in
# front of a container that is still booting) does not count.
kfs_amqp_up() {
    # shellcheck disable=SC2016 # expanded by the inner bash
    LC_ALL=C timeout 5 bash -c '
        exec 3<>"/dev/tcp/$1/$2" || exit 1
        printf "AMQP\0\0\x09\x01" >&3 || exit 1
        IFS= read -r -t 4 -n 1 -u 3 b || exit 1
        [[ $b == "$3" ]]
    ' _ "$KFS_AMQP_HOST" "$KFS_AMQP_PORT" $'\x01' >/dev/null 2>&1
}

# kfs_export_defaults: DATABASE_URL / AMQP_URL for the local services, unless set.
kfs_export_defaults() {
    export DATABASE_URL="${DATABASE_URL:-$KFS_DEFAULT_DATABASE_URL}"
    export AMQP_URL="${AMQP_URL:-$KFS_DEFAULT_AMQP_URL}"
}

# kfs_compose ARGS...: `docker compose`, or the standalone `docker-compose`.
kfs_compose() {
    if docker compose version >/dev/null 2>&1; then
        docker compose -f "$KFS_ROOT/docker-compose.yml" "$@"
    elif kfs_have docker-compose; then
        docker-compose -f "$KFS_ROOT/docker-compose.yml" "$@"
    else
        kfs_say "Docker runs but neither 'docker compose' nor 'docker-compose' is installed; install the compose plugin"
        return 1
    fi
}
