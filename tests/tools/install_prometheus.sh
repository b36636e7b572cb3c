#!/usr/bin/env bash
# Install what tests/integration/test_prometheus.py needs: a real Prometheus (Debian's prometheus package), which
# the test starts itself, scraping a real server. Its service is not started here. Idempotent; where it cannot
# install (no root, no apt), it says why and exits 0, and the test is skipped with that reason.
set -u
warn() { echo "prometheus: not installed ($1); tests/integration/test_prometheus.py will be skipped" >&2; exit 0; }
command -v prometheus >/dev/null && { echo "prometheus: $(prometheus --version 2>&1 | head -1)"; exit 0; }
[ "$(id -u)" = 0 ] || warn "installing it needs root"
command -v apt-get >/dev/null || warn "no apt-get"
# policy-rc.d 101: the package's service is not started (the test runs its own Prometheus on a free port).
policy=/usr/sbin/policy-rc.d
made_policy=0
[ -e $policy ] || { printf '#!/bin/sh\nexit 101\n' >$policy && chmod +x $policy && made_policy=1; }
(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
  >/dev/null 2>&1
installed=$?
[ $made_policy = 1 ] && rm -f $policy
[ $installed = 0 ] || warn "apt-get install prometheus failed"
echo "prometheus: installed $(prometheus --version 2>&1 | head -1)"
