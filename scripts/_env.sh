# Sourced by scripts/run and scripts/test: create or reuse .venv and install edgetrain into it.
# Reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EDGETRAIN_VENV:-$root/.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
if [ ! -x "$venv/bin/python" ]; then
  echo "edgetrain: creating virtual environment in $venv" >&2
  "$python" -m venv "$venv"
fi
stamp="$venv/.edgetrain-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "edgetrain: installing dependencies (pinned, CPU build of torch)" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$root[dev]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
