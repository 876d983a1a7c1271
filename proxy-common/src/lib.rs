//! The ABI between the eBPF programs and the agent: map names, keys, values, flags, limits and
//! the reason codes the datapath counts. This crate is the only place these types are defined.
//!
//! Layout rules: every map type is `#[repr(C)]` with explicit `_pad` fields and a size assert, so
//! there is no implicit padding for the kernel to compare or for bpftool to print as garbage.
//! Fields the packet carries (addresses, ports) are byte arrays in network order, exactly as they
//! sit in the header (bpftool prints an address as its four octets); everything else is host
//! order. Types made only of byte arrays are `align(4)`: without it the bpf backend moves them a
//! byte at a time, which showed up as a third of the datapath's cost.
#![no_std]

pub mod csum;
pub mod ct;
pub mod hash;
#[cfg(feature = "user")]
pub mod user;

use core::mem::size_of;

/// An IPv6 address as the maps and the datapath hold it: the 16 bytes of the wire, in order,
/// held as four 32-bit words in the machine's order (`u32::from_ne_bytes` of each quarter).
/// Kept as bytes, the compiler splits an address into sixteen separate values, each spilled to
/// its own stack slot, which the 512-byte BPF stack cannot hold; as words it moves in four
/// loads and stores, as an IPv4 address moves in one.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ip6(pub [u32; 4]);
const _: () = assert!(size_of::<Ip6>() == 16);

impl Ip6 {
    pub const fn from_bytes(b: [u8; 16]) -> Self {
        Self([
            u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
            u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
            u32::from_ne_bytes([b[8], b[9], b[10], b[11]]),
            u32::from_ne_bytes([b[12], b[13], b[14], b[15]]),
        ])
    }

    pub const fn to_bytes(self) -> [u8; 16] {
        let [a, b, c, d] = [self.0[0].to_ne_bytes(), self.0[1].to_ne_bytes(), self.0[2].to_ne_bytes(), self.0[3].to_ne_bytes()];
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2], d[3]]
    }
}

/// ELF symbol names of the maps. They are also the kernel map names (at most 15 characters) and
/// the file names under `<bpffs-root>/maps/`. Change a layout: bump the version suffix.
pub mod map_names {
    pub const SERVICES: &str = "LB4_SERVICES_V1";
    pub const BACKENDS: &str = "LB4_BACKENDS_V1";
    pub const REVNAT: &str = "LB4_REVNAT_V1";
    pub const BACKEND_FLOWS: &str = "LB4_FLOWS_V1";
    pub const CT: &str = "CT4_V2";
    pub const FRAGS: &str = "FRAG4_V1";
    pub const STATS: &str = "STATS_V1";
    /// Service names for people (`inspect`, bpftool); the datapath never reads it.
    pub const NAMES: &str = "LB4_NAMES_V1";
    /// Service id -> that service's Maglev lookup table (an inner array of backend ids).
    pub const MAGLEV: &str = "LB4_MAGLEV_V1";
    /// ClientIP session affinity: (service, scope, client) -> backend.
    pub const AFFINITY: &str = "LB4_AFFINITY_V1";
    /// (service, scope, backend) pairs affinity may still lead to.
    pub const AFFINITY_MATCH: &str = "LB4_AFFMATCH_V1";
    /// External interface index -> its IPv4 address (the SNAT source).
    pub const IFADDRS: &str = "NODE_IFADDR_V1";
    /// External interface index -> its global IPv6 address (the IPv6 SNAT source).
    pub const IFADDRS6: &str = "NODE_IFADDR6_V1";
    /// Node-wide settings (one entry).
    pub const CONFIG: &str = "CONFIG_V3";
    /// What the last `trace` packet did (one entry; only trace packets write it).
    pub const TRACE: &str = "TRACE_V2";
    /// loadBalancerSourceRanges: an LPM trie of (service id, source prefix) a load-balancer
    /// frontend with the `SOURCE_RANGES` flag accepts new flows from.
    pub const SOURCE_RANGES: &str = "LB4_SRCRANGE_V1";
    /// Host-network sockets translated at connect/sendmsg: (socket cookie, backend) -> the
    /// Service address their peer must appear as (getpeername, recvmsg).
    pub const SOCK_REVNAT: &str = "SOCK_REVNAT_V1";
    /// Unconnected host-network UDP sockets: (socket cookie, Service address) -> the backend
    /// its datagrams go to, so a socket keeps one backend per Service as conntrack keeps it.
    pub const SOCK_FWD: &str = "SOCK_FWD_V1";
    /// Connected host-network sockets with a local port of their own choosing: (protocol,
    /// local port, backend) -> the socket's cookie, so a second socket on that port is sent to
    /// another backend instead of onto the first one's tuple.
    pub const SOCK_PORTS: &str = "SOCK_PORTS_V1";
    /// The other way round: a socket's cookie -> the `SOCK_PORTS` tuple it holds, forgotten
    /// when the socket connects elsewhere or is closed.
    pub const SOCK_HELD: &str = "SOCK_HELD_V1";
    /// The network namespace whose sockets the socket hooks serve (one entry: its cookie; 0 is
    /// none).
    pub const HOST_NETNS: &str = "HOST_NETNS_V1";
    /// Interface index -> what XDP may do with it (`xdp_dev` flags), from the kernel's
    /// xdp_features and the mode XDP runs in there.
    pub const XDP_DEVS: &str = "XDP_DEVS_V1";
    /// The cluster's Service CIDRs (ServiceCIDR objects) and, as /32 entries, the cluster IPs
    /// allocated in them: an LPM trie whose value (`svc_cidr`) says what a packet to an address
    /// without a Service on its port meets there.
    pub const SERVICE_CIDRS: &str = "LB4_SVCCIDR_V1";
    /// The frontend filter (`crate::filter`): a bit per hash of every frontend's address, port
    /// and protocol, so a packet for no Service is told so without a services map lookup.
    pub const FILTER: &str = "LB4_FILTER_V1";
    /// The conntrack filter (`crate::ct_filter`): a bit per hash of every key the conntrack map
    /// may hold, so a packet of no tracked flow is told so without a conntrack lookup.
    pub const CT_FILTER: &str = "CT4_FILTER_V1";
    /// The generation the flow caches are valid under (`ct::FlowGen`), so that no cached step
    /// outlives what it was decided from.
    pub const FLOW_GEN: &str = "FLOW_GEN_V1";
    /// Until when each family's takeover may still adopt connections to served frontends
    /// (`ct::ADOPTING_V4`).
    pub const ADOPTING: &str = "ADOPTING_V1";

    /// The IPv6 family's maps: the same roles as their IPv4 namesakes, keyed by 16-byte
    /// addresses. Ids (service, backend) are the family's own.
    pub const SERVICES6: &str = "LB6_SERVICES_V1";
    pub const BACKENDS6: &str = "LB6_BACKENDS_V1";
    pub const REVNAT6: &str = "LB6_REVNAT_V1";
    pub const BACKEND_FLOWS6: &str = "LB6_FLOWS_V1";
    pub const CT6: &str = "CT6_V1";
    pub const FRAGS6: &str = "FRAG6_V1";
    pub const AFFINITY6: &str = "LB6_AFFINITY_V1";
    pub const AFFINITY_MATCH6: &str = "LB6_AFFMATCH_V1";
    pub const SOURCE_RANGES6: &str = "LB6_SRCRANGE_V1";
    pub const SERVICE_CIDRS6: &str = "LB6_SVCCIDR_V1";
    pub const NAMES6: &str = "LB6_NAMES_V1";
    pub const MAGLEV6: &str = "LB6_MAGLEV_V1";
    pub const FILTER6: &str = "LB6_FILTER_V1";
    pub const CT_FILTER6: &str = "CT6_FILTER_V1";
    /// The socket hooks' maps for IPv6 Services (an IPv6 socket's IPv4-mapped peers use the
    /// IPv4 ones).
    pub const SOCK6_REVNAT: &str = "SOCK6_REVNAT_V1";
    pub const SOCK6_FWD: &str = "SOCK6_FWD_V1";
    pub const SOCK6_PORTS: &str = "SOCK6_PORTS_V1";
    pub const SOCK6_HELD: &str = "SOCK6_HELD_V1";

    /// The load-balancer maps of one family, as the agent's map writer names them.
    pub struct LbMaps {
        pub services: &'static str,
        pub backends: &'static str,
        pub revnat: &'static str,
        pub names: &'static str,
        pub flows: &'static str,
        pub affinity_match: &'static str,
        pub source_ranges: &'static str,
        pub service_cidrs: &'static str,
        pub maglev: &'static str,
        pub filter: &'static str,
    }

    pub const LB4: LbMaps = LbMaps {
        services: SERVICES,
        backends: BACKENDS,
        revnat: REVNAT,
        names: NAMES,
        flows: BACKEND_FLOWS,
        affinity_match: AFFINITY_MATCH,
        source_ranges: SOURCE_RANGES,
        service_cidrs: SERVICE_CIDRS,
        maglev: MAGLEV,
        filter: FILTER,
    };

    pub const LB6: LbMaps = LbMaps {
        services: SERVICES6,
        backends: BACKENDS6,
        revnat: REVNAT6,
        names: NAMES6,
        flows: BACKEND_FLOWS6,
        affinity_match: AFFINITY_MATCH6,
        source_ranges: SOURCE_RANGES6,
        service_cidrs: SERVICE_CIDRS6,
        maglev: MAGLEV6,
        filter: FILTER6,
    };
    /// The IPv6 programs, which the IPv4 ones tail-call (`prog_slots`): IPv6's flow does not
    /// fit the IPv4 programs' 512-byte stack frame beside IPv4's, so it runs as programs of its
    /// own, each with a frame of its own.
    pub const PROGS: &str = "PROGS_V1";
    /// The same for XDP (a program array holds programs of one type): slot 0, the IPv6 XDP
    /// program (`prog_names::XDP_EXT6`).
    pub const PROGS_XDP: &str = "PROGS_XDP_V1";
    /// Each family's load-balancer maps: one size per family (the writer's id limit).
    pub const LB_V4: [&str; 9] = [SERVICES, BACKENDS, REVNAT, NAMES, BACKEND_FLOWS, MAGLEV, AFFINITY_MATCH, SOURCE_RANGES, SERVICE_CIDRS];
    pub const LB_V6: [&str; 9] =
        [SERVICES6, BACKENDS6, REVNAT6, BACKEND_FLOWS6, AFFINITY_MATCH6, SOURCE_RANGES6, SERVICE_CIDRS6, NAMES6, MAGLEV6];
    pub const ALL: [&str; 47] = [
        SERVICES,
        BACKENDS,
        REVNAT,
        BACKEND_FLOWS,
        CT,
        FRAGS,
        STATS,
        NAMES,
        MAGLEV,
        AFFINITY,
        AFFINITY_MATCH,
        IFADDRS,
        CONFIG,
        TRACE,
        SOURCE_RANGES,
        SOCK_REVNAT,
        SOCK_FWD,
        SOCK_PORTS,
        SOCK_HELD,
        HOST_NETNS,
        XDP_DEVS,
        FLOW_GEN,
        ADOPTING,
        SERVICE_CIDRS,
        SERVICES6,
        BACKENDS6,
        REVNAT6,
        BACKEND_FLOWS6,
        CT6,
        FRAGS6,
        AFFINITY6,
        AFFINITY_MATCH6,
        SOURCE_RANGES6,
        SERVICE_CIDRS6,
        NAMES6,
        SOCK6_REVNAT,
        SOCK6_FWD,
        SOCK6_PORTS,
        SOCK6_HELD,
        IFADDRS6,
        MAGLEV6,
        PROGS,
        PROGS_XDP,
        FILTER,
        FILTER6,
        CT_FILTER,
        CT_FILTER6,
    ];
}

/// Program names (ELF symbols) and the file names they are pinned under in `<bpffs-root>/progs/`.
pub mod prog_names {
    pub const TC_INGRESS: &str = "proxy_tc_ingress";
    pub const TC_EGRESS: &str = "proxy_tc_egress";
    /// TC ingress of external interfaces: NodePort, load-balancer and external IPs.
    pub const TC_EXT_INGRESS: &str = "proxy_tc_ext_ingress";
    /// XDP on external interfaces: the fast path to remote backends.
    pub const XDP_EXT: &str = "proxy_xdp_ext";
    /// IPv6 in XDP on external interfaces (tail-called by `XDP_EXT`: slot 0 of
    /// `map_names::PROGS_XDP`).
    pub const XDP_EXT6: &str = "proxy_xdp_ext6";
    /// The lab object's programs (proxy-ebpf/src/bin/lab.rs), which the agent's object does
    /// not carry. An empty classifier: the benchmark's floor.
    pub const TC_FLOOR: &str = "proxy_tc_floor";
    /// XDP_PASS for everything, for the far ends of the lab's links (see the program's comment).
    pub const XDP_PASS: &str = "proxy_xdp_pass";
    /// Benchmark frame generators (restore the frame, then the external XDP logic, or pass).
    pub const XDP_BENCH_EXT: &str = "proxy_xdp_bench_ext";
    pub const XDP_BENCH_PASS: &str = "proxy_xdp_bench_pass";
    pub const XDP_BENCH_TX: &str = "proxy_xdp_bench_tx";
    /// XDP_DROP for everything: the benchmark's sink.
    pub const XDP_DROP: &str = "proxy_xdp_drop";
    pub const LAB: [&str; 6] = [TC_FLOOR, XDP_PASS, XDP_BENCH_EXT, XDP_BENCH_PASS, XDP_BENCH_TX, XDP_DROP];
    /// cgroup socket hooks serving Services to host-network processes.
    pub const SOCK_CONNECT4: &str = "proxy_sock_connect4";
    pub const SOCK_SENDMSG4: &str = "proxy_sock_sendmsg4";
    pub const SOCK_RECVMSG4: &str = "proxy_sock_recvmsg4";
    pub const SOCK_GETPEERNAME4: &str = "proxy_sock_getpeername4";
    /// The same for IPv6 sockets (IPv4 Services through IPv4-mapped addresses).
    pub const SOCK_CONNECT6: &str = "proxy_sock_connect6";
    pub const SOCK_SENDMSG6: &str = "proxy_sock_sendmsg6";
    pub const SOCK_RECVMSG6: &str = "proxy_sock_recvmsg6";
    pub const SOCK_GETPEERNAME6: &str = "proxy_sock_getpeername6";
    /// The socket hooks with the attach type each needs.
    pub const SOCK_HOOKS: [&str; 8] =
        [SOCK_CONNECT4, SOCK_SENDMSG4, SOCK_RECVMSG4, SOCK_GETPEERNAME4, SOCK_CONNECT6, SOCK_SENDMSG6, SOCK_RECVMSG6, SOCK_GETPEERNAME6];
    /// A cgroup sock program, run when a host-network socket is closed (forgets its tuple).
    pub const SOCK_RELEASE: &str = "proxy_sock_release";
    /// The IPv6 flow, tail-called from `TC_EGRESS` (see `map_names::PROGS`): conntrack and
    /// established flows, a new flow's service lookup and tracking, replies (and, in
    /// `TC_EGRESS6`, IPv4 host flows: see `TC_HOST6`). `TC_INGRESS`
    /// serves IPv6 itself and enters only `TC_INGRESS6_NEW` (new flows) and `TC_ICMP6`
    /// (errors); `TC_INGRESS6` stays for an older build's `TC_INGRESS`, which tail-calls it
    /// until an upgrade replaces that program.
    pub const TC_INGRESS6: &str = "proxy_tc_ingress6";
    pub const TC_INGRESS6_NEW: &str = "proxy_tc_ingress6_new";
    pub const TC_EGRESS6: &str = "proxy_tc_egress6";
    pub const TC_EXT_INGRESS6: &str = "proxy_tc_ext_ingress6";
    pub const TC_EXT_INGRESS6_NEW: &str = "proxy_tc_ext_ingress6_new";
    pub const TC_EXT_INGRESS6_TRACE: &str = "proxy_tc_ext_ingress6_trace";
    /// ICMPv6 errors arriving from pods and from outside, tail-called from IPv6 pod ingress and
    /// `TC_EXT_INGRESS6` (the translation and its route do not fit their frames).
    pub const TC_ICMP6: &str = "proxy_tc_icmp6";
    /// An ICMPv6 error `TC_ICMP6` translated for a remote backend or its client, sent on past
    /// the stack by the FIB's route.
    pub const TC_ICMP6_SEND: &str = "proxy_tc_icmp6_send";
    /// An IPv6 host flow the socket hooks left to TC, tail-called from `TC_EGRESS6` (its new
    /// ones go on to `TC_HOST6_NEW`: both do not fit one frame). An IPv4 one goes from
    /// `TC_EGRESS` to `TC_EGRESS6`, the egress program's one tail call. Kept out of the egress
    /// programs themselves: inline, their decision made every packet there slower.
    pub const TC_HOST6: &str = "proxy_tc_host6";
    pub const TC_HOST6_NEW: &str = "proxy_tc_host6_new";
    /// Each with its slot in `map_names::PROGS`.
    pub const TAIL_CALLED: [(&str, u32); 10] = [
        (TC_INGRESS6, super::prog_slots::INGRESS6),
        (TC_INGRESS6_NEW, super::prog_slots::INGRESS6_NEW),
        (TC_EGRESS6, super::prog_slots::EGRESS6),
        (TC_EXT_INGRESS6, super::prog_slots::EXT_INGRESS6),
        (TC_EXT_INGRESS6_NEW, super::prog_slots::EXT_INGRESS6_NEW),
        (TC_EXT_INGRESS6_TRACE, super::prog_slots::EXT_INGRESS6_TRACE),
        (TC_ICMP6, super::prog_slots::ICMP6),
        (TC_ICMP6_SEND, super::prog_slots::ICMP6_SEND),
        (TC_HOST6, super::prog_slots::HOST6),
        (TC_HOST6_NEW, super::prog_slots::HOST6_NEW),
    ];
}

/// Slots of `map_names::PROGS`.
pub mod prog_slots {
    pub const INGRESS6: u32 = 0;
    pub const INGRESS6_NEW: u32 = 1;
    pub const EGRESS6: u32 = 2;
    pub const EXT_INGRESS6: u32 = 3;
    pub const EXT_INGRESS6_NEW: u32 = 4;
    pub const EXT_INGRESS6_TRACE: u32 = 5;
    pub const ICMP6: u32 = 6;
    pub const ICMP6_SEND: u32 = 7;
    pub const HOST6: u32 = 8;
    pub const HOST6_NEW: u32 = 9;
    pub const COUNT: u32 = 10;
    /// Slots of `map_names::PROGS_XDP` (slot 0: `prog_names::XDP_EXT6`).
    pub const XDP_COUNT: u32 = 1;
}

/// Default map sizes. The agent may override them when it first creates the maps.
pub mod limits {
    /// Host-network sockets remembered for getpeername/recvmsg (an LRU).
    pub const SOCK_REVNAT_MAX: u32 = 65536;
    /// Entries in each load-balancer map (services+slots, backends, reverse NAT, flow counters).
    pub const LB_MAP_MAX: u32 = 65536;
    /// Connection-tracking entries; a connection takes two (one per direction).
    pub const CT_MAP_MAX: u32 = 262_144;
    /// First fragments remembered so that later fragments can be translated.
    pub const FRAG_MAP_MAX: u32 = 8192;
    /// Slots a single service may have (`ServiceValue::count` is a u16).
    pub const MAX_SLOTS: u32 = u16::MAX as u32;
    /// Default Maglev table size per service: a prime, as the algorithm needs (Cilium's default;
    /// good for ~160 backends at <= 1% imbalance).
    pub const MAGLEV_TABLE_SIZE: u32 = 16381;
    /// Client IP affinity entries.
    pub const AFFINITY_MAP_MAX: u32 = 65536;
    /// External interfaces.
    pub const IFADDR_MAP_MAX: u32 = 256;
    /// Interfaces whose XDP capabilities are recorded (`XDP_DEVS_V1`).
    pub const XDP_DEVS_MAX: u32 = 1024;
    /// Source ports for SNAT of north-south flows: above Linux's default local port range
    /// (32768-60999), so the node's own connections do not compete for them.
    pub const SNAT_PORT_MIN: u16 = 61000;
    pub const SNAT_PORT_MAX: u16 = 65535;
}

/// Values of `XDP_DEVS_V1`. Native XDP can only send a frame out of a device whose driver takes
/// XDP frames: a veth does so only while its peer runs XDP or has GRO on, and drops them
/// otherwise. Without the bit XDP hands the flow to TC, which sends it as an skb.
pub mod xdp_dev {
    /// XDP_TX from native XDP on this device (the frame leaves where it came in).
    pub const TX: u32 = 1 << 0;
    /// XDP_REDIRECT from native XDP on another device into this one (ndo_xdp_xmit).
    pub const XMIT: u32 = 1 << 1;
    /// XDP runs in generic (skb) mode on this device: frames it sends are skbs, which every
    /// device takes.
    pub const GENERIC: u32 = 1 << 2;
}

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Service address scope. Only `EXTERNAL` (the one a ClusterIP uses) is programmed today; the
/// field is in the key so that node-local views can be added without a layout change.
pub mod scope {
    pub const EXTERNAL: u8 = 0;
    pub const INTERNAL: u8 = 1;
}

/// Key of `LB4_SERVICES_V1`. Slot 0 is the master entry of a frontend (VIP, port, protocol);
/// slots `1..=count` name its backends.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey<A = [u8; 4]> {
    /// Frontend address, network order.
    pub addr: A,
    /// Frontend port, network order.
    pub port: [u8; 2],
    pub proto: u8,
    pub scope: u8,
    pub slot: u16,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<ServiceKey>() == 12);
const _: () = assert!(size_of::<ServiceKey<Ip6>>() == 24);

impl<A> ServiceKey<A> {
    pub const fn new(addr: A, port: [u8; 2], proto: u8, slot: u16) -> Self {
        Self { addr, port, proto, scope: scope::EXTERNAL, slot, _pad: [0; 2] }
    }

    pub fn with_slot(mut self, slot: u16) -> Self {
        self.slot = slot;
        self
    }
}

/// Value of `LB4_SERVICES_V1`. In the master entry (slot 0): `count`, `service_id`, `flags` and
/// `affinity_timeout` are set and `backend_id` is 0. In slot entries `backend_id` is set and
/// `service_id` repeats the master's, so a dump shows which frontend a slot belongs to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    pub backend_id: u32,
    pub service_id: u32,
    pub count: u16,
    pub flags: u16,
    /// Session affinity timeout in seconds; 0 when the service has no affinity.
    pub affinity_timeout: u32,
}
const _: () = assert!(size_of::<ServiceValue>() == 16);

/// `ServiceValue::flags`.
pub mod svc_flags {
    pub const NONE: u16 = 0;
    /// With no backends, drop instead of answering port unreachable: the Service has endpoints,
    /// just none this traffic may use (kube-proxy's "has no local endpoints" DROP).
    pub const DROP_WHEN_EMPTY: u16 = 1 << 0;
    /// Reachable from outside (NodePort, load-balancer IP, external IP): served on external
    /// interfaces too.
    pub const EXTERNAL: u16 = 1 << 1;
    /// Pods see other backends than outside clients (externalTrafficPolicy Local): pod-facing
    /// hooks look the frontend up again with `scope::INTERNAL`.
    pub const TWO_SCOPES: u16 = 1 << 2;
    /// A Maglev table for this service id is in `LB4_MAGLEV_V1`.
    pub const MAGLEV: u16 = 1 << 3;
    /// New flows only from the sources `LB4_SRCRANGE_V1` holds for this service id
    /// (loadBalancerSourceRanges); others are dropped.
    pub const SOURCE_RANGES: u16 = 1 << 4;
}

/// Value of `LB4_BACKENDS_V1`, an array indexed by backend id (the lookup is inlined by the
/// verifier, unlike a hash lookup). Id 0 is never used; an entry with address 0.0.0.0 is unset.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend<A = [u8; 4]> {
    pub addr: A,
    pub port: [u8; 2],
    pub proto: u8,
    pub flags: u8,
}
const _: () = assert!(size_of::<Backend>() == 8);
const _: () = assert!(size_of::<Backend<Ip6>>() == 20);

/// `Backend::flags`.
pub mod backend_flags {
    /// The endpoint is terminating: it serves flows it already has and takes new ones only when
    /// no ready endpoint is left (KEP-1669).
    pub const TERMINATING: u8 = 1;
    /// The endpoint runs on this node.
    pub const LOCAL: u8 = 2;
}

/// Value of `LB4_REVNAT_V1`, keyed by service id: the address replies must appear to come from.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RevNat<A = [u8; 4]> {
    pub addr: A,
    pub port: [u8; 2],
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<RevNat>() == 8);
const _: () = assert!(size_of::<RevNat<Ip6>>() == 20);

/// Value of `LB4_NAMES_V1`, keyed by service id: `namespace/name:port`, NUL-padded.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceName {
    pub name: [u8; 128],
}
const _: () = assert!(size_of::<ServiceName>() == 128);

/// Value of `LB4_FLOWS_V1` (an array indexed by backend id): flows the datapath sent there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendFlows {
    pub flows: u64,
}
const _: () = assert!(size_of::<BackendFlows>() == 8);

/// Key of `CT4_V1`: the 5-tuple as it appears on the wire. A forward entry is keyed on
/// client -> service, a reply entry on backend -> client. Direction lives in the value: the two
/// tuples of one connection never coincide, so one lookup serves both directions.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey<A = [u8; 4]> {
    pub saddr: A,
    pub daddr: A,
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    // Two fields rather than [u8; 3]: zeroing three bytes made the bpf backend call memset.
    pub _pad: u8,
    pub _pad2: u16,
}
const _: () = assert!(size_of::<CtKey>() == 16);
const _: () = assert!(size_of::<CtKey<Ip6>>() == 40);

/// Value of `CT4_V2`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntry<A = [u8; 4]> {
    /// `bpf_ktime_get_coarse_ns()` of the last packet, refreshed at most once a second.
    pub last_seen_ns: u64,
    pub backend_id: u32,
    pub service_id: u32,
    /// `ct::flags`.
    pub flags: u8,
    /// Forward entry: the form of the TCP/UDP checksum the flow's packets carried when it
    /// was translated first (`ct::l4_csum`), so later packets can be rewritten without the
    /// kernel's checksum helpers.
    pub l4_csum: u8,
    /// Forward entry: the backend's port. Reply entry: the service's, or with `SNAT` the
    /// client's (network order).
    pub nat_port: [u8; 2],
    /// Forward entry: the backend's address, so a backend id reused by another backend is not
    /// mistaken for this one, and the reply entry can be found to delete it. Reply entry: the
    /// service's address, or with `SNAT` the client's.
    pub nat_addr: A,
    /// Forward entry with `SNAT`: the source port the node put on the flow.
    pub snat_port: [u8; 2],
    pub _pad2: [u8; 2],
    /// Forward entry with `SNAT`: the source address the node put on the flow.
    pub snat_addr: A,
    /// Entries of flows the datapath sends on itself (SNAT, both ways): where the last FIB
    /// lookup sent them, reused while `route_epoch` is the current one (about a second), so
    /// established packets skip the lookup. 0: nothing cached.
    pub route_ifindex: u32,
    pub route_dmac: [u8; 6],
    pub route_smac: [u8; 6],
    /// `ct::route_epoch` of the cached route.
    pub route_epoch: u16,
    /// The folded sum of the key's two addresses, as the L4 pseudo-header holds them
    /// (`csum::address_pair`), so established packets and replies check their checksum's form
    /// without summing the addresses again. 0: not computed (an entry of an older build; a SNAT
    /// entry; the datapath's reply entry of a hairpinned flow).
    pub addr_sum: [u8; 2],
    /// Forward entry: the folded change from the key's destination address to `nat_addr`
    /// (`csum::address_delta`), what DNAT adds to the checksum. Reply entry: the change from
    /// the key's source address (the backend's) to `nat_addr` (the Service's), what the reverse
    /// NAT adds (`csum::reply_sums`). 0: not computed.
    pub addr_delta: [u8; 2],
    /// With the cached route: the `xdp_dev` flags its device had when it was cached, or'd with
    /// `ct::ROUTE_XDP_KNOWN`, so native XDP need not look the device up on every packet. 0: not
    /// known (an entry of an older build, or no route cached).
    pub route_xdp: u8,
    /// `ct::owner`: whose translation the entry's tuple is.
    pub owner: u8,
}
const _: () = assert!(size_of::<CtEntry>() == 56);
const _: () = assert!(size_of::<CtEntry<Ip6>>() == 80);

/// Key of `LB4_AFFINITY_V1`.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey<A = [u8; 4]> {
    pub service_id: u32,
    pub client: A,
    pub scope: u8,
    pub _pad: u8,
    pub _pad2: u16,
}
const _: () = assert!(size_of::<AffinityKey>() == 12);
const _: () = assert!(size_of::<AffinityKey<Ip6>>() == 24);

/// Value of `LB4_AFFINITY_V1`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityValue {
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<AffinityValue>() == 16);

/// Key of `SOCK_REVNAT_V1` (value: a `RevNat`, the Service address), and of `SOCK_FWD_V1`
/// (holding the Service address). The cookie is held as bytes, so an IPv6 key has no padding
/// a u64's alignment would add.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevKey<A = [u8; 4]> {
    /// The socket's cookie, native byte order.
    pub cookie: [u8; 8],
    pub addr: A,
    pub port: [u8; 2],
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<SockRevKey>() == 16);
const _: () = assert!(size_of::<SockRevKey<Ip6>>() == 28);

impl<A> SockRevKey<A> {
    pub fn new(cookie: u64, addr: A, port: [u8; 2]) -> Self {
        Self { cookie: cookie.to_ne_bytes(), addr, port, _pad: [0; 2] }
    }
}

/// Value of `SOCK_PORTS_V1`: the socket holding the tuple, and since when (the coarse clock).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockOwner {
    pub cookie: u64,
    pub since_ns: u64,
}
const _: () = assert!(size_of::<SockOwner>() == 16);

/// Key of `SOCK_PORTS_V1` (value: a `SockOwner`, the socket holding the tuple): a
/// connected host-network socket's tuple at its backend, less the local address, which is not
/// chosen yet when the socket connects.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockPortKey<A = [u8; 4]> {
    pub addr: A,
    pub port: [u8; 2],
    /// The socket's local port, in network byte order.
    pub sport: [u8; 2],
    pub proto: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<SockPortKey>() == 12);
const _: () = assert!(size_of::<SockPortKey<Ip6>>() == 24);

/// Value of `SOCK_FWD_V1` (keyed by a `SockRevKey` holding the Service address).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockFwd<A = [u8; 4]> {
    pub backend_id: u32,
    pub addr: A,
    pub port: [u8; 2],
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<SockFwd>() == 12);
const _: () = assert!(size_of::<SockFwd<Ip6>>() == 24);

/// The data of a `LB4_SRCRANGE_V1` key (value: a u8, 1). The trie matches its bits in order,
/// so the prefix length of an entry is 32 (the whole service id) plus the range's.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceRangeKey<A = [u8; 4]> {
    pub service_id: u32,
    pub addr: A,
}
const _: () = assert!(size_of::<SourceRangeKey>() == 8);
const _: () = assert!(size_of::<SourceRangeKey<Ip6>>() == 20);

impl SourceRangeKey {
    /// Bits of the key before the address: the service id's.
    pub const ID_BITS: u32 = 32;
}

/// Key of `LB4_AFFMATCH_V1` (value: a u32, 1).
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityMatchKey {
    pub service_id: u32,
    pub backend_id: u32,
    pub scope: u8,
    pub _pad: u8,
    pub _pad2: u16,
}
const _: () = assert!(size_of::<AffinityMatchKey>() == 12);

/// Value of `NODE_IFADDR_V1` (`NODE_IFADDR6_V1`).
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IfAddr<A = [u8; 4]> {
    pub addr: A,
}
const _: () = assert!(size_of::<IfAddr>() == 4);
const _: () = assert!(size_of::<IfAddr<Ip6>>() == 16);

/// Value of `CONFIG_V3` (index 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// Entries of each Maglev table (a prime).
    pub maglev_size: u32,
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// The smallest prefix holding every Service CIDR (`svc_net & svc_mask`): a destination
    /// outside it needs no lookup in `LB4_SVCCIDR_V1`, so traffic that is not for Services (most
    /// of a node's) pays two ALU operations for the check. (Ranges far apart make it wide, and
    /// then more packets pay the lookup.)
    pub svc_net: [u8; 4],
    pub svc_mask: [u8; 4],
    /// Service CIDRs in `LB4_SVCCIDR_V1`; 0: none known, nothing is checked.
    pub svc_cidrs: u32,
    /// The same for `LB6_SVCCIDR_V1`.
    pub svc_cidrs6: u32,
    /// IPv6's common prefix, as `svc_net` and `svc_mask` (all zeroes with `svc_cidrs6` set, a
    /// `::/0` range: every address is looked up).
    pub svc_net6: Ip6,
    pub svc_mask6: Ip6,
}
const _: () = assert!(size_of::<Config>() == 56);

/// Key of `LB4_SVCCIDR_V1` (after the LPM trie's prefix length).
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcCidrKey<A = [u8; 4]> {
    pub addr: A,
}
const _: () = assert!(size_of::<SvcCidrKey>() == 4);
const _: () = assert!(size_of::<SvcCidrKey<Ip6>>() == 16);

/// The frontend filter (`LB4_FILTER_V1`, `LB6_FILTER_V1`): an array of 64-bit words holding one
/// bit per frontend hash (`hash::frontend`), set by the agent before it writes a frontend's
/// master entry and cleared after the last master of that bit is deleted. A packet whose
/// destination's bit is clear is for no Service, which the datapath then knows from one array
/// read (inlined by the verifier) instead of a services map lookup that finds nothing: most
/// packets a node sees (pod to pod, to the node itself) are such. A set bit says only "maybe":
/// the services map decides.
pub mod filter {
    /// 2^18 bits (32 KiB a family): about 4 % of the bits are set at 10,000 frontends.
    pub const BITS_LOG2: u32 = 18;
    pub const WORDS: u32 = 1 << (BITS_LOG2 - 6);

    /// An address the filter can place a frontend of.
    pub trait Addr: Copy {
        fn frontend_hash(self, port: [u8; 2], proto: u8) -> u32;
    }

    impl Addr for [u8; 4] {
        #[inline(always)]
        fn frontend_hash(self, port: [u8; 2], proto: u8) -> u32 {
            crate::hash::frontend(self, port, proto)
        }
    }

    impl Addr for crate::Ip6 {
        #[inline(always)]
        fn frontend_hash(self, port: [u8; 2], proto: u8) -> u32 {
            crate::hash::frontend6(self, port, proto)
        }
    }

    /// The word (index) and the bit in it of frontend (`addr`, `port`, `proto`).
    #[inline(always)]
    pub fn place<A: Addr>(addr: A, port: [u8; 2], proto: u8) -> (u32, u64) {
        let bit = addr.frontend_hash(port, proto) >> (32 - BITS_LOG2);
        (bit >> 6, 1 << (bit & 63))
    }
}

/// The conntrack filter (`CT4_FILTER_V1`, `CT6_FILTER_V1`): a bit per hash of every key the
/// family's conntrack map may hold. Most packets a node sees belong to no tracked flow (pod to
/// pod, to and from the node itself); a clear bit tells the datapath so from one array read
/// (inlined by the verifier) instead of a conntrack lookup that finds nothing, which hashes the
/// whole key (16 bytes, 40 for IPv6) and walks a bucket. A set bit says only "maybe": the
/// conntrack map decides.
///
/// The map holds one value (`CtFilter`): two halves of `2^BITS_LOG2` bits and a control word
/// that says which half lookups read. The datapath sets a key's bit in both halves before it
/// inserts the key, and never clears one. Bits of entries gone (evicted, or deleted) are
/// dropped by a rebuild (the agent's `ct_filter::rebuild`): it clears the half lookups do not
/// read, waits for every program run that may have set a bit there before the clear to
/// finish, sets the bit of every key the map holds, and only then turns lookups to that half.
/// A key inserted meanwhile had its bit set after the clear, or is in the map when the walk
/// starts: no tracked key is ever without its bit in the half read.
pub mod ct_filter {
    /// 2^20 bits a half (128 KiB): four per entry of a default conntrack map (262,144), so
    /// that a fifth of them are set when it is full.
    pub const BITS_LOG2: u32 = 20;
    pub const HALF_WORDS: usize = 1 << (BITS_LOG2 - 6);

    /// The map's one value. (One value rather than an array of words: the datapath reaches
    /// both halves and the control word from one lookup.)
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct CtFilter {
        pub words: [u64; 2 * HALF_WORDS],
        /// `control(half)`: lookups read half `half`. Anything else (a map not yet written)
        /// makes the filter say "maybe" for every key.
        pub control: u64,
    }

    const VALID: u64 = 0xc7f1_0000;

    /// The control word of a filter whose lookups read half `half` (0 or 1).
    pub const fn control(half: usize) -> u64 {
        VALID | (half & 1) as u64
    }

    /// The half lookups read, of a control word; `None`: not one.
    #[inline(always)]
    pub const fn half(control: u64) -> Option<usize> {
        if control & !1 == VALID {
            Some((control & 1) as usize)
        } else {
            None
        }
    }

    /// Where the key of hash `hash` has its bit in a half: the word and the bit.
    #[inline(always)]
    pub const fn place(hash: u64) -> (usize, u64) {
        let bit = (hash >> (64 - BITS_LOG2)) as usize;
        (bit >> 6, 1 << (bit & 63))
    }

    /// An address a conntrack key can hold, folded to one word (IPv6: its four words XORed;
    /// addresses that fold alike only share bits).
    pub trait Addr: Copy {
        fn fold(self) -> u32;
    }

    impl Addr for [u8; 4] {
        #[inline(always)]
        fn fold(self) -> u32 {
            u32::from_ne_bytes(self)
        }
    }

    impl Addr for crate::Ip6 {
        #[inline(always)]
        fn fold(self) -> u32 {
            self.0[0] ^ self.0[1] ^ self.0[2] ^ self.0[3]
        }
    }

    /// Hash of a conntrack key (its fields as the map holds them), whose top bits place it:
    /// a few multiplications and shifts, cheap beside the kernel's hash of the whole key. The destination
    /// port is left out: a reply tuple's is the port the client is moved to or the SNAT port,
    /// chosen by trying one after the other, and its bit is set once, before the tries. Part
    /// of the ABI of the pinned filter: a change renames the maps.
    #[inline(always)]
    pub fn hash<A: Addr>(key: &crate::CtKey<A>) -> u64 {
        let addrs = (key.saddr.fold() as u64) << 32 | key.daddr.fold() as u64;
        let rest = u16::from_ne_bytes(key.sport) as u64 | (key.proto as u64) << 16;
        let h = (addrs ^ rest << 40 ^ rest).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (h ^ h >> 32).wrapping_mul(0xd6e8_feb8_6659_fd93)
    }

    #[cfg(test)]
    mod tests {
        extern crate std;
        use super::*;
        use crate::{CtKey, Ip6};

        fn key<A: Addr>(saddr: A, daddr: A, sport: u16, dport: u16, proto: u8) -> CtKey<A> {
            CtKey { saddr, daddr, sport: sport.to_be_bytes(), dport: dport.to_be_bytes(), proto, _pad: 0, _pad2: 0 }
        }

        /// Distinct bits `keys` take in a half, against what a uniform hash gives their
        /// distinct tuples (`m (1 - e^(-n/m))`; the destination port is not hashed).
        fn spread<A: Addr>(keys: &[CtKey<A>]) -> (usize, f64) {
            let set: std::collections::BTreeSet<(usize, u64)> = keys.iter().map(|k| place(hash(k))).collect();
            let tuples: std::collections::BTreeSet<(u32, u32, [u8; 2], u8)> =
                keys.iter().map(|k| (k.saddr.fold(), k.daddr.fold(), k.sport, k.proto)).collect();
            let (n, m) = (tuples.len() as f64, (1u64 << BITS_LOG2) as f64);
            (set.len(), m * (1.0 - (-n / m).exp()))
        }

        /// Pod-to-pod flows (addresses of a /16, ephemeral ports, a few backend ports) and the
        /// replies of Service flows take about as many bits as a uniform hash would give them,
        /// in both families, so a packet of no flow meets a set bit about as often as the
        /// share of set bits says.
        #[test]
        fn conntrack_keys_spread_over_the_filter() {
            // Pinned: the filter outlives the agent in its pin; a change of the hash must
            // rename the maps.
            assert_eq!(hash(&key([10, 244, 1, 7], [10, 96, 0, 10], 40_000, 53, 17)), 0xe35d_5154_6a3d_58e8);
            assert_eq!(
                hash(&key([10, 244, 1, 7], [10, 96, 0, 10], 40_000, 53, 17)),
                hash(&key([10, 244, 1, 7], [10, 96, 0, 10], 40_000, 443, 17)),
                "the destination port is not hashed"
            );
            let (mut v4, mut v6) = (std::vec::Vec::new(), std::vec::Vec::new());
            for i in 0..100_000u32 {
                let client = [10, 244, (i % 200) as u8, (i / 200 % 250) as u8];
                let backend = [10, 244, (i % 13) as u8, 9];
                let sport = 32_768 + (i * 7 % 28_000) as u16;
                let dport = [80, 443, 8080, 5432][(i % 4) as usize];
                v4.push(key(client, backend, sport, dport, 6));
                v4.push(key(backend, client, dport, sport, 6));
                let c6 = Ip6::from_bytes([0xfd, 0, 0x10, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, (i % 200) as u8, 0, (i / 200 % 250) as u8]);
                let b6 = Ip6::from_bytes([0xfd, 0, 0x10, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, (i % 13) as u8, 0, 9]);
                v6.push(key(c6, b6, sport, dport, 6));
                v6.push(key(b6, c6, dport, sport, 6));
            }
            let (got, uniform) = spread(&v4);
            assert!((got as f64) > 0.98 * uniform, "IPv4: {got} bits, a uniform hash gives {uniform:.0}");
            let (got, uniform) = spread(&v6);
            assert!((got as f64) > 0.98 * uniform, "IPv6: {got} bits, a uniform hash gives {uniform:.0}");
        }

        #[test]
        fn control_words_and_places() {
            assert_eq!((half(control(0)), half(control(1))), (Some(0), Some(1)));
            assert_eq!(half(0), None, "an unwritten control word says nothing");
            assert_eq!(half(u64::MAX), None, "nor all ones");
            assert_eq!(place(u64::MAX), (HALF_WORDS - 1, 1 << 63), "the last bit of a half");
            assert_eq!(place(0), (0, 1), "the first");
            assert_eq!(size_of::<CtFilter>(), 8 * (2 * HALF_WORDS + 1));
        }
    }
}

/// Values of `LB4_SVCCIDR_V1`: what kube-proxy's `cluster-ips-check` chain does with a new flow
/// to an address of a Service CIDR that no Service serves on that port and protocol.
pub mod svc_cidr {
    /// In no Service CIDR (what the datapath's lookup gives; never stored).
    pub const NONE: u8 = 0;
    /// A Service CIDR: the address is not allocated; a packet that would leave the node for it
    /// is dropped ("Drop traffic to unallocated ClusterIPs").
    pub const RANGE: u8 = 1;
    /// A cluster IP (a /32): allocated, but not on this port; rejected ("Reject traffic to
    /// invalid ports of ClusterIPs").
    pub const ALLOCATED: u8 = 2;
}

/// `__sk_buff.mark` of a `proxy-agent trace` packet. Together with arriving on loopback (where
/// the programs are never attached, but where BPF_PROG_TEST_RUN puts its packets) it makes
/// the external ingress program decide without side effects (no conntrack, affinity or counter
/// writes) and record its decision in `TRACE_V2`.
pub const TRACE_MARK: u32 = 0x7ace_0001;

/// Value of `TRACE_V2`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceResult {
    /// Incremented by every trace packet, so the caller knows the entry is its own.
    pub seq: u32,
    /// `Reason` of the decision.
    pub reason: u32,
    pub backend_id: u32,
    pub service_id: u32,
    /// Source the packet would leave with (SNAT), else zero.
    pub snat_addr: [u8; 4],
    /// Interface the packet would leave by (FIB lookup), else zero.
    pub ifindex: u32,
    /// The same as `snat_addr` for an IPv6 packet.
    pub snat_addr6: Ip6,
}
const _: () = assert!(size_of::<TraceResult>() == 40);

/// Key of `FRAG4_V1`: identifies the fragments of one datagram (RFC 791).
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub id: [u8; 2],
    pub proto: u8,
    pub _pad: u8,
}
const _: () = assert!(size_of::<FragKey>() == 12);

/// Key of `FRAG6_V1`: identifies the fragments of one IPv6 datagram (RFC 8200: addresses and
/// the 32-bit identification of its Fragment header).
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Frag6Key {
    pub saddr: Ip6,
    pub daddr: Ip6,
    pub id: [u8; 4],
    pub proto: u8,
    pub _pad: u8,
    pub _pad2: u16,
}
const _: () = assert!(size_of::<Frag6Key>() == 40);

/// Value of `FRAG4_V1` and `FRAG6_V1`: the ports the first fragment carried.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragPorts {
    pub sport: [u8; 2],
    pub dport: [u8; 2],
}
const _: () = assert!(size_of::<FragPorts>() == 4);

/// Value of the datapath's per-CPU clock cache: the coarse clock as of a jiffy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClockCache {
    pub jiffies: u64,
    pub ns: u64,
}
const _: () = assert!(size_of::<ClockCache>() == 16);

/// Value of `STATS_V1` (a per-CPU array indexed by `Reason`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}
const _: () = assert!(size_of::<Counter>() == 16);

macro_rules! reasons {
    ($($(#[$doc:meta])* $name:ident = $val:literal => $label:literal,)*) => {
        /// What the datapath did with a packet. Every packet is counted under exactly one reason.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Reason {
            $($(#[$doc])* $name = $val,)*
        }

        impl Reason {
            pub const ALL: &'static [Reason] = &[$(Reason::$name,)*];

            /// Stable snake_case label, used in metrics and `inspect`.
            pub const fn label(self) -> &'static str {
                match self {
                    $(Reason::$name => $label,)*
                }
            }
        }

        impl TryFrom<u32> for Reason {
            type Error = u32;
            fn try_from(v: u32) -> Result<Self, u32> {
                match v {
                    $($val => Ok(Reason::$name),)*
                    other => Err(other),
                }
            }
        }
    };
}

reasons! {
    /// Ingress: a new flow to a service: backend chosen, flow tracked, destination rewritten.
    NewFlow = 0 => "new_flow",
    /// Ingress: a packet of a tracked flow, destination rewritten.
    Established = 1 => "established",
    /// Ingress: a tracked flow whose backend was removed, sent to a live backend instead.
    Reselected = 2 => "reselected",
    /// Egress: a reply leaving towards its client, source restored to the service address.
    ReverseNat = 3 => "reverse_nat",
    /// Ingress: a non-first fragment of a translated datagram, translated like its first.
    FragmentNat = 4 => "fragment_nat",
    /// Ingress: not addressed to a service, not part of a tracked flow: left untouched.
    PassNotService = 5 => "pass_not_service",
    /// Not IPv4: left untouched.
    PassNotIpv4 = 6 => "pass_not_ipv4",
    /// A frame too short or an IPv4 header that is invalid (IHL < 5, truncated L4 header):
    /// left untouched for the kernel, which drops it.
    PassMalformed = 7 => "pass_malformed",
    /// Ingress: a service with no endpoints: answered with ICMP port unreachable, as
    /// kube-proxy REJECTs.
    RejectNoEndpoints = 8 => "reject_no_endpoints",
    /// Ingress: a service with no endpoints, for a packet that cannot be answered (a later
    /// fragment).
    DropNoEndpoints = 9 => "drop_no_endpoints",
    /// A later fragment whose first fragment was not translated here (not ours, or it arrived
    /// before its first fragment): its ports are unknown, so it is left untouched.
    PassFragmentUnknown = 10 => "pass_fragment_unknown",
    /// The conntrack map refused an insert.
    DropCtInsert = 11 => "drop_ct_insert",
    /// A rewrite helper failed; the packet may be half-written so it is dropped.
    DropRewrite = 12 => "drop_rewrite",
    /// Building the ICMP reply failed.
    DropRejectFailed = 13 => "drop_reject_failed",
    /// A slot named a backend id that is not in the backends map.
    DropBackendMissing = 14 => "drop_backend_missing",
    /// Ingress: a reply of a tracked flow, coming from its backend. The kernel routes it as
    /// is (so netfilter sees a plain pod-to-pod connection); egress translates it.
    ReplyIngress = 15 => "reply_ingress",
    /// Egress: leaving towards a pod, not a reply of a translated flow: untouched.
    EgressPass = 16 => "egress_pass",
    /// Egress: an ICMP error about a translated flow, rewritten to name the service address
    /// so the client's socket sees it (what nf_nat does for RELATED packets).
    IcmpErrorNat = 17 => "icmp_error_nat",
    /// Ingress: a Local traffic policy Service whose endpoints are all on other nodes: dropped,
    /// as kube-proxy does.
    DropNoLocalEndpoints = 18 => "drop_no_local_endpoints",
    /// External ingress: a new north-south flow to a backend on this node (DNAT only, the
    /// client's address is kept).
    ExtNewLocal = 19 => "ext_new_local",
    /// External ingress: a new north-south flow to a backend on another node (DNAT and SNAT to
    /// this node's address, sent on by FIB lookup).
    ExtNewRemote = 20 => "ext_new_remote",
    /// External ingress: a packet of a tracked north-south flow.
    ExtEstablished = 21 => "ext_established",
    /// External ingress: a reply from a remote backend, translated back to the client.
    ExtReply = 22 => "ext_reply",
    /// No source port left for SNAT towards that backend.
    DropSnatExhausted = 23 => "drop_snat_exhausted",
    /// No route to the backend or the client (FIB lookup failed).
    DropNoRoute = 24 => "drop_no_route",
    /// XDP: a north-south packet to a remote backend, translated and sent from XDP.
    XdpForward = 25 => "xdp_forward",
    /// XDP: a reply from a remote backend, translated and sent from XDP.
    XdpReply = 26 => "xdp_reply",
    /// XDP: left for TC (not north-south to a remote backend, or needs the stack).
    XdpPass = 27 => "xdp_pass",
    /// External ingress: a packet to a remote backend or a client whose TTL would expire on
    /// this hop: left to the kernel, which answers it with ICMP time exceeded.
    PassTtl = 28 => "pass_ttl",
    /// A new flow to a load-balancer IP from a source outside its loadBalancerSourceRanges:
    /// dropped, as kube-proxy's firewall chain does.
    DropSourceRange = 29 => "drop_source_range",
    /// A host-network socket's connect (or an unconnected UDP socket's first send) to a
    /// Service, sent straight to a backend by the socket hooks (counted once per socket and
    /// Service, 0 bytes).
    HostConnect = 30 => "host_connect",
    /// A host-network socket's connect or send to a Service without endpoints: refused
    /// (ECONNREFUSED), as kube-proxy's REJECT.
    HostReject = 31 => "host_reject",
    /// Ingress: a new flow whose client port was moved, because another flow from the same
    /// client address and port already reaches the same backend (through another Service
    /// address); as netfilter's NAT does, the translated tuples are kept apart.
    NewFlowPortNat = 32 => "new_flow_port_nat",
    /// Ingress: a TCP segment without SYN to a Service, with no tracked flow: its conntrack
    /// entry was lost (evicted from a full map by newer flows, or expired). It is balanced
    /// afresh; unless it reaches the same backend, its connection is reset. A rising count
    /// means `--ct-map-max` (conntrack.maxPerCore) is too small for the node's flows.
    NewFlowMidConnection = 33 => "new_flow_mid_connection",
    /// Egress: a packet about to leave for an address of a Service CIDR that no Service holds
    /// (nothing took it on the way: no other proxy, no local address): dropped, as kube-proxy's
    /// nftables mode drops traffic to unallocated cluster IPs, instead of following the default
    /// route.
    DropUnallocatedClusterIp = 34 => "drop_unallocated_cluster_ip",
    /// A new flow to a cluster IP on a port or protocol its Service does not have: answered
    /// with ICMP port unreachable (a host socket: ECONNREFUSED), as kube-proxy rejects it.
    RejectClusterIpPort = 35 => "reject_cluster_ip_port",
    /// A host-network socket's connect or send went to another backend of the Service than the
    /// first pick, whose tuple was taken: another connected socket on the same local port
    /// reaches that backend, or this unconnected socket reaches it for another Service.
    /// (netfilter's NAT would move the local port instead; a socket hook acts before there is
    /// a packet.)
    HostBackendMoved = 36 => "host_backend_moved",
    /// Not counted any more (a build before host flows were moved in TC counted here a
    /// host-network UDP connect it refused with EADDRNOTAVAIL because every backend's tuple was
    /// taken; such a connect now goes on, see `host_shared_backend`).
    HostPortClash = 37 => "host_port_clash",
    /// A host-network socket's connect or send to a Service left untranslated by the socket
    /// hooks, because every backend tried was taken: another connected socket on the same
    /// local port reaches it, or this unconnected socket reaches it for another Service. Its
    /// packets follow the node's route for the Service address, and TC egress translates
    /// them with a moved port (`host_flow_new`), as netfilter's NAT moves the port on such a
    /// clash.
    HostSharedBackend = 38 => "host_shared_backend",
    /// Egress: a packet of another protocol than TCP, UDP or ICMP (SCTP, GRE) to an allocated
    /// cluster IP, about to leave the node by the default route: dropped (kube-proxy's
    /// `cluster-ips-check` rejects every protocol; this dataplane serves TCP and UDP).
    DropClusterIpProtocol = 39 => "drop_cluster_ip_protocol",
    /// An IPv6 packet left untouched because its next stage could not run: the program's slot
    /// of `map_names::PROGS` is empty (the agent fills it at load; a restart between builds may
    /// leave it so for a moment), or the packet a new-flow stage found staged was another one.
    PassNoStage = 40 => "pass_no_stage",
    /// Egress: a new flow from a host-network process to a Service, which the socket hooks
    /// left untranslated (`host_shared_backend`, or no hooks attached): DNAT to a backend, the
    /// local port moved to one of `--snat-port-range` so the tuple at the backend is unique,
    /// and sent by the route to the backend.
    HostFlowNew = 41 => "host_flow_new",
    /// Egress: a packet of such a flow, translated the same way.
    HostFlow = 42 => "host_flow",
    /// Ingress (of a pod or an external interface): a backend's reply to such a flow,
    /// translated back (from the Service, to the process's own port) and delivered to the
    /// node's socket.
    HostReply = 43 => "host_reply",
    /// Egress: a host flow left to TC whose backend has no route past the stack (an address of
    /// the node itself, a host-network endpoint here, or no route at all): refused with port
    /// unreachable, which fails the process's call at once (ECONNREFUSED).
    RejectHostNoRoute = 44 => "reject_host_no_route",
    /// A packet of a connection that kube-proxy's rules translated and masqueraded before the
    /// takeover (`ct::owner::NETFILTER`): left untouched to the kernel, whose conntrack entry
    /// goes on translating it (its port is netfilter's choice) until it ends.
    PassNetfilter = 45 => "pass_netfilter",
    /// A packet of a connection the takeover adopted, either way, while its netfilter entry is
    /// being replaced (`ct::owner::HANDOVER`, about a millisecond): dropped, where translated it
    /// would meet that entry (TCP: reset; UDP: its port moved); TCP sends it again.
    DropHandover = 46 => "drop_handover",
    /// A TCP segment of a connection under way (no SYN) that no entry tracks, to a frontend
    /// served while a takeover may still adopt the connections kube-proxy's rules translated
    /// (`ct::ADOPTING_V4`): dropped rather than balanced afresh (reset unless it met the same
    /// backend); TCP sends it again, by then adopted.
    DropAdoptPending = 47 => "drop_adopt_pending",
}

/// Entries in `STATS_V1`; leaves room for new reasons without resizing the map. (A pin of
/// another size is replaced at load: it holds counters only.)
pub const REASON_SLOTS: u32 = 64;
const _: () = assert!((Reason::ALL.len() as u32) <= REASON_SLOTS);
