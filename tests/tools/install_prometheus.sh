#!/usr/bin/env bash
# Install what tests/integration/test_prometheus.py needs: a real Prometheus (Debian's prometheus package), which
# the test starts itself, scraping a real server.
exec bash "$(dirname "$0")/install_debian_package.sh" prometheus tests/integration/test_prometheus.py prometheus --version
