#!/usr/bin/env bash
# The test suite as CI runs it (README "Quick start", command 2; `.ci/run` calls this script and nothing else),
# on a fresh machine:
#   1. Debian's chromium for the test that renders the audit's HTML report in a real headless browser
#      (apt-get, with sudo when not root), when no chromium is on PATH;
#   2. a venv in .venv with the CPU torch wheel pinned, and the project with its test extras;
#   3. pytest, with CKPTTOOL_REQUIRE_CHROMIUM=1: the browser test fails instead of skipping when chromium is
#      missing. Where chromium cannot be installed, CKPTTOOL_REQUIRE_CHROMIUM=0 lets that one test skip.
# Arguments are passed to pytest: `bash scripts/test.sh tests/test_audit_cli.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  if command -v apt-get >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
  else
    echo "scripts/test.sh: no chromium on PATH and no apt-get to install it; the HTML report test will fail" \
         "(install chromium, or set CKPTTOOL_REQUIRE_CHROMIUM=0 to skip that test)" >&2
  fi
fi
export CKPTTOOL_REQUIRE_CHROMIUM="${CKPTTOOL_REQUIRE_CHROMIUM:-1}"

python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
pip install -q -c .ci/constraints.txt -e ".[test]"
# Two workers (pytest-xdist), one per core of CI's machine: each test module is a unit of work, and the tests that
# start several processes at once run on one worker one after another, first (tests/conftest.py,
# pytest_xdist_make_scheduler). CKPTTOOL_TEST_WORKERS=0 runs everything in one process, as before.
# The 25 slowest tests are listed at the end, so that a CI log shows where the suite's time goes.
pytest -q -n "${CKPTTOOL_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
