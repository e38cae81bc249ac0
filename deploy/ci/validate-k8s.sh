#!/usr/bin/env bash
# Validate deploy/k8s against the Kubernetes API schemas, offline: kubernetes-validate (PyPI) ships
# the JSON schemas of each Kubernetes version. Strict: unknown fields fail.
set -euo pipefail
source "$(dirname "$0")/../../scripts/bootstrap.sh"
cd "$ROOT"
CI_DIR="${CODEENV_CI_DIR:-/var/tmp/codeenv-ci}"
# 1.30: the oldest that can run the worker (feature gate); 1.33: user namespaces on by default.
K8S_VERSIONS="${CODEENV_K8S_VERSIONS:-1.30.0 1.33.0}"
bootstrap
if [ ! -x "$CI_DIR/tools/bin/kubernetes-validate" ]; then
    [ -x "$CI_DIR/tools/bin/pip" ] || { mkdir -p "$CI_DIR"; "$VENV/bin/python" -m venv "$CI_DIR/tools"; }
    "$CI_DIR/tools/bin/pip" install -q --disable-pip-version-check "kubernetes-validate>=1.30"
fi
validate() {
    for version in $K8S_VERSIONS; do
        "$CI_DIR/tools/bin/kubernetes-validate" --strict --quiet -k "$version" "$@" || return 1
    done
}

manifests=()
for f in deploy/k8s/*.yaml; do
    [ "$(basename "$f")" = kustomization.yaml ] || manifests+=("$f")
    grep -qx "  - $(basename "$f")" deploy/k8s/kustomization.yaml || [ "$(basename "$f")" = kustomization.yaml ] \
        || { echo "FAIL: $f is not in deploy/k8s/kustomization.yaml"; exit 1; }
done
validate "${manifests[@]}"
# The checker must refuse what the API server would: a misspelt field.
bad="$(mktemp --suffix=.yaml)"
trap 'rm -f "$bad"' EXIT
sed 's/readinessProbe:/readinesProbe:/' deploy/k8s/gateway.yaml > "$bad"
if validate "$bad" >/dev/null 2>&1; then
    echo "FAIL: kubernetes-validate accepted a misspelt field"; exit 1
fi
echo "ok   ${#manifests[@]} Kubernetes manifests valid against the schemas of Kubernetes $K8S_VERSIONS (strict, offline)"
