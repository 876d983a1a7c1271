//! iptables mode, in kube-proxy's layout: `KUBE-SERVICES` -> `KUBE-SVC-*` / `KUBE-SVL-*` /
//! `KUBE-EXT-*` / `KUBE-FW-*` -> `KUBE-SEP-*` in the nat table, REJECT and DROP for Services
//! without (local) endpoints in the filter table, chain names hashed exactly as kube-proxy
//! hashes them, random selection by `statistic`, ClientIP affinity by `recent`. Applied with
//! `iptables-restore --noflush`: the fixed chains every time, a Service's own chains only when
//! they changed, and chains of Services that went away deleted. One `IptablesRules` per family:
//! IPv6 goes to ip6tables with the same chain names, as kube-proxy's IPv6 proxier writes it.

use std::collections::{BTreeMap, BTreeSet};

use super::{
    delete_jumps, ensure_jumps, hash_name, iptables_restore, run, Iptables, Jump, NetfilterError, NodeContext, Plan, RuleSet, Services,
    Tools, IPTABLES_PACKAGE,
};
use crate::{dataplane::ProxyMode, model::Family};

/// Host-dependent choices kube-proxy makes by probing (make them explicit for tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IptablesOptions {
    /// The masquerade mark, as written in rules.
    pub mark: String,
    /// NodePorts on 127.0.0.1 (needs `route_localnet`; kube-proxy's default when
    /// `--nodeport-addresses` is unset). Off here by default: it is CVE-2020-8558's surface.
    pub localhost_nodeports: bool,
    /// The nfacct counters kube-proxy adds exist (`xt_nfacct`).
    pub nfacct: bool,
    /// MASQUERADE `--random-fully`.
    pub random_fully: bool,
    /// Drop conntrack-INVALID forwarded packets (off when `nf_conntrack_tcp_be_liberal`).
    pub drop_invalid: bool,
    /// The family rendered (iptables or ip6tables).
    pub family: Family,
}

impl Default for IptablesOptions {
    fn default() -> Self {
        Self {
            mark: "0x4000".into(),
            localhost_nodeports: false,
            nfacct: false,
            random_fully: true,
            drop_invalid: true,
            family: Family::V4,
        }
    }
}

impl IptablesOptions {
    /// The options kube-proxy's own unit tests use (for golden comparisons).
    pub fn upstream_fixture() -> Self {
        Self { mark: "0x4000".into(), localhost_nodeports: true, nfacct: true, random_fully: false, drop_invalid: true, family: Family::V4 }
    }
}

/// `KUBE-SVC-`/`SVL-`/`EXT-`/`FW-` suffix of a service port.
pub fn port_hash(spn: &str, proto: &str) -> String {
    hash_name(&format!("{spn}{proto}"), 16)
}

/// `KUBE-SEP-` suffix of an endpoint of a service port.
pub fn endpoint_hash(spn: &str, proto: &str, endpoint: &str) -> String {
    hash_name(&format!("{spn}{proto}{endpoint}"), 16)
}

/// Quotes a comment of several words, as kube-proxy writes it.
fn comment(text: &str) -> String {
    if text.contains(' ') {
        format!("-m comment --comment \"{text}\"")
    } else {
        format!("-m comment --comment {text}")
    }
}

/// One table of the restore input: chains in declaration order, rules in emission order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    /// Chains in the order they were first declared.
    pub chains: Vec<String>,
    pub rules: Vec<(String, String)>,
    /// The same names, for the membership test (tens of thousands of chains at scale).
    declared: std::collections::HashSet<String>,
}

impl Table {
    fn chain(&mut self, name: impl Into<String>) {
        let name = name.into();
        if self.declared.insert(name.clone()) {
            self.chains.push(name);
        }
    }

    fn rule(&mut self, chain: &str, rule: impl Into<String>) {
        self.rules.push((chain.to_string(), rule.into()));
    }

    /// The rules of each chain, in order.
    pub fn by_chain(&self) -> BTreeMap<String, Vec<String>> {
        let mut m: BTreeMap<String, Vec<String>> = self.chains.iter().map(|c| (c.clone(), Vec::new())).collect();
        for (c, r) in &self.rules {
            m.entry(c.clone()).or_default().push(r.clone());
        }
        m
    }
}

/// The complete desired state of both tables.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rendered {
    pub filter: Table,
    pub nat: Table,
}

const FILTER_FIXED: [&str; 5] = ["KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-FORWARD", "KUBE-NODEPORTS", "KUBE-PROXY-FIREWALL"];
const NAT_FIXED: [&str; 4] = ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"];
const NODEPORTS_LAST: &str = "kubernetes service nodeports; NOTE: this must be the last rule in this chain";
/// Prefixes of the per-Service chains (what stale-chain cleanup looks for).
pub(super) const SERVICE_CHAIN_PREFIXES: [&str; 5] = ["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-"];

/// kube-proxy omits per-endpoint comments past this many endpoints in total.
const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// Renders every Service's rules of the options' family (`node` is that family's view).
pub fn render(services: &Services, node: &NodeContext, opts: &IptablesOptions) -> Rendered {
    // NodePorts on localhost need route_localnet, which IPv6 has no counterpart of: kube-proxy
    // never serves them on ::1.
    let opts = &IptablesOptions { localhost_nodeports: opts.localhost_nodeports && opts.family == Family::V4, ..opts.clone() };
    let ports = || services.values().flatten().filter(|p| p.family == opts.family);
    let mut out = Rendered::default();
    let (f, n) = (&mut out.filter, &mut out.nat);
    for c in FILTER_FIXED {
        f.chain(c);
    }
    if opts.localhost_nodeports {
        f.chain("KUBE-FIREWALL");
        f.rule(
            "KUBE-FIREWALL",
            "-m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
        );
    }
    for c in NAT_FIXED {
        n.chain(c);
    }
    let mark = &opts.mark;
    n.rule("KUBE-POSTROUTING", format!("-m mark ! --mark {mark}/{mark} -j RETURN"));
    n.rule("KUBE-POSTROUTING", format!("-j MARK --xor-mark {mark}"));
    n.rule(
        "KUBE-POSTROUTING",
        format!(
            "-m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE{}",
            if opts.random_fully { " --random-fully" } else { "" }
        ),
    );
    n.rule("KUBE-MARK-MASQ", format!("-j MARK --or-mark {mark}"));

    let total_endpoints: usize = ports().map(|p| p.reachable_endpoints().len()).sum();
    let large = total_endpoints > LARGE_CLUSTER_ENDPOINTS;
    for port in ports() {
        render_port(&Plan::new(port), node, opts, large, f, n);
    }

    if opts.drop_invalid {
        f.rule(
            "KUBE-FORWARD",
            format!(
                "-m conntrack --ctstate INVALID{} -j DROP",
                if opts.nfacct { " -m nfacct --nfacct-name ct_state_invalid_dropped_pkts" } else { "" }
            ),
        );
    }
    f.rule("KUBE-FORWARD", format!("-m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"));
    f.rule(
        "KUBE-FORWARD",
        "-m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    );
    if node.nodeport_all {
        let not_localhost = if opts.localhost_nodeports { String::new() } else { format!(" ! -d {}", opts.family.loopback()) };
        n.rule("KUBE-SERVICES", format!("{} -m addrtype --dst-type LOCAL{not_localhost} -j KUBE-NODEPORTS", comment(NODEPORTS_LAST)));
    } else {
        for ip in node.nodeport_ips.iter().filter(|ip| !ip.is_loopback() || opts.localhost_nodeports) {
            n.rule("KUBE-SERVICES", format!("{} -d {ip} -j KUBE-NODEPORTS", comment(NODEPORTS_LAST)));
        }
    }
    out
}

fn render_port(p: &Plan, node: &NodeContext, opts: &IptablesOptions, large: bool, f: &mut Table, n: &mut Table) {
    let Some(cluster_ip) = p.cluster_ip else { return };
    let (spn, proto, port) = (&p.spn, p.proto, p.port.port);
    let h = port_hash(spn, proto);
    let svc = format!("KUBE-SVC-{h}");
    let svl = format!("KUBE-SVL-{h}");
    let ext = format!("KUBE-EXT-{h}");
    let fw = format!("KUBE-FW-{h}");
    let int_chain = if p.port.internal_local { &svl } else { &svc };
    let ext_policy = if p.port.external_local { &svl } else { &svc };
    let m = format!("-m {proto} -p {proto}");
    let (no_ep_comment, no_ep_target) =
        if p.has_endpoints { (format!("{spn} has no local endpoints"), "DROP") } else { (format!("{spn} has no endpoints"), "REJECT") };
    let rejected = |f: &mut Table, chain: &str, dst: &str| {
        f.rule(chain, format!("{} {m} {dst} --dport {port} -j {no_ep_target}", comment(&no_ep_comment)));
    };

    // filter
    if !p.has_internal_endpoints {
        rejected(f, "KUBE-SERVICES", &format!("-d {cluster_ip}"));
    }
    for ip in &p.port.external_ips {
        if !p.has_external_endpoints {
            rejected(f, "KUBE-EXTERNAL-SERVICES", &format!("-d {ip}"));
        }
    }
    let uses_fw = p.has_endpoints && p.has_firewall;
    for ip in &p.port.lb_ips {
        if uses_fw {
            f.rule(
                "KUBE-PROXY-FIREWALL",
                format!("{} {m} -d {ip} --dport {port} -j DROP", comment(&format!("{spn} traffic not accepted by {fw}"))),
            );
        }
    }
    for ip in &p.port.lb_ips {
        if !p.has_external_endpoints {
            rejected(f, "KUBE-EXTERNAL-SERVICES", &format!("-d {ip}"));
        }
    }
    if let Some(np) = p.port.node_port {
        if !p.has_external_endpoints {
            f.rule(
                "KUBE-EXTERNAL-SERVICES",
                format!("{} -m addrtype --dst-type LOCAL {m} --dport {np} -j {no_ep_target}", comment(&no_ep_comment)),
            );
        }
    }
    if let Some(hc) = p.port.health_check_node_port {
        f.rule("KUBE-NODEPORTS", format!("{} -m tcp -p tcp --dport {hc} -j ACCEPT", comment(&format!("{spn} health check node port"))));
    }

    // nat: chains
    if p.uses_external_chain {
        n.chain(&ext);
    }
    if uses_fw {
        n.chain(&fw);
    }
    if p.uses_cluster_chain {
        n.chain(&svc);
    }
    if p.uses_local_chain {
        n.chain(&svl);
    }
    for e in &p.reachable {
        n.chain(format!("KUBE-SEP-{}", endpoint_hash(spn, proto, &e.socket().to_string())));
    }

    // nat: dispatch
    if p.has_internal_endpoints {
        n.rule("KUBE-SERVICES", format!("{} {m} -d {cluster_ip} --dport {port} -j {int_chain}", comment(&format!("{spn} cluster IP"))));
    }
    if p.has_endpoints {
        for ip in &p.port.external_ips {
            n.rule("KUBE-SERVICES", format!("{} {m} -d {ip} --dport {port} -j {ext}", comment(&format!("{spn} external IP"))));
        }
        for ip in &p.port.lb_ips {
            let to = if uses_fw { &fw } else { &ext };
            n.rule("KUBE-SERVICES", format!("{} {m} -d {ip} --dport {port} -j {to}", comment(&format!("{spn} loadbalancer IP"))));
        }
        if let Some(np) = p.port.node_port {
            if opts.localhost_nodeports && opts.nfacct {
                n.rule(
                    "KUBE-NODEPORTS",
                    format!(
                        "{} {m} -d 127.0.0.0/8 --dport {np} -m nfacct --nfacct-name localhost_nps_accepted_pkts -j {ext}",
                        comment(spn)
                    ),
                );
            }
            n.rule("KUBE-NODEPORTS", format!("{} {m} --dport {np} -j {ext}", comment(spn)));
        }
    }
    if p.has_internal_endpoints {
        let c = comment(&format!("{spn} cluster IP"));
        if node.masquerade_all {
            n.rule(int_chain, format!("{c} {m} -d {cluster_ip} --dport {port} -j KUBE-MARK-MASQ"));
        } else if let Some(not_local) = node.local.iptables(true) {
            n.rule(int_chain, format!("{c} {m} -d {cluster_ip} --dport {port} {not_local} -j KUBE-MARK-MASQ"));
        }
    }
    if p.uses_external_chain {
        if !p.port.external_local {
            n.rule(&ext, format!("{} -j KUBE-MARK-MASQ", comment(&format!("masquerade traffic for {spn} external destinations"))));
        } else {
            if let Some(local) = node.local.iptables(false) {
                n.rule(&ext, format!("{} {local} -j {svc}", comment(&format!("pod traffic for {spn} external destinations"))));
            }
            n.rule(
                &ext,
                format!(
                    "{} -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
                    comment(&format!("masquerade LOCAL traffic for {spn} external destinations"))
                ),
            );
            n.rule(
                &ext,
                format!(
                    "{} -m addrtype --src-type LOCAL -j {svc}",
                    comment(&format!("route LOCAL traffic for {spn} external destinations"))
                ),
            );
        }
        if p.has_external_endpoints {
            n.rule(&ext, format!("-j {ext_policy}"));
        }
    }
    if uses_fw {
        let c = comment(&format!("{spn} loadbalancer IP"));
        for r in &p.port.lb_source_ranges {
            n.rule(&fw, format!("{c} -s {r} -j {ext}"));
        }
        let node_in_ranges = crate::model::Cidr::any_contains(&p.port.lb_source_ranges, &node.node_ips);
        if node_in_ranges {
            for ip in &p.port.lb_ips {
                n.rule(&fw, format!("{c} -s {ip} -j {ext}"));
            }
        }
        n.rule(&fw, comment(&format!("other traffic to {spn} will be dropped by KUBE-PROXY-FIREWALL")));
    }
    let ep_comment = |text: String| if large { String::new() } else { format!("{} ", comment(&text)) };
    let dispatch = |n: &mut Table, chain: &str, eps: &[crate::model::EndpointView]| {
        let names: Vec<(String, String)> = eps
            .iter()
            .map(|e| {
                let s = e.socket().to_string();
                (format!("KUBE-SEP-{}", endpoint_hash(spn, proto, &s)), s)
            })
            .collect();
        if let Some(t) = p.port.affinity_timeout {
            for (sep, s) in &names {
                n.rule(
                    chain,
                    format!("{}-m recent --name {sep} --rcheck --seconds {t} --reap -j {sep}", ep_comment(format!("{spn} -> {s}"))),
                );
            }
        }
        let count = names.len();
        for (i, (sep, s)) in names.iter().enumerate() {
            let c = ep_comment(format!("{spn} -> {s}"));
            if i + 1 < count {
                let prob = 1.0f64 / (count - i) as f64;
                n.rule(chain, format!("{c}-m statistic --mode random --probability {prob:.10} -j {sep}"));
            } else {
                n.rule(chain, format!("{c}-j {sep}"));
            }
        }
    };
    if p.uses_cluster_chain {
        dispatch(n, &svc, &p.cluster);
    }
    if p.uses_local_chain {
        dispatch(n, &svl, &p.local);
    }
    for e in &p.reachable {
        let s = e.socket().to_string();
        let sep = format!("KUBE-SEP-{}", endpoint_hash(spn, proto, &s));
        let c = if large { String::new() } else { format!("{} ", comment(spn)) };
        n.rule(&sep, format!("{c}-s {} -j KUBE-MARK-MASQ", e.addr));
        let recent = if p.port.affinity_timeout.is_some() { format!("-m recent --name {sep} --set ") } else { String::new() };
        n.rule(&sep, format!("{c}{recent}{m} -j DNAT --to-destination {s}"));
    }
}

/// The restore input. `declare`: the non-fixed nat chains to (re)write; `stale`: nat chains
/// to delete.
pub fn restore_text(r: &Rendered, declare: &dyn Fn(&str) -> bool, stale: &BTreeSet<String>) -> String {
    let mut s = String::from("*filter\n");
    for c in &r.filter.chains {
        s += &format!(":{c} - [0:0]\n");
    }
    for (c, rule) in &r.filter.rules {
        s += &format!("-A {c} {rule}\n");
    }
    s += "COMMIT\n*nat\n";
    let keep = |c: &str| NAT_FIXED.contains(&c) || declare(c);
    for c in r.nat.chains.iter().filter(|c| keep(c)) {
        s += &format!(":{c} - [0:0]\n");
    }
    for c in stale {
        s += &format!(":{c} - [0:0]\n");
    }
    let (last, body): (Vec<_>, Vec<_>) = r.nat.rules.iter().partition(|(c, rule)| c == "KUBE-SERVICES" && rule.contains(NODEPORTS_LAST));
    for (c, rule) in body.into_iter().filter(|(c, _)| keep(c)) {
        s += &format!("-A {c} {rule}\n");
    }
    for c in stale {
        s += &format!("-X {c}\n");
    }
    for (c, rule) in last {
        s += &format!("-A {c} {rule}\n");
    }
    s += "COMMIT\n";
    s
}

/// The jumps from the built-in chains into kube-proxy's chains: (table, chain, extra match,
/// comment, target), in the order kube-proxy ensures them (each is inserted at the top).
const JUMPS: [Jump; 12] = [
    ("filter", "INPUT", "-m conntrack --ctstate NEW", "kubernetes externally-visible service portals", "KUBE-EXTERNAL-SERVICES"),
    ("filter", "FORWARD", "-m conntrack --ctstate NEW", "kubernetes externally-visible service portals", "KUBE-EXTERNAL-SERVICES"),
    ("filter", "INPUT", "", "kubernetes health check service ports", "KUBE-NODEPORTS"),
    ("filter", "FORWARD", "-m conntrack --ctstate NEW", "kubernetes service portals", "KUBE-SERVICES"),
    ("filter", "OUTPUT", "-m conntrack --ctstate NEW", "kubernetes service portals", "KUBE-SERVICES"),
    ("filter", "FORWARD", "", "kubernetes forwarding rules", "KUBE-FORWARD"),
    ("filter", "INPUT", "-m conntrack --ctstate NEW", "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
    ("filter", "OUTPUT", "-m conntrack --ctstate NEW", "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
    ("filter", "FORWARD", "-m conntrack --ctstate NEW", "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
    ("nat", "OUTPUT", "", "kubernetes service portals", "KUBE-SERVICES"),
    ("nat", "PREROUTING", "", "kubernetes service portals", "KUBE-SERVICES"),
    ("nat", "POSTROUTING", "", "kubernetes postrouting rules", "KUBE-POSTROUTING"),
];

/// Programs iptables, remembering what it wrote so later syncs rewrite only what changed.
pub struct IptablesRules {
    opts: IptablesOptions,
    ipt: Tools,
    /// The nat chains written by the last successful apply, with their rules.
    applied: Option<BTreeMap<String, Vec<String>>>,
}

impl IptablesRules {
    pub fn new(ipt: Iptables) -> Self {
        Self::with_options(IptablesOptions::default(), ipt)
    }

    pub fn with_options(opts: IptablesOptions, ipt: Iptables) -> Self {
        let ipt = ipt.tools(opts.family);
        Self { opts, ipt, applied: None }
    }

    /// Creates the chains the jumps lead to (where missing) and the jumps.
    fn ensure_jumps(&self) -> Result<(), NetfilterError> {
        let mut created = BTreeSet::new();
        for (table, _, _, _, target) in JUMPS {
            if created.insert((table, target)) {
                let _ = run(self.ipt.cmd(), IPTABLES_PACKAGE, &["-w", "5", "-t", table, "-N", target]);
            }
        }
        ensure_jumps(self.ipt, &JUMPS)
    }
}

/// Per-Service nat chains in the kernel now (`iptables-save -t nat`).
fn service_chains_in_kernel(ipt: Tools) -> Result<BTreeSet<String>, NetfilterError> {
    let out = run(ipt.save(), IPTABLES_PACKAGE, &["-t", "nat"])?;
    Ok(super::declared_chains(&out).filter(|c| SERVICE_CHAIN_PREFIXES.iter().any(|p| c.starts_with(p))).map(String::from).collect())
}

impl RuleSet for IptablesRules {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }

    fn render(&self, services: &Services, node: &NodeContext) -> String {
        restore_text(&render(services, node, &self.opts), &|_| true, &BTreeSet::new())
    }

    fn apply(&mut self, services: &Services, node: &NodeContext) -> Result<usize, NetfilterError> {
        let rendered = render(services, node, &self.opts);
        let wanted = rendered.nat.by_chain();
        // Taken, not cloned: it stays None if anything below fails, so the next sync writes
        // everything again.
        let (previous, existing) = match self.applied.take() {
            Some(prev) => {
                let existing = prev.keys().cloned().collect::<BTreeSet<_>>();
                (prev, existing)
            }
            None => {
                // First sync (or after a failure): everything is written, and the jumps and
                // leftovers of an earlier run are dealt with.
                self.ensure_jumps()?;
                (BTreeMap::new(), service_chains_in_kernel(self.ipt)?)
            }
        };
        let changed: std::collections::HashSet<&str> =
            wanted.iter().filter(|(c, rules)| previous.get(*c) != Some(*rules)).map(|(c, _)| c.as_str()).collect();
        let stale: BTreeSet<String> = existing
            .iter()
            .filter(|c| !wanted.contains_key(*c) && SERVICE_CHAIN_PREFIXES.iter().any(|p| c.starts_with(p)))
            .cloned()
            .collect();
        let written = changed.len() + stale.len();
        iptables_restore(self.ipt, &restore_text(&rendered, &|c| changed.contains(c), &stale))?;
        self.applied = Some(wanted);
        Ok(written)
    }

    fn forget_applied(&mut self) {
        self.applied = None;
    }

    fn family(&self) -> Family {
        self.opts.family
    }
}

/// Removes the iptables mode's chains and jumps from both families' tables of `ipt`
/// (`proxy-agent cleanup`, or another mode or backend starting). Returns a line per thing
/// removed; nothing when that iptables is not installed.
pub fn cleanup(ipt: Iptables) -> Vec<String> {
    Family::ALL.into_iter().flat_map(|f| cleanup_family(ipt.tools(f))).collect()
}

fn cleanup_family(ipt: Tools) -> Vec<String> {
    let mut removed = Vec::new();
    let chains_of = |save: &str| -> Vec<String> { super::declared_chains(save).map(String::from).collect() };
    let saved = match super::save_tables(ipt) {
        Ok(saved) => saved,
        Err(e) => {
            // What is there stays: say so (without CAP_NET_RAW, iptables-legacy cannot be read).
            tracing::warn!("{ipt}: cannot read its rules, so what kube-proxy or another mode left there stays: {e}");
            return removed;
        }
    };
    let tables: Vec<(&str, Vec<String>)> =
        ["nat", "filter"].into_iter().map(|t| (t, saved.get(t).map_or(vec![], |s| chains_of(s)))).collect();
    // Did the iptables mode run here at all? Its KUBE-SERVICES, KUBE-POSTROUTING and
    // KUBE-MARK-MASQ have the names IPVS mode's have, and a running IPVS mode must keep them.
    // The fixed filter chains but KUBE-SERVICES are the iptables mode's alone (IPVS mode has
    // KUBE-SERVICES too), as are the per-Service chains.
    let ours_only =
        |c: &str| (c != "KUBE-SERVICES" && FILTER_FIXED.contains(&c)) || SERVICE_CHAIN_PREFIXES.iter().any(|p| c.starts_with(p));
    if !tables.iter().any(|(_, chains)| chains.iter().any(|c| ours_only(c))) {
        return removed;
    }
    for (table, chain, _, _, target) in delete_jumps(ipt, &JUMPS) {
        removed.push(format!("{ipt}: jump {table}/{chain} -> {target}"));
    }
    for (table, chains) in tables {
        // Only ours: kubelet's chains (KUBE-FIREWALL, KUBE-KUBELET-CANARY, ...) stay.
        let chains: Vec<String> = chains
            .into_iter()
            .filter(|c| {
                FILTER_FIXED.contains(&c.as_str())
                    || NAT_FIXED.contains(&c.as_str())
                    || SERVICE_CHAIN_PREFIXES.iter().any(|p| c.starts_with(p))
            })
            .collect();
        if chains.is_empty() {
            continue;
        }
        let text = super::delete_chains_text(table, &chains);
        if iptables_restore(ipt, &text).is_ok() {
            removed.push(format!("{ipt}: {} chains in the {table} table", chains.len()));
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_names_hash_as_kube_proxy_does() {
        // Names seen in every cluster and in kube-proxy's own tests.
        assert_eq!(port_hash("default/kubernetes:https", "tcp"), "NPX46M4PTMTKRN6Y");
        assert_eq!(port_hash("kube-system/kube-dns:dns", "udp"), "TCOU7JCQXEZGVUNU");
        assert_eq!(port_hash("kube-system/kube-dns:dns-tcp", "tcp"), "ERIFXISQEP7F7OF4");
        assert_eq!(port_hash("kube-system/kube-dns:metrics", "tcp"), "JD5MR3NA4I4DYORP");
        assert_eq!(port_hash("ns1/svc1:p80", "tcp"), "XPGD46QRK7WJZT7O");
        assert_eq!(endpoint_hash("ns1/svc1:p80", "tcp", "10.180.0.1:80"), "SXIVWICOYRO3J4NJ");
        assert_eq!(endpoint_hash("ns4/svc4:p80", "tcp", "10.180.0.5:80"), "C6EBXVWJJZMIWKLZ");
        assert_eq!(endpoint_hash("ns3/svc3:p8081", "tcp", "203.0.113.4:8081"), "RUVVH7YV3PHQBDOS");
    }

    #[test]
    fn probabilities_have_ten_decimals() {
        for (k, want) in [(2u32, "0.5000000000"), (3, "0.3333333333"), (6, "0.1666666667"), (100_001, "0.0000099999")] {
            assert_eq!(format!("{:.10}", 1.0f64 / f64::from(k)), want);
        }
    }
}
