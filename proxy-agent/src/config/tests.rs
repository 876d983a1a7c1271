use super::*;

fn file(text: &str) -> tempfile_path::TempFile {
    tempfile_path::TempFile::with(text)
}

/// A file of the test's own, removed on drop.
mod tempfile_path {
    use std::path::PathBuf;

    pub struct TempFile(pub PathBuf);

    impl TempFile {
        pub fn with(text: &str) -> Self {
            use std::sync::atomic::{AtomicU32, Ordering};
            static N: AtomicU32 = AtomicU32::new(0);
            let path =
                std::env::temp_dir().join(format!("proxy-agent-config-{}-{}.yaml", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
            std::fs::write(&path, text).expect("write the test's config file");
            Self(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

const HEAD: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

fn resolve(text: &str, flags: Flags) -> Result<(Config, Vec<String>), String> {
    let f = file(text);
    Config::resolve(Flags { config: Some(f.0.clone()), ..flags }, || "host".into())
}

#[test]
fn without_a_file_the_defaults_are_kube_proxys() {
    let (c, notes) = Config::resolve(Flags::default(), || "node-1".into()).unwrap();
    assert!(notes.is_empty());
    assert_eq!(c.common.hostname, "node-1");
    assert_eq!(c.common.metrics_bind.to_string(), "127.0.0.1:10249");
    assert_eq!(c.common.healthz_bind.to_string(), "0.0.0.0:10256");
    assert_eq!(c.common.oom_score_adj, Some(-999));
    assert!(matches!(c.common.source, Source::Kube(ApiClient { kubeconfig: None, qps, burst: 10, .. }) if qps == 5.0));
    assert_eq!(
        c.netfilter.iptables,
        ModeSettings {
            masquerade_all: false,
            masquerade_bit: 14,
            sync: SyncPeriods { sync: Duration::from_secs(30), min: Duration::from_secs(1) }
        }
    );
    assert_eq!(c.netfilter.for_mode(ProxyMode::Ipvs).sync.min, Duration::ZERO);
    assert_eq!(c.netfilter.iptables.mark(), "0x4000");
    assert!(c.netfilter.localhost_nodeports);
    assert_eq!(c.ct_lifetimes(), Lifetimes::DEFAULT);
    assert!(c.unused_in(ProxyMode::Ebpf).is_empty());
}

#[test]
fn a_kubeadm_config_map_applies_and_names_only_what_a_mode_does_not_use() {
    let (c, notes) = resolve(kubeproxy::tests_support::KUBEADM, Flags::default()).unwrap();
    assert!(notes.is_empty(), "{notes:?}");
    assert!(
        matches!(&c.common.source, Source::Kube(a) if a.kubeconfig.as_deref() == Some(std::path::Path::new("/var/lib/kube-proxy/kubeconfig.conf")))
    );
    assert_eq!(c.common.cluster_cidrs, vec!["10.244.0.0/16".parse().unwrap()]);
    assert_eq!(c.common.proxy_mode, None, "mode \"\" is auto");
    // kubeadm writes zero values for what it leaves unset: those are defaults, not settings.
    assert_eq!(c.netfilter.iptables.sync.sync, Duration::from_secs(30));
    assert_eq!(c.unused_in(ProxyMode::Ebpf), vec!["clusterCIDR"], "the eBPF mode tells pods by their interfaces");
    assert!(c.unused_in(ProxyMode::Iptables).is_empty());
}

#[test]
fn flags_given_override_the_file() {
    let text = format!(
        "{HEAD}mode: iptables\nhostnameOverride: from-file\nmetricsBindAddress: 0.0.0.0:9999\nhealthzBindAddress: 10.0.0.1\niptables:\n  masqueradeBit: 16\n  syncPeriod: 1m\n  minSyncPeriod: 5s\nconntrack:\n  tcpEstablishedTimeout: 2h\n  udpTimeout: 10s\n"
    );
    let (c, _) = resolve(&text, Flags::default()).unwrap();
    assert_eq!(c.common.proxy_mode, Some(ProxyMode::Iptables));
    assert_eq!(c.common.hostname, "from-file");
    assert_eq!(c.common.metrics_bind.to_string(), "0.0.0.0:9999");
    assert_eq!(c.common.healthz_bind.to_string(), "10.0.0.1:10256", "an address alone gets the default port");
    assert_eq!(c.netfilter.iptables.mark(), "0x10000");
    assert_eq!(c.netfilter.iptables.sync, SyncPeriods { sync: Duration::from_secs(60), min: Duration::from_secs(5) });
    assert_eq!(c.ct_lifetimes().tcp_established_ns, 2 * 3600 * 1_000_000_000);
    assert_eq!(c.ct_lifetimes().udp_ns, 10_000_000_000);

    let flags = Flags {
        proxy_mode: Some(Some(ProxyMode::Nftables)),
        hostname_override: Some("from-flag".into()),
        iptables_sync_period: Some(Duration::from_secs(7)),
        ..Default::default()
    };
    let (c, _) = resolve(&text, flags).unwrap();
    assert_eq!(c.common.proxy_mode, Some(ProxyMode::Nftables));
    assert_eq!(c.common.hostname, "from-flag");
    assert_eq!(c.netfilter.iptables.sync.sync, Duration::from_secs(7));
    assert_eq!(c.netfilter.iptables.sync.min, Duration::from_secs(5), "what no flag gave stays from the file");
    // The file's iptables section means nothing to nftables mode: named once at start.
    assert_eq!(c.unused_in(ProxyMode::Nftables), vec!["iptables.masqueradeBit", "iptables.syncPeriod", "iptables.minSyncPeriod"]);
    assert_eq!(
        c.unused_in(ProxyMode::Ebpf),
        vec!["iptables.masqueradeBit", "iptables.syncPeriod", "iptables.minSyncPeriod"],
        "the conntrack timeouts are the eBPF conntrack's lifetimes"
    );
}

#[test]
fn every_section_reaches_its_setting() {
    let text = format!(
        "{HEAD}bindAddress: 192.168.1.10\nnodePortAddresses: [192.168.1.0/24, \"fd00::/64\"]\nclusterCIDR: 10.244.0.0/16,fd00:10::/56\noomScoreAdj: -500\nclientConnection:\n  kubeconfig: /etc/kp.conf\n  qps: 50\n  burst: 100\n  contentType: application/vnd.kubernetes.protobuf\nipvs:\n  scheduler: wrr\n  excludeCIDRs: [10.100.0.0/16]\n  strictARP: true\n  tcpTimeout: 900s\n  tcpFinTimeout: 120s\n  udpTimeout: 300s\nnftables:\n  masqueradeAll: true\n  masqueradeBit: 15\nconntrack:\n  maxPerCore: 65536\n  min: 262144\n  tcpBeLiberal: true\n  tcpCloseWaitTimeout: 1h\n  udpStreamTimeout: 3m\ndetectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  interfaceNamePrefix: cali\nlogging:\n  format: json\n  verbosity: 4\nconfigSyncPeriod: 10m\n"
    );
    let (c, notes) = resolve(&text, Flags::default()).unwrap();
    assert_eq!(c.common.node_ip, Some(std::net::Ipv4Addr::new(192, 168, 1, 10).into()));
    let cidr = |s: &str| s.parse::<crate::model::Cidr>().unwrap();
    assert_eq!(c.common.nodeport_addresses, NodePortAddresses::Cidrs(vec![cidr("192.168.1.0/24"), cidr("fd00::/64")]));
    assert_eq!(c.common.cluster_cidrs, vec![cidr("10.244.0.0/16"), cidr("fd00:10::/56")], "a dual-stack pair");
    let bad = resolve(&format!("{HEAD}clusterCIDR: 10.244.0.0/16,10.245.0.0/16\n"), Flags::default()).unwrap_err();
    assert!(bad.contains("not one range or one range per family"), "{bad}");
    assert!(notes.iter().any(|n| n.contains("protobuf")), "{notes:?}");
    assert_eq!(c.common.oom_score_adj, Some(-500));
    assert!(matches!(&c.common.source, Source::Kube(a) if a.qps == 50.0 && a.burst == 100));
    assert_eq!(c.netfilter.ipvs.scheduler.0, "wrr");
    assert_eq!(c.netfilter.ipvs.exclude_cidrs, vec!["10.100.0.0/16".parse().unwrap()]);
    assert!(c.netfilter.ipvs.strict_arp);
    assert_eq!(
        (c.netfilter.ipvs.tcp_timeout, c.netfilter.ipvs.tcp_fin_timeout, c.netfilter.ipvs.udp_timeout),
        (Some(Duration::from_secs(900)), Some(Duration::from_secs(120)), Some(Duration::from_secs(300)))
    );
    assert_eq!(c.netfilter.for_mode(ProxyMode::Nftables).mark(), "0x8000");
    assert!(c.netfilter.for_mode(ProxyMode::Nftables).masquerade_all);
    assert!(!c.netfilter.for_mode(ProxyMode::Iptables).masquerade_all);
    assert_eq!(c.common.conntrack.max_per_core, Some(65536));
    assert_eq!(c.common.conntrack.min, Some(262144));
    assert!(c.common.conntrack.tcp_be_liberal);
    assert_eq!(c.ct_lifetimes().tcp_half_closed_ns, 3600 * 1_000_000_000);
    assert_eq!(c.ct_lifetimes().udp_stream_ns, 180 * 1_000_000_000);
    assert_eq!(c.netfilter.detect_local, DetectLocal::InterfaceNamePrefix("cali".into()));
    assert_eq!(c.ebpf.pod_devices, vec!["cali*"], "the prefix names the eBPF mode's pod interfaces too");
    assert_eq!(c.common.log_format, LogFormat::Json);
    assert_eq!(c.common.log_verbosity, Some(4));
    assert_eq!(c.common.resync, Duration::from_secs(600));
    let unused = c.unused_in(ProxyMode::Ebpf);
    for f in
        ["clusterCIDR", "ipvs.scheduler", "nftables.masqueradeAll", "conntrack.maxPerCore", "conntrack.tcpBeLiberal", "detectLocalMode"]
    {
        assert!(unused.contains(&f), "{f} is not used in eBPF mode: {unused:?}");
    }
    for f in
        ["conntrack.udpStreamTimeout", "conntrack.tcpCloseWaitTimeout", "detectLocal.interfaceNamePrefix", "logging.format", "bindAddress"]
    {
        assert!(!unused.contains(&f), "{f} is used in eBPF mode: {unused:?}");
    }
}

#[test]
fn what_no_mode_uses_is_named_in_every_mode() {
    let text =
        format!("{HEAD}featureGates:\n  SomeGate: true\nenableProfiling: true\nportRange: 30000-32767\nwinkernel:\n  enableDSR: true\n");
    let (c, _) = resolve(&text, Flags::default()).unwrap();
    for mode in ProxyMode::ALL {
        assert_eq!(c.unused_in(mode), vec!["featureGates", "enableProfiling", "portRange", "winkernel"], "{mode}");
    }
}

#[test]
fn bad_values_are_errors_that_name_the_field() {
    let cases = [
        ("mode: userspace\n", "mode"),
        ("bindAddress: nowhere\n", "bindAddress"),
        ("metricsBindAddress: here:there\n", "metricsBindAddress"),
        ("nodePortAddresses: [10.0.0.0/33]\n", "nodePortAddresses"),
        ("clusterCIDR: 10.244.0.0\n", "clusterCIDR"),
        ("iptables:\n  masqueradeBit: 32\n", "iptables.masqueradeBit"),
        ("ipvs:\n  scheduler: fastest\n", "ipvs.scheduler"),
        ("oomScoreAdj: -2000\n", "oomScoreAdj"),
        ("conntrack:\n  maxPerCore: -1\n", "conntrack.maxPerCore"),
        ("detectLocalMode: Magic\n", "detectLocalMode"),
        ("detectLocalMode: BridgeInterface\n", "bridgeInterface"),
        // Written into every rule set: iptables and nft would refuse them, and so every write.
        ("detectLocalMode: BridgeInterface\ndetectLocal:\n  bridgeInterface: 'br0\" accept'\n", "bridgeInterface"),
        ("detectLocalMode: BridgeInterface\ndetectLocal:\n  bridgeInterface: a-bridge-name-too-long\n", "1 to 15 bytes"),
        ("detectLocal:\n  interfaceNamePrefix: 'veth\\n'\n", "interfaceNamePrefix"),
        ("detectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  interfaceNamePrefix: 'veth*'\n", "interfaceNamePrefix"),
        ("detectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  interfaceNamePrefix: 'a-prefix-long15'\n", "1 to 14 bytes"),
        ("logging:\n  format: xml\n", "logging.format"),
        ("iptables:\n  syncPeriod: soon\n", "iptables.syncPeriod"),
        ("iptables:\n  syncPeriod: 18446744073709551615s\n", "iptables.syncPeriod"),
        ("nftables:\n  minSyncPeriod: 10000000000000000000s\n", "nftables.minSyncPeriod"),
    ];
    for (body, field) in cases {
        let err = resolve(&format!("{HEAD}{body}"), Flags::default()).unwrap_err();
        assert!(err.contains(field), "{body:?}: the error names {field}: {err}");
    }
    let ok =
        resolve(&format!("{HEAD}detectLocalMode: BridgeInterface\ndetectLocal:\n  bridgeInterface: cni0.100@x_y-z\n"), Flags::default());
    assert!(ok.is_ok(), "an ordinary interface name is taken: {:?}", ok.err());
    let err = resolve(HEAD, Flags { pod_bridge_interface: Some("br 0".into()), ..Default::default() }).unwrap_err();
    assert!(err.contains("--pod-bridge-interface"), "a flag's value is named by the flag too: {err}");
    let err = Config::resolve(Flags { config: Some("/nonexistent/config.conf".into()), ..Default::default() }, || "h".into()).unwrap_err();
    assert!(err.contains("/nonexistent/config.conf"), "{err}");
}

#[test]
fn unknown_fields_are_named_and_the_rest_applies() {
    let (c, notes) = resolve(&format!("{HEAD}mode: nftables\nnftables:\n  syncPeriodd: 1m\n"), Flags::default()).unwrap();
    assert_eq!(c.common.proxy_mode, Some(ProxyMode::Nftables));
    assert_eq!(notes.len(), 1);
    assert!(notes[0].contains("nftables.syncPeriodd"), "{notes:?}");
}
