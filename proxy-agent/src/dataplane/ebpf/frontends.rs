//! The eBPF dataplane's rendering of the plan: each `PortView` (one Service port in one
//! family, as translate gives every mode) becomes the frontends the map writer programs, one
//! per address and port the Service port is reached on, as the netfilter renderers make rules
//! of the same view.

use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr},
};

use crate::model::{Backend, Cidr, EndpointView, Family, Frontend, FrontendKey, FrontendKind, NodeInfo, PortView, Protocol};

/// Frontends that hold one value: the addresses and ports a Service port is reached on alike
/// (its cluster IPs; its node ports; its load-balancer IPs; its external IPs). A Service may
/// list 100,000 external IPs: checked as a group (`Dataplane::admit`), they are copied out
/// one per address only once the dataplane has room for them.
pub struct Group {
    /// Each once, in the order the Service lists them.
    pub keys: Vec<FrontendKey>,
    pub frontend: Frontend,
}

/// The frontends of a Service's port views on this node.
pub fn render(ports: &[PortView], node: &NodeInfo) -> Vec<(FrontendKey, Frontend)> {
    expand(render_groups(ports, node)).collect()
}

/// The frontends of a Service's port views on this node, by group.
pub fn render_groups(ports: &[PortView], node: &NodeInfo) -> Vec<Group> {
    let mut out = Vec::new();
    for view in ports {
        port(view, node, &mut out);
    }
    out
}

/// Each group's frontend copied to each of its keys.
pub fn expand(groups: Vec<Group>) -> impl Iterator<Item = (FrontendKey, Frontend)> {
    groups.into_iter().flat_map(|g| {
        let fe = g.frontend;
        g.keys.into_iter().map(move |k| (k, fe.clone()))
    })
}

/// `keys` with each once, first occurrence kept.
fn once(mut keys: Vec<FrontendKey>) -> Vec<FrontendKey> {
    if keys.len() > 1 {
        let mut seen = HashSet::new();
        keys.retain(|k| seen.insert(*k));
    }
    keys
}

fn backends(eps: &[EndpointView]) -> Vec<Backend> {
    let mut b: Vec<Backend> =
        eps.iter().map(|e| Backend { addr: e.addr, port: e.port, terminating: e.terminating, local: e.local }).collect();
    b.sort();
    b
}

/// The sources the load-balancer IPs `lb_ips` accept new flows from: the Service's
/// loadBalancerSourceRanges of the view's family (`ranges`), sorted, and the load-balancer IPs
/// themselves when a range holds the node's primary IP or one of its NodePort addresses.
/// kube-proxy's rules check the node IP only, for packets whose own source the ranges then
/// judge; the socket hooks judge a node's process before it has a source address, by whether
/// the load-balancer IP is in the list, so any node address in the ranges admits it (a node
/// reaching the load balancer from a secondary address in a range gets through, as with
/// kube-proxy). Empty: no ranges.
fn source_ranges(ranges: &[Cidr], lb_ips: &[IpAddr], node: &NodeInfo) -> Vec<Cidr> {
    let mut ranges = ranges.to_vec();
    let node_addrs: Vec<IpAddr> = node.node_ips.iter().chain(node.nodeport_addresses.iter()).copied().collect();
    if Cidr::any_contains(&ranges, &node_addrs) {
        ranges.extend(lb_ips.iter().map(|a| Cidr::host(*a)));
    }
    ranges.sort();
    ranges.dedup();
    ranges
}

fn port(view: &PortView, node: &NodeInfo, out: &mut Vec<Group>) {
    let protocol = view.name.protocol;
    // Endpoints outside the chosen set keep the flows they have, as conntrack keeps them for
    // kube-proxy; UDP flows to endpoints that stopped serving are moved, as kube-proxy clears
    // their conntrack entries. One frontend per chosen set, copied to each address.
    let frontend = |chosen: &[EndpointView], kind: FrontendKind, internal: Option<Vec<Backend>>| {
        let active = backends(chosen);
        let in_use: HashSet<_> = active.iter().map(|b| (b.addr, b.port)).collect();
        let others: Vec<EndpointView> = view
            .endpoints
            .iter()
            .filter(|e| !in_use.contains(&(e.addr, e.port)))
            .filter(|e| protocol != Protocol::Udp || e.serving)
            .copied()
            .collect();
        Frontend {
            name: view.name.clone(),
            kind,
            drop_when_empty: active.is_empty() && view.has_endpoints,
            backends: active,
            retained: backends(&others),
            affinity_timeout: view.affinity_timeout,
            internal_backends: internal,
            source_ranges: vec![],
        }
    };
    if !view.cluster_ips.is_empty() {
        let internal =
            frontend(if view.internal_local { &view.local_endpoints } else { &view.cluster_endpoints }, FrontendKind::ClusterIp, None);
        let keys = view.cluster_ips.iter().map(|vip| FrontendKey { addr: *vip, port: view.port, protocol }).collect();
        out.push(Group { keys: once(keys), frontend: internal });
    }
    // External frontends: outside clients get the local endpoints under externalTrafficPolicy
    // Local, pods reaching the same address get the cluster's. (Made at the first external
    // address: most Services have none.)
    let mut external: Option<Frontend> = None;
    let lb_ranges = source_ranges(&view.lb_source_ranges, &view.lb_ips, node);
    let mut add = |keys: Vec<FrontendKey>, kind: FrontendKind| {
        if keys.is_empty() {
            return;
        }
        let external = external.get_or_insert_with(|| {
            if view.external_local {
                frontend(&view.local_endpoints, kind, Some(backends(&view.cluster_endpoints)))
            } else {
                frontend(&view.cluster_endpoints, kind, None)
            }
        });
        let source_ranges = if kind == FrontendKind::LoadBalancer { lb_ranges.clone() } else { vec![] };
        out.push(Group { keys: once(keys), frontend: Frontend { kind, source_ranges, ..external.clone() } });
    };
    let at = |addrs: &[IpAddr], port: u16| -> Vec<FrontendKey> { addrs.iter().map(|a| FrontendKey { addr: *a, port, protocol }).collect() };
    if let Some(np) = view.node_port {
        let mut addrs: Vec<IpAddr> = node.nodeport_addresses.iter().filter(|a| Family::of(**a) == view.family).copied().collect();
        // (The NodePort addresses never hold loopback: the store leaves it out.) Localhost
        // NodePorts are IPv4's (kube-proxy's route_localnet has no IPv6 counterpart).
        if node.localhost_nodeports && view.family == Family::V4 {
            addrs.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
        }
        add(at(&addrs, np), FrontendKind::NodePort);
    }
    add(at(&view.lb_ips, view.port), FrontendKind::LoadBalancer);
    add(at(&view.external_ips, view.port), FrontendKind::ExternalIp);
}
