# Sourced by scripts/quickstart and scripts/test: create or reuse .venv and install arpo into it.
# Idempotent: the install runs again only when pyproject.toml changed since the last successful one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ARPO_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "[arpo] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.arpo-install-stamp"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-${ARPO_EXTRAS:-dev}"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[arpo] installing arpo and its dependencies into $VENV"
  python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
  # torch first, pinned: on CPU machines this resolves to the CPU build instead of pulling CUDA wheels.
  python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  python -m pip install -q --disable-pip-version-check -e "$ROOT[${ARPO_EXTRAS:-dev}]"
  echo "$WANT" > "$STAMP"
fi
cd "$ROOT"
