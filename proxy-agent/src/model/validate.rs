//! Checks Kubernetes objects the way the API server would, and turns them into checked, typed
//! values. A manifest directory has no API server in front of it, and even a real watch should
//! never let one bad object take the agent or other Services down: a rejected object is reported
//! with its name and the reason, and the caller keeps the previous good version.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fmt,
    net::IpAddr,
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use super::{endpoints::Endpoint, ObjectKey, Protocol};

/// Label that hands a Service to another proxy (KEP-2447); kube-proxy ignores such Services.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label on EndpointSlices of headless Services, which kube-proxy does not watch.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label that ties an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// When the endpoints controller saw the change a slice reflects; network programming latency
/// is measured from it.
pub const ANNOTATION_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// Cluster Autoscaler's taint on a node it is about to delete (kube-proxy's /healthz fails then).
pub const TAINT_TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";
/// Default ClientIP affinity timeout (3 hours), as the API server defaults it.
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;
const MAX_AFFINITY_TIMEOUT: i32 = 86_400;

/// Why an object was refused: every problem found, so the user can fix them in one go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub Vec<String>);

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("; "))
    }
}

impl std::error::Error for Invalid {}

/// Why a valid Service gets no frontends on this node (kube-proxy's `ShouldSkipService`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    ExternalName,
    Headless,
    OtherProxy,
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Skip::ExternalName => "type ExternalName is served by DNS, not by the proxy",
            Skip::Headless => "headless (clusterIP None) Services are served by DNS, not by the proxy",
            Skip::OtherProxy => "labelled service.kubernetes.io/service-proxy-name: handled by another proxy",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceType {
    ClusterIp,
    NodePort,
    LoadBalancer,
    ExternalName,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
    pub node_port: Option<u16>,
}

/// A Service that passed validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckedService {
    pub key: ObjectKey,
    pub skip: Option<Skip>,
    pub service_type: ServiceType,
    pub cluster_ips: Box<[IpAddr]>,
    pub ports: Box<[ServicePort]>,
    pub affinity_timeout: Option<u32>,
    pub internal_local: bool,
    pub external_local: bool,
    /// `spec.externalIPs`.
    pub external_ips: Box<[IpAddr]>,
    /// `status.loadBalancer.ingress[].ip`, without those in `ipMode: Proxy` (KEP-1860: the
    /// load balancer proxies, so traffic must reach it rather than be short-circuited).
    pub lb_ingress: Box<[IpAddr]>,
    /// `spec.healthCheckNodePort`, for LoadBalancer Services with externalTrafficPolicy Local.
    pub health_check_node_port: Option<u16>,
    /// `spec.loadBalancerSourceRanges` (both families), canonical (network address).
    pub lb_source_ranges: Box<[super::addr::Cidr]>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
}

/// An EndpointSlice that passed validation and belongs to a Service we serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckedSlice {
    pub key: ObjectKey,
    pub service: ObjectKey,
    /// `addressType`: every endpoint's address is of this family.
    pub family: super::Family,
    pub ports: Box<[SlicePort]>,
    pub endpoints: Box<[SliceEndpoint]>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, when present and valid.
    pub trigger_time: Option<std::time::SystemTime>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceEndpoint {
    pub addr: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Shared with every endpoint on that node (`Store::share_node_names`); an `Arc<String>`,
    /// one word, not an `Arc<str>`: 120,000 endpoints are 40 bytes each instead of 48.
    pub node_name: Option<std::sync::Arc<String>>,
    /// Topology hints, boxed: most endpoints carry none, and two empty sets inline take 48
    /// bytes of every endpoint held.
    pub hints: Option<Box<Hints>>,
}

/// An endpoint's topology hints (`hints.forZones`, `hints.forNodes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hints {
    pub zones: BTreeSet<String>,
    pub nodes: BTreeSet<String>,
}

impl SliceEndpoint {
    pub fn to_endpoint(&self, port: u16, node_name: &str) -> Endpoint {
        Endpoint {
            addr: self.addr,
            port,
            ready: self.ready,
            serving: self.serving,
            terminating: self.terminating,
            local: self.node_name.as_ref().is_some_and(|n| n.as_str() == node_name),
            zone_hints: self.hints.as_ref().map(|h| h.zones.clone()).unwrap_or_default(),
            node_hints: self.hints.as_ref().map(|h| h.nodes.clone()).unwrap_or_default(),
        }
    }
}

/// A valid EndpointSlice we do not use, and why (not an error).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SliceIgnored {
    Headless,
    /// FQDN slices: no proxy serves them.
    AddressType(String),
    NoServiceLabel,
}

impl fmt::Display for SliceIgnored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SliceIgnored::Headless => f.write_str("belongs to a headless Service"),
            SliceIgnored::AddressType(t) => write!(f, "addressType {t} is not served (kube-proxy ignores it too)"),
            SliceIgnored::NoServiceLabel => write!(
                f,
                "has no {LABEL_SERVICE_NAME} label, so it belongs to no Service; add the label \
                 to use it"
            ),
        }
    }
}

/// What the API server requires of a name (apimachinery's validation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameRule {
    /// RFC 1035 label: Service names.
    Dns1035Label,
    /// RFC 1123 label: namespaces.
    Dns1123Label,
    /// RFC 1123 subdomain: EndpointSlice and Node names.
    Dns1123Subdomain,
}

/// Why a named target port is not an IANA service name (what a container port's name must
/// be: at most 15 lower-case letters, digits and single '-', with a letter, not at an end).
fn port_name_problem(name: &str) -> Option<&'static str> {
    let b = name.as_bytes();
    if b.is_empty() || b.len() > 15 {
        Some("must be 1 to 15 characters")
    } else if !b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-') {
        Some("may hold only lower-case letters, digits and '-'")
    } else if !b.iter().any(u8::is_ascii_lowercase) {
        Some("must hold a letter")
    } else if b[0] == b'-' || b[b.len() - 1] == b'-' || name.contains("--") {
        Some("may not start or end with '-' or hold '--'")
    } else {
        None
    }
}

/// Why `name` breaks `rule`, if it does.
pub fn name_problem(name: &str, rule: NameRule) -> Option<String> {
    let label_ok = |l: &str, first_alpha: bool| {
        let b = l.as_bytes();
        !b.is_empty()
            && b.len() <= 63
            && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            && (if first_alpha { b[0].is_ascii_lowercase() } else { b[0].is_ascii_alphanumeric() })
            && b[b.len() - 1].is_ascii_alphanumeric()
    };
    let ok = match rule {
        NameRule::Dns1035Label => label_ok(name, true),
        NameRule::Dns1123Label => label_ok(name, false),
        NameRule::Dns1123Subdomain => name.len() <= 253 && name.split('.').all(|l| label_ok(l, false)),
    };
    (!ok).then(|| {
        let what = match rule {
            NameRule::Dns1035Label => "an RFC 1035 label (lower-case letters, digits and '-', starting with a letter, at most 63)",
            NameRule::Dns1123Label => "an RFC 1123 label (lower-case letters, digits and '-', at most 63)",
            NameRule::Dns1123Subdomain => "an RFC 1123 subdomain (lower-case labels joined by '.', at most 253)",
        };
        format!("{:?} is not {what}", super::clip(name, 253))
    })
}

/// The namespace and name an object is known by, as written.
pub fn names(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Result<(&str, &str), Invalid> {
    let Some(name) = meta.name.as_deref().filter(|n| !n.is_empty()) else {
        return Err(Invalid(vec!["metadata.name is missing".into()]));
    };
    // kubectl apply puts namespace-less objects in "default"; do the same.
    Ok((meta.namespace.as_deref().filter(|n| !n.is_empty()).unwrap_or("default"), name))
}

pub fn object_key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Result<ObjectKey, Invalid> {
    let (namespace, name) = names(meta)?;
    Ok(ObjectKey::new(namespace, name))
}

/// `object_key`, and the name and namespace checked as the API server checks them.
fn checked_key(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    rule: NameRule,
    errs: &mut Vec<String>,
) -> Result<ObjectKey, Invalid> {
    // The fields as written, not the key's parts: a '/' in a namespace would move the split.
    let (namespace, name) = names(meta)?;
    if let Some(p) = name_problem(name, rule) {
        errs.push(format!("metadata.name {p}"));
    }
    if let Some(p) = name_problem(namespace, NameRule::Dns1123Label) {
        errs.push(format!("metadata.namespace {p}"));
    }
    Ok(ObjectKey::new(namespace, name))
}

/// What the API server enforces that depends on its configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rules {
    /// `--service-node-port-range` (inclusive). None: not checked (objects from an API server
    /// were checked against the range it has, which the agent need not know).
    pub node_port_range: Option<(u16, u16)>,
}

/// The API server's default NodePort range.
pub const DEFAULT_NODE_PORT_RANGE: (u16, u16) = (30000, 32767);

impl Default for Rules {
    fn default() -> Self {
        Self { node_port_range: Some(DEFAULT_NODE_PORT_RANGE) }
    }
}

impl Rules {
    fn outside(&self, port: i32) -> Option<String> {
        let (lo, hi) = self.node_port_range?;
        (port < i32::from(lo) || port > i32::from(hi))
            .then(|| format!("is outside the NodePort range {lo}-{hi} (--service-node-port-range)"))
    }
}

/// Why an address cannot be a Service's (cluster IP, external IP) or an endpoint's, if it
/// cannot: addresses the API server refuses for both (ValidateEndpointIP and the Service
/// checks), which no node can route to (unspecified, loopback, multicast, broadcast,
/// link-local). The node's own address is allowed for endpoints: hostNetwork pods' are.
fn special_ip(a: IpAddr) -> Option<&'static str> {
    match a {
        IpAddr::V4(v) if v.is_unspecified() => Some("unspecified"),
        IpAddr::V4(v) if v.is_loopback() => Some("a loopback address"),
        IpAddr::V4(v) if v.is_multicast() => Some("a multicast address"),
        IpAddr::V4(v) if v.is_broadcast() => Some("the broadcast address"),
        IpAddr::V4(v) if v.is_link_local() => Some("a link-local address"),
        IpAddr::V6(v) if v.is_unspecified() => Some("unspecified"),
        IpAddr::V6(v) if v.is_loopback() => Some("a loopback address"),
        IpAddr::V6(v) if v.is_multicast() => Some("a multicast address"),
        a if super::addr::is_v6_link_local(a) => Some("a link-local address"),
        _ => None,
    }
}

/// Of `special_ip`'s addresses, the ones the API server refuses as external IPs too
/// (ValidateNonSpecialIP: unspecified, loopback, link-local unicast and link-local multicast).
/// It lets other multicast addresses and the broadcast address in: such a Service is served
/// without that address (`Store::translate_on` notes it). kube-proxy writes rules for them
/// too; leaving them out is deliberate (a Service at the broadcast address would take every
/// node's broadcasts to its port).
fn refused_external_ip(a: IpAddr) -> Option<&'static str> {
    let link_local_multicast = match a {
        IpAddr::V4(v) => v.octets()[..3] == [224, 0, 0],
        IpAddr::V6(v) => v.octets()[0] == 0xff && v.octets()[1] & 0x0f == 0x02,
    };
    match special_ip(a) {
        Some(_) if a.is_multicast() && !link_local_multicast => None,
        Some(_) if a == IpAddr::V4(std::net::Ipv4Addr::BROADCAST) => None,
        why => why,
    }
}

/// Why an external IP the API server accepts cannot be served (a multicast or the broadcast
/// address), if it cannot.
pub fn unservable_external_ip(a: IpAddr) -> Option<&'static str> {
    special_ip(a)
}

fn port_number(v: i32, field: &str, errs: &mut Vec<String>) -> u16 {
    match u16::try_from(v) {
        Ok(p) if p != 0 => p,
        _ => {
            errs.push(format!("{field} {v} is out of range 1-65535"));
            0
        }
    }
}

fn ip(s: &str, field: &str, errs: &mut Vec<String>) -> Option<IpAddr> {
    let a = super::addr::parse_ip(s);
    if a.is_none() {
        errs.push(format!("{field} {s:?} is not a valid IP address"));
    }
    a
}

pub fn service(svc: &Service) -> Result<CheckedService, Invalid> {
    service_with(svc, &Rules::default())
}

pub fn service_with(svc: &Service, rules: &Rules) -> Result<CheckedService, Invalid> {
    let mut errs = Vec::new();
    let key = checked_key(&svc.metadata, NameRule::Dns1035Label, &mut errs)?;
    let spec = svc.spec.clone().unwrap_or_default();
    let service_type = match spec.type_.as_deref().unwrap_or("ClusterIP") {
        "ClusterIP" => ServiceType::ClusterIp,
        "NodePort" => ServiceType::NodePort,
        "LoadBalancer" => ServiceType::LoadBalancer,
        "ExternalName" => ServiceType::ExternalName,
        other => {
            errs.push(format!("spec.type {other:?} is not one of ClusterIP, NodePort, LoadBalancer, ExternalName"));
            ServiceType::ClusterIp
        }
    };
    let labels = svc.metadata.labels.clone().unwrap_or_default();
    let cluster_ip = spec.cluster_ip.clone().unwrap_or_default();
    let mut skip = if labels.contains_key(LABEL_SERVICE_PROXY_NAME) {
        Some(Skip::OtherProxy)
    } else if service_type == ServiceType::ExternalName {
        Some(Skip::ExternalName)
    } else if cluster_ip.is_empty() || cluster_ip == "None" {
        Some(Skip::Headless)
    } else {
        None
    };
    let families = spec.ip_families.clone().unwrap_or_default();
    for (i, f) in families.iter().enumerate() {
        if f != "IPv4" && f != "IPv6" {
            errs.push(format!("spec.ipFamilies[{i}] {f:?} is not IPv4 or IPv6"));
        } else if families[..i].contains(f) {
            errs.push(format!("spec.ipFamilies[{i}] {f} is listed twice"));
        }
    }
    if let Some(p) = spec.ip_family_policy.as_deref() {
        if !matches!(p, "SingleStack" | "PreferDualStack" | "RequireDualStack") {
            errs.push(format!("spec.ipFamilyPolicy {p:?} is not SingleStack, PreferDualStack or RequireDualStack"));
        }
    }
    if service_type == ServiceType::ExternalName {
        // The API server's rules for ExternalName; nothing else of such a Service matters to a
        // proxy.
        if !cluster_ip.is_empty() {
            errs.push(format!("spec.clusterIP {cluster_ip:?} may not be set for ExternalName Services"));
        }
        match spec.external_name.as_deref().map(|n| n.strip_suffix('.').unwrap_or(n)) {
            None | Some("") => errs.push("spec.externalName is required for ExternalName Services".into()),
            Some(n) => {
                if let Some(p) = name_problem(n, NameRule::Dns1123Subdomain) {
                    errs.push(format!("spec.externalName {p}"));
                }
            }
        }
        return if errs.is_empty() {
            Ok(CheckedService {
                key,
                skip,
                service_type,
                cluster_ips: Box::default(),
                ports: Box::default(),
                affinity_timeout: None,
                internal_local: false,
                external_local: false,
                external_ips: Box::default(),
                lb_ingress: Box::default(),
                health_check_node_port: None,
                lb_source_ranges: Box::default(),
            })
        } else {
            Err(Invalid(errs))
        };
    }

    let mut cluster_ips = Vec::new();
    if skip != Some(Skip::Headless) {
        let listed = spec.cluster_ips.clone().unwrap_or_default();
        if let Some(first) = listed.first() {
            if *first != cluster_ip {
                errs.push(format!("spec.clusterIPs[0] {first:?} must equal spec.clusterIP {cluster_ip:?}"));
            }
        }
        let all = if listed.is_empty() { vec![cluster_ip.clone()] } else { listed };
        for (i, s) in all.iter().enumerate() {
            if let Some(a) = ip(s, &format!("spec.clusterIPs[{i}]"), &mut errs) {
                match special_ip(a) {
                    Some(why) => errs.push(format!("spec.clusterIPs[{i}] {a} is {why}")),
                    None => cluster_ips.push(a),
                }
            }
        }
    }

    let ports_in = spec.ports.clone().unwrap_or_default();
    let mut ports = Vec::new();
    let mut names = HashSet::new();
    let mut seen = HashSet::new();
    for (i, p) in ports_in.iter().enumerate() {
        let name = p.name.clone().unwrap_or_default();
        if ports_in.len() > 1 && name.is_empty() {
            errs.push(format!("spec.ports[{i}].name is required when a Service has several ports"));
        }
        if !name.is_empty() && !names.insert(name.clone()) {
            errs.push(format!("spec.ports[{i}].name {name:?} is used twice"));
        }
        if let Some(p) = (!name.is_empty()).then(|| name_problem(&name, NameRule::Dns1123Label)).flatten() {
            errs.push(format!("spec.ports[{i}].name {p}"));
        }
        let port = port_number(p.port, &format!("spec.ports[{i}].port"), &mut errs);
        let protocol = Protocol::parse(p.protocol.as_deref())
            .map_err(|e| errs.push(format!("spec.ports[{i}].protocol: {e}")))
            .unwrap_or(Protocol::Tcp);
        if !seen.insert((port, protocol)) {
            errs.push(format!("spec.ports[{i}]: port {port}/{protocol} is listed twice"));
        }
        let node_port = match p.node_port {
            None | Some(0) => None,
            Some(np) => match rules.outside(np) {
                Some(why) => {
                    errs.push(format!("spec.ports[{i}].nodePort {np} {why}"));
                    None
                }
                None => Some(port_number(np, &format!("spec.ports[{i}].nodePort"), &mut errs)),
            },
        };
        match &p.target_port {
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(t)) => {
                port_number(*t, &format!("spec.ports[{i}].targetPort"), &mut errs);
            }
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(t)) => {
                if let Some(why) = port_name_problem(t) {
                    errs.push(format!("spec.ports[{i}].targetPort {:?} {why}", super::clip(t, 64)));
                }
            }
            None => {}
        }
        ports.push(ServicePort { name, port, protocol, node_port });
    }

    if ports_in.is_empty() && skip != Some(Skip::Headless) {
        errs.push("spec.ports is required (only headless Services may have none)".into());
    }

    let affinity_timeout = match spec.session_affinity.as_deref().unwrap_or("None") {
        "None" => None,
        "ClientIP" => {
            let t = spec.session_affinity_config.as_ref().and_then(|c| c.client_ip.as_ref()).and_then(|c| c.timeout_seconds);
            match t {
                None => Some(DEFAULT_AFFINITY_TIMEOUT),
                Some(t) if (1..=MAX_AFFINITY_TIMEOUT).contains(&t) => Some(t as u32),
                Some(t) => {
                    errs.push(format!("spec.sessionAffinityConfig.clientIP.timeoutSeconds {t} is out of range 1-{MAX_AFFINITY_TIMEOUT}"));
                    None
                }
            }
        }
        other => {
            errs.push(format!("spec.sessionAffinity {other:?} is not None or ClientIP"));
            None
        }
    };
    let policy = |v: Option<&str>, field: &str, errs: &mut Vec<String>| match v.unwrap_or("Cluster") {
        "Cluster" => false,
        "Local" => true,
        other => {
            errs.push(format!("{field} {other:?} is not Cluster or Local"));
            false
        }
    };
    let internal_local = policy(spec.internal_traffic_policy.as_deref(), "spec.internalTrafficPolicy", &mut errs);
    let external_local = policy(spec.external_traffic_policy.as_deref(), "spec.externalTrafficPolicy", &mut errs);
    let external_ips: Vec<IpAddr> = spec
        .external_ips
        .iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, s)| {
            let a = ip(s, &format!("spec.externalIPs[{i}]"), &mut errs)?;
            match refused_external_ip(a) {
                Some(why) => {
                    errs.push(format!("spec.externalIPs[{i}] {a} is {why}"));
                    None
                }
                None => Some(a),
            }
        })
        .collect();
    let lb_source_ranges: Vec<super::addr::Cidr> = spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, r)| {
            // Each family's proxier uses the ranges of its family.
            match r.trim().parse::<super::addr::Cidr>() {
                Ok(c) => Some(c.network()),
                Err(e) => {
                    errs.push(format!("spec.loadBalancerSourceRanges[{i}]: {e}"));
                    None
                }
            }
        })
        .collect();
    let health_check_node_port = match spec.health_check_node_port {
        None | Some(0) => None,
        Some(p) => match rules.outside(p) {
            Some(why) => {
                errs.push(format!("spec.healthCheckNodePort {p} {why}"));
                None
            }
            None => Some(port_number(p, "spec.healthCheckNodePort", &mut errs)),
        },
    };
    // Status is written by a load-balancer controller; an entry we cannot use is skipped, not
    // a reason to refuse the whole Service.
    let lb_ingress: Vec<IpAddr> = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter(|i| i.ip_mode.as_deref() != Some("Proxy"))
        .filter_map(|i| super::addr::parse_ip(i.ip.as_deref()?))
        .filter(|a| special_ip(*a).is_none())
        .collect();

    if !errs.is_empty() {
        return Err(Invalid(errs));
    }
    if skip.is_none() && cluster_ips.is_empty() {
        skip = Some(Skip::Headless);
    }
    Ok(CheckedService {
        key,
        skip,
        service_type,
        cluster_ips: exact(cluster_ips),
        ports: exact(ports),
        affinity_timeout,
        internal_local,
        external_local,
        external_ips: exact(external_ips),
        lb_ingress: exact(lb_ingress),
        health_check_node_port,
        lb_source_ranges: exact(lb_source_ranges),
    })
}

/// `v` without spare room, and without a Vec's capacity field. A checked object is kept for as
/// long as the object exists, 30,000 and more of them, and a Vec grown by pushes or collected
/// from a filter holds room for four.
fn exact<T>(v: Vec<T>) -> Box<[T]> {
    v.into_boxed_slice()
}

/// Checks a ServiceCIDR (`networking.k8s.io/v1`) as the API server does (at most two ranges,
/// one per family, each valid) and returns its ranges.
pub fn service_cidr(obj: &k8s_openapi::api::networking::v1::ServiceCIDR) -> Result<Vec<super::addr::Cidr>, Invalid> {
    let mut errs = Vec::new();
    checked_key(&obj.metadata, NameRule::Dns1123Subdomain, &mut errs)?;
    let listed = obj.spec.as_ref().and_then(|s| s.cidrs.clone()).unwrap_or_default();
    if listed.is_empty() {
        errs.push("spec.cidrs is required".into());
    }
    if listed.len() > 2 {
        errs.push(format!("spec.cidrs holds {} ranges; at most two (one per family)", listed.len()));
    }
    let mut out = Vec::new();
    let mut families = Vec::new();
    for (i, c) in listed.iter().enumerate() {
        match super::addr::parse_cidr(c) {
            None => errs.push(format!("spec.cidrs[{i}] {:?} is not a CIDR", super::clip(c, 64))),
            Some((a, _)) if families.contains(&a.is_ipv4()) => errs.push(format!("spec.cidrs[{i}] {c}: a second range of the same family")),
            Some((a, prefix)) => {
                families.push(a.is_ipv4());
                out.push(super::addr::Cidr { addr: a, prefix }.network());
            }
        }
    }
    if errs.is_empty() {
        Ok(out)
    } else {
        Err(Invalid(errs))
    }
}

/// Checks an EndpointSlice. `Ok(Err(_))` is a valid slice this proxy does not use.
pub fn endpoint_slice(slice: &EndpointSlice) -> Result<Result<CheckedSlice, SliceIgnored>, Invalid> {
    let mut errs = Vec::new();
    let key = checked_key(&slice.metadata, NameRule::Dns1123Subdomain, &mut errs)?;
    let labels = slice.metadata.labels.clone().unwrap_or_default();
    let family = match slice.address_type.as_str() {
        "IPv4" => super::Family::V4,
        "IPv6" => super::Family::V6,
        "FQDN" => return Ok(Err(SliceIgnored::AddressType(slice.address_type.clone()))),
        other => return Err(Invalid(vec![format!("addressType {other:?} is unknown (expected IPv4, IPv6 or FQDN)")])),
    };
    let mut ports = Vec::new();
    let mut port_names = HashSet::new();
    for (i, p) in slice.ports.iter().flatten().enumerate() {
        let name = p.name.clone().unwrap_or_default();
        if !port_names.insert(name.clone()) {
            errs.push(format!("ports[{i}].name {name:?} is used twice"));
        }
        if let Some(p) = (!name.is_empty()).then(|| name_problem(&name, NameRule::Dns1123Label)).flatten() {
            errs.push(format!("ports[{i}].name {p}"));
        }
        let protocol =
            Protocol::parse(p.protocol.as_deref()).map_err(|e| errs.push(format!("ports[{i}].protocol: {e}"))).unwrap_or(Protocol::Tcp);
        // A port without a number means "all ports", which Services cannot express; kube-proxy
        // skips it too.
        if let Some(n) = p.port {
            let port = port_number(n, &format!("ports[{i}].port"), &mut errs);
            ports.push(SlicePort { name: p.name.clone().unwrap_or_default(), port, protocol });
        }
    }
    // Sized once: a slice holds up to 100 endpoints, and a grown Vec keeps up to twice that.
    let mut endpoints = Vec::with_capacity(slice.endpoints.as_ref().map_or(0, Vec::len));
    for (i, e) in slice.endpoints.iter().flatten().enumerate() {
        // kube-proxy uses the first address of an endpoint; the API requires all to be valid.
        let mut first = None;
        if e.addresses.is_empty() {
            errs.push(format!("endpoints[{i}].addresses is empty"));
        }
        for (j, a) in e.addresses.iter().enumerate() {
            match super::addr::parse_ip(a) {
                Some(addr) if super::Family::of(addr) == family => match special_ip(addr) {
                    Some(why) => errs.push(format!("endpoints[{i}].addresses[{j}] {addr} is {why}")),
                    None => {
                        first.get_or_insert(addr);
                    }
                },
                _ => errs.push(format!(
                    "endpoints[{i}].addresses[{j}] {:?} is not an {family} address (addressType {family})",
                    super::clip(a, 64)
                )),
            }
        }
        let Some(addr) = first else { continue };
        let c = e.conditions.clone().unwrap_or_default();
        // As kube-proxy reads them: nil ready and nil serving mean true, nil terminating false.
        let ready = c.ready.unwrap_or(true);
        let hints = e.hints.clone().unwrap_or_default();
        endpoints.push(SliceEndpoint {
            addr,
            ready,
            serving: c.serving.unwrap_or(true),
            terminating: c.terminating.unwrap_or(false),
            node_name: e.node_name.clone().map(std::sync::Arc::new),
            hints: Some(Hints {
                zones: hints.for_zones.iter().flatten().map(|z| z.name.clone()).collect(),
                nodes: hints.for_nodes.iter().flatten().map(|n| n.name.clone()).collect(),
            })
            .filter(|h| !h.zones.is_empty() || !h.nodes.is_empty())
            .map(Box::new),
        });
    }
    if !errs.is_empty() {
        return Err(Invalid(errs));
    }
    if labels.contains_key(LABEL_HEADLESS) {
        return Ok(Err(SliceIgnored::Headless));
    }
    let Some(svc) = labels.get(LABEL_SERVICE_NAME).filter(|s| !s.is_empty()) else {
        return Ok(Err(SliceIgnored::NoServiceLabel));
    };
    let service = ObjectKey::new(key.namespace(), svc.clone());
    let trigger_time = slice
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_TRIGGER_TIME))
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
        .map(std::time::SystemTime::from);
    Ok(Ok(CheckedSlice { key, service, family, ports: exact(ports), endpoints: exact(endpoints), trigger_time }))
}

/// A Node as the proxy needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckedNode {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// The first InternalIP of each family in `status.addresses`: the "primary" addresses of
    /// `--nodeport-addresses primary`.
    pub internal_ips: Vec<IpAddr>,
    /// `spec.podCIDRs`: this node's pods' ranges, for `detectLocalMode NodeCIDR`.
    pub pod_cidrs: Vec<super::addr::Cidr>,
    /// Being deleted, or tainted for deletion by the Cluster Autoscaler: kube-proxy reports the
    /// node ineligible on /healthz so load balancers drain it.
    pub deleting: bool,
}

pub fn node(n: &Node) -> Result<CheckedNode, Invalid> {
    let name = n.metadata.name.clone().filter(|s| !s.is_empty());
    let Some(name) = name else {
        return Err(Invalid(vec!["metadata.name is missing".into()]));
    };
    if let Some(p) = name_problem(&name, NameRule::Dns1123Subdomain) {
        return Err(Invalid(vec![format!("metadata.name {p}")]));
    }
    let tainted = n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == TAINT_TO_BE_DELETED));
    let mut internal_ips: Vec<IpAddr> = Vec::new();
    let listed = n.status.as_ref().and_then(|s| s.addresses.as_ref()).into_iter().flatten();
    for a in listed.filter(|a| a.type_ == "InternalIP").filter_map(|a| super::addr::parse_ip(&a.address)) {
        if !internal_ips.iter().any(|b| super::Family::of(*b) == super::Family::of(a)) {
            internal_ips.push(a);
        }
    }
    let spec = n.spec.as_ref();
    let pod_cidrs = spec
        .and_then(|s| s.pod_cidrs.clone())
        .or_else(|| spec.and_then(|s| s.pod_cidr.clone()).map(|c| vec![c]))
        .unwrap_or_default()
        .iter()
        .filter_map(|c| c.parse().ok())
        .collect();
    Ok(CheckedNode {
        name,
        labels: n.metadata.labels.clone().unwrap_or_default(),
        internal_ips,
        pod_cidrs,
        deleting: n.metadata.deletion_timestamp.is_some() || tainted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(yaml: &str) -> Service {
        serde_yaml::from_str(yaml).expect("test YAML parses")
    }

    fn slice(yaml: &str) -> EndpointSlice {
        serde_yaml::from_str(yaml).expect("test YAML parses")
    }

    #[test]
    fn valid_service_is_checked_and_defaulted() {
        let s = service(&svc("metadata: {name: web}\nspec:\n  clusterIP: 10.96.0.10\n  ports:\n  - {port: 80}\n")).unwrap();
        assert_eq!(s.key, ObjectKey::new("default", "web"));
        assert_eq!(s.skip, None);
        assert_eq!(s.cluster_ips.to_vec(), vec!["10.96.0.10".parse::<IpAddr>().unwrap()]);
        assert_eq!(s.ports.to_vec(), vec![ServicePort { name: "".into(), port: 80, protocol: Protocol::Tcp, node_port: None }]);
        assert_eq!(s.affinity_timeout, None);
    }

    #[test]
    fn skipped_services() {
        let cases = [
            ("spec: {type: ExternalName, externalName: example.com}", Skip::ExternalName),
            ("spec: {clusterIP: None, ports: [{port: 80}]}", Skip::Headless),
            ("spec: {clusterIP: '', ports: [{port: 80}]}", Skip::Headless),
            ("spec: {ports: [{port: 80}]}", Skip::Headless),
        ];
        for (spec, want) in cases {
            let s = service(&svc(&format!("metadata: {{name: a, namespace: n}}\n{spec}"))).unwrap();
            assert_eq!(s.skip, Some(want), "{spec}");
        }
        let labelled = service(&svc(
            "metadata: {name: a, labels: {service.kubernetes.io/service-proxy-name: other}}\nspec: {clusterIP: 10.0.0.1, ports: [{port: 80}]}",
        ))
        .unwrap();
        assert_eq!(labelled.skip, Some(Skip::OtherProxy));
    }

    #[test]
    fn invalid_services_name_every_problem() {
        let cases = [
            ("spec: {clusterIP: 10.0.0.300, ports: [{port: 80}]}", "spec.clusterIPs[0] \"10.0.0.300\" is not a valid IP address"),
            ("spec: {clusterIP: 10.0.0.1, ports: [{port: 0}]}", "spec.ports[0].port 0 is out of range 1-65535"),
            ("spec: {clusterIP: 10.0.0.1, ports: [{port: 70000}]}", "spec.ports[0].port 70000 is out of range 1-65535"),
            ("spec: {clusterIP: 10.0.0.1, ports: [{port: 80, protocol: ICMP}]}", "spec.ports[0].protocol: unsupported protocol \"ICMP\""),
            ("spec: {clusterIP: 10.0.0.1, ports: [{port: 80, name: a}, {port: 81}]}", "spec.ports[1].name is required"),
            ("spec: {clusterIP: 10.0.0.1, ports: [{port: 80, name: a}, {port: 81, name: a}]}", "spec.ports[1].name \"a\" is used twice"),
            ("spec: {clusterIP: 10.0.0.1, ports: [{port: 80, targetPort: 0}]}", "spec.ports[0].targetPort 0 is out of range"),
            ("spec: {clusterIP: 10.0.0.1, sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}, ports: [{port: 80}]}", "timeoutSeconds 0 is out of range"),
            ("spec: {clusterIP: 10.0.0.1, type: Weird, ports: [{port: 80}]}", "spec.type \"Weird\""),
            ("spec: {clusterIP: 10.0.0.1, internalTrafficPolicy: Nearby, ports: [{port: 80}]}", "spec.internalTrafficPolicy \"Nearby\""),
            ("spec: {clusterIP: 10.0.0.1, clusterIPs: [10.0.0.2], ports: [{port: 80}]}", "must equal spec.clusterIP"),
            // What the API server never allocates nor accepts.
            ("spec: {clusterIP: 0.0.0.0, ports: [{port: 80}]}", "spec.clusterIPs[0] 0.0.0.0 is unspecified"),
            ("spec: {clusterIP: 127.0.0.1, ports: [{port: 80}]}", "is a loopback address"),
            ("spec: {clusterIP: 224.0.0.5, ports: [{port: 80}]}", "is a multicast address"),
            ("spec: {clusterIP: 255.255.255.255, ports: [{port: 80}]}", "is the broadcast address"),
            ("spec: {clusterIP: 10.0.0.1, externalIPs: [127.0.0.2], ports: [{port: 80}]}", "spec.externalIPs[0] 127.0.0.2 is a loopback address"),
            ("spec: {clusterIP: 10.0.0.1, externalIPs: [224.0.0.251], ports: [{port: 80}]}", "224.0.0.251 is a multicast address"),
            ("spec: {clusterIP: 10.0.0.1, externalIPs: ['ff02::fb'], ports: [{port: 80}]}", "ff02::fb is a multicast address"),
            ("spec: {clusterIP: 10.0.0.1, externalIPs: [169.254.169.254], ports: [{port: 80}]}", "is a link-local address"),
            ("spec: {clusterIP: 10.0.0.1, type: NodePort, ports: [{port: 80, nodePort: 22}]}", "nodePort 22 is outside the NodePort range 30000-32767"),
            ("spec: {clusterIP: 10.0.0.1, type: LoadBalancer, healthCheckNodePort: 10256, ports: [{port: 80}]}", "spec.healthCheckNodePort 10256 is outside"),
            // Port names, named target ports, ports at all, families, ExternalName.
            ("spec: {clusterIP: 10.0.0.1, ports: [{port: 80, name: Http}]}", "spec.ports[0].name \"Http\" is not an RFC 1123 label"),
            ("spec: {clusterIP: 10.0.0.1, ports: [{port: 80, targetPort: web--port}]}", "spec.ports[0].targetPort \"web--port\" may not start or end"),
            ("spec: {clusterIP: 10.0.0.1, ports: [{port: 80, targetPort: a-very-long-port-name}]}", "must be 1 to 15 characters"),
            ("spec: {clusterIP: 10.0.0.1, ports: [{port: 80, targetPort: '8080'}]}", "must hold a letter"),
            ("spec: {clusterIP: 10.0.0.1, ports: []}", "spec.ports is required"),
            ("spec: {clusterIP: 10.0.0.1}", "spec.ports is required"),
            ("spec: {clusterIP: 10.0.0.1, ipFamilies: [IPv4, IPv4], ports: [{port: 80}]}", "spec.ipFamilies[1] IPv4 is listed twice"),
            ("spec: {clusterIP: 10.0.0.1, ipFamilies: [IPv5], ports: [{port: 80}]}", "spec.ipFamilies[0] \"IPv5\" is not IPv4 or IPv6"),
            ("spec: {clusterIP: 10.0.0.1, ipFamilyPolicy: Sometimes, ports: [{port: 80}]}", "spec.ipFamilyPolicy \"Sometimes\""),
            ("spec: {type: ExternalName, clusterIP: 10.0.0.1, externalName: db.example.com}", "may not be set for ExternalName"),
            ("spec: {type: ExternalName}", "spec.externalName is required"),
            ("spec: {type: ExternalName, externalName: 'not a name'}", "spec.externalName \"not a name\""),
        ];
        for (spec, want) in cases {
            let err = service(&svc(&format!("metadata: {{name: a}}\n{spec}"))).unwrap_err();
            assert!(err.to_string().contains(want), "{spec}: got {err}, want it to mention {want}");
        }
        // External IPs the API server lets in (ValidateNonSpecialIP): the Service is taken, and
        // the store leaves them out with a note.
        for ip in ["239.1.2.3", "255.255.255.255", "ff05::2"] {
            let spec = format!("metadata: {{name: a}}\nspec: {{clusterIP: 10.0.0.1, externalIPs: ['{ip}'], ports: [{{port: 80}}]}}");
            assert!(service(&svc(&spec)).is_ok(), "{ip} passes the API server, so the Service is not refused");
        }
        assert_eq!(service(&svc("metadata: {namespace: x}\nspec: {}")).unwrap_err().to_string(), "metadata.name is missing");
        let named = |meta: &str| service(&svc(&format!("metadata: {meta}\nspec: {{clusterIP: 10.0.0.1, ports: [{{port: 80}}]}}")));
        assert!(named("{name: Web_1}").unwrap_err().to_string().contains("metadata.name \"Web_1\" is not an RFC 1035 label"));
        assert!(named("{name: 1web}").is_err(), "a Service name starts with a letter");
        assert!(named("{name: web, namespace: Prod!}").unwrap_err().to_string().contains("metadata.namespace"));
        // A key holds "namespace/name": a '/' is still blamed on the field that has it.
        let e = named("{name: web, namespace: a/b}").unwrap_err().to_string();
        assert!(e.contains("metadata.namespace \"a/b\"") && !e.contains("metadata.name "), "{e}");
        assert!(named(&format!("{{name: {}}}", "a".repeat(64))).is_err(), "at most 63");
        assert!(named("{name: web-1, namespace: team-a}").is_ok());
        // A wider range, as an API server configured so allows.
        let wide = Rules { node_port_range: None };
        assert!(service_with(
            &svc("metadata: {name: a}\nspec: {clusterIP: 10.0.0.1, type: NodePort, ports: [{port: 80, nodePort: 22}]}"),
            &wide
        )
        .is_ok());
    }

    #[test]
    fn external_addresses_are_read_and_proxy_mode_ingress_skipped() {
        let s = service(&svc(
            "metadata: {name: a}\nspec: {type: LoadBalancer, clusterIP: 10.0.0.1, externalIPs: [192.0.2.7], externalTrafficPolicy: Local, healthCheckNodePort: 32100, ports: [{port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.1}, {ip: 203.0.113.2, ipMode: Proxy}, {ip: 203.0.113.3, ipMode: VIP}, {hostname: lb.example.com}]}}",
        ))
        .unwrap();
        assert_eq!(s.external_ips.to_vec(), vec!["192.0.2.7".parse::<IpAddr>().unwrap()]);
        assert_eq!(
            s.lb_ingress.to_vec(),
            vec!["203.0.113.1".parse::<IpAddr>().unwrap(), "203.0.113.3".parse().unwrap()],
            "ipMode Proxy skipped"
        );
        assert_eq!(s.health_check_node_port, Some(32100));
        assert_eq!(s.ports[0].node_port, Some(30080));
        let bad = service(&svc("metadata: {name: a}\nspec: {clusterIP: 10.0.0.1, externalIPs: [nope], ports: [{port: 80}]}")).unwrap_err();
        assert!(bad.to_string().contains("spec.externalIPs[0] \"nope\""), "{bad}");
    }

    #[test]
    fn affinity_defaults_to_three_hours() {
        let s = service(&svc("metadata: {name: a}\nspec: {clusterIP: 10.0.0.1, sessionAffinity: ClientIP, ports: [{port: 80}]}")).unwrap();
        assert_eq!(s.affinity_timeout, Some(10_800));
        let s = service(&svc("metadata: {name: a}\nspec: {clusterIP: 10.0.0.1, sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}, ports: [{port: 80}]}")).unwrap();
        assert_eq!(s.affinity_timeout, Some(60));
    }

    #[test]
    fn trigger_time_and_node_deletion_are_read() {
        let s = endpoint_slice(&slice(
            "metadata: {name: s, labels: {kubernetes.io/service-name: a}, annotations: {endpoints.kubernetes.io/last-change-trigger-time: '2026-11-21T09:00:00Z'}}\naddressType: IPv4",
        ))
        .unwrap()
        .unwrap();
        let want = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_795_251_600);
        assert_eq!(s.trigger_time, Some(want));
        let n: Node =
            serde_yaml::from_str("metadata: {name: n}\nspec: {taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]}")
                .unwrap();
        assert!(node(&n).unwrap().deleting);
        let n: Node = serde_yaml::from_str("metadata: {name: n, deletionTimestamp: '2026-11-21T09:00:00Z'}").unwrap();
        assert!(node(&n).unwrap().deleting);
        let n: Node = serde_yaml::from_str("metadata: {name: n}").unwrap();
        assert!(!node(&n).unwrap().deleting);
    }

    #[test]
    fn slice_conditions_follow_api_defaults() {
        let s = endpoint_slice(&slice(
            "metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints:\n- addresses: [10.1.0.1]\n- addresses: [10.1.0.2]\n  conditions: {ready: false}\n- addresses: [10.1.0.3]\n  conditions: {ready: false, serving: true, terminating: true}\n",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(s.service, ObjectKey::new("default", "web"));
        let flags: Vec<_> = s.endpoints.iter().map(|e| (e.ready, e.serving, e.terminating)).collect();
        assert_eq!(flags, vec![(true, true, false), (false, true, false), (false, true, true)]);
    }

    #[test]
    fn slices_we_ignore_or_refuse() {
        let ignored = |y: &str| endpoint_slice(&slice(y)).unwrap().unwrap_err();
        assert_eq!(ignored("metadata: {name: s}\naddressType: IPv4"), SliceIgnored::NoServiceLabel);
        assert_eq!(ignored("metadata: {name: s}\naddressType: FQDN"), SliceIgnored::AddressType("FQDN".into()));
        assert_eq!(
            ignored("metadata: {name: s, labels: {kubernetes.io/service-name: a, service.kubernetes.io/headless: ''}}\naddressType: IPv4"),
            SliceIgnored::Headless
        );
        let refused = |y: &str| endpoint_slice(&slice(y)).unwrap_err().to_string();
        assert!(refused("metadata: {name: s}\naddressType: IPv5").contains("addressType \"IPv5\" is unknown"));
        assert!(refused("metadata: {name: s}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.999]}]")
            .contains("endpoints[0].addresses[0] \"10.0.0.999\" is not an IPv4 address"));
        assert!(refused("metadata: {name: s}\naddressType: IPv4\nports: [{port: 65536}]").contains("ports[0].port 65536 is out of range"));
        assert!(refused("metadata: {name: s}\naddressType: IPv4\nports: [{port: 0}]").contains("ports[0].port 0 is out of range"));
        // The API server's rules for endpoint addresses, port names and object names.
        for (addr, why) in [
            ("127.0.0.1", "a loopback address"),
            ("224.0.0.5", "a multicast address"),
            ("0.0.0.0", "unspecified"),
            ("169.254.3.4", "a link-local address"),
        ] {
            let e = refused(&format!("metadata: {{name: s}}\naddressType: IPv4\nendpoints: [{{addresses: [{addr}]}}]"));
            assert!(e.contains(&format!("endpoints[0].addresses[0] {addr} is {why}")), "{e}");
        }
        let e = refused("metadata: {name: s}\naddressType: IPv4\nports: [{name: http, port: 80}, {name: http, port: 81}]");
        assert!(e.contains("ports[1].name \"http\" is used twice"), "{e}");
        assert!(refused("metadata: {name: S..1}\naddressType: IPv4").contains("RFC 1123 subdomain"));
        assert!(refused("metadata: {name: s}\naddressType: IPv4\nports: [{name: HTTP_, port: 80}]")
            .contains("ports[0].name \"HTTP_\" is not an RFC 1123 label"));
    }

    #[test]
    fn ipv6_slices_are_checked_as_the_api_server_checks_them() {
        let with = |t: &str, a: &str| {
            endpoint_slice(&slice(&format!(
                "metadata: {{name: s, labels: {{kubernetes.io/service-name: web}}}}\naddressType: {t}\nendpoints: [{{addresses: ['{a}']}}]"
            )))
        };
        let ok = with("IPv6", "fd00:10:180::1").unwrap().unwrap();
        assert_eq!((ok.family, ok.endpoints[0].addr), (super::super::Family::V6, "fd00:10:180::1".parse().unwrap()));
        let e = with("IPv6", "10.0.0.1").unwrap_err().to_string();
        assert!(e.contains("\"10.0.0.1\" is not an IPv6 address (addressType IPv6)"), "{e}");
        let e = with("IPv4", "fd00::1").unwrap_err().to_string();
        assert!(e.contains("is not an IPv4 address (addressType IPv4)"), "{e}");
        for (bad, why) in [("fe80::1", "link-local"), ("::1", "loopback"), ("ff02::1", "multicast"), ("::", "unspecified")] {
            let e = with("IPv6", bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert_eq!(with("FQDN", "example.com").unwrap(), Err(SliceIgnored::AddressType("FQDN".into())));
        // An IPv6 cluster IP is a Service's like an IPv4 one; a link-local one is refused.
        let s = service(&svc("metadata: {name: web}\nspec: {clusterIP: 'fd00::10', ports: [{port: 80}]}")).unwrap();
        assert_eq!(s.cluster_ips.to_vec(), vec!["fd00::10".parse::<IpAddr>().unwrap()]);
        let e = service(&svc("metadata: {name: web}\nspec: {clusterIP: 'fe80::10', ports: [{port: 80}]}")).unwrap_err().to_string();
        assert!(e.contains("link-local"), "{e}");
    }

    #[test]
    fn addresses_with_leading_zeros_are_read_as_kube_proxy_reads_them() {
        // Stored before Go 1.17 and still served: every part is decimal (041 is 41).
        let s = service(&svc(
            "metadata: {name: old}\nspec: {type: LoadBalancer, clusterIP: 010.096.000.010, externalIPs: [192.000.002.007], loadBalancerSourceRanges: [010.001.000.000/016], ports: [{port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.001}]}}",
        ))
        .unwrap();
        assert_eq!(s.cluster_ips.to_vec(), vec!["10.96.0.10".parse::<IpAddr>().unwrap()]);
        assert_eq!(s.external_ips.to_vec(), vec!["192.0.2.7".parse::<IpAddr>().unwrap()]);
        assert_eq!(s.lb_ingress.to_vec(), vec!["203.0.113.1".parse::<IpAddr>().unwrap()]);
        assert_eq!(s.lb_source_ranges.to_vec(), vec!["10.1.0.0/16".parse().unwrap()]);
        let e = endpoint_slice(&slice(
            "metadata: {name: s, labels: {kubernetes.io/service-name: old}}\naddressType: IPv4\nendpoints: [{addresses: [10.244.001.041]}]",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(e.endpoints[0].addr, "10.244.1.41".parse::<IpAddr>().unwrap());
        let n = node(&serde_yaml::from_str("metadata: {name: n}\nspec: {podCIDR: 10.244.001.000/24}\nstatus: {addresses: [{type: InternalIP, address: 192.168.001.010}]}").unwrap()).unwrap();
        assert_eq!(n.internal_ips, vec!["192.168.1.10".parse::<IpAddr>().unwrap()]);
        assert_eq!(n.pod_cidrs, vec!["10.244.1.0/24".parse().unwrap()]);
        // What Go never accepted is still refused, naming the field.
        let e = service(&svc("metadata: {name: bad}\nspec: {clusterIP: 10.96.0.0256, ports: [{port: 80}]}")).unwrap_err().to_string();
        assert!(e.contains("spec.clusterIPs[0] \"10.96.0.0256\" is not a valid IP address"), "{e}");
    }
}
