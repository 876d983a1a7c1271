//! Backends that answer with their own name over TCP and UDP, and the client side of the
//! conversation. Every blocking call has a timeout so a broken dataplane fails a test instead
//! of hanging it.

use std::{
    io::{self, BufRead, BufReader, Write},
    net::{Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::{self, JoinHandle},
    time::Duration,
};

use crate::netns::Netns;

pub const TIMEOUT: Duration = Duration::from_secs(3);
const POLL: Duration = Duration::from_millis(20);

/// A backend's TCP and UDP servers. They answer each request line / datagram with
/// `<name> <peer-address>`, so a test sees which backend answered and whom it saw.
pub struct Backend {
    pub name: String,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Backend {
    pub fn start(ns: &Netns, name: &str, tcp_port: u16, udp_port: u16) -> Self {
        Self::start_on(ns, name, std::net::Ipv4Addr::UNSPECIFIED.into(), tcp_port, udp_port)
    }

    /// The same on address `ip` (`::` for IPv6: dual-stack, so not on a port an IPv4 server
    /// of the namespace holds).
    pub fn start_on(ns: &Netns, name: &str, ip: std::net::IpAddr, tcp_port: u16, udp_port: u16) -> Self {
        let (tcp, udp) = ns.run(move || {
            let tcp = TcpListener::bind((ip, tcp_port)).expect("bind TCP");
            let udp = UdpSocket::bind((ip, udp_port)).expect("bind UDP");
            (tcp, udp)
        });
        tcp.set_nonblocking(true).unwrap();
        udp.set_read_timeout(Some(POLL)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let (n, s) = (name.to_string(), stop.clone());
        threads.push(thread::spawn(move || serve_tcp(tcp, n, s)));
        let (n, s) = (name.to_string(), stop.clone());
        threads.push(thread::spawn(move || serve_udp(udp, n, s)));
        Self { name: name.into(), stop, threads }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve_tcp(listener: TcpListener, name: String, stop: Arc<AtomicBool>) {
    let mut conns = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let (n, s) = (name.clone(), stop.clone());
                conns.push(thread::spawn(move || serve_conn(stream, peer, n, s)));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(POLL),
            Err(_) => thread::sleep(POLL),
        }
    }
    for c in conns {
        let _ = c.join();
    }
}

fn serve_conn(stream: TcpStream, peer: SocketAddr, name: String, stop: Arc<AtomicBool>) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(POLL));
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    while !stop.load(Ordering::Relaxed) {
        match reader.read_line(&mut line) {
            Ok(0) => return,
            Ok(_) if line.ends_with('\n') => {
                // (One write, one segment: pieces would wait on each other's acknowledgement.)
                if writer.write_all(format!("{name} {peer}\n").as_bytes()).is_err() {
                    return;
                }
                line.clear();
            }
            Ok(_) => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
    let _ = writer.shutdown(Shutdown::Both);
}

fn serve_udp(sock: UdpSocket, name: String, stop: Arc<AtomicBool>) {
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        if let Ok((_, peer)) = sock.recv_from(&mut buf) {
            let _ = sock.send_to(format!("{name} {peer}").as_bytes(), peer);
        }
    }
}

/// What a backend answered: its name and the client address it saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub backend: String,
    pub peer: SocketAddr,
}

fn parse_answer(text: &str) -> io::Result<Answer> {
    let mut it = text.split_whitespace();
    let (Some(backend), Some(peer)) = (it.next(), it.next()) else {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("unexpected answer {text:?}")));
    };
    let peer = peer.parse().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{e}: {text:?}")))?;
    Ok(Answer { backend: backend.into(), peer })
}

/// A TCP connection from the client namespace.
pub struct Conn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Conn {
    /// Connects from inside `ns`.
    pub fn open(ns: &Netns, to: impl Into<SocketAddr>) -> io::Result<Self> {
        let to = to.into();
        ns.run(move || Self::here(to))
    }

    /// Connects from the namespace of the calling thread.
    pub fn here(to: SocketAddr) -> io::Result<Self> {
        let stream = TcpStream::connect_timeout(&to, TIMEOUT)?;
        stream.set_read_timeout(Some(TIMEOUT))?;
        stream.set_write_timeout(Some(TIMEOUT))?;
        Ok(Self { writer: stream.try_clone()?, reader: BufReader::new(stream) })
    }

    /// The same connection, waiting up to `timeout` for each read and write.
    pub fn patient(self, timeout: Duration) -> io::Result<Self> {
        // (Both halves are the one socket.)
        self.writer.set_read_timeout(Some(timeout))?;
        self.writer.set_write_timeout(Some(timeout))?;
        Ok(self)
    }

    /// Sends a request line and reads the answer.
    pub fn ask(&mut self) -> io::Result<Answer> {
        // (One write, one segment: see `serve_tcp`.)
        self.writer.write_all(b"hello\n")?;
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed"));
        }
        parse_answer(line.trim())
    }
}

/// A socket in `ns` bound to `port` with SO_REUSEADDR, so several sockets may share the port
/// as long as their peers differ (what a client reusing its source port towards two Services
/// does).
fn bound_socket(ns: &Netns, kind: libc::c_int, port: u16) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd as _;
    ns.run(move || {
        // SAFETY: plain socket calls on a descriptor this function owns from creation on.
        unsafe {
            let fd = libc::socket(libc::AF_INET, kind | libc::SOCK_CLOEXEC, 0);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let fd = std::os::fd::OwnedFd::from_raw_fd(fd);
            let one: libc::c_int = 1;
            let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
            if libc::setsockopt(
                raw,
                libc::SOL_SOCKET,
                libc::SO_REUSEADDR,
                (&one as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as u32,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as u16;
            sa.sin_port = port.to_be();
            if libc::bind(raw, (&sa as *const libc::sockaddr_in).cast(), size_of::<libc::sockaddr_in>() as u32) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(fd)
        }
    })
}

impl Conn {
    /// Connects from inside `ns`, from source port `port` (shared with other sockets).
    pub fn open_from_port(ns: &Netns, port: u16, to: SocketAddrV4) -> io::Result<Self> {
        let fd = bound_socket(ns, libc::SOCK_STREAM, port)?;
        let stream = TcpStream::from(fd);
        // Set before connecting, it bounds the connect too (SO_SNDTIMEO): a SYN nothing
        // answers gives up after TIMEOUT, not after the kernel's two minutes of retries.
        stream.set_write_timeout(Some(TIMEOUT))?;
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: to.port().to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(*to.ip()).to_be() },
            sin_zero: [0; 8],
        };
        // SAFETY: connect on the stream's own descriptor with a valid address.
        if unsafe {
            libc::connect(
                std::os::fd::AsRawFd::as_raw_fd(&stream),
                (&sa as *const libc::sockaddr_in).cast(),
                size_of::<libc::sockaddr_in>() as u32,
            )
        } != 0
        {
            return Err(io::Error::last_os_error());
        }
        stream.set_read_timeout(Some(TIMEOUT))?;
        Ok(Self { writer: stream.try_clone()?, reader: BufReader::new(stream) })
    }
}

impl UdpFlow {
    /// A connected UDP flow from source port `port` (shared with other sockets).
    pub fn open_from_port(ns: &Netns, port: u16, to: SocketAddrV4) -> io::Result<Self> {
        let sock = UdpSocket::from(bound_socket(ns, libc::SOCK_DGRAM, port)?);
        sock.set_read_timeout(Some(TIMEOUT))?;
        sock.connect(to)?;
        Ok(Self(sock))
    }
}

/// One TCP request on a fresh connection.
pub fn tcp_ask(ns: &Netns, to: SocketAddrV4) -> io::Result<Answer> {
    Conn::open(ns, to)?.ask()
}

/// One TCP request on a fresh connection, to an address of either family.
pub fn tcp_ask_any(ns: &Netns, to: SocketAddr) -> io::Result<Answer> {
    Conn::open(ns, to)?.ask()
}

/// One UDP request; returns the answer and the address it came from.
pub fn udp_ask(ns: &Netns, to: SocketAddrV4) -> io::Result<(Answer, SocketAddr)> {
    udp_ask_any(ns, to.into())
}

/// The same to an address of either family.
pub fn udp_ask_any(ns: &Netns, to: SocketAddr) -> io::Result<(Answer, SocketAddr)> {
    let sock = ns.run(move || UdpSocket::bind(if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }))?;
    sock.set_read_timeout(Some(TIMEOUT))?;
    sock.send_to(b"hello", to)?;
    let mut buf = [0u8; 2048];
    let (n, from) = sock.recv_from(&mut buf)?;
    Ok((parse_answer(&String::from_utf8_lossy(&buf[..n]))?, from))
}

/// A UDP flow that keeps its socket, as a DNS resolver does: every request has the same
/// 5-tuple.
pub struct UdpFlow(UdpSocket);

impl UdpFlow {
    pub fn open(ns: &Netns, to: impl Into<SocketAddr>) -> io::Result<Self> {
        let to = to.into();
        let sock = ns.run(move || UdpSocket::bind(if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }))?;
        sock.set_read_timeout(Some(TIMEOUT))?;
        sock.connect(to)?;
        Ok(Self(sock))
    }

    pub fn ask(&self) -> io::Result<Answer> {
        self.0.send(b"hello")?;
        let mut buf = [0u8; 2048];
        let n = self.0.recv(&mut buf)?;
        parse_answer(&String::from_utf8_lossy(&buf[..n]))
    }
}

/// Asks again and again with `ask` (every fifth of a millisecond: six such askers on two
/// cores, unpaused, starve an agent beside them) until `stop`: how many answers came, each from
/// where the first (`first`) came and seeing the same peer; the first that did not, or failed,
/// as an error naming `what`.
pub fn ask_until(stop: &AtomicBool, what: &str, first: &Answer, mut ask: impl FnMut() -> io::Result<Answer>) -> Result<u64, String> {
    let mut asked = 0u64;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_micros(200));
        match ask() {
            Ok(a) if (&a.backend, a.peer) == (&first.backend, first.peer) => asked += 1,
            Ok(a) => return Err(format!("{what} ({first:?}) moved after {asked} answers: {a:?}")),
            Err(e) => return Err(format!("{what} ({first:?}) failed after {asked} answers: {e}")),
        }
    }
    Ok(asked)
}

/// A UDP request on a connected socket, so ICMP errors surface as errors (ECONNREFUSED).
pub fn udp_ask_connected(ns: &Netns, to: impl Into<SocketAddr>) -> io::Result<Answer> {
    UdpFlow::open(ns, to)?.ask()
}

/// A plain HTTP/1.0 GET from inside `ns`: (status code, body).
pub fn http_get(ns: &Netns, addr: SocketAddrV4, path: &str) -> io::Result<(u16, String)> {
    http_get_with_headers(ns, addr, path).map(|(c, _, b)| (c, b))
}

/// As `http_get`, with the response headers (names lower-cased).
pub fn http_get_with_headers(
    ns: &Netns,
    addr: SocketAddrV4,
    path: &str,
) -> io::Result<(u16, std::collections::BTreeMap<String, String>, String)> {
    use std::io::Read as _;
    let mut stream = ns.run(move || TcpStream::connect_timeout(&addr.into(), TIMEOUT))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("not an HTTP response: {text:?}")))?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let headers = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok((code, headers, body.to_string()))
}

/// A listener in a namespace that accepts every connection, writes `greeting` on it (if any)
/// and closes it, polling every `poll`; stopped and joined when dropped, also when a test fails.
pub struct Acceptor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    pub fn start(ns: &Netns, at: SocketAddr, greeting: Option<String>, poll: Duration) -> Self {
        let listener = ns.run(move || TcpListener::bind(at)).unwrap_or_else(|e| panic!("bind {at}: {e}"));
        listener.set_nonblocking(true).expect("a non-blocking listener");
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut conn, _)) => {
                        if let Some(g) = &greeting {
                            // A greeting larger than the socket buffer waits for the peer: never
                            // for ever (a connection that stalls must not hang the test's end).
                            let _ = conn.set_write_timeout(Some(Duration::from_secs(10)));
                            let _ = conn.write_all(g.as_bytes());
                        }
                    }
                    Err(_) => thread::sleep(poll),
                }
            }
        });
        Self { stop, thread: Some(thread) }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
