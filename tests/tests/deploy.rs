//! deploy/: the manifests validate strictly against Kubernetes' schemas (offline, with
//! kubernetes-validate), and say what an operator relies on: least privilege, kube-proxy's
//! RBAC, the rollout, the probes, the node name.

use std::{collections::BTreeSet, path::PathBuf, process::Command};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    rbac::v1::{ClusterRole, ClusterRoleBinding},
};

fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn documents(file: &str) -> Vec<serde_yaml::Value> {
    let text = std::fs::read_to_string(deploy().join(file)).unwrap_or_else(|e| panic!("deploy/{file}: {e}"));
    serde_yaml::Deserializer::from_str(&text).map(|d| serde::Deserialize::deserialize(d).expect("YAML")).collect()
}

fn of_kind<T: serde::de::DeserializeOwned>(file: &str, kind: &str) -> T {
    let doc = documents(file).into_iter().find(|d| d["kind"].as_str() == Some(kind)).unwrap_or_else(|| panic!("no {kind} in {file}"));
    serde_yaml::from_value(doc).unwrap_or_else(|e| panic!("{kind} in {file}: {e}"))
}

#[test]
fn the_manifests_validate_strictly_against_kubernetes_schemas() {
    let tool = Command::new("kubernetes-validate").arg("--version").output();
    if tool.as_ref().map_or(true, |o| !o.status.success()) {
        let why = "kubernetes-validate (PyPI) is not installed; cargo xtask setup installs it";
        if std::env::var_os("PROXY_TESTS_STRICT").is_some() {
            panic!("{why}");
        }
        eprintln!("SKIPPED the_manifests_validate_strictly_against_kubernetes_schemas: {why}");
        return;
    }
    let files = ["rbac.yaml", "configmap.yaml", "daemonset.yaml"];
    for version in ["1.30.0", "1.33.0", "1.37.0"] {
        let out = Command::new("kubernetes-validate")
            .args(["--strict", "--kubernetes-version", version])
            .args(files.iter().map(|f| deploy().join(f)))
            .output()
            .expect("kubernetes-validate");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "Kubernetes {version}: {text}");
        assert_eq!(text.matches("passed").count(), 5, "every object checked against {version}: {text}");
    }
}

#[test]
fn rbac_grants_what_kube_proxys_node_proxier_role_does_and_nothing_more() {
    let role: ClusterRole = of_kind("rbac.yaml", "ClusterRole");
    let mut granted = BTreeSet::new();
    for r in role.rules.iter().flatten() {
        for g in r.api_groups.iter().flatten() {
            for res in r.resources.iter().flatten() {
                for v in &r.verbs {
                    granted.insert((g.clone(), res.clone(), v.clone()));
                }
            }
        }
    }
    let mut want: BTreeSet<(String, String, String)> = BTreeSet::new();
    for v in ["list", "watch"] {
        want.insert(("".into(), "services".into(), v.into()));
        want.insert(("discovery.k8s.io".into(), "endpointslices".into(), v.into()));
        // system:node-proxier gained these with ServiceCIDRs (GA in 1.33).
        want.insert(("networking.k8s.io".into(), "servicecidrs".into(), v.into()));
    }
    for v in ["get", "list", "watch"] {
        want.insert(("".into(), "nodes".into(), v.into()));
    }
    for g in ["", "events.k8s.io"] {
        for v in ["create", "patch", "update"] {
            want.insert((g.into(), "events".into(), v.into()));
        }
    }
    assert_eq!(granted, want);
    let binding: ClusterRoleBinding = of_kind("rbac.yaml", "ClusterRoleBinding");
    assert_eq!(binding.role_ref.name, "proxy-agent");
    assert!(binding
        .subjects
        .iter()
        .flatten()
        .any(|s| s.kind == "ServiceAccount" && s.name == "proxy-agent" && s.namespace.as_deref() == Some("kube-system")));
}

#[test]
fn the_daemonset_runs_like_kube_proxy_with_least_privilege() {
    let ds: DaemonSet = of_kind("daemonset.yaml", "DaemonSet");
    assert_eq!(ds.metadata.namespace.as_deref(), Some("kube-system"));
    let spec = ds.spec;
    let update = spec.update_strategy.expect("update strategy");
    assert_eq!(update.type_.as_deref(), Some("RollingUpdate"));
    let rolling = update.rolling_update.expect("rolling update");
    assert_eq!(format!("{:?}", rolling.max_unavailable), "Some(Int(1))");
    assert_eq!(format!("{:?}", rolling.max_surge), "Some(Int(0))", "never two agents on one node");
    let pod = spec.template.spec.expect("pod spec");
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    assert!(
        pod.tolerations.iter().flatten().any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none()),
        "tolerates everything"
    );
    assert_eq!(pod.service_account_name.as_deref(), Some("proxy-agent"));

    let agent = &pod.containers[0];
    let sc = agent.security_context.clone().expect("securityContext");
    assert_ne!(sc.privileged, Some(true), "the long-running container is not privileged");
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let caps = sc.capabilities.expect("capabilities");
    assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
    assert_eq!(caps.add, Some(vec!["BPF".to_string(), "NET_ADMIN".to_string(), "NET_RAW".to_string(), "PERFMON".to_string()]));
    let probe = |p: Option<k8s_openapi::api::core::v1::Probe>| {
        p.and_then(|p| p.http_get).map(|h| (h.path.unwrap_or_default(), format!("{:?}", h.port)))
    };
    assert_eq!(probe(agent.liveness_probe.clone()), Some(("/livez".into(), "Int(10256)".into())));
    assert_eq!(probe(agent.readiness_probe.clone()), Some(("/healthz".into(), "Int(10256)".into())));
    let node_name = agent.env.iter().flatten().find(|e| e.name == "NODE_NAME").expect("NODE_NAME");
    assert_eq!(node_name.value_from.as_ref().and_then(|v| v.field_ref.as_ref()).map(|f| f.field_path.as_str()), Some("spec.nodeName"));
    let args = agent.args.clone().unwrap_or_default();
    assert!(args.iter().any(|a| a.starts_with("--config=")), "kube-proxy's configuration file: {args:?}");
    assert!(args.iter().any(|a| a == "--hostname-override=$(NODE_NAME)"));

    // What is privileged happens in the init container, which mounts on the host.
    let init = &pod.init_containers.expect("init container")[0];
    assert_eq!(init.security_context.as_ref().and_then(|s| s.privileged), Some(true));
    assert!(init.args.iter().flatten().any(|a| a == "--init-only"));
    let propagation = |c: &k8s_openapi::api::core::v1::Container, path: &str| {
        c.volume_mounts.iter().flatten().find(|m| m.mount_path == path).and_then(|m| m.mount_propagation.clone())
    };
    for path in ["/sys/fs/bpf", "/run/proxy-agent/cgroupv2"] {
        assert_eq!(propagation(init, path).as_deref(), Some("Bidirectional"), "{path}: the init container's mounts reach the host");
        assert_eq!(propagation(agent, path).as_deref(), Some("HostToContainer"), "{path}: the agent sees the host's");
    }
    let volumes: BTreeSet<String> = pod.volumes.iter().flatten().filter_map(|v| v.host_path.as_ref().map(|h| h.path.clone())).collect();
    for p in ["/sys/fs/bpf", "/run/xtables.lock", "/lib/modules"] {
        assert!(volumes.contains(p), "hostPath {p}");
    }
}
