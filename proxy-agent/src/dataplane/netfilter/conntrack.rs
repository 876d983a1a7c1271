//! Stale UDP conntrack entries in the netfilter modes. The kernel's conntrack keeps translating
//! a UDP flow to the endpoint it first chose for as long as packets keep coming, so a client
//! that reuses its socket (a DNS resolver) keeps talking to an endpoint that is gone; and a
//! flow that started before the Service had endpoints stays untranslated. kube-proxy deletes
//! such entries after each sync; so do we: after a sync that changed a UDP Service, one
//! `conntrack -L -p udp` dump, read line by line as it comes (a busy node's table is large;
//! only the stale flows are kept), then one ctnetlink request per stale flow, by its exact
//! tuple, sent in batches (`Forgetter`; `conntrack -D` would dump the whole table again for
//! each). TCP to a removed endpoint
//! needs none of this: its connections end with a reset. (The eBPF dataplane re-selects such
//! flows itself, on their next packet.)
//!
//! TCP needs one sweep of its own, which kube-proxy does not make: a connection attempt to a
//! Service address before its rules existed (a Service just created, or an agent just started)
//! leaves the node by its default route with an untranslated conntrack entry, and the client's
//! retransmitted SYNs (the same tuple) keep following that entry past the new DNAT rules for
//! as long as it lives (120 s of SYN_SENT, renewed by each retransmission): the nftables rules
//! refuse them as traffic to a ClusterIP port nothing serves, the iptables rules let them go
//! to nowhere. A client that reuses such a source port (one that wraps the ephemeral range
//! within two minutes) meets the same. So after a sync that gave a TCP Service address its
//! first endpoints, the unanswered, untranslated attempts to it are deleted
//! (`forget_untranslated_attempts`: one listing, then a ctnetlink request per attempt), and
//! the next SYN is translated.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead as _, BufReader, Read as _},
    net::{IpAddr, SocketAddr},
};

use super::{hung, killed_idle, killed_if_idle, spawn, NetfilterError, NodeContext, Services, TOOL_IDLE_LIMIT};
use crate::model::{Family, PortView, Protocol};
use crate::netlink::Request;

const CONNTRACK: &str = "conntrack";

/// One tracked UDP flow: its original direction (what its deletion names it by) and where
/// replies come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Flow {
    pub dst: IpAddr,
    pub dport: u16,
    pub src: IpAddr,
    pub sport: u16,
    pub reply_src: IpAddr,
    pub reply_sport: u16,
}

/// Parses one line of `conntrack -L -p udp` output (the first src/dst/sport/dport are the
/// original direction, the second the reply).
pub fn parse_line(line: &str) -> Option<Flow> {
    let nth = |key: &str, n: usize| field(line, key, n);
    Some(Flow {
        dst: nth("dst", 0)?.parse().ok()?,
        dport: nth("dport", 0)?.parse().ok()?,
        src: nth("src", 0)?.parse().ok()?,
        sport: nth("sport", 0)?.parse().ok()?,
        reply_src: nth("src", 1)?.parse().ok()?,
        reply_sport: nth("sport", 1)?.parse().ok()?,
    })
}

/// The n-th value of `key=` on a line of `conntrack -L` output.
fn field<'a>(line: &'a str, key: &str, n: usize) -> Option<&'a str> {
    line.split_whitespace().filter_map(|w| w.strip_prefix(key)?.strip_prefix('=')).nth(n)
}

/// A TCP connection attempt that nothing answered and no rule translated, by its original
/// tuple (what its deletion names it by).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Attempt {
    pub src: IpAddr,
    pub sport: u16,
    pub dst: IpAddr,
    pub dport: u16,
}

/// Reads a line of `conntrack -L -p tcp` output as an unanswered attempt that went out
/// untranslated (replies would come from the address it was sent to); None for anything else.
pub fn parse_attempt(line: &str) -> Option<Attempt> {
    if !line.split_whitespace().any(|w| w == "[UNREPLIED]") {
        return None;
    }
    let flow = parse_line(line)?;
    if (flow.reply_src, flow.reply_sport) != (flow.dst, flow.dport) {
        return None;
    }
    Some(Attempt { src: flow.src, sport: flow.sport, dst: flow.dst, dport: flow.dport })
}

/// A connection netfilter's DNAT sent to another address: what kube-proxy's rules made of a
/// pod's connection to a Service (or of an outside client's to a NodePort), which the eBPF mode
/// takes over at a takeover (`dataplane::ebpf::adopt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Translated {
    pub proto: u8,
    /// The original direction: client -> Service address.
    pub client: SocketAddr,
    pub service: SocketAddr,
    /// Where replies come from.
    pub backend: SocketAddr,
    /// Where replies go, when netfilter masqueraded the client too (an outside client of
    /// externalTrafficPolicy Cluster, a pod reaching itself, `masqueradeAll`): the node's
    /// address and the port netfilter chose. None: only DNATed.
    pub masquerade: Option<SocketAddr>,
}

/// Reads a line of `conntrack -L` output as a TCP or UDP connection that is answered, still
/// open (TCP: not closing), and DNATed; None for anything else (an attempt nothing answered,
/// which is balanced afresh all the same, an untranslated flow).
pub fn parse_translated(line: &str) -> Option<Translated> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let proto = match words.first() {
        Some(&"tcp") => libc::IPPROTO_TCP as u8,
        Some(&"udp") => libc::IPPROTO_UDP as u8,
        _ => return None,
    };
    if words.contains(&"[UNREPLIED]") || (proto == libc::IPPROTO_TCP as u8 && words.iter().any(|w| ["TIME_WAIT", "CLOSE"].contains(w))) {
        return None;
    }
    let flow = parse_line(line)?;
    let reply_dst = SocketAddr::new(field(line, "dst", 1)?.parse().ok()?, field(line, "dport", 1)?.parse().ok()?);
    let client = SocketAddr::new(flow.src, flow.sport);
    let translated = (flow.reply_src, flow.reply_sport) != (flow.dst, flow.dport);
    translated.then(|| Translated {
        proto,
        client,
        service: SocketAddr::new(flow.dst, flow.dport),
        backend: SocketAddr::new(flow.reply_src, flow.reply_sport),
        masquerade: (reply_dst != client).then_some(reply_dst),
    })
}

/// The translated connections of one family in the kernel's conntrack table
/// (`parse_translated`), from one `conntrack -L` of the DNATed ones (a busy node's table is
/// mostly other flows).
pub fn list_translated(family: Family) -> Result<Vec<Translated>, NetfilterError> {
    list(&["-L", "-f", conntrack_family(family), "--dst-nat"], |lines| lines.filter_map(|l| parse_translated(&l)).collect())
}

/// Deletes conntrack entries by their original tuple, and creates those of connections our
/// programs translate, over one ctnetlink socket; with netfilter's lifetimes for the latter,
/// read at the first replacement.
pub struct Forgetter(netlink_sys::Socket, Option<Timeouts>);

impl Forgetter {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self(ctnetlink()?, None))
    }

    /// Deletes the entries of `flows` (by their original tuple, client -> Service address): see
    /// `delete_all`.
    pub fn forget_all(&mut self, flows: &[Translated]) -> std::io::Result<Vec<std::io::Result<bool>>> {
        let tuples: Vec<(u8, SocketAddr, SocketAddr)> = flows.iter().map(|t| (t.proto, t.client, t.service)).collect();
        self.delete_all(&tuples)
    }

    /// Deletes the entries of protocol and original tuple (`from` -> `to`) `tuples`, in a few
    /// writes (`netlink::request_batch`): for each, Ok(false) where there was none (it ended
    /// meanwhile).
    pub fn delete_all(&mut self, tuples: &[(u8, SocketAddr, SocketAddr)]) -> std::io::Result<Vec<std::io::Result<bool>>> {
        let requests: Vec<Request> = tuples.iter().map(|(proto, from, to)| delete_request(*proto, *from, *to)).collect();
        Ok(results(crate::netlink::request_batch(&mut self.0, &requests)?, libc::ENOENT))
    }

    /// Replaces the entries of `flows` (by their original tuple, client -> Service address) by
    /// those netfilter makes of them once our programs translate them (client -> backend,
    /// replies backend -> client): answered, a TCP connection established with window tracking
    /// liberal in both directions (its sequence numbers were not seen), with netfilter's
    /// lifetime of such a connection. (Tracked afresh from whichever packet came first
    /// instead, a reply from a pod to an outside client would be a new connection that a CNI's
    /// masquerade of pods' traffic translates; and with `nf_conntrack_tcp_loose` 0 no TCP
    /// connection is.) Each connection's deletion is followed by its creation in the same
    /// write, so that no packet of it meets netfilter without an entry for long (kube-proxy's
    /// rules, still there, would balance it afresh). For each, whether an entry was deleted
    /// (none: it ended meanwhile) and whether one was made (none: one is there already).
    pub fn replace_all(&mut self, flows: &[Translated]) -> std::io::Result<Vec<[std::io::Result<bool>; 2]>> {
        let timeouts = self.1.get_or_insert_with(Timeouts::read);
        let requests: Vec<Request> =
            flows.iter().flat_map(|t| [delete_request(t.proto, t.client, t.service), answered_request(t, timeouts)]).collect();
        let codes = crate::netlink::request_batch(&mut self.0, &requests)?;
        let mut done = results(codes, libc::ENOENT).into_iter();
        Ok(std::iter::from_fn(|| {
            let deleted = done.next()?;
            let made = match done.next()? {
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
                r => r,
            };
            Some([deleted, made])
        })
        .collect())
    }
}

/// netfilter's lifetimes of an established TCP connection and of a UDP flow answered more than
/// once, in this network namespace, seconds.
struct Timeouts {
    tcp: u32,
    udp: u32,
}

impl Timeouts {
    fn read() -> Self {
        let read = |name: &str, default: u32| {
            std::fs::read_to_string(format!("/proc/sys/net/netfilter/nf_conntrack_{name}"))
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(default)
        };
        Self { tcp: read("tcp_timeout_established", 432_000), udp: read("udp_timeout_stream", 120) }
    }
}

/// Each request's result from its error number: Ok(true) done, Ok(false) for `nothing`.
fn results(codes: Vec<i32>, nothing: i32) -> Vec<std::io::Result<bool>> {
    codes
        .into_iter()
        .map(|code| match code {
            0 => Ok(true),
            c if c == nothing => Ok(false),
            e => Err(std::io::Error::from_raw_os_error(e)),
        })
        .collect()
}

/// The TCP Service addresses (cluster, external and load-balancer IPs, with the port) of
/// `ports` that are in the rules (`served`: those with endpoints, where an attempt made before
/// may be stuck).
pub fn tcp_frontends(ports: &[PortView], served: bool) -> BTreeSet<(IpAddr, u16)> {
    ports
        .iter()
        .filter(|p| p.name.protocol == Protocol::Tcp && (p.has_endpoints || !served))
        .flat_map(|p| p.service_ips().map(|a| (*a, p.port)))
        .collect()
}

/// The flows that no longer lead where the rules do: to a UDP Service address (cluster IP,
/// external IP, load-balancer IP, or a node address on its NodePort) with endpoints, answered
/// by something that is not one of its endpoints (a removed endpoint, or nothing translated
/// at all). Services without endpoints are left alone: their packets are refused anyway.
pub fn stale(flows: impl IntoIterator<Item = Flow>, services: &Services, node: &NodeContext) -> BTreeSet<Flow> {
    // (address, port) -> the endpoints replies may come from.
    let mut frontends: BTreeMap<(IpAddr, u16), BTreeSet<(IpAddr, u16)>> = BTreeMap::new();
    for port in services.values().flatten().filter(|p| p.name.protocol == Protocol::Udp && p.has_endpoints) {
        let eps: BTreeSet<(IpAddr, u16)> = port.reachable_endpoints().iter().map(|e| (e.addr, e.port)).collect();
        for addr in port.service_ips() {
            frontends.entry((*addr, port.port)).or_default().extend(&eps);
        }
        if let Some(np) = port.node_port {
            for addr in node.nodeport_ips.iter().filter(|a| Family::of(**a) == port.family) {
                frontends.entry((*addr, np)).or_default().extend(&eps);
            }
        }
    }
    flows.into_iter().filter(|f| frontends.get(&(f.dst, f.dport)).is_some_and(|eps| !eps.contains(&(f.reply_src, f.reply_sport)))).collect()
}

/// Deletes the stale UDP flows for `services`: one listing per family, then one ctnetlink
/// request per flow.
pub fn reconcile(services: &Services, node: &NodeContext) -> Result<(), NetfilterError> {
    let udp_in = |family| services.values().flatten().any(|p| p.family == family && p.name.protocol == Protocol::Udp);
    // `conntrack` lists one family at a time (IPv4 unless told).
    for family in Family::ALL.into_iter().filter(|f| *f == Family::V4 || udp_in(*f)) {
        let stale = list_stale(services, node, family)?;
        if stale.is_empty() {
            continue;
        }
        let mut forgetter = Forgetter::new().map_err(ctnetlink_failed)?;
        let stale: Vec<Flow> = stale.into_iter().collect();
        let tuples: Vec<(u8, SocketAddr, SocketAddr)> =
            stale.iter().map(|f| (libc::IPPROTO_UDP as u8, SocketAddr::new(f.src, f.sport), SocketAddr::new(f.dst, f.dport))).collect();
        // Said once per (Service address, answering endpoint), not per client.
        let mut deleted: BTreeMap<(SocketAddr, SocketAddr), usize> = BTreeMap::new();
        for (f, r) in stale.iter().zip(forgetter.delete_all(&tuples).map_err(ctnetlink_failed)?) {
            // False: the flow ended meanwhile.
            if r.map_err(ctnetlink_failed)? {
                *deleted.entry((SocketAddr::new(f.dst, f.dport), SocketAddr::new(f.reply_src, f.reply_sport))).or_default() += 1;
            }
        }
        for ((service, stale), flows) in deleted {
            tracing::info!(service = %format!("{service}/udp"), stale = %stale, flows, "deleted stale UDP conntrack entries");
        }
    }
    Ok(())
}

fn ctnetlink_failed(e: std::io::Error) -> NetfilterError {
    NetfilterError::Failed { command: "ctnetlink: delete a conntrack entry".into(), stderr: e.to_string() }
}

fn conntrack_family(family: Family) -> &'static str {
    match family {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    }
}

/// Lists one family's UDP flows and keeps the stale ones.
fn list_stale(services: &Services, node: &NodeContext, family: Family) -> Result<BTreeSet<Flow>, NetfilterError> {
    list(&["-L", "-f", conntrack_family(family), "-p", "udp"], |lines| stale(lines.filter_map(|l| parse_line(&l)), services, node))
}

/// Runs a `conntrack -L` and hands its lines to `read` as `conntrack` writes them (a busy
/// node's table is large: only what `read` keeps is held).
fn list<R>(args: &[&str], read: impl FnOnce(&mut dyn Iterator<Item = String>) -> R) -> Result<R, NetfilterError> {
    let command = || format!("{CONNTRACK} {}", args.join(" "));
    let mut child = spawn(CONNTRACK, CONNTRACK, args, false)?;
    let stdout = child.stdout.take().expect("piped stdout");
    // Its summary line ("... flow entries have been shown") goes to stderr, which stays small;
    // it is read after stdout ends. A conntrack that hangs is killed, as the other tools are.
    let ((kept, stderr, status), killed) = killed_if_idle(child.id(), TOOL_IDLE_LIMIT, || {
        let kept = read(&mut BufReader::new(stdout).lines().map_while(Result::ok));
        let mut stderr = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut stderr);
        }
        (kept, stderr, child.wait())
    });
    let status = status.map_err(|e| NetfilterError::Failed { command: command(), stderr: e.to_string() })?;
    if killed_idle(killed, &status) {
        return Err(hung(command(), TOOL_IDLE_LIMIT, stderr.trim()));
    }
    if !status.success() {
        return Err(NetfilterError::Failed { command: command(), stderr: stderr.trim().to_string() });
    }
    Ok(kept)
}

/// Deletes the unanswered, untranslated TCP attempts to `frontends` (Service addresses that
/// just got their first endpoints; see the module's notes): one listing per family, then one
/// ctnetlink request per attempt, by its exact tuple (`conntrack -D` would dump the whole
/// table again for each). Returns how many were deleted; a family that fails does not keep
/// the other from its sweep.
pub fn forget_untranslated_attempts(frontends: &BTreeSet<(IpAddr, u16)>) -> Result<usize, NetfilterError> {
    let (mut deleted, mut failure) = (0, None);
    for family in Family::ALL.into_iter().filter(|f| frontends.iter().any(|(a, _)| Family::of(*a) == *f)) {
        // An attempt nothing answered is in SYN_SENT; listing only those keeps the read short.
        let listed = list(&["-L", "-f", conntrack_family(family), "-p", "tcp", "--state", "SYN_SENT"], |lines| {
            lines.filter_map(|l| parse_attempt(&l)).filter(|a| frontends.contains(&(a.dst, a.dport))).collect::<Vec<Attempt>>()
        });
        let attempts = match listed {
            Ok(a) => a,
            Err(e) => {
                failure = Some(e);
                continue;
            }
        };
        if attempts.is_empty() {
            continue;
        }
        let tuples: Vec<(u8, SocketAddr, SocketAddr)> =
            attempts.iter().map(|a| (libc::IPPROTO_TCP as u8, SocketAddr::new(a.src, a.sport), SocketAddr::new(a.dst, a.dport))).collect();
        let results = match Forgetter::new().and_then(|mut f| f.delete_all(&tuples)) {
            Ok(r) => r,
            Err(e) => {
                failure = Some(ctnetlink_failed(e));
                continue;
            }
        };
        for (a, r) in attempts.iter().zip(results) {
            match r {
                Ok(true) => {
                    deleted += 1;
                    tracing::info!(service = %format!("{}/tcp", SocketAddr::new(a.dst, a.dport)), client = %SocketAddr::new(a.src, a.sport), "deleted the conntrack entry of a connection attempt made before the Service was served: its next SYN is translated");
                }
                // Gone meanwhile (it timed out, or the client gave up).
                Ok(false) => {}
                Err(e) => failure = Some(ctnetlink_failed(e)),
            }
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(deleted),
    }
}

// ctnetlink (linux/netfilter/nfnetlink_conntrack.h).
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_TIMEOUT: u16 = 7;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
const CTA_PROTOINFO_TCP_FLAGS_ORIGINAL: u16 = 4;
const CTA_PROTOINFO_TCP_FLAGS_REPLY: u16 = 5;
const TCP_CONNTRACK_ESTABLISHED: u8 = 3;
const IP_CT_TCP_FLAG_BE_LIBERAL: u8 = 0x08;
const IPS_SEEN_REPLY: u32 = 1 << 1;
const IPS_ASSURED: u32 = 1 << 2;
/// (Set by the kernel as it inserts the entry it makes: a status without it is a change the
/// kernel refuses, EBUSY.)
const IPS_CONFIRMED: u32 = 1 << 3;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

fn ctnetlink() -> std::io::Result<netlink_sys::Socket> {
    let mut socket = netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&netlink_sys::SocketAddr::new(0, 0))?;
    Ok(socket)
}

/// The netfilter header of a request about a tuple of `addr`'s family (version 0).
fn family_header(addr: SocketAddr) -> [u8; 4] {
    [if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 } as u8, 0, 0, 0]
}

/// A conntrack tuple's attributes: protocol `proto`, `from` -> `to` (of one family).
fn tuple(proto: u8, from: SocketAddr, to: SocketAddr) -> Vec<u8> {
    use crate::netlink::{attr, NLA_F_NESTED};
    let src_attr = if from.is_ipv4() { CTA_IP_V4_SRC } else { CTA_IP_V6_SRC };
    let octets = |ip: IpAddr| match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let ip = [attr(src_attr, &octets(from.ip())), attr(src_attr + 1, &octets(to.ip()))].concat();
    let ports = [
        attr(CTA_PROTO_NUM, &[proto]),
        attr(CTA_PROTO_SRC_PORT, &from.port().to_be_bytes()),
        attr(CTA_PROTO_DST_PORT, &to.port().to_be_bytes()),
    ]
    .concat();
    [attr(CTA_TUPLE_IP | NLA_F_NESTED, &ip), attr(CTA_TUPLE_PROTO | NLA_F_NESTED, &ports)].concat()
}

/// The ctnetlink request that deletes the entry of protocol `proto` whose original tuple is
/// `from` -> `to`.
fn delete_request(proto: u8, from: SocketAddr, to: SocketAddr) -> Request {
    use crate::netlink::{attr, NLA_F_NESTED};
    // (A conntrack tuple is of one family: both addresses are the listing's, of the family.)
    Request {
        kind: NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_DELETE,
        flags: 0,
        header: family_header(from),
        body: attr(CTA_TUPLE_ORIG | NLA_F_NESTED, &tuple(proto, from, to)),
    }
}

/// The ctnetlink request that creates the entry of the connection `t` as our programs'
/// translation leaves it: answered, untranslated, client -> backend (see
/// `Forgetter::replace_all`).
fn answered_request(t: &Translated, timeouts: &Timeouts) -> Request {
    use crate::netlink::{attr, NLA_F_NESTED};
    let (proto, client, backend) = (t.proto, t.client, t.backend);
    let timeout = if proto == libc::IPPROTO_TCP as u8 { timeouts.tcp } else { timeouts.udp };
    let mut body = [
        attr(CTA_TUPLE_ORIG | NLA_F_NESTED, &tuple(proto, client, backend)),
        attr(CTA_TUPLE_REPLY | NLA_F_NESTED, &tuple(proto, backend, client)),
        attr(CTA_STATUS, &(IPS_SEEN_REPLY | IPS_ASSURED | IPS_CONFIRMED).to_be_bytes()),
        attr(CTA_TIMEOUT, &timeout.to_be_bytes()),
    ]
    .concat();
    if proto == libc::IPPROTO_TCP as u8 {
        let liberal = [IP_CT_TCP_FLAG_BE_LIBERAL, IP_CT_TCP_FLAG_BE_LIBERAL];
        let tcp = [
            attr(CTA_PROTOINFO_TCP_STATE, &[TCP_CONNTRACK_ESTABLISHED]),
            attr(CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, &liberal),
            attr(CTA_PROTOINFO_TCP_FLAGS_REPLY, &liberal),
        ]
        .concat();
        body.extend(attr(CTA_PROTOINFO | NLA_F_NESTED, &attr(CTA_PROTOINFO_TCP | NLA_F_NESTED, &tcp)));
    }
    Request {
        kind: NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW,
        flags: crate::netlink::NLM_F_CREATE | crate::netlink::NLM_F_EXCL,
        header: family_header(client),
        body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EndpointView, ObjectKey, ServicePortName};

    fn ep(addr: &str, port: u16) -> EndpointView {
        EndpointView { addr: addr.parse().unwrap(), port, ready: true, serving: true, terminating: false, local: false }
    }

    fn dns(endpoints: Vec<EndpointView>, node_port: Option<u16>) -> PortView {
        let name = ServicePortName { service: ObjectKey::new("kube-system", "dns"), port: "dns".into(), protocol: Protocol::Udp };
        PortView { node_port, ..PortView::new(name, Family::V4, 53, vec!["10.96.0.10".parse().unwrap()], endpoints) }
    }

    #[test]
    fn parses_conntrack_listings() {
        let text = "udp      17 27 src=10.244.0.2 dst=10.96.0.10 sport=40000 dport=53 src=10.244.1.3 dst=10.244.0.2 sport=5353 dport=40000 mark=0 use=1\n\
                    udp      17 29 src=10.244.0.2 dst=10.96.0.10 sport=40001 dport=53 [UNREPLIED] src=10.96.0.10 dst=10.244.0.2 sport=53 dport=40001 mark=0 use=1\n\
                    conntrack v1.4.7 (conntrack-tools): 2 flow entries have been shown.\n";
        let flow = |sport, reply_src: &str, reply_sport| Flow {
            dst: "10.96.0.10".parse().unwrap(),
            dport: 53,
            src: "10.244.0.2".parse().unwrap(),
            sport,
            reply_src: reply_src.parse().unwrap(),
            reply_sport,
        };
        assert_eq!(
            text.lines().filter_map(parse_line).collect::<Vec<_>>(),
            vec![flow(40000, "10.244.1.3", 5353), flow(40001, "10.96.0.10", 53)]
        );
    }

    #[test]
    fn only_answered_open_dnated_connections_are_read_as_translated_with_their_masquerade() {
        let lines = [
            // A pod's connection kube-proxy DNATed.
            "tcp      6 431999 ESTABLISHED src=10.244.0.2 dst=10.96.0.10 sport=44044 dport=80 src=10.244.1.3 dst=10.244.0.2 sport=8080 dport=44044 [ASSURED] mark=0 use=1",
            // Masqueraded as well (an outside client of externalTrafficPolicy Cluster), to the
            // node's port 61000.
            "tcp      6 431999 ESTABLISHED src=192.0.2.9 dst=192.168.0.4 sport=50000 dport=30080 src=10.244.1.3 dst=192.168.0.4 sport=8080 dport=61000 [ASSURED] mark=0 use=1",
            // Closing, unanswered, untranslated: not read.
            "tcp      6 100 TIME_WAIT src=10.244.0.2 dst=10.96.0.10 sport=44046 dport=80 src=10.244.1.3 dst=10.244.0.2 sport=8080 dport=44046 [ASSURED] mark=0 use=1",
            "tcp      6 117 SYN_SENT src=10.244.0.2 dst=10.96.0.10 sport=44048 dport=80 [UNREPLIED] src=10.244.1.3 dst=10.244.0.2 sport=8080 dport=44048 mark=0 use=1",
            "tcp      6 431999 ESTABLISHED src=10.244.0.2 dst=192.0.2.7 sport=44050 dport=80 src=192.0.2.7 dst=10.244.0.2 sport=80 dport=44050 [ASSURED] mark=0 use=1",
            // UDP, IPv6, answered.
            "udp      17 110 src=fd00:244::2 dst=fd00:96::a sport=40000 dport=53 src=fd00:244:1::3 dst=fd00:244::2 sport=5353 dport=40000 [ASSURED] mark=0 use=1",
            "icmp     1 29 src=10.244.0.2 dst=10.96.0.10 type=8 code=0 id=7 src=10.244.1.3 dst=10.244.0.2 type=0 code=0 id=7 mark=0 use=1",
            "conntrack v1.4.7 (conntrack-tools): 7 flow entries have been shown.",
        ];
        let got: Vec<Translated> = lines.iter().filter_map(|l| parse_translated(l)).collect();
        let t = |proto: libc::c_int, client: &str, service: &str, backend: &str| Translated {
            proto: proto as u8,
            client: client.parse().unwrap(),
            service: service.parse().unwrap(),
            backend: backend.parse().unwrap(),
            masquerade: None,
        };
        let masqueraded = Translated {
            masquerade: Some("192.168.0.4:61000".parse().unwrap()),
            ..t(libc::IPPROTO_TCP, "192.0.2.9:50000", "192.168.0.4:30080", "10.244.1.3:8080")
        };
        assert_eq!(
            got,
            vec![
                t(libc::IPPROTO_TCP, "10.244.0.2:44044", "10.96.0.10:80", "10.244.1.3:8080"),
                masqueraded,
                t(libc::IPPROTO_UDP, "[fd00:244::2]:40000", "[fd00:96::a]:53", "[fd00:244:1::3]:5353"),
            ]
        );
    }

    #[test]
    fn only_unanswered_untranslated_attempts_are_read_as_stuck() {
        let lines = [
            // Sent before the Service was served: untranslated, unanswered.
            "tcp      6 117 SYN_SENT src=10.244.0.2 dst=10.96.0.77 sport=44044 dport=80 [UNREPLIED] src=10.96.0.77 dst=10.244.0.2 sport=80 dport=44044 mark=0 use=1",
            // Translated (a backend is waiting to answer): not stuck, left alone.
            "tcp      6 118 SYN_SENT src=10.244.0.2 dst=10.96.0.77 sport=44046 dport=80 [UNREPLIED] src=10.244.1.1 dst=10.244.0.2 sport=8080 dport=44046 mark=0 use=1",
            // Answered: a live connection to a host that held the address before.
            "tcp      6 431999 ESTABLISHED src=10.244.0.2 dst=192.0.2.7 sport=44048 dport=80 src=192.0.2.7 dst=10.244.0.2 sport=80 dport=44048 [ASSURED] mark=0 use=1",
            "tcp      6 117 SYN_SENT src=fd00:244::2 dst=fd00:96::77 sport=40000 dport=443 [UNREPLIED] src=fd00:96::77 dst=fd00:244::2 sport=443 dport=40000 mark=0 use=1",
            "conntrack v1.4.7 (conntrack-tools): 4 flow entries have been shown.",
        ];
        let got: Vec<Attempt> = lines.iter().filter_map(|l| parse_attempt(l)).collect();
        let at = |src: &str, sport, dst: &str, dport| Attempt { src: src.parse().unwrap(), sport, dst: dst.parse().unwrap(), dport };
        assert_eq!(got, vec![at("10.244.0.2", 44044, "10.96.0.77", 80), at("fd00:244::2", 40000, "fd00:96::77", 443)]);
    }

    /// The delete request names the flow's protocol and original tuple as ctnetlink nests them.
    #[test]
    fn a_delete_request_names_the_original_tuple() {
        use crate::netlink::attrs;
        let nested = |v: &[u8], kind: u16| -> Vec<u8> { attrs(v).find(|(t, _)| *t == kind).map(|(_, x)| x.to_vec()).unwrap_or_default() };
        for (src, dst, family, src_attr) in
            [("10.244.0.2", "10.96.0.77", libc::AF_INET, CTA_IP_V4_SRC), ("fd00:244::2", "fd00:96::77", libc::AF_INET6, CTA_IP_V6_SRC)]
        {
            let (src, dst): (IpAddr, IpAddr) = (src.parse().unwrap(), dst.parse().unwrap());
            let octets = |ip: IpAddr| match ip {
                IpAddr::V4(a) => a.octets().to_vec(),
                IpAddr::V6(a) => a.octets().to_vec(),
            };
            let Request { header, body, .. } =
                delete_request(libc::IPPROTO_TCP as u8, SocketAddr::new(src, 20077), SocketAddr::new(dst, 80));
            assert_eq!(header, [family as u8, 0, 0, 0]);
            let orig = nested(&body, CTA_TUPLE_ORIG);
            let (ip, proto) = (nested(&orig, CTA_TUPLE_IP), nested(&orig, CTA_TUPLE_PROTO));
            assert_eq!((nested(&ip, src_attr), nested(&ip, src_attr + 1)), (octets(src), octets(dst)));
            assert_eq!(nested(&proto, CTA_PROTO_NUM), vec![6]);
            assert_eq!((nested(&proto, CTA_PROTO_SRC_PORT), nested(&proto, CTA_PROTO_DST_PORT)), (vec![0x4e, 0x6d], vec![0, 80]));
            // Every nested attribute says so (the kernel's strict parsing wants the flag).
            assert_eq!(u16::from_ne_bytes([body[2], body[3]]) & crate::netlink::NLA_F_NESTED, crate::netlink::NLA_F_NESTED);
        }
    }

    #[test]
    fn tcp_frontends_are_every_address_of_a_tcp_port_in_the_rules() {
        let name = |proto| ServicePortName { service: ObjectKey::new("default", "web"), port: "p".into(), protocol: proto };
        let web = PortView {
            external_ips: vec!["192.0.2.1".parse().unwrap()],
            lb_ips: vec!["198.51.100.1".parse().unwrap()],
            node_port: Some(30080),
            ..PortView::new(name(Protocol::Tcp), Family::V4, 80, vec!["10.96.0.1".parse().unwrap()], vec![ep("10.244.1.1", 8080)])
        };
        let empty = PortView::new(name(Protocol::Tcp), Family::V4, 81, vec!["10.96.0.1".parse().unwrap()], vec![]);
        let udp = PortView::new(name(Protocol::Udp), Family::V4, 53, vec!["10.96.0.1".parse().unwrap()], vec![ep("10.244.1.1", 53)]);
        let ports = [web, empty, udp];
        let want: BTreeSet<(IpAddr, u16)> = ["10.96.0.1", "192.0.2.1", "198.51.100.1"].iter().map(|a| (a.parse().unwrap(), 80)).collect();
        assert_eq!(
            tcp_frontends(&ports, true),
            want,
            "served: no NodePort (the node answers those itself), no port without endpoints, no UDP"
        );
        let mut present = want.clone();
        present.insert(("10.96.0.1".parse().unwrap(), 81));
        assert_eq!(tcp_frontends(&ports, false), present, "in the rules: the port without endpoints too");
    }

    #[test]
    fn ipv6_flows_are_read_and_judged_by_their_familys_view() {
        let line = "udp      17 27 src=fd00:244::2 dst=fd00:96::10 sport=40000 dport=53 src=fd00:244::103 dst=fd00:244::2 sport=5353 dport=40000 mark=0 use=1";
        let f = parse_line(line).expect("an IPv6 line");
        assert_eq!((f.dst, f.reply_src), ("fd00:96::10".parse().unwrap(), "fd00:244::103".parse().unwrap()));
        let mut v6 = dns(vec![ep("fd00:244::101", 5353)], Some(30053));
        (v6.family, v6.cluster_ips) = (Family::V6, vec!["fd00:96::10".parse().unwrap()]);
        let node = NodeContext { nodeport_ips: vec!["192.168.0.1".parse().unwrap(), "fd00::1".parse().unwrap()], ..Default::default() };
        let services = Services::from([(ObjectKey::new("kube-system", "dns"), vec![dns(vec![ep("10.244.1.1", 5353)], Some(30053)), v6])]);
        let flow = |dst: &str, dport, src: &str| Flow {
            dst: dst.parse().unwrap(),
            dport,
            src: "fd00:244::2".parse().unwrap(),
            sport: 40000,
            reply_src: src.parse().unwrap(),
            reply_sport: 5353,
        };
        let flows = [
            f,
            flow("fd00:96::10", 53, "fd00:244::101"),
            flow("fd00::1", 30053, "fd00:244::102"),
            // An IPv4 endpoint does not answer for the IPv6 NodePort address.
            flow("fd00::1", 30053, "10.244.1.1"),
            flow("192.168.0.1", 30053, "10.244.1.1"),
        ];
        let want: BTreeSet<Flow> = [flows[0], flows[2], flows[3]].into();
        assert_eq!(stale(flows, &services, &node), want);
    }

    #[test]
    fn stale_flows_are_those_to_a_service_not_answered_by_its_endpoints() {
        let node = NodeContext { nodeport_ips: vec!["192.168.0.1".parse().unwrap()], ..Default::default() };
        let services = Services::from([(ObjectKey::new("kube-system", "dns"), vec![dns(vec![ep("10.244.1.1", 5353)], Some(30053))])]);
        let flow = |dst: &str, dport, src: &str, sport| Flow {
            dst: dst.parse().unwrap(),
            dport,
            src: "10.244.0.2".parse().unwrap(),
            sport: 40000,
            reply_src: src.parse().unwrap(),
            reply_sport: sport,
        };
        let flows = [
            // Live: answered by the endpoint.
            flow("10.96.0.10", 53, "10.244.1.1", 5353),
            // A removed endpoint.
            flow("10.96.0.10", 53, "10.244.1.2", 5353),
            // Never translated (started before the Service had endpoints).
            flow("10.96.0.10", 53, "10.96.0.10", 53),
            // The endpoint's address, another port: not this endpoint.
            flow("10.96.0.10", 53, "10.244.1.1", 53),
            // Through the NodePort, to a removed endpoint.
            flow("192.168.0.1", 30053, "10.244.1.2", 5353),
            // Not a Service: left alone.
            flow("8.8.8.8", 53, "8.8.8.8", 53),
        ];
        assert_eq!(stale(flows, &services, &node), flows[1..5].iter().copied().collect::<BTreeSet<_>>());
        // Without endpoints nothing is stale: the rules refuse those packets.
        let empty = Services::from([(ObjectKey::new("kube-system", "dns"), vec![dns(vec![], Some(30053))])]);
        assert!(stale(flows, &empty, &node).is_empty());
    }
}
