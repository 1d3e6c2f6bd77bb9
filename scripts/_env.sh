# Sourced by scripts/run and scripts/test: create or reuse .venv and install edgetrain into it.
#
# * Python: $PYTHON if set, else the first of python3.11, python3.12, python3.13, python3.14,
#   python3 that is 3.11-3.14 (torch 2.13.0 ships wheels for 3.10-3.14; the pinned numpy 2.4 and
#   scipy 1.17 need 3.11). Anything else stops here, in a second, with one line saying what to do.
# * torch's CPU build: if pip's own configuration already offers torch==2.13.0+cpu (a local wheel
#   directory or mirror, as on the CI machine), nothing is added, so an offline install stays
#   offline. Otherwise PyTorch's CPU index is added as an extra index, the way PyTorch's install
#   instructions do (pip then prefers 2.13.0+cpu over PyPI's CUDA build of the same version),
#   after a 10 s reachability check: an unreachable index would otherwise cost pip minutes of
#   retries, or let it fall back to the multi-GB CUDA build. EDGETRAIN_TORCH_INDEX=URL names
#   another index of CPU wheels; EDGETRAIN_TORCH_INDEX= (empty) leaves pip's configuration alone.
# * A venv is complete only once its stamp is written (after a successful install). A venv this
#   script made that has no stamp (a failed or interrupted install) is removed and built again;
#   a failed install removes the venv it was installing into. Reinstalls only when pyproject.toml
#   or the extras asked for (EDGETRAIN_EXTRAS, set by the sourcing script) changed since the last
#   install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EDGETRAIN_VENV:-$root/.venv}"
stamp="$venv/.edgetrain-installed"
marker="$venv/.edgetrain-venv"
torch_cpu="torch==2.13.0+cpu"
torch_cpu_index="https://download.pytorch.org/whl/cpu"
supported="3.11 to 3.14"

_edgetrain_fail() {
  echo "edgetrain: error: $*" >&2
  exit 2
}

_edgetrain_py_version() {
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

_edgetrain_supported() {
  case "$1" in 3.11 | 3.12 | 3.13 | 3.14) return 0 ;; *) return 1 ;; esac
}

_edgetrain_pick_python() {
  local candidate version found=""
  if [ -n "${PYTHON:-}" ]; then
    version="$(_edgetrain_py_version "$PYTHON")" ||
      _edgetrain_fail "PYTHON=$PYTHON does not run; set PYTHON to a Python $supported"
    _edgetrain_supported "$version" ||
      _edgetrain_fail "PYTHON=$PYTHON is Python $version; edgetrain needs Python $supported (torch 2.13.0, numpy 2.4); set PYTHON to one of those"
    echo "$PYTHON"
    return
  fi
  for candidate in python3.11 python3.12 python3.13 python3.14 python3; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    version="$(_edgetrain_py_version "$candidate")" || continue
    if _edgetrain_supported "$version"; then
      echo "$candidate"
      return
    fi
    found="$found${found:+, }$candidate is $version"
  done
  _edgetrain_fail "no Python $supported found (${found:-no python3 on PATH}); install python3.11 (with its venv module) or set PYTHON=/path/to/python3.12"
}

# The pip arguments that make torch the CPU build (printed one per line; none when pip's own
# configuration already provides it).
_edgetrain_torch_index() {
  local py="$1"
  if [ -n "${EDGETRAIN_TORCH_INDEX+set}" ]; then
    [ -z "$EDGETRAIN_TORCH_INDEX" ] || printf '%s\n' --extra-index-url "$EDGETRAIN_TORCH_INDEX"
    return
  fi
  if "$py" -m pip install --dry-run --quiet --ignore-installed --no-deps "$torch_cpu" \
    >/dev/null 2>&1; then
    return
  fi
  if "$py" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" \
    "$torch_cpu_index/torch/" >/dev/null 2>&1; then
    printf '%s\n' --extra-index-url "$torch_cpu_index"
    return
  fi
  _edgetrain_fail "pip offers no $torch_cpu here and $torch_cpu_index (PyTorch's CPU wheels) cannot be reached, so pip would fetch the multi-GB CUDA build; connect to it, or set EDGETRAIN_TORCH_INDEX to a mirror of the CPU wheels (EDGETRAIN_TORCH_INDEX= uses pip's own configuration)"
}

if [ -e "$venv" ] && [ ! -f "$stamp" ]; then
  if [ -f "$marker" ]; then
    echo "edgetrain: removing $venv: its last install did not finish" >&2
    rm -rf "$venv"
  elif [ ! -x "$venv/bin/python" ]; then
    _edgetrain_fail "$venv exists but is not a virtual environment; move it away or set EDGETRAIN_VENV to another directory"
  fi
fi
if [ -x "$venv/bin/python" ]; then
  version="$(_edgetrain_py_version "$venv/bin/python")" || version="broken"
  if ! _edgetrain_supported "$version"; then
    if [ -f "$stamp" ] || [ -f "$marker" ]; then
      echo "edgetrain: removing $venv: it was made with Python $version" >&2
      rm -rf "$venv"
    else
      _edgetrain_fail "$venv runs Python $version; edgetrain needs Python $supported; set EDGETRAIN_VENV to another directory"
    fi
  fi
fi
# The stamp holds pyproject.toml's hash and the extras installed with it; a script that needs
# no more extras than were installed (scripts/run after scripts/test) installs nothing.
extras="${EDGETRAIN_EXTRAS:-dev,insitu,zoo}" # what the sourcing script needs (scripts/run: insitu)
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
_edgetrain_installed() {
  local have extra
  [ -f "$stamp" ] && [ "$(head -n 1 "$stamp")" = "$want" ] || return 1
  have=",$(sed -n 2p "$stamp"),"
  for extra in ${extras//,/ }; do
    case "$have" in *",$extra,"*) ;; *) return 1 ;; esac
  done
}
if ! _edgetrain_installed; then
  if [ -f "$stamp" ] && [ "$(head -n 1 "$stamp")" = "$want" ]; then
    extras="$extras,$(sed -n 2p "$stamp")" # keep what is installed: add, never flip-flop
  fi
  if [ ! -x "$venv/bin/python" ]; then
    python="$(_edgetrain_pick_python)" || exit $?
    echo "edgetrain: creating virtual environment in $venv with $python" \
      "($(_edgetrain_py_version "$python"))" >&2
    mkdir -p "$venv"
    : >"$marker" # made here: removed again if anything below fails
    if ! "$python" -m venv "$venv" || [ ! -x "$venv/bin/python" ]; then
      rm -rf "$venv"
      _edgetrain_fail "$python -m venv failed (above); install its venv module (e.g. apt install python3.11-venv) and run again"
    fi
  fi
  rm -f "$stamp"                  # incomplete until the install below succeeds
  if ! index="$(_edgetrain_torch_index "$venv/bin/python")"; then
    if [ -f "$marker" ]; then rm -rf "$venv"; fi
    exit 2
  fi
  echo "edgetrain: installing dependencies (pinned, CPU build of torch${index:+ from ${index#*$'\n'}})" >&2
  # shellcheck disable=SC2086  # $index is zero or two words without spaces
  if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    ${index//$'\n'/ } -e "$root[$extras]"; then
    if [ -f "$marker" ]; then
      rm -rf "$venv"
      _edgetrain_fail "installing the dependencies failed (pip's output above); removed the incomplete $venv, run again once fixed"
    fi
    _edgetrain_fail "installing the dependencies failed (pip's output above); $venv is marked incomplete and the next run installs again"
  fi
  printf '%s\n%s\n' "$want" "$extras" >"$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
