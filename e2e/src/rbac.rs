//! Running the operator with exactly the chart's permissions: the chart's RBAC applied,
//! a ServiceAccount's kubeconfig, and the operator's own count of the requests it made
//! (`muster_api_requests_total`), to compare what is granted with what is used.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::config::{AuthInfo, Kubeconfig, NamedAuthInfo};
use serde_json::Value;

use crate::chart;
use crate::scenario::Test;
use muster_local_cluster::operator::Operator;

/// `name{labels} value` lines of a Prometheus text page, by name and label text.
pub fn samples(page: &str) -> BTreeMap<String, f64> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            Some((key.to_string(), value.parse().ok()?))
        })
        .collect()
}

pub async fn metrics(operator: &Operator) -> Result<BTreeMap<String, f64>> {
    let (status, body) = operator.get("/metrics").await?;
    ensure!(status == 200, "/metrics answered {status}");
    Ok(samples(&body))
}

/// A kubeconfig for `account`, with a token from the TokenRequest API and the cluster of
/// `admin`.
pub async fn service_account_kubeconfig(test: &Test, namespace: &str, account: &str) -> Result<std::path::PathBuf> {
    let accounts: Api<ServiceAccount> = Api::namespaced(test.client.clone(), namespace);
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let token = accounts
        .create_token_request(account, &PostParams::default(), &request)
        .await?
        .status
        .and_then(|s| s.token)
        .context("a token")?;
    let mut config = Kubeconfig::read_from(test.cluster.control_plane.kubeconfig())?;
    let user = config
        .contexts
        .first_mut()
        .and_then(|c| c.context.as_mut())
        .context("a context")?;
    user.user = Some(account.to_string());
    config.auth_infos = vec![NamedAuthInfo {
        name: account.to_string(),
        auth_info: Some(AuthInfo {
            token: Some(token.into()),
            ..Default::default()
        }),
        other: Default::default(),
    }];
    let path = test
        .cluster
        .control_plane
        .run_dir()
        .join(format!("{account}-{namespace}.kubeconfig"));
    std::fs::write(&path, serde_json::to_string(&config)?)?;
    Ok(path)
}

/// A client of the cluster of `kubeconfig` (its admin) impersonating `user`.
pub async fn impersonating(kubeconfig: &std::path::Path, user: &str) -> Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default()).await?;
    config.auth_info.impersonate = Some(user.to_string());
    Ok(kube::Client::try_from(config)?)
}

/// Applies rendered objects for real.
pub async fn apply(client: &kube::Client, objects: &[&Value]) -> Result<()> {
    for object in objects {
        let (group, version) = match object["apiVersion"].as_str().unwrap_or_default().split_once('/') {
            Some((g, v)) => (g.to_string(), v.to_string()),
            None => (
                String::new(),
                object["apiVersion"].as_str().unwrap_or_default().to_string(),
            ),
        };
        let kind = object["kind"].as_str().unwrap_or_default();
        let plural = match kind {
            "ServiceAccount" => "serviceaccounts",
            "ClusterRole" => "clusterroles",
            "ClusterRoleBinding" => "clusterrolebindings",
            "Role" => "roles",
            "RoleBinding" => "rolebindings",
            "ValidatingAdmissionPolicy" => "validatingadmissionpolicies",
            "ValidatingAdmissionPolicyBinding" => "validatingadmissionpolicybindings",
            other => anyhow::bail!("unexpected kind {other}"),
        };
        let resource = ApiResource {
            group: group.clone(),
            version: version.clone(),
            api_version: object["apiVersion"].as_str().unwrap_or_default().to_string(),
            kind: kind.to_string(),
            plural: plural.to_string(),
        };
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
            None => Api::all_with(client.clone(), &resource),
        };
        api.patch(name, &PatchParams::apply("muster-e2e").force(), &Patch::Apply(object))
            .await
            .with_context(|| format!("applying {}", chart::describe(object)))?;
    }
    Ok(())
}

/// `verb resource[/subresource][.group]` for every permission the rendered rules grant.
pub fn granted(rules: &[&Value]) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for rule in rules {
        let list = |key: &str| -> Vec<String> {
            rule[key]
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
                .unwrap_or_default()
        };
        for group in list("apiGroups") {
            for resource in list("resources") {
                for verb in list("verbs") {
                    let resource = if group.is_empty() {
                        resource.clone()
                    } else {
                        format!("{resource}.{group}")
                    };
                    out.insert((verb, resource));
                }
            }
        }
    }
    out
}

/// The rules of the rendered (Cluster)Roles that the chart binds to its ServiceAccount:
/// what the operator is granted, leaving out roles for people (the aggregated view and
/// edit roles).
pub fn operator_rules(objects: &[Value]) -> Vec<&Value> {
    let Some(account) = chart::of_kind(objects, "ServiceAccount")
        .first()
        .and_then(|a| a["metadata"]["name"].as_str())
    else {
        return Vec::new();
    };
    let bound: BTreeSet<(&str, &str)> = chart::of_kind(objects, "ClusterRoleBinding")
        .into_iter()
        .chain(chart::of_kind(objects, "RoleBinding"))
        .filter(|binding| {
            binding["subjects"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|subject| subject["kind"] == "ServiceAccount" && subject["name"].as_str() == Some(account))
        })
        .filter_map(|binding| {
            Some((
                binding["roleRef"]["kind"].as_str()?,
                binding["roleRef"]["name"].as_str()?,
            ))
        })
        .collect();
    chart::of_kind(objects, "ClusterRole")
        .into_iter()
        .chain(chart::of_kind(objects, "Role"))
        .filter(|role| {
            let kind = role["kind"].as_str().unwrap_or_default();
            role["metadata"]["name"]
                .as_str()
                .is_some_and(|name| bound.contains(&(kind, name)))
        })
        .flat_map(|role| role["rules"].as_array().into_iter().flatten())
        .collect()
}

/// `(verb, resource[.group])` of every request the operator made, from its metrics.
pub async fn used(operator: &Operator) -> Result<BTreeSet<(String, String)>> {
    let seen = metrics(operator).await?;
    Ok(seen
        .iter()
        .filter(|(_, count)| **count > 0.0)
        .filter_map(|(key, _)| {
            let labels = key.strip_prefix("muster_api_requests_total{")?.strip_suffix('}')?;
            let value = |name: &str| {
                labels
                    .split("\",")
                    .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                    .map(|v| v.trim_end_matches('"').to_string())
            };
            Some((value("verb")?, value("resource")?))
        })
        .collect())
}

/// The chart's ServiceAccount and roles, rendered with `set` into `namespace` and
/// applied; returns the rendered objects and a kubeconfig of the ServiceAccount.
pub async fn chart_account(
    test: &Test,
    namespace: &str,
    set: &[(&str, &str)],
) -> Result<(Vec<Value>, std::path::PathBuf)> {
    let objects = chart::render_with(&chart::RenderOptions {
        namespace,
        set,
        ..chart::RenderOptions::default()
    })?;
    let kinds = [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ];
    let rbac: Vec<&Value> = objects
        .iter()
        .filter(|o| kinds.contains(&o["kind"].as_str().unwrap_or_default()))
        .collect();
    apply(&test.client, &rbac).await?;
    let account = chart::of_kind(&objects, "ServiceAccount")
        .first()
        .and_then(|a| a["metadata"]["name"].as_str())
        .context("the chart's ServiceAccount")?
        .to_string();
    let kubeconfig = service_account_kubeconfig(test, namespace, &account).await?;
    Ok((objects, kubeconfig))
}
