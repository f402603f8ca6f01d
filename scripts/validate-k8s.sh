#!/usr/bin/env bash
# Offline validation of the Kubernetes manifests in deploy/k8s/ (no cluster, no kubectl):
#   * built-in kinds (Service, ...) with PyPI's kubernetes-validate --strict, whose wheel bundles
#     the Kubernetes OpenAPI schemas (-k $K8S_VERSION, default 1.33);
#   * custom resources (LeaderWorkerSet, InferencePool, HTTPRoute) with scripts/crdcheck.py against
#     the openAPIV3Schema of the CRDs vendored in deploy/k8s/crds/ (see the README there);
#   * a document that neither knows (a misspelt kind, a CRD not vendored) is an error.
# Not checked: CEL rules (x-kubernetes-validations), defaulting, admission webhooks, and whatever
# only a running cluster knows (the LWS webhook's env injection, DNS, GPUs, images).
#
#   scripts/validate-k8s.sh               validate deploy/k8s/*.yaml
#   scripts/validate-k8s.sh FILE...       validate these files
#   scripts/validate-k8s.sh --self-test   validate, then check that broken copies are rejected
#
# The validators live in a venv, ${OMNI_K8S_VENV:-target/k8s-venv}, created on first use.
# Exit status: 0 valid; 1 invalid (or a broken copy was accepted); 3 the validators could not be
# installed (PyPI unreachable: scripts/test.sh then skips with a warning).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${OMNI_K8S_VENV:-target/k8s-venv}"
K8S_VERSION="${K8S_VERSION:-1.33}"
KUBERNETES_VALIDATE="kubernetes-validate==1.37.0"
PY="$VENV/bin/python"
CRD_ARGS=()
for f in deploy/k8s/crds/*.yaml; do
    CRD_ARGS+=(--crd "$f")
done

setup() {
    if "$PY" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
        return 0
    fi
    echo "validate-k8s: installing $KUBERNETES_VALIDATE into $VENV" >&2
    python3 -m venv "$VENV" >&2 &&
        "$VENV/bin/pip" install --quiet --disable-pip-version-check --timeout 20 --retries 1 \
            "$KUBERNETES_VALIDATE" pyyaml >&2
}

# validate FILE...: prints both validators' findings; returns 1 on any error.
validate() {
    local kv crd rc=0 file kind api
    kv=$("$VENV/bin/kubernetes-validate" -k "$K8S_VERSION" --strict "$@" 2>&1) || rc=1
    crd=$("$PY" scripts/crdcheck.py "${CRD_ARGS[@]}" "$@" 2>&1) || rc=1
    printf '%s\n%s\n' "$kv" "$crd"
    # kubernetes-validate only warns about kinds it has no schema for: each must be a custom
    # resource that crdcheck checked.
    while read -r file kind api; do
        if ! grep -qF -e "ok $file $api $kind/" -e "ERROR $file $api $kind/" <<<"$crd"; then
            echo "ERROR $file: no schema for kind $kind in $api (not a built-in kind of" \
                "Kubernetes $K8S_VERSION, and no CRD in deploy/k8s/crds/)"
            rc=1
        fi
    done < <(sed -nE "s/^WARN ([^ ]+) Couldn't find schema for kind ([^ ]+) with api version ([^ ]+) .*/\1 \2 \3/p" <<<"$kv")
    return $rc
}

# Writes broken copies of the manifests under $1/<case>/ and prints one line per case:
# <case> <file> <text the rejection must contain>. Each case breaks one thing.
make_mutants() {
    "$PY" - "$1" <<'PY'
import os, sys, yaml
out = sys.argv[1]

def load(name):
    with open(f"deploy/k8s/{name}") as f:
        return list(yaml.safe_load_all(f))

def write(case, name, docs, expect):
    os.makedirs(f"{out}/{case}")
    path = f"{out}/{case}/{name}"
    with open(path, "w") as f:
        if isinstance(docs, str):
            f.write(docs)
        else:
            yaml.safe_dump_all(docs, f, sort_keys=False)
    print(case, path, expect)

d = load("lws.yaml")
d[0]["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RestartAll"
write("lws-restart-policy", "lws.yaml", d, "restartPolicy: 'RestartAll' is not one of")

d = load("lws.yaml")
d[0]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["gpus"] = 2
write("lws-container-unknown-field", "lws.yaml", d, "containers[0].gpus: unknown field")

d = load("lws.yaml")
d[1]["spec"]["ports"][0]["port"] = "8000"
write("service-string-port", "lws.yaml", d, "spec.ports.0.port: '8000' is not of type 'integer'")

d = load("inferencepool.yaml")
d[0]["spec"]["targetPortNumber"] = 8000
write("pool-unknown-field", "inferencepool.yaml", d, "spec.targetPortNumber: unknown field")

d = load("inferencepool.yaml")
d[1]["kind"] = "Servic"
write("unknown-kind", "inferencepool.yaml", d, "no schema for kind Servic")

d = load("httproute.yaml")
d[0]["spec"]["rules"][0]["backendRefs"][0]["weight"] = -1
write("route-negative-weight", "httproute.yaml", d, "weight: -1 is below the minimum 0")

with open("deploy/k8s/httproute.yaml") as f:
    text = f.read()
write("route-duplicate-key", "httproute.yaml",
      text.replace("  name: omni\n", "  name: omni\n  name: omni-2\n", 1), "duplicate key 'name'")
PY
}

self_test() {
    local case file expect out failed=0 n=0
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    make_mutants "$TMP/cases" >"$TMP/list"
    while read -r case file expect; do
        n=$((n + 1))
        if out=$(validate "$file" </dev/null); then
            echo "self-test FAILED: $case: the broken copy was accepted" >&2
            failed=1
        elif ! grep -qF -- "$expect" <<<"$out"; then
            echo "self-test FAILED: $case: rejected, but not with \"$expect\":" >&2
            echo "$out" >&2
            failed=1
        else
            echo "self-test ok: $case rejected ($expect)"
        fi
    done <"$TMP/list"
    if [ "$n" -eq 0 ]; then
        echo "self-test FAILED: no broken copies were made" >&2
        return 1
    fi
    return $failed
}

SELF_TEST=0
FILES=()
for a in "$@"; do
    case "$a" in
        --self-test) SELF_TEST=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *) FILES+=("$a") ;;
    esac
done
if [ "${#FILES[@]}" -eq 0 ]; then
    FILES=(deploy/k8s/lws.yaml deploy/k8s/inferencepool.yaml deploy/k8s/httproute.yaml)
fi

if ! setup; then
    echo "validate-k8s: could not create $VENV with $KUBERNETES_VALIDATE (is PyPI reachable?" \
        "is python3-venv installed?)" >&2
    exit 3
fi
validate "${FILES[@]}"
echo "validate-k8s: ${FILES[*]} valid (Kubernetes $K8S_VERSION; CEL rules and defaulting not checked)"
if [ "$SELF_TEST" -eq 1 ]; then
    self_test
    echo "validate-k8s: self-test passed"
fi
