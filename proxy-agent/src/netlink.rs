//! Interfaces and their addresses (both families) coming and going, from rtnetlink: the
//! current state, then every change.

use std::net::IpAddr;

use futures::{StreamExt, TryStreamExt};
use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::{
    address::{AddressAttribute, AddressFlags, AddressMessage, AddressScope},
    link::{LinkAttribute, LinkMessage},
    RouteNetlinkMessage,
};
use netlink_sys::{AsyncSocket, SocketAddr};
use tokio::sync::mpsc;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkChange {
    /// A link exists (new, renamed, or changed state).
    Present {
        index: u32,
        name: String,
    },
    Gone {
        index: u32,
    },
    /// An address was added to (or removed from, or changed on) interface `index`. `global`:
    /// scope universe (not host or link scope). `source`: what it is good for as a source.
    Address {
        index: u32,
        addr: IpAddr,
        global: bool,
        source: SourceUse,
        added: bool,
    },
}

/// An address as a source address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SourceUse {
    /// One the kernel picks itself.
    Preferred,
    /// One it picks only when nothing better is there: an IPv4 secondary, a temporary IPv6
    /// address (the same flag) or a deprecated one.
    Fallback,
    /// Not to be used at all: still tentative (duplicate address detection not done) or
    /// failed it (the address is another host's).
    Never,
}

fn address_of(msg: &AddressMessage, added: bool) -> Option<LinkChange> {
    // IFA_LOCAL is the interface's own address on point-to-point links; IFA_ADDRESS otherwise
    // (IPv6 sends IFA_ADDRESS only).
    let addr = msg
        .attributes
        .iter()
        .find_map(|a| match a {
            AddressAttribute::Local(a) => Some(*a),
            _ => None,
        })
        .or_else(|| {
            msg.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(a) => Some(*a),
                _ => None,
            })
        })?;
    // IFA_FLAGS holds all 32 bits where present; the header the first eight.
    let flags = msg
        .attributes
        .iter()
        .find_map(|a| match a {
            AddressAttribute::Flags(f) => Some(*f),
            _ => None,
        })
        .unwrap_or_else(|| AddressFlags::from_bits_retain(u32::from(msg.header.flags.bits())));
    let source = if flags.intersects(AddressFlags::Tentative | AddressFlags::Dadfailed) {
        SourceUse::Never
    } else if flags.intersects(AddressFlags::Secondary | AddressFlags::Deprecated) {
        SourceUse::Fallback
    } else {
        SourceUse::Preferred
    };
    Some(LinkChange::Address { index: msg.header.index, addr, global: msg.header.scope == AddressScope::Universe, source, added })
}

fn name_of(msg: &LinkMessage) -> Option<String> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    })
}

/// Subscribes to link and address changes, then lists what exists. Subscribing first means a
/// change during the listing is not missed (it may be reported twice, which is harmless).
/// Returns the links and, as `LinkChange::Address` events, their addresses.
pub async fn watch(tx: mpsc::Sender<LinkChange>) -> std::io::Result<(Vec<(u32, String)>, Vec<LinkChange>)> {
    let (mut conn, handle, mut messages) = rtnetlink::new_connection()?;
    let groups = rtnetlink::constants::RTMGRP_LINK | rtnetlink::constants::RTMGRP_IPV4_IFADDR | rtnetlink::constants::RTMGRP_IPV6_IFADDR;
    conn.socket_mut().socket_mut().bind(&SocketAddr::new(0, groups))?;
    tokio::spawn(conn);
    let mut links = Vec::new();
    let mut dump = handle.link().get().execute();
    while let Some(msg) = dump.try_next().await.map_err(std::io::Error::other)? {
        if let Some(name) = name_of(&msg) {
            links.push((msg.header.index, name));
        }
    }
    let mut addrs = Vec::new();
    let mut dump = handle.address().get().execute();
    while let Some(msg) = dump.try_next().await.map_err(std::io::Error::other)? {
        addrs.extend(address_of(&msg, true));
    }
    tokio::spawn(async move {
        // Keep the handle alive with the task: dropping it closes the connection.
        let _handle = handle;
        while let Some((msg, _)) = messages.next().await {
            let change = match msg.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(m)) => {
                    name_of(&m).map(|name| LinkChange::Present { index: m.header.index, name })
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(m)) => Some(LinkChange::Gone { index: m.header.index }),
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewAddress(m)) => address_of(&m, true),
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelAddress(m)) => address_of(&m, false),
                _ => None,
            };
            if let Some(c) = change {
                if tx.send(c).await.is_err() {
                    return;
                }
            }
        }
        tracing::error!("the netlink link watch ended; new interfaces will not be attached");
    });
    Ok((links, addrs))
}

// Raw netlink requests, for the families the netlink crates do not cover (generic netlink's
// netdev family in `xdpdevs`, ctnetlink in the netfilter modes' `conntrack`).

pub const NLM_F_REQUEST: u16 = 1;
pub const NLM_F_ACK: u16 = 4;
pub const NLM_F_DUMP: u16 = 0x300;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// The flag a nested attribute's type carries.
pub const NLA_F_NESTED: u16 = 0x8000;

/// One attribute: length, type, value, padded to 4 bytes.
pub fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut v = Vec::with_capacity(len.next_multiple_of(4));
    v.extend_from_slice(&(len as u16).to_ne_bytes());
    v.extend_from_slice(&kind.to_ne_bytes());
    v.extend_from_slice(value);
    v.resize(len.next_multiple_of(4), 0);
    v
}

/// The attributes of `payload` (a message's attributes, or a nested attribute's value), their
/// types without the nested and byte-order flags.
pub fn attrs(payload: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut rest = payload;
    std::iter::from_fn(move || {
        let len = u16::from_ne_bytes([*rest.first()?, *rest.get(1)?]) as usize;
        let kind = u16::from_ne_bytes([*rest.get(2)?, *rest.get(3)?]) & 0x3fff;
        let value = rest.get(4..len)?;
        rest = rest.get(len.next_multiple_of(4)..).unwrap_or(&[]);
        Some((kind, value))
    })
}

/// Appends a netlink message to `msg`: its header (type `kind`, `flags`, sequence number `seq`,
/// port 0), its family header `header` and `body`.
fn put_message(msg: &mut Vec<u8>, kind: u16, flags: u16, seq: u32, header: [u8; 4], body: &[u8]) {
    msg.extend_from_slice(&((20 + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(&header);
    msg.extend_from_slice(body);
}

/// Sends one request of type `kind`, whose family header (generic netlink's command and
/// version, netfilter's address family and version) is `header`, and returns the payloads of
/// the replies after their netlink header (a dump's until NLMSG_DONE; with NLM_F_ACK, none,
/// and the kernel's error as the error).
pub fn request(socket: &mut netlink_sys::Socket, kind: u16, flags: u16, header: [u8; 4], body: &[u8]) -> std::io::Result<Vec<Vec<u8>>> {
    use std::io;
    let mut msg = Vec::with_capacity(20 + body.len());
    put_message(&mut msg, kind, flags, 1, header, body);
    socket.send(&msg, 0)?;
    let mut out = Vec::new();
    loop {
        let (buf, _) = socket.recv_from_full()?;
        let mut rest = &buf[..];
        while rest.len() >= 16 {
            let len = u32::from_ne_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
            let kind = u16::from_ne_bytes([rest[4], rest[5]]);
            if len < 16 || len > rest.len() {
                return Err(io::Error::other("truncated netlink message"));
            }
            match kind {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let code = i32::from_ne_bytes(rest[16..20].try_into().expect("4 bytes"));
                    return if code == 0 { Ok(out) } else { Err(io::Error::from_raw_os_error(-code)) };
                }
                _ => out.push(rest[16..len].to_vec()),
            }
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        }
        if flags & NLM_F_DUMP == 0 {
            return Ok(out);
        }
    }
}

/// Messages `request_batch` sends in one write: their errors (a few hundred bytes each) must
/// fit the socket's receive buffer.
const BATCH: usize = 64;

/// One request of `request_batch`: its message type, its flags besides NLM_F_REQUEST and
/// NLM_F_ACK, its family header and its body.
pub struct Request {
    pub kind: u16,
    pub flags: u16,
    pub header: [u8; 4],
    pub body: Vec<u8>,
}

/// Sends `requests` in writes of `BATCH`, in their order, with an acknowledgement asked for
/// only on the last of each write (the kernel answers the others only when they fail), and
/// returns each request's result: 0 or the kernel's error number. A few syscalls for many
/// requests, so that a batch takes effect within microseconds.
pub fn request_batch(socket: &mut netlink_sys::Socket, requests: &[Request]) -> std::io::Result<Vec<i32>> {
    use std::io;
    let mut codes = vec![0; requests.len()];
    for (c, chunk) in requests.chunks(BATCH).enumerate() {
        let first = c * BATCH;
        let mut msg = Vec::new();
        for (i, Request { kind, flags, header, body }) in chunk.iter().enumerate() {
            let flags = NLM_F_REQUEST | flags | if i + 1 == chunk.len() { NLM_F_ACK } else { 0 };
            // Sequence numbers from 1: the index of the request, plus one.
            put_message(&mut msg, *kind, flags, (first + i + 1) as u32, *header, body);
            msg.resize(msg.len().next_multiple_of(4), 0);
        }
        socket.send(&msg, 0)?;
        let last = (first + chunk.len()) as u32;
        'acks: loop {
            let (buf, _) = socket.recv_from_full()?;
            let mut rest = &buf[..];
            while rest.len() >= 20 {
                let len = u32::from_ne_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
                if len < 16 || len > rest.len() {
                    return Err(io::Error::other("truncated netlink message"));
                }
                let seq = u32::from_ne_bytes(rest[8..12].try_into().expect("4 bytes"));
                if u16::from_ne_bytes([rest[4], rest[5]]) == NLMSG_ERROR {
                    let code = i32::from_ne_bytes(rest[16..20].try_into().expect("4 bytes"));
                    if let Some(slot) = (seq as usize).checked_sub(1).and_then(|i| codes.get_mut(i)) {
                        *slot = -code;
                    }
                    if seq == last {
                        break 'acks;
                    }
                }
                rest = &rest[len.next_multiple_of(4).min(rest.len())..];
            }
        }
    }
    Ok(codes)
}
