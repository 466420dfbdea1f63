#!/usr/bin/env bash
# Builds the local control plane from the official Go modules: kube-apiserver,
# kube-controller-manager, kube-scheduler and kubectl (k8s.io/kubernetes), etcd
# (go.etcd.io/etcd/server/v3) and kwok (sigs.k8s.io/kwok), plus kwok's stage files.
#
# The binaries go to a cache outside the repository, keyed by the versions, and are
# reused when present. Prints the binary directory on stdout as its last line.
#
# Environment: MUSTER_CACHE (default ~/.cache/muster).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${MUSTER_CACHE:-$HOME/.cache/muster}

# The versions are the ones pinned in the wrapper modules.
k8s_version=$(sed -n 's#^[[:space:]]*k8s.io/kubernetes \(v[0-9.]*\).*#\1#p' "$here/k8s/go.mod" | head -n1)
etcd_version=$(sed -n 's#^[[:space:]]*go.etcd.io/etcd/server/v3 \(v[0-9.]*\).*#\1#p' "$here/etcd/go.mod" | head -n1)
kwok_version=v0.8.0
[ -n "$k8s_version" ] && [ -n "$etcd_version" ] || { echo "cannot read versions from the wrapper modules" >&2; exit 1; }

bin="$cache/controlplane/k8s-$k8s_version-etcd-$etcd_version-kwok-$kwok_version"
if [ -f "$bin/.complete" ]; then
  echo "$bin"
  exit 0
fi

command -v go >/dev/null || { echo "the Go toolchain is needed to build the control plane" >&2; exit 1; }
mkdir -p "$bin"
# Keep Go's caches outside the repository as well; reuse the user's when set.
export GOFLAGS="${GOFLAGS:-} -buildvcs=false"
export CGO_ENABLED=0
start=$(date +%s)

minor=${k8s_version#v1.}; minor=${minor%%.*}
ldflags="-s -w \
 -X k8s.io/component-base/version.gitVersion=$k8s_version \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=$minor \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version \
 -X k8s.io/client-go/pkg/version.gitMajor=1 \
 -X k8s.io/client-go/pkg/version.gitMinor=$minor"

echo "building kubernetes $k8s_version (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl)" >&2
# One go build invocation shares the compiled packages between the four commands.
# -p 2: two cores; more parallel compiles only add memory pressure.
(cd "$here/k8s" && go build -p 2 -trimpath -ldflags "$ldflags" -o "$bin/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl)

echo "building etcd $etcd_version" >&2
(cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3)

echo "building kwok $kwok_version" >&2
GOBIN="$bin" GOFLAGS=-buildvcs=false go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$kwok_version"
kwok_dir=$(GOFLAGS= go mod download -json "sigs.k8s.io/kwok@$kwok_version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
rm -rf "$bin/stages"
mkdir -p "$bin/stages"
cp -r "$kwok_dir/kustomize/stage/node" "$kwok_dir/kustomize/stage/pod" "$bin/stages/"
chmod -R u+w "$bin/stages"

"$bin/kube-apiserver" --version >&2
"$bin/etcd" --version 2>&1 | sed -n 1p >&2
printf '%s\n' "$k8s_version" > "$bin/.complete"
echo "control plane built in $(( $(date +%s) - start ))s" >&2
echo "$bin"
