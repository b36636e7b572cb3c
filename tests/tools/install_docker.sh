#!/usr/bin/env bash
# Install what tests/test_compose.py needs: a Docker engine (Debian's docker.io), Compose
# (Debian's docker-compose 1.29, unless `docker compose` v2 is already there) and debootstrap
# (the test builds its own base image: no registry can be reached). The engine is not started
# here; the test starts its own daemon and stops it. Idempotent; where it cannot install (no root,
# no apt), it says why and exits 0, and the test is skipped.
set -u
warn() { echo "docker: not installed ($1); tests/test_compose.py will be skipped" >&2; exit 0; }
need=()
command -v dockerd >/dev/null || need+=(docker.io)
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
[ ${#need[@]} = 0 ] && { echo "docker: engine, compose and debootstrap already installed"; exit 0; }
[ "$(id -u)" = 0 ] || warn "installing ${need[*]} needs root"
command -v apt-get >/dev/null || warn "no apt-get"
(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}") \
  >/dev/null 2>&1 || warn "apt-get install ${need[*]} failed"
echo "docker: installed ${need[*]}"
