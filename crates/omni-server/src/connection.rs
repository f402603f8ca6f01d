//! The listener: an accept loop over hyper's HTTP/1 connections that enforces
//! [`ConnectionLimits`] (`axum::serve` exposes no timeouts and no connection bound).
//!
//! Each accepted connection runs in its own task, which owns hyper's connection future and a
//! record of the connection's [`Activity`], kept up to date by three hooks:
//!
//! ```text
//!   socket <-> TrackedStream (bytes read, bytes written, a write left pending)
//!                 <-> hyper http1 connection
//!                        -> service: a request starts (in flight + 1)
//!                           -> TrackedBody: the response body is dropped (in flight - 1)
//! ```
//!
//! The task wakes at the earliest instant a timeout could fire and closes the connection when
//! it is idle (no request in flight, no response bytes waiting for the kernel) and either
//! `timeout_keep_alive` has passed without a byte from the client or `header_read_timeout` has
//! passed since the first byte of a header that is still incomplete. Dropping an idle
//! connection loses nothing: every response byte is already in the kernel, which sends it
//! before the FIN. hyper's own `header_read_timeout` is left off: its timer starts when hyper
//! waits for a header, so it would also close idle keep-alive connections, and a keep-alive
//! timeout longer than it could not be configured.
//!
//! Beyond `limit_concurrency` open connections, a new one is answered `503` in OpenAI's error
//! shape and closed (uvicorn's `--limit-concurrency`); at most [`MAX_REFUSING`] of those are in
//! progress at once, and connections beyond that are closed without an answer, so a flood holds
//! a bounded number of file descriptors. On shutdown the loop stops accepting, idle connections
//! close at once, and busy ones close after their response.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderValue, Request, header};
use axum::response::IntoResponse;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;
use tower::ServiceExt as _;

use crate::config::ConnectionLimits;
use crate::error::ApiError;

/// Most connections beyond the bound that are being answered `503` at once.
const MAX_REFUSING: usize = 64;

/// The shortest interval between two checks of one connection's timeouts (a guard against a
/// zero timeout turning the check into a busy loop).
const MIN_CHECK_INTERVAL: Duration = Duration::from_millis(10);

/// How long the accept loop pauses after an error that is not about one connection (out of
/// file descriptors, say), as `axum::serve` does.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_secs(1);

/// Accepts connections on `listener` and serves `app` on each until `shutdown` resolves, then
/// closes idle connections and waits for busy ones to finish their response.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let limit = limits.limit_concurrency;
    let limits = Arc::new(limits);
    let open = Arc::new(Semaphore::new(limit.min(Semaphore::MAX_PERMITS)));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let refusal = refusal_app(limit);
    let (close_tx, close_rx) = watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    let mut at_limit = false;
    loop {
        let tcp = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _peer)) => tcp,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
        };
        // Streamed tokens are small writes: without TCP_NODELAY, Nagle + delayed ACK add ~40 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY: {e}");
        }
        let (conn_app, keep_alive, permit) = match open.clone().try_acquire_owned() {
            Ok(permit) => {
                at_limit = false;
                (app.clone(), true, permit)
            }
            Err(_) => {
                if !at_limit {
                    at_limit = true;
                    tracing::warn!(
                        limit,
                        "connection limit reached: new connections get 503 until one closes"
                    );
                }
                match refusing.clone().try_acquire_owned() {
                    Ok(permit) => (refusal.clone(), false, permit),
                    Err(_) => continue, // dropping `tcp` closes it
                }
            }
        };
        let limits = limits.clone();
        let close = close_rx.clone();
        tokio::spawn(async move {
            run_connection(tcp, conn_app, &limits, keep_alive, close).await;
            drop(permit);
        });
    }
    drop(listener);
    drop(close_rx);
    tracing::debug!("closing idle connections, waiting for busy ones");
    // Err only when no connection is open.
    let _ = close_tx.send(());
    close_tx.closed().await;
}

/// The app that answers every request on a connection beyond the bound.
fn refusal_app(limit: usize) -> Router {
    Router::new().fallback(move || async move {
        let mut response = ApiError::too_many_connections(limit).into_response();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        response
    })
}

async fn accept_failed(e: io::Error) {
    // About one connection (it went away before we accepted it): nothing to wait for.
    if matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!("accepting a connection: {e} (pausing {ACCEPT_ERROR_PAUSE:?})");
    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
}

/// Serves one connection until it ends, a timeout closes it, or shutdown finds it idle.
async fn run_connection(
    tcp: TcpStream,
    app: Router,
    limits: &ConnectionLimits,
    keep_alive: bool,
    mut close: watch::Receiver<()>,
) {
    let activity = Arc::new(Activity::new(Instant::now()));
    let io = TokioIo::new(TrackedStream {
        tcp,
        activity: activity.clone(),
    });
    let on_request = activity.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let in_flight = InFlight::start(&on_request);
        let app = app.clone();
        async move {
            let response = match app.oneshot(req.map(Body::new)).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            Ok::<_, Infallible>(response.map(|inner| TrackedBody {
                inner,
                _in_flight: in_flight,
            }))
        }
    });
    let mut builder = http1::Builder::new();
    // The timeouts are ours (module doc): hyper's header timer would also run while idle.
    builder.keep_alive(keep_alive).header_read_timeout(None);
    let mut conn = std::pin::pin!(builder.serve_connection(io, service));
    let mut closing = false;
    loop {
        let check_at = match activity.check(limits, Instant::now()) {
            Check::Expired(why) => {
                tracing::debug!("closing a connection: {why}");
                return;
            }
            Check::At(t) => t,
        };
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            () = tokio::time::sleep_until(check_at) => {}
            _ = close.changed(), if !closing => {
                if activity.is_idle() {
                    return;
                }
                closing = true;
                // Ends the connection after the response in flight.
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// What one connection is doing, as far as its timeouts care.
#[derive(Debug)]
struct Activity(Mutex<ActivityState>);

#[derive(Debug)]
struct ActivityState {
    /// Requests whose response body has not been dropped yet (HTTP/1: 0 or 1).
    in_flight: usize,
    /// The last write to the socket returned `Pending`: response bytes wait in hyper's buffer.
    write_pending: bool,
    /// The last byte read or written, or the end of the last response.
    last_io: Instant,
    /// The first byte of a request header that has not arrived whole yet.
    header_started: Option<Instant>,
}

/// The outcome of [`Activity::check`].
#[derive(Debug, PartialEq)]
enum Check {
    /// Idle past a timeout: close, for this reason.
    Expired(&'static str),
    /// Check again at this instant (no timeout can expire before it).
    At(Instant),
}

impl Activity {
    fn new(now: Instant) -> Self {
        Self(Mutex::new(ActivityState {
            in_flight: 0,
            write_pending: false,
            last_io: now,
            header_started: None,
        }))
    }

    fn state(&self) -> MutexGuard<'_, ActivityState> {
        // The state stays consistent under a panic: every update is one plain assignment.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn read(&self, now: Instant) {
        let mut s = self.state();
        s.last_io = now;
        if s.in_flight == 0 && s.header_started.is_none() {
            s.header_started = Some(now);
        }
    }

    fn wrote(&self, now: Instant, result: &Poll<io::Result<usize>>) {
        let mut s = self.state();
        match result {
            Poll::Pending => s.write_pending = true,
            Poll::Ready(Ok(n)) if *n > 0 => {
                s.write_pending = false;
                s.last_io = now;
            }
            Poll::Ready(Ok(_)) => {}
            // The connection is broken; hyper ends it.
            Poll::Ready(Err(_)) => s.write_pending = false,
        }
    }

    fn is_idle(&self) -> bool {
        let s = self.state();
        s.in_flight == 0 && !s.write_pending
    }

    /// Whether a timeout has expired at `now`, else when to check again: the earliest deadline,
    /// but no later than one shortest timeout from now, the soonest a deadline that does not
    /// exist yet (a request that has not started or ended yet) could fall.
    fn check(&self, limits: &ConnectionLimits, now: Instant) -> Check {
        let s = self.state();
        let keep_alive = limits.timeout_keep_alive;
        let header = limits.header_read_timeout;
        let next = now + keep_alive.min(header).max(MIN_CHECK_INTERVAL);
        if s.in_flight > 0 || s.write_pending {
            return Check::At(next);
        }
        let idle_deadline = s.last_io + keep_alive;
        let (deadline, why) = match s.header_started {
            Some(t) if t + header < idle_deadline => (t + header, "request header not complete"),
            _ => (idle_deadline, "idle"),
        };
        if now >= deadline {
            Check::Expired(why)
        } else {
            Check::At(deadline.min(next))
        }
    }
}

/// One request in flight; dropped with its response body.
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(activity: &Arc<Activity>) -> Self {
        let mut s = activity.state();
        s.in_flight += 1;
        s.header_started = None;
        Self(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut s = self.0.state();
        s.in_flight = s.in_flight.saturating_sub(1);
        s.last_io = Instant::now();
    }
}

/// A response body that holds its request's [`InFlight`].
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, reporting reads and writes to the connection's [`Activity`].
struct TrackedStream {
    tcp: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for TrackedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.tcp).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read(Instant::now());
        }
        polled
    }
}

impl AsyncWrite for TrackedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.tcp).poll_write(cx, buf);
        self.activity.wrote(Instant::now(), &polled);
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs);
        self.activity.wrote(Instant::now(), &polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(keep_alive: u64, header: u64) -> ConnectionLimits {
        ConnectionLimits {
            timeout_keep_alive: Duration::from_secs(keep_alive),
            header_read_timeout: Duration::from_secs(header),
            limit_concurrency: 8,
        }
    }

    #[test]
    fn idle_connection_expires_after_the_keep_alive_timeout() {
        let t0 = Instant::now();
        let a = Activity::new(t0);
        let l = limits(5, 10);
        assert_eq!(a.check(&l, t0), Check::At(t0 + Duration::from_secs(5)));
        assert_eq!(
            a.check(&l, t0 + Duration::from_secs(5)),
            Check::Expired("idle")
        );
    }

    #[test]
    fn trickled_header_expires_after_the_header_timeout_though_bytes_keep_coming() {
        let t0 = Instant::now();
        let a = Activity::new(t0);
        let l = limits(5, 10);
        for s in 1..=9 {
            a.read(t0 + Duration::from_secs(s));
            assert!(matches!(
                a.check(&l, t0 + Duration::from_secs(s)),
                Check::At(_)
            ));
        }
        a.read(t0 + Duration::from_secs(10));
        assert_eq!(
            a.check(&l, t0 + Duration::from_secs(11)),
            Check::Expired("request header not complete")
        );
    }

    #[test]
    fn request_in_flight_or_unflushed_response_never_expires() {
        let t0 = Instant::now();
        let a = Arc::new(Activity::new(t0));
        let l = limits(1, 1);
        let late = t0 + Duration::from_secs(3600);
        let in_flight = InFlight::start(&a);
        assert!(matches!(a.check(&l, late), Check::At(_)));
        drop(in_flight);
        a.wrote(late, &Poll::Pending);
        assert!(matches!(a.check(&l, late), Check::At(_)));
        a.wrote(late, &Poll::Ready(Ok(10)));
        assert_eq!(a.check(&l, late), Check::At(late + Duration::from_secs(1)));
    }

    #[test]
    fn a_header_starting_later_is_checked_in_time() {
        // Keep-alive 60 s, header 2 s: with nothing read yet, the next check comes within 2 s,
        // so a header that starts now is caught when its 2 s run out.
        let t0 = Instant::now();
        let a = Activity::new(t0);
        let l = limits(60, 2);
        assert_eq!(a.check(&l, t0), Check::At(t0 + Duration::from_secs(2)));
    }
}
