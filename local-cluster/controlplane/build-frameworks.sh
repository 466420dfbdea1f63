#!/usr/bin/env bash
# Builds the training frameworks' controller managers from their Go modules: JobSet
# (sigs.k8s.io/jobset) and Kubeflow Trainer (github.com/kubeflow/trainer/v2), pinned in
# frameworks/go.mod, and copies their CRDs beside the binaries. Trainer depends on JobSet
# and both pin the same k8s.io modules, so one wrapper module builds both in one `go
# build`, compiling their shared dependencies once.
#
# The result goes to a cache outside the repository, keyed by both versions, and is
# reused when present. Prints the directory on stdout as its last line.
#
# Environment: MUSTER_CACHE (default ~/.cache/muster).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MUSTER_CACHE:-$HOME/.cache/muster}

module_version() {
  sed -n "s#^[[:space:]]*\(require[[:space:]]*\)\{0,1\}$1 \(v[0-9.]*\).*#\2#p" "$here/frameworks/go.mod" | head -n1
}
jobset=$(module_version sigs.k8s.io/jobset)
trainer=$(module_version github.com/kubeflow/trainer/v2)
[ -n "$jobset" ] && [ -n "$trainer" ] || { echo "cannot read the JobSet and Trainer versions from frameworks/go.mod" >&2; exit 1; }

dir="$cache/frameworks/jobset-$jobset-trainer-$trainer"
if [ -f "$dir/.complete" ]; then
  echo "$dir"
  exit 0
fi

command -v go >/dev/null || { echo "the Go toolchain is needed to build JobSet and Trainer" >&2; exit 1; }
mkdir -p "$dir"
export GOFLAGS="${GOFLAGS:-} -buildvcs=false"
export CGO_ENABLED=0
start=$(date +%s)

echo "building jobset $jobset and trainer $trainer" >&2
(cd "$here/frameworks" && go build -p 2 -trimpath -ldflags "-s -w" -o "$dir/" \
  sigs.k8s.io/jobset github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager)
# `go build -o DIR/` names each binary after its package's last element.
[ -x "$dir/jobset" ] && [ -x "$dir/trainer-controller-manager" ] \
  || { echo "the build did not produce jobset and trainer-controller-manager" >&2; exit 1; }

rm -rf "$dir/crds"
mkdir -p "$dir/crds"
jobset_dir=$(cd "$here/frameworks" && go list -m -f '{{.Dir}}' sigs.k8s.io/jobset)
trainer_dir=$(cd "$here/frameworks" && go list -m -f '{{.Dir}}' github.com/kubeflow/trainer/v2)
cp "$jobset_dir"/config/components/crd/bases/*.yaml "$dir/crds/"
cp "$trainer_dir"/manifests/base/crds/trainer.kubeflow.org_*.yaml "$dir/crds/"
chmod -R u+w "$dir/crds"

printf 'jobset %s\ntrainer %s\n' "$jobset" "$trainer" > "$dir/.complete"
echo "jobset and trainer built in $(( $(date +%s) - start ))s" >&2
echo "$dir"
