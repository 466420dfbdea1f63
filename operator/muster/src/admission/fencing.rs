//! How muster keeps pods it does not admit off the devices it plans with: the API
//! server does not stop two claims from taking one device, only kube-scheduler's memory
//! does. Whatever the mode, the re-read of all claims after reserving (the conflict
//! check) catches what still gets through.

use muster_api::labels;
use muster_engine::claim::{DeviceRequest, DeviceToleration, TaintEffect, TolerationOperator};
use muster_engine::request::GangRequest;
use muster_engine::selector::{NodeTaintEffect, Toleration};

/// The fencing modes of `--fencing`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Fencing {
    /// GPU nodes carry the node taint `muster.dev/fenced:NoSchedule`; muster's pods are
    /// planned and released with a toleration for it, other pods stay off those nodes.
    #[default]
    Taint,
    /// GPU devices carry the device taint `muster.dev/fenced` with effect NoSchedule (a
    /// DeviceTaintRule, or the driver); muster's claims are allocated with a toleration
    /// for it, other claims cannot get those devices, and other pods still use the
    /// nodes' CPU and memory. Device taints need Kubernetes 1.36+ (DeviceTaintRules 1.37+).
    DeviceTaint,
    /// No fence: only the conflict check protects planned devices.
    None,
}

impl Fencing {
    /// Whether released pods get the node taint's toleration.
    pub fn tolerates_node_fence(self) -> bool {
        self == Fencing::Taint
    }

    /// Makes `request` tolerate the fence: its pods the node taint, or its claims' device
    /// requests the device taint.
    pub fn apply(self, request: &mut GangRequest) {
        match self {
            Fencing::Taint => {
                for group in &mut request.groups {
                    group.shape.tolerations.push(node_fence_toleration());
                }
            }
            Fencing::DeviceTaint => {
                let specs = request
                    .groups
                    .iter_mut()
                    .flat_map(|g| g.shape.claims.iter_mut())
                    .chain(request.shared_claims.iter_mut().map(|c| &mut c.spec));
                for spec in specs {
                    for device_request in &mut spec.requests {
                        match device_request {
                            DeviceRequest::Exactly(spec) => spec.tolerations.push(device_fence_toleration()),
                            DeviceRequest::FirstAvailable { subrequests, .. } => {
                                for sub in subrequests {
                                    sub.tolerations.push(device_fence_toleration());
                                }
                            }
                        }
                    }
                }
            }
            Fencing::None => {}
        }
    }
}

/// The toleration muster's pods carry for the node fence.
pub fn node_fence_toleration() -> Toleration {
    Toleration {
        key: labels::FENCE_TAINT.into(),
        exists: true,
        value: String::new(),
        effect: Some(NodeTaintEffect::NoSchedule),
    }
}

/// The toleration muster's device requests carry for the device fence.
pub fn device_fence_toleration() -> DeviceToleration {
    DeviceToleration {
        key: Some(labels::FENCE_TAINT.into()),
        operator: TolerationOperator::Exists,
        value: None,
        effect: Some(TaintEffect::NoSchedule),
        toleration_seconds: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_engine::fixtures::{gpu_gang, request};
    use muster_engine::request::SharedClaim;

    fn gang() -> GangRequest {
        let mut gang = gpu_gang("ns/g", 2, 8, None, None);
        gang.groups[0].shape.claims[0]
            .requests
            .push(DeviceRequest::FirstAvailable {
                name: "either".into(),
                subrequests: vec![request("big", 8), request("small", 4)],
            });
        gang.shared_claims.push(SharedClaim {
            key: "ns/shared".into(),
            spec: muster_engine::fixtures::gpu_claim(1),
            allocation: None,
        });
        gang
    }

    fn device_tolerations(gang: &GangRequest) -> Vec<usize> {
        let specs = gang
            .groups
            .iter()
            .flat_map(|g| &g.shape.claims)
            .chain(gang.shared_claims.iter().map(|c| &c.spec));
        specs
            .flat_map(|spec| &spec.requests)
            .flat_map(|r| match r {
                DeviceRequest::Exactly(spec) => vec![spec.tolerations.len()],
                DeviceRequest::FirstAvailable { subrequests, .. } => {
                    subrequests.iter().map(|s| s.tolerations.len()).collect()
                }
            })
            .collect()
    }

    #[test]
    fn each_mode_tolerates_its_own_fence() {
        let mut by_node = gang();
        Fencing::Taint.apply(&mut by_node);
        assert_eq!(by_node.groups[0].shape.tolerations, vec![node_fence_toleration()]);
        assert!(device_tolerations(&by_node).iter().all(|n| *n == 0));

        let mut by_device = gang();
        Fencing::DeviceTaint.apply(&mut by_device);
        assert!(by_device.groups[0].shape.tolerations.is_empty());
        let counts = device_tolerations(&by_device);
        assert_eq!(counts.len(), 4, "the request, both subrequests and the shared claim");
        assert!(counts.iter().all(|n| *n == 1), "{counts:?}");

        let mut open = gang();
        Fencing::None.apply(&mut open);
        assert!(open.groups[0].shape.tolerations.is_empty());
        assert!(device_tolerations(&open).iter().all(|n| *n == 0));
    }
}
