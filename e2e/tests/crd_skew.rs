//! An operator newer than the Workload CRD the cluster serves: the CRD drops the
//! admission loop's write count (`status.admissionRevision`), so the loop can neither
//! fence its status writes nor tell that one landed. It stops admitting with a clear
//! error, instead of taking each landed write for failed and making it again for ever
//! (evicting gangs for preemptors that could never commit). Its own file: the test
//! changes the CRD of its control plane.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use muster_api::v1alpha1::AdmissionState;
use muster_e2e::scenario::{allocations, assert_runs_as_planned, gang, with_test};
use muster_local_cluster::wait;
use serde_json::json;

const OUTDATED: &str = "the Workload CRD drops status.admissionRevision";

#[tokio::test]
async fn an_outdated_workload_crd_stops_admission_with_a_clear_error() -> Result<()> {
    with_test("crd-skew", &[], &[], |test| {
        Box::pin(async move {
            // The CRD as a muster from before the write count installed it.
            let crds: Api<CustomResourceDefinition> = Api::all(test.client.clone());
            let field = "/spec/versions/0/schema/openAPIV3Schema/properties/status/properties/admissionRevision";
            let crd = crds.get("workloads.muster.dev").await?;
            let schema = serde_json::to_value(&crd)?
                .pointer(field)
                .cloned()
                .context("the CRD has the write count")?;
            let remove = json!([{"op": "remove", "path": field}]);
            crds.patch(
                "workloads.muster.dev",
                &PatchParams::default(),
                &Patch::Json::<()>(serde_json::from_value(remove)?),
            )
            .await?;
            test.create(gang("skewed", 1, None)).await?;
            let operator = test.operator.as_ref().context("operator")?;
            wait::until(
                "the operator to say the CRD is outdated",
                Duration::from_secs(60),
                || {
                    let said = operator.log().contains(OUTDATED);
                    async move { Ok(said.then_some(())) }
                },
            )
            .await?;
            // Nothing more: the plan's record landed, and no claim is allocated, no pod
            // released, no record made again.
            let workloads = test.workloads();
            let claims = test.claims();
            let pods = test.pods();
            let recorded = workloads.get("skewed").await?.status.and_then(|s| s.placement);
            ensure!(
                recorded.as_ref().and_then(|p| p.state) == Some(AdmissionState::Reserving),
                "the plan's record landed: {recorded:?}"
            );
            wait::holds("admission to write nothing more", Duration::from_secs(10), || {
                let (workloads, claims, pods, recorded) =
                    (workloads.clone(), claims.clone(), pods.clone(), recorded.clone());
                async move {
                    let placement = workloads.get("skewed").await?.status.and_then(|s| s.placement);
                    let released = pods.list(&Default::default()).await?.items.iter().any(|p| {
                        p.spec
                            .as_ref()
                            .is_some_and(|s| s.scheduling_gates.as_ref().is_none_or(|g| g.is_empty()))
                    });
                    Ok(placement == recorded && allocations(&claims).await?.is_empty() && !released)
                }
            })
            .await?;

            // Once the CRD is upgraded and the operator restarted, the gang runs: the
            // interrupted commit is undone and made again.
            let add = json!([{"op": "add", "path": field, "value": schema}]);
            crds.patch(
                "workloads.muster.dev",
                &PatchParams::default(),
                &Patch::Json::<()>(serde_json::from_value(add)?),
            )
            .await?;
            test.operator.take().context("operator")?.stop();
            test.start_operator(&[], &[])?;
            assert_runs_as_planned(test, "skewed").await?;
            Ok(())
        })
    })
    .await
}
