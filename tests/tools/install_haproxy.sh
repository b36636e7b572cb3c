#!/usr/bin/env bash
# Install what tests/e2e/test_haproxy.py needs: a real HAProxy (Debian's haproxy package), which the test starts
# itself with deploy/haproxy/haproxy.cfg in front of real servers. Its service is not started here. Idempotent;
# where it cannot install (no root, no apt), it says why and exits 0, and the test is skipped with that reason.
set -u
warn() { echo "haproxy: not installed ($1); tests/e2e/test_haproxy.py will be skipped" >&2; exit 0; }
command -v haproxy >/dev/null && { echo "haproxy: $(haproxy -v 2>&1 | head -1)"; exit 0; }
[ "$(id -u)" = 0 ] || warn "installing it needs root"
command -v apt-get >/dev/null || warn "no apt-get"
# policy-rc.d 101: the package's service is not started (the test runs its own HAProxy on free ports).
policy=/usr/sbin/policy-rc.d
made_policy=0
[ -e $policy ] || { printf '#!/bin/sh\nexit 101\n' >$policy && chmod +x $policy && made_policy=1; }
(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy) \
  >/dev/null 2>&1
installed=$?
[ $made_policy = 1 ] && rm -f $policy
[ $installed = 0 ] || warn "apt-get install haproxy failed"
echo "haproxy: installed $(haproxy -v 2>&1 | head -1)"
