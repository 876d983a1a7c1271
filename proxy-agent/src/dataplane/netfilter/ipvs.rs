//! IPVS mode, as kube-proxy's: an IPVS virtual server per Service address and port (cluster
//! IP, external IPs, load-balancer IPs, node address + NodePort) with the endpoints as real
//! servers, the Service addresses on a dummy `kube-ipvs0` interface so the node accepts them,
//! and ipsets plus a few iptables rules for what IPVS does not do itself (masquerade, hairpin).
//! Programmed with `ipvsadm-restore`, `ipset restore` and `iptables-restore`; only virtual and
//! real servers and set entries that changed are touched, so existing IPVS connections keep
//! their real server and one endpoint change costs a few commands at any scale. One
//! `IpvsRules` per family, as kube-proxy's dual-stack IPVS mode: the families share the
//! dummy interface and the IPVS table; IPv6 has its own ipsets (`KUBE-6-` names, kube-proxy's)
//! and its rules go to ip6tables.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use super::{
    delete_jumps, ensure_jumps, iptables_restore, run, run_with_input, Iptables, Jump, NetfilterError, NodeContext, Plan, RuleSet, Services,
};
use crate::{
    dataplane::ProxyMode,
    model::{Cidr, Family},
};

pub const DUMMY: &str = "kube-ipvs0";

/// `--ipvs-scheduler`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduler(pub String);

impl Default for Scheduler {
    fn default() -> Self {
        Self("rr".into())
    }
}

impl std::str::FromStr for Scheduler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        const KNOWN: [&str; 11] = ["rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "mh"];
        if KNOWN.contains(&s) {
            Ok(Self(s.into()))
        } else {
            Err(format!("unknown IPVS scheduler {s:?} (one of {})", KNOWN.join(", ")))
        }
    }
}

/// A virtual server: protocol, address, port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VirtualKey {
    pub proto: &'static str,
    pub addr: IpAddr,
    pub port: u16,
}

impl VirtualKey {
    /// `addr:port`, `[addr]:port` for IPv6, as ipvsadm writes and reads them.
    fn at(&self) -> SocketAddr {
        SocketAddr::new(self.addr, self.port)
    }

    fn flag(&self) -> &'static str {
        if self.proto == "udp" {
            "-u"
        } else {
            "-t"
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Virtual {
    /// The scheduler (`--ipvs-scheduler`).
    pub scheduler: String,
    /// ClientIP affinity timeout (IPVS persistence).
    pub persistence: Option<u32>,
    pub reals: BTreeSet<(IpAddr, u16)>,
}

/// What IPVS mode programs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    pub virtuals: BTreeMap<VirtualKey, Virtual>,
    /// Addresses bound to `kube-ipvs0`.
    pub addresses: BTreeSet<IpAddr>,
    /// ipset name -> (type, entries).
    pub sets: BTreeMap<&'static str, (&'static str, BTreeSet<String>)>,
    /// The iptables-restore input (nat and filter).
    pub iptables: String,
}

/// The sysctls IPVS mode needs, as kube-proxy sets them: netfilter must see IPVS-forwarded
/// packets (masquerade, hairpin), connections to removed real servers are expired, and the
/// VIPs on the dummy interface are not answered for in ARP.
pub const SYSCTLS: [(&str, &str); 4] = [
    ("net/ipv4/vs/conntrack", "1"),
    ("net/ipv4/vs/expire_nodest_conn", "1"),
    ("net/ipv4/vs/expire_quiescent_template", "1"),
    ("net/ipv4/ip_forward", "1"),
];

/// `ipvs.strictARP`: the node answers ARP only for addresses of the interface asked on, so the
/// VIPs on kube-ipvs0 are not announced (what MetalLB's L2 mode needs).
pub const STRICT_ARP_SYSCTLS: [(&str, &str); 2] = [("net/ipv4/conf/all/arp_ignore", "1"), ("net/ipv4/conf/all/arp_announce", "2")];

/// IPVS mode's settings beyond the node view (kube-proxy's `ipvs` section and the mark).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpvsOptions {
    pub scheduler: Scheduler,
    /// The masquerade mark, as rules write it.
    pub mark: String,
    /// Virtual servers in these ranges are not ours: never removed.
    pub exclude_cidrs: Vec<crate::model::store::Cidr>,
    pub strict_arp: bool,
    /// `ipvsadm --set`: TCP, TCP after FIN, UDP session timeouts (None: the kernel's).
    pub timeouts: (Option<std::time::Duration>, Option<std::time::Duration>, Option<std::time::Duration>),
    /// The family programmed.
    pub family: Family,
}

impl Default for IpvsOptions {
    fn default() -> Self {
        Self {
            scheduler: Scheduler::default(),
            mark: "0x4000".into(),
            exclude_cidrs: Vec::new(),
            strict_arp: false,
            timeouts: (None, None, None),
            family: Family::V4,
        }
    }
}

impl IpvsOptions {
    /// The sysctls the mode needs.
    pub fn sysctls(&self) -> Vec<(&'static str, &'static str)> {
        let strict = if self.strict_arp { &STRICT_ARP_SYSCTLS[..] } else { &[] };
        SYSCTLS.iter().chain(strict).copied().collect()
    }

    /// Forgets the virtual servers in ipvs.excludeCIDRs: they are someone else's, and what is
    /// not known is not touched.
    /// The other family's virtual servers are its own `IpvsRules`'.
    pub fn keep_only_ours<V>(&self, virtuals: &mut BTreeMap<VirtualKey, V>) {
        virtuals.retain(|k, _| Family::of(k.addr) == self.family && !self.exclude_cidrs.iter().any(|c| c.contains(k.addr)));
    }

    /// `ipvsadm --set TCP TCPFIN UDP` arguments (seconds; 0 leaves one as it is), when any is set.
    pub fn set_timeouts_args(&self) -> Option<Vec<String>> {
        let (t, f, u) = self.timeouts;
        if t.is_none() && f.is_none() && u.is_none() {
            return None;
        }
        let secs = |d: Option<std::time::Duration>| d.map_or(0, |d| d.as_secs().max(1)).to_string();
        Some(vec!["--set".into(), secs(t), secs(f), secs(u)])
    }
}

/// kube-proxy's ipsets: the IPv4 name, the IPv6 one (`KUBE-` becomes `KUBE-6-`, cut to the
/// 31 characters a set name may have, as kube-proxy cuts it), and the type.
const SETS: [(&str, &str, &str); 13] = [
    ("KUBE-CLUSTER-IP", "KUBE-6-CLUSTER-IP", "hash:ip,port"),
    ("KUBE-LOOP-BACK", "KUBE-6-LOOP-BACK", "hash:ip,port,ip"),
    ("KUBE-EXTERNAL-IP", "KUBE-6-EXTERNAL-IP", "hash:ip,port"),
    ("KUBE-EXTERNAL-IP-LOCAL", "KUBE-6-EXTERNAL-IP-LOCAL", "hash:ip,port"),
    ("KUBE-LOAD-BALANCER", "KUBE-6-LOAD-BALANCER", "hash:ip,port"),
    ("KUBE-LOAD-BALANCER-LOCAL", "KUBE-6-LOAD-BALANCER-LOCAL", "hash:ip,port"),
    ("KUBE-LOAD-BALANCER-FW", "KUBE-6-LOAD-BALANCER-FW", "hash:ip,port"),
    ("KUBE-LOAD-BALANCER-SOURCE-CIDR", "KUBE-6-LOAD-BALANCER-SOURCE-CID", "hash:ip,port,net"),
    ("KUBE-LOAD-BALANCER-SOURCE-IP", "KUBE-6-LOAD-BALANCER-SOURCE-IP", "hash:ip,port,ip"),
    ("KUBE-NODE-PORT-TCP", "KUBE-6-NODE-PORT-TCP", "bitmap:port"),
    ("KUBE-NODE-PORT-UDP", "KUBE-6-NODE-PORT-UDP", "bitmap:port"),
    ("KUBE-NODE-PORT-LOCAL-TCP", "KUBE-6-NODE-PORT-LOCAL-TCP", "bitmap:port"),
    ("KUBE-NODE-PORT-LOCAL-UDP", "KUBE-6-NODE-PORT-LOCAL-UDP", "bitmap:port"),
];

/// A set's name in `family` (`base`: its IPv4 name).
fn set_name(family: Family, base: &str) -> &'static str {
    let (v4, v6, _) = SETS.iter().find(|(v4, _, _)| *v4 == base).expect("a known set");
    match family {
        Family::V4 => v4,
        Family::V6 => v6,
    }
}

pub fn desired(services: &Services, node: &NodeContext, opts: &IpvsOptions) -> Desired {
    let scheduler = &opts.scheduler;
    let family = opts.family;
    let mut d = Desired::default();
    for (v4, v6, ty) in SETS {
        d.sets.insert(if family == Family::V4 { v4 } else { v6 }, (ty, BTreeSet::new()));
    }
    let add = |d: &mut Desired, set: &'static str, entry: String| {
        d.sets.get_mut(set_name(family, set)).expect("known set").1.insert(entry);
    };
    let mut drops: Vec<String> = Vec::new();
    for port in services.values().flatten().filter(|p| p.family == family) {
        let p = Plan::new(port);
        let Some(cip) = p.cluster_ip else { continue };
        // Without endpoints there is no virtual server: the address is still on kube-ipvs0,
        // so the node's own stack refuses the connection (TCP reset, ICMP port unreachable),
        // as kube-proxy's REJECT does. Endpoints elsewhere but none here under a Local
        // policy: dropped, as kube-proxy does.
        let proto = p.proto;
        let drop_rule = |dst: String, dport: u16| {
            format!(
                "-A KUBE-IPVS-DROP {dst}-p {proto} -m {proto} --dport {dport} -m comment --comment \"{} has no local endpoints\" -j DROP",
                p.spn
            )
        };
        let reals = |eps: &[crate::model::EndpointView]| eps.iter().map(|e| (e.addr, e.port)).collect::<BTreeSet<_>>();
        let virt = |eps: &[crate::model::EndpointView]| Virtual {
            scheduler: scheduler.0.clone(),
            persistence: port.affinity_timeout,
            reals: reals(eps),
        };
        if proto == "sctp" {
            continue;
        }
        if p.has_internal_endpoints {
            d.virtuals.insert(VirtualKey { proto, addr: cip, port: port.port }, virt(p.internal()));
        } else if p.has_endpoints {
            drops.push(drop_rule(format!("-d {} ", Cidr::host(cip)), port.port));
        }
        d.addresses.insert(cip);
        add(&mut d, "KUBE-CLUSTER-IP", format!("{cip},{proto}:{}", port.port));
        for e in p.reachable.iter() {
            add(&mut d, "KUBE-LOOP-BACK", format!("{},{proto}:{},{}", e.addr, e.port, e.addr));
        }
        let external_ok = p.has_external_endpoints;
        let local_drop = !external_ok && p.has_endpoints;
        for ip in port.external_ips.iter().chain(&port.lb_ips) {
            if external_ok {
                d.virtuals.insert(VirtualKey { proto, addr: *ip, port: port.port }, virt(p.external()));
            } else if local_drop {
                drops.push(drop_rule(format!("-d {} ", Cidr::host(*ip)), port.port));
            }
            d.addresses.insert(*ip);
        }
        for ip in &port.external_ips {
            // Under externalTrafficPolicy Local the client address is kept: no masquerade mark.
            let set = if port.external_local { "KUBE-EXTERNAL-IP-LOCAL" } else { "KUBE-EXTERNAL-IP" };
            add(&mut d, set, format!("{ip},{proto}:{}", port.port));
        }
        for ip in &port.lb_ips {
            let entry = format!("{ip},{proto}:{}", port.port);
            if port.external_local {
                add(&mut d, "KUBE-LOAD-BALANCER-LOCAL", entry.clone());
            }
            if !port.lb_source_ranges.is_empty() {
                // loadBalancerSourceRanges: only these sources get through; the node itself
                // too when one of its addresses is in a range (hairpin through the LB).
                add(&mut d, "KUBE-LOAD-BALANCER-FW", entry.clone());
                for r in &port.lb_source_ranges {
                    add(&mut d, "KUBE-LOAD-BALANCER-SOURCE-CIDR", format!("{entry},{r}"));
                }
                if crate::model::Cidr::any_contains(&port.lb_source_ranges, &node.node_ips) {
                    add(&mut d, "KUBE-LOAD-BALANCER-SOURCE-IP", format!("{entry},{ip}"));
                }
            }
            add(&mut d, "KUBE-LOAD-BALANCER", entry);
        }
        if let Some(np) = port.node_port {
            for ip in &node.nodeport_ips {
                if external_ok {
                    d.virtuals.insert(VirtualKey { proto, addr: *ip, port: np }, virt(p.external()));
                }
            }
            if local_drop {
                drops.push(drop_rule("-m addrtype --dst-type LOCAL ".into(), np));
            }
            let (all, local) = if proto == "udp" {
                ("KUBE-NODE-PORT-UDP", "KUBE-NODE-PORT-LOCAL-UDP")
            } else {
                ("KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT-LOCAL-TCP")
            };
            add(&mut d, all, np.to_string());
            if port.external_local {
                add(&mut d, local, np.to_string());
            }
        }
    }
    d.iptables = iptables_rules(node, &drops, &opts.mark, family);
    d
}

fn iptables_rules(node: &NodeContext, drops: &[String], mark: &str, family: Family) -> String {
    // The family's sets, by their IPv4 names.
    let set = |base: &str| set_name(family, base);
    let mut s = String::from("*filter\n:KUBE-IPVS-DROP - [0:0]\n:KUBE-IPVS-SOURCE-RANGES - [0:0]\n");
    for r in drops {
        let _ = writeln!(s, "{r}");
    }
    let _ = writeln!(s, "-A KUBE-IPVS-DROP -m comment --comment \"load balancer with loadBalancerSourceRanges\" -m set --match-set {} dst,dst -j KUBE-IPVS-SOURCE-RANGES", set("KUBE-LOAD-BALANCER-FW"));
    let _ = writeln!(s, "-A KUBE-IPVS-SOURCE-RANGES -m set --match-set {} dst,dst,src -j RETURN", set("KUBE-LOAD-BALANCER-SOURCE-CIDR"));
    let _ = writeln!(s, "-A KUBE-IPVS-SOURCE-RANGES -m set --match-set {} dst,dst,src -j RETURN", set("KUBE-LOAD-BALANCER-SOURCE-IP"));
    let _ = writeln!(s, "-A KUBE-IPVS-SOURCE-RANGES -m comment --comment \"source not in loadBalancerSourceRanges\" -j DROP");
    s += "COMMIT\n*nat\n";
    for c in ["KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-MARK-MASQ", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER"] {
        let _ = writeln!(s, ":{c} - [0:0]");
    }
    let _ = writeln!(s, "-A KUBE-POSTROUTING -m comment --comment \"Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose\" -m set --match-set {} dst,dst,src -j MASQUERADE", set("KUBE-LOOP-BACK"));
    let _ = writeln!(s, "-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN");
    let _ = writeln!(s, "-A KUBE-POSTROUTING -j MARK --xor-mark {mark}");
    let _ =
        writeln!(s, "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully");
    let _ = writeln!(s, "-A KUBE-MARK-MASQ -j MARK --or-mark {mark}");
    match (node.masquerade_all, node.local.iptables(true)) {
        (true, _) => {
            let _ = writeln!(s, "-A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set {} dst,dst -j KUBE-MARK-MASQ", set("KUBE-CLUSTER-IP"));
        }
        (false, Some(not_local)) => {
            let _ = writeln!(s, "-A KUBE-SERVICES {not_local} -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set {} dst,dst -j KUBE-MARK-MASQ", set("KUBE-CLUSTER-IP"));
        }
        (false, None) => {}
    }
    let _ = writeln!(s, "-A KUBE-SERVICES -m comment --comment \"Kubernetes service external ip + port for masquerade and filter purpose\" -m set --match-set {} dst,dst -j KUBE-MARK-MASQ", set("KUBE-EXTERNAL-IP"));
    let _ = writeln!(
        s,
        "-A KUBE-SERVICES -m comment --comment \"Kubernetes service lb portal\" -m set --match-set {} dst,dst -j KUBE-LOAD-BALANCER",
        set("KUBE-LOAD-BALANCER")
    );
    if node.nodeport_all {
        let _ = writeln!(s, "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT");
    } else {
        for ip in &node.nodeport_ips {
            let _ = writeln!(s, "-A KUBE-SERVICES -d {ip} -j KUBE-NODE-PORT");
        }
    }
    let _ = writeln!(s, "-A KUBE-LOAD-BALANCER -m comment --comment \"Kubernetes service load balancer ip + port with externalTrafficPolicy=local\" -m set --match-set {} dst,dst -j RETURN", set("KUBE-LOAD-BALANCER-LOCAL"));
    let _ = writeln!(s, "-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ");
    for proto in ["TCP", "UDP"] {
        let p = proto.to_lowercase();
        let _ = writeln!(s, "-A KUBE-NODE-PORT -p {p} -m comment --comment \"Kubernetes nodeport {proto} port with externalTrafficPolicy=local\" -m set --match-set {} dst -j RETURN", set(&format!("KUBE-NODE-PORT-LOCAL-{proto}")));
        let _ = writeln!(s, "-A KUBE-NODE-PORT -p {p} -m comment --comment \"Kubernetes nodeport {proto} port for masquerade purpose\" -m set --match-set {} dst -j KUBE-MARK-MASQ", set(&format!("KUBE-NODE-PORT-{proto}")));
    }
    s += "COMMIT\n";
    s
}

/// The jumps from the built-in chains.
const JUMPS: [Jump; 4] = [
    ("nat", "PREROUTING", "", "kubernetes service portals", "KUBE-SERVICES"),
    ("nat", "OUTPUT", "", "kubernetes service portals", "KUBE-SERVICES"),
    ("nat", "POSTROUTING", "", "kubernetes postrouting rules", "KUBE-POSTROUTING"),
    ("filter", "INPUT", "", "kubernetes services without local endpoints", "KUBE-IPVS-DROP"),
];

/// ipvsadm-restore commands for a virtual server and its real servers.
fn add_virtual(out: &mut String, k: &VirtualKey, v: &Virtual) {
    let persist = v.persistence.map(|t| format!(" -p {t}")).unwrap_or_default();
    let _ = writeln!(out, "-A {} {} -s {}{persist}", k.flag(), k.at(), v.scheduler);
    for (ip, port) in &v.reals {
        let _ = writeln!(out, "-a {} {} -r {} -m -w 1", k.flag(), k.at(), SocketAddr::new(*ip, *port));
    }
}

/// What `ipvsadm-restore` needs to go from `from` to `to`.
pub fn ipvsadm_delta(from: &BTreeMap<VirtualKey, Virtual>, to: &BTreeMap<VirtualKey, Virtual>) -> String {
    let mut out = String::new();
    for (k, v) in to {
        match from.get(k) {
            None => add_virtual(&mut out, k, v),
            Some(old) => {
                if old.persistence != v.persistence || old.scheduler != v.scheduler {
                    let persist = v.persistence.map(|t| format!(" -p {t}")).unwrap_or_default();
                    let _ = writeln!(out, "-E {} {} -s {}{persist}", k.flag(), k.at(), v.scheduler);
                }
                for (ip, port) in v.reals.difference(&old.reals) {
                    let _ = writeln!(out, "-a {} {} -r {} -m -w 1", k.flag(), k.at(), SocketAddr::new(*ip, *port));
                }
                for (ip, port) in old.reals.difference(&v.reals) {
                    let _ = writeln!(out, "-d {} {} -r {}", k.flag(), k.at(), SocketAddr::new(*ip, *port));
                }
            }
        }
    }
    for k in from.keys().filter(|k| !to.contains_key(*k)) {
        let _ = writeln!(out, "-D {} {}", k.flag(), k.at());
    }
    out
}

/// Parses `ipvsadm -Sn` output.
pub fn parse_ipvsadm_save(text: &str) -> BTreeMap<VirtualKey, Virtual> {
    let mut out: BTreeMap<VirtualKey, Virtual> = BTreeMap::new();
    let parse_vk = |flag: &str, addr: &str| -> Option<VirtualKey> {
        let proto = match flag {
            "-t" => "tcp",
            "-u" => "udp",
            _ => return None,
        };
        let at: SocketAddr = addr.parse().ok()?;
        Some(VirtualKey { proto, addr: at.ip(), port: at.port() })
    };
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() < 3 {
            continue;
        }
        let Some(k) = parse_vk(w[1], w[2]) else { continue };
        match w[0] {
            "-A" => {
                let persistence = w.iter().position(|x| *x == "-p").and_then(|i| w.get(i + 1)).and_then(|t| t.parse().ok());
                let scheduler = w.iter().position(|x| *x == "-s").and_then(|i| w.get(i + 1)).map(|s| s.to_string()).unwrap_or_default();
                out.insert(k, Virtual { scheduler, persistence, reals: BTreeSet::new() });
            }
            "-a" => {
                let real = w
                    .iter()
                    .position(|x| *x == "-r")
                    .and_then(|i| w.get(i + 1))
                    .and_then(|r| r.parse::<SocketAddr>().ok())
                    .map(|r| (r.ip(), r.port()));
                if let (Some(v), Some(r)) = (out.get_mut(&k), real) {
                    v.reals.insert(r);
                }
            }
            _ => {}
        }
    }
    out
}

const IPVSADM: &str = "ipvsadm";
const IPSET: &str = "ipset";

pub struct IpvsRules {
    opts: IpvsOptions,
    /// Where the masquerade and drop rules go.
    ipt: Iptables,
    /// What the last successful apply left in the kernel (None: read it from the kernel).
    applied: Option<Desired>,
}

impl IpvsRules {
    pub fn new(opts: IpvsOptions, ipt: Iptables) -> Self {
        Self { opts, ipt, applied: None }
    }
}

/// Makes `kube-ipvs0` exist and returns its addresses of `family`.
fn ensure_dummy(family: Family) -> Result<BTreeSet<IpAddr>, NetfilterError> {
    if run("ip", "iproute2", &["link", "show", DUMMY]).is_err() {
        run("ip", "iproute2", &["link", "add", DUMMY, "type", "dummy"])?;
    }
    let (flag, word) = if family == Family::V4 { ("-4", "inet") } else { ("-6", "inet6") };
    let out = run("ip", "iproute2", &[flag, "-o", "addr", "show", "dev", DUMMY])?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().skip_while(|w| *w != word).nth(1))
        .filter_map(|a| a.split('/').next()?.parse().ok())
        .collect())
}

type Sets = BTreeMap<&'static str, (&'static str, BTreeSet<String>)>;

/// Brings the sets to `sets`. A set whose applied entries are known gets only the entries
/// that were added and removed (one endpoint change is a few lines, whatever the number of
/// Services); one whose content is unknown (the first sync) is filled as a temporary set and
/// swapped in whole, so a packet never sees it half written.
fn ipset_restore(sets: &Sets, applied: &Sets) -> Result<(), NetfilterError> {
    let unknown = sets.keys().any(|name| !applied.contains_key(name));
    // Sets an earlier run left may have been sized for more entries: only missing ones are
    // created under their own name.
    let existing: BTreeSet<String> =
        if unknown { run(IPSET, IPSET, &["list", "-n"])?.lines().map(String::from).collect() } else { BTreeSet::new() };
    let s = ipset_delta(sets, applied, &existing);
    if s.is_empty() {
        return Ok(());
    }
    run_with_input(IPSET, IPSET, &["restore"], &s).map(|_| ())
}

/// `create` options sizing a set for `entries`: a hash set's default limit is 65,536 entries,
/// which 30,000 Services of 4 endpoints exceed in KUBE-LOOP-BACK, so the limit is twice the
/// entries (an incremental add past it fails, and the next sync re-creates the set bigger).
/// An IPv6 set (its name says so) holds that family.
fn set_options(name: &str, ty: &str, entries: usize) -> String {
    if ty.starts_with("bitmap:port") {
        return " range 0-65535".into();
    }
    let maxelem = (2 * entries).next_power_of_two().max(65_536);
    let hashsize = (entries / 4).next_power_of_two().max(1024);
    let family = if name.starts_with("KUBE-6-") { " family inet6" } else { "" };
    format!("{family} hashsize {hashsize} maxelem {maxelem}")
}

/// The `ipset restore` input for [`ipset_restore`]; `existing` names the sets the kernel has.
pub fn ipset_delta(sets: &Sets, applied: &Sets, existing: &BTreeSet<String>) -> String {
    let mut s = String::new();
    for (i, (name, (ty, entries))) in sets.iter().enumerate() {
        match applied.get(name) {
            Some((t, old)) if t == ty => {
                for e in entries.difference(old) {
                    let _ = writeln!(s, "add {name} {e} -exist");
                }
                for e in old.difference(entries) {
                    let _ = writeln!(s, "del {name} {e} -exist");
                }
            }
            _ => {
                // Set names are at most 31 characters, hence the short temporary names.
                let opts = set_options(name, ty, entries.len());
                let tmp = format!("KUBE-PROXY-TMP-{}{i}", if name.starts_with("KUBE-6-") { "6-" } else { "" });
                if !existing.contains(*name) {
                    let _ = writeln!(s, "create {name} {ty}{opts}");
                }
                let _ = writeln!(s, "create {tmp} {ty}{opts} -exist");
                let _ = writeln!(s, "flush {tmp}");
                for e in entries {
                    let _ = writeln!(s, "add {tmp} {e} -exist");
                }
                let _ = writeln!(s, "swap {tmp} {name}");
                let _ = writeln!(s, "destroy {tmp}");
            }
        }
    }
    s
}

impl RuleSet for IpvsRules {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ipvs
    }

    fn render(&self, services: &Services, node: &NodeContext) -> String {
        let d = desired(services, node, &self.opts);
        let mut s = String::from("# IPVS virtual and real servers (ipvsadm-restore)\n");
        s += &ipvsadm_delta(&BTreeMap::new(), &d.virtuals);
        s += &format!("\n# addresses on {DUMMY}\n");
        for a in &d.addresses {
            s += &format!("{}\n", Cidr::host(*a));
        }
        s += "\n# ipsets\n";
        for (name, (ty, entries)) in &d.sets {
            s += &format!("create {name} {ty}\n");
            for e in entries {
                s += &format!("add {name} {e}\n");
            }
        }
        s += "\n# iptables (iptables-restore --noflush)\n";
        s += &d.iptables;
        s
    }

    fn apply(&mut self, services: &Services, node: &NodeContext) -> Result<usize, NetfilterError> {
        let t0 = std::time::Instant::now();
        let d = desired(services, node, &self.opts);
        let t_desired = t0.elapsed();
        // Taken: it stays None if anything below fails, so the next sync starts from the kernel.
        let prev = match self.applied.take() {
            Some(prev) => prev,
            None => {
                for (key, value) in self.opts.sysctls() {
                    super::sysctl::ensure(key, value).map_err(|e| NetfilterError::Failed {
                        command: format!("sysctl {key}={value}"),
                        stderr: format!("{e} (is the ip_vs module loaded?)"),
                    })?;
                }
                if let Some(args) = self.opts.set_timeouts_args() {
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    run(IPVSADM, IPVSADM, &args)?;
                }
                let mut virtuals = parse_ipvsadm_save(&run(IPVSADM, IPVSADM, &["-Sn"])?);
                self.opts.keep_only_ours(&mut virtuals);
                Desired { addresses: ensure_dummy(self.opts.family)?, virtuals, ..Desired::default() }
            }
        };
        // Addresses first (the node must accept the VIPs), then sets and rules, then IPVS.
        // One `ip -batch` for all of them: thousands of Services are thousands of addresses.
        // (IPv6 ones without duplicate detection, which would hold them back.)
        let nodad = if self.opts.family == Family::V6 { " nodad" } else { "" };
        let add: String =
            d.addresses.difference(&prev.addresses).map(|a| format!("addr replace {} dev {DUMMY}{nodad}\n", Cidr::host(*a))).collect();
        if !add.is_empty() {
            run_with_input("ip", "iproute2", &["-batch", "-"], &add)?;
        }
        let t_addresses = t0.elapsed();
        ipset_restore(&d.sets, &prev.sets)?;
        let t_sets = t0.elapsed();
        if prev.iptables != d.iptables {
            iptables_restore(self.ipt.tools(self.opts.family), &d.iptables)?;
        }
        ensure_jumps(self.ipt.tools(self.opts.family), &JUMPS)?;
        let t_iptables = t0.elapsed();
        let delta = ipvsadm_delta(&prev.virtuals, &d.virtuals);
        if !delta.is_empty() {
            run_with_input(IPVSADM, IPVSADM, &["-R"], &delta)?;
        }
        let t_ipvs = t0.elapsed();
        let del: String = prev.addresses.difference(&d.addresses).map(|a| format!("addr del {} dev {DUMMY}\n", Cidr::host(*a))).collect();
        if !del.is_empty() {
            // -force: an address someone else removed already is not an error.
            let _ = run_with_input("ip", "iproute2", &["-force", "-batch", "-"], &del);
        }
        tracing::debug!(
            desired_ms = t_desired.as_millis() as u64,
            addresses_ms = (t_addresses - t_desired).as_millis() as u64,
            ipsets_ms = (t_sets - t_addresses).as_millis() as u64,
            iptables_ms = (t_iptables - t_sets).as_millis() as u64,
            ipvs_ms = (t_ipvs - t_iptables).as_millis() as u64,
            total_ms = t0.elapsed().as_millis() as u64,
            "ipvs apply"
        );
        self.applied = Some(d);
        Ok(delta.lines().count())
    }

    fn forget_applied(&mut self) {
        self.applied = None;
    }

    fn family(&self) -> Family {
        self.opts.family
    }
}

/// Removes IPVS mode's state: its virtual servers (all of them, as kube-proxy's cleanup does),
/// `kube-ipvs0`, its ipsets and its iptables chains in each of `backends`. Nothing when IPVS is
/// not available.
pub fn cleanup(backends: &[Iptables]) -> Vec<String> {
    let mut removed = Vec::new();
    if run("ip", "iproute2", &["link", "show", DUMMY]).is_ok() {
        if run(IPVSADM, IPVSADM, &["-C"]).is_ok() {
            removed.push("ipvs: virtual servers".into());
        }
        if run("ip", "iproute2", &["link", "del", DUMMY]).is_ok() {
            removed.push(format!("ipvs: {DUMMY}"));
        }
    }
    let present: BTreeSet<String> =
        run(IPSET, IPSET, &["list", "-n"]).map(|out| out.lines().map(String::from).collect()).unwrap_or_default();
    let sets: Vec<&str> = SETS.iter().flat_map(|(v4, v6, _)| [*v4, *v6]).filter(|name| present.contains(*name)).collect();
    for &ipt in backends {
        // The iptables rules that match on the sets must go first.
        removed.extend(cleanup_iptables(ipt));
    }
    for name in sets {
        if run(IPSET, IPSET, &["destroy", name]).is_ok() {
            removed.push(format!("ipvs: ipset {name}"));
        }
    }
    removed
}

/// Removes IPVS mode's jumps and chains from both families' tables of `ipt`, where IPVS mode
/// ran.
pub fn cleanup_iptables(ipt: Iptables) -> Vec<String> {
    Family::ALL.into_iter().flat_map(|f| cleanup_iptables_family(ipt.tools(f))).collect()
}

fn cleanup_iptables_family(ipt: super::Tools) -> Vec<String> {
    // Its filter chain says whether it ran in this backend at all. Nothing is touched
    // otherwise: its nat jumps are the iptables mode's too (deleting them would leave an
    // iptables mode that is starting without them until its first sync), and declaring the
    // nat chains below would create them.
    let ran = run(ipt.save(), super::IPTABLES_PACKAGE, &["-t", "filter"])
        .is_ok_and(|out| super::declared_chains(&out).any(|c| c == "KUBE-IPVS-DROP"));
    if !ran {
        return Vec::new();
    }
    let mut removed: Vec<String> = delete_jumps(ipt, &JUMPS)
        .into_iter()
        .map(|(table, chain, _, _, target)| format!("ipvs: {ipt} jump {table}/{chain} -> {target}"))
        .collect();
    if iptables_restore(
            ipt,
            "*filter\n:KUBE-IPVS-DROP - [0:0]\n:KUBE-IPVS-SOURCE-RANGES - [0:0]\n-X KUBE-IPVS-DROP\n-X KUBE-IPVS-SOURCE-RANGES\nCOMMIT\n*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODE-PORT - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-LOAD-BALANCER - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n-X KUBE-SERVICES\n-X KUBE-NODE-PORT\n-X KUBE-POSTROUTING\n-X KUBE-LOAD-BALANCER\n-X KUBE-MARK-MASQ\nCOMMIT\n",
        )
        .is_ok()
    {
        removed.push(format!("ipvs: {ipt} chains"));
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipvs_settings_become_sysctls_timeouts_and_exclusions() {
        let mut o = IpvsOptions::default();
        assert!(!o.sysctls().iter().any(|(k, _)| k.contains("arp")), "strictARP is off by default, as kube-proxy's");
        assert_eq!(o.set_timeouts_args(), None, "no timeouts set, the kernel's stay");
        o.strict_arp = true;
        o.timeouts = (Some(std::time::Duration::from_secs(900)), None, Some(std::time::Duration::from_secs(300)));
        assert!(
            o.sysctls().contains(&("net/ipv4/conf/all/arp_ignore", "1")) && o.sysctls().contains(&("net/ipv4/conf/all/arp_announce", "2"))
        );
        assert_eq!(o.set_timeouts_args().unwrap(), ["--set", "900", "0", "300"]);
        o.exclude_cidrs = vec!["10.100.0.0/16".parse().unwrap()];
        let key = |a: &str| VirtualKey { proto: "tcp", addr: a.parse().unwrap(), port: 80 };
        let mut v: BTreeMap<VirtualKey, ()> = [(key("10.100.3.4"), ()), (key("10.96.0.10"), ())].into();
        o.keep_only_ours(&mut v);
        assert_eq!(
            v.keys().map(|k| k.addr.to_string()).collect::<Vec<_>>(),
            ["10.96.0.10"],
            "an excluded virtual server is never ours to delete"
        );
    }

    #[test]
    fn deltas_touch_only_what_changed() {
        let k = VirtualKey { proto: "tcp", addr: "10.96.0.10".parse().unwrap(), port: 80 };
        let v = |reals: &[&str]| Virtual {
            scheduler: "rr".into(),
            persistence: None,
            reals: reals
                .iter()
                .map(|r| {
                    let (a, p) = r.split_once(':').unwrap();
                    (a.parse().unwrap(), p.parse().unwrap())
                })
                .collect(),
        };
        let from = BTreeMap::from([(k, v(&["10.0.0.1:80", "10.0.0.2:80"]))]);
        let to = BTreeMap::from([(k, v(&["10.0.0.2:80", "10.0.0.3:80"]))]);
        assert_eq!(ipvsadm_delta(&from, &to), "-a -t 10.96.0.10:80 -r 10.0.0.3:80 -m -w 1\n-d -t 10.96.0.10:80 -r 10.0.0.1:80\n");
        assert_eq!(ipvsadm_delta(&to, &to), "");
        assert_eq!(ipvsadm_delta(&to, &BTreeMap::new()), "-D -t 10.96.0.10:80\n");
        let saved = "-A -t 10.96.0.10:80 -s rr\n-a -t 10.96.0.10:80 -r 10.0.0.2:80 -m -w 1\n-a -t 10.96.0.10:80 -r 10.0.0.3:80 -m -w 1\n";
        assert_eq!(parse_ipvsadm_save(saved), to);
        assert!("bogus".parse::<Scheduler>().is_err());
        // A virtual server left by a run with another scheduler is edited, not re-created
        // (its connections stay).
        let mut sh = to.clone();
        sh.get_mut(&k).unwrap().scheduler = "sh".into();
        assert_eq!(ipvsadm_delta(&to, &sh), "-E -t 10.96.0.10:80 -s sh\n");
    }

    #[test]
    fn known_sets_get_entry_deltas_unknown_ones_are_swapped_in_whole() {
        let set = |entries: &[&str]| -> Sets {
            BTreeMap::from([("KUBE-LOOP-BACK", ("hash:ip,port,ip", entries.iter().map(|e| e.to_string()).collect()))])
        };
        let a = set(&["10.0.0.1,tcp:80,10.0.0.1", "10.0.0.2,tcp:80,10.0.0.2"]);
        let b = set(&["10.0.0.2,tcp:80,10.0.0.2", "10.0.0.3,tcp:80,10.0.0.3"]);
        // Known: only the entries that changed.
        let none = BTreeSet::new();
        assert_eq!(
            ipset_delta(&b, &a, &none),
            "add KUBE-LOOP-BACK 10.0.0.3,tcp:80,10.0.0.3 -exist\ndel KUBE-LOOP-BACK 10.0.0.1,tcp:80,10.0.0.1 -exist\n"
        );
        assert_eq!(ipset_delta(&b, &b, &none), "");
        // Unknown (first sync): filled aside and swapped in, so no packet sees it half written.
        let whole = ipset_delta(&b, &Sets::new(), &none);
        assert_eq!(
            whole,
            "create KUBE-LOOP-BACK hash:ip,port,ip hashsize 1024 maxelem 65536\n\
             create KUBE-PROXY-TMP-0 hash:ip,port,ip hashsize 1024 maxelem 65536 -exist\nflush KUBE-PROXY-TMP-0\n\
             add KUBE-PROXY-TMP-0 10.0.0.2,tcp:80,10.0.0.2 -exist\nadd KUBE-PROXY-TMP-0 10.0.0.3,tcp:80,10.0.0.3 -exist\n\
             swap KUBE-PROXY-TMP-0 KUBE-LOOP-BACK\ndestroy KUBE-PROXY-TMP-0\n"
        );
        // A set applied with another type is re-created whole as well.
        let mut other = a.clone();
        other.get_mut("KUBE-LOOP-BACK").unwrap().0 = "hash:ip,port";
        assert_eq!(ipset_delta(&b, &other, &none), whole);
        // A set the kernel has already (an earlier run) is not created again, whatever its size.
        let existing = BTreeSet::from(["KUBE-LOOP-BACK".to_string()]);
        assert_eq!(
            ipset_delta(&b, &Sets::new(), &existing),
            whole.replace("create KUBE-LOOP-BACK hash:ip,port,ip hashsize 1024 maxelem 65536\n", "")
        );
        // Sized for what they hold: 120,000 loopback entries (30,000 Services x 4).
        assert_eq!(set_options("KUBE-LOOP-BACK", "hash:ip,port,ip", 120_000), " hashsize 32768 maxelem 262144");
        assert_eq!(set_options("KUBE-NODE-PORT-TCP", "bitmap:port", 10), " range 0-65535");
        assert_eq!(set_options("KUBE-6-LOOP-BACK", "hash:ip,port,ip", 10), " family inet6 hashsize 1024 maxelem 65536");
    }

    /// The IPv6 family's state, as kube-proxy's IPv6 IPVS proxier keeps it: its own sets
    /// (`KUBE-6-`, at most 31 characters), `[addr]:port` in ipvsadm, /128 addresses, and only
    /// its own virtual servers taken as its to change.
    #[test]
    fn the_ipv6_family_has_its_own_sets_addresses_and_virtual_servers() {
        use crate::model::{EndpointView, ObjectKey, PortView, Protocol, ServicePortName};
        assert!(SETS.iter().all(|(v4, v6, _)| v6.len() <= 31 && v6.starts_with("KUBE-6-") && v4.starts_with("KUBE-")));
        assert_eq!(set_name(Family::V6, "KUBE-LOAD-BALANCER-SOURCE-CIDR"), "KUBE-6-LOAD-BALANCER-SOURCE-CID");
        let ep =
            |a: &str| EndpointView { addr: a.parse().unwrap(), port: 8080, ready: true, serving: true, terminating: false, local: false };
        let port = |family: Family, cip: &str, eps: Vec<EndpointView>| {
            let name = ServicePortName { service: ObjectKey::new("default", "web"), port: "http".into(), protocol: Protocol::Tcp };
            PortView { node_port: Some(30080), ..PortView::new(name, family, 80, vec![cip.parse().unwrap()], eps) }
        };
        let services = Services::from([(
            ObjectKey::new("default", "web"),
            vec![port(Family::V4, "10.96.0.10", vec![ep("10.244.1.1")]), port(Family::V6, "fd00::10", vec![ep("fd00:244::1")])],
        )]);
        let node = NodeContext { nodeport_ips: vec!["fd00::1".parse().unwrap()], ..Default::default() };
        let opts = IpvsOptions { family: Family::V6, ..Default::default() };
        let d = desired(&services, &node, &opts);
        assert_eq!(d.addresses, BTreeSet::from(["fd00::10".parse::<IpAddr>().unwrap()]), "the IPv6 cluster IP only");
        assert!(d.sets.keys().all(|n| n.starts_with("KUBE-6-")), "{:?}", d.sets.keys());
        assert!(d.sets["KUBE-6-CLUSTER-IP"].1.contains("fd00::10,tcp:80"), "{:?}", d.sets["KUBE-6-CLUSTER-IP"]);
        assert!(d.iptables.contains("--match-set KUBE-6-LOAD-BALANCER dst,dst") && !d.iptables.contains("--match-set KUBE-LOAD-BALANCER "));
        let text = ipvsadm_delta(&BTreeMap::new(), &d.virtuals);
        assert!(text.contains("-A -t [fd00::10]:80 -s rr\n-a -t [fd00::10]:80 -r [fd00:244::1]:8080 -m -w 1\n"), "{text}");
        assert!(text.contains("-A -t [fd00::1]:30080 -s rr"), "the NodePort on the node's IPv6 address: {text}");
        assert_eq!(parse_ipvsadm_save(&text), d.virtuals, "ipvsadm -Sn's IPv6 form reads back");
        // The IPv4 family's view of the same table leaves the IPv6 servers alone.
        let mut all = d.virtuals.clone();
        all.insert(VirtualKey { proto: "tcp", addr: "10.96.0.10".parse().unwrap(), port: 80 }, d.virtuals.values().next().unwrap().clone());
        IpvsOptions::default().keep_only_ours(&mut all);
        assert_eq!(all.keys().map(|k| k.addr.to_string()).collect::<Vec<_>>(), ["10.96.0.10"]);
    }
}
