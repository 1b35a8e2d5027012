//! A TCP fault proxy: the chaos runner puts one between each component and each dependency it
//! reaches (PostgreSQL, a Kafka node's listener, a remote API), so a network fault needs no
//! code of the user's and hits one component while the others still reach the dependency.
//!
//! A [`Proxy`] forwards every connection to its upstream under the [`Conditions`] set now:
//!
//! * **latency and jitter**: each chunk read is delivered `latency + U(0, jitter)` later, in
//!   order (a chunk never overtakes the one before it, as on one TCP stream);
//! * **a bandwidth cap**: each direction of each connection writes at most so many bytes per
//!   second;
//! * **a blackhole**: nothing moves either way; open connections hang (bytes already sent wait,
//!   as TCP would retransmit them) and new ones are held before the upstream is dialled, so
//!   clients wait until their own timeouts; healing lets everything through again;
//! * **answers held**: requests go through, nothing comes back (the upstream-to-client
//!   direction waits): the peer acts on a request whose answer the client never gets — a
//!   produce appended but not acknowledged, an API call served but not answered, a `COMMIT`
//!   committed but not confirmed. Healing delivers the held bytes late; a reset loses them;
//! * **resets** ([`Proxy::reset_all`]): every open connection is closed with a TCP reset on both
//!   sides, as a middlebox or a restarted peer does.
//!
//! The proxy never changes a byte: a fault delays, stops or cuts the stream, and what arrives
//! arrives whole and in order.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// What the network does to the proxy's connections now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Conditions {
    /// Added to every chunk's delivery, each way.
    pub latency: Duration,
    /// A uniform extra delay in `0..jitter` per chunk (order kept).
    pub jitter: Duration,
    /// Bytes per second each way of each connection; `None`: as fast as the loopback.
    pub bandwidth: Option<u64>,
    /// Nothing moves either way until healed.
    pub blackhole: bool,
    /// Requests move; answers (upstream to client) wait until healed.
    pub answers_held: bool,
}

impl Conditions {
    /// No fault.
    pub fn healthy() -> Conditions {
        Conditions::default()
    }

    /// Nothing moves.
    pub fn blackhole() -> Conditions {
        Conditions {
            blackhole: true,
            ..Conditions::default()
        }
    }

    /// Requests reach the upstream; its answers wait.
    pub fn answers_held() -> Conditions {
        Conditions {
            answers_held: true,
            ..Conditions::default()
        }
    }

    /// Whether bytes may move in the direction `answers` (upstream to client) or the other.
    fn open(&self, answers: bool) -> bool {
        !(self.blackhole || answers && self.answers_held)
    }
}

/// What a proxy has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections open now.
    pub open: u64,
    /// Connections cut by [`Proxy::reset_all`].
    pub reset: u64,
    /// Bytes delivered to the upstream.
    pub bytes_up: u64,
    /// Bytes delivered to the clients.
    pub bytes_down: u64,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    open: AtomicU64,
    reset: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
}

/// What the accept loop and every connection share.
struct Shared {
    upstream: SocketAddr,
    conditions: watch::Sender<Conditions>,
    /// Bumped by [`Proxy::reset_all`]: every connection open then is reset.
    resets: watch::Sender<u64>,
    counters: Counters,
    /// The jitter's generator state (splitmix64), seeded: a run replays its delays.
    random: AtomicU64,
}

impl Shared {
    /// A uniform draw in `0..jitter`.
    fn jitter(&self, jitter: Duration) -> Duration {
        if jitter.is_zero() {
            return Duration::ZERO;
        }
        let mut z = self
            .random
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let nanos = u64::try_from(jitter.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(z % nanos)
    }
}

/// A TCP proxy to one upstream address, under [`Conditions`] that can change at any time.
/// Dropping it closes its listener and every connection.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream)
            .field("conditions", &*self.shared.conditions.borrow())
            .finish()
    }
}

impl Proxy {
    /// Listens on `listen` (port 0: any free one) and forwards to `upstream`; `seed` draws the
    /// jitter.
    pub async fn start(
        listen: SocketAddr,
        upstream: SocketAddr,
        seed: u64,
    ) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            conditions: watch::Sender::new(Conditions::default()),
            resets: watch::Sender::new(0),
            counters: Counters::default(),
            random: AtomicU64::new(seed),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Proxy {
            addr,
            shared,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where it forwards.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// Applies `conditions` to every connection, open or to come.
    pub fn set(&self, conditions: Conditions) {
        self.shared.conditions.send_replace(conditions);
    }

    /// The conditions now.
    pub fn conditions(&self) -> Conditions {
        *self.shared.conditions.borrow()
    }

    /// Closes every open connection with a TCP reset on both sides.
    pub fn reset_all(&self) {
        self.shared.resets.send_modify(|n| *n += 1);
    }

    /// What it has done so far.
    pub fn stats(&self) -> Stats {
        let c = &self.shared.counters;
        Stats {
            accepted: c.accepted.load(Ordering::Relaxed),
            open: c.open.load(Ordering::Relaxed),
            reset: c.reset.load(Ordering::Relaxed),
            bytes_up: c.bytes_up.load(Ordering::Relaxed),
            bytes_down: c.bytes_down.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Accepts until aborted; the connections live in its set, so they end with it.
async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    shared.counters.accepted.fetch_add(1, Ordering::Relaxed);
                    connections.spawn(serve(client, shared.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the fault proxy could not accept a connection");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = connections.join_next() => {}
        }
    }
}

/// Counts a connection open while it lives.
struct Open<'a>(&'a Counters);

impl<'a> Open<'a> {
    fn new(c: &'a Counters) -> Self {
        c.open.fetch_add(1, Ordering::Relaxed);
        Open(c)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One client: held while blackholed, then joined to a new upstream connection until both
/// directions end, a direction fails (both sides are reset) or [`Proxy::reset_all`].
async fn serve(mut client: TcpStream, shared: Arc<Shared>) {
    let _open = Open::new(&shared.counters);
    let mut resets = shared.resets.subscribe();
    resets.borrow_and_update();
    let mut conditions = shared.conditions.subscribe();
    tokio::select! {
        () = until_open(&mut conditions, false) => {}
        _ = resets.changed() => {
            shared.counters.reset.fetch_add(1, Ordering::Relaxed);
            return reset(&client);
        }
    }
    let mut server = match TcpStream::connect(shared.upstream).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, upstream = %shared.upstream, "the fault proxy's upstream refused");
            return reset(&client);
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let failed = {
        let (cr, cw) = client.split();
        let (sr, sw) = server.split();
        let up = pipe(cr, sw, &shared, &shared.counters.bytes_up, false);
        let down = pipe(sr, cw, &shared, &shared.counters.bytes_down, true);
        tokio::select! {
            both = async { tokio::try_join!(up, down) } => both.is_err(),
            _ = resets.changed() => {
                shared.counters.reset.fetch_add(1, Ordering::Relaxed);
                true
            }
        }
    };
    if failed {
        reset(&client);
        reset(&server);
    }
}

/// Closes with a TCP reset (no lingering), not a FIN, when the stream is dropped.
fn reset(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

/// Returns once the conditions let bytes through in the direction `answers` (upstream to
/// client) or the other.
async fn until_open(conditions: &mut watch::Receiver<Conditions>, answers: bool) {
    while !conditions.borrow_and_update().open(answers) {
        if conditions.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// A chunk and when it may be delivered; `None` data: the end of the stream.
type Chunk = (Instant, Option<Vec<u8>>);

/// One direction: reads chunks and stamps their delivery time; writes each at its time, at
/// the bandwidth cap, never while blackholed (nor, for the `answers` direction, while answers
/// are held). Ends with the reader's end (the writer is shut down, a half-close) or an error.
async fn pipe(
    mut from: tokio::net::tcp::ReadHalf<'_>,
    mut to: tokio::net::tcp::WriteHalf<'_>,
    shared: &Shared,
    delivered: &AtomicU64,
    answers: bool,
) -> std::io::Result<()> {
    let (tx, rx) = mpsc::channel::<Chunk>(64);
    // Each side owns its end of the channel: when one side ends (an error included), the
    // other sees the channel closed and ends too, and the error reaches the caller.
    let read = async {
        let tx = tx;
        let mut conditions = shared.conditions.subscribe();
        let mut last = Instant::now();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            until_open(&mut conditions, answers).await;
            let n = from.read(&mut buf).await?;
            let c = *conditions.borrow();
            let at = (Instant::now() + c.latency + shared.jitter(c.jitter)).max(last);
            last = at;
            let data = (n > 0).then(|| buf[..n].to_vec());
            if tx.send((at, data)).await.is_err() || n == 0 {
                return Ok::<(), std::io::Error>(());
            }
        }
    };
    let write = async {
        let mut rx = rx;
        let mut conditions = shared.conditions.subscribe();
        while let Some((at, data)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            until_open(&mut conditions, answers).await;
            let Some(data) = data else {
                return to.shutdown().await;
            };
            to.write_all(&data).await?;
            delivered.fetch_add(data.len() as u64, Ordering::Relaxed);
            let cap = conditions.borrow().bandwidth.filter(|b| *b > 0);
            if let Some(bps) = cap {
                let nanos = (data.len() as u128 * 1_000_000_000) / u128::from(bps);
                tokio::time::sleep(Duration::from_nanos(
                    u64::try_from(nanos).unwrap_or(u64::MAX),
                ))
                .await;
            }
        }
        Ok(())
    };
    let (r, w) = tokio::join!(read, write);
    r.and(w)
}

/// One Kafka listener of `scripts/kafka prepare --proxied-listeners`, each node's port behind
/// a [`Proxy`] at the address the node advertises for it: a client bootstrapped on
/// [`ProxiedListener::bootstrap`] reaches every node through these proxies only.
#[derive(Debug)]
pub struct ProxiedListener {
    /// One per node, in node order.
    pub proxies: Vec<Proxy>,
}

impl ProxiedListener {
    /// Starts the proxies of listener `name` (`P1`, `P2`, …) of the cluster prepared in
    /// `dir`, from `DIR/proxied/NAME/routes` (`PROXY_PORT LISTENER_PORT` per node).
    pub async fn start(
        dir: &std::path::Path,
        name: &str,
        seed: u64,
    ) -> std::io::Result<ProxiedListener> {
        let file = dir.join("proxied").join(name).join("routes");
        let text = std::fs::read_to_string(&file)?;
        let mut proxies = Vec::new();
        for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
            let bad = || {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "{}: line {:?} is not PROXY_PORT LISTENER_PORT",
                        file.display(),
                        line
                    ),
                )
            };
            let mut ports = line.split_whitespace().map(str::parse::<u16>);
            let (Some(Ok(proxy)), Some(Ok(port)), None) =
                (ports.next(), ports.next(), ports.next())
            else {
                return Err(bad());
            };
            let listen = SocketAddr::from(([127, 0, 0, 1], proxy));
            let upstream = SocketAddr::from(([127, 0, 0, 1], port));
            proxies.push(Proxy::start(listen, upstream, seed.wrapping_add(i as u64)).await?);
        }
        Ok(ProxiedListener { proxies })
    }

    /// The bootstrap list a client of this listener uses.
    pub fn bootstrap(&self) -> String {
        let addrs: Vec<String> = self.proxies.iter().map(|p| p.addr().to_string()).collect();
        addrs.join(",")
    }

    /// Applies `conditions` to the way to every node.
    pub fn set(&self, conditions: Conditions) {
        for p in &self.proxies {
            p.set(conditions);
        }
    }

    /// Resets every open connection to every node.
    pub fn reset_all(&self) {
        for p in &self.proxies {
            p.reset_all();
        }
    }
}
