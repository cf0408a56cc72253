# Sourced by scripts/quickstart and scripts/test: create or reuse .venv and install arpo into it.
# ARPO_EXTRAS names the extras to install (comma-separated; unset or empty: none). scripts/test asks for dev (pytest,
# ruff, MkDocs), the quickstart for none. Idempotent: the install runs again only when pyproject.toml changed since the
# last successful one, or when an extra is asked for that the environment does not have yet. The stamp records the
# extras installed; a reinstall keeps them, so a quickstart after ./scripts/test neither drops nor reinstalls dev.
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
HASH="$(sha256sum < "$ROOT/pyproject.toml" | cut -c1-16)"
# stamp: "<pyproject hash> <extras installed, comma-separated>"; a stamp of an older format reads as nothing installed
HAVE_HASH="" HAVE_EXTRAS=""
[ -f "$STAMP" ] && read -r HAVE_HASH HAVE_EXTRAS < "$STAMP" || true  # no stamp yet: nothing installed
[ "${HAVE_HASH:-}" = "$HASH" ] || HAVE_EXTRAS=""
WANTED="${ARPO_EXTRAS:-}"
NEED=""
for extra in ${WANTED//,/ }; do
  case ",${HAVE_EXTRAS:-}," in *",$extra,"*) ;; *) NEED="${NEED:+$NEED,}$extra" ;; esac
done
if [ "${HAVE_HASH:-}" != "$HASH" ] || [ -n "$NEED" ]; then
  EXTRAS="$(printf '%s\n' ${HAVE_EXTRAS//,/ } ${NEED//,/ } | sort -u | paste -sd, -)"
  echo "[arpo] installing arpo${EXTRAS:+[$EXTRAS]} and its dependencies into $VENV"
  python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
  # torch first, pinned: on CPU machines this resolves to the CPU build instead of pulling CUDA wheels.
  python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  python -m pip install -q --disable-pip-version-check -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  echo "$HASH $EXTRAS" > "$STAMP"
fi
cd "$ROOT"
