//! Service + its EndpointSlices + this node -> the plan every mode renders: one `PortView` per
//! Service port and address family.

use std::{collections::HashSet, net::IpAddr};

use super::{
    addr::{Cidr, Family},
    endpoints::{categorize, Endpoint, Policies},
    validate::{CheckedService, CheckedSlice, ServicePort, ServiceType},
    EndpointView, NodeInfo, ObjectKey, PortView, ServicePortName,
};

fn endpoint_view(ep: &Endpoint) -> EndpointView {
    EndpointView { addr: ep.addr, port: ep.port, ready: ep.ready, serving: ep.serving, terminating: ep.terminating, local: ep.local }
}

/// A health-check node port to serve (externalTrafficPolicy Local LoadBalancer Services).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub port: u16,
    pub service: ObjectKey,
    /// Usable local endpoints (the load balancer sends traffic here only when > 0): the most
    /// of any family, as kube-proxy's health server counts a dual-stack Service.
    pub local_endpoints: usize,
}

/// The plan of one Service, and remarks worth a log line (not errors).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Translation {
    /// One per port and address family the Service has a cluster IP of.
    pub ports: Vec<PortView>,
    pub health_check: Option<HealthCheck>,
    pub notes: Vec<String>,
}

/// externalTrafficPolicy counts only for NodePort and LoadBalancer Services (a ClusterIP
/// Service with external IPs is served as Cluster).
fn external_local(svc: &CheckedService) -> bool {
    svc.external_local && matches!(svc.service_type, ServiceType::NodePort | ServiceType::LoadBalancer)
}

/// Which endpoint sets the Service's traffic uses (kube-proxy `UsesClusterEndpoints` /
/// `UsesLocalEndpoints`). An externally reachable Service always needs the Cluster set: pods
/// and the node itself reaching its external addresses are short-circuited to it even under
/// externalTrafficPolicy Local.
fn policies(svc: &CheckedService) -> Policies {
    let external = matches!(svc.service_type, ServiceType::NodePort | ServiceType::LoadBalancer)
        || !svc.external_ips.is_empty()
        || !svc.lb_ingress.is_empty();
    Policies { uses_cluster: !svc.internal_local || external, uses_local: svc.internal_local || (external && external_local(svc)) }
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

fn of_family(addrs: &[IpAddr], family: Family) -> Vec<IpAddr> {
    addrs.iter().copied().filter(|a| Family::of(*a) == family).collect()
}

/// Translates one Service: a `PortView` per port for each family the Service has a cluster IP
/// of (each family's view holds that family's addresses and the endpoints of that family's
/// slices, as kube-proxy's per-family proxiers see a dual-stack Service). `slices` are the
/// Service's slices, sorted by name.
pub fn service(svc: &CheckedService, slices: &[&CheckedSlice], node: &NodeInfo) -> Translation {
    let mut out = Translation::default();
    if svc.skip.is_some() {
        return out;
    }
    let mut health_check_endpoints = 0;
    for family in Family::ALL {
        let cluster_ips = of_family(&svc.cluster_ips, family);
        // kube-proxy's proxier of a family skips a Service without a cluster IP of it.
        if cluster_ips.is_empty() {
            continue;
        }
        let slices: Vec<&CheckedSlice> = slices.iter().copied().filter(|s| s.family == family).collect();
        let local = family_service(svc, &slices, node, family, &cluster_ips, &mut out);
        health_check_endpoints = health_check_endpoints.max(local);
    }
    if svc.service_type == ServiceType::LoadBalancer && external_local(svc) {
        if let Some(port) = svc.health_check_node_port {
            out.health_check = Some(HealthCheck { port, service: svc.key.clone(), local_endpoints: health_check_endpoints });
        }
    }
    out
}

/// One family of `svc`: its port views. Returns the number of usable local
/// endpoints (for the health check).
fn family_service(
    svc: &CheckedService,
    slices: &[&CheckedSlice],
    node: &NodeInfo,
    family: Family,
    cluster_ips: &[IpAddr],
    out: &mut Translation,
) -> usize {
    let policies = policies(svc);
    let lb_ips = of_family(&svc.lb_ingress, family);
    let external_ips = of_family(&svc.external_ips, family);
    let node_ports = matches!(svc.service_type, ServiceType::NodePort | ServiceType::LoadBalancer);
    let lb_source_ranges: Vec<Cidr> = svc.lb_source_ranges.iter().copied().filter(|r| r.family() == family).collect();
    let mut local_endpoints = 0;
    for port in &svc.ports {
        let endpoints = port_endpoints(port, slices, node);
        let sets = categorize(&endpoints, policies, &node.name, node.zone.as_deref());
        local_endpoints += sets.local.len();
        let name = ServicePortName { service: svc.key.clone(), port: port.name.clone(), protocol: port.protocol };
        out.ports.push(PortView {
            name,
            family,
            port: port.port,
            cluster_ips: cluster_ips.to_vec(),
            node_port: port.node_port.filter(|_| node_ports),
            external_ips: external_ips.clone(),
            lb_ips: lb_ips.clone(),
            internal_local: svc.internal_local,
            external_local: external_local(svc),
            lb_source_ranges: lb_source_ranges.clone(),
            affinity_timeout: svc.affinity_timeout,
            health_check_node_port: svc
                .health_check_node_port
                .filter(|_| svc.service_type == ServiceType::LoadBalancer && external_local(svc)),
            cluster_endpoints: sets.cluster.iter().map(endpoint_view).collect(),
            local_endpoints: sets.local.iter().map(endpoint_view).collect(),
            has_endpoints: sets.has_any,
            endpoints: endpoints.iter().map(endpoint_view).collect(),
        });
    }
    local_endpoints
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

    use super::*;
    use crate::model::{validate, Backend, Frontend, FrontendKey, FrontendKind, Protocol};

    /// A translation and the eBPF dataplane's rendering of it, which most of these tests check.
    struct Rendered {
        ports: Vec<PortView>,
        frontends: Vec<(FrontendKey, Frontend)>,
        health_check: Option<HealthCheck>,
        notes: Vec<String>,
    }

    fn service(s: &CheckedService, slices: &[&CheckedSlice], node: &NodeInfo) -> Rendered {
        let t = super::service(s, slices, node);
        Rendered {
            frontends: crate::dataplane::ebpf::frontends::render(&t.ports, node),
            ports: t.ports,
            health_check: t.health_check,
            notes: t.notes,
        }
    }

    fn node() -> NodeInfo {
        NodeInfo {
            name: "node-a".into(),
            zone: Some("zone-1".into()),
            nodeport_addresses: vec!["192.168.0.10".parse().unwrap()],
            node_ips: vec!["192.168.0.10".parse().unwrap()],
            localhost_nodeports: false,
        }
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

    fn backends_of(t: &Rendered, key: FrontendKey) -> Vec<String> {
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

    fn find(t: &Rendered, key: FrontendKey) -> &Frontend {
        &t.frontends.iter().find(|(k, _)| *k == key).unwrap_or_else(|| panic!("no frontend {key} in {:?}", t.frontends)).1
    }

    const NS_SLICE: &str = "metadata: {name: web-a, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints:\n- {addresses: [10.1.0.1], nodeName: node-a}\n- {addresses: [10.1.0.2], nodeName: node-b}\n";

    #[test]
    fn node_ports_load_balancer_and_external_ips_are_frontends() {
        let s = svc("metadata: {name: web}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.10, externalIPs: [192.0.2.7], ports: [{name: http, port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.1}, {ip: 203.0.113.2, ipMode: Proxy}]}}");
        let t = service(&s, &[&slice(NS_SLICE)], &node());
        let kinds: Vec<_> = t.frontends.iter().map(|(k, f)| (k.to_string(), f.kind)).collect();
        assert_eq!(
            kinds,
            vec![
                ("10.96.0.10:80/TCP".to_string(), FrontendKind::ClusterIp),
                ("192.168.0.10:30080/TCP".to_string(), FrontendKind::NodePort),
                ("203.0.113.1:80/TCP".to_string(), FrontendKind::LoadBalancer),
                ("192.0.2.7:80/TCP".to_string(), FrontendKind::ExternalIp),
            ],
            "ipMode Proxy ingress is not served"
        );
        assert!(t.frontends.iter().all(|(_, f)| f.backends.len() == 2 && f.internal_backends.is_none()), "Cluster policy: every endpoint");
        assert_eq!(t.health_check, None);
        // Localhost NodePorts: one more NodePort frontend, on 127.0.0.1.
        let t = service(&s, &[&slice(NS_SLICE)], &NodeInfo { localhost_nodeports: true, ..node() });
        let node_ports: Vec<String> =
            t.frontends.iter().filter(|(_, f)| f.kind == FrontendKind::NodePort).map(|(k, _)| k.to_string()).collect();
        assert_eq!(node_ports, ["192.168.0.10:30080/TCP", "127.0.0.1:30080/TCP"]);
    }

    #[test]
    fn load_balancer_source_ranges_restrict_only_the_load_balancer_ips() {
        let s = svc("metadata: {name: web}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.10, externalIPs: [192.0.2.7], loadBalancerSourceRanges: [10.1.2.3/8, 2001:db8::/32], ports: [{name: http, port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.1}]}}");
        let t = service(&s, &[&slice(NS_SLICE)], &node());
        let ranges = |t: &Rendered, k: FrontendKey| find(t, k).source_ranges.iter().map(|c| c.to_string()).collect::<Vec<_>>();
        assert_eq!(ranges(&t, fk("203.0.113.1", 80, Protocol::Tcp)), ["10.0.0.0/8"], "the network of each IPv4 range");
        for other in [fk("10.96.0.10", 80, Protocol::Tcp), fk("192.168.0.10", 30080, Protocol::Tcp), fk("192.0.2.7", 80, Protocol::Tcp)] {
            assert!(ranges(&t, other).is_empty(), "{other}: cluster IP, NodePort and external IP are not restricted");
        }
        // A range holding the node's own address lets the node reach the load balancer from
        // the load balancer's address too, as kube-proxy allows.
        let s = svc("metadata: {name: web}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.10, loadBalancerSourceRanges: [192.168.0.0/16, 10.0.0.0/8], ports: [{name: http, port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.1}, {ip: 203.0.113.2}]}}");
        let t = service(&s, &[&slice(NS_SLICE)], &node());
        for lb in ["203.0.113.1", "203.0.113.2"] {
            assert_eq!(ranges(&t, fk(lb, 80, Protocol::Tcp)), ["10.0.0.0/8", "192.168.0.0/16", "203.0.113.1/32", "203.0.113.2/32"], "{lb}");
        }
        // A range holding none of the node's addresses admits nothing more; one holding a
        // secondary NodePort address does (see `source_ranges`).
        let lb_ips = ["10.0.0.0/8", "192.168.0.0/16", "203.0.113.1/32", "203.0.113.2/32"];
        let outside =
            NodeInfo { nodeport_addresses: vec!["172.16.0.9".parse().unwrap()], node_ips: vec!["172.16.0.1".parse().unwrap()], ..node() };
        let t = service(&s, &[&slice(NS_SLICE)], &outside);
        assert_eq!(ranges(&t, fk("203.0.113.1", 80, Protocol::Tcp)), ["10.0.0.0/8", "192.168.0.0/16"], "no node address in a range");
        let secondary =
            NodeInfo { nodeport_addresses: vec!["10.9.9.9".parse().unwrap()], node_ips: vec!["172.16.0.1".parse().unwrap()], ..node() };
        let t = service(&s, &[&slice(NS_SLICE)], &secondary);
        assert_eq!(ranges(&t, fk("203.0.113.1", 80, Protocol::Tcp)), lb_ips, "a secondary address in a range");
        let t = service(&s, &[&slice(NS_SLICE)], &NodeInfo { nodeport_addresses: vec![], ..node() });
        assert_eq!(ranges(&t, fk("203.0.113.1", 80, Protocol::Tcp)), lb_ips, "the primary IP in a range");
    }

    #[test]
    fn external_traffic_policy_local_keeps_outside_traffic_local_and_pods_cluster_wide() {
        let s = svc("metadata: {name: web}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.10, externalTrafficPolicy: Local, healthCheckNodePort: 32000, ports: [{name: http, port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.1}]}}");
        let t = service(&s, &[&slice(NS_SLICE)], &node());
        let np = find(&t, fk("192.168.0.10", 30080, Protocol::Tcp));
        assert_eq!(np.backends.iter().map(|b| b.to_string()).collect::<Vec<_>>(), ["10.1.0.1:8080"], "outside: local only");
        assert_eq!(np.internal_backends.as_ref().map(Vec::len), Some(2), "pods: cluster-wide");
        let cip = find(&t, fk("10.96.0.10", 80, Protocol::Tcp));
        assert_eq!(cip.backends.len(), 2, "the cluster IP is not affected by externalTrafficPolicy");
        assert_eq!(t.health_check, Some(HealthCheck { port: 32000, service: ObjectKey::new("default", "web"), local_endpoints: 1 }));

        // No local endpoint: outside traffic is dropped (kube-proxy), pods still get through.
        let remote_only = slice("metadata: {name: web-a, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints:\n- {addresses: [10.1.0.2], nodeName: node-b}\n");
        let t = service(&s, &[&remote_only], &node());
        let np = find(&t, fk("192.168.0.10", 30080, Protocol::Tcp));
        assert!(np.backends.is_empty() && np.drop_when_empty);
        assert_eq!(np.internal_backends.as_ref().map(Vec::len), Some(1));
        assert_eq!(t.health_check.unwrap().local_endpoints, 0);
    }

    #[test]
    fn a_cluster_ip_service_has_no_node_ports() {
        let s = svc("metadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, nodePort: 30080}]}");
        assert_eq!(service(&s, &[], &node()).frontends.len(), 1);
    }

    #[test]
    fn dual_stack_gives_each_family_its_own_view_and_its_own_ebpf_frontends() {
        let s = svc("metadata: {name: web}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, 'fd00::10'], externalIPs: [192.0.2.7, '2001:db8::7'], loadBalancerSourceRanges: [10.0.0.0/8, '2001:db8:1::/48'], ports: [{name: http, port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.1}, {ip: '2001:db8::1'}]}}");
        let v4 = slice(NS_SLICE);
        let v6 = slice("metadata: {name: web-b, labels: {kubernetes.io/service-name: web}}\naddressType: IPv6\nports: [{name: http, port: 8080}]\nendpoints:\n- {addresses: ['fd00:1::1'], nodeName: node-a}\n");
        let node = NodeInfo { nodeport_addresses: vec!["192.168.0.10".parse().unwrap(), "fd00:ff::10".parse().unwrap()], ..node() };
        let t = service(&s, &[&v4, &v6], &node);
        let view = |f: Family| t.ports.iter().find(|p| p.family == f).unwrap_or_else(|| panic!("no {f} view"));
        let (a, b) = (view(Family::V4), view(Family::V6));
        assert_eq!(a.cluster_ips, vec!["10.96.0.10".parse::<IpAddr>().unwrap()]);
        assert_eq!(b.cluster_ips, vec!["fd00::10".parse::<IpAddr>().unwrap()]);
        assert_eq!(b.external_ips, vec!["2001:db8::7".parse::<IpAddr>().unwrap()]);
        assert_eq!(b.lb_ips, vec!["2001:db8::1".parse::<IpAddr>().unwrap()]);
        assert_eq!(b.lb_source_ranges, vec!["2001:db8:1::/48".parse().unwrap()], "each family its own ranges");
        assert_eq!(a.lb_source_ranges, vec!["10.0.0.0/8".parse().unwrap()]);
        assert_eq!(a.cluster_endpoints.len(), 2, "the IPv4 slice's endpoints");
        assert_eq!(b.cluster_endpoints.iter().map(|e| e.socket().to_string()).collect::<Vec<_>>(), ["[fd00:1::1]:8080"]);
        // Each family's eBPF frontends hold that family's endpoints and ranges.
        assert_eq!(t.frontends.len(), 8, "cluster IP, NodePort, LB, external IP of each family: {:?}", t.frontends);
        for (k, f) in &t.frontends {
            assert!(f.backends.iter().all(|b| b.addr.is_ipv4() == k.addr.is_ipv4()), "{k}: {:?}", f.backends);
            assert!(f.source_ranges.iter().all(|r| r.addr.is_ipv4() == k.addr.is_ipv4()), "{k}: {:?}", f.source_ranges);
            assert_eq!(f.backends.len(), if k.addr.is_ipv4() { 2 } else { 1 }, "{k}");
        }
        assert_eq!(find(&t, fk("203.0.113.1", 80, Protocol::Tcp)).source_ranges, vec!["10.0.0.0/8".parse().unwrap()]);
        assert_eq!(find(&t, fk("2001:db8::1", 80, Protocol::Tcp)).source_ranges, vec!["2001:db8:1::/48".parse().unwrap()]);
        assert_eq!(find(&t, fk("fd00:ff::10", 30080, Protocol::Tcp)).kind, FrontendKind::NodePort);
        assert!(t.notes.is_empty(), "{:?}", t.notes);
        // Health-check endpoints are counted per family, not added up.
        let s = svc("metadata: {name: web}\nspec: {type: LoadBalancer, externalTrafficPolicy: Local, healthCheckNodePort: 32000, clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, 'fd00::10'], ports: [{name: http, port: 80, nodePort: 30080}]}");
        let h = service(&s, &[&v4, &v6], &node).health_check.unwrap();
        assert_eq!(h.local_endpoints, 1);
        let h = service(&s, &[&v6], &node).health_check.unwrap();
        assert_eq!(h.local_endpoints, 1, "local IPv6 endpoints only");
    }

    #[test]
    fn a_single_stack_service_ignores_the_other_familys_slices() {
        let s = svc("metadata: {name: web}\nspec: {clusterIP: 'fd00::10', ports: [{name: http, port: 80}]}");
        let t = service(&s, &[&slice(NS_SLICE)], &node());
        assert_eq!(t.frontends.len(), 1, "its IPv6 cluster IP only");
        assert!(t.frontends[0].1.backends.is_empty(), "IPv4 endpoints do not serve an IPv6 frontend");
        assert_eq!(t.ports.len(), 1);
        assert_eq!(t.ports[0].family, Family::V6);
        assert!(t.ports[0].cluster_endpoints.is_empty() && !t.ports[0].has_endpoints, "IPv4 endpoints do not serve an IPv6 Service");
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
        assert_eq!(t.frontends.len(), 2, "a frontend per port");
        assert!(t.frontends.iter().all(|(_, f)| f.affinity_timeout == Some(10_800)));
    }
}
