//! The pure translation layer: Kubernetes objects in, this node's view of its Services out.
//! Nothing here touches the kernel, so kube-proxy's semantics are unit-tested here.

pub mod addr;
pub mod endpoints;
pub mod store;
pub mod translate;
pub mod validate;

use std::{fmt, net::IpAddr};

pub use addr::{Cidr, Family};

/// A transport protocol as Kubernetes names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// Parses a `protocol` field; absent means TCP, as the API server defaults it.
    pub fn parse(s: Option<&str>) -> Result<Self, String> {
        match s.unwrap_or("TCP") {
            "TCP" => Ok(Self::Tcp),
            "UDP" => Ok(Self::Udp),
            "SCTP" => Ok(Self::Sctp),
            other => Err(format!("unsupported protocol {other:?} (expected TCP, UDP or SCTP)")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Sctp => "SCTP",
        }
    }

    /// The IP protocol number.
    pub fn ipproto(self) -> u8 {
        match self {
            Self::Tcp => proxy_common::IPPROTO_TCP,
            Self::Udp => proxy_common::IPPROTO_UDP,
            Self::Sctp => 132,
        }
    }

    pub fn from_ipproto(p: u8) -> Option<Self> {
        match p {
            proxy_common::IPPROTO_TCP => Some(Self::Tcp),
            proxy_common::IPPROTO_UDP => Some(Self::Udp),
            132 => Some(Self::Sctp),
            _ => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Namespace and name of an object, held as `namespace/name` in one string that every clone
/// shares: the store, the reconciler and the dataplanes keep a key per Service in several maps,
/// and with 30,000 Services two `String`s per copy were a fifth of the agent's memory. (An
/// `Arc<String>`, not an `Arc<str>`: a key of one word keeps those maps' tables smaller.) A
/// namespace is a DNS label, so the first '/' ends it. Ordered by (namespace, name), as the two
/// fields were.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ObjectKey(std::sync::Arc<String>);

impl ObjectKey {
    pub fn new(namespace: impl AsRef<str>, name: impl AsRef<str>) -> Self {
        let (namespace, name) = (namespace.as_ref(), name.as_ref());
        let mut text = String::with_capacity(namespace.len() + 1 + name.len());
        text.push_str(namespace);
        text.push('/');
        text.push_str(name);
        Self(std::sync::Arc::new(text))
    }

    fn parts(&self) -> (&str, &str) {
        self.0.split_once('/').unwrap_or(("", self.0.as_str()))
    }

    pub fn namespace(&self) -> &str {
        self.parts().0
    }

    pub fn name(&self) -> &str {
        self.parts().1
    }

    /// Whether the two are one allocation (not merely equal).
    #[cfg(test)]
    pub fn shares(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Ord for ObjectKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.parts().cmp(&other.parts())
    }
}

impl PartialOrd for ObjectKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectKey").field("namespace", &self.namespace()).field("name", &self.name()).finish()
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // No valid name is longer than 253; an invalid one is shown clipped.
        write!(f, "{}/{}", clip(self.namespace(), 253), clip(self.name(), 253))
    }
}

/// Adds `x` to the sorted `v` where it belongs, unless it is there already: the small sorted
/// sets the store and the reconciler keep per Service (nearly always one or two entries, where
/// a `BTreeSet` would allocate a node of hundreds of bytes).
pub fn insert_sorted<T: Ord>(v: &mut Vec<T>, x: T) {
    if let Err(at) = v.binary_search(&x) {
        // Room for one more, not the four (or double) a push makes: thousands of these live.
        v.reserve_exact(1);
        v.insert(at, x);
    }
}

/// `text`, or its first `max` characters and how long it was: what a log line quotes of
/// something a user or an API server wrote, however long that is.
pub fn clip(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    match text.char_indices().nth(max) {
        None => std::borrow::Cow::Borrowed(text),
        Some((at, _)) => std::borrow::Cow::Owned(format!("{}... ({} bytes in all)", &text[..at], text.len())),
    }
}

/// One port of one Service, as kube-proxy names it: `namespace/name:port-name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub service: ObjectKey,
    pub port: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}", self.service)
        } else {
            write!(f, "{}:{}", self.service, self.port)
        }
    }
}

/// Where clients send: address, port, protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrontendKey {
    pub addr: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for FrontendKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", std::net::SocketAddr::new(self.addr, self.port), self.protocol)
    }
}

/// An endpoint as the dataplane sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    pub addr: IpAddr,
    pub port: u16,
    pub terminating: bool,
    pub local: bool,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::net::SocketAddr::new(self.addr, self.port))
    }
}

/// How clients reach a frontend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrontendKind {
    /// A cluster IP: reached from inside the cluster only.
    #[default]
    ClusterIp,
    /// A node address and a nodePort.
    NodePort,
    /// A `status.loadBalancer.ingress` IP.
    LoadBalancer,
    /// A `spec.externalIPs` address.
    ExternalIp,
}

impl FrontendKind {
    /// Reached from outside the cluster: served on external interfaces too.
    pub fn is_external(self) -> bool {
        self != FrontendKind::ClusterIp
    }
}

/// What one frontend should do on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frontend {
    pub name: ServicePortName,
    pub kind: FrontendKind,
    /// Endpoints new flows are spread over, sorted. Empty: clients get "connection refused".
    pub backends: Vec<Backend>,
    /// Endpoints that take no new flows but keep the ones they have (not ready, terminating,
    /// or outside this node's topology), sorted.
    pub retained: Vec<Backend>,
    /// ClientIP session affinity timeout in seconds.
    pub affinity_timeout: Option<u32>,
    /// With no backends: drop (endpoints exist, but none this traffic may use: a Local policy
    /// with endpoints only on other nodes) instead of rejecting (no endpoints at all).
    pub drop_when_empty: bool,
    /// Set on external frontends of externalTrafficPolicy Local Services: the endpoints pods
    /// get when they reach this frontend (all of the Service's, as with kube-proxy), while
    /// `backends` holds the local ones outside clients get.
    pub internal_backends: Option<Vec<Backend>>,
    /// Load-balancer frontends of Services with `spec.loadBalancerSourceRanges`: new flows only
    /// from these sources (networks, sorted), from pods as from outside, as kube-proxy's
    /// firewall. Empty: no restriction.
    pub source_ranges: Vec<Cidr>,
}

impl Frontend {
    /// A frontend of `kind` for `name` with these backends and nothing else set.
    pub fn new(name: ServicePortName, kind: FrontendKind, backends: Vec<Backend>) -> Self {
        Self {
            name,
            kind,
            backends,
            retained: vec![],
            affinity_timeout: None,
            drop_when_empty: false,
            internal_backends: None,
            source_ranges: vec![],
        }
    }
}

/// This node's identity, as translation needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `topology.kubernetes.io/zone` of the Node object, once known.
    pub zone: Option<String>,
    /// Addresses NodePorts are served on (`--nodeport-addresses` applied), both families.
    pub nodeport_addresses: Vec<IpAddr>,
    /// The node's primary IPs, at most one per family (`bindAddress`, else the Node's first
    /// InternalIP of each family), which kube-proxy keeps apart from the NodePort addresses: a
    /// load balancer's source ranges admit the node when they hold one.
    pub node_ips: Vec<IpAddr>,
    /// NodePorts also on 127.0.0.1, for the node's own processes (the eBPF mode's socket hooks;
    /// kube-proxy's `localhostNodePorts`).
    pub localhost_nodeports: bool,
}

/// One endpoint of a service port as the dataplanes need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointView {
    pub addr: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub local: bool,
}

impl EndpointView {
    /// `ip:port` (`[ip]:port` for IPv6), as kube-proxy writes endpoints.
    pub fn socket(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::new(self.addr, self.port)
    }
}

/// The plan of one Service port in one address family, with everything a dataplane renders
/// from it: addresses, policies and the endpoint sets kube-proxy's `CategorizeEndpoints`
/// yields, all of that family (as kube-proxy gives each family's proxier its own view of a
/// dual-stack Service). The netfilter renderers (iptables, nftables, IPVS) make rules of it,
/// the eBPF dataplane frontends (`dataplane::ebpf::frontends`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortView {
    pub name: ServicePortName,
    pub family: Family,
    pub port: u16,
    pub cluster_ips: Vec<IpAddr>,
    pub node_port: Option<u16>,
    pub external_ips: Vec<IpAddr>,
    pub lb_ips: Vec<IpAddr>,
    pub internal_local: bool,
    /// externalTrafficPolicy Local (NodePort and LoadBalancer Services only).
    pub external_local: bool,
    /// `spec.loadBalancerSourceRanges`.
    pub lb_source_ranges: Vec<Cidr>,
    pub affinity_timeout: Option<u32>,
    pub health_check_node_port: Option<u16>,
    /// Endpoints for Cluster traffic policy (ready, or serving+terminating as a fallback;
    /// topology applied), in slice order.
    pub cluster_endpoints: Vec<EndpointView>,
    /// Endpoints for Local traffic policy.
    pub local_endpoints: Vec<EndpointView>,
    /// The Service has a usable endpoint somewhere (so "no local endpoint" drops rather than
    /// rejects).
    pub has_endpoints: bool,
    /// Every endpoint of the port, in slice order, whatever its conditions: those outside the
    /// chosen sets keep the flows they have (the eBPF dataplane's retained backends; netfilter
    /// leaves that to conntrack).
    pub endpoints: Vec<EndpointView>,
}

impl PortView {
    /// The addresses the port is reached on, node ports aside: its cluster, external and
    /// load-balancer IPs.
    pub fn service_ips(&self) -> impl Iterator<Item = &IpAddr> {
        self.cluster_ips.iter().chain(&self.external_ips).chain(&self.lb_ips)
    }

    /// A port reached on `cluster_ips` only, with `endpoints` for the Cluster policy and
    /// nothing else set.
    pub fn new(name: ServicePortName, family: Family, port: u16, cluster_ips: Vec<IpAddr>, endpoints: Vec<EndpointView>) -> Self {
        Self {
            name,
            family,
            port,
            cluster_ips,
            node_port: None,
            external_ips: vec![],
            lb_ips: vec![],
            internal_local: false,
            external_local: false,
            lb_source_ranges: vec![],
            affinity_timeout: None,
            health_check_node_port: None,
            has_endpoints: !endpoints.is_empty(),
            endpoints: endpoints.clone(),
            cluster_endpoints: endpoints,
            local_endpoints: vec![],
        }
    }

    /// Endpoints either policy may use: the ones rules are written for.
    pub fn reachable_endpoints(&self) -> Vec<EndpointView> {
        EndpointView::union(&self.cluster_endpoints, &self.local_endpoints)
    }
}

impl EndpointView {
    /// `a`, then those of `b` not in `a`. (Through a set: both may hold a Service's 20,000
    /// endpoints, and this runs for every port at every sync of the netfilter modes.)
    pub fn union(a: &[EndpointView], b: &[EndpointView]) -> Vec<EndpointView> {
        let mut v = a.to_vec();
        if b.is_empty() {
            return v;
        }
        let mut seen: std::collections::HashSet<EndpointView> = a.iter().copied().collect();
        v.extend(b.iter().filter(|e| seen.insert(**e)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::ObjectKey;

    #[test]
    fn an_object_key_orders_and_shows_as_namespace_then_name() {
        let k = ObjectKey::new("shop", "web");
        assert_eq!((k.namespace(), k.name(), k.to_string()), ("shop", "web", "shop/web".to_string()));
        let node = ObjectKey::new("", "node-1");
        assert_eq!((node.namespace(), node.name()), ("", "node-1"));
        // As strings "a-b/x" sorts before "a/x"; as (namespace, name) "a" comes first.
        let mut keys = [ObjectKey::new("a-b", "x"), ObjectKey::new("a", "x"), ObjectKey::new("a", "a"), node.clone()];
        keys.sort();
        let names: Vec<String> = keys.iter().map(ToString::to_string).collect();
        assert_eq!(names, ["/node-1", "a/a", "a/x", "a-b/x"]);
        assert_eq!(k.clone(), ObjectKey::new(String::from("shop"), "web"));
        assert_ne!(k, ObjectKey::new("shop", "web2"));
    }

    #[test]
    fn a_union_of_endpoints_keeps_the_first_list_then_what_the_second_adds_once() {
        use super::EndpointView;
        let ep = |last: u8, local: bool| EndpointView {
            addr: std::net::IpAddr::from([10, 244, 0, last]),
            port: 80,
            ready: true,
            serving: true,
            terminating: false,
            local,
        };
        let a = [ep(1, false), ep(2, true)];
        let b = [ep(2, true), ep(3, true), ep(3, true), ep(1, true)];
        assert_eq!(EndpointView::union(&a, &b), [ep(1, false), ep(2, true), ep(3, true), ep(1, true)]);
        assert_eq!(EndpointView::union(&a, &[]), a);
    }
}
