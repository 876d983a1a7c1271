//! Service + its EndpointSlices + this node -> the frontends this node programs.

use std::{
    collections::HashSet,
    net::IpAddr,
};

use super::{
    endpoints::{categorize, Endpoint, Policies},
    validate::{CheckedService, CheckedSlice, ServicePort, ServiceType},
    Backend, Frontend, FrontendKey, NodeInfo, Protocol, ServicePortName,
};

/// The frontends of one Service, and remarks worth a log line (not errors).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Translation {
    pub frontends: Vec<(FrontendKey, Frontend)>,
    pub notes: Vec<String>,
}

/// Which endpoint sets the Service's traffic uses (kube-proxy `UsesClusterEndpoints` /
/// `UsesLocalEndpoints`).
fn policies(svc: &CheckedService) -> Policies {
    let external = matches!(svc.service_type, ServiceType::NodePort | ServiceType::LoadBalancer);
    Policies {
        uses_cluster: !svc.internal_local || (external && !svc.external_local),
        uses_local: svc.internal_local || (external && svc.external_local),
    }
}

/// Endpoints of one service port across all slices: matched by port name and protocol, the
/// same address:port counted once (slices are visited in name order, the first wins).
pub fn port_endpoints(port: &ServicePort, slices: &[&CheckedSlice], node: &NodeInfo) -> Vec<Endpoint> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for slice in slices {
        for sp in slice.ports.iter().filter(|sp| sp.name == port.name && sp.protocol == port.protocol) {
            for e in &slice.endpoints {
                if seen.insert((e.addr, sp.port)) {
                    out.push(e.to_endpoint(sp.port, &node.name));
                }
            }
        }
    }
    out
}

fn backend(ep: &Endpoint) -> Backend {
    Backend { addr: ep.addr, port: ep.port, terminating: ep.terminating, local: ep.local }
}

/// Translates one Service. `slices` are the Service's slices, sorted by name.
pub fn service(svc: &CheckedService, slices: &[&CheckedSlice], node: &NodeInfo) -> Translation {
    let mut out = Translation::default();
    if svc.skip.is_some() {
        return out;
    }
    let policies = policies(svc);
    let vips: Vec<_> = svc
        .cluster_ips
        .iter()
        .filter_map(|a| match a {
            IpAddr::V4(v4) => Some(*v4),
            IpAddr::V6(v6) => {
                out.notes.push(format!("cluster IP {v6} skipped: this dataplane serves IPv4 only"));
                None
            }
        })
        .collect();
    for port in &svc.ports {
        let endpoints = port_endpoints(port, slices, node);
        let sets = categorize(&endpoints, policies, &node.name, node.zone.as_deref());
        let chosen = if svc.internal_local { &sets.local } else { &sets.cluster };
        let mut backends: Vec<Backend> = chosen.iter().map(backend).collect();
        backends.sort();
        let in_use: HashSet<_> = backends.iter().map(|b| (b.addr, b.port)).collect();
        // Endpoints outside the chosen set keep the flows they have, as conntrack keeps them
        // for kube-proxy; UDP flows to endpoints that stopped serving are moved, as kube-proxy
        // clears their conntrack entries.
        let mut retained: Vec<Backend> = endpoints
            .iter()
            .filter(|e| !in_use.contains(&(e.addr, e.port)))
            .filter(|e| port.protocol != Protocol::Udp || e.serving)
            .map(backend)
            .collect();
        retained.sort();
        let name = ServicePortName { service: svc.key.clone(), port: port.name.clone(), protocol: port.protocol };
        for vip in &vips {
            out.frontends.push((
                FrontendKey { addr: *vip, port: port.port, protocol: port.protocol },
                Frontend {
                    name: name.clone(),
                    backends: backends.clone(),
                    retained: retained.clone(),
                    affinity_timeout: svc.affinity_timeout,
                    drop_when_empty: backends.is_empty() && sets.has_any,
                },
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

    use super::*;
    use crate::model::validate;

    fn node() -> NodeInfo {
        NodeInfo { name: "node-a".into(), zone: Some("zone-1".into()) }
    }

    fn svc(yaml: &str) -> CheckedService {
        validate::service(&serde_yaml::from_str::<Service>(yaml).unwrap()).unwrap()
    }

    fn slice(yaml: &str) -> CheckedSlice {
        validate::endpoint_slice(&serde_yaml::from_str::<EndpointSlice>(yaml).unwrap()).unwrap().unwrap()
    }

    fn fk(addr: &str, port: u16, protocol: Protocol) -> FrontendKey {
        FrontendKey { addr: addr.parse().unwrap(), port, protocol }
    }

    fn be(addr: &str, port: u16) -> Backend {
        Backend { addr: addr.parse().unwrap(), port, terminating: false, local: false }
    }

    fn backends_of(t: &Translation, key: FrontendKey) -> Vec<String> {
        let fe = &t.frontends.iter().find(|(k, _)| *k == key).unwrap_or_else(|| panic!("no frontend {key}")).1;
        fe.backends.iter().map(|b| b.to_string()).collect()
    }

    #[test]
    fn named_ports_map_service_port_to_slice_port() {
        let s = svc("metadata: {name: web, namespace: shop}\nspec:\n  clusterIP: 10.96.0.10\n  ports:\n  - {name: http, port: 80, targetPort: web}\n  - {name: metrics, port: 9090}\n");
        let sl = slice("metadata: {name: web-abc, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}, {name: metrics, port: 9100}]\nendpoints: [{addresses: [10.1.0.1]}, {addresses: [10.1.0.2]}]\n");
        let t = service(&s, &[&sl], &node());
        assert_eq!(backends_of(&t, fk("10.96.0.10", 80, Protocol::Tcp)), ["10.1.0.1:8080", "10.1.0.2:8080"]);
        assert_eq!(backends_of(&t, fk("10.96.0.10", 9090, Protocol::Tcp)), ["10.1.0.1:9100", "10.1.0.2:9100"]);
        assert_eq!(t.frontends[0].1.name.to_string(), "shop/web:http");
    }

    #[test]
    fn tcp_and_udp_on_the_same_port_are_separate_frontends() {
        let s = svc("metadata: {name: dns}\nspec:\n  clusterIP: 10.96.0.53\n  ports:\n  - {name: dns, port: 53, protocol: UDP}\n  - {name: dns-tcp, port: 53, protocol: TCP}\n");
        let sl = slice("metadata: {name: dns-1, labels: {kubernetes.io/service-name: dns}}\naddressType: IPv4\nports: [{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5354, protocol: TCP}]\nendpoints: [{addresses: [10.1.0.9]}]\n");
        let t = service(&s, &[&sl], &node());
        assert_eq!(backends_of(&t, fk("10.96.0.53", 53, Protocol::Udp)), ["10.1.0.9:5353"]);
        assert_eq!(backends_of(&t, fk("10.96.0.53", 53, Protocol::Tcp)), ["10.1.0.9:5354"]);
    }

    #[test]
    fn endpoints_in_several_slices_are_merged_once() {
        let s = svc("metadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}");
        let a = slice("metadata: {name: web-a, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.1.0.1]}, {addresses: [10.1.0.2]}]\n");
        let b = slice("metadata: {name: web-b, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.1.0.2]}, {addresses: [10.1.0.3]}]\n");
        let t = service(&s, &[&a, &b], &node());
        assert_eq!(backends_of(&t, fk("10.96.0.10", 80, Protocol::Tcp)), ["10.1.0.1:8080", "10.1.0.2:8080", "10.1.0.3:8080"]);
    }

    #[test]
    fn no_endpoints_gives_an_empty_frontend_not_none() {
        let s = svc("metadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}");
        let t = service(&s, &[], &node());
        assert_eq!(t.frontends.len(), 1);
        assert!(t.frontends[0].1.backends.is_empty(), "a Service without endpoints must still be programmed so it can REJECT");
    }

    #[test]
    fn terminating_endpoints_are_retained_and_used_only_as_fallback() {
        let s = svc("metadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}");
        let mixed = slice("metadata: {name: web-a, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints:\n- addresses: [10.1.0.1]\n- addresses: [10.1.0.2]\n  conditions: {ready: false, serving: true, terminating: true}\n");
        let t = service(&s, &[&mixed], &node());
        let fe = &t.frontends[0].1;
        assert_eq!(fe.backends, vec![be("10.1.0.1", 8080)]);
        assert_eq!(fe.retained, vec![Backend { terminating: true, ..be("10.1.0.2", 8080) }]);

        let only_terminating = slice("metadata: {name: web-a, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints:\n- addresses: [10.1.0.2]\n  conditions: {ready: false, serving: true, terminating: true}\n");
        let t = service(&s, &[&only_terminating], &node());
        assert_eq!(t.frontends[0].1.backends, vec![Backend { terminating: true, ..be("10.1.0.2", 8080) }]);
    }

    #[test]
    fn udp_does_not_retain_endpoints_that_stopped_serving() {
        let s = svc("metadata: {name: dns}\nspec: {clusterIP: 10.96.0.53, ports: [{port: 53, protocol: UDP}]}");
        let sl = slice("metadata: {name: dns-a, labels: {kubernetes.io/service-name: dns}}\naddressType: IPv4\nports: [{port: 53, protocol: UDP}]\nendpoints:\n- addresses: [10.1.0.1]\n- addresses: [10.1.0.2]\n  conditions: {ready: false, serving: false}\n");
        let t = service(&s, &[&sl], &node());
        assert!(t.frontends[0].1.retained.is_empty());
    }

    #[test]
    fn internal_traffic_policy_local_uses_this_node_only() {
        let s = svc("metadata: {name: web}\nspec: {clusterIP: 10.96.0.10, internalTrafficPolicy: Local, ports: [{port: 80}]}");
        let sl = slice("metadata: {name: web-a, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints:\n- {addresses: [10.1.0.1], nodeName: node-a}\n- {addresses: [10.1.0.2], nodeName: node-b}\n");
        let t = service(&s, &[&sl], &node());
        assert_eq!(t.frontends[0].1.backends, vec![Backend { local: true, ..be("10.1.0.1", 8080) }]);
    }

    #[test]
    fn local_policy_without_local_endpoints_drops_and_no_endpoints_rejects() {
        let s = svc("metadata: {name: web}\nspec: {clusterIP: 10.96.0.10, internalTrafficPolicy: Local, ports: [{port: 80}]}");
        let remote = slice("metadata: {name: web-a, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints:\n- {addresses: [10.1.0.2], nodeName: node-b}\n");
        let fe = &service(&s, &[&remote], &node()).frontends[0].1;
        assert!(fe.backends.is_empty() && fe.drop_when_empty, "kube-proxy drops: the Service has endpoints, none local");
        let fe = &service(&s, &[], &node()).frontends[0].1;
        assert!(!fe.drop_when_empty, "no endpoints at all: reject");
    }

    #[test]
    fn dual_stack_programs_the_ipv4_address_and_notes_the_rest() {
        let s = svc("metadata: {name: web}\nspec: {clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, 'fd00::10'], ports: [{port: 80}]}");
        let t = service(&s, &[], &node());
        assert_eq!(t.frontends.len(), 1);
        assert_eq!(t.frontends[0].0.addr, Ipv4Addr::new(10, 96, 0, 10));
        assert_eq!(t.notes.len(), 1, "{:?}", t.notes);
    }

    #[test]
    fn skipped_services_have_no_frontends() {
        let s = svc("metadata: {name: web}\nspec: {clusterIP: None, ports: [{port: 80}]}");
        assert!(service(&s, &[], &node()).frontends.is_empty());
    }

    #[test]
    fn affinity_is_carried_to_every_frontend() {
        let s = svc("metadata: {name: web}\nspec: {clusterIP: 10.96.0.10, sessionAffinity: ClientIP, ports: [{name: a, port: 80}, {name: b, port: 81}]}");
        let t = service(&s, &[], &node());
        assert!(t.frontends.iter().all(|(_, f)| f.affinity_timeout == Some(10_800)));
    }
}
