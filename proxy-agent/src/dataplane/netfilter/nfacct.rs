//! kube-proxy's packet counters in iptables mode: named nfacct objects (the kernel's extended
//! accounting, `nfnetlink_acct`) that its rules count into with `-m nfacct`, read back for the
//! `kubeproxy_iptables_*_packets_total` metrics. Spoken to over netfilter netlink directly (no
//! `nfacct` tool needed); each object lives in the node's network namespace.

use std::io;

use super::nfnetlink;

/// Packets dropped as conntrack INVALID (`kubeproxy_iptables_ct_state_invalid_dropped_packets_total`).
pub const CT_STATE_INVALID: &str = "ct_state_invalid_dropped_pkts";
/// Packets accepted to localhost NodePorts (`kubeproxy_iptables_localhost_nodeports_accepted_packets_total`).
pub const LOCALHOST_NODEPORTS: &str = "localhost_nps_accepted_pkts";
/// Both, with their metric names and help texts (kube-proxy's).
pub const COUNTERS: [(&str, &str, &str); 2] = [
    (
        CT_STATE_INVALID,
        "kubeproxy_iptables_ct_state_invalid_dropped_packets",
        "packets dropped by iptables to work around conntrack problems",
    ),
    (
        LOCALHOST_NODEPORTS,
        "kubeproxy_iptables_localhost_nodeports_accepted_packets",
        "Number of packets accepted on nodeports of loopback interface",
    ),
];

const NFNL_SUBSYS_ACCT: u16 = 7;
const NFNL_MSG_ACCT_NEW: u16 = 0;
const NFNL_MSG_ACCT_GET: u16 = 1;
const NFNL_MSG_ACCT_DEL: u16 = 3;
const NFACCT_NAME: u16 = 1;
const NFACCT_PKTS: u16 = 2;
/// The kernel's limit on an object's name, with its NUL.
const NFACCT_NAME_MAX: usize = 32;

/// One request: netlink header, nfgenmsg (family unspecified, version 0), the name attribute.
pub fn request(kind: u16, flags: u16, name: &str, seq: u32) -> Vec<u8> {
    let mut attr = Vec::new();
    let value_len = name.len() + 1;
    attr.extend_from_slice(&((4 + value_len) as u16).to_ne_bytes());
    attr.extend_from_slice(&NFACCT_NAME.to_ne_bytes());
    attr.extend_from_slice(name.as_bytes());
    attr.push(0);
    while attr.len() % 4 != 0 {
        attr.push(0);
    }
    let len = 16 + 4 + attr.len();
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(&(len as u32).to_ne_bytes());
    msg.extend_from_slice(&((NFNL_SUBSYS_ACCT << 8) | kind).to_ne_bytes());
    msg.extend_from_slice(&(flags | libc::NLM_F_REQUEST as u16 | libc::NLM_F_ACK as u16).to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    msg.extend_from_slice(&attr);
    msg
}

/// What the kernel answered: an object's packet count (a GET), and the ack's error (0: done).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Answer {
    pub packets: Option<u64>,
    pub error: i32,
}

/// Reads the kernel's messages in `buf` (one datagram), into `answer`. True once the ack came.
pub fn parse(buf: &[u8], answer: &mut Answer) -> bool {
    for m in nfnetlink::messages(buf) {
        let Some((kind, body)) = m else {
            // A message cut short: nothing can be taken from it, not even an ack.
            answer.error = -libc::EIO;
            return true;
        };
        if kind == libc::NLMSG_ERROR as u16 {
            answer.error = nfnetlink::error_of(body);
            return true;
        }
        if kind == libc::NLMSG_DONE as u16 {
            return true;
        }
        if kind == (NFNL_SUBSYS_ACCT << 8) | NFNL_MSG_ACCT_NEW && body.len() >= 4 {
            for (atype, value) in nfnetlink::attributes(body) {
                if atype == NFACCT_PKTS && value.len() >= 8 {
                    answer.packets = Some(u64::from_be_bytes(value[..8].try_into().unwrap()));
                }
            }
        }
    }
    false
}

/// Sends one request and waits for its ack (at most a second).
fn exchange(kind: u16, flags: u16, name: &str) -> io::Result<Answer> {
    if name.len() >= NFACCT_NAME_MAX {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("nfacct name {name:?} is too long")));
    }
    let msg = request(kind, flags, name, 1);
    let mut answer = Answer::default();
    nfnetlink::exchange(&msg, |datagram| parse(datagram, &mut answer))?;
    if answer.error != 0 {
        return Err(io::Error::from_raw_os_error(-answer.error));
    }
    Ok(answer)
}

/// Creates the object unless it exists (as kube-proxy ensures its counters).
pub fn ensure(name: &str) -> io::Result<()> {
    match exchange(NFNL_MSG_ACCT_NEW, (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16, name) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        other => other.map(|_| ()),
    }
}

/// The object's packet count.
pub fn packets(name: &str) -> io::Result<u64> {
    exchange(NFNL_MSG_ACCT_GET, 0, name)?.packets.ok_or_else(|| io::Error::other(format!("nfacct {name}: no packet count in the answer")))
}

/// Deletes the object; one that rules still use (EBUSY) or that is gone (ENOENT) is left.
pub fn delete(name: &str) -> io::Result<bool> {
    match exchange(NFNL_MSG_ACCT_DEL, 0, name) {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::EBUSY)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Ensures both of kube-proxy's counters; the error names what failed (the kernel lacks
/// `nfnetlink_acct`, say), and then the rules are written without them, as kube-proxy does.
pub fn ensure_all() -> Result<(), String> {
    for (name, _, _) in COUNTERS {
        ensure(name).map_err(|e| format!("nfacct object {name}: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_a_netlink_message_with_the_name_attribute() {
        let m = request(NFNL_MSG_ACCT_GET, 0, "abc", 7);
        assert_eq!(m.len(), 16 + 4 + 8, "header, nfgenmsg, attribute of 4 + 4 bytes");
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()) as usize, m.len());
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), (7 << 8) | 1, "subsystem acct, GET");
        assert_eq!(u32::from_ne_bytes(m[8..12].try_into().unwrap()), 7, "sequence");
        assert_eq!(u16::from_ne_bytes(m[20..22].try_into().unwrap()), 8, "attribute length: header and \"abc\\0\"");
        assert_eq!(u16::from_ne_bytes(m[22..24].try_into().unwrap()), NFACCT_NAME);
        assert_eq!(&m[24..28], b"abc\0");
    }

    #[test]
    fn answers_give_the_packet_count_and_the_error() {
        // An ACCT_NEW message holding NAME and PKTS (big-endian 42), then the ack.
        let mut body = vec![0u8, 0, 0, 0];
        body.extend_from_slice(&8u16.to_ne_bytes());
        body.extend_from_slice(&NFACCT_NAME.to_ne_bytes());
        body.extend_from_slice(b"abc\0");
        body.extend_from_slice(&12u16.to_ne_bytes());
        body.extend_from_slice(&NFACCT_PKTS.to_ne_bytes());
        body.extend_from_slice(&42u64.to_be_bytes());
        let mut buf = Vec::new();
        buf.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
        buf.extend_from_slice(&(NFNL_SUBSYS_ACCT << 8).to_ne_bytes());
        buf.extend_from_slice(&[0; 10]);
        buf.extend_from_slice(&body);
        let mut a = Answer::default();
        assert!(!parse(&buf, &mut a), "no ack yet");
        assert_eq!(a.packets, Some(42));
        let mut ack = Vec::new();
        ack.extend_from_slice(&36u32.to_ne_bytes());
        ack.extend_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
        ack.extend_from_slice(&[0; 10]);
        ack.extend_from_slice(&(-libc::ENOENT).to_ne_bytes());
        ack.extend_from_slice(&[0; 16]);
        assert!(parse(&ack, &mut a));
        assert_eq!(a.error, -libc::ENOENT);
    }
}
