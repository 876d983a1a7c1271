//! A delay line for the SYN-ACKs a namespace sends: iptables' NFQUEUE target in the
//! namespace's OUTPUT chain hands each to a netfilter queue (`nfnetlink_queue`) that a thread
//! of this process reads, and the thread lets each go `delay` after it came. A handshake whose
//! backend answers late is what a takeover's trailing read is for; this kernel has no netem to
//! delay packets with (nor fq, whose departure times a program could set).

use std::{
    collections::VecDeque,
    io,
    os::fd::{AsRawFd, OwnedFd},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use proxy_agent::dataplane::netfilter::nfnetlink;

use crate::netns::Netns;

/// nfnetlink_queue's subsystem, its messages and attributes (linux/netfilter/nfnetlink_queue.h).
const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_VERDICT: u16 = 1;
const NFQNL_MSG_CONFIG: u16 = 2;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
const NF_ACCEPT: u32 = 1;

/// How often the reading thread looks at its stop flag and at what is due.
const TICK: Duration = Duration::from_millis(2);

/// SYN-ACKs of a namespace held back by `delay` each, until dropped (which lets those still
/// held go at once and takes the rule out).
pub struct SynAckDelay {
    ns: String,
    rule: Vec<String>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<io::Result<usize>>>,
}

impl SynAckDelay {
    /// Holds back each SYN-ACK that `ns` sends by `delay`, through netfilter queue `queue` of
    /// the namespace.
    pub fn start(ns: &Netns, queue: u16, delay: Duration) -> io::Result<Self> {
        // (A netlink socket belongs to the namespace it was made in.)
        let fd = ns.run(move || nfnetlink::socket(TICK))?;
        let config = |attr: (u16, &[u8])| {
            nfnetlink::message((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_CONFIG, libc::NLM_F_ACK as u16, libc::AF_UNSPEC as u8, queue, &[attr])
        };
        // (nfqnl_msg_config_cmd: the command, a pad byte, a protocol family the kernel ignores
        // since 3.8.)
        request(&fd, &config((NFQA_CFG_CMD, &[NFQNL_CFG_CMD_BIND, 0, 0, 0][..])))?;
        // (nfqnl_msg_config_params, packed: how much of the packet to copy, then the mode; the
        // packet's id is all this needs.)
        let mut params = 0u32.to_be_bytes().to_vec();
        params.push(NFQNL_COPY_META);
        request(&fd, &config((NFQA_CFG_PARAMS, &params)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || hold(&fd, queue, delay, &stop))
        };
        // (--queue-bypass: accepted where no socket reads the queue, as once this one is gone.)
        let queue = queue.to_string();
        let rule: Vec<String> =
            ["OUTPUT", "-p", "tcp", "--tcp-flags", "SYN,ACK", "SYN,ACK", "-j", "NFQUEUE", "--queue-num", queue.as_str(), "--queue-bypass"]
                .map(String::from)
                .to_vec();
        let this = Self { ns: ns.name.clone(), rule, stop, thread: Some(thread) };
        this.iptables("-A")?;
        Ok(this)
    }

    fn iptables(&self, op: &str) -> io::Result<()> {
        let out = std::process::Command::new("ip").args(["netns", "exec", &self.ns, "iptables-nft", op]).args(&self.rule).output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!("iptables-nft {op} {:?}: {}", self.rule, String::from_utf8_lossy(&out.stderr))));
        }
        Ok(())
    }

    /// Lets those still held go, takes the rule out, and says how many SYN-ACKs were held back.
    pub fn stop(mut self) -> io::Result<usize> {
        self.end().expect("stopped once")
    }

    fn end(&mut self) -> Option<io::Result<usize>> {
        let thread = self.thread.take()?;
        self.stop.store(true, Ordering::Relaxed);
        let held = thread.join().unwrap_or_else(|_| Err(io::Error::other("the delay line's thread panicked")));
        Some(self.iptables("-D").and(held))
    }
}

impl Drop for SynAckDelay {
    fn drop(&mut self) {
        let _ = self.end();
    }
}

/// Sends `msg` on `fd` and reads its ack.
fn request(fd: &OwnedFd, msg: &[u8]) -> io::Result<()> {
    let mut answer = Err(io::Error::other("no ack from nfnetlink_queue"));
    nfnetlink::exchange_on(fd, msg, |datagram| {
        if let Some(Some((kind, body))) = nfnetlink::messages(datagram).next() {
            if kind == libc::NLMSG_ERROR as u16 {
                answer = match nfnetlink::error_of(body) {
                    0 => Ok(()),
                    e => Err(io::Error::from_raw_os_error(-e)),
                };
            }
        }
        true
    })?;
    answer
}

/// Reads the queue until `stop`, letting each packet go `delay` after it came; then lets go
/// those still held. The number of packets held.
fn hold(fd: &OwnedFd, queue: u16, delay: Duration, stop: &AtomicBool) -> io::Result<usize> {
    let verdict = |id: u32| {
        let hdr = [NF_ACCEPT.to_be_bytes(), id.to_be_bytes()].concat();
        let msg =
            nfnetlink::message((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_VERDICT, 0, libc::AF_UNSPEC as u8, queue, &[(NFQA_VERDICT_HDR, &hdr)]);
        // SAFETY: a buffer of the size given.
        if unsafe { libc::send(fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    };
    let (mut held, mut count) = (VecDeque::<(Instant, u32)>::new(), 0);
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        while held.front().is_some_and(|(due, _)| *due <= Instant::now()) {
            verdict(held.pop_front().unwrap().1)?;
        }
        // SAFETY: a buffer of the size given.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => continue,
                // (Notifications lost: their packets are dropped when the socket closes.)
                _ if e.raw_os_error() == Some(libc::ENOBUFS) => continue,
                _ => return Err(e),
            }
        }
        for m in nfnetlink::messages(&buf[..n as usize]).flatten() {
            let (kind, body) = m;
            if kind != (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET {
                continue;
            }
            // (nfqnl_msg_packet_hdr: the packet's id first, big-endian.)
            let id = nfnetlink::attributes(body).find_map(|(t, v)| match (t, v.get(..4)) {
                (NFQA_PACKET_HDR, Some(id)) => Some(u32::from_be_bytes(id.try_into().unwrap())),
                _ => None,
            });
            if let Some(id) = id {
                held.push_back((Instant::now() + delay, id));
                count += 1;
            }
        }
    }
    for (_, id) in held {
        verdict(id)?;
    }
    Ok(count)
}
