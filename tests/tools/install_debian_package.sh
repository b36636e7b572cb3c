#!/usr/bin/env bash
# install_debian_package.sh PACKAGE TEST VERSION-COMMAND...: Debian's PACKAGE for TEST, which starts the program
# itself; the package's service is not started. Idempotent; where it cannot install (no root, no apt), it says why
# and exits 0, and TEST is skipped with that reason.
set -u
package=$1 test=$2
shift 2
warn() { echo "$package: not installed ($1); $test will be skipped" >&2; exit 0; }
command -v "$package" >/dev/null && { echo "$package: $("$@" 2>&1 | head -1)"; exit 0; }
[ "$(id -u)" = 0 ] || warn "installing it needs root"
command -v apt-get >/dev/null || warn "no apt-get"
# policy-rc.d 101: the package's service is not started (the test runs its own, on free ports).
policy=/usr/sbin/policy-rc.d
made_policy=0
[ -e $policy ] || { printf '#!/bin/sh\nexit 101\n' >$policy && chmod +x $policy && made_policy=1; }
(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package") \
  >/dev/null 2>&1
installed=$?
[ $made_policy = 1 ] && rm -f $policy
[ $installed = 0 ] || warn "apt-get install $package failed"
echo "$package: installed $("$@" 2>&1 | head -1)"
