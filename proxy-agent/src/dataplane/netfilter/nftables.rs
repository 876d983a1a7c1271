//! nftables mode, in the style of kube-proxy's: one table per family (`ip kube-proxy`,
//! `ip6 kube-proxy`, each written by its own `NftablesRules`), verdict maps that
//! dispatch a packet to its Service's chain in one lookup (`service-ips`,
//! `service-nodeports`), `numgen` maps that pick an endpoint, maps that drop or reject traffic
//! to Services without endpoints, sets for ClientIP affinity. Every sync is one `nft -f`
//! transaction: atomic, and after the first one it carries only what changed.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{hash_name, nfnetlink, nft_family, run, run_with_input, NetfilterError, NodeContext, Plan, RuleSet, Services};
use crate::{
    dataplane::ProxyMode,
    model::{Cidr, Family, ObjectKey, PortView},
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

/// Set and map elements: (set, key) -> the text after the key.
pub type Elements = BTreeMap<(String, String), String>;

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
    pub elements: Elements,
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
    render_alone(services, node, opts).0
}

/// The Service has ports of the family (the other family's table has nothing of it).
fn of_family(ports: &[PortView], family: Family) -> bool {
    ports.iter().any(|p| p.family == family)
}

/// One Service's ports of the family, alone (no fixed part).
fn render_piece(ports: &[PortView], node: &NodeContext, family: Family) -> Ruleset {
    let mut r = Ruleset { family, ..Default::default() };
    for port in ports.iter().filter(|p| p.family == family) {
        render_port(&Plan::new(port), node, &mut r);
    }
    r
}

/// `render`, and whether every Service's chains, sets and elements are its own (no two
/// Services render one of the same name; then what they render is merged as one, and no
/// Service alone can be written: `NftablesRules::changes_alone`).
fn render_alone(services: &Services, node: &NodeContext, opts: &NftablesOptions) -> (Ruleset, bool) {
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
    let mut alone = true;
    for ports in services.values() {
        let piece = render_piece(ports, node, family);
        for (name, rules) in piece.chains {
            alone &= !r.chains.contains_key(&name);
            r.chains.entry(name).or_default().extend(rules);
        }
        for (name, line) in piece.sets {
            alone &= r.sets.insert(name, line).is_none();
        }
        for (k, rest) in piece.elements {
            alone &= r.elements.insert(k, rest).is_none();
        }
    }
    (r, alone)
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

/// Programs nftables, one transaction per sync (a large table written again: one step per
/// sync, `Refresh`).
pub struct NftablesRules {
    opts: NftablesOptions,
    applied: Option<Ruleset>,
    /// A large table being written again, step by step.
    refreshing: Option<Refresh>,
    /// A large table being built from nothing, step by step.
    building: Option<Build>,
    /// A build began, or a write of changes failed, and the table has not been whole since (a
    /// step that failed ends the build, not this): Services are missing from the kernel, or
    /// not in it as they are.
    partial: bool,
    /// Refreshes that failed in a row (the second makes the next sync replace the table).
    refresh_failures: u8,
    /// The node `applied` was rendered for, when every Service's names in it are its own
    /// (`render_alone`): the Services changed can then be written alone.
    alone: Option<NodeContext>,
    /// The Services changed since the last `apply`, with their ports as it had them (None: new
    /// since): `RuleSet::changed`.
    changed: Changed,
    /// What the last `apply`s left of the Services changed for the next, when there were more
    /// than a batch (`CHANGES_ALONE_MAX`), oldest first: written first there. (Changes that
    /// merely wait in `changed`, while this family's failure backs off, do not make it
    /// pending: the loop would spin on them.)
    waiting: Vec<Changed>,
}

/// Services changed, with their ports as the kernel has them (None: not in the kernel).
type Changed = BTreeMap<ObjectKey, Option<Vec<PortView>>>;

/// A sync writes at most this many Services changed, alone (`changes_alone`); the others wait
/// for the next syncs, one batch each (`pending`). One transaction of every change would hold
/// the control loop for as long as a build of that many Services in one step, quadratic in
/// them (`BUILD_STEP`): tens of seconds for 5,000 Services of a namespace deleted at once.
const CHANGES_ALONE_MAX: usize = BUILD_STEP;

impl NftablesRules {
    pub fn new(opts: NftablesOptions) -> Self {
        Self {
            opts,
            applied: None,
            refreshing: None,
            building: None,
            partial: false,
            refresh_failures: 0,
            alone: None,
            changed: BTreeMap::new(),
            waiting: Vec::new(),
        }
    }

    /// The sync's transaction when only the Services `changed` are rendered, as they are and as
    /// they were (their ports at the last `apply`), and compared: None where that cannot be
    /// (nothing applied or known to be, another node, another fixed part, a name two Services
    /// render, or what they were not what the table applied holds). Every other Service's
    /// chains, sets and elements are its own and the same in the kernel and in the whole table
    /// rendered, so this writes what comparing
    /// the whole would. At 10,000 Services, rendering the whole took 150 ms and comparing it
    /// 80 ms of a one-Service change (beside nft's 230 ms).
    fn changes_alone(&self, services: &Services, node: &NodeContext, changed: &Changed) -> Option<Changes> {
        let applied = self.applied.as_ref()?;
        self.alone.as_ref().filter(|n| *n == node)?;
        let fixed = render(&Services::new(), node, &self.opts);
        if fixed.base != applied.base {
            return None;
        }
        let family = self.opts.family;
        let mut old = Ruleset { family, base: applied.base.clone(), ..Default::default() };
        let mut new = Ruleset { family, base: applied.base.clone(), ..Default::default() };
        // What the Services were, as the table applied holds them (the same node, the same
        // fixed part): anything else, and the whole is written.
        for before in changed.values().flatten() {
            let piece = render_piece(before, node, family);
            held(piece.chains, &applied.chains, &mut old.chains)?;
            held(piece.sets, &applied.sets, &mut old.sets)?;
            held(piece.elements, &applied.elements, &mut old.elements)?;
        }
        for key in changed.keys() {
            let Some(ports) = services.get(key) else { continue };
            let piece = render_piece(ports, node, family);
            own(piece.chains, &applied.chains, &old.chains, &mut new.chains)?;
            own(piece.sets, &applied.sets, &old.sets, &mut new.sets)?;
            own(piece.elements, &applied.elements, &old.elements, &mut new.elements)?;
        }
        Some(Changes { tx: transaction(Some(&old), &new), old, new })
    }

    /// Writes the sync's changes alone (`changes_alone`); None where the whole is needed.
    fn apply_changes(&mut self, services: &Services, node: &NodeContext, changed: &Changed) -> Option<Result<usize, NetfilterError>> {
        let c = self.changes_alone(services, node, changed)?;
        if !c.tx.is_empty() {
            if let Err(e) = nft(&["-f", "-"], &c.tx) {
                // The next sync writes the table again from scratch; until then Services are not
                // in the kernel as they are (health-check ports wait too).
                self.applied = None;
                self.alone = None;
                self.partial = true;
                return Some(Err(e));
            }
        }
        let lines = c.tx.lines().count();
        self.commit_changes(c);
        self.refresh_failures = 0;
        Some(Ok(lines))
    }

    /// `applied` after `c` was written.
    fn commit_changes(&mut self, c: Changes) {
        let Some(applied) = self.applied.as_mut() else { return };
        replace(&mut applied.chains, &c.old.chains, c.new.chains);
        replace(&mut applied.sets, &c.old.sets, c.new.sets);
        replace(&mut applied.elements, &c.old.elements, c.new.elements);
    }
}

/// The Services a sync writes alone, at most `max`, and the rest, oldest first: those
/// `waiting` first, oldest first (else, changing again and again, more than `max` Services
/// would keep the ones whose keys sort last waiting), then those `changed` since. A Service
/// that waited keeps what the kernel has as it was when it began to wait.
fn batch(waiting: Vec<Changed>, changed: Changed, max: usize) -> (Changed, Vec<Changed>) {
    let (mut batch, mut rest) = (Changed::new(), Vec::<Changed>::new());
    for generation in waiting.into_iter().chain([changed]) {
        let mut left = Changed::new();
        for (key, before) in generation {
            // (An older generation has it: its `before` is what the kernel has.)
            if batch.contains_key(&key) || rest.iter().any(|g| g.contains_key(&key)) {
                continue;
            }
            if batch.len() < max { &mut batch } else { &mut left }.insert(key, before);
        }
        if !left.is_empty() {
            rest.push(left);
        }
    }
    (batch, rest)
}

/// Moves a Service's items, as it was, into `old`: None unless `applied` holds each as it is
/// (and no other Service changed holds it too).
fn held<K: Ord, V: PartialEq>(piece: BTreeMap<K, V>, applied: &BTreeMap<K, V>, old: &mut BTreeMap<K, V>) -> Option<()> {
    for (k, v) in piece {
        (applied.get(&k) == Some(&v)).then_some(())?;
        old.insert(k, v).is_none().then_some(())?;
    }
    Some(())
}

/// Moves a Service's items, as it is, into `new`: None for a name the table has that none of
/// the Services changed had, or that two of them render (shared, so not theirs alone).
fn own<K: Ord, V>(piece: BTreeMap<K, V>, applied: &BTreeMap<K, V>, old: &BTreeMap<K, V>, new: &mut BTreeMap<K, V>) -> Option<()> {
    for (k, v) in piece {
        if applied.contains_key(&k) && !old.contains_key(&k) {
            return None;
        }
        new.insert(k, v).is_none().then_some(())?;
    }
    Some(())
}

/// `applied`'s items of `old` replaced by `new`.
fn replace<K: Ord, V>(applied: &mut BTreeMap<K, V>, old: &BTreeMap<K, V>, new: BTreeMap<K, V>) {
    for k in old.keys() {
        applied.remove(k);
    }
    applied.extend(new);
}

/// A sync's changes alone (`NftablesRules::changes_alone`): the transaction, and what the
/// Services changed have in the table applied and will have after it.
struct Changes {
    tx: String,
    old: Ruleset,
    new: Ruleset,
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
    let (deleted, added) = element_changes(&tbl, &from.elements, &to.elements);
    t.extend(deleted);
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
    // A set whose line changed (a Service's affinity timeout) is added again: the kernel takes
    // the new timeout and keeps the clients' affinities (kernels of mid-2023 on, nf_tables'
    // "honor set timeout updates"; an older one keeps the old timeout, as it does under
    // kube-proxy's `add set`).
    for (name, line) in &to.sets {
        if from.sets.get(name) != Some(line) {
            t.push(line.clone());
        }
    }
    for (name, rules) in &to.chains {
        if from.chains.get(name) != Some(rules) {
            t.extend(rules.iter().map(|r| format!("add rule {tbl} {name} {r}")));
        }
    }
    t.extend(added);
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

/// The lines that bring set and map elements from `from` to `to`: the deletions (of elements
/// gone or changed: `add` does not change an element's data) and the additions.
fn element_changes(tbl: &str, from: &Elements, to: &Elements) -> (Vec<String>, Vec<String>) {
    let differ = |a: &Elements, b: &Elements, op: &str, data: bool| -> Vec<String> {
        a.iter()
            .filter(|(k, rest)| b.get(*k) != Some(*rest))
            .map(|((set, key), rest)| element_line(tbl, op, set, key, if data { rest } else { "" }))
            .collect()
    };
    (differ(from, to, "delete", false), differ(to, from, "add", true))
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
        let (batch, rest) = batch(std::mem::take(&mut self.waiting), std::mem::take(&mut self.changed), CHANGES_ALONE_MAX);
        let done = self.apply_any(services, node, batch, rest);
        // (Whole: every Service is in the kernel.)
        if self.applied.is_some() {
            self.partial = false;
        }
        done
    }

    fn changed(&mut self, service: &ObjectKey, before: Option<&[PortView]>) {
        // (The first since the last apply: what that apply had.)
        self.changed.entry(service.clone()).or_insert_with(|| before.map(<[PortView]>::to_vec));
    }

    /// A refresh or a build goes on (a full resync asked for meanwhile changes nothing: they
    /// write everything).
    fn forget_applied(&mut self) {
        self.applied = None;
    }

    fn pending(&self) -> bool {
        self.refreshing.is_some() || self.building.is_some() || !self.waiting.is_empty()
    }

    /// A build in steps, or what is left of one that failed or turned into a write in place,
    /// or a write in place whose maps are not filled yet (the Services whose chains the table
    /// lacked are not served until then: Services created while the agent was down, say), or
    /// changes left for the next batch (`waiting`: Services created are not served, changed
    /// ones are served as they were, until their batch).
    fn building(&self) -> bool {
        let filled = self.refreshing.as_ref().is_some_and(|r| r.elements.is_some());
        self.building.is_some() || !self.waiting.is_empty() || (!filled && (self.partial || self.refreshing.is_some()))
    }

    fn family(&self) -> Family {
        self.opts.family
    }
}

impl NftablesRules {
    /// `apply`: a build's next step, the Services changed alone (`batch`, and `rest` left
    /// `waiting` for the next syncs), or the whole (which takes every change).
    fn apply_any(&mut self, services: &Services, node: &NodeContext, batch: Changed, rest: Vec<Changed>) -> Result<usize, NetfilterError> {
        if let Some(build) = self.building.take() {
            return self.build_step(services, node, build);
        }
        if self.refreshing.is_none() {
            // The rest is in the kernel as it was meanwhile. What the batch shares with it, and
            // anything that fails, has the whole written instead.
            if let Some(done) = self.apply_changes(services, node, &batch) {
                if done.is_ok() {
                    self.waiting = rest;
                }
                return done;
            }
        }
        let (wanted, alone) = render_alone(services, node, &self.opts);
        let done = self.apply_whole(services, node, wanted);
        // (Every way of applying the whole leaves `applied` as this sync's whole or unknown.)
        self.alone = (self.applied.is_some() && alone).then(|| node.clone());
        done
    }

    /// `apply` of the whole table rendered (`wanted`).
    fn apply_whole(&mut self, services: &Services, node: &NodeContext, wanted: Ruleset) -> Result<usize, NetfilterError> {
        if self.refreshing.is_some() {
            return self.refresh_step(wanted, None);
        }
        // Everything to be written again: the first sync, a full resync, the sync after a
        // failed one, a change of the fixed part. One transaction of a large table takes
        // minutes (`BUILD_STEP`), during which nothing else is programmed.
        let whole = self.applied.as_ref().is_none_or(|a| a.base != wanted.base);
        let large = wanted.chains.len() > STEP_CHAINS;
        if whole && (large || services.values().filter(|ports| of_family(ports, self.opts.family)).count() > BUILD_STEP) {
            // (Listing the chains is one chain dump, `listed`: 0.3 s at 50,000 chains, 3 s at
            // 255,000; the refresh starts from the same list.)
            let present = listed(nft_family(self.opts.family), "chains");
            if present.as_ref().is_ok_and(|chains| chains.is_empty()) {
                self.partial = true;
                return self.build_step(services, node, Build::default());
            }
            return self.refresh_step(wanted, present.ok());
        }
        let tx = transaction(self.applied.as_ref(), &wanted);
        if tx.is_empty() {
            self.refresh_failures = 0;
            return Ok(0);
        }
        let ops = tx.lines().count();
        match nft(&["-f", "-"], &tx) {
            Ok(_) => {
                self.applied = Some(wanted);
                self.refresh_failures = 0;
                Ok(ops)
            }
            Err(e) => {
                // The next sync rebuilds the table from scratch.
                self.applied = None;
                Err(e)
            }
        }
    }
}

/// Services per transaction when a large table is built from nothing. The kernel binds each
/// anonymous set of a transaction (one per dispatch `vmap`) by walking the transaction, so one
/// transaction of N Services costs O(N^2): 10,000 Services took 82 s in one transaction on
/// Linux 6.18, against well under a second per step of 1,000.
const BUILD_STEP: usize = 1000;

/// A step of writing a large table again (`Refresh`) holds at most this many anonymous sets,
/// and about this many lines, besides the chains that changed meanwhile (at least: more in a
/// table of many chains, `refresh_lines`, `refresh_sets`): each set costs about
/// 2.5 ms (whatever the step's size, from 250 to 1,000) and each line about 36 us, on top of
/// about 0.4 s for any `nft -f` at 10,000 Services (nft loads the table's chains first), so a
/// step holds the control loop for about a second there, and a change made meanwhile waits
/// no longer.
const REFRESH_SETS: usize = 250;
const REFRESH_LINES: usize = 5000;

/// The lines of a refresh step over a table of `chains` chains: `REFRESH_LINES`, or more in a
/// table of many chains, where any `nft -f` costs more than a step's own work (nft 1.0.6 reads
/// every chain of the table before a rule or element command, and the kernel's chain dump
/// grows with the square of them: 3 s at 255,000 chains, 5,000 Services of 50 endpoints, where
/// steps of 5,000 lines wrote the table again in 919 s).
fn refresh_lines(chains: usize) -> usize {
    REFRESH_LINES.max(chains / 8)
}

/// The anonymous sets of a refresh step over a table of `chains` chains, likewise: a step of
/// 1,000 (2.5 s) at 255,000 chains costs about what its `nft -f` does anyway.
fn refresh_sets(chains: usize) -> usize {
    REFRESH_SETS.max(chains / 250)
}

/// A table written again (not built from nothing) of more chains than this goes in steps
/// whatever its number of Services: 1,000 Services of 50 endpoints (51,000 chains) took 17 s
/// in one transaction.
const STEP_CHAINS: usize = 10_000;

impl NftablesRules {
    /// A step of building a large table from nothing (a node without the table: its first
    /// sync), one per sync: a transaction of `BUILD_STEP` Services not written yet, in key
    /// order, each leaving a consistent table (the Services so far, complete, served), the
    /// changes that come meanwhile taken between steps. The last step writes the rest together
    /// with whatever changed since the earlier steps wrote it (Services changed or deleted
    /// meanwhile). A step that fails ends the build; the next sync writes the table that
    /// exists again (`Refresh`), as it does when the fixed part changes meanwhile.
    fn build_step(&mut self, services: &Services, node: &NodeContext, mut build: Build) -> Result<usize, NetfilterError> {
        self.applied = None;
        let family = self.opts.family;
        let whole = |rules: &Self| render_alone(services, node, &rules.opts);
        if build.done.as_ref().is_some_and(|d| d.base != render(&Services::new(), node, &self.opts).base) {
            let (wanted, alone) = whole(self);
            let done = self.refresh_step(wanted, None);
            self.alone = (self.applied.is_some() && alone).then(|| node.clone());
            return done;
        }
        let left: Vec<&ObjectKey> = services
            .iter()
            .filter(|(k, ports)| !build.written.contains(*k) && of_family(ports, family))
            .map(|(k, _)| k)
            .take(BUILD_STEP + 1)
            .collect();
        if left.len() <= BUILD_STEP {
            // The last step: the rest, and whatever changed since the earlier steps (the whole
            // rendered, compared with what they wrote).
            let (wanted, alone) = whole(self);
            let tx = transaction(build.done.as_ref(), &wanted);
            if !tx.is_empty() {
                nft(&["-f", "-"], &tx)?;
            }
            let services = services.values().filter(|ports| of_family(ports, family)).count();
            tracing::info!(family = %family, services, steps = build.steps + 1, "the nftables table is built");
            self.applied = Some(wanted);
            self.alone = alone.then(|| node.clone());
            self.refresh_failures = 0;
            return Ok(tx.lines().count());
        }
        let part: Services = left[..BUILD_STEP].iter().map(|k| ((*k).clone(), services[*k].clone())).collect();
        let mut part_rules = render(&part, node, &self.opts);
        build.written.extend(part.into_keys());
        build.steps += 1;
        let Some(done) = &mut build.done else {
            // (The first step replaces the table: `transaction` from nothing.)
            let tx = transaction(None, &part_rules);
            nft(&["-f", "-"], &tx)?;
            build.done = Some(part_rules);
            self.building = Some(build);
            return Ok(tx.lines().count());
        };
        // What the table so far lacks of the part (rendering is per Service, so the table so
        // far is the union of the parts; a name an earlier part took stays as it wrote it
        // until the last step).
        part_rules.chains.retain(|name, _| !done.chains.contains_key(name));
        part_rules.sets.retain(|name, _| !done.sets.contains_key(name));
        part_rules.elements.retain(|k, _| !done.elements.contains_key(k));
        let fixed = Ruleset { family, base: done.base.clone(), ..Default::default() };
        let tx = transaction(Some(&fixed), &part_rules);
        if !tx.is_empty() {
            nft(&["-f", "-"], &tx)?;
        }
        done.chains.append(&mut part_rules.chains);
        done.sets.append(&mut part_rules.sets);
        done.elements.append(&mut part_rules.elements);
        self.building = Some(build);
        Ok(tx.lines().count())
    }

    /// One step of writing a large table that exists again (`Refresh`): the first starts the
    /// refresh, the last removes what the table holds and `wanted` lacks (`remove_stale`). A
    /// step that fails ends the refresh; the next sync starts another, and after a second
    /// failure in a row replaces the table in one transaction instead, which always converges
    /// (a set of another type where ours goes, say) but holds the control loop throughout.
    /// `present`: the chains the table holds, when they were just listed (a refresh that starts
    /// lists them otherwise).
    fn refresh_step(&mut self, wanted: Ruleset, present: Option<BTreeSet<String>>) -> Result<usize, NetfilterError> {
        self.applied = None;
        if self.refresh_failures >= 2 {
            self.refreshing = None;
            let done = self.replace_whole(wanted);
            if done.is_ok() {
                self.refresh_failures = 0;
            }
            return done;
        }
        match self.try_refresh_step(&wanted, present) {
            Ok((ops, false)) => Ok(ops),
            Ok((ops, true)) => {
                self.refresh_failures = 0;
                self.applied = Some(wanted);
                Ok(ops)
            }
            Err(e) => {
                self.refreshing = None;
                self.refresh_failures += 1;
                Err(e)
            }
        }
    }

    /// The lines written, and whether the refresh is over.
    fn try_refresh_step(&mut self, wanted: &Ruleset, present: Option<BTreeSet<String>>) -> Result<(usize, bool), NetfilterError> {
        let family = nft_family(wanted.family);
        let (tx, refresh) = match self.refreshing.take() {
            Some(mut r) if r.base == wanted.base => (r.next(wanted), r),
            // The first step, or the fixed part changed meanwhile: (again) from the start.
            _ => Refresh::start(wanted, &present.map_or_else(|| listed(family, "chains"), Ok)?),
        };
        let mut ops = 0;
        if !tx.is_empty() {
            ops += tx.lines().count();
            nft(&["-f", "-"], &tx)?;
        }
        if !refresh.done() {
            self.refreshing = Some(refresh);
            return Ok((ops, false));
        }
        ops += remove_stale(wanted)?;
        Ok((ops, true))
    }

    /// `wanted` in one transaction that replaces the table.
    fn replace_whole(&mut self, wanted: Ruleset) -> Result<usize, NetfilterError> {
        let tx = transaction(None, &wanted);
        nft(&["-f", "-"], &tx)?;
        let ops = tx.lines().count();
        self.applied = Some(wanted);
        Ok(ops)
    }
}

/// A large table being built from nothing (`NftablesRules::build_step`).
#[derive(Debug, Default)]
struct Build {
    /// The table as written so far (None before the first step).
    done: Option<Ruleset>,
    /// The Services written (as they were then, until the last step).
    written: std::collections::HashSet<ObjectKey>,
    steps: usize,
}

/// Removes what the family's table holds and `wanted` lacks (`stale`: the chains and affinity
/// sets of Services deleted while the agent was down or while a refresh went on, which would
/// otherwise pile up across restarts). Returns the lines written.
fn remove_stale(wanted: &Ruleset) -> Result<usize, NetfilterError> {
    let family = nft_family(wanted.family);
    let tx = stale(wanted, &listed(family, "chains")?, &listed(family, "sets")?, &listed(family, "maps")?);
    if tx.is_empty() {
        return Ok(0);
    }
    nft(&["-f", "-"], &tx)?;
    Ok(tx.lines().count())
}

/// Runs `nft args` with `input` on its stdin; a crash is explained (`explain_crash`).
pub fn nft(args: &[&str], input: &str) -> Result<String, NetfilterError> {
    run_with_input("nft", PACKAGE, args, input).map_err(explain_crash)
}

/// What is known of an nft crash, added to its error. nft before 1.1.2 dies (SIGSEGV) reading
/// a set or map that nft 1.1.2 or later declared with a `type` (or a `numgen` map), in any
/// table of any family, for any command that loads sets (every transaction of this mode): it
/// cannot read the metadata the newer nft stores with them (kubernetes#136786). A node gets
/// them from its newer tools (Debian 13's nft, a CNI plugin's or a firewall's); rules already
/// written stay, but nothing more can be written. The tables whose listing alone crashes nft
/// are named (found over netlink: listing them all with nft crashes); the cause is said only
/// where one is found.
pub fn explain_crash(e: NetfilterError) -> NetfilterError {
    let NetfilterError::Crashed { command, signal, why, unreadable } = e else { return e };
    if signal != libc::SIGSEGV {
        return NetfilterError::Crashed { command, signal, why, unreadable };
    }
    let version = run("nft", PACKAGE, &["--version"]).map_or_else(|_| "this nft".into(), |v| v.trim().to_string());
    let found = crashing_tables();
    let why = match &found {
        Ok(named) if !named.is_empty() => format!(
            "{why}: {version} crashes listing {} alone: {} sets or maps that it cannot read, as nft before 1.1.2 cannot \
             read those nft 1.1.2 or later wrote (kubernetes#136786). This mode writes nothing more while they exist (what \
             it wrote stays in the kernel). The eBPF and iptables modes run no nft (`proxy-agent cleanup` removes this \
             mode's tables); an nft that reads them (1.1.2 or later) writes sets older nft versions on the node cannot read",
            if named.len() == 1 { format!("table {}", named[0]) } else { format!("tables {}", named.join(", ")) },
            if named.len() == 1 { "it holds" } else { "they hold" },
        ),
        Ok(_) => format!("{why}: {version} crashes, though listing each table alone does not; the cause is not known here"),
        Err(e) => format!("{why}: {version} crashes; the tables could not be listed to find one it crashes on ({e})"),
    };
    NetfilterError::Crashed { command, signal, why, unreadable: found.unwrap_or_default() }
}

/// The tables ("ip fw") whose listing alone crashes nft, for `explain_crash`: the others', then
/// this mode's own if none of those (written by kube-proxy's or a newer nft before this agent
/// took them over, say; listing one whole takes seconds at tens of thousands of Services). Kept
/// a minute per network namespace: a failing mode retries every few seconds at first, and each
/// table costs an nft run.
fn crashing_tables() -> std::io::Result<Vec<String>> {
    type Found = Option<(u64, std::time::Instant, Vec<String>)>;
    static FOUND: std::sync::Mutex<Found> = std::sync::Mutex::new(None);
    let netns = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata("/proc/thread-self/ns/net")?);
    let mut found = FOUND.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, _, named)) = found.as_ref().filter(|(ns, at, _)| *ns == netns && at.elapsed() < std::time::Duration::from_secs(60)) {
        return Ok(named.clone());
    }
    let tables = tables()?;
    let ours = |(family, name): &&(String, String)| name == TABLE && (family == "ip" || family == "ip6");
    let crashing = |(family, name): &&(String, String)| {
        matches!(run("nft", PACKAGE, &["-t", "list", "table", family, name]), Err(NetfilterError::Crashed { .. }))
    };
    let mut named: Vec<String> = tables.iter().filter(|t| !ours(t)).filter(crashing).map(|(f, n)| format!("{f} {n}")).collect();
    if named.is_empty() {
        named = tables.iter().filter(ours).filter(crashing).map(|(f, n)| format!("{f} {n}")).collect();
    }
    *found = Some((netns, std::time::Instant::now(), named.clone()));
    Ok(named)
}

use nfnetlink::NFNL_SUBSYS_NFTABLES;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_DELTABLE: u16 = 2;
const NFTA_TABLE_NAME: u16 = 1;

/// Every nf_tables table of the network namespace, as (family, name) in nft's words, read over
/// netlink: no nft, so none of its crashes.
pub fn tables() -> std::io::Result<Vec<(String, String)>> {
    // (Every family's.)
    let msg = nfnetlink::message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE, libc::NLM_F_DUMP as u16, libc::AF_UNSPEC as u8, 0, &[]);
    let (mut found, mut error) = (Vec::new(), 0);
    nfnetlink::exchange(&msg, |datagram| dumped_tables(datagram, &mut found, &mut error))?;
    if error != 0 {
        return Err(std::io::Error::from_raw_os_error(-error));
    }
    Ok(found)
}

/// Reads one datagram of the table dump into `found`; true at its end (`error`: the kernel's).
fn dumped_tables(datagram: &[u8], found: &mut Vec<(String, String)>, error: &mut i32) -> bool {
    for m in nfnetlink::messages(datagram) {
        let Some((kind, body)) = m else {
            *error = -libc::EIO;
            return true;
        };
        if kind == libc::NLMSG_ERROR as u16 {
            *error = nfnetlink::error_of(body);
            return true;
        }
        if kind == libc::NLMSG_DONE as u16 {
            return true;
        }
        if kind != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE || body.len() < 4 {
            continue;
        }
        let family = match i32::from(body[0]) {
            libc::NFPROTO_INET => "inet",
            libc::NFPROTO_IPV4 => "ip",
            libc::NFPROTO_IPV6 => "ip6",
            libc::NFPROTO_ARP => "arp",
            libc::NFPROTO_BRIDGE => "bridge",
            libc::NFPROTO_NETDEV => "netdev",
            _ => continue,
        };
        let name = nfnetlink::attributes(body).find(|(t, _)| *t == NFTA_TABLE_NAME);
        if let Some((_, name)) = name {
            let name = name.split(|b| *b == 0).next().unwrap_or_default();
            found.push((family.to_string(), String::from_utf8_lossy(name).into_owned()));
        }
    }
    false
}

/// The names of the `what` (`chains`, `sets` or `maps`) of the family's kube-proxy table, as
/// `nft -j` lists them; tersely (`-t`), without the elements of sets and maps, which cost more
/// than everything else: at 10,000 Services, 0.04 s for the sets or the maps against 4.5 s
/// with their elements, 0.35 s for the chains.
fn listed(family: &str, what: &str) -> Result<BTreeSet<String>, NetfilterError> {
    let out = nft(&["-t", "-j", "list", what, family], "")?;
    let kind = what.trim_end_matches('s');
    let bad = |e: String| NetfilterError::Failed { command: format!("nft -t -j list {what} {family}"), stderr: e };
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

/// A large table that exists written again over several syncs, whatever it holds now (drift,
/// a failed transaction, an earlier run's Services), without replacing the table: Services
/// keep being served throughout, and the control loop takes the changes that come meanwhile
/// between steps.
/// 1. `start`: the fixed part (sets, maps and chains added where missing, the fixed chains
///    flushed and written).
/// 2. `next`, until `done`: first the chains the table lacks, then the others, each added,
///    flushed and written in one transaction, at most `REFRESH_SETS` anonymous sets (the
///    costly part of a transaction: `BUILD_STEP`) or about `refresh_lines` a step. With
///    them, every chain whose rules changed since the refresh began or since it wrote them, or
///    that is new (a Service created meanwhile), whatever its turn. A chain is written with
///    the chains it jumps to that the table lacks, or before them: no rule jumps to a chain
///    that does not exist, and no chain is ever added empty.
/// 3. Every set and map is flushed and filled in the step that writes the last chain the table
///    lacked (in the first, when it lacks none, as at the hourly resync): until then they
///    point where they pointed before, and the changes to them wait (a Service created or
///    deleted meanwhile); from then on, each step writes the elements that changed (a Service
///    deleted leaves the maps at once; its chain goes with the leftovers, `stale`).
///
/// Affinity sets are added (where missing, or to change their timeout), never flushed: they
/// hold the clients' affinities.
#[derive(Debug)]
pub struct Refresh {
    /// The fixed part written.
    base: Vec<String>,
    /// A hash of every chain's rules: as wanted when the refresh began for the chains still
    /// to write, as written for the others.
    hashes: HashMap<String, u64>,
    /// The chains the table lacks, still to write, in name order (before any verdict points
    /// at them).
    missing: BTreeSet<String>,
    /// The chains the table had, still to write, in name order.
    remaining: BTreeSet<String>,
    /// Every element of the sets and maps, as written, once they are (step 3).
    elements: Option<Elements>,
    /// The affinity sets written, as written (one whose timeout changed is written again).
    sets: BTreeMap<String, String>,
    /// A step found no chain left to write: what is left over goes in that step's sync.
    settled: bool,
}

fn rules_hash(rules: &[String]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    rules.hash(&mut h);
    h.finish()
}

/// The chains a rule jumps to (`goto x`, `jump x`, in verdicts and verdict maps).
fn targets(rule: &str) -> impl Iterator<Item = &str> {
    let mut words = rule.split(|c: char| c.is_whitespace() || c == ',').filter(|w| !w.is_empty());
    std::iter::from_fn(move || loop {
        let w = words.next()?;
        if w == "goto" || w == "jump" {
            return words.next();
        }
    })
}

impl Refresh {
    /// The first step's transaction, and the refresh it starts, over a table that holds
    /// `present` chains (what an earlier refresh added is written: it adds no chain empty).
    pub fn start(to: &Ruleset, present: &BTreeSet<String>) -> (String, Refresh) {
        let tbl = table(to.family);
        let rule_prefix = format!("add rule {tbl} ");
        let (rules, declarations): (Vec<&String>, Vec<&String>) = to.base.iter().partition(|l| l.starts_with(&rule_prefix));
        let mut t: Vec<String> = declarations.iter().map(|l| (*l).clone()).collect();
        t.extend(to.sets.values().cloned());
        let mut flushed = BTreeSet::new();
        for r in &rules {
            let chain = r[rule_prefix.len()..].split(' ').next().unwrap_or_default();
            if flushed.insert(chain) {
                t.push(format!("flush chain {tbl} {chain}"));
            }
        }
        t.extend(rules.iter().map(|l| (*l).clone()));
        let (missing, remaining) = to.chains.keys().cloned().partition(|name| !present.contains(name));
        let mut refresh = Refresh {
            base: to.base.clone(),
            hashes: to.chains.iter().map(|(name, rules)| (name.clone(), rules_hash(rules))).collect(),
            missing,
            remaining,
            elements: None,
            sets: to.sets.clone(),
            settled: false,
        };
        refresh.fill(to, &mut t);
        (t.join("\n") + "\n", refresh)
    }

    /// Step 3, once no chain the table lacked is left to write: every set and map flushed
    /// and filled.
    fn fill(&mut self, to: &Ruleset, t: &mut Vec<String>) {
        if self.elements.is_some() || !self.missing.is_empty() {
            return;
        }
        let tbl = table(to.family);
        t.extend(declared(to, "set").map(|name| format!("flush set {tbl} {name}")));
        t.extend(declared(to, "map").map(|name| format!("flush map {tbl} {name}")));
        t.extend(to.elements.iter().map(|((set, key), rest)| element_line(&tbl, "add", set, key, rest)));
        self.elements = Some(to.elements.clone());
    }

    /// The next step's transaction towards `to` (the Services as they are now, with the fixed
    /// part the refresh started with). Empty when there is nothing to write.
    pub fn next(&mut self, to: &Ruleset) -> String {
        let tbl = table(to.family);
        self.settled = self.missing.is_empty() && self.remaining.is_empty();
        let anonymous = |rules: &[String]| rules.iter().filter(|r| r.contains('{')).count();
        // Chains new, or changed since the refresh began or wrote them: now, whatever waits.
        let mut batch: Vec<(&String, &Vec<String>)> = Vec::new();
        for (name, rules) in &to.chains {
            let hash = rules_hash(rules);
            if self.hashes.get(name) != Some(&hash) {
                self.hashes.insert(name.clone(), hash);
                self.missing.remove(name);
                self.remaining.remove(name);
                batch.push((name, rules));
            }
        }
        self.pull(to, &mut batch, 0);
        // Then a step's worth of those waiting, the ones the table lacked first, each with
        // what it pulls. (Cut by anonymous sets, a random pick's vmap or a list of ranges, and
        // by lines, so that chains of one kind, sorted together by name, do not make one step
        // large.)
        let (mut sets, mut lines) = (0, 0);
        let (max_sets, max_lines) = (refresh_sets(to.chains.len()), refresh_lines(to.chains.len()));
        while sets < max_sets && lines < max_lines {
            let Some(name) = self.missing.pop_first().or_else(|| self.remaining.pop_first()) else { break };
            // (A Service deleted meanwhile: nothing to write.)
            if let Some(chain) = to.chains.get_key_value(&name) {
                let from = batch.len();
                batch.push(chain);
                self.pull(to, &mut batch, from);
                for (_, rules) in &batch[from..] {
                    sets += anonymous(rules);
                    lines += rules.len() + 1;
                }
            }
        }
        let mut t: Vec<String> = to.sets.iter().filter(|(name, l)| self.sets.get(*name) != Some(l)).map(|(_, l)| l.clone()).collect();
        self.sets.extend(to.sets.iter().map(|(name, l)| (name.clone(), l.clone())));
        // (Every chain of the step added first: chains of the step jump to one another.)
        t.extend(batch.iter().map(|(name, _)| format!("add chain {tbl} {name}")));
        let (deleted, added) = self.elements.as_ref().map(|written| element_changes(&tbl, written, &to.elements)).unwrap_or_default();
        t.extend(deleted);
        for (name, rules) in &batch {
            t.push(format!("flush chain {tbl} {name}"));
            t.extend(rules.iter().map(|r| format!("add rule {tbl} {name} {r}")));
        }
        t.extend(added);
        match &mut self.elements {
            Some(written) => written.clone_from(&to.elements),
            None => self.fill(to, &mut t),
        }
        // (Chains of Services deleted meanwhile stay in the table, out of every map once the
        // maps are written, until the leftovers go.)
        self.hashes.retain(|name, _| to.chains.contains_key(name));
        if t.is_empty() {
            String::new()
        } else {
            t.join("\n") + "\n"
        }
    }

    /// Adds to `batch`, from `from` on, the chains its chains jump to that the table lacks,
    /// and theirs in turn: a chain is written in the same step as those (every chain of a step
    /// is added before any rule), never jumping to one that does not exist.
    fn pull<'a>(&mut self, to: &'a Ruleset, batch: &mut Vec<(&'a String, &'a Vec<String>)>, from: usize) {
        let mut i = from;
        while i < batch.len() {
            let pulled: Vec<(&String, &Vec<String>)> = batch[i]
                .1
                .iter()
                .flat_map(|r| targets(r))
                .filter(|t| self.missing.remove(*t))
                .filter_map(|t| to.chains.get_key_value(t))
                .collect();
            batch.extend(pulled);
            i += 1;
        }
    }

    /// Every chain is written, and a step after the last of them (changes only, small) has
    /// run: `remove_stale` is what is left, in that step's sync rather than the last large
    /// step's (it lists the table's chains, 0.35 s at 10,000 Services, and deletes the
    /// leftovers).
    pub fn done(&self) -> bool {
        self.settled
    }
}

/// Removes the nftables mode's tables (both families). Returns a line per thing removed.
/// Found and deleted over netlink, not with nft: an nft that crashes on another table's sets
/// (`explain_crash`) would leave the table behind, its rules translating beside the mode that
/// follows; and nft would list the whole table (every element) to find it.
pub fn cleanup() -> Vec<String> {
    let (mut removed, failed) = removal();
    removed.extend(failed.into_iter().map(|e| format!("nftables: {e}")));
    removed
}

/// `cleanup` where a table left behind is an error (auto mode retiring this mode for another:
/// `proxier::Fallback::retire`, which tries again at the next sync).
pub fn remove_tables() -> Result<Vec<String>, String> {
    let (removed, failed) = removal();
    if failed.is_empty() {
        Ok(removed)
    } else {
        Err(failed.join("; "))
    }
}

/// The families whose table of the mode's name is there.
pub fn families_with_table() -> std::io::Result<Vec<Family>> {
    let present = tables()?;
    Ok(Family::ALL.into_iter().filter(|f| present.iter().any(|(ip, name)| ip == nft_family(*f) && name == TABLE)).collect())
}

/// The mode's tables removed (a line each), and what could not be done.
fn removal() -> (Vec<String>, Vec<String>) {
    let present = match families_with_table() {
        Ok(t) => t,
        // No nf_tables in this kernel: nothing this agent could have written.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP | libc::EPROTONOSUPPORT | libc::ENOENT)) => {
            tracing::debug!("nftables: no tables to remove: {e}");
            return (Vec::new(), Vec::new());
        }
        Err(e) => return (Vec::new(), vec![format!("could not list the tables to remove the mode's: {e}")]),
    };
    let (mut removed, mut failed) = (Vec::new(), Vec::new());
    for family in present {
        let ip = nft_family(family);
        match delete_table(family) {
            Ok(()) => removed.push(format!("nftables: table {ip} {TABLE}")),
            Err(e) => failed.push(format!("could not delete table {ip} {TABLE}: {e}")),
        }
    }
    (removed, failed)
}

/// The mode's table's name, in both families.
const TABLE: &str = "kube-proxy";

/// Deletes the family's table and everything in it, as `nft delete table` does.
fn delete_table(family: Family) -> std::io::Result<()> {
    let nfproto = match family {
        Family::V4 => libc::NFPROTO_IPV4,
        Family::V6 => libc::NFPROTO_IPV6,
    } as u8;
    let name = [TABLE.as_bytes(), &[0]].concat();
    let delete = nfnetlink::message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELTABLE, 0, nfproto, 0, &[(NFTA_TABLE_NAME, &name)]);
    nfnetlink::nftables_batch(&[delete])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table dump's messages read into (family, name); the dump ends at NLMSG_DONE, or at
    /// an error the kernel sends instead.
    #[test]
    fn the_table_dump_names_each_table_with_its_family() {
        let table = |family: u8, name: &str| {
            let mut body = vec![family, 0, 0, 0];
            let value = [name.as_bytes(), &[0]].concat();
            body.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
            body.extend_from_slice(&NFTA_TABLE_NAME.to_ne_bytes());
            body.extend_from_slice(&value);
            while body.len() % 4 != 0 {
                body.push(0);
            }
            message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE, &body)
        };
        let mut datagram = table(libc::NFPROTO_IPV4 as u8, "kube-proxy");
        datagram.extend(table(libc::NFPROTO_INET as u8, "firewalld"));
        let (mut found, mut error) = (Vec::new(), 0);
        assert!(!dumped_tables(&datagram, &mut found, &mut error), "more to come");
        assert!(dumped_tables(&message(libc::NLMSG_DONE as u16, &0i32.to_ne_bytes()), &mut found, &mut error));
        let named = |f: &str, n: &str| (f.to_string(), n.to_string());
        assert_eq!((found, error), (vec![named("ip", "kube-proxy"), named("inet", "firewalld")], 0));
        let (mut found, mut error) = (Vec::new(), 0);
        assert!(dumped_tables(&message(libc::NLMSG_ERROR as u16, &(-libc::EPERM).to_ne_bytes()), &mut found, &mut error));
        assert_eq!((found.len(), error), (0, -libc::EPERM));
    }

    /// A netlink message of `kind` around `body`.
    fn message(kind: u16, body: &[u8]) -> Vec<u8> {
        let mut m = ((16 + body.len()) as u32).to_ne_bytes().to_vec();
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(body);
        m
    }

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

    /// What the kernel would hold after our transactions, as far as they go: chains and their
    /// rules, elements. It refuses what nft refuses: a rule or verdict that jumps to a chain
    /// that does not exist, a chain flushed or written that does not exist, an element added
    /// over one of other data, an element deleted that is not there.
    #[derive(Default)]
    struct Kernel {
        chains: BTreeMap<String, Vec<String>>,
        elements: BTreeMap<(String, String), String>,
    }

    impl Kernel {
        /// No chain a map's verdict leads to, directly or through rules, is empty (where a
        /// packet would find nothing).
        fn served(&self) {
            for ((set, key), data) in &self.elements {
                let mut to_visit: Vec<&str> = targets(data).collect();
                let mut seen = BTreeSet::new();
                while let Some(chain) = to_visit.pop() {
                    if seen.insert(chain) {
                        let rules = &self.chains[chain];
                        assert!(!rules.is_empty(), "{set} {{ {key} }} leads to {chain}, which is empty");
                        to_visit.extend(rules.iter().flat_map(|r| targets(r)));
                    }
                }
            }
        }

        fn run(&mut self, tx: &str) {
            let tbl = table(Family::V4);
            for line in tx.lines() {
                if line.starts_with("add table") {
                    continue;
                }
                if line.starts_with("delete table") {
                    *self = Kernel::default();
                    continue;
                }
                let (op, rest) = line.split_once(&format!(" {tbl} ")).unwrap_or_else(|| panic!("a line of our table: {line}"));
                let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
                let exists = |k: &Kernel, chain: &str| assert!(k.chains.contains_key(chain), "no chain {chain}: {line}");
                match op {
                    "add chain" => {
                        self.chains.entry(name.to_string()).or_default();
                    }
                    "flush chain" => {
                        exists(self, name);
                        self.chains.get_mut(name).unwrap().clear();
                    }
                    "delete chain" => {
                        exists(self, name);
                        assert!(self.chains[name].is_empty(), "a chain deleted with rules: {line}");
                        let jumped_to = self.chains.values().flatten().chain(self.elements.values()).any(|r| targets(r).any(|t| t == name));
                        assert!(!jumped_to, "a chain deleted that something jumps to: {line}");
                        self.chains.remove(name);
                    }
                    "add rule" => {
                        exists(self, name);
                        for t in targets(text) {
                            exists(self, t);
                        }
                        self.chains.get_mut(name).unwrap().push(text.to_string());
                    }
                    "flush set" | "flush map" => self.elements.retain(|(set, _), _| set != name),
                    "add element" | "delete element" => {
                        let inner = text.strip_prefix("{ ").and_then(|t| t.strip_suffix(" }")).expect("{ element }");
                        let (key, data) = match inner.split_once(" : ") {
                            Some((k, d)) => (k.to_string(), format!(" : {d}")),
                            None => (inner.to_string(), String::new()),
                        };
                        let k = (name.to_string(), key);
                        if op == "delete element" {
                            assert!(self.elements.remove(&k).is_some(), "no such element: {line}");
                        } else {
                            for t in targets(&data) {
                                exists(self, t);
                            }
                            let old = self.elements.insert(k, data.clone());
                            assert!(old.is_none_or(|o| o == data), "an element of other data: {line}");
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// A table of `services` Service chains (each with a random pick, an anonymous set) with
    /// one verdict each in `service-ips`; `touched` Services get other rules.
    fn table_of(services: std::ops::Range<u32>, touched: &[u32], skip: &[u32]) -> Ruleset {
        let mut r = render(&Services::new(), &NodeContext::default(), &NftablesOptions::default());
        for i in services.filter(|i| !skip.contains(i)) {
            let (chain, endpoint) = (format!("service-{i:05}"), format!("endpoint-{i:05}"));
            let (to, count) = if touched.contains(&i) { ("10.0.9.9", "counter ") } else { ("10.0.0.1", "") };
            r.chains.insert(chain.clone(), vec![format!("{count}numgen random mod 1 vmap {{ 0 : goto {endpoint} }}")]);
            r.chains.insert(endpoint, vec![format!("meta l4proto tcp dnat to {to}:80")]);
            r.elements.insert(("service-ips".into(), format!("10.96.{}.{} . tcp . 80", i / 250, i % 250)), format!(" : goto {chain}"));
            // Every other one a NodePort, whose chain (sorted before the Service's) jumps to it.
            if i % 2 == 0 {
                let external = format!("external-{i:05}");
                r.chains.insert(external.clone(), vec!["jump mark-for-masquerade".into(), format!("goto {chain}")]);
                r.elements.insert(("service-nodeports".into(), format!("tcp . {}", 30000 + i)), format!(" : goto {external}"));
            }
        }
        r
    }

    /// A refresh writes every chain of the table once, a step's worth of anonymous sets at a
    /// time, the chains the table lacks first, each with the chains it jumps to, and fills the
    /// maps once none is left, so that no verdict leads to an empty chain at any step and no
    /// chain is added empty. It takes in the changes made meanwhile at the next step: a chain
    /// changed, written or still to come, is written at once, a Service created meanwhile
    /// too; a deleted one leaves the maps with the fill. At the end the table is what was
    /// wanted last, over a kernel that held an older, drifted table, and no step did what nft
    /// refuses.
    #[test]
    fn a_refresh_goes_in_steps_and_takes_the_changes_made_meanwhile() {
        let mut kernel = Kernel::default();
        // What an earlier run left: Services 0..600 (600..1200 came since) and 5000 (gone
        // since), the chain of 7 changed by someone.
        let mut old = table_of(0..600, &[], &[]);
        old.chains.extend(table_of(5000..5001, &[], &[]).chains);
        old.elements.extend(table_of(5000..5001, &[], &[]).elements);
        kernel.run(&transaction(None, &old));
        kernel.chains.get_mut("service-00007").unwrap()[0].insert_str(0, "counter ");
        kernel.served();
        let sets_in = |tx: &str| tx.lines().filter(|l| l.starts_with("add rule") && l.contains('{')).count();

        let first = table_of(0..1200, &[], &[]);
        let present: BTreeSet<String> = kernel.chains.keys().cloned().collect();
        let (tx, mut refresh) = Refresh::start(&first, &present);
        assert!(
            !tx.contains("add chain ip kube-proxy service-0") && !tx.contains("add chain ip kube-proxy endpoint-0"),
            "no chain added empty"
        );
        kernel.run(&tx);
        kernel.served();
        // 600 chains the table lacks, of a set each: more than a step.
        let tx = refresh.next(&first);
        kernel.run(&tx);
        kernel.served();
        assert_eq!(sets_in(&tx), REFRESH_SETS, "a step's worth of anonymous sets");
        assert!(tx.contains("flush chain ip kube-proxy service-00600\n") && !tx.contains("service-00000"), "what the table lacks first");
        assert_eq!(kernel.elements, old.elements, "no verdict points at the chains the table lacks before they are all written");
        // Meanwhile: 3 (present) and 1100 (lacking) change, 1200 comes, 9 goes, and 100 now
        // jumps to 1199 (lacking, not written yet).
        let mut second = table_of(0..1201, &[3, 1100], &[9]);
        second.chains.insert("service-00100".into(), vec!["goto service-01199".into()]);
        let tx = refresh.next(&second);
        assert!(tx.contains("add chain ip kube-proxy service-01200"), "a new Service is written at once");
        for chain in ["service-00003", "endpoint-00003", "service-01100", "endpoint-01100", "service-00100", "service-01199"] {
            assert_eq!(tx.matches(&format!("flush chain ip kube-proxy {chain}\n")).count(), 1, "{chain}: written at once");
        }
        kernel.run(&tx);
        kernel.served();
        assert_eq!(kernel.elements, old.elements, "the maps wait for the last chain the table lacks");
        let mut steps = 0;
        while !refresh.done() {
            let tx = refresh.next(&second);
            assert!(sets_in(&tx) <= REFRESH_SETS, "{} sets in a step", sets_in(&tx));
            for chain in ["service-00003", "service-01100", "service-01199"] {
                assert!(!tx.contains(&format!("flush chain ip kube-proxy {chain}\n")), "{chain} is not written again unchanged");
            }
            kernel.run(&tx);
            kernel.served();
            steps += 1;
            assert!(steps < 10, "a refresh ends");
        }
        for (name, rules) in &second.chains {
            assert_eq!(kernel.chains.get(name), Some(rules), "{name}");
        }
        assert_eq!(kernel.elements, second.elements);
        assert!(!kernel.elements.keys().any(|(_, k)| k == "10.96.0.9 . tcp . 80"), "a deleted Service left the map");
        // What is left for `stale`: the chains of Services gone (9, and 5000 from before).
        let left: Vec<&String> = kernel
            .chains
            .keys()
            .filter(|c| !second.chains.contains_key(*c) && !declared(&second, "chain").any(|d| d == c.as_str()))
            .collect();
        assert_eq!(left, ["endpoint-00009", "endpoint-05000", "external-05000", "service-00009", "service-05000"]);
        assert!(refresh.next(&second).is_empty(), "nothing more to write");
    }

    /// Over a table that lacks no chain (the hourly resync), the maps are filled in the first
    /// step.
    #[test]
    fn a_refresh_over_a_whole_table_fills_the_maps_at_once() {
        let mut kernel = Kernel::default();
        let old = table_of(0..10, &[], &[5]);
        kernel.run(&transaction(None, &old));
        let to = table_of(0..10, &[3], &[]);
        let mut present: BTreeSet<String> = kernel.chains.keys().cloned().collect();
        present.extend(["service-00005".to_string(), "endpoint-00005".to_string()]);
        kernel.run("add chain ip kube-proxy service-00005\nadd chain ip kube-proxy endpoint-00005\nadd rule ip kube-proxy service-00005 goto endpoint-00005\nadd rule ip kube-proxy endpoint-00005 accept\n");
        let (tx, refresh) = Refresh::start(&to, &present);
        kernel.run(&tx);
        kernel.served();
        assert_eq!(kernel.elements, to.elements);
        assert_eq!(refresh.elements.as_ref(), Some(&to.elements));
    }

    #[test]
    fn comments_are_cut_to_what_nft_takes() {
        assert_eq!(comment("ns1/svc1:p80"), "ns1/svc1:p80");
        let longest = format!("{}/{}:{}", "n".repeat(63), "s".repeat(63), "p".repeat(15));
        assert_eq!(comment(&longest), &longest[..128]);
        // Not inside a character (names are ASCII, but the cut must not panic on other text).
        assert_eq!(comment(&format!("{}é", "x".repeat(127))), "x".repeat(127));
    }

    /// A Service's ports, as the model gives them, in one of a few shapes by `shape`.
    fn shaped(i: u32, shape: u32, endpoints: u32) -> Vec<crate::model::PortView> {
        use crate::model::{EndpointView, PortView, Protocol, ServicePortName};
        let key = ObjectKey::new("default", format!("svc-{i}"));
        let ep = |n: u32| EndpointView {
            addr: std::net::Ipv4Addr::from(0x0a80_0000 + i * 16 + n).into(),
            port: 8080,
            ready: true,
            serving: true,
            terminating: false,
            local: n == 0,
        };
        let eps: Vec<EndpointView> = (0..endpoints).map(ep).collect();
        let name = |port: &str| ServicePortName { service: key.clone(), port: port.into(), protocol: Protocol::Tcp };
        let vip: std::net::IpAddr = std::net::Ipv4Addr::from(0x0a60_0000 + i).into();
        let mut p = PortView::new(name("http"), Family::V4, 80, vec![vip], eps.clone());
        match shape % 5 {
            0 => {}
            1 => p.node_port = Some(30000 + i as u16),
            2 => {
                p.node_port = Some(30000 + i as u16);
                p.lb_ips = vec![std::net::Ipv4Addr::from(0xcb00_7100 + i).into()];
                p.lb_source_ranges = vec!["192.0.2.0/24".parse().unwrap()];
                p.external_local = true;
                p.local_endpoints = eps.iter().filter(|e| e.local).cloned().collect();
            }
            3 => p.affinity_timeout = Some(10800),
            _ => p.external_ips = vec![std::net::Ipv4Addr::from(0xc633_6400 + i).into()],
        }
        let mut dns = PortView::new(name("dns"), Family::V4, 53, vec![vip], eps);
        dns.name.protocol = Protocol::Udp;
        vec![p, dns]
    }

    /// Writing only the Services a sync changed (`changes_alone`) leaves the kernel, and what
    /// the mode holds as applied, as writing the whole table compared with what was applied
    /// would: Services changed in shape and endpoints, deleted and created, over rounds; and
    /// the whole is written where the Services changed cannot be written alone.
    #[test]
    fn changes_alone_write_what_comparing_the_whole_would() {
        let node = NodeContext { nodeport_ips: vec!["192.0.2.1".parse().unwrap()], ..Default::default() };
        let key = |i: u32| ObjectKey::new("default", format!("svc-{i}"));
        let mut services: Services = (0..40).map(|i| (key(i), shaped(i, i, 2))).collect();
        let mut rules = NftablesRules::default();
        let (whole, alone) = render_alone(&services, &node, &rules.opts);
        assert!(alone, "no Service shares a name");
        let mut kernel = Kernel::default();
        kernel.run(&transaction(None, &whole));
        rules.applied = Some(whole);
        rules.alone = Some(node.clone());
        let change = |services: &mut Services, changed: &mut Changed, i: u32, to: Option<Vec<PortView>>| {
            let before = match to {
                Some(ports) => services.insert(key(i), ports),
                None => services.remove(&key(i)),
            };
            changed.entry(key(i)).or_insert(before);
        };
        for round in 1..6u32 {
            let mut changed = BTreeMap::new();
            for i in (round..40).step_by(7) {
                change(&mut services, &mut changed, i, Some(shaped(i, i + round, 1 + round % 3)));
            }
            change(&mut services, &mut changed, round * 3, None);
            change(&mut services, &mut changed, 100 + round, Some(shaped(100 + round, round, 2)));
            let c = rules.changes_alone(&services, &node, &changed).expect("written alone");
            assert!(!c.tx.contains("delete table"), "not the whole table");
            kernel.run(&c.tx);
            rules.commit_changes(c);
            let whole = render(&services, &node, &rules.opts);
            let differ = |a: &BTreeMap<String, Vec<String>>, b: &BTreeMap<String, Vec<String>>| -> Vec<String> {
                a.iter().filter(|(k, v)| b.get(*k) != Some(v)).map(|(k, _)| k.clone()).collect()
            };
            let fixed: BTreeSet<&str> = declared(&whole, "chain").collect();
            let mut held = kernel.chains.clone();
            held.retain(|name, _| !fixed.contains(name.as_str()));
            let (extra, lacking) = (differ(&held, &whole.chains), differ(&whole.chains, &held));
            assert!(
                extra.is_empty() && lacking.is_empty(),
                "round {round}: chains other than the whole's {extra:?}, or lacking {lacking:?}"
            );
            assert_eq!(kernel.elements, whole.elements, "round {round}: the elements");
            kernel.served();
            assert!(rules.applied.as_ref() == Some(&whole), "round {round}: what is held as applied");
        }
        let one = |services: &Services| BTreeMap::from([(key(1), Some(services[&key(1)].clone()))]);
        // Another node, or another fixed part: the whole.
        let other = NodeContext { masquerade_all: true, ..node.clone() };
        assert!(rules.changes_alone(&services, &other, &one(&services)).is_none());
        rules.opts.service_cidrs = vec!["10.96.0.0/16".parse().unwrap()];
        assert!(rules.changes_alone(&services, &node, &one(&services)).is_none());
        rules.opts.service_cidrs.clear();
        assert!(rules.changes_alone(&services, &node, &one(&services)).is_some());
        // What a Service was is not what the table holds (a change that was never written):
        // the whole.
        let mut wrong = one(&services);
        wrong.insert(key(1), Some(shaped(1, 3, 4)));
        assert!(rules.changes_alone(&services, &node, &wrong).is_none());
        // A Service changed to take another's IP and port (as an external IP): shared, so the
        // whole.
        let before = one(&services);
        let mut taker = shaped(1, 4, 2);
        taker[0].external_ips = services[&key(4)][0].cluster_ips.clone();
        services.insert(key(1), taker);
        assert!(rules.changes_alone(&services, &node, &before).is_none());
        let (_, alone) = render_alone(&services, &node, &rules.opts);
        assert!(!alone, "and the whole rendered says no Service has its names alone");
        // Changes waiting for an apply (one that a failure's backoff holds back) leave nothing
        // pending: only a batch's rest does.
        rules.changed(&key(1), None);
        assert!(!rules.pending(), "a change waiting is not a step left");
    }

    /// More Services changed than a sync writes: those that waited go first, keeping what the
    /// kernel had of them, and the newer changes fill the batch.
    #[test]
    fn a_batch_takes_what_waited_first() {
        let key = |i: u32| ObjectKey::new("default", format!("svc-{i:02}"));
        let ports = |i: u32| Some(shaped(i, i, 1));
        let waiting: Changed = [(key(50), ports(50)), (key(60), ports(60)), (key(70), ports(70))].into();
        let mut changed: Changed = (0..5).map(|i| (key(i), None)).collect();
        changed.insert(key(60), ports(61));
        let (batch1, rest) = batch(vec![waiting], changed, 4);
        let keys = |c: &Changed| c.keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(&batch1), [key(0), key(50), key(60), key(70)], "what waited, then the first changed since");
        assert_eq!(batch1[&key(60)], ports(60), "a Service that waited keeps what the kernel has");
        assert_eq!(rest.len(), 1);
        assert_eq!(keys(&rest[0]), [key(1), key(2), key(3), key(4)]);
        // More waiting than a batch: the older ones first, whatever the newer ones' keys.
        let (batch2, rest) = batch(rest, [(key(0), ports(0)), (key(1), ports(1))].into(), 3);
        assert_eq!(keys(&batch2), [key(1), key(2), key(3)], "the oldest first");
        assert_eq!(batch2[&key(1)], None, "with what the kernel had when it began to wait");
        assert_eq!(rest.iter().map(keys).collect::<Vec<_>>(), [vec![key(4)], vec![key(0)]], "then the older, then the newer");
        let (all, rest) = batch(Vec::new(), batch1, 10);
        assert_eq!((all.len(), rest.len()), (4, 0), "fewer than a batch: all of them");
    }

    /// A table of many chains (Services of 50 endpoints, a chain each) is written again in
    /// steps of more lines than one of few: each `nft -f` costs more there whatever its size.
    #[test]
    fn a_refresh_of_many_chains_takes_larger_steps() {
        let mut to = render(&Services::new(), &NodeContext::default(), &NftablesOptions::default());
        for i in 0..2000 {
            let arms: Vec<String> = (0..50).map(|b| format!("{b} : goto endpoint-{i:05}-{b:02}")).collect();
            to.chains.insert(format!("service-{i:05}"), vec![format!("numgen random mod 50 vmap {{ {} }}", arms.join(" , "))]);
            for b in 0..50 {
                to.chains.insert(format!("endpoint-{i:05}-{b:02}"), vec![format!("meta l4proto tcp dnat to 10.1.{}.{b}:80", i % 250)]);
            }
        }
        let present: BTreeSet<String> = to.chains.keys().cloned().collect();
        let (_, mut refresh) = Refresh::start(&to, &present);
        let mut steps = 0;
        while !refresh.done() {
            let tx = refresh.next(&to);
            // (A chain's lines are counted as its rules and one: its `add chain` and `flush
            // chain` are two.)
            assert!(tx.lines().count() <= refresh_lines(to.chains.len()) * 3 / 2 + 200, "a step of about its lines");
            steps += 1;
        }
        // (102,000 chains: 24 steps of 12,750 lines, against 49 of 5,000 lines.)
        assert!(steps <= 30, "{steps} steps");
    }

    /// A Service's affinity timeout changed: its affinity sets are added again with the new
    /// timeout (the kernel updates a set's timeout in place and keeps its elements), by a sync
    /// that writes the Service alone, and by a refresh whose steps pass it.
    #[test]
    fn an_affinity_timeout_change_adds_the_sets_again() {
        let node = NodeContext::default();
        let key = ObjectKey::new("default", "svc-3");
        let mut services: Services = [(key.clone(), shaped(3, 3, 2))].into();
        let rules = NftablesRules::default();
        let before = render(&services, &node, &rules.opts);
        assert_eq!(before.sets.len(), 2, "a set per endpoint");
        services.get_mut(&key).unwrap()[0].affinity_timeout = Some(60);
        let after = render(&services, &node, &rules.opts);
        let tx = transaction(Some(&before), &after);
        let lines: Vec<&str> = tx.lines().collect();
        assert_eq!(lines.len(), 2, "the two sets and nothing else:\n{tx}");
        assert!(lines.iter().all(|l| l.starts_with("add set ") && l.contains("timeout 60s")), "{tx}");
        // Written alone (what a sync of that one change does).
        let mut rules = NftablesRules { applied: Some(before.clone()), alone: Some(node.clone()), ..NftablesRules::default() };
        let mut was = services[&key].clone();
        was[0].affinity_timeout = Some(10800);
        let c = rules.changes_alone(&services, &node, &[(key.clone(), Some(was))].into()).expect("written alone");
        assert_eq!(c.tx, tx);
        rules.commit_changes(c);
        assert!(rules.applied.as_ref() == Some(&after));
        // A refresh that began before the change writes the sets again at its next step.
        let present: BTreeSet<String> = before.chains.keys().cloned().collect();
        let (first, mut refresh) = Refresh::start(&before, &present);
        assert_eq!(first.matches("timeout 10800s").count(), 2, "the refresh's first step adds the sets");
        let next = refresh.next(&after);
        assert_eq!(next.matches("timeout 60s").count(), 2, "and the next the changed ones:\n{next}");
        assert_eq!(refresh.next(&after).matches("add set").count(), 0, "once");
    }

    /// What is left of a build that failed counts as building (Services are missing from the
    /// kernel) until the table is whole again, or a write in place has filled its maps.
    #[test]
    fn a_build_that_failed_counts_as_building_until_the_maps_are_filled() {
        let mut rules = NftablesRules { partial: true, ..NftablesRules::default() };
        assert!(rules.building(), "a step failed: no build goes on, the table is partial");
        let to = table_of(0..10, &[], &[]);
        let (_, lacking) = Refresh::start(&to, &BTreeSet::new());
        rules.refreshing = Some(lacking);
        assert!(rules.building(), "written again in place, maps not filled yet");
        let present: BTreeSet<String> = to.chains.keys().cloned().collect();
        let (_, filled) = Refresh::start(&to, &present);
        rules.refreshing = Some(filled);
        assert!(!rules.building(), "the maps are filled: every Service is served");
        rules.refreshing = None;
        rules.partial = false;
        assert!(!rules.building());
    }
}
