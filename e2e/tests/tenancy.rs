//! Namespace users get Workload rights the usual way: the chart's aggregated roles add
//! Workloads to the built-in view, edit and admin roles, and grant nothing else.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::rbac::v1::{ClusterRole, RoleBinding};
use kube::api::{Api, ListParams, PostParams};
use muster_api::v1alpha1::Workload;
use muster_e2e::chart;
use muster_e2e::testing::{namespace, shared_cluster};
use muster_local_cluster::fleet::FleetSpec;
use muster_local_cluster::wait;
use serde_json::{Value, json};

/// A client that acts as `user` (the admin impersonating it).
async fn as_user(kubeconfig: &std::path::Path, user: &str) -> Result<kube::Client> {
    muster_e2e::rbac::impersonating(kubeconfig, user).await
}

async fn bind(client: &kube::Client, ns: &str, user: &str, cluster_role: &str) -> Result<()> {
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), ns);
    bindings
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": format!("{user}-{cluster_role}")},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            }))?,
        )
        .await?;
    Ok(())
}

fn workload(name: &str) -> Result<Workload> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "muster.dev/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {"podGroups": [{"name": "workers", "replicas": 1,
            "template": {"spec": {"containers": [{"name": "main", "image": "trainer"}]}}}]},
    }))?)
}

fn forbidden<T>(result: kube::Result<T>) -> bool {
    matches!(result, Err(kube::Error::Api(status)) if status.code == 403)
}

#[tokio::test]
async fn aggregated_roles_give_namespace_users_workloads_and_nothing_else() -> Result<()> {
    let cluster = shared_cluster(FleetSpec::with_nodes(1)).await?;
    let admin = cluster.control_plane.client().await?;
    let kubeconfig = cluster.control_plane.kubeconfig();

    let objects = chart::render(&[])?;
    let roles: Vec<&Value> = chart::of_kind(&objects, "ClusterRole")
        .into_iter()
        .filter(|r| {
            r["metadata"]["labels"].as_object().is_some_and(|labels| {
                labels
                    .keys()
                    .any(|k| k.starts_with("rbac.authorization.k8s.io/aggregate-to-"))
            })
        })
        .collect();
    ensure!(
        roles.len() == 2,
        "the chart renders a view and an edit role to aggregate"
    );
    for role in &roles {
        for rule in role["rules"].as_array().context("rules")? {
            ensure!(
                rule["apiGroups"] == json!(["muster.dev"]),
                "{rule} is about muster.dev only"
            );
            for resource in rule["resources"].as_array().context("resources")? {
                ensure!(
                    resource == "workloads" || resource == "workloads/status",
                    "{} grants {resource}",
                    chart::describe(role)
                );
            }
        }
    }
    muster_e2e::rbac::apply(&admin, &roles).await?;

    // kube-controller-manager folds the labelled roles into the built-in ones.
    let cluster_roles: Api<ClusterRole> = Api::all(admin.clone());
    for built_in in ["view", "edit", "admin"] {
        wait::until(
            &format!("the built-in {built_in} role to include Workloads"),
            Duration::from_secs(60),
            || {
                let cluster_roles = cluster_roles.clone();
                async move {
                    let role = cluster_roles.get(built_in).await?;
                    Ok(role
                        .rules
                        .unwrap_or_default()
                        .iter()
                        .any(|r| r.resources.iter().flatten().any(|x| x == "workloads"))
                        .then_some(()))
                }
            },
        )
        .await?;
    }

    let ns = namespace(&admin, "tenancy").await?;
    let other = namespace(&admin, "tenancy-other").await?;
    bind(&admin, &ns, "alice", "edit").await?;
    bind(&admin, &ns, "bob", "view").await?;
    bind(&admin, &ns, "carol", "muster-edit").await?;
    bind(&admin, &ns, "carol", "muster-view").await?;

    // alice edits in her namespace: Workloads and, through the built-in edit role, pods.
    let alice = as_user(kubeconfig, "alice").await?;
    let workloads: Api<Workload> = Api::namespaced(alice.clone(), &ns);
    wait::until(
        "alice to be allowed to create a Workload",
        Duration::from_secs(30),
        || {
            let workloads = workloads.clone();
            async move {
                Ok(
                    match workloads.create(&PostParams::default(), &workload("by-alice")?).await {
                        Ok(_) => Some(()),
                        Err(kube::Error::Api(status)) if status.code == 403 => None,
                        Err(e) => return Err(e.into()),
                    },
                )
            }
        },
    )
    .await?;
    workloads.get("by-alice").await?;
    ensure!(
        forbidden(
            Api::<Workload>::namespaced(alice.clone(), &other)
                .list(&ListParams::default())
                .await
        ),
        "alice sees no Workload outside her namespace"
    );

    // bob views: reads Workloads, creates none.
    let bob = as_user(kubeconfig, "bob").await?;
    let bobs: Api<Workload> = Api::namespaced(bob, &ns);
    ensure!(
        bobs.list(&ListParams::default()).await?.items.len() == 1,
        "bob reads the Workload"
    );
    ensure!(
        forbidden(bobs.create(&PostParams::default(), &workload("by-bob")?).await),
        "bob may not create Workloads"
    );

    // carol holds only muster's roles: Workloads, and nothing else.
    let carol = as_user(kubeconfig, "carol").await?;
    let carols: Api<Workload> = Api::namespaced(carol.clone(), &ns);
    carols.create(&PostParams::default(), &workload("by-carol")?).await?;
    carols.get("by-carol").await?;
    ensure!(
        forbidden(
            Api::<Pod>::namespaced(carol.clone(), &ns)
                .list(&ListParams::default())
                .await
        ),
        "muster's roles grant no pods"
    );
    ensure!(
        forbidden(
            Api::<Secret>::namespaced(carol.clone(), &ns)
                .list(&ListParams::default())
                .await
        ),
        "muster's roles grant no secrets"
    );
    ensure!(
        forbidden(
            Api::<Workload>::namespaced(carol, &other)
                .list(&ListParams::default())
                .await
        ),
        "a RoleBinding keeps muster's roles to its namespace"
    );
    Ok(())
}
