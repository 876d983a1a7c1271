//! kube-proxy's HTTP endpoints: `--metrics-bind-address` serves /metrics, /proxyMode and
//! /healthz ("ok"); `--healthz-bind-address` serves /healthz and /livez with kube-proxy's JSON.
//! A server that cannot bind is retried; the dataplane never waits for it.
//!
//! Every server here is bounded (`serve_bounded`): pods can reach the node's health port, and
//! a client that opens connections and never speaks must not exhaust the agent's descriptors.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    http::{header, StatusCode},
    response::IntoResponse,
    routing::get,
    Router,
};

use crate::telemetry::Telemetry;

fn json(code: u16, body: String) -> impl IntoResponse {
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        [(header::CONTENT_TYPE, "application/json"), (header::X_CONTENT_TYPE_OPTIONS, "nosniff")],
        body,
    )
}

pub fn metrics_router(t: Arc<Telemetry>) -> Router {
    let t2 = t.clone();
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let t = t.clone();
                async move { ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], t.encode()) }
            }),
        )
        .route("/proxyMode", get(move || std::future::ready(t2.mode())))
        .route("/healthz", get(|| async { "ok" }))
}

pub fn health_router(t: Arc<Telemetry>) -> Router {
    let t2 = t.clone();
    Router::new()
        .route(
            "/healthz",
            get(move || {
                let (code, body) = t.healthz();
                async move { json(code, body) }
            }),
        )
        .route(
            "/livez",
            get(move || {
                let (code, body) = t2.livez();
                async move { json(code, body) }
            }),
        )
}

/// Connections one server holds at once; a new one beyond closes the oldest.
pub const MAX_CONNECTIONS: usize = 64;
/// A request's headers must arrive within this.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// No connection lasts longer (these are probes and scrapes, answered at once).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// Serves `router` on `listener` holding at most `MAX_CONNECTIONS` connections: when full, a
/// new connection closes the oldest (a probe is answered in milliseconds, so the oldest is an
/// idle one), so idle connections can neither exhaust the agent's descriptors nor lock probes
/// out. A connection is also closed when its headers are slow or it outlives
/// `CONNECTION_LIFETIME`. Out of descriptors, it waits and accepts again rather than stopping.
pub async fn serve_bounded(name: &'static str, listener: tokio::net::TcpListener, router: Router) {
    use std::collections::VecDeque;
    let open: Arc<std::sync::Mutex<VecDeque<(u64, tokio::task::AbortHandle)>>> = Default::default();
    let mut next = 0u64;
    let mut shed_warned = false;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // EMFILE/ENFILE and the like: the listener is fine, descriptors are short.
                tracing::debug!(server = name, error = %e, "accept failed; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        {
            let mut open = open.lock().expect("connection list");
            while open.len() >= MAX_CONNECTIONS {
                if let Some((_, oldest)) = open.pop_front() {
                    oldest.abort();
                }
                if !shed_warned {
                    shed_warned = true;
                    tracing::warn!(server = name, "more than {MAX_CONNECTIONS} connections at once; closing the oldest as new ones come");
                }
            }
        }
        let id = next;
        next += 1;
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let list = open.clone();
        let task = tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, conn).await;
            list.lock().expect("connection list").retain(|(i, _)| *i != id);
        });
        open.lock().expect("connection list").push_back((id, task.abort_handle()));
    }
}

/// Serves `router` on `addr` forever, retrying the bind every 5 s when it fails (another
/// kube-proxy still on the port, say), so the agent itself keeps running. `flag` names what
/// sets the address, for the error.
pub fn listen(name: &'static str, flag: &'static str, addr: SocketAddr, router: Router) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut warned = false;
        let mut attempts = 0;
        loop {
            match bind(addr) {
                Ok(listener) => {
                    tracing::info!(server = name, %addr, "serving");
                    serve_bounded(name, listener, router.clone()).await;
                }
                // A listener of ours on the same port that was just stopped (a health-check
                // port moving to other addresses) closes when its task is next polled: a few
                // quick tries first, not 5 s without an answer.
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && attempts < 20 => {
                    attempts += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    if !warned {
                        warned = true;
                        tracing::error!(
                            server = name,
                            %addr,
                            error = %e,
                            "cannot listen on {flag} {addr}; is kube-proxy or another proxy still running on this node? retrying every 5 s"
                        );
                    }
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
        }
    })
}

/// A listener on `addr`. `0.0.0.0` means every address of both families, as it does for
/// kube-proxy (Go listens on a dual-stack socket for it): a load balancer or kubelet checking
/// the node over IPv6 is answered too. Where the kernel has no IPv6, `0.0.0.0` alone.
pub fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let listener = |domain: Domain, at: SocketAddr, dual: bool| -> std::io::Result<std::net::TcpListener> {
        let socket = Socket::new(domain, Type::STREAM, Some(Protocol::TCP))?;
        if dual {
            socket.set_only_v6(false)?;
        }
        socket.set_reuse_address(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&at.into())?;
        socket.listen(1024)?;
        Ok(socket.into())
    };
    let std = match addr {
        SocketAddr::V4(v4) if v4.ip().is_unspecified() => {
            let any6 = SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), addr.port());
            // IPv4 alone only where the kernel has no IPv6: an address in use (our own
            // listener, just stopped) is said as it is, and retried, not served IPv4-only.
            match listener(Domain::IPV6, any6, true) {
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => return Err(e),
                Err(_) => listener(Domain::IPV4, addr, false)?,
                Ok(l) => l,
            }
        }
        _ => listener(Domain::for_address(addr), addr, false)?,
    };
    tokio::net::TcpListener::from_std(std)
}

/// `listen` for kube-proxy's two fixed servers.
pub fn spawn(name: &'static str, flag: &'static str, addr: SocketAddr, router: Router) {
    listen(name, flag, addr, router);
}

#[cfg(test)]
mod tests {
    use std::net::{SocketAddr, TcpStream};

    /// `0.0.0.0` answers over both families, as kube-proxy's servers do; a specific address
    /// only over its own.
    #[tokio::test]
    async fn the_unspecified_ipv4_address_listens_on_both_families() {
        let listener = super::bind("0.0.0.0:0".parse().unwrap()).expect("bind");
        let port = listener.local_addr().unwrap().port();
        for to in [format!("127.0.0.1:{port}"), format!("[::1]:{port}")] {
            let to: SocketAddr = to.parse().unwrap();
            TcpStream::connect(to).unwrap_or_else(|e| panic!("connecting to {to}: {e}"));
        }
        let listener = super::bind("127.0.0.1:0".parse().unwrap()).expect("bind");
        let port = listener.local_addr().unwrap().port();
        assert!(TcpStream::connect(format!("[::1]:{port}")).is_err(), "127.0.0.1 is IPv4 only");
    }
}
