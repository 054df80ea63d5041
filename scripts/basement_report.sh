#!/usr/bin/env bash
# The shape of the basement (issue #25), for a before/after: line counts of specflow/ per
# package, the import circles inside specflow/ (tests/test_layering.py's finder: every
# import, type-only and lazy ones included), the `type: ignore`s in specflow/ and stages/,
# and `duplicates` (the library's tool, when on PATH) over specflow/ and stages/.
#
#   bash scripts/basement_report.sh [TREE]      # TREE: a checkout (default: this one)
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
TREE=$(cd "${1:-$HERE}" && pwd)
PY=${PY:-$HERE/.venv/bin/python}
cd "$TREE"
echo "# $(git rev-parse --short HEAD 2>/dev/null || echo '?') $TREE"
echo "## specflow/ lines (.py)"
echo "total: $(find specflow -name '*.py' -print0 | xargs -0 cat | wc -l)"
for d in $(find specflow -type d -not -name __pycache__ | sort); do
  n=$(find "$d" -maxdepth 1 -name '*.py' -print0 | xargs -0 -r cat | wc -l)
  [ "$n" -gt 0 ] && echo "$d: $n"
done
echo "## import circles in specflow/"
"$PY" - "$TREE" "$HERE" <<'PYEOF'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.test_layering import import_circles, import_graph
circles = import_circles(import_graph(Path(sys.argv[1])))
print(f"{len(circles)} circle(s)")
for c in circles:
    print("  " + " <-> ".join(c))
PYEOF
echo "## type: ignore (specflow/ stages/)"
echo "total: $(grep -r 'type: ignore' specflow stages --include='*.py' | wc -l)"
grep -rc 'type: ignore' specflow stages --include='*.py' | grep -v ':0$' || true
if command -v duplicates > /dev/null; then
  for d in specflow stages; do
    echo "## duplicates --repo $d"
    duplicates --repo "$d" --most 200
  done
fi
