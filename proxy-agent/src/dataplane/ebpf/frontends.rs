//! The eBPF dataplane's rendering of the plan: each `PortView` (one Service port in one
//! family, as translate gives every mode) becomes the frontends the map writer programs, one
//! per address and port the Service port is reached on, as the netfilter renderers make rules
//! of the same view.

use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr},
};

use crate::model::{Backend, Cidr, EndpointView, Family, Frontend, FrontendKey, FrontendKind, NodeInfo, PortView, Protocol};

/// The frontends of a Service's port views on this node.
pub fn render(ports: &[PortView], node: &NodeInfo) -> Vec<(FrontendKey, Frontend)> {
    let mut out = Vec::new();
    for view in ports {
        port(view, node, &mut out);
    }
    out
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

fn port(view: &PortView, node: &NodeInfo, out: &mut Vec<(FrontendKey, Frontend)>) {
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
    let internal =
        frontend(if view.internal_local { &view.local_endpoints } else { &view.cluster_endpoints }, FrontendKind::ClusterIp, None);
    for vip in &view.cluster_ips {
        out.push((FrontendKey { addr: *vip, port: view.port, protocol }, internal.clone()));
    }
    // External frontends: outside clients get the local endpoints under externalTrafficPolicy
    // Local, pods reaching the same address get the cluster's. (Made at the first external
    // address: most Services have none.)
    let mut external: Option<Frontend> = None;
    let lb_ranges = source_ranges(&view.lb_source_ranges, &view.lb_ips, node);
    let mut add = |addr: IpAddr, port: u16, kind: FrontendKind| {
        let external = external.get_or_insert_with(|| {
            if view.external_local {
                frontend(&view.local_endpoints, kind, Some(backends(&view.cluster_endpoints)))
            } else {
                frontend(&view.cluster_endpoints, kind, None)
            }
        });
        let source_ranges = if kind == FrontendKind::LoadBalancer { lb_ranges.clone() } else { vec![] };
        out.push((FrontendKey { addr, port, protocol }, Frontend { kind, source_ranges, ..external.clone() }));
    };
    if let Some(np) = view.node_port {
        for a in node.nodeport_addresses.iter().filter(|a| Family::of(**a) == view.family) {
            add(*a, np, FrontendKind::NodePort);
        }
        // (The NodePort addresses never hold loopback: the store leaves it out.) Localhost
        // NodePorts are IPv4's (kube-proxy's route_localnet has no IPv6 counterpart).
        if node.localhost_nodeports && view.family == Family::V4 {
            add(IpAddr::V4(Ipv4Addr::LOCALHOST), np, FrontendKind::NodePort);
        }
    }
    for a in &view.lb_ips {
        add(*a, view.port, FrontendKind::LoadBalancer);
    }
    for a in &view.external_ips {
        add(*a, view.port, FrontendKind::ExternalIp);
    }
}
