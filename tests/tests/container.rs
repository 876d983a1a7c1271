//! The built image, run the way kubelet runs deploy/daemonset.yaml (see `container`): the init
//! container with its privileges, then the agent with exactly the DaemonSet's capabilities,
//! mounts, read-only root and host network, configured by the ConfigMap's kube-proxy file and
//! talking to an API server with a ServiceAccount token. kube-proxy's rules stay until the
//! agent's first write and are gone, in both iptables backends, once it is ready; Services
//! work through it, and a rolled pod (container stopped, a new one started from the image)
//! loses no connection.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::PathBuf,
    time::{Duration, Instant},
};

use proxy_tests::{
    apiserver::ApiServer,
    container::{self, Node, Rootfs, SharedDir},
    lab::{self, node_manifest, sock, standard_objects, Lab, NODE_NAME, WEB_VIP},
    require,
    servers::{http_get, tcp_ask, Conn},
};

const AGENT: &str = env!("CARGO_BIN_EXE_proxy-lab-agent");
const NODE_PORT: &str = "192.168.250.1:30080";

fn eventually<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if Instant::now() > deadline => panic!("timed out waiting for {what}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn every_backend(lab: &Lab, to: &str) -> Result<(), String> {
    let seen: BTreeSet<String> = (0..30).filter_map(|_| tcp_ask(&lab.client.ns, sock(to)).ok()).map(|a| a.backend).collect();
    if seen.len() == 3 {
        Ok(())
    } else {
        Err(format!("{to} answered by {seen:?}"))
    }
}

#[test]
fn the_daemonset_serves_services_and_a_rolled_pod_loses_no_connection() {
    let test = "the_daemonset_serves_services_and_a_rolled_pod_loses_no_connection";
    if !require::root(test) {
        return;
    }
    if let Some(why) = container::unavailable() {
        if std::env::var_os("PROXY_TESTS_STRICT").is_some() {
            panic!("{test}: {why}");
        }
        eprintln!("SKIPPED {test}: {why}");
        return;
    }
    let (ds, config_map) = container::manifests();
    let pod = ds.spec.template.spec.clone().expect("pod spec");
    let lab = Lab::new(AGENT, 3);
    let api = ApiServer::start(&lab.node, 0);
    api.apply(&node_manifest());
    for obj in standard_objects(&lab.backend_ips()) {
        api.apply(&obj);
    }
    api.apply(&proxy_tests::cluster::service(
        "web-np",
        "  type: NodePort\n  clusterIP: 10.96.0.11\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n",
        None,
    ));
    api.apply(&lab::endpoint_slice("web-np", "web-np-1", &lab.backend_ips(), &[("http", lab::TCP_PORT, "TCP")]));

    // The node: a host bpffs mount point and cgroup mount point (shared, as / is on a node),
    // the iptables lock, the ConfigMap's files pointing at the API server, the token.
    let host = lab.dir.join("host");
    let bpffs = SharedDir::new(host.join("sys-fs-bpf"));
    let cgroup = SharedDir::new(host.join("cgroupv2"));
    fs::write(host.join("xtables.lock"), "").unwrap();
    let cm_dir = host.join("configmap");
    fs::create_dir_all(&cm_dir).unwrap();
    for (name, text) in &config_map {
        let text = text.replace("https://CONTROL-PLANE-ENDPOINT:6443", &format!("http://{}", api.addr));
        fs::write(cm_dir.join(name), text).unwrap();
    }
    let sa = host.join("serviceaccount");
    fs::create_dir_all(&sa).unwrap();
    let token = format!("test-token-{}", lab.id);
    fs::write(sa.join("token"), &token).unwrap();
    fs::write(sa.join("namespace"), "kube-system").unwrap();
    fs::copy("/etc/ssl/certs/ca-certificates.crt", sa.join("ca.crt")).expect("a CA bundle for ca.crt (package ca-certificates)");
    // DirectoryOrCreate: kubelet makes /lib/modules on a node whose kernel has no modules (as
    // this one); the lab makes its own instead of touching the machine's /lib.
    let modules = if std::path::Path::new("/lib/modules").is_dir() { PathBuf::from("/lib/modules") } else { host.join("lib-modules") };
    fs::create_dir_all(&modules).unwrap();
    let host_paths: BTreeMap<String, PathBuf> = [
        ("/sys/fs/bpf", bpffs.0.clone()),
        ("/run/proxy-agent/cgroupv2", cgroup.0.clone()),
        ("/proc", PathBuf::from("/proc")),
        ("/lib/modules", modules),
        ("/run/xtables.lock", host.join("xtables.lock")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let node = Node { netns: lab.node.name.clone(), node_name: NODE_NAME.into(), host_paths, config_map: cm_dir, service_account: sa };

    // What kube-proxy left on the node taken over: IPv4 rules in iptables-nft, IPv6 in
    // iptables-legacy (which only CAP_NET_RAW may read).
    let in_node = |tool: &str, stdin: Option<&str>| {
        let mut cmd = std::process::Command::new("ip");
        cmd.args(["netns", "exec", &lab.node.name, tool]);
        if let Some(file) = stdin {
            cmd.arg("--noflush").stdin(fs::File::open(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(file)).unwrap());
        }
        let out = cmd.output().unwrap_or_else(|e| panic!("{tool}: {e}"));
        assert!(out.status.success(), "{tool}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    in_node("iptables-nft-restore", Some("kube-proxy-ipv4.rules"));
    in_node("ip6tables-legacy-restore", Some("kube-proxy-ipv6.rules"));
    let kube_proxys = || -> Vec<String> {
        ["iptables-nft-save", "ip6tables-legacy-save"]
            .into_iter()
            .flat_map(|save| {
                let out = in_node(save, None);
                out.lines()
                    .filter(|l| l.starts_with(":KUBE-SVC-") || l.starts_with(":KUBE-SEP-"))
                    .map(|l| format!("{save} {l}"))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    // kube-proxy's rules for the web Service (its cluster IP to the lab's backends, by random
    // draws as kube-proxy writes them), and connections it translated before the takeover,
    // which the agent adopts: each keeps its backend through the takeover.
    let backends = lab.backend_ips();
    for (i, b) in backends.iter().enumerate().rev() {
        let (to, probability) = (format!("{b}:{}", lab::TCP_PORT), format!("{:.5}", 1.0 / (backends.len() - i) as f64));
        let mut rule = vec!["ip", "netns", "exec", &lab.node.name, "iptables-nft", "-t", "nat", "-I", "KUBE-SERVICES", "-d", "10.96.0.10"];
        rule.extend(["-p", "tcp", "--dport", "80"]);
        if i + 1 < backends.len() {
            rule.extend(["-m", "statistic", "--mode", "random", "--probability", &probability]);
        }
        rule.extend(["-j", "DNAT", "--to-destination", &to]);
        proxy_tests::netns::sh(&rule);
    }
    let mut translated: Vec<(Conn, String)> = (0..10)
        .map(|i| {
            let mut c =
                Conn::open(&lab.client.ns, sock(WEB_VIP)).unwrap_or_else(|e| panic!("connection {i} through kube-proxy's rules: {e}"));
            let backend = c.ask().unwrap_or_else(|e| panic!("connection {i} through kube-proxy's rules: {e}")).backend;
            (c, backend)
        })
        .collect();
    let left_by_kube_proxy = kube_proxys();
    assert_eq!(left_by_kube_proxy.len(), 4, "the fixtures load kube-proxy's chains: {left_by_kube_proxy:?}");

    // The init container: privileged, once.
    let init_rootfs = Rootfs::new();
    let init_spec = &pod.init_containers.as_ref().expect("an init container")[0];
    let mut init = container::run(&ds, init_spec, &node, &init_rootfs.path, &lab.dir);
    let status = init.wait(Duration::from_secs(120)).expect("the init container finishes");
    assert!(status.success(), "the init container succeeds: {status}\n{}", init.log());
    // Its mounts reached the host, where they outlive every container.
    let pins = bpffs.0.join("proxy-agent");
    assert!(proxy_agent::bpffs::is_bpffs(&pins).unwrap_or(false), "a bpffs under the host's /sys/fs/bpf:\n{}", init.log());
    assert!(proxy_agent::dataplane::ebpf::hostsock::is_cgroup2(&cgroup.0), "a cgroup v2 hierarchy on the host:\n{}", init.log());
    assert_eq!(kube_proxys(), left_by_kube_proxy, "the init container leaves kube-proxy's rules to the agent's first write");

    // The agent, with the DaemonSet's capabilities and nothing more.
    let agent_spec = &pod.containers[0];
    let caps = agent_spec.security_context.as_ref().and_then(|s| s.capabilities.as_ref()).and_then(|c| c.add.clone()).unwrap_or_default();
    assert_eq!(caps, ["BPF", "NET_ADMIN", "NET_RAW", "PERFMON"], "the DaemonSet's capabilities");
    let rootfs = Rootfs::new();
    let mut agent = container::run(&ds, agent_spec, &node, &rootfs.path, &lab.dir);
    let health = || http_get(&lab.node, "127.0.0.1:10256".parse().unwrap(), "/healthz").map_err(|e| e.to_string());
    let ready = |agent: &mut container::Running| {
        eventually("the agent to be ready (/healthz 200)", Duration::from_secs(60), || {
            if !agent.running() {
                panic!("the agent's container exited:\n{}", agent.log());
            }
            match health() {
                Ok((200, _)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        });
    };
    ready(&mut agent);
    let log = agent.log();
    assert!(log.contains("the kernel runs the eBPF dataplane"), "eBPF mode with the DaemonSet's capabilities:\n{log}");
    assert!(!log.contains("private to this agent"), "the pins are on the host's bpffs:\n{log}");
    // Removed after the first write, in both backends, with the DaemonSet's capabilities.
    eventually("the agent to remove kube-proxy's rules", Duration::from_secs(30), || match kube_proxys() {
        left if left.is_empty() => Ok(()),
        left => Err(format!("{left:?}\n{}", agent.log())),
    });
    let log = agent.log();
    assert!(proxy_tests::conformance::removed_after_the_first_write(&log), "removed after the first write:\n{log}");
    for (i, (c, backend)) in translated.iter_mut().enumerate() {
        let now = c.ask().unwrap_or_else(|e| panic!("connection {i} kube-proxy translated, after the takeover: {e}\n{}", agent.log()));
        assert_eq!(&now.backend, backend, "connection {i} kube-proxy translated keeps its backend");
    }
    // The adoption's summary comes at its trailing read, a second or more after the first sync.
    eventually("the agent to say it adopted the 10 connections", Duration::from_secs(30), || {
        let log = agent.log();
        if log.contains("adopted=10") {
            Ok(())
        } else {
            Err(log)
        }
    });
    // The pins are seen from the host.
    eventually("the Services to be programmed", Duration::from_secs(30), || match proxy_agent::inspect::read(&pins) {
        Ok(r) if r.frontends.len() >= 5 => Ok(()),
        Ok(r) => Err(proxy_agent::inspect::render(&r)),
        Err(e) => Err(e.to_string()),
    });
    assert!(
        api.authorizations().contains(&format!("Bearer {token}")),
        "the agent used the ServiceAccount token: {:?}",
        api.authorizations()
    );

    // ClusterIP and NodePort through it.
    eventually("the cluster IP to reach every backend", Duration::from_secs(15), || every_backend(&lab, WEB_VIP));
    eventually("the NodePort to reach every backend", Duration::from_secs(15), || every_backend(&lab, NODE_PORT));
    // Host-network processes too: the hooks sit on the cgroup v2 root the init container mounted.
    if require::cgroup2(&format!("{test}: its host-network part"), lab.cgroup.is_some()) {
        let out = lab.host_ask("tcp", WEB_VIP);
        assert!(out.starts_with("ok backend-"), "a host-network process reaches the Service: {out}\n{}", agent.log());
    }

    // Rolling the pod: the container is stopped as kubelet stops it, a new one starts from the
    // image, and every open connection goes on answering from the same backend.
    let mut open: Vec<(Conn, String)> = (0..20)
        .map(|i| {
            let mut c = Conn::open(&lab.client.ns, sock(WEB_VIP)).unwrap_or_else(|e| panic!("connection {i}: {e}"));
            let backend = c.ask().unwrap_or_else(|e| panic!("connection {i}: {e}")).backend;
            (c, backend)
        })
        .collect();
    agent.stop(Duration::from_secs(30));
    for (i, (c, backend)) in open.iter_mut().enumerate() {
        assert_eq!(&c.ask().unwrap_or_else(|e| panic!("connection {i} without an agent: {e}")).backend, backend);
    }
    let rootfs2 = Rootfs::new();
    let mut agent2 = container::run(&ds, agent_spec, &node, &rootfs2.path, &lab.dir);
    ready(&mut agent2);
    let log2 = agent2.log();
    let second = &log2[log2.rfind("dataplane loaded").expect("the new pod loaded the dataplane")..];
    let adopted: usize = second
        .split("adopted_frontends=")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .unwrap_or_else(|| panic!("no adopted_frontends in:\n{second}"));
    assert!(adopted > 0, "the new pod adopts the pinned frontends:\n{second}");
    for (i, (c, backend)) in open.iter_mut().enumerate() {
        assert_eq!(
            &c.ask().unwrap_or_else(|e| panic!("connection {i} after the roll: {e}\n{log2}")).backend,
            backend,
            "connection {i} keeps its backend"
        );
    }
    eventually("new connections after the roll", Duration::from_secs(15), || every_backend(&lab, WEB_VIP));
    drop(open);
    drop(translated);
    agent2.stop(Duration::from_secs(30));
    drop(agent);
}
