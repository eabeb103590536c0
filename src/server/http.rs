//! Connections: hyper driven directly (HTTP/1.1, and HTTP/2 with prior
//! knowledge), with the limits that keep slow or idle clients from holding
//! the server's sockets:
//!
//! - **header timeout** (`--header-timeout`): a request head must arrive whole
//!   within this time of its first byte (of the accept, for a connection's
//!   first request); the deadline is not reset by each byte;
//! - **idle timeout** (`--idle-timeout`): a keep-alive connection with no
//!   request in flight is closed after this long;
//! - **connection limit** (`--max-connections`): past it, up to
//!   [`OVERFLOW_CONNECTIONS`] more connections are served `/health` and
//!   `/metrics` only (anything else gets 503 and the connection is closed), so
//!   health checks still answer at the limit; past those, new connections
//!   are closed at once.
//!
//! The body timeout (`--body-timeout`) is the handlers' (see `routes`): they
//! read a body whole within it, or answer 408.
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// Connections over `--max-connections` that are still served `/health` and `/metrics`.
pub const OVERFLOW_CONNECTIONS: usize = 64;

/// Request headers hyper parses at most (more: hyper's own body-less 431).
/// The routes refuse more than [`super::routes::MAX_HEADERS`] with a JSON 431.
pub const HYPER_MAX_HEADERS: usize = 512;

/// hyper's read buffer limit, which bounds a request head (past it: hyper's own
/// body-less 431). The routes refuse heads over [`super::routes::MAX_HEADER_BYTES`]
/// with a JSON 431.
pub const HYPER_MAX_BUF: usize = 2 << 20;

/// How often each connection checks its timeouts.
const TICK: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

/// What one connection is doing, for its timeouts.
struct Activity(Mutex<ActState>);

struct ActState {
    /// Requests whose response has not been sent whole (or dropped).
    in_flight: usize,
    /// When the bytes of the next request head started to arrive (the accept,
    /// for the first request); `None` while idle or while requests are in flight.
    head_since: Option<Instant>,
    /// When the connection last became idle (no request in flight).
    idle_since: Instant,
    /// No byte read yet (the first bytes tell HTTP/2's preface).
    fresh: bool,
    /// HTTP/2: streams are requests; no head timeout between them.
    h2: bool,
}

impl Activity {
    fn new() -> Activity {
        let now = Instant::now();
        Activity(Mutex::new(ActState {
            in_flight: 0,
            head_since: Some(now),
            idle_since: now,
            fresh: true,
            h2: false,
        }))
    }

    fn lock(&self) -> MutexGuard<'_, ActState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn read(&self, bytes: &[u8]) {
        let mut s = self.lock();
        if s.fresh {
            s.fresh = false;
            if bytes.starts_with(b"PRI * HTTP/2") {
                s.h2 = true;
                s.head_since = None;
            }
        }
        if !s.h2 && s.in_flight == 0 && s.head_since.is_none() {
            s.head_since = Some(Instant::now());
        }
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        let mut s = self.lock();
        s.in_flight += 1;
        s.head_since = None;
        InFlight(self.clone())
    }

    /// Why the connection should be closed now, if it should.
    fn expired(&self, l: &Limits) -> Option<String> {
        let s = self.lock();
        if s.in_flight > 0 {
            return None;
        }
        if let Some(t) = s.head_since {
            if t.elapsed() >= l.header_timeout {
                return Some(format!(
                    "no complete request head within {:?} (--header-timeout)",
                    l.header_timeout
                ));
            }
            return None;
        }
        if s.idle_since.elapsed() >= l.idle_timeout {
            return Some(format!("idle for {:?} (--idle-timeout)", l.idle_timeout));
        }
        None
    }
}

/// A request in flight on a connection, until its response body is done.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.in_flight == 0 {
            s.idle_since = Instant::now();
            s.head_since = None;
        }
    }
}

/// A response body that keeps its request counted as in flight.
struct Tracked {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, noting when bytes arrive.
struct Watched {
    io: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &r {
            let got = &buf.filled()[before..];
            if !got.is_empty() {
                this.activity.read(got);
            }
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

fn builder() -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        // the head deadline is ours (hyper's would also end idle keep-alive connections)
        .header_read_timeout(None)
        // a client that shuts down its sending side still gets its answer
        .half_close(true)
        .max_headers(HYPER_MAX_HEADERS)
        .max_buf_size(HYPER_MAX_BUF);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(64)
        .max_header_list_size(HYPER_MAX_BUF as u32);
    b
}

/// Serves one connection until it ends, a timeout closes it, or the server
/// stops (then in-flight requests finish and the connection closes).
async fn serve_connection(
    stream: TcpStream,
    app: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        io: stream,
        activity: activity.clone(),
    });
    let act = activity.clone();
    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let in_flight = act.begin();
        let app = app.clone();
        async move {
            let resp = match app.oneshot(req.map(Body::new)).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            Ok::<_, Infallible>(resp.map(|inner| {
                Body::new(Tracked {
                    inner,
                    _in_flight: in_flight,
                })
            }))
        }
    });
    let builder = builder();
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut tick = tokio::time::interval(TICK);
    let mut draining = *stop.borrow();
    if draining {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            changed = stop.changed(), if !draining => {
                if changed.is_err() || *stop.borrow() {
                    draining = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            _ = tick.tick() => {
                if let Some(why) = activity.expired(&limits) {
                    tracing::debug!("closing a connection: {why}");
                    return;
                }
            }
        }
    }
}

/// Accepts connections until `stop` turns true, then waits for the open
/// connections to finish their requests.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    overflow_app: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) {
    let normal = Arc::new(Semaphore::new(limits.max_connections));
    let overflow = Arc::new(Semaphore::new(OVERFLOW_CONNECTIONS));
    let mut tasks = tokio::task::JoinSet::new();
    let mut warned = false;
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _peer)) => {
                    let (permit, app) = match normal.clone().try_acquire_owned() {
                        Ok(p) => (p, app.clone()),
                        Err(_) => match overflow.clone().try_acquire_owned() {
                            Ok(p) => {
                                if !warned {
                                    warned = true;
                                    tracing::warn!(
                                        "--max-connections {} reached: new connections get /health and /metrics only",
                                        limits.max_connections
                                    );
                                }
                                (p, overflow_app.clone())
                            }
                            Err(_) => {
                                drop(stream);
                                continue;
                            }
                        },
                    };
                    let _ = stream.set_nodelay(true);
                    let stop = stop.clone();
                    tasks.spawn(async move {
                        serve_connection(stream, app, limits, stop).await;
                        drop(permit);
                    });
                }
                Err(e) => {
                    // out of file descriptors, a connection reset before accept, ...
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    break;
                }
            }
        }
    }
    drop(listener);
    while tasks.join_next().await.is_some() {}
}
