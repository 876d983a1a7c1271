//! `proxy-agent trace`: runs one synthetic packet through the loaded external ingress program
//! (BPF_PROG_TEST_RUN) and reports what the datapath decided: the verdict, the Service, and the
//! backend the packet would reach. The packet is marked as a trace, so the program writes
//! nothing (no conntrack, affinity or counters) and records its decision instead.

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
};

use aya::{
    maps::{Array, HashMap, MapData},
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use proxy_common::{csum, map_names, prog_names, Backend, Reason, RevNat, ServiceName, TraceResult, TRACE_MARK};
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
    pub snat_address: Option<Ipv4Addr>,
    /// Interface the packet would leave by.
    pub ifindex: Option<u32>,
}

/// An Ethernet + IPv4 + TCP SYN or UDP frame from `from` to `to`.
pub fn frame(from: SocketAddrV4, to: SocketAddrV4, proto: Protocol) -> Vec<u8> {
    let l4_len = if proto == Protocol::Tcp { 20 } else { 8 + 4 };
    let mut f = vec![0u8; 14 + 20 + l4_len];
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + l4_len) as u16).to_be_bytes());
    ip[8] = 64;
    ip[9] = proto.ipproto();
    ip[12..16].copy_from_slice(&from.ip().octets());
    ip[16..20].copy_from_slice(&to.ip().octets());
    let mut hdr = [0u8; 20];
    hdr.copy_from_slice(ip);
    ip[10..12].copy_from_slice(&csum::ipv4_header(&hdr));
    let l4 = &mut f[34..];
    l4[0..2].copy_from_slice(&from.port().to_be_bytes());
    l4[2..4].copy_from_slice(&to.port().to_be_bytes());
    if proto == Protocol::Tcp {
        l4[12] = 5 << 4;
        l4[13] = 0x02; // SYN
    } else {
        l4[4..6].copy_from_slice(&(l4_len as u16).to_be_bytes());
    }
    f
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

/// Runs the packet `from -> to` through the pinned external ingress program under `root`.
/// Must run in the node's network namespace (the program's FIB lookups use the caller's).
pub fn run(root: &Path, from: SocketAddrV4, to: SocketAddrV4, proto: Protocol) -> Result<TraceReport, TraceError> {
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
    let data = frame(from, to, proto);
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
        snat_address: (r.snat_addr != [0; 4]).then(|| Ipv4Addr::from(r.snat_addr)),
        ifindex: (r.ifindex != 0).then_some(r.ifindex),
    };
    if r.service_id != 0 {
        let names: HashMap<MapData, u32, ServiceName> =
            HashMap::try_from(aya::maps::Map::HashMap(open_map(root, map_names::NAMES)?)).map_err(|e| TraceError::Run(e.to_string()))?;
        report.service = names.get(&r.service_id, 0).ok().map(|n| n.as_str().to_string());
        let revnat: HashMap<MapData, u32, RevNat> =
            HashMap::try_from(aya::maps::Map::HashMap(open_map(root, map_names::REVNAT)?)).map_err(|e| TraceError::Run(e.to_string()))?;
        report.frontend = revnat.get(&r.service_id, 0).ok().map(|rn| rn.socket().to_string());
    }
    if r.backend_id != 0 {
        let backends: Array<MapData, Backend> =
            Array::try_from(aya::maps::Map::Array(open_map(root, map_names::BACKENDS)?)).map_err(|e| TraceError::Run(e.to_string()))?;
        if let Ok(b) = backends.get(&r.backend_id, 0) {
            report.backend = Some(b.socket().to_string());
            report.backend_local = b.flags & proxy_common::backend_flags::LOCAL != 0;
        }
        report.backend_id = Some(r.backend_id);
    }
    Ok(report)
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
