//! A host-network process for the lab: joins a cgroup and a network namespace, then asks a
//! server once and prints what happened, for tests of the socket hooks (a process, because a
//! cgroup holds whole processes).
//!
//! `proxy-host-client CGROUP_DIR NETNS_FILE tcp|udp ADDR:PORT` prints
//! `ok <backend> <peer the backend saw> <peer this socket reports>` or `err <io::ErrorKind>`;
//! `udp-many` sends 10 datagrams from one unconnected socket and prints `ok <how many backends
//! answered> <their names>`.

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
        // Unconnected: sendto/recvfrom, as a resolver's first query.
        let s = UdpSocket::bind("0.0.0.0:0")?;
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
    let to: SocketAddr = to.parse().expect("ADDR:PORT");
    if proto == "udp-many" {
        let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
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
