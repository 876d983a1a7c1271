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
//! backend resets what it takes for a stranger's segment (a UDP flow's port stays moved). The
//! entry is made again at once as our translation leaves it (`Forgetter::replace_all`: client ->
//! backend, answered): tracked afresh from whichever packet came first, a pod's reply to an
//! outside client would be a new connection that a CNI's masquerade of pods' traffic
//! translates (and with nf_conntrack_tcp_loose 0 no TCP connection is picked up in
//! mid-stream). Until its entry is replaced, a connection is at its handover
//! (`ct::owner::HANDOVER`, a millisecond or so, a second at most): our programs drop its
//! packets both ways (TCP sends them again; a UDP client asks again, as for any datagram
//! lost). Busy connections (a packet every millisecond) were otherwise reset, and busy UDP
//! flows moved port; passed on to netfilter instead, a UDP datagram met kube-proxy's rules
//! once the old entry was gone, and was balanced afresh.
//!
//! A connection netfilter masqueraded as well (an outside client of a NodePort or
//! load-balancer IP of externalTrafficPolicy Cluster, a pod reaching itself, `masqueradeAll`)
//! is not adopted: its source went out as the node's address and a port netfilter chose among
//! its own, which our programs' SNAT (remote backends only, from `--snat-port-range`) does not
//! reproduce for every backend. It is left to netfilter instead: its conntrack entry keeps its
//! NAT with kube-proxy's rules gone, so the seed marks both tuples it reaches the hooks with
//! (the client's, and the backend's reply to the masquerading address) as netfilter's
//! (`ct::owner::NETFILTER`), before the master as well, and the hooks pass its packets to the
//! stack untouched until it ends. Its netfilter entry stays. As under kube-proxy, a UDP flow of
//! them whose endpoint is removed is balanced afresh (kube-proxy deletes such a flow's
//! netfilter entry; the hooks track it as new, beside that entry), and a TCP connection stays
//! with its endpoint.
//!
//! A connection opened between the table's last read (at the first frontend's write, and
//! again each second during a long first write) and its frontend's master has no entry of ours
//! when its next packet comes. From the first read until the adoption ends, the datapath holds
//! back (drops) a TCP segment of a connection under way that no entry tracks
//! (`ct::ADOPTING_V4`, `drop_adopt_pending`) instead of balancing it afresh; the next read
//! (within a second, and one more as the first sync ends) finds the connection to a served
//! frontend and adopts it as above (`adopt_late`), and TCP's retransmission then reaches the
//! backend it had. A UDP flow of them is balanced afresh by its next datagram, which may move
//! it (nothing tells a UDP flow's later datagram from a new flow's first).
//!
//! A read finds only connections that were answered (netfilter's entry has seen a reply): one
//! whose SYN kube-proxy's rules translated just before its frontend's master, and whose backend
//! answered after the read at the first sync's end, would be found by no read. So the adoption
//! ends with a trailing read, at least `TRAIL` after the first sync's end (at the agent's next
//! housekeeping, every `agent::HOUSEKEEPING`: `Adopt::trail`), and the hold lasts until then.
//! Once our programs serve a frontend, kube-proxy's rules translate no new connection to it:
//! what the trailing read misses is a handshake that took longer than that. A frontend written
//! again or removed meanwhile is not adopted to by it (its ids may have changed: `forget`).
//!
//! Not taken over: the node's own processes' connections, which netfilter's entry goes
//! on translating (our programs translate pods' and outside clients' packets). The deletions
//! go in batches of requests (`netlink::request_batch`), a few syscalls a frontend, to keep
//! the handover short; the log gives the time they took (`replacing_netfilter_entries_us`).

use std::{
    collections::{HashMap, HashSet},
    io,
    net::{IpAddr, SocketAddr},
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    time::{Duration, Instant},
};

use proxy_common::{
    csum,
    ct::{self, flags, l4_csum, owner},
    ct_filter as filter,
    user::MapAddr,
    CtEntry, CtKey,
};

use super::{batch, ct_filter, ct_gc, lbmaps::Adopt};
use crate::{
    dataplane::netfilter::{
        conntrack::{self, Forgetter, Translated},
        NetfilterError,
    },
    model::{self, Family, FrontendKey},
};

/// How old the table's last read may be at a frontend's write: a first write of 30,000 Services
/// takes seconds, during which kube-proxy's rules go on translating new connections to the
/// frontends not yet written.
const REREAD: Duration = Duration::from_secs(1);

/// How long after the first sync's end the trailing read comes at the earliest (see the
/// module's notes): longer than a handshake on a node's network takes.
const TRAIL: Duration = Duration::from_secs(1);

/// How long the hold lasts from the first sync's end: until the trailing read (`TRAIL`, then at
/// the agent's next housekeeping), and a second more.
const TRAILING_HOLD: Duration = Duration::from_secs(TRAIL.as_secs() + crate::agent::HOUSEKEEPING.as_secs() + 1);

/// A read of the table (`read`), by Service address, split: the connections to frontends
/// already served (`served`, whose masters are written), which the adoption takes at once
/// (`adopt_late`), and the rest, adopted as their frontends are written.
type ByService = HashMap<(SocketAddr, u8), Vec<Translated>>;
fn split_read(read: ByService, served: &HashSet<(SocketAddr, u8)>) -> (ByService, ByService) {
    read.into_iter().partition(|(k, _)| served.contains(k))
}

/// A frontend as written: the reverse NAT id of its first scope written, and its endpoints,
/// both scopes: (their scope's reverse NAT id, the endpoint's id) by endpoint.
type Written = (u32, HashMap<SocketAddr, (u32, u32)>);

/// One family's adoption, from the first frontend written to its trailing read after the first
/// sync (`Adopt::trail`).
pub struct Adoption<A> {
    family: Family,
    /// The node's addresses: connections from them are its own processes', which stay
    /// netfilter's (see `read_table`).
    node_addresses: HashSet<IpAddr>,
    /// The translated connections to frontends not served yet, by (Service address, protocol).
    pending: ByService,
    /// When the table was last read (`REREAD`); None before the first frontend's write.
    read_at: Option<Instant>,
    /// How the table is read (`conntrack::list_translated`; a test's own: `reading_with`).
    list: fn(Family) -> Result<Vec<Translated>, NetfilterError>,
    /// The first read failed: no read is tried again, and nothing is held back.
    unreadable: bool,
    /// When the first sync ended (`Adopt::end`): the trailing read is due `TRAIL` later.
    ended_at: Option<Instant>,
    /// Frontends whose master is written: what a later read finds for them was opened after
    /// the read before (its TCP segments are held back meanwhile: `ct::ADOPTING_V4`), and is
    /// adopted at once (`adopt_late`).
    served: HashSet<(SocketAddr, u8)>,
    /// Each frontend as written, for the connections a later read finds.
    written: HashMap<(SocketAddr, u8), Written>,
    ct: OwnedFd,
    /// `map_names::ADOPTING`, and the family's slot of it.
    adopting: (OwnedFd, u32),
    marker: ct_filter::Marker,
    /// Seeded for the frontend being written, with their forward and reply keys: their
    /// netfilter entries go once it is served.
    seeded: Vec<(Translated, [CtKey<A>; 2])>,
    forgetter: Option<Forgetter>,
    adopted: usize,
    /// Of them, those a read found after their frontend was served.
    late: usize,
    /// Of those, the trailing read's: their backend answered after the first sync's end.
    trailing: usize,
    /// Masqueraded connections left to netfilter.
    left: usize,
    /// Connections whose tuple one of ours already held.
    taken: usize,
    /// Connections found to a frontend that no seed adopted: their backend is not one of its
    /// endpoints, or its master could not be written (their entries taken out again).
    not_served: usize,
    /// netfilter's entries of adopted connections that could not be deleted or made again.
    unreplaced: usize,
    /// Time the replacement of netfilter's entries took, all frontends: what a frontend's
    /// takes is about how long its connections' packets are held back.
    replacing: Duration,
    /// Keeps the agent's periodic filter rebuild (and expiry) off while entries are inserted
    /// from here: a rebuild clears a half and walks the map, which an insert from here could
    /// fall between.
    _lock: Option<ct_filter::RebuildLock>,
}

impl<A: MapAddr + filter::Addr + csum::Words> Adoption<A> {
    /// `ct` and `filter`: the family's conntrack map and conntrack filter; `adopting`:
    /// `map_names::ADOPTING`; `node_addresses`: the node's (`Devices::node_addresses`).
    pub fn new(
        family: Family,
        [ct, filter, adopting]: [BorrowedFd<'_>; 3],
        node_addresses: HashSet<IpAddr>,
        lock: Option<ct_filter::RebuildLock>,
    ) -> io::Result<Self> {
        let slot = match family {
            Family::V4 => ct::ADOPTING_V4,
            Family::V6 => ct::ADOPTING_V6,
        };
        Ok(Self {
            family,
            node_addresses,
            pending: HashMap::new(),
            read_at: None,
            list: conntrack::list_translated,
            unreadable: false,
            ended_at: None,
            served: HashSet::new(),
            written: HashMap::new(),
            ct: ct.try_clone_to_owned()?,
            adopting: (adopting.try_clone_to_owned()?, slot),
            marker: ct_filter::Marker::of(filter)?,
            seeded: Vec::new(),
            forgetter: None,
            adopted: 0,
            late: 0,
            trailing: 0,
            left: 0,
            taken: 0,
            not_served: 0,
            unreplaced: 0,
            replacing: Duration::ZERO,
            _lock: lock,
        })
    }

    /// The same adoption reading its table from `list` (a test's).
    pub fn reading_with(self, list: fn(Family) -> Result<Vec<Translated>, NetfilterError>) -> Self {
        Self { list, ..self }
    }

    /// Sets until when the datapath holds back TCP segments to served frontends that no entry
    /// tracks (`ct::ADOPTING_V4`; 0: no more).
    fn hold_until(&self, until: u64) {
        let (fd, slot) = &self.adopting;
        if let Err(e) = batch::replace(fd.as_fd(), slot, &until) {
            tracing::warn!(family = %self.family, error = %e, "could not set how long connections opened during the takeover are held back");
        }
    }

    /// None: the table could not be read (now or before).
    fn read_table(&mut self) -> Option<ByService> {
        if self.unreadable {
            return None;
        }
        let first = self.read_at.is_none();
        // Held back from before the read: a connection the read misses was opened after it.
        self.hold_until(ct_gc::monotonic_coarse_ns() + ct::ADOPTING_HOLD_NS);
        let read = (self.list)(self.family);
        self.read_at = Some(Instant::now());
        let list = match read {
            Ok(list) => list,
            // Not tried again, and nothing held back: no read would find what it held.
            Err(e) if first => {
                self.unreadable = true;
                self.hold_until(0);
                tracing::warn!(
                    family = %self.family,
                    error = %e,
                    "connections kube-proxy translated are not adopted (the conntrack table could not be read): each is balanced \
                     afresh on its next packet, and reset unless it reaches the same backend"
                );
                return None;
            }
            // Let go: no read since adopts what is held (each failed one would set the hold
            // again). The next read that succeeds holds back again.
            Err(e) => {
                self.hold_until(0);
                tracing::debug!(family = %self.family, error = %e, "the conntrack table could not be read again");
                return None;
            }
        };
        // And for as long again from its end: a read of a large table can take seconds.
        self.hold_until(ct_gc::monotonic_coarse_ns() + ct::ADOPTING_HOLD_NS);
        // The node's own processes' connections stay netfilter's: our programs translate pods'
        // and outside clients' packets, and would let a host process's leave untranslated once
        // its netfilter entry were gone; that entry goes on translating them.
        let mut by_service = ByService::new();
        list.into_iter()
            .filter(|t| !t.client.ip().is_loopback() && !self.node_addresses.contains(&t.client.ip()))
            .for_each(|t| by_service.entry((t.service, t.proto)).or_default().push(t));
        let n: usize = by_service.values().map(Vec::len).sum();
        if first {
            tracing::info!(family = %self.family, connections = n, "read the connections netfilter translated, to adopt at the first write");
        } else {
            tracing::debug!(family = %self.family, connections = n, "read the connections netfilter translated again");
        }
        Some(by_service)
    }

    /// Inserts the forward and reply entries of `t`, as the datapath makes them for a new flow
    /// (`proxy_ebpf::ct::create`) that has seen a reply; their keys. None: a tuple of it is
    /// taken.
    fn insert(&self, t: &Translated, service_id: u32, backend_id: u32, now: u64) -> io::Result<Option<[CtKey<A>; 2]>> {
        let (client, service, backend) = (addr::<A>(t.client)?, addr::<A>(t.service)?, addr::<A>(t.backend)?);
        let fwd = tuple(t.proto, (client, t.client), (service, t.service));
        let forward = CtEntry::<A> {
            last_seen_ns: now,
            backend_id,
            service_id,
            flags: flags::SEEN_REPLY,
            // Not translated by our programs until netfilter's entry is replaced (`settle`).
            owner: owner::HANDOVER,
            l4_csum: l4_csum::UNKNOWN,
            nat_port: t.backend.port().to_be_bytes(),
            nat_addr: backend,
            addr_sum: csum::address_pair(client, service),
            addr_delta: csum::address_delta(service, backend),
            ..Default::default()
        };
        let reply = ct::reply_key_of(&fwd, &forward, A::HAIRPIN);
        let reverse = CtEntry::<A> {
            flags: flags::REPLY | flags::SEEN_REPLY,
            nat_port: fwd.dport,
            nat_addr: service,
            addr_sum: csum::address_pair(reply.saddr, reply.daddr),
            addr_delta: csum::address_delta(backend, service),
            ..forward
        };
        self.marker.mark(&fwd);
        self.marker.mark(&reply);
        self.put_pair([(reply, reverse), (fwd, forward)])
    }

    /// Marks the two tuples of the masqueraded connection `t` (to the node's `masquerade`) as
    /// netfilter's (see the module's notes), with its endpoint as the id `backend_id` names it
    /// (a UDP flow whose endpoint is removed is then balanced afresh, as kube-proxy clears its
    /// netfilter entry). None: a tuple of it is taken.
    fn leave(
        &self,
        t: &Translated,
        masquerade: SocketAddr,
        service_id: u32,
        backend_id: u32,
        now: u64,
    ) -> io::Result<Option<[CtKey<A>; 2]>> {
        let (client, service) = (addr::<A>(t.client)?, addr::<A>(t.service)?);
        let (backend, node) = (addr::<A>(t.backend)?, addr::<A>(masquerade)?);
        let e = CtEntry::<A> {
            last_seen_ns: now,
            backend_id,
            service_id,
            flags: flags::SEEN_REPLY,
            nat_port: t.backend.port().to_be_bytes(),
            nat_addr: backend,
            owner: owner::NETFILTER,
            ..Default::default()
        };
        let keys = [tuple(t.proto, (backend, t.backend), (node, masquerade)), tuple(t.proto, (client, t.client), (service, t.service))];
        for k in &keys {
            self.marker.mark(k);
        }
        self.put_pair(keys.map(|k| (k, e)))
    }

    /// Inserts two entries where their keys are free, the first first; neither if a key is
    /// taken (None).
    fn put_pair(&self, entries: [(CtKey<A>, CtEntry<A>); 2]) -> io::Result<Option<[CtKey<A>; 2]>> {
        let [(first, e1), (second, e2)] = entries;
        if !batch::put_back(self.ct.as_fd(), &first, &e1)? {
            return Ok(None);
        }
        if !batch::put_back(self.ct.as_fd(), &second, &e2)? {
            let _ = batch::take::<CtKey<A>, CtEntry<A>>(self.ct.as_fd(), &first);
            return Ok(None);
        }
        Ok(Some([second, first]))
    }
}

impl<A: MapAddr + filter::Addr + csum::Words> Adoption<A> {
    /// Deletes netfilter's entries of the adopted connections `flows`, and makes them again as
    /// our programs' translation leaves them (`Forgetter::replace_all`), counting the time it
    /// took and what could not be deleted or made.
    fn replace_entries(&mut self, flows: &[Translated]) {
        let started = Instant::now();
        let results = match self.forgetter.as_mut().map(|f| f.replace_all(flows)) {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "ctnetlink: the conntrack entries of adopted connections could not be replaced");
                self.unreplaced += flows.len();
                return;
            }
            None => {
                self.unreplaced += flows.len();
                return;
            }
        };
        self.replacing += started.elapsed();
        for (t, [deleted, made]) in flows.iter().zip(results) {
            if let Some(e) = deleted.err().or(made.err()) {
                self.unreplaced += 1;
                tracing::debug!(client = %t.client, error = %e, "could not replace an adopted connection's conntrack entry");
            }
        }
    }

    /// Replaces netfilter's entries of the connections `seeded` adopted (at their handover),
    /// then makes their entries ours.
    fn finish(&mut self, seeded: Vec<(Translated, [CtKey<A>; 2])>) {
        if seeded.is_empty() {
            return;
        }
        if self.forgetter.is_none() {
            match Forgetter::new() {
                Ok(f) => self.forgetter = Some(f),
                Err(e) => tracing::warn!(error = %e, "ctnetlink: cannot replace the conntrack entries of adopted connections"),
            }
        }
        let flows: Vec<Translated> = seeded.iter().map(|(t, _)| *t).collect();
        self.adopted += flows.len();
        self.replace_entries(&flows);
        // Ours from now on: their packets were held back while netfilter's entries were
        // replaced.
        for (t, keys) in &seeded {
            for k in keys {
                if let Err(e) = self.hand_over(k) {
                    tracing::debug!(client = %t.client, error = %e, "could not hand an adopted connection over (the datapath does in a second)");
                }
            }
        }
    }

    /// Adopts (or leaves to netfilter) the connections a read found to frontends already
    /// served (`late`) that no entry of ours tracks: opened after the read before, they met
    /// kube-proxy's rules, and their TCP segments since the master are held back
    /// (`ct::ADOPTING_V4`). Those whose endpoint the frontend lacks are counted as not served at
    /// the `last` read (before it, a later read finds them again).
    fn adopt_late(&mut self, late: ByService, last: bool) {
        let now = ct_gc::monotonic_coarse_ns();
        let mut seeded = Vec::new();
        for (key, flows) in late {
            for t in flows {
                let ours = (|| {
                    let (client, service) = (addr::<A>(t.client)?, addr::<A>(t.service)?);
                    batch::lookup::<_, CtEntry<A>>(self.ct.as_fd(), &tuple(t.proto, (client, t.client), (service, t.service)))
                })();
                if !matches!(ours, Ok(None)) {
                    // Tracked already (adopted, left, or a flow of ours since), or not of the family.
                    continue;
                }
                let Some((first_id, endpoints)) = self.written.get(&key) else {
                    self.not_served += usize::from(last);
                    continue;
                };
                let put = match (t.masquerade, endpoints.get(&t.backend)) {
                    // Left to netfilter whether or not the frontend has its endpoint, as `seed`
                    // leaves it (id 0 without).
                    (Some(masquerade), found) => {
                        let (service_id, id) = found.copied().unwrap_or((*first_id, 0));
                        self.leave(&t, masquerade, service_id, id, now).map(|k| k.map(|_| None))
                    }
                    (None, Some(&(service_id, id))) => self.insert(&t, service_id, id, now).map(|k| k.map(Some)),
                    (None, None) => {
                        self.not_served += usize::from(last);
                        continue;
                    }
                };
                match put {
                    Ok(Some(None)) => self.left += 1,
                    Ok(Some(Some(keys))) => seeded.push((t, keys)),
                    Ok(None) => self.taken += 1,
                    Err(e) => tracing::warn!(client = %t.client, error = %e, "could not adopt a connection netfilter translated"),
                }
            }
        }
        self.late += seeded.len();
        if last {
            self.trailing += seeded.len();
        }
        self.finish(seeded);
    }

    /// Makes the entry at `k`, seeded at its handover (`ct::owner::HANDOVER`), ours. Left if it
    /// is not at its handover any more (the datapath took it past its time).
    fn hand_over(&self, k: &CtKey<A>) -> io::Result<()> {
        match batch::lookup::<_, CtEntry<A>>(self.ct.as_fd(), k)? {
            Some(e) if e.owner == owner::HANDOVER => batch::replace(self.ct.as_fd(), k, &CtEntry { owner: owner::DATAPATH, ..e }),
            _ => Ok(()),
        }
    }
}

fn addr<A: MapAddr>(s: SocketAddr) -> io::Result<A> {
    A::from_ip(s.ip()).ok_or_else(|| io::Error::other(format!("{s} is not of the family")))
}

/// The conntrack key of a packet `from` -> `to` (each as the map holds the address, and as
/// given).
fn tuple<A>(proto: u8, (saddr, from): (A, SocketAddr), (daddr, to): (A, SocketAddr)) -> CtKey<A> {
    CtKey { saddr, daddr, sport: from.port().to_be_bytes(), dport: to.port().to_be_bytes(), proto, _pad: 0, _pad2: 0 }
}

impl<A: MapAddr + filter::Addr + csum::Words> Adopt for Adoption<A> {
    fn seed(&mut self, frontend: &FrontendKey, service_id: u32, backends: &[model::Backend], ids: &[u32]) {
        if self.ended_at.is_some() {
            // Written again after the first sync: only the trailing read is left, which must not
            // adopt with ids written before.
            self.forget(frontend);
            return;
        }
        let key = (SocketAddr::new(frontend.addr, frontend.port), frontend.protocol.ipproto());
        let (_, endpoints) = self.written.entry(key).or_insert_with(|| (service_id, HashMap::new()));
        endpoints.extend(backends.iter().zip(ids).map(|(b, id)| (SocketAddr::new(b.addr, b.port), (service_id, *id))));
        if self.read_at.is_none_or(|at| at.elapsed() >= REREAD) {
            // (Again during a long first write: kube-proxy's rules go on translating new
            // connections to the frontends not written yet.)
            let read = self.read_table().unwrap_or_default();
            let (late, fresh) = split_read(read, &self.served);
            self.pending = fresh;
            self.adopt_late(late, false);
        }
        let Some(flows) = self.pending.remove(&key) else { return };
        let now = ct_gc::monotonic_coarse_ns();
        // A connection whose backend this scope lacks may be the other scope's.
        let mut left = Vec::new();
        for t in flows {
            let found = backends.iter().position(|b| SocketAddr::new(b.addr, b.port) == t.backend);
            if let Some(masquerade) = t.masquerade {
                // (0 where this scope lacks its endpoint: no backend's id and address, so a UDP
                // flow of it is balanced afresh.)
                match self.leave(&t, masquerade, service_id, found.map_or(0, |i| ids[i]), now) {
                    Ok(Some(_)) => self.left += 1,
                    Ok(None) => self.taken += 1,
                    Err(e) => {
                        tracing::warn!(frontend = %frontend, client = %t.client, error = %e, "could not leave a masqueraded connection to netfilter")
                    }
                }
                continue;
            }
            let Some(i) = found else {
                left.push(t);
                continue;
            };
            match self.insert(&t, service_id, ids[i], now) {
                Ok(Some(keys)) => self.seeded.push((t, keys)),
                Ok(None) => self.taken += 1,
                Err(e) => {
                    tracing::warn!(frontend = %frontend, client = %t.client, error = %e, "could not adopt a connection netfilter translated")
                }
            }
        }
        if !left.is_empty() {
            self.pending.insert(key, left);
        }
    }

    fn settle(&mut self, frontend: &FrontendKey, served: bool) {
        if self.ended_at.is_some() {
            return;
        }
        if !served {
            // Taken out again: served later, while netfilter's entries are still there, they
            // would meet the port move (see the module's notes).
            for (_, keys) in self.seeded.drain(..) {
                for k in keys {
                    let _ = batch::take::<CtKey<A>, CtEntry<A>>(self.ct.as_fd(), &k);
                }
                self.not_served += 1;
            }
            return;
        }
        self.served.insert((SocketAddr::new(frontend.addr, frontend.port), frontend.protocol.ipproto()));
        let seeded = std::mem::take(&mut self.seeded);
        self.finish(seeded);
    }

    fn forget(&mut self, frontend: &FrontendKey) {
        let key = (SocketAddr::new(frontend.addr, frontend.port), frontend.protocol.ipproto());
        self.written.remove(&key);
    }

    fn end(&mut self) {
        if self.ended_at.is_some() {
            return;
        }
        // One more read (after one at least), for the connections opened since the one before
        // to frontends served since (held back meanwhile); held back on until the trailing read,
        // for those whose backend had not answered yet.
        if let Some(read) = self.read_at.and_then(|_| self.read_table()) {
            let (late, _) = split_read(read, &self.served);
            self.adopt_late(late, false);
            self.hold_until(ct_gc::monotonic_coarse_ns() + TRAILING_HOLD.as_nanos() as u64);
        }
        // From the read's end (a large table's takes seconds, and the housekeeping that came due
        // meanwhile comes at once): the trailing read is `TRAIL` after it.
        self.ended_at = Some(Instant::now());
    }

    fn trail(&mut self) -> bool {
        let Some(ended) = self.ended_at else { return false };
        if self.read_at.is_none() {
            return true;
        }
        if !self.unreadable && ended.elapsed() < TRAIL {
            return false;
        }
        // The trailing read: the connections answered since the read before to frontends served,
        // and the rest never served.
        let (late, never) = split_read(self.read_table().unwrap_or_default(), &self.served);
        self.adopt_late(late, true);
        self.hold_until(0);
        let not_served = never.values().map(Vec::len).sum::<usize>() + self.not_served;
        tracing::info!(
            family = %self.family,
            adopted = self.adopted,
            adopted_late = self.late,
            adopted_at_trailing_read = self.trailing,
            left_to_netfilter = self.left,
            not_served,
            taken = self.taken,
            replacing_netfilter_entries_us = self.replacing.as_micros() as u64,
            trailing_read_after_ms = ended.elapsed().as_millis() as u64,
            "adopted the connections netfilter translated to endpoints we serve, and left those it masqueraded to it; the rest \
             (their Service or endpoint gone, or a tuple already tracked) are balanced afresh on their next packet"
        );
        if self.unreplaced > 0 {
            tracing::warn!(
                family = %self.family,
                connections = self.unreplaced,
                "netfilter's entries of some adopted connections could not be deleted or made again: netfilter may move their \
                 source port, and their backends reset them"
            );
        }
        true
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
            masquerade: None,
        }
    }

    /// A read during the first write keeps for later what it finds for frontends not written
    /// yet (new connections kube-proxy's rules translated meanwhile among them), and gives the
    /// served frontends' apart, to adopt at once.
    #[test]
    fn a_read_again_sets_the_served_frontends_connections_apart() {
        let key = |s: &str| (s.parse::<SocketAddr>().unwrap(), libc::IPPROTO_TCP as u8);
        let (web, api, db) = (key("10.96.0.10:80"), key("10.96.0.20:443"), key("10.96.0.30:5432"));
        let read: ByService =
            [(web, vec![t(40000, "10.96.0.10:80")]), (api, vec![t(40001, "10.96.0.20:443"), t(40002, "10.96.0.20:443")])].into();
        let served: HashSet<_> = [web, db].into();
        let (late, pending) = split_read(read, &served);
        assert_eq!(late.keys().collect::<Vec<_>>(), [&web], "only the served frontend's, and only where the read found some");
        assert_eq!(late[&web].len(), 1);
        assert_eq!((pending.len(), pending[&api].len()), (1, 2), "the frontend not written yet keeps both");
        let (late, pending) = split_read(pending, &HashSet::new());
        assert_eq!((late.len(), pending.len()), (0, 1), "a first read keeps everything for later");
    }
}
