//! One request to the kernel over netfilter netlink (`NETLINK_NETFILTER`) and its answers:
//! the socket, the send, and the datagrams read back until the caller has what it asked for.
//! nfacct's objects and the nf_tables table list (`nftables::tables`) are read this way.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::Duration,
};

const NETLINK_NETFILTER: i32 = 12;

/// Sends `msg` (one or more netlink messages) and hands every datagram the kernel answers with
/// to `datagram`, until it returns true (the answer is whole: an ack, a dump's end). A second
/// without a datagram is an error (`WouldBlock`).
pub fn exchange(msg: &[u8], datagram: impl FnMut(&[u8]) -> bool) -> io::Result<()> {
    exchange_on(&socket(Duration::from_secs(1))?, msg, datagram)
}

/// A netfilter netlink socket whose reads give up after `timeout` (`WouldBlock`): for a caller
/// that keeps one, as a queue's reader must (the queue is bound to the socket).
pub fn socket(timeout: Duration) -> io::Result<OwnedFd> {
    // SAFETY: a new socket, owned from here on.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, NETLINK_NETFILTER) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just made, and not owned elsewhere.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval { tv_sec: timeout.as_secs() as i64, tv_usec: i64::from(timeout.subsec_micros()) };
    // SAFETY: a timeval of the right size.
    if unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const timeout).cast(),
            size_of::<libc::timeval>() as u32,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// `exchange` on socket `fd` (`socket`).
pub fn exchange_on(fd: &OwnedFd, msg: &[u8], mut datagram: impl FnMut(&[u8]) -> bool) -> io::Result<()> {
    // SAFETY: the kernel as the peer (zeroed sockaddr_nl with its family).
    let sent = unsafe {
        let mut to: libc::sockaddr_nl = std::mem::zeroed();
        to.nl_family = libc::AF_NETLINK as u16;
        libc::sendto(fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0, (&raw const to).cast(), size_of::<libc::sockaddr_nl>() as u32)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    // (A dump's datagrams are at most a page or so each; a larger buffer takes them whole.)
    let mut buf = vec![0u8; 32768];
    loop {
        // SAFETY: a buffer of the size given.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if datagram(&buf[..n as usize]) {
            return Ok(());
        }
    }
}

/// A message's header fields and body, for each whole message in `buf`; None for one cut short
/// (the rest of the datagram cannot be read).
pub fn messages(buf: &[u8]) -> impl Iterator<Item = Option<(u16, &[u8])>> {
    let mut off = 0;
    std::iter::from_fn(move || {
        if off + 16 > buf.len() {
            return None;
        }
        let len = u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap()) as usize;
        let kind = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().unwrap());
        if len < 16 || off + len > buf.len() {
            off = buf.len();
            return Some(None);
        }
        let body = &buf[off + 16..off + len];
        off += (len + 3) & !3;
        Some(Some((kind, body)))
    })
}

/// The error an NLMSG_ERROR message's `body` carries (0: an ack; -EIO if cut short).
pub fn error_of(body: &[u8]) -> i32 {
    body.get(..4).map_or(-libc::EIO, |e| i32::from_ne_bytes(e.try_into().unwrap()))
}

/// The attributes (type without its flag bits, value) of a netfilter message's body after its
/// 4-byte `nfgenmsg`.
pub fn attributes(body: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut a = 4;
    std::iter::from_fn(move || {
        if a + 4 > body.len() {
            return None;
        }
        let alen = u16::from_ne_bytes(body[a..a + 2].try_into().unwrap()) as usize;
        let atype = u16::from_ne_bytes(body[a + 2..a + 4].try_into().unwrap()) & 0x3fff;
        if alen < 4 || a + alen > body.len() {
            return None;
        }
        let value = &body[a + 4..a + alen];
        a += (alen + 3) & !3;
        Some((atype, value))
    })
}

/// A netfilter message: the netlink header (`kind`, NLM_F_REQUEST and `flags`), `nfgenmsg`
/// (`family`, version 0, `res_id`) and the attributes (type, value), each padded to 4 bytes.
pub fn message(kind: u16, flags: u16, family: u8, res_id: u16, attrs: &[(u16, &[u8])]) -> Vec<u8> {
    let mut body = vec![family, 0];
    body.extend_from_slice(&res_id.to_be_bytes());
    for (t, value) in attrs {
        body.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
        body.extend_from_slice(&t.to_ne_bytes());
        body.extend_from_slice(value);
        while body.len() % 4 != 0 {
            body.push(0);
        }
    }
    let mut m = Vec::with_capacity(16 + body.len());
    m.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&(flags | libc::NLM_F_REQUEST as u16).to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&body);
    m
}

/// The nf_tables subsystem, and its batch's bounds.
pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;

/// Commits `commands` (nf_tables messages) as one transaction: Ok once the kernel acked every
/// one (each is sent asking for it), else its first error (the kernel then undoes them all).
pub fn nftables_batch(commands: &[Vec<u8>]) -> io::Result<()> {
    if commands.is_empty() {
        return Ok(());
    }
    let bound = |kind| message(kind, 0, libc::AF_UNSPEC as u8, NFNL_SUBSYS_NFTABLES, &[]);
    let mut batch = bound(NFNL_MSG_BATCH_BEGIN);
    for m in commands {
        let mut m = m.clone();
        // (The flags field, after the length and the type.)
        let flags = u16::from_ne_bytes([m[6], m[7]]) | libc::NLM_F_ACK as u16;
        m[6..8].copy_from_slice(&flags.to_ne_bytes());
        batch.extend(m);
    }
    batch.extend(bound(NFNL_MSG_BATCH_END));
    let (mut acks, mut error) = (0, 0);
    exchange(&batch, |datagram| {
        for m in messages(datagram) {
            let Some((kind, body)) = m else {
                error = -libc::EIO;
                return true;
            };
            if kind == libc::NLMSG_ERROR as u16 {
                acks += 1;
                error = error_of(body);
                if error != 0 {
                    return true;
                }
            }
        }
        acks == commands.len()
    })?;
    if error != 0 {
        return Err(io::Error::from_raw_os_error(-error));
    }
    Ok(())
}
