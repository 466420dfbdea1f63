//! The Helm chart against a real API server: everything it renders is accepted by
//! server-side apply (dry run; the CRD is installed for real), the operator's pod meets
//! the `restricted` Pod Security Standard, and its RBAC has no wildcards.

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{self, Scope};
use muster_e2e::chart::{self, RenderOptions, describe, of_kind};
use muster_e2e::testing::{delete_namespace, namespace};
use muster_local_cluster::{ControlPlane, Options};
use serde_json::{Value, json};
use tokio::sync::OnceCell;

const MANAGER: &str = "helm";

/// The variant: one replica without leader election, no CRD, no PodDisruptionBudget, no
/// aggregated user roles, a ServiceMonitor, the Grafana dashboard, the PrometheusRule,
/// /metrics behind TokenReview and SubjectAccessReview, a NetworkPolicy, and
/// resourceclaims/binding forced on.
const VARIANT: &[(&str, &str)] = &[
    ("replicaCount", "1"),
    ("leaderElection.enabled", "false"),
    ("crds.install", "false"),
    ("podDisruptionBudget.enabled", "false"),
    ("rbac.aggregateToDefaultRoles", "false"),
    ("metrics.serviceMonitor.enabled", "true"),
    ("metrics.dashboard.enabled", "true"),
    ("metrics.prometheusRule.enabled", "true"),
    ("metrics.auth.enabled", "true"),
    ("networkPolicy.enabled", "true"),
    ("rbac.resourceClaimBinding", "true"),
    ("webhook.enabled", "false"),
];
const MONITORING: &[&str] = &["monitoring.coreos.com/v1"];

/// A control plane without muster's CRDs: the chart installs them.
async fn control_plane() -> Result<&'static ControlPlane> {
    static CLUSTER: OnceCell<ControlPlane> = OnceCell::const_new();
    CLUSTER
        .get_or_try_init(|| ControlPlane::start(Options::default()))
        .await
}

/// A test namespace that enforces the `restricted` Pod Security Standard.
async fn restricted_namespace(client: &kube::Client, prefix: &str) -> Result<String> {
    let ns = namespace(client, prefix).await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let labels = json!({"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }}});
    namespaces
        .patch(&ns, &PatchParams::default(), &Patch::Merge(&labels))
        .await?;
    Ok(ns)
}

/// The API for a rendered object, found by discovery.
async fn api_for(client: &kube::Client, object: &DynamicObject) -> Result<Api<DynamicObject>> {
    let types = object.types.clone().context("object without apiVersion/kind")?;
    let gvk = GroupVersionKind::try_from(&types)?;
    let (resource, capabilities) = discovery::pinned_kind(client, &gvk)
        .await
        .with_context(|| format!("the cluster does not serve {}/{}", types.api_version, types.kind))?;
    Ok(match capabilities.scope {
        Scope::Namespaced => {
            let ns = object
                .metadata
                .namespace
                .as_deref()
                .context("namespaced object without namespace")?;
            Api::namespaced_with(client.clone(), ns, &resource)
        }
        Scope::Cluster => Api::all_with(client.clone(), &resource),
    })
}

/// Server-side apply of one rendered object, as a dry run or for real.
async fn apply(client: &kube::Client, object: &Value, dry_run: bool) -> Result<DynamicObject> {
    let object: DynamicObject = serde_json::from_value(object.clone()).context("not a Kubernetes object")?;
    let name = object.metadata.name.clone().context("object without a name")?;
    let api = api_for(client, &object).await?;
    let mut params = PatchParams::apply(MANAGER).force();
    if dry_run {
        params = params.dry_run();
    }
    Ok(api.patch(&name, &params, &Patch::Apply(&object)).await?)
}

/// Dry-runs every object; fails listing each one the API server refused.
async fn dry_run_all(client: &kube::Client, objects: &[&Value]) -> Result<()> {
    let mut refused = Vec::new();
    for object in objects {
        if let Err(e) = apply(client, object, true).await {
            refused.push(format!("{}: {e:#}", describe(object)));
        }
    }
    if !refused.is_empty() {
        bail!("the API server refused:\n{}", refused.join("\n"));
    }
    Ok(())
}

/// Installs a CRD for real and waits until it is established.
async fn install_crd(client: &kube::Client, crd: &Value) -> Result<()> {
    apply(client, crd, false).await?;
    let name = crd["metadata"]["name"]
        .as_str()
        .context("CRD without a name")?
        .to_string();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    muster_local_cluster::wait_established(&api, &name).await
}

/// The operator's pod as the Deployment would create it, checked by admission (Pod
/// Security included) with a dry run.
async fn dry_run_pod(client: &kube::Client, ns: &str, deployment: &Value) -> Result<()> {
    let mut spec = deployment["spec"]["template"]["spec"].clone();
    // The ServiceAccount was only dry-run; admission needs an existing one, and which
    // one does not matter for Pod Security.
    spec["serviceAccountName"] = json!("default");
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "muster-pod-check",
            "namespace": ns,
            "labels": deployment["spec"]["template"]["metadata"]["labels"],
        },
        "spec": spec,
    });
    apply(client, &pod, true)
        .await
        .map(|_| ())
        .context("the operator's pod in a namespace enforcing the restricted Pod Security Standard")
}

fn args(deployment: &Value) -> Vec<&str> {
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn default_values_are_accepted_by_the_api_server() -> Result<()> {
    let client = control_plane().await?.client().await?;
    let ns = restricted_namespace(&client, "chart").await?;
    let objects = chart::render_with(&RenderOptions {
        namespace: &ns,
        ..RenderOptions::default()
    })?;
    let kinds: Vec<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    for kind in [
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Service",
        "PodDisruptionBudget",
        "Deployment",
    ] {
        assert!(kinds.contains(&kind), "no {kind} rendered: {kinds:?}");
    }
    for off in ["ServiceMonitor", "PrometheusRule", "ConfigMap"] {
        assert!(!kinds.contains(&off), "{off} is off by default: {kinds:?}");
    }
    let aggregated = of_kind(&objects, "ClusterRole")
        .into_iter()
        .filter(|r| r["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true")
        .count();
    assert_eq!(aggregated, 1, "the view role aggregates by default");

    // The CRD is installed for real, serves Workloads, and survives an uninstall.
    let crds = of_kind(&objects, "CustomResourceDefinition");
    assert_eq!(crds.len(), 1);
    install_crd(&client, crds[0]).await?;
    let installed: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = installed.get("workloads.muster.dev").await?;
    assert_eq!(
        crd.metadata
            .annotations
            .unwrap_or_default()
            .get("helm.sh/resource-policy")
            .map(String::as_str),
        Some("keep")
    );
    let workload_gvk = GroupVersionKind::gvk("muster.dev", "v1alpha1", "Workload");
    let (resource, _) = discovery::pinned_kind(&client, &workload_gvk).await?;
    let workloads: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &resource);
    workloads.list(&ListParams::default()).await?;

    let rest: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] != "CustomResourceDefinition")
        .collect();
    dry_run_all(&client, &rest).await?;

    let deployment = of_kind(&objects, "Deployment")[0];
    assert_eq!(deployment["spec"]["replicas"], 2);
    let args = args(deployment);
    assert!(args.contains(&"--leader-elect"), "{args:?}");
    assert!(
        args.contains(&format!("--leader-election-namespace={ns}").as_str()),
        "{args:?}"
    );
    dry_run_pod(&client, &ns, deployment).await?;

    delete_namespace(&client, &ns).await
}

#[tokio::test]
async fn variant_values_are_accepted_by_the_api_server() -> Result<()> {
    let client = control_plane().await?.client().await?;
    let ns = restricted_namespace(&client, "chart-variant").await?;
    let objects = chart::render_with(&RenderOptions {
        namespace: &ns,
        api_versions: MONITORING,
        set: VARIANT,
        ..RenderOptions::default()
    })?;
    // The uninstall hook brings a role of its own for its one run; the release keeps none.
    let kept = chart::installed(&objects);
    let kinds: Vec<&str> = kept.iter().filter_map(|o| o["kind"].as_str()).collect();
    for absent in ["CustomResourceDefinition", "Role", "RoleBinding", "PodDisruptionBudget"] {
        assert!(!kinds.contains(&absent), "{absent} rendered: {kinds:?}");
    }
    for present in ["ServiceMonitor", "PrometheusRule", "ConfigMap", "NetworkPolicy"] {
        assert!(kinds.contains(&present), "no {present}: {kinds:?}");
    }
    let roles: Vec<&str> = of_kind(&kept, "ClusterRole")
        .into_iter()
        .filter_map(|r| r["metadata"]["name"].as_str())
        .collect();
    assert_eq!(
        roles,
        ["muster", "muster-metrics-reader"],
        "the operator's role and the scrapers'"
    );
    let dashboard = of_kind(&objects, "ConfigMap")[0];
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json = dashboard["data"]["muster.json"].as_str().expect("the dashboard JSON");
    let parsed: Value = serde_json::from_str(json).expect("the ConfigMap holds valid JSON");
    assert_eq!(parsed["uid"], "muster-overview");

    // The control plane has no prometheus-operator: stand-in CRDs that accept any
    // ServiceMonitor and PrometheusRule let the API server take the objects.
    for (kind, plural) in [
        ("ServiceMonitor", "servicemonitors"),
        ("PrometheusRule", "prometheusrules"),
    ] {
        install_crd(
            &client,
            &json!({
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": format!("{plural}.monitoring.coreos.com")},
                "spec": {
                    "group": "monitoring.coreos.com",
                    "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase()},
                    "scope": "Namespaced",
                    "versions": [{
                        "name": "v1",
                        "served": true,
                        "storage": true,
                        "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
                    }],
                },
            }),
        )
        .await?;
    }

    dry_run_all(&client, &objects.iter().collect::<Vec<_>>()).await?;

    let deployment = of_kind(&objects, "Deployment")[0];
    assert_eq!(deployment["spec"]["replicas"], 1);
    let args = args(deployment);
    assert!(!args.iter().any(|a| a.starts_with("--leader-elect")), "{args:?}");
    dry_run_pod(&client, &ns, deployment).await?;

    delete_namespace(&client, &ns).await
}

#[test]
fn rbac_has_no_wildcards() -> Result<()> {
    for (set, api_versions) in [(&[][..], &[][..]), (VARIANT, MONITORING)] {
        let objects = chart::render_with(&RenderOptions {
            api_versions,
            set,
            ..RenderOptions::default()
        })?;
        let roles: Vec<&Value> = objects
            .iter()
            .filter(|o| o["kind"] == "ClusterRole" || o["kind"] == "Role")
            .collect();
        assert!(!roles.is_empty(), "no roles rendered");
        for role in roles {
            let rules = role["rules"].as_array().context("role without rules")?;
            // The role scrapers are bound to reads exactly /metrics.
            if role["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("-metrics-reader"))
            {
                assert_eq!(
                    role["rules"],
                    serde_json::json!([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}])
                );
                continue;
            }
            assert!(!rules.is_empty(), "{} has no rules", describe(role));
            for rule in rules {
                assert!(rule.get("nonResourceURLs").is_none(), "{}: {rule}", describe(role));
                for field in ["apiGroups", "resources", "verbs", "resourceNames"] {
                    for value in rule[field].as_array().into_iter().flatten() {
                        let value = value.as_str().context("rule entry that is not a string")?;
                        assert!(!value.contains('*'), "{}: wildcard in {field}: {rule}", describe(role));
                    }
                }
                for field in ["apiGroups", "resources", "verbs"] {
                    assert!(
                        rule[field].as_array().is_some_and(|a| !a.is_empty()),
                        "{}: no {field}: {rule}",
                        describe(role)
                    );
                }
            }
        }
    }
    Ok(())
}

/// Whether the ClusterRole grants resourceclaims/binding.
fn grants_binding(kube_version: &str, set: &[(&str, &str)]) -> Result<bool> {
    let objects = chart::render_with(&RenderOptions {
        kube_version: Some(kube_version),
        set,
        ..RenderOptions::default()
    })?;
    Ok(muster_e2e::rbac::operator_rules(&objects)
        .into_iter()
        .flat_map(|rule| rule["resources"].as_array().into_iter().flatten())
        .any(|r| r == "resourceclaims/binding"))
}

#[test]
fn resource_claim_binding_follows_the_cluster_version() -> Result<()> {
    assert!(grants_binding(&chart::control_plane_kube_version()?, &[])?);
    assert!(grants_binding("v1.36.0", &[])?);
    assert!(!grants_binding("v1.35.3", &[])?);
    assert!(grants_binding("v1.35.3", &[("rbac.resourceClaimBinding", "true")])?);
    assert!(!grants_binding("v1.37.1", &[("rbac.resourceClaimBinding", "false")])?);
    Ok(())
}

#[test]
fn leader_election_follows_the_replicas() -> Result<()> {
    let elects = |set: &[(&str, &str)]| -> Result<(bool, bool)> {
        // The webhook's certificate Secret has a Role of its own.
        let set: Vec<(&str, &str)> = set.iter().copied().chain([("webhook.enabled", "false")]).collect();
        let objects = chart::installed(&chart::render(&set)?);
        let deployment = of_kind(&objects, "Deployment")[0];
        Ok((
            args(deployment).contains(&"--leader-elect"),
            !of_kind(&objects, "Role").is_empty(),
        ))
    };
    assert_eq!(elects(&[])?, (true, true));
    assert_eq!(elects(&[("replicaCount", "1")])?, (true, true));
    assert_eq!(
        elects(&[("leaderElection.enabled", "false")])?,
        (true, true),
        "two replicas always elect"
    );
    assert_eq!(
        elects(&[("replicaCount", "1"), ("leaderElection.enabled", "false")])?,
        (false, false)
    );
    Ok(())
}

/// With cert-manager, the serving certificate comes from a CA of the chart's own (a
/// self-signed CA Certificate and a CA Issuer), so that renewing it keeps the CA the API
/// server trusts; the CA injector reads the serving certificate's CA.
#[test]
fn cert_manager_issues_the_serving_certificate_from_a_ca_of_the_charts_own() -> Result<()> {
    let objects = chart::render(&[("webhook.certManager.enabled", "true")])?;
    let named = |kind: &str, name: &str| -> Result<&Value> {
        of_kind(&objects, kind)
            .into_iter()
            .find(|o| o["metadata"]["name"] == name)
            .with_context(|| format!("{kind} {name}"))
    };
    let self_signed = named("Issuer", "muster-webhook-selfsigned")?;
    assert!(self_signed["spec"]["selfSigned"].is_object());
    let ca = named("Certificate", "muster-webhook-ca")?;
    assert_eq!(ca["spec"]["isCA"], true);
    assert_eq!(ca["spec"]["issuerRef"]["name"], "muster-webhook-selfsigned");
    let issuer = named("Issuer", "muster-webhook")?;
    assert_eq!(issuer["spec"]["ca"]["secretName"], ca["spec"]["secretName"]);
    let serving = named("Certificate", "muster-webhook")?;
    assert_eq!(serving["spec"]["issuerRef"]["name"], "muster-webhook");
    assert_eq!(serving["spec"]["secretName"], "muster-webhook-tls");
    let configuration = of_kind(&objects, "MutatingWebhookConfiguration")[0];
    assert_eq!(
        configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        format!("{}/muster-webhook", chart::NAMESPACE)
    );
    // An issuer of the user's: no CA of the chart's.
    let objects = chart::render(&[
        ("webhook.certManager.enabled", "true"),
        ("webhook.certManager.issuerRef.name", "corporate-ca"),
        ("webhook.certManager.issuerRef.kind", "ClusterIssuer"),
    ])?;
    assert!(of_kind(&objects, "Issuer").is_empty());
    assert_eq!(of_kind(&objects, "Certificate").len(), 1);
    Ok(())
}
