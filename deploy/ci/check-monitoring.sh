#!/usr/bin/env bash
# The monitoring files, checked with Prometheus's own promtool (Debian's, unpacked, not installed):
# the alert rules' syntax and their unit tests (deploy/prometheus/alerts.test.yml), the scrape
# config's syntax, and the Grafana dashboard's JSON being what deploy/grafana/dashboard.py writes.
# tests/test_monitoring.py then runs a real Prometheus against a real service with both.
set -euo pipefail
source "$(dirname "$0")/../../scripts/bootstrap.sh"
cd "$ROOT"
debian_binaries prometheus
promtool check rules deploy/prometheus/alerts.yml
(cd deploy/prometheus && promtool test rules alerts.test.yml)
promtool check config --syntax-only deploy/prometheus/prometheus.yml
python3 - <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("dashboard", "deploy/grafana/dashboard.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
if open("deploy/grafana/codeenv.json").read() != module.render():
    sys.exit("deploy/grafana/codeenv.json is not what deploy/grafana/dashboard.py writes: run it")
print("deploy/grafana/codeenv.json: as dashboard.py writes it")
PY
