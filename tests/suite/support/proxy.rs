//! A TCP fault proxy between the workers and one service: the chaos run's network faults, and
//! the Postgres that refuses connections in `outage`. Invariant: bytes pass through unchanged
//! and in order; a fault only delays them (latency), holds them while keeping both sockets open
//! (half-open), refuses new connections, or closes connections; it never invents, reorders or
//! alters data.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Default)]
struct Faults {
    latency_ms: AtomicU64,
    refuse: AtomicBool,
    hold: AtomicBool,
    /// Connections numbered up to this (from 1, in the order accepted) are held; 0: none.
    frozen_up_to: AtomicU64,
    open: AtomicUsize,
    accepted: AtomicU64,
    cut: AtomicU64,
}

/// One listening proxy; dropping it stops accepting (open connections end with the runtime).
pub struct Proxy {
    pub addr: SocketAddr,
    faults: Arc<Faults>,
    generation: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on an ephemeral port of 127.0.0.1 and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let faults = Arc::new(Faults::default());
        let (generation, _) = watch::channel(0u64);
        let f = faults.clone();
        let gen = generation.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let serial = f.accepted.fetch_add(1, Ordering::Relaxed) + 1;
                if f.refuse.load(Ordering::Relaxed) {
                    drop(client);
                    continue;
                }
                let f = f.clone();
                let cut = gen.subscribe();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    f.open.fetch_add(1, Ordering::Relaxed);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        () = pump(cr, sw, f.clone(), serial) => {}
                        () = pump(sr, cw, f.clone(), serial) => {}
                        () = cut_signal(cut) => {}
                    }
                    f.open.fetch_sub(1, Ordering::Relaxed);
                });
            }
        });
        Proxy {
            addr,
            faults,
            generation,
            task,
        }
    }

    /// A proxy in front of the Postgres that `database_url` names, and the same URL through it.
    pub async fn before(database_url: &str) -> (Proxy, url::Url) {
        let mut u = url::Url::parse(database_url).unwrap();
        let upstream: SocketAddr = format!(
            "{}:{}",
            u.host_str().unwrap(),
            u.port_or_known_default().unwrap()
        )
        .parse()
        .expect("Postgres is at an IP address in the tests");
        let proxy = Proxy::start(upstream).await;
        u.set_host(Some(&proxy.addr.ip().to_string())).unwrap();
        u.set_port(Some(proxy.addr.port())).unwrap();
        (proxy, u)
    }

    /// Accepts and immediately closes new connections while set.
    pub fn set_refuse(&self, on: bool) {
        self.faults.refuse.store(on, Ordering::Relaxed);
    }

    /// Closes every open connection now.
    pub fn cut_all(&self) {
        self.faults.cut.fetch_add(1, Ordering::Relaxed);
        self.generation.send_modify(|g| *g += 1);
    }
}

/// The faults and counts only the chaos run uses (it is built with `crash-points`).
#[cfg(feature = "crash-points")]
impl Proxy {
    /// Delays every chunk by `ms` (0: none).
    pub fn set_latency(&self, ms: u64) {
        self.faults.latency_ms.store(ms, Ordering::Relaxed);
    }

    /// Half-open: stops forwarding in both directions without closing anything.
    pub fn set_hold(&self, on: bool) {
        self.faults.hold.store(on, Ordering::Relaxed);
    }

    /// Half-open for the connections open now only: they stop forwarding in both directions
    /// without closing, as a link a NAT or a failed peer dropped; new connections pass.
    pub fn freeze_open(&self) {
        let accepted = self.faults.accepted.load(Ordering::Relaxed);
        self.faults.frozen_up_to.store(accepted, Ordering::Relaxed);
    }

    /// Connections open through the proxy now.
    pub fn open_connections(&self) -> usize {
        self.faults.open.load(Ordering::Relaxed)
    }

    /// Connections accepted since the start.
    pub fn accepted(&self) -> u64 {
        self.faults.accepted.load(Ordering::Relaxed)
    }

    /// Clears every fault.
    pub fn heal(&self) {
        self.set_latency(0);
        self.set_refuse(false);
        self.set_hold(false);
        self.faults.frozen_up_to.store(0, Ordering::Relaxed);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.cut_all();
    }
}

async fn cut_signal(mut rx: watch::Receiver<u64>) {
    let _ = rx.changed().await;
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    f: Arc<Faults>,
    serial: u64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while f.hold.load(Ordering::Relaxed) || serial <= f.frozen_up_to.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ms = f.latency_ms.load(Ordering::Relaxed);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
