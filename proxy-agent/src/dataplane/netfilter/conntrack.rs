//! Stale UDP conntrack entries in the netfilter modes. The kernel's conntrack keeps translating
//! a UDP flow to the endpoint it first chose for as long as packets keep coming, so a client
//! that reuses its socket (a DNS resolver) keeps talking to an endpoint that is gone; and a
//! flow that started before the Service had endpoints stays untranslated. kube-proxy deletes
//! such entries after each sync; so do we: after a sync that changed a UDP Service, one
//! `conntrack -L -p udp` dump, read line by line as it comes (a busy node's table is large;
//! only the stale pairs are kept), then one `conntrack -D` per stale (Service address,
//! endpoint) pair. TCP needs none of this: a removed endpoint's connections end with a reset.
//! (The eBPF dataplane re-selects such flows itself, on their next packet.)

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead as _, BufReader, Read as _},
    net::IpAddr,
};

use super::{run, spawn, NetfilterError, NodeContext, Services};
use crate::model::{Family, Protocol};

const CONNTRACK: &str = "conntrack";

/// One tracked UDP flow: its original direction and where replies come from. As a stale one,
/// what to delete: flows to `dst`:`dport` whose replies come from `reply_src`:`reply_sport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Flow {
    pub dst: IpAddr,
    pub dport: u16,
    pub reply_src: IpAddr,
    pub reply_sport: u16,
}

/// Parses one line of `conntrack -L -p udp` output (the first src/dst/sport/dport are the
/// original direction, the second the reply).
pub fn parse_line(line: &str) -> Option<Flow> {
    // The n-th value of `key=` on the line.
    let nth = |key: &str, n: usize| line.split_whitespace().filter_map(|w| w.strip_prefix(key)?.strip_prefix('=')).nth(n);
    Some(Flow {
        dst: nth("dst", 0)?.parse().ok()?,
        dport: nth("dport", 0)?.parse().ok()?,
        reply_src: nth("src", 1)?.parse().ok()?,
        reply_sport: nth("sport", 1)?.parse().ok()?,
    })
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
        for addr in port.cluster_ips.iter().chain(&port.external_ips).chain(&port.lb_ips) {
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

/// Deletes the stale UDP flows for `services`, one `conntrack -D` per (Service address,
/// endpoint) pair.
pub fn reconcile(services: &Services, node: &NodeContext) -> Result<(), NetfilterError> {
    let udp_in = |family| services.values().flatten().any(|p| p.family == family && p.name.protocol == Protocol::Udp);
    // `conntrack` lists one family at a time (IPv4 unless told).
    for family in Family::ALL.into_iter().filter(|f| *f == Family::V4 || udp_in(*f)) {
        let f = conntrack_family(family);
        for s in list_stale(services, node, family)? {
            let (dst, dport, src, sport) = (s.dst.to_string(), s.dport.to_string(), s.reply_src.to_string(), s.reply_sport.to_string());
            // Exit status 1 with "0 flow entries have been deleted" is a race with the flow ending.
            let _ = run(
                CONNTRACK,
                CONNTRACK,
                &[
                    "-D",
                    "-f",
                    f,
                    "-p",
                    "udp",
                    "--orig-dst",
                    &dst,
                    "--orig-port-dst",
                    &dport,
                    "--reply-src",
                    &src,
                    "--reply-port-src",
                    &sport,
                ],
            );
            let service = std::net::SocketAddr::new(s.dst, s.dport);
            tracing::info!(service = %format!("{service}/udp"), stale = %std::net::SocketAddr::new(s.reply_src, s.reply_sport), "deleted stale UDP conntrack entries");
        }
    }
    Ok(())
}

fn conntrack_family(family: Family) -> &'static str {
    match family {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    }
}

/// Lists one family's UDP flows and keeps the stale ones, reading the listing as `conntrack`
/// writes it.
fn list_stale(services: &Services, node: &NodeContext, family: Family) -> Result<BTreeSet<Flow>, NetfilterError> {
    let args = ["-L", "-f", conntrack_family(family), "-p", "udp"];
    let command = || format!("{CONNTRACK} {}", args.join(" "));
    let mut child = spawn(CONNTRACK, CONNTRACK, &args, false)?;
    let stdout = child.stdout.take().expect("piped stdout");
    // Its summary line ("... flow entries have been shown") goes to stderr, which stays small;
    // it is read after stdout ends.
    let stale = stale(BufReader::new(stdout).lines().map_while(Result::ok).filter_map(|l| parse_line(&l)), services, node);
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    let status = child.wait().map_err(|e| NetfilterError::Failed { command: command(), stderr: e.to_string() })?;
    if !status.success() {
        return Err(NetfilterError::Failed { command: command(), stderr: stderr.trim().to_string() });
    }
    Ok(stale)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EndpointView, ObjectKey, PortView, ServicePortName};

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
        assert_eq!(
            text.lines().filter_map(parse_line).collect::<Vec<_>>(),
            vec![
                Flow { dst: "10.96.0.10".parse().unwrap(), dport: 53, reply_src: "10.244.1.3".parse().unwrap(), reply_sport: 5353 },
                Flow { dst: "10.96.0.10".parse().unwrap(), dport: 53, reply_src: "10.96.0.10".parse().unwrap(), reply_sport: 53 },
            ]
        );
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
        let flow =
            |dst: &str, dport, src: &str| Flow { dst: dst.parse().unwrap(), dport, reply_src: src.parse().unwrap(), reply_sport: 5353 };
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
