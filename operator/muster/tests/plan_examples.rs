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
        "pods-of-any-controller.yaml",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("resnet-ddp: fits"), "{out}");
    assert!(out.contains("pod group workers has 0 of its 4 pods"), "{out}");
}

/// The example snapshot grown to `nodes` nodes, as kubectl would print a cluster that
/// size: copies of its first Node and its first ResourceSlice, four nodes per rack, and
/// its DeviceClass.
fn grown_snapshot(nodes: usize) -> serde_json::Value {
    let text = std::fs::read_to_string(examples().join("cluster-snapshot.yaml")).expect("the example snapshot");
    let list: serde_json::Value = serde_saphyr::from_str(&text).expect("the example snapshot parses");
    let items = list["items"].as_array().expect("a List");
    let first = |kind: &str| items.iter().find(|i| i["kind"] == kind).cloned().expect(kind);
    let (node, slice, class) = (first("Node"), first("ResourceSlice"), first("DeviceClass"));
    let mut out = vec![class];
    for i in 0..nodes {
        let name = format!("node-{i:05}");
        let mut n = node.clone();
        n["metadata"]["name"] = name.clone().into();
        n["metadata"]["labels"]["kubernetes.io/hostname"] = name.clone().into();
        n["metadata"]["labels"]["example.com/rack"] = format!("rack-{:04}", i / 4).into();
        let mut s = slice.clone();
        s["metadata"]["name"] = format!("{name}-gpu.example.com").into();
        s["spec"]["nodeName"] = name.clone().into();
        s["spec"]["pool"]["name"] = name.clone().into();
        out.push(n);
        out.push(s);
    }
    serde_json::json!({"apiVersion": "v1", "kind": "List", "items": out})
}

fn scratch(file: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("muster-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let path = dir.join(file);
    std::fs::write(&path, text).expect("written");
    path
}

/// Runs `muster plan` and watches its peak resident memory (`VmHWM`) while it runs.
/// Returns success, stdout, stderr and the peak in bytes, if the system shows it.
fn muster_with_peak_memory(args: &[&str]) -> (bool, String, String, Option<u64>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_muster"))
        .args(args)
        .current_dir(examples())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("muster runs");
    let status_file = format!("/proc/{}/status", child.id());
    let read_peak = || -> Option<u64> {
        let status = std::fs::read_to_string(&status_file).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    };
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out = std::thread::spawn(move || std::io::read_to_string(&mut stdout).unwrap_or_default());
    let err = std::thread::spawn(move || std::io::read_to_string(&mut stderr).unwrap_or_default());
    let mut peak = None;
    // The high-water mark only grows; the last reading before the process ends is kept.
    let status = loop {
        if let Some(reading) = read_peak() {
            peak = Some(reading);
        }
        if let Some(status) = child.try_wait().expect("waits") {
            break status;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    (
        status.success(),
        out.join().expect("stdout read"),
        err.join().expect("stderr read"),
        peak,
    )
}

#[test]
fn a_five_thousand_node_json_snapshot_is_planned() {
    let snapshot = serde_json::to_string(&grown_snapshot(5_000)).expect("JSON");
    let path = scratch("snapshot-5000.json", &snapshot);
    let started = std::time::Instant::now();
    let (ok, out, err, peak) =
        muster_with_peak_memory(&["plan", "--cluster", path.to_str().unwrap(), "training-gang.yaml"]);
    let megabytes = |bytes: u64| bytes as f64 / 1e6;
    println!(
        "plan: {:.1} MB JSON snapshot of 5,000 nodes in {:.2}s, peak memory {} (debug build)",
        megabytes(snapshot.len() as u64),
        started.elapsed().as_secs_f64(),
        peak.map(|p| format!(
            "{:.0} MB, {:.1}x the file",
            megabytes(p),
            p as f64 / snapshot.len() as f64
        ))
        .unwrap_or_else(|| "not shown by this system".into()),
    );
    assert!(ok, "{err}");
    assert!(out.contains("llama-pretrain: fits"), "{out}");
}

#[test]
fn a_thousand_node_yaml_snapshot_is_planned_and_an_alias_bomb_is_refused() {
    let snapshot = serde_saphyr::to_string(&grown_snapshot(1_000)).expect("YAML");
    let path = scratch("snapshot-1000.yaml", &snapshot);
    let (ok, out, err) = muster(&["plan", "--cluster", path.to_str().unwrap(), "training-gang.yaml"]);
    assert!(ok, "{err}");
    assert!(out.contains("llama-pretrain: fits"), "{out}");

    // Each level refers to the one before ten times: a billion strings from a few lines.
    let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for level in 1..10 {
        let refs = vec![format!("*a{}", level - 1); 10].join(", ");
        bomb.push_str(&format!("a{level}: &a{level} [{refs}]\n"));
    }
    let path = scratch("bomb.yaml", &bomb);
    let (ok, _, err) = muster(&["plan", "--cluster", path.to_str().unwrap(), "training-gang.yaml"]);
    assert!(!ok, "an alias bomb is refused");
    assert!(err.contains("bomb.yaml"), "the error names the file: {err}");
}

#[test]
fn gpus_asked_as_an_extended_resource_a_device_class_maps_are_planned_as_claims() {
    let (ok, out, err) = muster(&[
        "plan",
        "--cluster",
        "cluster-snapshot.yaml",
        "dra-extended-resources.yaml",
        "-o",
        "json",
    ]);
    assert!(ok, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let workload = &report["workloads"][0];
    assert_eq!(workload["feasible"], true, "{out}");
    let pods = workload["pods"].as_array().expect("pods");
    assert_eq!(pods.len(), 2);
    for pod in pods {
        let devices = pod["devices"].as_array().expect("devices");
        assert_eq!(devices.len(), 8, "{pod}");
        let claim = format!("{}-extended-resources", pod["name"].as_str().unwrap());
        assert!(
            devices
                .iter()
                .all(|d| d["claim"] == claim.as_str() && d["pool"] == pod["node"]),
            "{pod}"
        );
    }
}

#[test]
fn the_multi_level_gang_shows_every_level_and_slice() {
    let (ok, out, err) = muster(&[
        "plan",
        "--cluster",
        "cluster-snapshot.yaml",
        "multi-level-topology.yaml",
    ]);
    assert!(ok, "{err}");
    // rack-0000 has one whole NVLink pair free (node-00000 lends 4 GPUs to a notebook):
    // the workers' two pairs go to rack-0001, the launcher with them.
    assert!(
        out.contains(
            "levels: fits (example.com/block=block-000, example.com/rack: rack-0001, kubernetes.io/hostname: node-00004,node-00005,node-00006,node-00007; group workers: example.com/rack=rack-0001, 2 slices by example.com/nvlink-domain: nvl-2,nvl-3)"
        ),
        "{out}"
    );
}

#[test]
fn the_pod_constraints_example_goes_where_the_disks_are_one_worker_per_node() {
    let (ok, out, err) = muster(&[
        "plan",
        "--cluster",
        "cluster-snapshot.yaml",
        "pod-constraints.yaml",
        "-o",
        "json",
    ]);
    assert!(ok, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let pods = report["workloads"][0]["pods"].as_array().expect("pods");
    let workers: Vec<&serde_json::Value> = pods
        .iter()
        .filter(|p| p["name"].as_str().is_some_and(|n| n.contains("workers")))
        .collect();
    assert_eq!(workers.len(), 4);
    for worker in &workers {
        let node = worker["node"].as_str().unwrap();
        assert_eq!(
            worker["volumes"],
            serde_json::json!([format!("nvme-{node}")]),
            "{worker}"
        );
    }
    let nodes: std::collections::BTreeSet<&str> = workers.iter().filter_map(|w| w["node"].as_str()).collect();
    assert_eq!(nodes.len(), 4, "one worker per node");
    let launcher = pods
        .iter()
        .find(|p| p["name"] == "finetune-launcher-0")
        .expect("the launcher");
    assert!(
        ["node-00004", "node-00005", "node-00006", "node-00007"].contains(&launcher["node"].as_str().unwrap()),
        "the launcher in the workers' rack: {launcher}"
    );
}
