//! nftables mode, in the style of kube-proxy's: one table per family (`ip kube-proxy`,
//! `ip6 kube-proxy`, each written by its own `NftablesRules`), verdict maps that
//! dispatch a packet to its Service's chain in one lookup (`service-ips`,
//! `service-nodeports`), `numgen` maps that pick an endpoint, maps that drop or reject traffic
//! to Services without endpoints, sets for ClientIP affinity. Every sync is one `nft -f`
//! transaction: atomic, and after the first one it carries only what changed.

use std::collections::{BTreeMap, BTreeSet};

use super::{hash_name, nft_family, run, run_with_input, NetfilterError, NodeContext, Plan, RuleSet, Services};
use crate::{
    dataplane::ProxyMode,
    model::{Cidr, Family},
};

const PACKAGE: &str = "nftables";

/// The table of a family: `ip kube-proxy`, `ip6 kube-proxy`.
pub fn table(family: Family) -> String {
    format!("{} kube-proxy", nft_family(family))
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftablesOptions {
    pub mark: String,
    /// The Service CIDRs of the family, when known: traffic to an unallocated cluster IP in
    /// them is dropped.
    pub service_cidrs: Vec<Cidr>,
    /// The family rendered.
    pub family: Family,
}

impl Default for NftablesOptions {
    fn default() -> Self {
        Self { mark: "0x4000".into(), service_cidrs: Vec::new(), family: Family::V4 }
    }
}

/// `HASH8-name` as kube-proxy builds chain names: the readable name behind its hash.
pub fn base_name(name: &str) -> String {
    let base = format!("{}-{name}", hash_name(name, 8));
    if base.len() > 240 {
        format!("{}...", &base[..237])
    } else {
        base
    }
}

/// The longest comment nft takes (its userdata's): longer, it fails the whole transaction.
const COMMENT_MAX: usize = 128;

/// `text` as a comment nft takes: cut at `COMMENT_MAX` bytes (on a character boundary).
/// `namespace/name:port` reaches 143 characters (63 + 63 + 15 and two separators), and one
/// such Service without endpoints stopped every change from being written (kube-proxy cuts it
/// the same way since kubernetes#139515).
fn comment(text: &str) -> &str {
    &text[..text.floor_char_boundary(COMMENT_MAX)]
}

/// `ns/name/proto/port`.
fn port_name(p: &Plan) -> String {
    let n = &p.port.name;
    format!("{}/{}/{}/{}", n.service.namespace(), n.service.name(), p.proto, n.port)
}

/// The desired ruleset of one family's table, object by object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ruleset {
    pub family: Family,
    /// Table, sets, maps, fixed chains and their rules: written in full syncs only.
    pub base: Vec<String>,
    /// Per-Service chains and their rules.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Per-endpoint affinity sets: name -> its `add set` line.
    pub sets: BTreeMap<String, String>,
    /// Map and set elements: (set, key) -> the text after the key (` : goto x`, comments).
    pub elements: BTreeMap<(String, String), String>,
}

impl Ruleset {
    /// As nft lists a ruleset: one `add` line per object.
    pub fn dump(&self) -> String {
        let table = table(self.family);
        let mut out: Vec<String> = self.base.clone();
        out.extend(self.sets.values().cloned());
        for (name, rules) in &self.chains {
            out.push(format!("add chain {table} {name}"));
            out.extend(rules.iter().map(|r| format!("add rule {table} {name} {r}")));
        }
        out.extend(self.elements.iter().map(|((set, key), rest)| element_line(&table, "add", set, key, rest)));
        out.join("\n") + "\n"
    }
}

fn element_line(table: &str, op: &str, set: &str, key: &str, rest: &str) -> String {
    format!("{op} element {table} {set} {{ {key}{rest} }}")
}

/// Renders the ports of the options' family (`node` is that family's view).
pub fn render(services: &Services, node: &NodeContext, opts: &NftablesOptions) -> Ruleset {
    let family = opts.family;
    let mut r = Ruleset { family, ..Default::default() };
    let tbl = table(family);
    // The family's address keyword and type, and "not loopback" as kube-proxy writes it.
    let ip = nft_family(family);
    let addr_type = match family {
        Family::V4 => "ipv4_addr",
        Family::V6 => "ipv6_addr",
    };
    let no_localhost = match family {
        Family::V4 => "ip daddr != 127.0.0.0/8",
        Family::V6 => "ip6 daddr != ::1",
    };
    let b = &mut r.base;
    let mark = &opts.mark;
    b.push(format!("add table {tbl} {{ comment \"rules for kube-proxy\" ; }}"));
    b.push(format!("add set {tbl} cluster-ips {{ type {addr_type} ; comment \"Active ClusterIPs\" ; }}"));
    if !node.nodeport_all {
        b.push(format!("add set {tbl} nodeport-ips {{ type {addr_type} ; comment \"IPs that accept NodePort traffic\" ; }}"));
    }
    let addr_proto_port = format!("{addr_type} . inet_proto . inet_service : verdict");
    for (name, ty, c) in [
        ("firewall-ips", addr_proto_port.as_str(), "destinations that are subject to LoadBalancerSourceRanges"),
        (
            "no-endpoint-nodeports",
            "inet_proto . inet_service : verdict",
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        ("no-endpoint-services", addr_proto_port.as_str(), "vmap to drop or reject packets to services with no endpoints"),
        ("service-ips", addr_proto_port.as_str(), "ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        ("service-nodeports", "inet_proto . inet_service : verdict", "NodePort traffic"),
    ] {
        b.push(format!("add map {tbl} {name} {{ type {ty} ; comment \"{c}\" ; }}"));
    }
    for c in [
        "cluster-ips-check",
        "filter-prerouting-pre-dnat { type filter hook prerouting priority -110 ; }",
        "filter-output-pre-dnat { type filter hook output priority -110 ; }",
        "filter-forward { type filter hook forward priority 0 ; }",
        "filter-input { type filter hook input priority 0 ; }",
        "filter-output { type filter hook output priority 0 ; }",
        "firewall-check",
        "mark-for-masquerade",
        "masquerading",
        "nat-output { type nat hook output priority -100 ; }",
        "nat-postrouting { type nat hook postrouting priority 100 ; }",
        "nat-prerouting { type nat hook prerouting priority -100 ; }",
        "nodeport-endpoints-check",
        "reject-chain { comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ; }",
        "services",
        "service-endpoints-check",
    ] {
        b.push(format!("add chain {tbl} {c}"));
    }
    let mut rule = |chain: &str, text: String| b.push(format!("add rule {tbl} {chain} {text}"));
    rule("cluster-ips-check", format!("{ip} daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\""));
    let cidrs: Vec<String> = opts.service_cidrs.iter().filter(|c| c.family() == family).map(|c| c.to_string()).collect();
    if !cidrs.is_empty() {
        rule(
            "cluster-ips-check",
            format!("{ip} daddr {{ {} }} drop comment \"Drop traffic to unallocated ClusterIPs\"", cidrs.join(" , ")),
        );
    }
    rule("filter-prerouting-pre-dnat", "ct state new jump firewall-check".into());
    rule("filter-forward", "ct state new jump service-endpoints-check".into());
    rule("filter-forward", "ct state new jump cluster-ips-check".into());
    rule("filter-input", "ct state new jump nodeport-endpoints-check".into());
    rule("filter-input", "ct state new jump service-endpoints-check".into());
    rule("filter-output", "ct state new jump service-endpoints-check".into());
    rule("filter-output-pre-dnat", "ct state new jump firewall-check".into());
    rule("filter-output", "ct state new jump cluster-ips-check".into());
    rule("firewall-check", format!("{ip} daddr . meta l4proto . th dport vmap @firewall-ips"));
    rule("mark-for-masquerade", format!("mark set mark or {mark}"));
    rule("masquerading", format!("mark and {mark} == 0 return"));
    rule("masquerading", format!("mark set mark xor {mark}"));
    rule("masquerading", "masquerade fully-random".into());
    rule("nat-output", "jump services".into());
    rule("nat-postrouting", "jump masquerading".into());
    rule("nat-prerouting", "jump services".into());
    if node.nodeport_all {
        rule("nodeport-endpoints-check", format!("{no_localhost} meta l4proto . th dport vmap @no-endpoint-nodeports"));
    } else {
        rule("nodeport-endpoints-check", format!("{ip} daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports"));
    }
    rule("reject-chain", "reject".into());
    rule("services", format!("{ip} daddr . meta l4proto . th dport vmap @service-ips"));
    if node.nodeport_all {
        rule("services", format!("fib daddr type local {no_localhost} meta l4proto . th dport vmap @service-nodeports"));
    } else {
        rule("services", format!("{ip} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports"));
    }
    rule("service-endpoints-check", format!("{ip} daddr . meta l4proto . th dport vmap @no-endpoint-services"));
    if !node.nodeport_all {
        for ip in node.nodeport_ips.iter().filter(|ip| !ip.is_loopback()) {
            r.elements.insert(("nodeport-ips".into(), ip.to_string()), String::new());
        }
    }
    for port in services.values().flatten().filter(|p| p.family == family) {
        render_port(&Plan::new(port), node, &mut r);
    }
    r
}

fn render_port(p: &Plan, node: &NodeContext, r: &mut Ruleset) {
    let Some(cluster_ip) = p.cluster_ip else { return };
    let (spn, proto, port) = (&p.spn, p.proto, p.port.port);
    let name = port_name(p);
    let base = base_name(&name);
    let svc = format!("service-{base}");
    let loc = format!("local-{base}");
    let ext = format!("external-{base}");
    let fw = format!("firewall-{base}");
    let int_chain = if p.port.internal_local { &loc } else { &svc };
    let ext_policy = if p.port.external_local { &loc } else { &svc };
    let (ip, table) = (nft_family(r.family), table(r.family));
    let verdict = if p.has_endpoints { "drop".to_string() } else { "goto reject-chain".to_string() };
    let mut elem = |set: &str, key: String, rest: String| {
        r.elements.insert((set.to_string(), key), rest);
    };
    let no_ep = |v: &str| format!(" comment \"{}\" : {v}", comment(spn));

    elem("cluster-ips", cluster_ip.to_string(), String::new());
    if p.has_internal_endpoints {
        elem("service-ips", format!("{cluster_ip} . {proto} . {port}"), format!(" : goto {int_chain}"));
    } else {
        elem("no-endpoint-services", format!("{cluster_ip} . {proto} . {port}"), no_ep(&verdict));
    }
    for ip in &p.port.external_ips {
        if p.has_endpoints {
            elem("service-ips", format!("{ip} . {proto} . {port}"), format!(" : goto {ext}"));
        }
        if !p.has_external_endpoints {
            elem("no-endpoint-services", format!("{ip} . {proto} . {port}"), no_ep(&verdict));
        }
    }
    for ip in &p.port.lb_ips {
        if p.has_endpoints {
            elem("service-ips", format!("{ip} . {proto} . {port}"), format!(" : goto {ext}"));
        }
        if p.has_firewall {
            elem("firewall-ips", format!("{ip} . {proto} . {port}"), format!(" : goto {fw}"));
        }
        if !p.has_external_endpoints {
            elem("no-endpoint-services", format!("{ip} . {proto} . {port}"), no_ep(&verdict));
        }
    }
    if let Some(np) = p.port.node_port {
        if p.has_endpoints {
            elem("service-nodeports", format!("{proto} . {np}"), format!(" : goto {ext}"));
        }
        if !p.has_external_endpoints {
            elem("no-endpoint-nodeports", format!("{proto} . {np}"), no_ep(&verdict));
        }
    }

    let mut chain = |name: &str, rules: Vec<String>| {
        r.chains.entry(name.to_string()).or_default().extend(rules);
    };
    if p.has_internal_endpoints {
        let mut rules = Vec::new();
        if node.masquerade_all {
            rules.push(format!("{ip} daddr {cluster_ip} jump mark-for-masquerade"));
        } else if let Some(not_local) = node.local.nftables(true) {
            rules.push(format!("{ip} daddr {cluster_ip} {not_local} jump mark-for-masquerade"));
        }
        chain(int_chain, rules);
    }
    if p.uses_external_chain {
        let mut rules = Vec::new();
        if !p.port.external_local {
            rules.push("jump mark-for-masquerade".to_string());
        } else {
            if let Some(local) = node.local.nftables(false) {
                rules.push(format!("{local} goto {svc} comment \"short-circuit pod traffic\""));
            }
            rules.push("fib saddr type local jump mark-for-masquerade comment \"masquerade local traffic\"".to_string());
            rules.push(format!("fib saddr type local goto {svc} comment \"short-circuit local traffic\""));
        }
        if p.has_external_endpoints {
            rules.push(format!("goto {ext_policy}"));
        }
        chain(&ext, rules);
    }
    if p.has_firewall {
        let mut allowed: Vec<String> = p.port.lb_source_ranges.iter().map(|c| c.to_string()).collect();
        if Cidr::any_contains(&p.port.lb_source_ranges, &node.node_ips) {
            allowed.extend(p.port.lb_ips.iter().map(|ip| ip.to_string()));
        }
        chain(&fw, vec![format!("{ip} saddr != {{ {} }} drop", allowed.join(" , "))]);
    }
    // A chain name cannot hold ":": kube-proxy writes an IPv6 endpoint's colons as dots.
    let endpoint = |e: &crate::model::EndpointView| base_name(&format!("{name}__{}/{}", e.addr.to_string().replace(':', "."), e.port));
    let dispatch = |eps: &[crate::model::EndpointView]| {
        let mut rules = Vec::new();
        if p.port.affinity_timeout.is_some() {
            for e in eps {
                let b = endpoint(e);
                rules.push(format!("{ip} saddr @affinity-{b} goto endpoint-{b}"));
            }
        }
        // One endpoint needs no random pick. Each numgen vmap is an anonymous set, and the kernel
        // walks every set of the table to add one, so a table of many Services takes quadratic
        // time to write (kube-proxy does the same since kubernetes#140723).
        if let [e] = eps {
            rules.push(format!("goto endpoint-{}", endpoint(e)));
        } else {
            let arms: Vec<String> = eps.iter().enumerate().map(|(i, e)| format!("{i} : goto endpoint-{}", endpoint(e))).collect();
            rules.push(format!("numgen random mod {} vmap {{ {} }}", eps.len(), arms.join(" , ")));
        }
        rules
    };
    if p.uses_cluster_chain {
        chain(&svc, dispatch(&p.cluster));
    }
    if p.uses_local_chain {
        chain(&loc, dispatch(&p.local));
    }
    for e in &p.reachable {
        let b = endpoint(e);
        let mut rules = vec![format!("{ip} saddr {} jump mark-for-masquerade", e.addr)];
        if let Some(t) = p.port.affinity_timeout {
            let addr_type = if r.family == Family::V4 { "ipv4_addr" } else { "ipv6_addr" };
            r.sets.insert(
                format!("affinity-{b}"),
                format!("add set {table} affinity-{b} {{ type {addr_type} ; flags dynamic,timeout ; timeout {t}s ; }}"),
            );
            rules.push(format!("update @affinity-{b} {{ {ip} saddr }}"));
        }
        rules.push(format!("meta l4proto {proto} dnat to {}", e.socket()));
        r.chains.entry(format!("endpoint-{b}")).or_default().extend(rules);
    }
}

/// Programs nftables, one transaction per sync.
pub struct NftablesRules {
    opts: NftablesOptions,
    applied: Option<Ruleset>,
    /// The last `refresh_in_steps` did not finish.
    refresh_failed: bool,
}

impl NftablesRules {
    pub fn new(opts: NftablesOptions) -> Self {
        Self { opts, applied: None, refresh_failed: false }
    }
}

impl Default for NftablesRules {
    fn default() -> Self {
        Self::new(NftablesOptions::default())
    }
}

/// The transaction that brings the kernel from `from` (None: unknown, rebuild the table) to
/// `to`.
pub fn transaction(from: Option<&Ruleset>, to: &Ruleset) -> String {
    let tbl = table(to.family);
    let mut t: Vec<String> = Vec::new();
    let empty = Ruleset { family: to.family, ..Default::default() };
    let from = match from {
        Some(f) if f.base == to.base => f,
        _ => {
            // The whole table, atomically replaced.
            t.push(format!("add table {tbl}"));
            t.push(format!("delete table {tbl}"));
            t.extend(to.base.iter().cloned());
            &empty
        }
    };
    // Elements that go or change first: they may point at chains that are deleted below.
    for ((set, key), rest) in &from.elements {
        if to.elements.get(&(set.clone(), key.clone())) != Some(rest) {
            t.push(element_line(&tbl, "delete", set, key, ""));
        }
    }
    for (name, rules) in &to.chains {
        match from.chains.get(name) {
            Some(old) if old == rules => {}
            Some(_) => {
                t.push(format!("add chain {tbl} {name}"));
                t.push(format!("flush chain {tbl} {name}"));
            }
            None => t.push(format!("add chain {tbl} {name}")),
        }
    }
    for (name, line) in &to.sets {
        if !from.sets.contains_key(name) {
            t.push(line.clone());
        }
    }
    for (name, rules) in &to.chains {
        if from.chains.get(name) != Some(rules) {
            t.extend(rules.iter().map(|r| format!("add rule {tbl} {name} {r}")));
        }
    }
    for ((set, key), rest) in &to.elements {
        if from.elements.get(&(set.clone(), key.clone())) != Some(rest) {
            t.push(element_line(&tbl, "add", set, key, rest));
        }
    }
    let gone: Vec<&String> = from.chains.keys().filter(|c| !to.chains.contains_key(*c)).collect();
    for c in &gone {
        t.push(format!("flush chain {tbl} {c}"));
    }
    for c in &gone {
        t.push(format!("delete chain {tbl} {c}"));
    }
    for name in from.sets.keys().filter(|s| !to.sets.contains_key(*s)) {
        t.push(format!("delete set {tbl} {name}"));
    }
    if t.is_empty() {
        String::new()
    } else {
        t.join("\n") + "\n"
    }
}

impl RuleSet for NftablesRules {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Nftables
    }

    fn render(&self, services: &Services, node: &NodeContext) -> String {
        render(services, node, &self.opts).dump()
    }

    fn set_service_cidrs(&mut self, cidrs: Vec<Cidr>) {
        self.opts.service_cidrs = cidrs;
    }

    fn apply(&mut self, services: &Services, node: &NodeContext) -> Result<usize, NetfilterError> {
        let wanted = render(services, node, &self.opts);
        // (Listing chains is fast; listing tables loads every rule: 5 s at 10,000 Services.)
        let exists = || listed(nft_family(self.opts.family), "chains").is_ok_and(|chains| !chains.is_empty());
        // Everything to be written again: the first sync, a full resync, the sync after a
        // failed one, a change of the fixed part. One transaction of a large table takes
        // minutes (`BUILD_STEP`), during which nothing else is programmed.
        let whole = self.applied.as_ref().is_none_or(|a| a.base != wanted.base);
        if whole && services.len() > BUILD_STEP {
            if !exists() {
                return self.build_in_steps(services, node, wanted);
            }
            return self.refresh_in_steps(wanted);
        }
        let tx = transaction(self.applied.as_ref(), &wanted);
        if tx.is_empty() {
            return Ok(0);
        }
        let ops = tx.lines().count();
        match run_with_input("nft", PACKAGE, &["-f", "-"], &tx) {
            Ok(_) => {
                self.applied = Some(wanted);
                self.refresh_failed = false;
                Ok(ops)
            }
            Err(e) => {
                // The next sync rebuilds the table from scratch.
                self.applied = None;
                Err(e)
            }
        }
    }

    fn forget_applied(&mut self) {
        self.applied = None;
    }

    fn family(&self) -> Family {
        self.opts.family
    }
}

/// Services per transaction when a large table is built from nothing (and, halved, anonymous
/// sets per transaction when it is written again: `refresh`). The kernel binds each anonymous
/// set of a transaction (one per dispatch `vmap`) by walking the transaction, so one
/// transaction of N Services costs O(N^2): 10,000 Services took 82 s in one transaction on
/// Linux 6.18, against well under a second per step of 1,000.
const BUILD_STEP: usize = 1000;

impl NftablesRules {
    /// First sync on a node without the table: the table is built in transactions of
    /// BUILD_STEP Services, each leaving a consistent table (the Services so far, complete).
    /// Nothing is lost by not doing it in one: there was no table to serve from. (When the
    /// table exists, as after an agent restart, it is written again in place, in steps that
    /// each leave every Service working: `refresh_table`.)
    fn build_in_steps(&mut self, services: &Services, node: &NodeContext, wanted: Ruleset) -> Result<usize, NetfilterError> {
        let keys: Vec<&crate::model::ObjectKey> = services.keys().collect();
        let mut done: Option<Ruleset> = None;
        let mut ops = 0;
        for chunk in keys.chunks(BUILD_STEP) {
            let part: Services = chunk.iter().map(|k| ((*k).clone(), services[*k].clone())).collect();
            // Rendering is per Service, so the table so far is the union of the parts.
            let mut next = render(&part, node, &self.opts);
            if let Some(d) = &done {
                next.chains.extend(d.chains.iter().map(|(k, v)| (k.clone(), v.clone())));
                next.sets.extend(d.sets.iter().map(|(k, v)| (k.clone(), v.clone())));
                next.elements.extend(d.elements.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
            let tx = transaction(done.as_ref(), &next);
            ops += tx.lines().count();
            run_with_input("nft", PACKAGE, &["-f", "-"], &tx)?;
            done = Some(next);
        }
        // Whatever the union missed (nothing, if rendering is truly per Service).
        let tx = transaction(done.as_ref(), &wanted);
        if !tx.is_empty() {
            ops += tx.lines().count();
            run_with_input("nft", PACKAGE, &["-f", "-"], &tx)?;
        }
        // (Called with nothing applied: a failure above leaves it so.)
        self.applied = Some(wanted);
        Ok(ops)
    }

    /// A large table that exists written again in steps (`refresh_table`). A failure leaves
    /// `applied` empty, and the next sync replaces the table in one transaction instead.
    fn refresh_in_steps(&mut self, wanted: Ruleset) -> Result<usize, NetfilterError> {
        self.applied = None;
        // A refresh that failed (a set of another type where ours goes, say) is not tried
        // again: the next sync replaces the table in one transaction, which always converges.
        if std::mem::take(&mut self.refresh_failed) {
            return self.replace_whole(wanted);
        }
        self.refresh_failed = true;
        let ops = refresh_table(&wanted)?;
        self.refresh_failed = false;
        self.applied = Some(wanted);
        Ok(ops)
    }

    /// `wanted` in one transaction that replaces the table.
    fn replace_whole(&mut self, wanted: Ruleset) -> Result<usize, NetfilterError> {
        let tx = transaction(None, &wanted);
        run_with_input("nft", PACKAGE, &["-f", "-"], &tx)?;
        let ops = tx.lines().count();
        self.applied = Some(wanted);
        Ok(ops)
    }
}

/// Writes `wanted` again over its family's table, which exists (`refresh`), then removes what
/// the table holds that `wanted` lacks (`stale`: the chains of Services deleted while the
/// agent was down, which would otherwise pile up across restarts). Returns the lines written.
pub fn refresh_table(wanted: &Ruleset) -> Result<usize, NetfilterError> {
    let mut ops = 0;
    for tx in refresh(wanted) {
        ops += tx.lines().count();
        run_with_input("nft", PACKAGE, &["-f", "-"], &tx)?;
    }
    // Chains are listed fast; sets and maps only with the rules (5 s at 10,000 Services), so
    // only when chains are left over (Services deleted while the agent was down, whose
    // affinity sets are left too), not at every hourly resync.
    let family = nft_family(wanted.family);
    let none = BTreeSet::new();
    let chains = listed(family, "chains")?;
    let mut tx = stale(wanted, &chains, &none, &none);
    if !tx.is_empty() {
        tx = stale(wanted, &chains, &listed(family, "sets")?, &listed(family, "maps")?);
    }
    if !tx.is_empty() {
        ops += tx.lines().count();
        run_with_input("nft", PACKAGE, &["-f", "-"], &tx)?;
    }
    Ok(ops)
}

/// The names of the `what` (`chains`, `sets` or `maps`) of the family's kube-proxy table, as
/// `nft -j` lists them.
fn listed(family: &str, what: &str) -> Result<BTreeSet<String>, NetfilterError> {
    let out = run("nft", PACKAGE, &["-j", "list", what, family])?;
    let kind = what.trim_end_matches('s');
    let bad = |e: String| NetfilterError::Failed { command: format!("nft -j list {what} {family}"), stderr: e };
    let v: serde_json::Value = serde_json::from_str(&out).map_err(|e| bad(e.to_string()))?;
    Ok(v["nftables"]
        .as_array()
        .ok_or_else(|| bad("no \"nftables\" array".into()))?
        .iter()
        .filter_map(|o| o.get(kind))
        .filter(|o| o["table"] == "kube-proxy")
        .filter_map(|o| o["name"].as_str().map(str::to_string))
        .collect())
}

/// The names of the `kind`s (`chain`, `set`, `map`) the fixed part of `to` declares.
fn declared<'a>(to: &'a Ruleset, kind: &str) -> impl Iterator<Item = &'a str> {
    let prefix = format!("add {kind} {} ", table(to.family));
    to.base.iter().filter_map(move |l| l.strip_prefix(&prefix)?.split(' ').next())
}

/// The transaction that removes what the table holds (`chains`, `sets`, `maps`) and `to` does
/// not declare: maps flushed first (an older build's map may jump to a leftover chain), then
/// chains flushed (a leftover chain may jump to another, or name a set), then deleted, then
/// the sets and maps.
pub fn stale(to: &Ruleset, chains: &BTreeSet<String>, sets: &BTreeSet<String>, maps: &BTreeSet<String>) -> String {
    let tbl = table(to.family);
    let declared = |kind: &str| -> BTreeSet<&str> { declared(to, kind).collect() };
    let (fixed_chains, fixed_sets, fixed_maps) = (declared("chain"), declared("set"), declared("map"));
    let gone_maps: Vec<&String> = maps.iter().filter(|m| !fixed_maps.contains(m.as_str())).collect();
    let gone: Vec<&String> = chains.iter().filter(|c| !fixed_chains.contains(c.as_str()) && !to.chains.contains_key(c.as_str())).collect();
    let mut t: Vec<String> = gone_maps.iter().map(|m| format!("flush map {tbl} {m}")).collect();
    t.extend(gone.iter().map(|c| format!("flush chain {tbl} {c}")));
    t.extend(gone.iter().map(|c| format!("delete chain {tbl} {c}")));
    t.extend(
        sets.iter()
            .filter(|s| !fixed_sets.contains(s.as_str()) && !to.sets.contains_key(s.as_str()))
            .map(|s| format!("delete set {tbl} {s}")),
    );
    t.extend(gone_maps.iter().map(|m| format!("delete map {tbl} {m}")));
    if t.is_empty() {
        String::new()
    } else {
        t.join("\n") + "\n"
    }
}

/// The transactions that write `to` again over a table that exists, whatever it holds now
/// (drift, a failed transaction, an earlier run's Services), without replacing the table:
/// Services keep being served throughout, and no transaction holds more than half of
/// `BUILD_STEP` anonymous sets (the costly part of a transaction: `BUILD_STEP`; each costs
/// about 2.5 ms here, and batches of 250 to 1,000 cost alike per set).
/// 1. The fixed part: sets, maps and chains added where missing, every Service chain added
///    (empty where missing: a chain's rules jump to others, which must exist first), the
///    static sets (no verdicts in them) flushed and filled, the fixed chains flushed and
///    written.
/// 2. The Services' chains, each flushed and written in one transaction.
/// 3. The verdict maps flushed and filled in one transaction (elements cost little; no packet
///    sees a map half-filled).
///
/// Affinity sets are added where missing, never flushed: they hold the clients' affinities.
/// What the table holds and `to` lacks is for `stale`.
pub fn refresh(to: &Ruleset) -> Vec<String> {
    let tbl = table(to.family);
    let (sets, maps): (Vec<&str>, Vec<&str>) = (declared(to, "set").collect(), declared(to, "map").collect());
    let elements = |of: &[&str]| -> Vec<String> {
        to.elements
            .iter()
            .filter(|((set, _), _)| of.contains(&set.as_str()))
            .map(|((set, key), rest)| element_line(&tbl, "add", set, key, rest))
            .collect()
    };
    let tx = |lines: Vec<String>| lines.join("\n") + "\n";
    let rule_prefix = format!("add rule {tbl} ");
    let (rules, declarations): (Vec<&String>, Vec<&String>) = to.base.iter().partition(|l| l.starts_with(&rule_prefix));

    let mut t: Vec<String> = declarations.iter().map(|l| (*l).clone()).collect();
    t.extend(to.sets.values().cloned());
    t.extend(to.chains.keys().map(|name| format!("add chain {tbl} {name}")));
    t.extend(sets.iter().map(|name| format!("flush set {tbl} {name}")));
    t.extend(elements(&sets));
    let mut flushed = BTreeSet::new();
    for r in &rules {
        let chain = r[rule_prefix.len()..].split(' ').next().unwrap_or_default();
        if flushed.insert(chain) {
            t.push(format!("flush chain {tbl} {chain}"));
        }
    }
    t.extend(rules.iter().map(|l| (*l).clone()));
    let mut txs = vec![tx(t)];

    // Cut by anonymous sets (a rule with `{`: a random pick's vmap, a list of ranges), and by
    // lines, so that chains of one kind (sorted together by name) do not make one step large.
    let mut t = Vec::new();
    let mut anonymous = 0;
    for (name, rules) in &to.chains {
        if anonymous >= BUILD_STEP / 2 || t.len() >= 10 * BUILD_STEP {
            txs.push(tx(std::mem::take(&mut t)));
            anonymous = 0;
        }
        anonymous += rules.iter().filter(|r| r.contains('{')).count();
        t.push(format!("flush chain {tbl} {name}"));
        t.extend(rules.iter().map(|r| format!("add rule {tbl} {name} {r}")));
    }
    if !t.is_empty() {
        txs.push(tx(t));
    }

    let mut t: Vec<String> = maps.iter().map(|name| format!("flush map {tbl} {name}")).collect();
    t.extend(elements(&maps));
    txs.push(tx(t));
    txs
}

/// Removes the nftables mode's tables (both families). Returns a line per thing removed.
pub fn cleanup() -> Vec<String> {
    let mut removed = Vec::new();
    for family in Family::ALL {
        let ip = nft_family(family);
        if run("nft", PACKAGE, &["list", "table", ip, "kube-proxy"]).is_ok() {
            removed.push(match run("nft", PACKAGE, &["delete", "table", ip, "kube-proxy"]) {
                Ok(_) => format!("nftables: table {ip} kube-proxy"),
                Err(e) => format!("nftables: could not delete table {ip} kube-proxy: {e}"),
            });
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_names_hash_as_kube_proxy_does() {
        assert_eq!(base_name("ns1/svc1/tcp/p80"), "ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(base_name("ns2/svc2/tcp/p8080"), "MHHHYRWA-ns2/svc2/tcp/p8080");
        assert_eq!(base_name("testing/service/tcp/https"), "LZBRENCP-testing/service/tcp/https");
        assert!(base_name("ns1/svc1/tcp/p80__10.180.0.1/80").starts_with("5OJB2KTY-"));
        assert!(base_name("ns4/svc4/tcp/p80__10.180.0.5/80").starts_with("5RFCDDV7-"));
        let long = base_name(&"x".repeat(300));
        assert_eq!(long.len(), 240);
        assert!(long.ends_with("..."));
    }

    #[test]
    fn comments_are_cut_to_what_nft_takes() {
        assert_eq!(comment("ns1/svc1:p80"), "ns1/svc1:p80");
        let longest = format!("{}/{}:{}", "n".repeat(63), "s".repeat(63), "p".repeat(15));
        assert_eq!(comment(&longest), &longest[..128]);
        // Not inside a character (names are ASCII, but the cut must not panic on other text).
        assert_eq!(comment(&format!("{}é", "x".repeat(127))), "x".repeat(127));
    }
}
