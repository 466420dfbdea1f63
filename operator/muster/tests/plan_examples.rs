//! `muster plan` on the files in examples/, as a new user would run it.

use std::path::PathBuf;
use std::process::Command;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

fn muster(args: &[&str]) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_muster"))
        .args(args)
        .current_dir(examples())
        .output()
        .expect("muster runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into(),
        String::from_utf8_lossy(&output.stderr).into(),
    )
}

#[test]
fn the_training_gang_fits_one_rack_and_the_big_one_is_explained() {
    let (ok, out, err) = muster(&[
        "plan",
        "--cluster",
        "cluster-snapshot.yaml",
        "training-gang.yaml",
        "too-big-for-a-rack.yaml",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("llama-pretrain: fits (example.com/rack=rack-0001)"),
        "{out}"
    );
    assert!(out.contains("too-big-for-a-rack: does not fit"), "{out}");
    assert!(
        out.contains("group workers needs 5 pods (8 gpu.example.com devices each) in one example.com/rack"),
        "{out}"
    );
}

#[test]
fn json_output_has_the_documented_shape() {
    let (ok, out, err) = muster(&[
        "plan",
        "--cluster",
        "cluster-snapshot.yaml",
        "training-gang.yaml",
        "-o",
        "json",
    ]);
    assert!(ok, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let workload = &report["workloads"][0];
    assert_eq!(workload["name"], "llama-pretrain");
    assert_eq!(workload["feasible"], true);
    assert!(workload["reason"].is_null());
    let pods = workload["pods"].as_array().expect("pods");
    assert_eq!(pods.len(), 5);
    let worker = &pods[1];
    assert_eq!(worker["devices"].as_array().map(Vec::len), Some(8));
    for key in ["claim", "request", "driver", "pool", "device"] {
        assert!(worker["devices"][0][key].is_string(), "{key} in {worker}");
    }
}

#[test]
fn bad_files_name_the_file_and_object() {
    let dir = std::env::temp_dir().join(format!("muster-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "apiVersion: muster.dev/v1alpha1\nkind: Workload\nmetadata: {name: w}\nspec: {podGroups: [{name: a, replicas: many}]}\n").unwrap();
    let (ok, _, err) = muster(&["plan", "--cluster", "cluster-snapshot.yaml", bad.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("bad.yaml: document 1 (Workload w): spec.podGroups[0].replicas: invalid type"),
        "{err}"
    );
    let (ok, _, err) = muster(&["plan", "--cluster", "missing.yaml", "training-gang.yaml"]);
    assert!(!ok);
    assert!(err.contains("reading missing.yaml"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_pytorch_example_fits_and_the_job_example_waits_for_its_pods() {
    let (ok, out, err) = muster(&[
        "plan",
        "--cluster",
        "cluster-snapshot.yaml",
        "pytorch-ddp.yaml",
        "job-joins-a-workload.yaml",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("resnet-ddp: fits"), "{out}");
    assert!(out.contains("pod group workers has 0 of its 4 pods"), "{out}");
}
