#!/usr/bin/env bash
# The container test: build the image and run docker-compose.yml end to end with podman, with no
# container registry (the base image is made with debootstrap from the Debian mirror).
# Needs root; installs what it needs. Everything listens on 127.0.0.1 (deploy/ci/compose.host.yml).
#
#   deploy/ci/test-compose.sh        # CI runs it from .ci/run
#
# CODEENV_CI_DIR (/var/tmp/codeenv-ci) keeps podman-compose's venv; the base image is kept in
# podman's storage and made again only when missing.
set -euo pipefail
started=$(date +%s)
source "$(dirname "$0")/../../scripts/bootstrap.sh"
cd "$ROOT"
CI_DIR="${CODEENV_CI_DIR:-/var/tmp/codeenv-ci}"
PROJECT=codeenv-ci
BASE=docker.io/library/debian:trixie-slim
export CODEENV_IMAGE_TAG=localhost/codeenv:latest
export CONTAINERS_CONF="$ROOT/deploy/ci/containers.conf"
export CODEENV_CI_PORT="${CODEENV_CI_PORT:-28000}" CODEENV_CI_REDIS_PORT="${CODEENV_CI_REDIS_PORT:-26379}"
K8S_PORT="${CODEENV_CI_K8S_PORT:-28001}" K8S_WORKER=codeenv-ci-k8s-worker K8S_UIDS=1800000000
export CODEENV_TOKEN="ci-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
export CODEENV_REDIS_PASSWORD="ci-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
say() { printf '\n== %s (%ss)\n' "$*" "$(( $(date +%s) - started ))"; }

say "installing podman, runc, debootstrap"
# runc: crun refuses this host's hybrid cgroup layout; catatonit: compose's `init: true`.
bootstrap podman runc catatonit debootstrap netavark aardvark-dns iptables containernetworking-plugins
if [ ! -x "$CI_DIR/tools/bin/podman-compose" ]; then
    mkdir -p "$CI_DIR"
    "$VENV/bin/python" -m venv "$CI_DIR/tools"
    "$CI_DIR/tools/bin/pip" install -q --disable-pip-version-check "podman-compose>=1.5"
fi
compose() { "$CI_DIR/tools/bin/podman-compose" -p "$PROJECT" -f docker-compose.yml -f deploy/ci/compose.host.yml "$@"; }

leftovers() {
    podman ps -a -q --filter "label=io.podman.compose.project=$PROJECT"
    podman pod ls -q --filter "name=$PROJECT"
    podman network ls -q --filter "name=^${PROJECT}_"
    podman volume ls -q --filter "name=^${PROJECT}_"
}
remove_k8s_worker() {  # its jails' mount namespaces can keep its shm busy for a moment after it ends
    for _ in 1 2 3 4 5; do
        podman container exists "$K8S_WORKER" || return 0
        podman rm -f -t 10 "$K8S_WORKER" >/dev/null 2>&1 || sleep 2
    done
    ! podman container exists "$K8S_WORKER" || { echo "FAIL: cannot remove $K8S_WORKER"; return 1; }
}
clean() {
    remove_k8s_worker || true
    compose down -v --remove-orphans >/dev/null 2>&1 || true
    podman ps -a -q --filter "label=io.podman.compose.project=$PROJECT" | xargs -r podman rm -f -t 40 >/dev/null 2>&1 || true
    podman pod ls -q --filter "name=$PROJECT" | xargs -r podman pod rm -f >/dev/null 2>&1 || true
    podman volume ls -q --filter "name=^${PROJECT}_" | xargs -r podman volume rm -f >/dev/null 2>&1 || true
}
trap 'status=$?; if [ $status -ne 0 ]; then podman logs --tail 30 "$K8S_WORKER" 2>/dev/null; for c in $(podman ps -a --format "{{.Names}}" --filter "label=io.podman.compose.project=$PROJECT"); do echo "--- logs of $c"; podman logs --tail 30 "$c" 2>&1; done; fi; clean' EXIT
clean

if podman image exists "$BASE"; then
    say "base image $BASE: kept from an earlier run"
else
    say "making $BASE with debootstrap"
    rootfs="$(mktemp -d /var/tmp/codeenv-rootfs.XXXXXX)"
    debootstrap --variant=minbase trixie "$rootfs" http://deb.debian.org/debian >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --change 'CMD ["bash"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
fi

say "building $CODEENV_IMAGE_TAG"
ca_args=()
shopt -s nullglob
cas=(/usr/local/share/ca-certificates/*.crt)
if [ ${#cas[@]} -gt 0 ]; then  # a TLS-intercepting proxy between this machine and PyPI
    ca_args=(--build-arg "EXTRA_CA_CERTS=$(cat "${cas[@]}")")
fi
podman build -q "${ca_args[@]}" -f deploy/Dockerfile -t "$CODEENV_IMAGE_TAG" . >/dev/null
podman build -q -f deploy/ci/redis.Containerfile -t localhost/codeenv-ci-redis:latest deploy/ci >/dev/null
built=$(date +%s)

say "the worker's least privileges: codeenv run with SYS_ADMIN, SETUID, SETGID, KILL and /proc unmasked"
printf 'import sys\nprint(sys.version_info >= (3, 12))\n' > "$CI_DIR/least.py"
out=$(podman run --rm --cap-drop=all --cap-add=SYS_ADMIN,SETUID,SETGID,KILL --security-opt 'unmask=/proc/*' \
    -e CODEENV_UID_BASE=1700100000 -v "$CI_DIR/least.py:/least.py:ro" "$CODEENV_IMAGE_TAG" run /least.py 2>/dev/null)
grep -q '"stdout": "True\\n"' <<<"$out" || { echo "$out"; echo "FAIL: codeenv run with the least privileges"; exit 1; }
echo "ok   a jail runs without --privileged"
out=$(podman run --rm --cap-drop=all --cap-add=SYS_ADMIN,SETUID,SETGID,KILL -e CODEENV_UID_BASE=1700100000 \
    -v "$CI_DIR/least.py:/least.py:ro" "$CODEENV_IMAGE_TAG" run /least.py 2>&1 || true)
grep -q 'refused the jail a /proc of its own.*unmask=/proc/\*' <<<"$out" \
    || { echo "$out"; echo "FAIL: a masked /proc is not named as the cause"; exit 1; }
echo "ok   with /proc masked, the one line says so and what to set"

say "the Kubernetes worker's privileges: its own user namespace of 65,536 uids, /proc unmasked, the same capabilities"
# deploy/k8s/worker.yaml as podman can say it: hostUsers: false (--uidmap), procMount: Unmasked,
# the four capabilities, no seccomp or AppArmor profile in the way.
# It starts the service once its cgroups are handed over (below).
podman run -d --name "$K8S_WORKER" --uidmap "0:$K8S_UIDS:65536" --gidmap "0:$K8S_UIDS:65536" \
    --cap-drop=all --cap-add=SYS_ADMIN,SETUID,SETGID,KILL --security-opt 'unmask=/proc/*' \
    -p "127.0.0.1:$K8S_PORT:8000" -e CODEENV_TOKEN -e CODEENV_REQUIRE_USER_NAMESPACE=true \
    --entrypoint /bin/sh "$CODEENV_IMAGE_TAG" \
    -c 'until [ -e /tmp/go ]; do sleep 0.1; done; exec /usr/local/bin/codeenv-entrypoint serve --host 0.0.0.0' >/dev/null
# What the RuntimeClass's handler does (containerd's cgroup_writable, CRI-O's annotation): the
# container's own cgroups belong to its root. podman cannot be asked to, so it is done here.
pid=$(podman inspect -f '{{.State.Pid}}' "$K8S_WORKER")
while IFS=: read -r _ controllers path; do
    if [ -z "$controllers" ] && [ -e /sys/fs/cgroup/cgroup.controllers ]; then
        dir="/sys/fs/cgroup$path"  # cgroup v2
    elif grep -qwE 'memory|pids|cpu|cpuacct' <<<"${controllers//,/ }"; then
        dir="/sys/fs/cgroup/$controllers$path"
    else
        continue
    fi
    [ "$path" != / ] || { echo "FAIL: the container's $controllers cgroup is its hierarchy's root"; exit 1; }
    chown -R "$K8S_UIDS:$K8S_UIDS" "$dir"
done < "/proc/$pid/cgroup"
podman exec "$K8S_WORKER" touch /tmp/go
"$VENV/bin/python" deploy/ci/check_stack.py basics "http://127.0.0.1:$K8S_PORT"
# Read whole, then searched: with pipefail, `podman logs | grep -q` fails whenever grep stops reading first.
logs=$(podman logs "$K8S_WORKER" 2>&1)
grep -q 'host uids from 32768 ' <<<"$logs" \
    || { echo "FAIL: the slots' uids were not carved out of the container's namespace"; exit 1; }
echo "ok   the hostile basics pass in a user namespace, on uids carved out of it (32768 up)"
podman stop -t 30 "$K8S_WORKER" >/dev/null
remove_k8s_worker

say "the monitoring profile: off by default; on, Prometheus and Grafana with deploy/'s files"
services() { compose "$@" config 2>/dev/null | "$VENV/bin/python" -c 'import sys, yaml; print(" ".join(sorted(yaml.safe_load(sys.stdin)["services"])))'; }
[ "$(services)" = "gateway redis worker" ] || { echo "FAIL: the default services are $(services)"; exit 1; }
[ "$(services --profile monitoring)" = "gateway grafana prometheus redis worker" ] \
    || { echo "FAIL: the monitoring profile's services are $(services --profile monitoring)"; exit 1; }
echo "ok   compose config: 3 services by default, Prometheus and Grafana with --profile monitoring"

say "up: redis, gateway, 1 worker"
compose up -d --no-build >/dev/null 2>&1
for c in $(podman ps --format '{{.Names}}' --filter "label=io.podman.compose.project=$PROJECT"); do
    podman healthcheck run "$c" >/dev/null 2>&1 || true  # no systemd here to run them on a timer
done
"$VENV/bin/python" deploy/ci/check_stack.py basics "http://127.0.0.1:$CODEENV_CI_PORT"
for c in $(podman ps --format '{{.Names}}' --filter "label=io.podman.compose.project=$PROJECT"); do
    podman healthcheck run "$c" >/dev/null 2>&1 || { echo "FAIL: the health check of $c"; exit 1; }
done
echo "ok   the health checks of redis, the gateway and the worker pass (run by hand: no systemd here)"

say "scale: 2 workers"
compose up -d --no-build --scale worker=2 >/dev/null 2>&1
"$VENV/bin/python" deploy/ci/check_stack.py spread "http://127.0.0.1:$CODEENV_CI_PORT" 2
bases=()
for c in $(podman ps --format '{{.Names}}' --filter "label=io.podman.compose.project=$PROJECT" | grep _worker_); do
    calls=$(podman logs "$c" 2>&1 | grep -c '"event": "start"' || true)
    base=$(podman logs "$c" 2>&1 | sed -n 's/.*host uids from \([0-9]*\).*/\1/p' | tail -1)
    echo "     $c ran $calls calls, slots from host uid $base"
    [ "$calls" -gt 0 ] || { echo "FAIL: $c ran no call"; exit 1; }
    bases+=("$base")
done
[ ${#bases[@]} -eq 2 ] && [ "${bases[0]}" != "${bases[1]}" ] || { echo "FAIL: workers share a uid block: ${bases[*]}"; exit 1; }
echo "ok   both workers ran calls, each on host uids of its own"

say "down"
compose down -v --remove-orphans >/dev/null 2>&1
# podman-compose can try to remove a container before those that depend on it ("has dependent
# containers"), leaving it and its volume in use: a second `down` takes what the first could not.
[ -z "$(leftovers)" ] || compose down -v --remove-orphans >/dev/null 2>&1
left=$(leftovers)
[ -z "$left" ] || { echo "FAIL: left behind: $left"; exit 1; }
echo "ok   no container, pod, network or volume of the project left"
ended=$(date +%s)
echo "container test passed in $((ended - started)) s (setup and builds $((built - started)) s, stack $((ended - built)) s)"
