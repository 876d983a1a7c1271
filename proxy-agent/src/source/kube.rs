//! The API-server source: kube-rs watchers on Services, EndpointSlices, this node's Node and
//! the ServiceCIDRs,
//! with the label selectors kube-proxy uses. Each watcher's initial list (and every relist,
//! after a 410 Gone or a lost watch) goes to the store as `ListBegin`, one `Listed` per object
//! and `ListEnd`, so objects that vanished while the watch was down are removed at the end;
//! changes after that are `Apply` and `Delete`. Errors
//! are retried with backoff forever: an unreachable API server delays programming but stops
//! nothing, and what is pinned keeps serving.

use std::fmt::Debug;

use futures::StreamExt;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    runtime::{watcher, WatchStreamExt},
    Api, Client, Resource,
};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use crate::model::{
    store::{Event, Kind, Object},
    validate::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME},
    ObjectKey,
};

/// Builds a client from `--kubeconfig`, else $KUBECONFIG, in-cluster config, ~/.kube/config,
/// whose requests keep to `qps` on average and `burst` at once (kube-proxy's client-go rate
/// limiter), and whose responses are bounded (`guard`): their watches are reported to
/// `telemetry` as they progress or stall.
pub async fn client(api: &crate::config::ApiClient, telemetry: std::sync::Arc<crate::telemetry::Telemetry>) -> anyhow::Result<Client> {
    let config = match api.kubeconfig.as_deref() {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| {
            anyhow::anyhow!(
                "no Kubernetes API configuration found ({e}); pass --kubeconfig, set KUBECONFIG, \
                 run in a pod, or pass --manifests DIR to read objects from files"
            )
        })?,
    };
    let builder = kube::client::ClientBuilder::try_from(config)?;
    let guard = guard::Layer { limits: guard::Limits { stall: api.watch_stall, ..Default::default() }, telemetry };
    Ok(builder.with_layer(&guard).with_layer(&rate::Layer::new(api.qps, api.burst)).build())
}

/// Bounds on what the API server sends: a watch event must arrive whole within `stall` of the
/// one before (the server sends a BOOKMARK about every minute when nothing else happens) and
/// may not exceed `max_line`; a List's body may not exceed `max_body`.
/// Beyond them the response fails; the watcher starts again (from where it was) and what
/// was read is freed. Sized to real clusters: the API server stores objects of at most
/// 1.5 MiB (etcd's limit) and the watcher lists 500 objects a page.
pub mod guard {
    use std::{
        future::Future,
        pin::Pin,
        sync::Arc,
        task::{Context, Poll},
        time::Duration,
    };

    use bytes::Bytes;
    use http_body::{Body, Frame};
    use tokio::time::Sleep;

    use crate::telemetry::Telemetry;

    type BoxError = Box<dyn std::error::Error + Send + Sync>;

    #[derive(Clone, Copy, Debug)]
    pub struct Limits {
        pub stall: Duration,
        pub max_line: usize,
        pub max_body: usize,
    }

    impl Default for Limits {
        fn default() -> Self {
            Self { stall: Duration::from_secs(120), max_line: 16 << 20, max_body: 1 << 30 }
        }
    }

    #[derive(Clone)]
    pub struct Layer {
        pub limits: Limits,
        pub telemetry: Arc<Telemetry>,
    }

    impl<S> tower::Layer<S> for Layer {
        type Service = Guarded<S>;
        fn layer(&self, inner: S) -> Guarded<S> {
            Guarded { inner, layer: self.clone() }
        }
    }

    pub struct Guarded<S> {
        inner: S,
        layer: Layer,
    }

    impl<S, ReqB, B> tower::Service<http::Request<ReqB>> for Guarded<S>
    where
        S: tower::Service<http::Request<ReqB>, Response = http::Response<B>>,
        S::Future: Send + 'static,
        B: Body<Data = Bytes> + Unpin + Send + 'static,
        B::Error: Into<BoxError>,
    {
        type Response = http::Response<GuardedBody<B>>;
        type Error = S::Error;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
            self.inner.poll_ready(cx)
        }

        fn call(&mut self, req: http::Request<ReqB>) -> Self::Future {
            let uri = req.uri();
            let watch = uri.query().is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
            let resource = uri.path().rsplit('/').next().unwrap_or_default().to_string();
            let (limits, telemetry) = (self.layer.limits, self.layer.telemetry.clone());
            let fut = self.inner.call(req);
            Box::pin(async move {
                let resp = fut.await?;
                Ok(resp.map(|body| GuardedBody::new(body, watch, resource, limits, telemetry)))
            })
        }
    }

    pub struct GuardedBody<B> {
        inner: B,
        watch: bool,
        resource: String,
        limits: Limits,
        telemetry: Arc<Telemetry>,
        /// Bytes since the last newline, and in all.
        line: usize,
        total: usize,
        deadline: Pin<Box<Sleep>>,
        failed: bool,
    }

    impl<B> GuardedBody<B> {
        fn new(inner: B, watch: bool, resource: String, limits: Limits, telemetry: Arc<Telemetry>) -> Self {
            let deadline = Box::pin(tokio::time::sleep(limits.stall));
            Self { inner, watch, resource, limits, telemetry, line: 0, total: 0, deadline, failed: false }
        }

        fn fail(&mut self, why: String) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.failed = true;
            tracing::warn!(resource = %self.resource, "the API server's response was cut: {why}");
            Poll::Ready(Some(Err(why.into())))
        }
    }

    impl<B> Body for GuardedBody<B>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            let this = &mut *self;
            if this.failed {
                return Poll::Ready(None);
            }
            let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => {
                    if this.watch && this.deadline.as_mut().poll(cx).is_ready() {
                        this.telemetry.watch_stalled(&this.resource);
                        let stall = this.limits.stall;
                        return this.fail(format!("no complete watch event or bookmark for {} s; watching again", stall.as_secs()));
                    }
                    return Poll::Pending;
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(Some(Ok(f))) => f,
            };
            if let Some(data) = frame.data_ref() {
                this.total += data.len();
                match data.iter().rposition(|b| *b == b'\n') {
                    Some(i) => {
                        this.line = data.len() - i - 1;
                        if this.watch {
                            let stall = this.limits.stall;
                            this.deadline.as_mut().reset(tokio::time::Instant::now() + stall);
                            this.telemetry.watch_progress(&this.resource);
                        }
                    }
                    None => this.line += data.len(),
                }
                // A List's body is one line; a watch's events are one a line.
                if this.watch && this.line > this.limits.max_line {
                    let max = this.limits.max_line >> 20;
                    return this.fail(format!("one line is over {max} MiB; the API server stores objects of 1.5 MiB at most"));
                }
                if !this.watch && this.total > this.limits.max_body {
                    let max = this.limits.max_body >> 20;
                    return this.fail(format!("the response is over {max} MiB"));
                }
            }
            Poll::Ready(Some(Ok(frame)))
        }

        fn is_end_stream(&self) -> bool {
            self.failed || self.inner.is_end_stream()
        }

        fn size_hint(&self) -> http_body::SizeHint {
            self.inner.size_hint()
        }
    }
}

/// A token bucket in front of the client: `burst` requests at once, then `qps` a second.
mod rate {
    use std::{
        future::Future,
        pin::Pin,
        sync::{Arc, Mutex},
        task::{Context, Poll},
        time::Duration,
    };

    use tokio::time::{Instant, Sleep};

    struct Bucket {
        tokens: f64,
        at: Instant,
    }

    #[derive(Clone)]
    pub struct Layer {
        bucket: Arc<Mutex<Bucket>>,
        qps: f64,
        burst: f64,
    }

    impl Layer {
        pub fn new(qps: f32, burst: u32) -> Self {
            let burst = f64::from(burst.max(1));
            Self { bucket: Arc::new(Mutex::new(Bucket { tokens: burst, at: Instant::now() })), qps: f64::from(qps).max(0.01), burst }
        }

        /// Takes a token, or says how long until one is there.
        fn take(&self) -> Result<(), Duration> {
            let mut b = self.bucket.lock().expect("rate bucket");
            let now = Instant::now();
            b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * self.qps).min(self.burst);
            b.at = now;
            if b.tokens >= 1.0 {
                b.tokens -= 1.0;
                Ok(())
            } else {
                Err(Duration::from_secs_f64((1.0 - b.tokens) / self.qps))
            }
        }
    }

    impl<S> tower::Layer<S> for Layer {
        type Service = Limited<S>;
        fn layer(&self, inner: S) -> Limited<S> {
            Limited { inner, limit: self.clone(), permit: false, wait: None }
        }
    }

    pub struct Limited<S> {
        inner: S,
        limit: Layer,
        permit: bool,
        wait: Option<Pin<Box<Sleep>>>,
    }

    impl<S: tower::Service<R>, R> tower::Service<R> for Limited<S> {
        type Response = S::Response;
        type Error = S::Error;
        type Future = S::Future;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
            while !self.permit {
                if let Some(w) = self.wait.as_mut() {
                    if w.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.wait = None;
                }
                match self.limit.take() {
                    Ok(()) => self.permit = true,
                    Err(d) => self.wait = Some(Box::pin(tokio::time::sleep(d))),
                }
            }
            self.inner.poll_ready(cx)
        }

        fn call(&mut self, req: R) -> S::Future {
            self.permit = false;
            self.inner.call(req)
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[tokio::test(start_paused = true)]
        async fn a_burst_goes_at_once_and_the_rest_at_the_rate() {
            let l = Layer::new(5.0, 10);
            for _ in 0..10 {
                assert!(l.take().is_ok());
            }
            let wait = l.take().unwrap_err();
            assert!((wait.as_secs_f64() - 0.2).abs() < 0.01, "the 11th waits a fifth of a second: {wait:?}");
            tokio::time::advance(Duration::from_secs(1)).await;
            let taken = (0..10).filter(|_| l.take().is_ok()).count();
            assert_eq!(taken, 5, "a second later, 5 more");
        }
    }
}

fn key_of<K: Resource>(obj: &K, namespaced: bool) -> ObjectKey {
    let meta = obj.meta();
    let ns = if namespaced { meta.namespace.clone().unwrap_or_else(|| "default".into()) } else { String::new() };
    ObjectKey::new(ns, meta.name.clone().unwrap_or_default())
}

fn watch<K>(api: Api<K>, config: watcher::Config, kind: Kind, wrap: fn(K) -> Object, namespaced: bool, tx: mpsc::Sender<Event>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    tokio::spawn(async move {
        let mut stream = watcher(api, config).default_backoff().boxed();
        let mut failing = false;
        while let Some(item) = stream.next().await {
            let event = match item {
                Ok(e) => {
                    // `Init` only starts a (re)list, which may fail again: the watch is back once
                    // something arrives.
                    if failing && !matches!(e, watcher::Event::Init) {
                        tracing::info!(kind = kind.as_str(), "watch re-established");
                        failing = false;
                    }
                    e
                }
                Err(e) => {
                    // The stream retries with exponential backoff on its own; say it once.
                    if !failing {
                        if kind == Kind::ServiceCidr {
                            tracing::warn!(kind = kind.as_str(), error = %e, "ServiceCIDRs cannot be watched (Kubernetes before 1.33 does not serve networking.k8s.io/v1 servicecidrs; RBAC needs list and watch on them): traffic to unallocated cluster IPs is not dropped meanwhile; retrying with backoff");
                        } else {
                            tracing::warn!(kind = kind.as_str(), error = %e, "watch failed; retrying with backoff");
                        }
                    }
                    failing = true;
                    continue;
                }
            };
            let out = match event {
                // The list goes to the store object by object, so it is never held whole.
                watcher::Event::Init => Some(Event::ListBegin { kind }),
                watcher::Event::InitApply(obj) => Some(Event::Listed(wrap(obj))),
                watcher::Event::InitDone => Some(Event::ListEnd { kind }),
                watcher::Event::Apply(obj) => Some(Event::Apply(wrap(obj))),
                watcher::Event::Delete(obj) => Some(Event::Delete { kind, key: key_of(&obj, namespaced) }),
            };
            if let Some(ev) = out {
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
        }
    });
}

/// Objects per page of a list. The API server pages a list (served from etcd, or from its
/// cache since consistent reads from the cache) when asked to, and each page is a request
/// under the client's rate limit (kube-proxy's qps 5, burst 10): at kube-rs' and client-go's
/// 500, listing 30,000 Services and their slices took 120 requests and 24 s here, while
/// kube-proxy's informers list from the cache in one response (resourceVersion 0, where the
/// cache ignores the limit). Services are small: 5,000 a page. An EndpointSlice holds up to
/// 100 endpoints (the controller's default; the API allows 1,000), so its pages are smaller,
/// to bound what one page decodes: 2,000. At 30,000 of each that is 21 requests, 11 past the
/// burst (about 2 s).
const PAGE_SIZE: u32 = 5_000;
const SLICE_PAGE_SIZE: u32 = 2_000;

/// Starts the four watchers.
pub fn spawn(client: Client, node_name: &str, tx: mpsc::Sender<Event>) {
    // kube-proxy's selectors: Services another proxy claims are not ours (KEP-2447), and slices
    // of headless Services are never needed.
    watch(
        Api::<Service>::all(client.clone()),
        watcher::Config::default().page_size(PAGE_SIZE).labels(&format!("!{LABEL_SERVICE_PROXY_NAME}")),
        Kind::Service,
        |s| Object::Service(Box::new(s)),
        true,
        tx.clone(),
    );
    watch(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().page_size(SLICE_PAGE_SIZE).labels(&format!("!{LABEL_HEADLESS}")),
        Kind::EndpointSlice,
        |s| Object::EndpointSlice(Box::new(s)),
        true,
        tx.clone(),
    );
    watch(
        Api::<Node>::all(client.clone()),
        watcher::Config::default().fields(&format!("metadata.name={node_name}")),
        Kind::Node,
        |n| Object::Node(Box::new(n)),
        false,
        tx.clone(),
    );
    // Not required for readiness: API servers before 1.33 do not serve ServiceCIDRs (GA), and
    // without them only the drop of unallocated cluster IPs is missing.
    watch(
        Api::<k8s_openapi::api::networking::v1::ServiceCIDR>::all(client),
        watcher::Config::default(),
        Kind::ServiceCidr,
        |c| Object::ServiceCidr(Box::new(c)),
        false,
        tx,
    );
}
