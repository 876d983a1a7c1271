//! Connections kube-proxy translated, adopted at a takeover. Without this, a connection that
//! netfilter's DNAT sent to a backend meets our programs once they serve its Service with no
//! flow of ours: it is balanced afresh and reset unless it lands on the same backend.
//!
//! So when the eBPF mode starts over kube-proxy's rules, each frontend's first write seeds the
//! conntrack map with the connections the kernel's conntrack table shows netfilter DNATed to
//! one of the frontend's backends (and translated nothing else: `conntrack::parse_translated`),
//! before the frontend's master entry makes our programs serve it. Their next packet then goes
//! to the same backend, by our programs. Right after the master, each such connection's
//! netfilter entry is deleted: it still holds the DNAT and its reply tuple, and to netfilter
//! the packet our programs translated (client -> backend) is a new connection whose reply tuple
//! that entry holds; its NAT then moves the packet's source port to keep tuples unique, and the
//! backend resets what it takes for a stranger's segment. Without the old entry it is tracked
//! afresh as the connection it is (mid-stream TCP, as nf_conntrack_tcp_loose allows by
//! default).
//!
//! Not adopted: a connection opened between the table's last read (at the first frontend's
//! write, as late as it can be, and again each second during a long first write) and its
//! frontend's master; masqueraded connections (a pod reaching
//! itself, outside clients of externalTrafficPolicy Cluster), whose node port kube-proxy chose
//! and our programs do not track; and the node's own processes' connections, which netfilter's
//! entry goes on translating (our programs translate pods' and outside clients' packets). And a packet that comes between its frontend's master and the
//! deletion of its entry meets the port move above: the deletions go in batches of requests
//! (`netlink::request_batch`), a few syscalls a frontend, to keep that window short; the log
//! gives the time they took (`deleting_netfilter_entries_us`).

use std::{
    collections::{HashMap, HashSet},
    io,
    net::{IpAddr, SocketAddr},
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    time::{Duration, Instant},
};

use proxy_common::{
    csum,
    ct::{flags, l4_csum},
    ct_filter as filter,
    user::MapAddr,
    CtEntry, CtKey,
};

use super::{batch, ct_filter, ct_gc, lbmaps::Adopt};
use crate::{
    dataplane::netfilter::conntrack::{self, Forgetter, Translated},
    model::{self, Family, FrontendKey},
};

/// Whether netfilter tracks a TCP connection it meets in mid-stream (the kernel's default, 1),
/// as each adopted connection is once its old entry is deleted.
const TCP_LOOSE: &str = "/proc/sys/net/netfilter/nf_conntrack_tcp_loose";

/// How old the table's last read may be at a frontend's write: a first write of 30,000 Services
/// takes seconds, during which kube-proxy's rules go on translating new connections to the
/// frontends not yet written.
const REREAD: Duration = Duration::from_secs(1);

/// The connections to adopt after a read of the table (`read`), by Service address: the read's,
/// less those of frontends already served (`served`), whose masters are written. Also the number
/// of connections the previous pending set (`old`) held for served frontends, which no seed
/// adopted (their backend was not the frontend's) and which the new set drops.
fn pending_after_read(
    old: Option<HashMap<(SocketAddr, u8), Vec<Translated>>>,
    mut read: HashMap<(SocketAddr, u8), Vec<Translated>>,
    served: &HashSet<(SocketAddr, u8)>,
) -> (usize, HashMap<(SocketAddr, u8), Vec<Translated>>) {
    let dropped = old.iter().flatten().filter(|(k, _)| served.contains(k)).map(|(_, v)| v.len()).sum();
    read.retain(|k, _| !served.contains(k));
    (dropped, read)
}

/// The addresses of this network namespace's interfaces (none where they cannot be read).
fn local_addresses() -> HashSet<IpAddr> {
    let mut out = HashSet::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a list that is freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return out;
    }
    let mut p = list;
    while !p.is_null() {
        // SAFETY: a node of the list getifaddrs made, alive until freeifaddrs; its address, where
        // there is one, is a sockaddr of the family it names.
        unsafe {
            let ifa = &*p;
            if !ifa.ifa_addr.is_null() {
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                        out.insert(IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                        out.insert(IpAddr::from(sin6.sin6_addr.s6_addr));
                    }
                    _ => {}
                }
            }
            p = ifa.ifa_next;
        }
    }
    // SAFETY: the list getifaddrs made, not used after.
    unsafe { libc::freeifaddrs(list) };
    out
}

/// One family's adoption, from the first frontend written to the end of the first sync.
pub struct Adoption<A> {
    family: Family,
    /// The translated connections not adopted yet, by (Service address, protocol); read at the
    /// first `seed`.
    pending: Option<HashMap<(SocketAddr, u8), Vec<Translated>>>,
    ct: OwnedFd,
    marker: ct_filter::Marker,
    /// Seeded for the frontend being written: their netfilter entries go once it is served.
    seeded: Vec<Translated>,
    forgetter: Option<Forgetter>,
    adopted: usize,
    /// Connections whose tuple one of ours already held.
    taken: usize,
    /// Conntrack entries of adopted connections that could not be deleted.
    unforgotten: usize,
    /// Seeded for a frontend whose master could not be written (taken out again).
    unserved: usize,
    /// Time the deletions of netfilter's entries took, all frontends: what a frontend's takes
    /// is the window in which its connections' packets meet both.
    forgetting: Duration,
    /// When the table was last read (`REREAD`).
    read_at: Option<Instant>,
    /// Frontends whose master is written: what a later read finds for them is not adopted.
    served: HashSet<(SocketAddr, u8)>,
    /// The frontend `seed` was last called for.
    current: Option<(SocketAddr, u8)>,
    /// Connections to served frontends a read found that no seed adopted (their backend
    /// unknown to the frontend).
    not_adopted: usize,
    /// Keeps the agent's periodic filter rebuild (and expiry) off while entries are inserted
    /// from here: a rebuild clears a half and walks the map, which an insert from here could
    /// fall between.
    _lock: Option<ct_filter::RebuildLock>,
    _a: std::marker::PhantomData<A>,
}

impl<A: MapAddr + filter::Addr + csum::Words> Adoption<A> {
    /// `ct` and `filter`: the family's conntrack map and conntrack filter.
    pub fn new(family: Family, ct: BorrowedFd<'_>, filter: BorrowedFd<'_>, lock: Option<ct_filter::RebuildLock>) -> io::Result<Self> {
        Ok(Self {
            family,
            pending: None,
            ct: ct.try_clone_to_owned()?,
            marker: ct_filter::Marker::of(filter)?,
            seeded: Vec::new(),
            forgetter: None,
            adopted: 0,
            taken: 0,
            unforgotten: 0,
            unserved: 0,
            read_at: None,
            served: HashSet::new(),
            current: None,
            not_adopted: 0,
            forgetting: Duration::ZERO,
            _lock: lock,
            _a: std::marker::PhantomData,
        })
    }

    fn read_table(&mut self) -> HashMap<(SocketAddr, u8), Vec<Translated>> {
        let mut by_service: HashMap<(SocketAddr, u8), Vec<Translated>> = HashMap::new();
        match conntrack::list_translated(self.family) {
            Ok(list) => {
                // The node's own processes' connections stay netfilter's: our programs translate
                // pods' and outside clients' packets, and would let a host process's leave
                // untranslated once its netfilter entry were gone; that entry goes on
                // translating them.
                let local = local_addresses();
                list.into_iter()
                    .filter(|t| !local.contains(&t.client.ip()))
                    .for_each(|t| by_service.entry((t.service, t.proto)).or_default().push(t))
            }
            // (Said once: the reads again during a long first write would repeat it.)
            Err(e) if self.read_at.is_none() => tracing::warn!(
                family = %self.family,
                error = %e,
                "connections kube-proxy translated are not adopted (the conntrack table could not be read): each is balanced afresh \
                 on its next packet, and reset unless it reaches the same backend"
            ),
            Err(e) => tracing::debug!(family = %self.family, error = %e, "the conntrack table could not be read again"),
        }
        let n: usize = by_service.values().map(Vec::len).sum();
        let first = self.read_at.is_none();
        self.read_at = Some(Instant::now());
        if !first {
            tracing::debug!(family = %self.family, connections = n, "read the connections netfilter translated again");
            return by_service;
        }
        tracing::info!(family = %self.family, connections = n, "read the connections netfilter translated, to adopt at the first write");
        let tcp = by_service.keys().any(|(_, proto)| *proto == libc::IPPROTO_TCP as u8);
        if tcp && std::fs::read_to_string(TCP_LOOSE).is_ok_and(|v| v.trim() == "0") {
            tracing::warn!(
                family = %self.family,
                "{TCP_LOOSE} is 0: netfilter takes the packets of adopted TCP connections for INVALID (it picks up no connection in \
                 mid-stream), so a rule that drops INVALID packets stalls them; set it to 1 (the kernel's default) for the takeover"
            );
        }
        by_service
    }

    /// The forward (client -> Service) and reply (backend -> client) keys of `t`.
    fn keys(t: &Translated) -> io::Result<(CtKey<A>, CtKey<A>)> {
        let addr = |s: SocketAddr| A::from_ip(s.ip()).ok_or_else(|| io::Error::other(format!("{s} is not of the family")));
        let (client, service, backend) = (addr(t.client)?, addr(t.service)?, addr(t.backend)?);
        let port = |s: SocketAddr| s.port().to_be_bytes();
        Ok((
            CtKey { saddr: client, daddr: service, sport: port(t.client), dport: port(t.service), proto: t.proto, _pad: 0, _pad2: 0 },
            CtKey { saddr: backend, daddr: client, sport: port(t.backend), dport: port(t.client), proto: t.proto, _pad: 0, _pad2: 0 },
        ))
    }

    /// Inserts the reply and forward entries of `t`, as the datapath makes them for a new flow
    /// (`proxy_ebpf::ct::create`) that has seen a reply. False: a tuple of it is taken.
    fn insert(&self, t: &Translated, service_id: u32, backend_id: u32, now: u64) -> io::Result<bool> {
        let (fwd, reply) = Self::keys(t)?;
        let (client, service, backend) = (fwd.saddr, fwd.daddr, reply.saddr);
        let port = |s: SocketAddr| s.port().to_be_bytes();
        self.marker.mark(&fwd);
        self.marker.mark(&reply);
        let mut e = CtEntry::<A> {
            last_seen_ns: now,
            backend_id,
            service_id,
            flags: flags::REPLY | flags::SEEN_REPLY,
            l4_csum: l4_csum::UNKNOWN,
            nat_port: port(t.service),
            nat_addr: service,
            ..Default::default()
        };
        if !batch::put_back(self.ct.as_fd(), &reply, &e)? {
            return Ok(false);
        }
        e.flags = flags::SEEN_REPLY;
        e.nat_port = port(t.backend);
        e.nat_addr = backend;
        e.addr_sum = csum::address_pair(client, service);
        e.addr_delta = csum::address_delta(service, backend);
        if !batch::put_back(self.ct.as_fd(), &fwd, &e)? {
            let _ = batch::take::<CtKey<A>, CtEntry<A>>(self.ct.as_fd(), &reply);
            return Ok(false);
        }
        Ok(true)
    }
}

impl<A: MapAddr + filter::Addr + csum::Words> Adopt for Adoption<A> {
    fn seed(&mut self, frontend: &FrontendKey, service_id: u32, backends: &[(model::Backend, u32)]) {
        let mut pending = match self.pending.take() {
            Some(p) if self.read_at.is_some_and(|at| at.elapsed() < REREAD) => p,
            old => {
                // (Again during a long first write: kube-proxy's rules go on translating new
                // connections to the frontends not written yet.)
                let read = self.read_table();
                let (served, fresh) = pending_after_read(old, read, &self.served);
                self.not_adopted += served;
                fresh
            }
        };
        let key = (SocketAddr::new(frontend.addr, frontend.port), frontend.protocol.ipproto());
        self.current = Some(key);
        if let Some(flows) = pending.remove(&key) {
            let now = ct_gc::monotonic_coarse_ns();
            // A connection whose backend this scope lacks may be the other scope's.
            let mut left = Vec::new();
            for t in flows {
                let Some((_, id)) = backends.iter().find(|(b, _)| SocketAddr::new(b.addr, b.port) == t.backend) else {
                    left.push(t);
                    continue;
                };
                match self.insert(&t, service_id, *id, now) {
                    Ok(true) => self.seeded.push(t),
                    Ok(false) => self.taken += 1,
                    Err(e) => {
                        tracing::warn!(frontend = %frontend, client = %t.client, error = %e, "could not adopt a connection netfilter translated");
                    }
                }
            }
            if !left.is_empty() {
                pending.insert(key, left);
            }
        }
        self.pending = Some(pending);
    }

    fn settle(&mut self, served: bool) {
        if let (true, Some(key)) = (served, self.current.take()) {
            self.served.insert(key);
        }
        if !served {
            // Taken out again: served later, while netfilter's entries are still there, they
            // would meet the port move (see the module's notes).
            for t in self.seeded.drain(..) {
                if let Ok((fwd, reply)) = Self::keys(&t) {
                    let _ = batch::take::<CtKey<A>, CtEntry<A>>(self.ct.as_fd(), &fwd);
                    let _ = batch::take::<CtKey<A>, CtEntry<A>>(self.ct.as_fd(), &reply);
                }
                self.unserved += 1;
            }
        }
        if self.seeded.is_empty() {
            return;
        }
        if self.forgetter.is_none() {
            match Forgetter::new() {
                Ok(f) => self.forgetter = Some(f),
                Err(e) => tracing::warn!(error = %e, "ctnetlink: cannot delete the conntrack entries of adopted connections"),
            }
        }
        let seeded = std::mem::take(&mut self.seeded);
        self.adopted += seeded.len();
        let started = Instant::now();
        let results = match self.forgetter.as_mut().map(|f| f.forget_all(&seeded)) {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "ctnetlink: the conntrack entries of adopted connections could not be deleted");
                self.unforgotten += seeded.len();
                return;
            }
            None => {
                self.unforgotten += seeded.len();
                return;
            }
        };
        self.forgetting += started.elapsed();
        for (t, r) in seeded.iter().zip(results) {
            if let Err(e) = r {
                self.unforgotten += 1;
                tracing::debug!(client = %t.client, error = %e, "could not delete an adopted connection's conntrack entry");
            }
        }
    }

    fn end(&mut self) {
        let Some(pending) = self.pending.take() else { return };
        let not_served = pending.values().map(Vec::len).sum::<usize>() + self.unserved + self.not_adopted;
        tracing::info!(
            family = %self.family,
            adopted = self.adopted,
            not_served,
            taken = self.taken,
            deleting_netfilter_entries_us = self.forgetting.as_micros() as u64,
            "adopted the connections netfilter translated to endpoints we serve; the rest (their Service or endpoint gone, or a \
             tuple already tracked) are balanced afresh on their next packet"
        );
        if self.unforgotten > 0 {
            tracing::warn!(
                family = %self.family,
                connections = self.unforgotten,
                "the conntrack entries of some adopted connections could not be deleted: netfilter moves their source port, and \
                 their backends reset them"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(client_port: u16, service: &str) -> Translated {
        Translated {
            proto: libc::IPPROTO_TCP as u8,
            client: SocketAddr::new("10.244.0.2".parse().unwrap(), client_port),
            service: service.parse().unwrap(),
            backend: "10.244.1.3:8080".parse().unwrap(),
        }
    }

    /// A read during the first write keeps what it finds for frontends not written yet (new
    /// connections kube-proxy's rules translated meanwhile among them), and drops the served
    /// frontends', counting those the previous set still held.
    #[test]
    fn a_read_again_keeps_only_the_frontends_not_served_yet() {
        let key = |s: &str| (s.parse::<SocketAddr>().unwrap(), libc::IPPROTO_TCP as u8);
        let (web, api) = (key("10.96.0.10:80"), key("10.96.0.20:443"));
        let old: HashMap<_, _> = [(web, vec![t(40000, "10.96.0.10:80")]), (api, vec![t(40001, "10.96.0.20:443")])].into();
        let read: HashMap<_, _> =
            [(web, vec![t(40000, "10.96.0.10:80")]), (api, vec![t(40001, "10.96.0.20:443"), t(40002, "10.96.0.20:443")])].into();
        let served: HashSet<_> = [web].into();
        let (dropped, pending) = pending_after_read(Some(old), read, &served);
        assert_eq!(dropped, 1, "the served frontend's connection no seed adopted");
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[&api].len(), 2, "the new connection to the frontend not yet written is in");
        let (dropped, pending) = pending_after_read(None, pending, &HashSet::new());
        assert_eq!((dropped, pending.len()), (0, 1), "a first read keeps everything");
    }
}
