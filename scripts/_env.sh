# Sourced by scripts/run and scripts/test: chooses the Python environment, installs what is
# missing, and builds nimble_train into it. Every step is skipped when already done.

NT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The torch installed when the environment has none. The extension builds against whichever
# torch is there (2.11 or newer); a CUDA build of torch is what lets the CUDA sources compile.
NT_TORCH_SPEC=${NT_TORCH_SPEC:-torch>=2.11}

nt_log() { printf '[nimble_train] %s\n' "$*" >&2; }

# The active virtual environment; else ${NT_VENV:-~/.venvs/nimble_train}, created on first use.
# It lives outside the checkout, so fresh clones (and CI) reuse it.
nt_python_env() {
  if [ -z "${VIRTUAL_ENV:-}" ]; then
    local venv=${NT_VENV:-$HOME/.venvs/nimble_train}
    if [ ! -x "$venv/bin/python" ]; then
      nt_log "creating the virtual environment $venv"
      python3 -m venv "$venv" ||
        { nt_log "python3 -m venv failed: install python3-venv"; return 1; }
    fi
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
  fi
  nt_log "python: $(command -v python) ($(python --version 2>&1))"
}

# nt_pip_ensure MODULE SPEC: pip install SPEC unless `import MODULE` already works.
nt_pip_ensure() {
  python -c "import $1" 2>/dev/null && return 0
  nt_log "installing $2"
  python -m pip install --quiet "$2"
}

nt_install_build_deps() {
  nt_pip_ensure torch "$NT_TORCH_SPEC" &&
    nt_pip_ensure scikit_build_core "scikit-build-core>=0.10" || return 1
  command -v ninja >/dev/null || nt_pip_ensure ninja ninja || return 1
  if ! python - <<'PY' 2>/dev/null; then
import re, subprocess, sys
out = subprocess.run(["cmake", "--version"], capture_output=True, text=True).stdout
v = tuple(int(x) for x in re.search(r"(\d+)\.(\d+)", out).groups())
sys.exit(0 if v >= (3, 24) else 1)
PY
    nt_log "installing cmake>=3.24 (none on PATH, or too old)"
    python -m pip install --quiet "cmake>=3.24" || return 1
  fi
}

# GoogleTest headers and libraries, from Debian's libgtest-dev.
nt_ensure_gtest() {
  [ -f /usr/include/gtest/gtest.h ] && return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  nt_log "installing libgtest-dev (apt-get)"
  $sudo apt-get update -qq && $sudo apt-get install -y -qq libgtest-dev >/dev/null || {
    nt_log "could not install libgtest-dev; install it with: sudo apt-get install libgtest-dev"
    return 1
  }
}

# nt_build BUILD_DIR [-Ccmake.define.X=Y ...]: builds the extension into the environment
# (editable: Python sources are used in place). CMake rebuilds only what changed.
nt_build() {
  local build_dir=$1
  shift
  nt_log "building nimble_train (build/$build_dir)"
  (cd "$NT_ROOT" && python -m pip install --quiet --no-build-isolation --no-deps -e . \
    "-Cbuild-dir=build/$build_dir" "$@") || {
    nt_log "the build failed; the CMake log is above, the build tree in build/$build_dir"
    return 1
  }
}
