//! kube-proxy's HTTP endpoints: `--metrics-bind-address` serves /metrics, /proxyMode and
//! /healthz ("ok"); `--healthz-bind-address` serves /healthz and /livez with kube-proxy's JSON.
//! A server that cannot bind is retried; the dataplane never waits for it.

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

pub fn metrics_router(t: Arc<Telemetry>, mode: &'static str) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let t = t.clone();
                async move {
                    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], t.encode())
                }
            }),
        )
        .route("/proxyMode", get(move || async move { mode }))
        .route("/healthz", get(|| async { "ok" }))
}

pub fn health_router(t: Arc<Telemetry>) -> Router {
    let t2 = t.clone();
    Router::new()
        .route("/healthz", get(move || {
            let (code, body) = t.healthz();
            async move { json(code, body) }
        }))
        .route("/livez", get(move || {
            let (code, body) = t2.livez();
            async move { json(code, body) }
        }))
}

/// Serves `router` on `addr` forever, retrying the bind every 5 s when it fails (another
/// kube-proxy still on the port, say), so the agent itself keeps running.
pub fn spawn(name: &'static str, flag: &'static str, addr: SocketAddr, router: Router) {
    tokio::spawn(async move {
        loop {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => {
                    tracing::info!(server = name, %addr, "serving");
                    if let Err(e) = axum::serve(listener, router.clone()).await {
                        tracing::error!(server = name, %addr, error = %e, "HTTP server stopped; restarting");
                    }
                }
                Err(e) => {
                    tracing::error!(
                        server = name,
                        %addr,
                        error = %e,
                        "cannot listen on {flag} {addr}; is kube-proxy or another proxy still running on this node? retrying in 5 s"
                    );
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
        }
    });
}
