//! The Helm chart (`charts/muster`) rendered with `scripts/helm template`, for tests that
//! check what it would create against the local control plane.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use muster_local_cluster::paths;

/// Release name the chart is rendered with.
pub const RELEASE: &str = "muster";
/// Namespace [`render`] renders into.
pub const NAMESPACE: &str = "muster-system";

/// How to render the chart.
#[derive(Clone, Debug)]
pub struct RenderOptions<'a> {
    /// `--namespace`: the release namespace.
    pub namespace: &'a str,
    /// `--kube-version`; `None` means the local control plane's version.
    pub kube_version: Option<&'a str>,
    /// `--api-versions`: APIs the cluster is assumed to serve beyond the built-in ones.
    pub api_versions: &'a [&'a str],
    /// `--set` values, `key=value` each.
    pub set: &'a [(&'a str, &'a str)],
}

impl Default for RenderOptions<'_> {
    fn default() -> Self {
        RenderOptions {
            namespace: NAMESPACE,
            kube_version: None,
            api_versions: &[],
            set: &[],
        }
    }
}

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    paths::crate_dir().parent().map(PathBuf::from).unwrap_or_default()
}

/// The Kubernetes version of the local control plane (`v1.37.1`): the `k8s.io/kubernetes`
/// requirement of the control-plane wrapper module, as `local-cluster/controlplane/build.sh` reads it.
pub fn control_plane_kube_version() -> Result<String> {
    let go_mod = paths::crate_dir().join("controlplane").join("k8s").join("go.mod");
    let text = std::fs::read_to_string(&go_mod).with_context(|| format!("reading {}", go_mod.display()))?;
    text.lines()
        .filter_map(|line| line.trim().strip_prefix("k8s.io/kubernetes "))
        .filter_map(|rest| rest.split_whitespace().next())
        .find(|version| version.starts_with('v'))
        .map(str::to_string)
        .with_context(|| format!("no k8s.io/kubernetes requirement in {}", go_mod.display()))
}

/// Renders the chart into [`NAMESPACE`] for the local control plane's Kubernetes version
/// with `set` values; returns the objects in helm's order.
pub fn render(set: &[(&str, &str)]) -> Result<Vec<serde_json::Value>> {
    render_with(&RenderOptions {
        set,
        ..RenderOptions::default()
    })
}

/// Renders the chart (`scripts/helm template`, which builds helm on first use) and parses
/// its YAML documents.
pub fn render_with(options: &RenderOptions<'_>) -> Result<Vec<serde_json::Value>> {
    let root = repo_root();
    let kube_version = match options.kube_version {
        Some(version) => version.to_string(),
        None => control_plane_kube_version()?,
    };
    let mut command = Command::new(root.join("scripts").join("helm"));
    command
        .current_dir(&root)
        .args(["template", RELEASE, "charts/muster"])
        .args(["--namespace", options.namespace])
        .args(["--kube-version", &kube_version]);
    for api in options.api_versions {
        command.args(["--api-versions", api]);
    }
    for (key, value) in options.set {
        command.args(["--set", &format!("{key}={value}")]);
    }
    let output = command.output().context("running scripts/helm")?;
    if !output.status.success() {
        bail!(
            "helm template failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let yaml = String::from_utf8(output.stdout).context("helm printed something that is not UTF-8")?;
    let documents: Vec<serde_json::Value> = serde_saphyr::from_multiple(&yaml).context("parsing the rendered chart")?;
    Ok(documents.into_iter().filter(|d| !d.is_null()).collect())
}

/// `kind/name` of a rendered object, for messages.
pub fn describe(object: &serde_json::Value) -> String {
    format!(
        "{}/{}",
        object["kind"].as_str().unwrap_or("?"),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// The rendered objects of one kind.
pub fn of_kind<'a>(objects: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

/// Whether Helm runs the object as a hook (created for the hook's run, then deleted)
/// rather than installing it with the release.
pub fn is_hook(object: &serde_json::Value) -> bool {
    object["metadata"]["annotations"]["helm.sh/hook"].is_string()
}

/// The rendered objects the release installs and keeps: everything but hooks.
pub fn installed(objects: &[serde_json::Value]) -> Vec<serde_json::Value> {
    objects.iter().filter(|o| !is_hook(o)).cloned().collect()
}
