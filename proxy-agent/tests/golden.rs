//! Golden tests: the rules rendered for a set of Services and EndpointSlices match what
//! kube-proxy produces for the same objects, compared as kube-proxy's own unit tests compare
//! (order-insensitive where kube-proxy's output order is not defined). The expected files were
//! written from kube-proxy's documented rule format (see tests/golden/README.md).

use std::{net::Ipv4Addr, path::Path};

use proxy_agent::{
    dataplane::netfilter::{iptables, nftables, LocalTraffic, NodeContext},
    model::store::Cidr,
    rules::services_of,
};

/// kube-proxy's own test fixtures use NodePorts (3001, ...) outside the API server's default
/// range, which its proxier does not check: the range is not checked here.
const FIXTURE_RULES: proxy_agent::model::validate::Rules = proxy_agent::model::validate::Rules { node_port_range: None };

fn golden(case: &str, file: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(case).join(file)).expect("golden file")
}

fn comment_of(rule: &str) -> Option<String> {
    let rest = &rule[rule.find("--comment ")? + "--comment ".len()..];
    Some(match rest.strip_prefix('"') {
        Some(q) => q[..q.find('"')?].to_string(),
        None => rest.split(' ').next()?.to_string(),
    })
}

/// The Service port a rule belongs to, by its comment: text up to the first space.
/// kube-proxy's own normaliser keys on the Service (up to the first colon too) because its
/// tests have one port per Service; with several ports, kube-proxy emits the ports of a
/// Service in Go map order (undefined), so the ports are ordered by name here, and the rules
/// of one port keep their order.
fn service_of(comment: &str) -> String {
    comment.split(' ').next().unwrap_or("").to_string()
}

/// kube-proxy's test normalisation of iptables-restore input: tables by name; chains with
/// KUBE-NODEPORTS, KUBE-SERVICES first, then KUBE-* and others by name; rules grouped by
/// chain in their order, KUBE-NODEPORTS and KUBE-SERVICES rules stably sorted by Service port
/// (the nodeports catch-all last); deleted chains as -X lines.
fn normalize_iptables(text: &str) -> String {
    struct Table {
        name: String,
        chains: Vec<String>,
        rules: std::collections::BTreeMap<String, Vec<String>>,
        deleted: Vec<String>,
    }
    let mut tables: Vec<Table> = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(name) = line.strip_prefix('*') {
            tables.push(Table { name: name.into(), chains: vec![], rules: Default::default(), deleted: vec![] });
            continue;
        }
        let Some(t) = tables.last_mut() else { continue };
        if let Some(decl) = line.strip_prefix(':') {
            let c = decl.split(' ').next().unwrap().to_string();
            if !t.chains.contains(&c) {
                t.chains.push(c.clone());
                t.rules.insert(c, vec![]);
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let c = rule.split(' ').next().unwrap().to_string();
            t.rules.entry(c).or_default().push(line.to_string());
        } else if let Some(c) = line.strip_prefix("-X ") {
            t.deleted.push(c.to_string());
        }
    }
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    let rank = |c: &str| match c {
        "KUBE-NODEPORTS" => (0, String::new()),
        "KUBE-SERVICES" => (1, String::new()),
        c if c.starts_with("KUBE-") => (2, c.to_string()),
        c => (3, c.to_string()),
    };
    let mut out = Vec::new();
    for mut t in tables {
        t.chains.sort_by_key(|c| rank(c));
        for chain in ["KUBE-NODEPORTS", "KUBE-SERVICES"] {
            let nat = t.name == "nat";
            if let Some(rules) = t.rules.get_mut(chain) {
                rules.sort_by_key(|r| {
                    let c = comment_of(r);
                    let last = nat && chain == "KUBE-SERVICES" && c.as_deref().is_some_and(|c| c.contains("must be the last rule"));
                    (last, c.map(|c| service_of(&c)).unwrap_or_default())
                });
            }
        }
        out.push(format!("*{}", t.name));
        for c in t.chains.iter().filter(|c| !t.deleted.contains(c)) {
            out.push(format!(":{c} - [0:0]"));
        }
        for c in t.chains.iter().filter(|c| !t.deleted.contains(c)) {
            out.extend(t.rules.get(c).cloned().unwrap_or_default());
        }
        out.extend(t.chains.iter().filter(|c| t.deleted.contains(c)).map(|c| format!("-X {c}")));
        out.push("COMMIT".into());
    }
    out.join("\n")
}

/// kube-proxy's test normalisation of an nftables dump: tables, chains, rules, sets, maps,
/// elements in that order; by object name; rules keep their order within a chain; other
/// objects of one name by their text.
fn normalize_nft(text: &str) -> String {
    let rank = |kind: &str| match kind {
        "table" => 0,
        "chain" => 1,
        "rule" => 2,
        "set" => 3,
        "map" => 4,
        "element" => 5,
        _ => 6,
    };
    let mut lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    lines.sort_by_key(|l| {
        let w: Vec<&str> = l.split(' ').collect();
        let kind = w.get(1).copied().unwrap_or("");
        let name = w.get(4).copied().unwrap_or("").to_string();
        let tail = if kind == "rule" { String::new() } else { l.to_string() };
        (rank(kind), name, tail)
    });
    lines.join("\n")
}

fn cidr(s: &str) -> Cidr {
    s.parse().unwrap()
}

fn assert_same(what: &str, got: &str, want: &str) {
    if got != want {
        let diff: Vec<String> = want
            .lines()
            .filter(|l| !got.lines().any(|g| g == *l))
            .map(|l| format!("- {l}"))
            .chain(got.lines().filter(|g| !want.lines().any(|l| l == *g)).map(|g| format!("+ {g}")))
            .collect();
        panic!("{what} differs from kube-proxy's (- missing, + extra):\n{}\n\nfull output:\n{got}", diff.join("\n"));
    }
}

fn iptables_case(case: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(case);
    let node = NodeContext {
        nodeport_ips: vec![],
        nodeport_all: true,
        local: LocalTraffic::Cidrs(vec![cidr("10.0.0.0/8")]),
        masquerade_all: false,
        node_ips: vec![Ipv4Addr::new(192, 168, 0, 2).into()],
        ..Default::default()
    };
    let (_, services) = services_of(&dir, "test-node", &node, FIXTURE_RULES).unwrap();
    let rendered = iptables::render(&services, &node, &iptables::IptablesOptions::upstream_fixture());
    let text = iptables::restore_text(&rendered, &|_| true, &Default::default());
    assert_same(&format!("{case}: iptables-restore input"), &normalize_iptables(&text), &normalize_iptables(&golden(case, "iptables.txt")));
}

/// kube-proxy's test node: 192.168.0.2, NodePorts on that address only.
fn fixture_node(local: LocalTraffic) -> NodeContext {
    let ip = Ipv4Addr::new(192, 168, 0, 2);
    NodeContext {
        nodeport_ips: vec![ip.into()],
        nodeport_all: false,
        local,
        masquerade_all: false,
        node_ips: vec![ip.into()],
        ..Default::default()
    }
}

fn nftables_case(case: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(case);
    let node = fixture_node(LocalTraffic::Cidrs(vec![cidr("10.0.0.0/8")]));
    let (_, services) = services_of(&dir, "test-node", &node, FIXTURE_RULES).unwrap();
    let opts = nftables::NftablesOptions { mark: "0x4000".into(), service_cidrs: vec![cidr("172.30.0.0/16")], ..Default::default() };
    let dump = nftables::render(&services, &node, &opts).dump();
    assert_same(&format!("{case}: nftables ruleset"), &normalize_nft(&dump), &normalize_nft(&golden(case, "nftables.txt")));
}

/// kube-proxy's TestOverall Services: ClusterIP, LoadBalancer with eTP=Local, NodePort,
/// externalIPs, source ranges with affinity, no endpoints.
#[test]
fn iptables_rules_match_kube_proxys_for_the_overall_case() {
    iptables_case("overall");
}

#[test]
fn nftables_rules_match_kube_proxys_for_the_overall_case() {
    nftables_case("overall");
}

/// Several ports per Service, TCP and UDP, targetPorts, one port without endpoints.
#[test]
fn iptables_rules_match_kube_proxys_for_services_with_several_ports() {
    iptables_case("multiport");
}

#[test]
fn nftables_rules_match_kube_proxys_for_services_with_several_ports() {
    nftables_case("multiport");
}

/// A dual-stack Service: kube-proxy runs a proxier per family, and each renders the Service's
/// cluster IP and EndpointSlice of its family. kube-proxy's TestDisableLocalhostNodePortsIPv4
/// and TestDisableLocalhostNodePortsIPv6 (no local-traffic detector, localhost NodePorts off)
/// give both halves; the case makes them one Service (see its manifests).
#[test]
fn iptables_rules_match_kube_proxys_for_a_dual_stack_service_in_each_family() {
    use proxy_agent::model::Family;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/dual-stack");
    let node = NodeContext {
        nodeport_ips: vec![],
        nodeport_all: true,
        local: LocalTraffic::Unknown,
        masquerade_all: false,
        node_ips: vec![Ipv4Addr::new(192, 168, 0, 2).into(), "2001:db8::1".parse().unwrap()],
        ..Default::default()
    };
    let (_, services) = services_of(&dir, "test-node", &node, FIXTURE_RULES).unwrap();
    for (family, file) in [(Family::V4, "iptables.txt"), (Family::V6, "ip6tables.txt")] {
        let opts = iptables::IptablesOptions {
            family,
            localhost_nodeports: false,
            nfacct: false,
            ..iptables::IptablesOptions::upstream_fixture()
        };
        let text = iptables::restore_text(&iptables::render(&services, &node.for_family(family), &opts), &|_| true, &Default::default());
        assert_same(&format!("dual-stack: {file}"), &normalize_iptables(&text), &normalize_iptables(&golden("dual-stack", file)));
    }
}

/// The nftables mode's two tables for a dual-stack ClusterIP Service (`ip kube-proxy` and `ip6
/// kube-proxy`, one per family as kube-proxy's per-family proxiers write them). The IPv6 half's
/// Service lines are those of kube-proxy's nftables TestNodePorts IPv6 case; the table's own
/// chains and rules are the IPv4 fixture's in kube-proxy's IPv6 form (see the case's README
/// entry).
#[test]
fn nftables_rules_match_kube_proxys_for_a_dual_stack_service_in_each_family() {
    use proxy_agent::model::Family;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/dual-stack-cluster-ip");
    let ips: Vec<std::net::IpAddr> = vec![Ipv4Addr::new(192, 168, 0, 2).into(), "2001:db8::1".parse().unwrap()];
    let node = NodeContext {
        nodeport_ips: ips.clone(),
        nodeport_all: false,
        local: LocalTraffic::Cidrs(vec![cidr("10.0.0.0/8"), cidr("fd00:10::/64")]),
        masquerade_all: false,
        node_ips: ips,
        ..Default::default()
    };
    let (_, services) = services_of(&dir, "test-node", &node, FIXTURE_RULES).unwrap();
    for (family, file) in [(Family::V4, "nftables.txt"), (Family::V6, "nftables6.txt")] {
        let opts = nftables::NftablesOptions {
            family,
            mark: "0x4000".into(),
            service_cidrs: vec![cidr("172.30.0.0/16"), cidr("fd00:172:30::/112")],
        };
        let dump = nftables::render(&services, &node.for_family(family), &opts).dump();
        assert_same(
            &format!("dual-stack-cluster-ip: {file}"),
            &normalize_nft(&dump),
            &normalize_nft(&golden("dual-stack-cluster-ip", file)),
        );
    }
}

/// A large nftables table is built Service by Service in several transactions (the kernel's
/// cost per transaction grows with its square); that relies on the ruleset of a set of
/// Services being the union of each Service's.
#[test]
fn an_nftables_ruleset_is_the_union_of_its_services_rulesets() {
    for case in ["overall", "multiport"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(case);
        let node = fixture_node(LocalTraffic::Cidrs(vec![cidr("10.0.0.0/8")]));
        let (_, services) = services_of(&dir, "test-node", &node, FIXTURE_RULES).unwrap();
        let opts = nftables::NftablesOptions { mark: "0x4000".into(), service_cidrs: vec![cidr("172.30.0.0/16")], ..Default::default() };
        let whole = nftables::render(&services, &node, &opts);
        let mut union = nftables::Ruleset { base: whole.base.clone(), ..Default::default() };
        for (k, v) in &services {
            let one = nftables::render(&[(k.clone(), v.clone())].into_iter().collect(), &node, &opts);
            assert_eq!(one.base, whole.base, "{case}: the base does not depend on the Services");
            union.chains.extend(one.chains);
            union.sets.extend(one.sets);
            union.elements.extend(one.elements);
        }
        assert!(services.len() > 1);
        assert_eq!(union, whole, "{case}");
    }
}

/// kube-proxy's local traffic detectors (`detectLocalMode`): what "from a pod" means in the
/// masquerade and short-circuit rules, for a cluster CIDR, a bridge and an interface prefix.
#[test]
fn local_traffic_is_told_as_detect_local_mode_says() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/overall");
    let cases = [
        (
            LocalTraffic::Cidrs(vec![cidr("10.0.0.0/8")]),
            "! -s 10.0.0.0/8",
            "-s 10.0.0.0/8 -j KUBE-SVC",
            "ip saddr != 10.0.0.0/8",
            "ip saddr 10.0.0.0/8 goto",
        ),
        (LocalTraffic::Interface("cbr0".into()), "! -i cbr0", "-i cbr0 -j KUBE-SVC", "iifname != \"cbr0\"", "iifname \"cbr0\" goto"),
        (
            LocalTraffic::InterfacePrefix("veth".into()),
            "! -i veth+",
            "-i veth+ -j KUBE-SVC",
            "iifname != \"veth*\"",
            "iifname \"veth*\" goto",
        ),
    ];
    for (local, ipt_not_local, ipt_local, nft_not_local, nft_local) in cases {
        let node = NodeContext {
            nodeport_ips: vec![],
            nodeport_all: true,
            local: local.clone(),
            masquerade_all: false,
            node_ips: vec![Ipv4Addr::new(192, 168, 0, 2).into()],
            ..Default::default()
        };
        let (_, services) = services_of(&dir, "test-node", &node, FIXTURE_RULES).unwrap();
        let ipt = iptables::restore_text(
            &iptables::render(&services, &node, &iptables::IptablesOptions::default()),
            &|_| true,
            &Default::default(),
        );
        assert!(ipt.contains(&format!("--dport 80 {ipt_not_local} -j KUBE-MARK-MASQ")), "{local:?}: cluster IP masquerade:\n{ipt}");
        assert!(ipt.contains(ipt_local), "{local:?}: eTP Local short-circuit of pod traffic:\n{ipt}");
        let nft = nftables::render(&services, &node, &nftables::NftablesOptions::default()).dump();
        assert!(nft.contains(&format!("{nft_not_local} jump mark-for-masquerade")), "{local:?}:\n{nft}");
        assert!(nft.contains(nft_local), "{local:?}:\n{nft}");
    }
    // Nothing known (ClusterCIDR without a clusterCIDR): nothing is local, no such rule.
    let node = NodeContext {
        nodeport_ips: vec![],
        nodeport_all: true,
        local: LocalTraffic::Unknown,
        masquerade_all: false,
        node_ips: vec![Ipv4Addr::new(192, 168, 0, 2).into()],
        ..Default::default()
    };
    let (_, services) = services_of(&dir, "test-node", &node, FIXTURE_RULES).unwrap();
    let ipt =
        iptables::restore_text(&iptables::render(&services, &node, &iptables::IptablesOptions::default()), &|_| true, &Default::default());
    assert!(!ipt.contains("cluster IP\" -m tcp -p tcp -d 172.30.0.41 --dport 80 !"), "{ipt}");
}

/// Every dotted quad of `text` with its parts zero-padded to three digits (`10.0.0.1` becomes
/// `010.000.000.001`), as objects stored before Go 1.17 may hold them.
fn zero_padded(text: &str) -> String {
    let mut out = String::new();
    let mut token = String::new();
    let flush = |token: &mut String, out: &mut String| {
        let parts: Vec<&str> = token.split('.').collect();
        if parts.len() == 4 && parts.iter().all(|p| !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit())) {
            out.push_str(&parts.iter().map(|p| format!("{p:0>3}")).collect::<Vec<_>>().join("."));
        } else {
            out.push_str(token);
        }
        token.clear();
    };
    for c in text.chars() {
        if c.is_ascii_digit() || c == '.' {
            token.push(c);
        } else {
            flush(&mut token, &mut out);
            out.push(c);
        }
    }
    flush(&mut token, &mut out);
    out
}

/// kube-proxy reads addresses with ParseIPSloppy: objects whose addresses carry leading zeros
/// get exactly the rules of the same objects written canonically, in both modes.
#[test]
fn addresses_with_leading_zeros_render_the_same_rules_in_both_modes() {
    let original = golden("overall", "manifests.yaml");
    let padded = zero_padded(&original);
    assert!(padded.contains("172.030.000.041") && padded != original, "the manifests must hold padded addresses");
    let guard = tempfile::Builder::new().prefix("golden-sloppy-").tempdir().unwrap();
    let dir = guard.path();
    std::fs::write(dir.join("manifests.yaml"), &padded).unwrap();
    let node = fixture_node(LocalTraffic::Cidrs(vec![cidr("010.0.0.0/08")]));
    let (_, services) = services_of(dir, "test-node", &node, FIXTURE_RULES).unwrap();
    let ipt = iptables::restore_text(
        &iptables::render(&services, &node, &iptables::IptablesOptions::upstream_fixture()),
        &|_| true,
        &Default::default(),
    );
    let opts = nftables::NftablesOptions { mark: "0x4000".into(), service_cidrs: vec![cidr("172.30.0.0/16")], ..Default::default() };
    let nft = nftables::render(&services, &node, &opts).dump();
    let canonical_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/overall");
    let (_, canonical) = services_of(&canonical_dir, "test-node", &node, FIXTURE_RULES).unwrap();
    assert_eq!(services.len(), canonical.len(), "every Service is read");
    assert_same(
        "iptables rules of zero-padded objects",
        &ipt,
        &iptables::restore_text(
            &iptables::render(&canonical, &node, &iptables::IptablesOptions::upstream_fixture()),
            &|_| true,
            &Default::default(),
        ),
    );
    assert_same("nftables rules of zero-padded objects", &nft, &nftables::render(&canonical, &node, &opts).dump());
    assert!(nft.contains("172.30.0.41") && !nft.contains("172.030"), "{nft}");
}

/// `rules` as `run`: the node IP (which decides whether load-balancer source ranges admit the
/// node) comes from the Node's InternalIP, NodePorts from `--nodeport-addresses` (every local
/// address by default, however many addresses `--node-ip` lists), as kube-proxy keeps the two
/// apart.
#[test]
fn rules_take_the_node_ip_from_the_node_and_nodeports_from_the_flag() {
    let guard = tempfile::Builder::new().prefix("golden-nodeip-").tempdir().unwrap();
    let dir = guard.path();
    let objects = |internal_ip: &str| {
        format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: lab-node}}\nstatus: {{addresses: [{{type: InternalIP, address: {internal_ip}}}]}}\n---\n\
             apiVersion: v1\nkind: Service\nmetadata: {{name: lb, namespace: ns}}\nspec: {{type: LoadBalancer, clusterIP: 172.30.0.50, loadBalancerSourceRanges: [192.168.0.0/24], ports: [{{name: p, port: 80, nodePort: 30080}}]}}\nstatus: {{loadBalancer: {{ingress: [{{ip: 203.0.113.9}}]}}}}\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: lb-1, namespace: ns, labels: {{kubernetes.io/service-name: lb}}}}\naddressType: IPv4\nports: [{{name: p, port: 80}}]\nendpoints: [{{addresses: [10.180.0.1]}}]\n"
        )
    };
    let cfg = |extra: proxy_agent::config::Flags| {
        proxy_agent::config::Config::resolve(proxy_agent::config::Flags { hostname_override: Some("lab-node".into()), ..extra }, || {
            "h".into()
        })
        .unwrap()
        .0
    };
    let node_ips = [Ipv4Addr::new(192, 168, 0, 2).into(), Ipv4Addr::new(10, 0, 0, 5).into()];
    let admitted = "-s 203.0.113.9 -j KUBE-EXT";
    std::fs::write(dir.join("objects.yaml"), objects("192.168.0.2")).unwrap();
    let text = proxy_agent::rules::print(proxy_agent::dataplane::ProxyMode::Iptables, dir, &cfg(Default::default()), &node_ips).unwrap();
    assert!(text.contains(admitted), "the range holds the Node's InternalIP: the LB IP is admitted:\n{text}");
    assert!(
        text.contains("-m addrtype --dst-type LOCAL") && !text.contains("-d 10.0.0.5"),
        "NodePorts on every local address, as run serves them:\n{text}"
    );
    // The node IP elsewhere: the range no longer admits the node, although it holds one of the
    // node's addresses.
    std::fs::write(dir.join("objects.yaml"), objects("10.0.0.5")).unwrap();
    let text = proxy_agent::rules::print(proxy_agent::dataplane::ProxyMode::Iptables, dir, &cfg(Default::default()), &node_ips).unwrap();
    assert!(!text.contains(admitted), "{text}");
    // --bind-address names the node IP over the Node's.
    let flags = proxy_agent::config::Flags { bind_address: Some("192.168.0.2".parse().unwrap()), ..Default::default() };
    let text = proxy_agent::rules::print(proxy_agent::dataplane::ProxyMode::Nftables, dir, &cfg(flags), &node_ips).unwrap();
    assert!(text.contains("ip saddr != { 192.168.0.0/24 , 203.0.113.9 } drop"), "{text}");
}

/// A dual-stack Service rendered per family: each family's rules hold only its own addresses,
/// and the IPv6 ones are written as kube-proxy's IPv6 proxier writes them (`ip6 kube-proxy`,
/// `ipv6_addr`, endpoint chains with the colons of the address as dots, `[addr]:port`
/// DNAT targets, NodePorts never on ::1).
#[test]
fn each_family_renders_its_own_addresses_in_kube_proxys_ipv6_form() {
    use proxy_agent::model::Family;
    let guard = tempfile::Builder::new().prefix("golden-dual-stack-").tempdir().unwrap();
    let dir = guard.path();
    std::fs::write(
        dir.join("objects.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: ns1}\nspec: {type: NodePort, clusterIP: 172.30.0.41, clusterIPs: [172.30.0.41, 'fd00:172:30::41'], ipFamilies: [IPv4, IPv6], ports: [{name: p80, port: 80, nodePort: 3001}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-v4, namespace: ns1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: p80, port: 80}]\nendpoints: [{addresses: [10.180.0.1]}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-v6, namespace: ns1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv6\nports: [{name: p80, port: 80}]\nendpoints: [{addresses: ['fd00:10:180::1']}, {addresses: ['fd00:10:180::2']}]\n",
    )
    .unwrap();
    let node = NodeContext {
        nodeport_ips: vec![],
        nodeport_all: true,
        local: LocalTraffic::Cidrs(vec![cidr("10.0.0.0/8"), cidr("fd00:10::/32")]),
        masquerade_all: false,
        node_ips: vec![Ipv4Addr::new(192, 168, 0, 2).into(), "fd00::2".parse().unwrap()],
        ..Default::default()
    };
    let (_, services) = services_of(dir, "test-node", &node, FIXTURE_RULES).unwrap();
    let (v4, v6) = (node.for_family(Family::V4), node.for_family(Family::V6));
    let ipt = |family, node: &NodeContext| {
        let opts = iptables::IptablesOptions { family, ..iptables::IptablesOptions::upstream_fixture() };
        iptables::restore_text(&iptables::render(&services, node, &opts), &|_| true, &Default::default())
    };
    let nft =
        |family, node: &NodeContext| nftables::render(&services, node, &nftables::NftablesOptions { family, ..Default::default() }).dump();
    let (ipt4, ipt6, nft4, nft6) = (ipt(Family::V4, &v4), ipt(Family::V6, &v6), nft(Family::V4, &v4), nft(Family::V6, &v6));
    for text in [&ipt4, &nft4] {
        assert!(
            text.contains("172.30.0.41") && text.contains("10.180.0.1") && !text.contains("fd00"),
            "IPv4 rules, IPv4 addresses:\n{text}"
        );
    }
    for text in [&ipt6, &nft6] {
        assert!(text.contains("fd00:172:30::41") && !text.contains("172.30.0.41") && !text.contains("10.180.0.1"), "IPv6 rules:\n{text}");
    }
    for line in [
        "-A KUBE-SERVICES -m comment --comment \"ns1/web:p80 cluster IP\" -m tcp -p tcp -d fd00:172:30::41 --dport 80 -j KUBE-SVC-",
        "-m tcp -p tcp -j DNAT --to-destination [fd00:10:180::1]:80",
        "-s fd00:10:180::2 -j KUBE-MARK-MASQ",
        "-m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS",
        "! -s fd00:10::/32 -j KUBE-MARK-MASQ",
    ] {
        assert!(ipt6.contains(line), "ip6tables input lacks {line:?}:\n{ipt6}");
    }
    assert!(!ipt6.contains("127.0.0.0/8") && !ipt6.contains("block incoming localnet"), "no localhost NodePorts in IPv6:\n{ipt6}");
    for line in [
        "add table ip6 kube-proxy",
        "add set ip6 kube-proxy cluster-ips { type ipv6_addr ; comment \"Active ClusterIPs\" ; }",
        "add rule ip6 kube-proxy services ip6 daddr . meta l4proto . th dport vmap @service-ips",
        "add rule ip6 kube-proxy services fib daddr type local ip6 daddr != ::1 meta l4proto . th dport vmap @service-nodeports",
        "__fd00.10.180..1/80",
        "meta l4proto tcp dnat to [fd00:10:180::2]:80",
        "ip6 daddr fd00:172:30::41 ip6 saddr != fd00:10::/32 jump mark-for-masquerade",
        "add element ip6 kube-proxy cluster-ips { fd00:172:30::41 }",
    ] {
        assert!(nft6.contains(line), "ip6 kube-proxy lacks {line:?}:\n{nft6}");
    }
}
