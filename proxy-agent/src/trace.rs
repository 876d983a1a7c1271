//! `proxy-agent trace`: runs one synthetic packet through the loaded external ingress program
//! (BPF_PROG_TEST_RUN) and reports what the datapath decided: the verdict, the Service, and the
//! backend the packet would reach. The packet is marked as a trace, so the program writes
//! nothing (no conntrack, affinity or counters) and records its decision instead.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
};

use aya::{
    maps::{Array, HashMap, MapData},
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use proxy_common::{csum, map_names, prog_names, user::MapAddr, Backend, Ip6, Reason, RevNat, ServiceName, TraceResult, TRACE_MARK};
use serde::Serialize;

use crate::{dataplane::ebpf::loader, model::Protocol};

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("opening {what} under {root}: {detail}. Is the agent running with --bpffs-root {root}?")]
    Open { what: String, root: String, detail: String },
    #[error("running the packet through the program: {0}")]
    Run(String),
    #[error("the program recorded no decision (an agent older than this command?)")]
    NoDecision,
    #[error(transparent)]
    Access(#[from] crate::inspect::InspectError),
}

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct TraceReport {
    pub packet: String,
    /// The datapath's reason label.
    pub verdict: String,
    pub meaning: String,
    pub service: Option<String>,
    /// The frontend as replies will show it.
    pub frontend: Option<String>,
    pub backend: Option<String>,
    pub backend_id: Option<u32>,
    pub backend_local: bool,
    /// Source address the node would put on the packet (north-south to another node).
    pub snat_address: Option<IpAddr>,
    /// Interface the packet would leave by.
    pub ifindex: Option<u32>,
}

/// An Ethernet + IPv4 (IPv6) + TCP SYN or UDP frame from `from` to `to` (one family), with
/// no L4 checksum: the program decides on headers alone.
pub fn frame(from: SocketAddr, to: SocketAddr, proto: Protocol) -> Result<Vec<u8>, TraceError> {
    let l4_len = if proto == Protocol::Tcp { 20 } else { 8 + 4 };
    let (mut f, l4_off) = match (from.ip(), to.ip()) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            let mut f = vec![0u8; 14 + 20 + l4_len];
            f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
            let ip = &mut f[14..34];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&((20 + l4_len) as u16).to_be_bytes());
            ip[8] = 64;
            ip[9] = proto.ipproto();
            ip[12..16].copy_from_slice(&src.octets());
            ip[16..20].copy_from_slice(&dst.octets());
            let mut hdr = [0u8; 20];
            hdr.copy_from_slice(ip);
            ip[10..12].copy_from_slice(&csum::ipv4_header(&hdr));
            (f, 34)
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            let mut f = vec![0u8; 14 + 40 + l4_len];
            f[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
            let ip = &mut f[14..54];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
            ip[6] = proto.ipproto();
            ip[7] = 64;
            ip[8..24].copy_from_slice(&src.octets());
            ip[24..40].copy_from_slice(&dst.octets());
            (f, 54)
        }
        _ => return Err(TraceError::Run(format!("{from} and {to} are of different address families"))),
    };
    let l4 = &mut f[l4_off..];
    l4[0..2].copy_from_slice(&from.port().to_be_bytes());
    l4[2..4].copy_from_slice(&to.port().to_be_bytes());
    if proto == Protocol::Tcp {
        l4[12] = 5 << 4;
        l4[13] = 0x02; // SYN
    } else {
        l4[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
    }
    Ok(f)
}

fn meaning(r: Reason) -> &'static str {
    match r {
        Reason::ExtNewLocal => "new flow: DNAT to a backend on this node (the client address is kept)",
        Reason::ExtNewRemote => "new flow: DNAT to a backend on another node and SNAT to this node's address",
        Reason::Established => "a tracked flow to a backend on this node: DNAT",
        Reason::ExtEstablished => "a tracked flow to a backend on another node: DNAT and SNAT",
        Reason::ExtReply => "a reply of a tracked flow: translated back towards its client",
        Reason::ReplyIngress => "a reply of a flow translated on a pod interface: routed as is",
        Reason::RejectNoEndpoints => "the Service has no endpoints: answered with ICMP port unreachable",
        Reason::DropNoLocalEndpoints => "externalTrafficPolicy Local and no endpoint on this node: dropped",
        Reason::DropNoRoute => "no route to the chosen backend: dropped",
        Reason::DropBackendMissing => "the chosen backend is missing from the maps: dropped",
        Reason::DropSourceRange => "the source is outside the load balancer's loadBalancerSourceRanges: dropped",
        Reason::PassNotService => "not addressed to a NodePort, load-balancer or external IP: left to the kernel",
        Reason::PassNetfilter => "a connection kube-proxy masqueraded before the takeover: left to netfilter, which translates it",
        _ => "see the reason label",
    }
}

fn open_map(root: &Path, name: &'static str) -> Result<MapData, TraceError> {
    MapData::from_pin(loader::maps_dir(root).join(name)).map_err(|e| TraceError::Open {
        what: format!("map {name}"),
        root: root.display().to_string(),
        detail: e.to_string(),
    })
}

/// Runs the packet `from -> to` (IPv4 or IPv6) through the pinned external ingress program
/// under `root`. Must run in the node's network namespace (the program's FIB lookups use the
/// caller's).
pub fn run(root: &Path, from: impl Into<SocketAddr>, to: impl Into<SocketAddr>, proto: Protocol) -> Result<TraceReport, TraceError> {
    let (from, to) = (from.into(), to.into());
    let path = loader::progs_dir(root).join(prog_names::TC_EXT_INGRESS);
    if !crate::inspect::pinned(&path)? {
        return Err(crate::inspect::InspectError::NotFound(root.display().to_string()).into());
    }
    let prog = SchedClassifier::from_pin(&path).map_err(|e| TraceError::Open {
        what: format!("program {}", prog_names::TC_EXT_INGRESS),
        root: root.display().to_string(),
        detail: e.to_string(),
    })?;
    let trace_map = open_map(root, map_names::TRACE)?;
    let trace: Array<MapData, TraceResult> =
        Array::try_from(aya::maps::Map::Array(trace_map)).map_err(|e| TraceError::Run(e.to_string()))?;
    let before = trace.get(&0, 0).map_err(|e| TraceError::Run(e.to_string()))?.seq;
    let data = frame(from, to, proto)?;
    let mut out = vec![0u8; data.len() + 256];
    // `struct __sk_buff` up to `mark`: len and pkt_type must be zero.
    let mut ctx = [0u8; 12];
    ctx[8..12].copy_from_slice(&TRACE_MARK.to_ne_bytes());
    let opts = TestRunOptions { data_in: Some(&data), data_out: Some(&mut out), ctx_in: Some(&ctx), repeat: 1, ..Default::default() };
    prog.test_run(opts).map_err(|e| TraceError::Run(e.to_string()))?;
    let r = trace.get(&0, 0).map_err(|e| TraceError::Run(e.to_string()))?;
    if r.seq == before {
        return Err(TraceError::NoDecision);
    }
    let reason = Reason::try_from(r.reason).map_err(|v| TraceError::Run(format!("unknown reason {v}")))?;
    let mut report = TraceReport {
        packet: format!("{from} -> {to}/{proto}"),
        verdict: reason.label().to_string(),
        meaning: meaning(reason).to_string(),
        service: None,
        frontend: None,
        backend: None,
        backend_id: None,
        backend_local: false,
        snat_address: if to.is_ipv4() {
            (r.snat_addr != [0; 4]).then(|| Ipv4Addr::from(r.snat_addr).into())
        } else {
            (r.snat_addr6 != Ip6::default()).then(|| r.snat_addr6.ip())
        },
        ifindex: (r.ifindex != 0).then_some(r.ifindex),
    };
    if to.is_ipv4() {
        describe::<[u8; 4]>(root, &r, &mut report)?;
    } else {
        describe::<Ip6>(root, &r, &mut report)?;
    }
    Ok(report)
}

/// The Service, frontend and backend the decision names, from the family's maps.
fn describe<A: MapAddr>(root: &Path, r: &TraceResult, report: &mut TraceReport) -> Result<(), TraceError> {
    let maps = A::LB;
    let run_err = |e: aya::maps::MapError| TraceError::Run(e.to_string());
    if r.service_id != 0 {
        let names: HashMap<MapData, u32, ServiceName> =
            HashMap::try_from(aya::maps::Map::HashMap(open_map(root, maps.names)?)).map_err(run_err)?;
        report.service = names.get(&r.service_id, 0).ok().map(|n| n.as_str().to_string());
        let revnat: HashMap<MapData, u32, RevNat<A>> =
            HashMap::try_from(aya::maps::Map::HashMap(open_map(root, maps.revnat)?)).map_err(run_err)?;
        report.frontend =
            revnat.get(&r.service_id, 0).ok().map(|rn| SocketAddr::new(rn.addr.ip(), u16::from_be_bytes(rn.port)).to_string());
    }
    if r.backend_id != 0 {
        let backends: Array<MapData, Backend<A>> =
            Array::try_from(aya::maps::Map::Array(open_map(root, maps.backends)?)).map_err(run_err)?;
        if let Ok(b) = backends.get(&r.backend_id, 0) {
            report.backend = Some(SocketAddr::new(b.addr.ip(), u16::from_be_bytes(b.port)).to_string());
            report.backend_local = b.flags & proxy_common::backend_flags::LOCAL != 0;
        }
        report.backend_id = Some(r.backend_id);
    }
    Ok(())
}

pub fn render(r: &TraceReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "packet    {}", r.packet);
    let _ = writeln!(s, "verdict   {}: {}", r.verdict, r.meaning);
    if let Some(svc) = &r.service {
        let _ = writeln!(s, "service   {svc}{}", r.frontend.as_ref().map(|f| format!(" (frontend {f})")).unwrap_or_default());
    }
    if let Some(b) = &r.backend {
        let _ = writeln!(
            s,
            "backend   {b} (id {}, {})",
            r.backend_id.unwrap_or(0),
            if r.backend_local { "on this node" } else { "on another node" }
        );
    }
    if let Some(a) = r.snat_address {
        let _ = writeln!(s, "snat      source becomes {a}");
    }
    if let Some(i) = r.ifindex {
        let _ = writeln!(s, "leaves by ifindex {i}");
    }
    s
}
