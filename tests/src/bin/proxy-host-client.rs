//! A host-network process for the lab: joins a cgroup and a network namespace, then asks a
//! server once and prints what happened, for tests of the socket hooks (a process, because a
//! cgroup holds whole processes).
//!
//! `proxy-host-client CGROUP_DIR NETNS_FILE tcp|udp ADDR:PORT` prints
//! `ok <backend> <peer the backend saw> <peer this socket reports>` or `err <io::ErrorKind>`;
//! `udp-many` sends 10 datagrams from one unconnected socket and prints `ok <how many backends
//! answered> <their names>`. `tcp-same-port` and `udp-same-port` take `ADDR:PORT,ADDR:PORT`:
//! two connected sockets on one local port (SO_REUSEADDR), one to each; they print
//! `first=<answer|err-kind> second=<answer|err-kind> first-again=<answer|err-kind>
//! after-close=<answer|err-kind>` (answers as `<backend>/<peer seen>`; the last from a new
//! socket to the second address once the first socket is closed). `udp-two-services` takes `ADDR:PORT,ADDR:PORT` too: one unconnected
//! socket sends to both before it reads, then prints each answer as `<sender>=<backend>`.

use std::{
    fs,
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    time::Duration,
};

const TIMEOUT: Duration = Duration::from_secs(3);

fn ask(proto: &str, to: SocketAddr) -> std::io::Result<(String, SocketAddr)> {
    if proto == "tcp" {
        let s = TcpStream::connect_timeout(&to, TIMEOUT)?;
        s.set_read_timeout(Some(TIMEOUT))?;
        (&s).write_all(b"hello\n")?;
        let mut line = String::new();
        BufReader::new(&s).read_line(&mut line)?;
        Ok((line.trim().to_string(), s.peer_addr()?))
    } else {
        // Unconnected: sendto/recvfrom, as a resolver's first query. (An IPv6 socket for an
        // IPv6 address: an IPv4-mapped one reaches an IPv4 Service.)
        let s = UdpSocket::bind(if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" })?;
        s.set_read_timeout(Some(TIMEOUT))?;
        s.send_to(b"hello", to)?;
        let mut buf = [0u8; 512];
        let (n, from) = s.recv_from(&mut buf)?;
        Ok((String::from_utf8_lossy(&buf[..n]).trim().to_string(), from))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, cgroup, netns, proto, to] = &args[..] else {
        eprintln!("usage: proxy-host-client CGROUP_DIR NETNS_FILE tcp|udp ADDR:PORT");
        std::process::exit(2);
    };
    fs::write(format!("{cgroup}/cgroup.procs"), std::process::id().to_string()).expect("join the cgroup");
    let ns = fs::File::open(netns).expect("open the network namespace");
    // SAFETY: setns on a valid namespace fd; this process is single-threaded here.
    assert_eq!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns: {}", std::io::Error::last_os_error());
    if let Some((a, b)) = to.split_once(',') {
        let (a, b) = (a.parse().expect("ADDR:PORT"), b.parse().expect("ADDR:PORT"));
        match proto.as_str() {
            "tcp-same-port" => same_port(libc::SOCK_STREAM, a, b),
            "udp-same-port" => same_port(libc::SOCK_DGRAM, a, b),
            "udp-two-services" => two_services(a, b),
            other => panic!("{other} takes one ADDR:PORT"),
        }
        return;
    }
    let to: SocketAddr = to.parse().expect("ADDR:PORT");
    if proto == "udp-many" {
        let s = UdpSocket::bind(if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }).expect("bind");
        s.set_read_timeout(Some(TIMEOUT)).expect("timeout");
        let mut names = std::collections::BTreeSet::new();
        for _ in 0..10 {
            let mut buf = [0u8; 512];
            match s.send_to(b"hello", to).and_then(|_| s.recv_from(&mut buf)) {
                Ok((n, _)) => {
                    names.insert(String::from_utf8_lossy(&buf[..n]).split_whitespace().next().unwrap_or("").to_string());
                }
                Err(e) => {
                    println!("err {:?}", e.kind());
                    return;
                }
            }
        }
        println!("ok {} {}", names.len(), names.into_iter().collect::<Vec<_>>().join(" "));
        return;
    }
    match ask(proto, to) {
        Ok((answer, peer)) => println!("ok {answer} {peer}"),
        Err(e) => println!("err {:?}", e.kind()),
    }
}

/// A socket of `kind` (TCP or UDP) connected from local port `port`, shared (SO_REUSEADDR)
/// with other sockets.
fn connect_from(kind: i32, port: u16, to: SocketAddr) -> std::io::Result<fs::File> {
    use std::os::fd::FromRawFd as _;
    let SocketAddr::V4(to) = to else { return Err(std::io::ErrorKind::Unsupported.into()) };
    // SAFETY: plain socket calls on a descriptor owned by the returned file from creation on.
    unsafe {
        let fd = libc::socket(libc::AF_INET, kind | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = fs::File::from_raw_fd(fd);
        let one: libc::c_int = 1;
        let len = size_of::<libc::sockaddr_in>() as u32;
        let sa = |ip: u32, port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr { s_addr: ip.to_be() },
            sin_zero: [0; 8],
        };
        let (local, remote) = (sa(0, port), sa(u32::from(*to.ip()), to.port()));
        let timeout = libc::timeval { tv_sec: TIMEOUT.as_secs() as i64, tv_usec: 0 };
        if libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, (&one as *const libc::c_int).cast(), size_of::<libc::c_int>() as u32)
            != 0
            || libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                size_of::<libc::timeval>() as u32,
            ) != 0
            || libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) != 0
            || libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

/// One request on a connected socket of `kind` (a line over TCP, a datagram over UDP) and its
/// answer.
fn request(kind: i32, mut s: &fs::File) -> String {
    use std::io::Read as _;
    let mut answer = String::new();
    let read = s.write_all(b"hello\n").and_then(|()| {
        if kind == libc::SOCK_STREAM {
            BufReader::new(s).read_line(&mut answer)
        } else {
            let mut buf = [0u8; 512];
            let n = s.read(&mut buf)?;
            answer = String::from_utf8_lossy(&buf[..n]).into_owned();
            Ok(n)
        }
    });
    match read {
        Ok(0) => "err-UnexpectedEof".into(),
        Ok(_) => answer.split_whitespace().collect::<Vec<_>>().join("/"),
        Err(e) => format!("err-{:?}", e.kind()),
    }
}

fn same_port(kind: i32, a: SocketAddr, b: SocketAddr) {
    // A port of this run's own, below the ephemeral range (32768-60999 by default): a TCP
    // port a previous run closed lingers in TIME_WAIT.
    let port = 12000 + (std::process::id() % 20000) as u16;
    let first = connect_from(kind, port, a);
    let ask = |s: &fs::File| request(kind, s);
    let first_answer = first.as_ref().map(ask).unwrap_or_else(|e| format!("err-{:?}", e.kind()));
    let second = connect_from(kind, port, b).map(|s| ask(&s)).unwrap_or_else(|e| format!("err-{:?}", e.kind()));
    let again = first.as_ref().map(ask).unwrap_or_else(|e| format!("err-{:?}", e.kind()));
    // Once the first socket is closed, its tuple is free for the next one.
    drop(first);
    let after = connect_from(kind, port, b).map(|s| ask(&s)).unwrap_or_else(|e| format!("err-{:?}", e.kind()));
    println!("first={first_answer} second={second} first-again={again} after-close={after}");
}

/// One unconnected socket asks two Services at once, as a resolver asking two servers.
fn two_services(a: SocketAddr, b: SocketAddr) {
    let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
    s.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let mut out = Vec::new();
    for to in [a, b] {
        if let Err(e) = s.send_to(b"hello", to) {
            out.push(format!("{to}=err-{:?}", e.kind()));
        }
    }
    let mut buf = [0u8; 512];
    while out.len() < 2 {
        match s.recv_from(&mut buf) {
            Ok((n, from)) => out.push(format!("{from}={}", String::from_utf8_lossy(&buf[..n]).split_whitespace().next().unwrap_or(""))),
            Err(e) => out.push(format!("err-{:?}", e.kind())),
        }
    }
    out.sort();
    println!("{}", out.join(" "));
}
