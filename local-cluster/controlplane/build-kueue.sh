#!/usr/bin/env bash
# Builds Kueue from its Go module (sigs.k8s.io/kueue, pinned in kueue/go.mod) and copies
# its CRDs beside the binary. Kueue pins older k8s.io modules than the control plane and
# imports kube-scheduler internals, so it builds in its own wrapper module.
#
# The result goes to a cache outside the repository, keyed by the version, and is
# reused when present. Prints the directory on stdout as its last line.
#
# Environment: MUSTER_CACHE (default ~/.cache/muster).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MUSTER_CACHE:-$HOME/.cache/muster}

version=$(sed -n 's#^[[:space:]]*\(require[[:space:]]*\)\{0,1\}sigs.k8s.io/kueue \(v[0-9.]*\).*#\2#p' "$here/kueue/go.mod" | head -n1)
[ -n "$version" ] || { echo "cannot read the Kueue version from kueue/go.mod" >&2; exit 1; }

dir="$cache/kueue/$version"
if [ -f "$dir/.complete" ]; then
  echo "$dir"
  exit 0
fi

command -v go >/dev/null || { echo "the Go toolchain is needed to build Kueue" >&2; exit 1; }
mkdir -p "$dir"
export GOFLAGS="${GOFLAGS:-} -buildvcs=false"
export CGO_ENABLED=0
start=$(date +%s)

echo "building kueue $version" >&2
(cd "$here/kueue" && go build -p 2 -trimpath -ldflags "-s -w" -o "$dir/kueue" sigs.k8s.io/kueue/cmd/kueue)

module=$(cd "$here/kueue" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
rm -rf "$dir/crds"
mkdir -p "$dir/crds"
cp "$module"/config/components/crd/bases/*.yaml "$dir/crds/"
chmod -R u+w "$dir/crds"

printf '%s\n' "$version" > "$dir/.complete"
echo "kueue built in $(( $(date +%s) - start ))s" >&2
echo "$dir"
