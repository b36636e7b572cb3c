#!/usr/bin/env bash
# Install what tests/e2e/test_haproxy.py needs: a real HAProxy (Debian's haproxy package), which the test starts
# itself with deploy/haproxy/haproxy.cfg in front of real servers.
exec bash "$(dirname "$0")/install_debian_package.sh" haproxy tests/e2e/test_haproxy.py haproxy -v
