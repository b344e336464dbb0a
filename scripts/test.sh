#!/usr/bin/env bash
# Set up (idempotent), then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    cat <<'USAGE'
usage: scripts/test.sh [PYTEST ARGS...]
       scripts/test.sh -- [PYTEST ARGS...]    (everything after -- goes to pytest, -h included)

Sets up first (scripts/setup.sh: Debian packages, kubectl, .venv, torch, Mooncake and this
package with its extras; what is already in place is skipped), then runs
`.venv/bin/python -m pytest PYTEST ARGS...` from the repository root: the whole suite
(tests/) without arguments.

  scripts/test.sh                          # everything
  scripts/test.sh tests/disagg -x -q       # one folder, stop at the first failure
  scripts/test.sh -k bench -m "not slow"   # by name, without the slow tests
  scripts/test.sh -- --help                # pytest's own help
USAGE
}

case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    --) shift ;;
esac
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
