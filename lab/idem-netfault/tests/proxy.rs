//! The fault proxy between real TCP sockets on loopback: bytes pass whole and in order under
//! jitter; latency and the bandwidth cap slow them by at least what they say; a blackhole
//! holds every byte and every new connection of its proxy (and only its proxy's) until healed;
//! a reset reaches both sides.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use idem_netfault::{Conditions, Proxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// An echo server; each accepted connection's read results reach `events` (`Ok(n)` per read,
/// `Ok(0)` at the end, the error kind when a read fails).
async fn echo() -> (
    SocketAddr,
    mpsc::UnboundedReceiver<Result<usize, std::io::ErrorKind>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) => {
                            let _ = tx.send(Ok(0));
                            return;
                        }
                        Ok(n) => {
                            let _ = tx.send(Ok(n));
                            if s.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e.kind()));
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, rx)
}

async fn proxy_to(upstream: SocketAddr) -> Proxy {
    Proxy::start("127.0.0.1:0".parse().unwrap(), upstream, 7)
        .await
        .unwrap()
}

/// Sends `data` and reads its echo whole.
async fn round_trip(s: &mut TcpStream, data: &[u8]) -> Vec<u8> {
    let (mut r, mut w) = s.split();
    let mut got = vec![0u8; data.len()];
    let (sent, read) = tokio::join!(w.write_all(data), r.read_exact(&mut got));
    sent.unwrap();
    read.unwrap();
    got
}

#[tokio::test]
async fn bytes_pass_whole_and_in_order_under_jitter() {
    let (upstream, _) = echo().await;
    let proxy = proxy_to(upstream).await;
    proxy.set(Conditions {
        latency: Duration::from_millis(1),
        jitter: Duration::from_millis(5),
        ..Conditions::default()
    });
    let data: Vec<u8> = (0..1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(round_trip(&mut s, &data).await, data);
    let stats = proxy.stats();
    assert_eq!((stats.bytes_up, stats.bytes_down), (1 << 20, 1 << 20));
    assert_eq!((stats.accepted, stats.open), (1, 1));
}

#[tokio::test]
async fn latency_delays_each_way() {
    let (upstream, _) = echo().await;
    let proxy = proxy_to(upstream).await;
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(round_trip(&mut s, b"x").await, b"x");
    proxy.set(Conditions {
        latency: Duration::from_millis(100),
        ..Conditions::default()
    });
    let t = Instant::now();
    assert_eq!(round_trip(&mut s, b"y").await, b"y");
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn the_bandwidth_cap_slows_a_transfer() {
    let (upstream, _) = echo().await;
    let proxy = proxy_to(upstream).await;
    proxy.set(Conditions {
        bandwidth: Some(200_000),
        ..Conditions::default()
    });
    let data = vec![7u8; 100_000];
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    let t = Instant::now();
    assert_eq!(round_trip(&mut s, &data).await, data);
    // 100 000 bytes at 200 000 B/s: 0.5 s, less the last chunk's 16 KiB written before its wait.
    assert!(
        t.elapsed() >= Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn a_blackhole_holds_its_connections_and_only_its_own_until_healed() {
    let (upstream, mut reads) = echo().await;
    let cut = proxy_to(upstream).await;
    let other = proxy_to(upstream).await;
    let mut open = TcpStream::connect(cut.addr()).await.unwrap();
    assert_eq!(round_trip(&mut open, b"a").await, b"a");
    assert_eq!(reads.recv().await.unwrap(), Ok(1));

    cut.set(Conditions::blackhole());
    open.write_all(b"b").await.unwrap();
    let mut new = TcpStream::connect(cut.addr()).await.unwrap();
    new.write_all(b"c").await.unwrap();
    // The component behind the other proxy still reaches the upstream meanwhile.
    let mut beside = TcpStream::connect(other.addr()).await.unwrap();
    assert_eq!(round_trip(&mut beside, b"d").await, b"d");
    assert_eq!(reads.recv().await.unwrap(), Ok(1), "only d arrived");
    let mut one = [0u8; 1];
    // Nothing comes back through the blackhole (an absence can only be waited for).
    let held = tokio::time::timeout(Duration::from_millis(300), open.read_exact(&mut one)).await;
    assert!(held.is_err(), "a byte passed the blackhole");
    assert!(reads.try_recv().is_err(), "b or c reached the upstream");
    assert_eq!(cut.stats().bytes_up, 1);

    cut.set(Conditions::healthy());
    open.read_exact(&mut one).await.unwrap();
    assert_eq!(&one, b"b");
    new.read_exact(&mut one).await.unwrap();
    assert_eq!(&one, b"c");
}

#[tokio::test]
async fn a_reset_reaches_both_sides_and_new_connections_pass() {
    let (upstream, mut reads) = echo().await;
    let proxy = proxy_to(upstream).await;
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(round_trip(&mut s, b"a").await, b"a");
    assert_eq!(reads.recv().await.unwrap(), Ok(1));

    proxy.reset_all();
    let mut buf = [0u8; 1];
    let e = s.read(&mut buf).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
    assert_eq!(
        reads.recv().await.unwrap(),
        Err(std::io::ErrorKind::ConnectionReset),
        "the upstream saw a reset too"
    );
    assert_eq!(proxy.stats().reset, 1);

    let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(round_trip(&mut again, b"z").await, b"z");
}

#[tokio::test]
async fn an_upstream_that_refuses_resets_the_client() {
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let proxy = proxy_to(closed).await;
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut buf = [0u8; 1];
    let e = s.read(&mut buf).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
}

#[tokio::test]
async fn a_client_that_vanishes_with_a_reset_ends_its_upstream_connection() {
    let (upstream, mut reads) = echo().await;
    let proxy = proxy_to(upstream).await;
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(round_trip(&mut s, b"a").await, b"a");
    assert_eq!(reads.recv().await.unwrap(), Ok(1));
    // A killed process's socket: closed with a reset (as with unread data in its buffer).
    socket2::SockRef::from(&s)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(s);
    // The upstream (a database holding the client's transaction) learns that it is gone.
    let ended = tokio::time::timeout(Duration::from_secs(10), reads.recv())
        .await
        .expect("the upstream connection outlived its client");
    assert!(
        matches!(
            ended,
            Some(Ok(0) | Err(std::io::ErrorKind::ConnectionReset))
        ),
        "{ended:?}"
    );
}

#[tokio::test]
async fn held_answers_let_the_request_arrive_and_keep_its_answer_until_healed() {
    let (upstream, mut events) = echo().await;
    let proxy = proxy_to(upstream).await;
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(round_trip(&mut s, b"before").await, b"before");
    assert_eq!(events.recv().await, Some(Ok(6)));
    proxy.set(Conditions::answers_held());
    s.write_all(b"request").await.unwrap();
    // The upstream reads the request while its answer is held.
    assert_eq!(events.recv().await, Some(Ok(7)));
    let mut answer = [0u8; 7];
    let early = tokio::time::timeout(Duration::from_millis(500), s.read_exact(&mut answer)).await;
    assert!(early.is_err(), "an answer passed while answers were held");
    proxy.set(Conditions::healthy());
    s.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"request");
}
