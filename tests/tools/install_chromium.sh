#!/usr/bin/env bash
# Install what tests/project/test_pages_in_a_browser.py (and the reports' checks) need: Debian's chromium, which the
# tests start headless to see the docs site and the HTML reports as a person would.
exec bash "$(dirname "$0")/install_debian_package.sh" chromium tests/project/test_pages_in_a_browser.py chromium --version
