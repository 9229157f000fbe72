//! Private Postgres and RabbitMQ instances, for the tests that crash and restart them at will
//! (chaos) or need them set up otherwise (TLS listeners with a test's own CA). Invariant: each
//! instance lives in its own temporary directory on its own ports, is only ever started,
//! stopped or killed through its own data directory or node name, and is removed when dropped;
//! the shared services are never touched.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// `cmd` as the given system user when we are root (Postgres refuses to run as root).
fn as_user(user: &str, program: &str) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", user, "--", program]);
        c
    } else {
        Command::new(program)
    }
}

fn chown(path: &Path, user: &str) {
    if is_root() {
        let status = Command::new("chown")
            .args(["-R", &format!("{user}:{user}")])
            .arg(path)
            .status()
            .expect("chown");
        assert!(status.success(), "chown {} to {user}", path.display());
    }
}

fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A port in `range` that is free, with `port + offset` free too.
fn free_port(seed: u64, range: std::ops::Range<u16>, offset: u16) -> u16 {
    let span = u64::from(range.end - range.start);
    for i in 0..span {
        let p = range.start + ((seed.wrapping_mul(7919) + i) % span) as u16;
        if port_free(p) && (offset == 0 || port_free(p + offset)) {
            return p;
        }
    }
    panic!("no free port in {range:?}");
}

fn tmpdir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("kfschaos-{name}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// A throwaway Postgres 15 cluster.
pub struct PrivatePostgres {
    pub dir: PathBuf,
    pub port: u16,
    /// More `-c` settings for the server.
    settings: String,
}

impl PrivatePostgres {
    pub fn start() -> PrivatePostgres {
        Self::start_with(None)
    }

    /// A cluster that speaks TLS only, with the server certificate of `pki`: any database over
    /// TLS, and database `mtls` only with a client certificate that `pki`'s CA signed.
    pub fn start_tls(pki: &super::pki::Pki) -> PrivatePostgres {
        Self::start_with(Some(pki))
    }

    fn start_with(pki: Option<&super::pki::Pki>) -> PrivatePostgres {
        let dir = tmpdir("pg");
        chown(&dir, "postgres");
        let out = as_user("postgres", &format!("{PG_BIN}/initdb"))
            .args(["-D"])
            .arg(dir.join("data"))
            .args(["-U", "postgres", "--auth=trust", "--no-sync"])
            .stdout(Stdio::null())
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port(rand::random(), 41000..42000, 0);
        let mut settings = String::new();
        if let Some(pki) = pki {
            let tls = dir.join("tls");
            std::fs::create_dir_all(&tls).unwrap();
            pki.install_server_files(&tls);
            std::fs::write(
                dir.join("data").join("pg_hba.conf"),
                "local all all trust\n\
                 hostssl mtls all 127.0.0.1/32 trust clientcert=verify-ca\n\
                 hostssl mtls all ::1/128 trust clientcert=verify-ca\n\
                 hostssl all all 127.0.0.1/32 trust\n\
                 hostssl all all ::1/128 trust\n",
            )
            .unwrap();
            chown(&dir, "postgres");
            let t = tls.display();
            settings = format!(
                " -c ssl=on -c ssl_cert_file={t}/server.pem -c ssl_key_file={t}/server.key -c ssl_ca_file={t}/ca.pem"
            );
        }
        let pg = PrivatePostgres {
            dir,
            port,
            settings,
        };
        pg.up();
        pg
    }

    pub fn addr(&self) -> SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }

    /// URL of `db`, directly (not through a proxy).
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    fn pg_ctl(&self) -> Command {
        let mut c = as_user("postgres", &format!("{PG_BIN}/pg_ctl"));
        c.arg("-D").arg(self.dir.join("data"));
        c
    }

    /// Starts the server and waits until it accepts connections.
    pub fn up(&self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=400 -c fsync=off -c track_commit_timestamp=on{}",
            self.port,
            self.dir.display(),
            self.settings
        );
        let out = self
            .pg_ctl()
            .args(["-w", "-t", "60", "-o", &opts, "-l"])
            .arg(self.dir.join("log"))
            .arg("start")
            .output()
            .expect("pg_ctl start");
        assert!(
            out.status.success(),
            "pg_ctl start failed: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Crashes the server: `pg_ctl stop -m immediate` (no checkpoint, crash recovery on start).
    pub fn crash(&self) {
        let _ = self
            .pg_ctl()
            .args(["-w", "stop", "-m", "immediate"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.crash();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A throwaway RabbitMQ node with no plugins.
pub struct PrivateRabbit {
    pub dir: PathBuf,
    pub node: String,
    pub port: u16,
    /// The TLS listener's port, when it has one.
    pub tls_port: Option<u16>,
    server: Option<std::process::Child>,
}

impl PrivateRabbit {
    pub fn start() -> PrivateRabbit {
        Self::start_with(None)
    }

    /// A node with a TLS listener too, with the server certificate of `pki`, asking clients
    /// for a certificate that `pki`'s CA signed and, with `require_client_cert`, refusing a
    /// client without one.
    pub fn start_tls(pki: &super::pki::Pki, require_client_cert: bool) -> PrivateRabbit {
        Self::start_with(Some((pki, require_client_cert)))
    }

    fn start_with(tls: Option<(&super::pki::Pki, bool)>) -> PrivateRabbit {
        let dir = tmpdir("mq");
        let port = free_port(rand::random(), 42000..43000, 20000);
        std::fs::create_dir_all(dir.join("mnesia")).unwrap();
        std::fs::create_dir_all(dir.join("log")).unwrap();
        std::fs::write(dir.join("plugins"), "[].\n").unwrap();
        let mut conf = format!("listeners.tcp.local = 127.0.0.1:{port}\nloopback_users = none\n");
        let mut tls_port = None;
        if let Some((pki, require)) = tls {
            let tls_dir = dir.join("tls");
            std::fs::create_dir_all(&tls_dir).unwrap();
            pki.install_server_files(&tls_dir);
            let p = free_port(rand::random(), 43000..44000, 0);
            let t = tls_dir.display();
            conf.push_str(&format!(
                "listeners.ssl.default = 127.0.0.1:{p}\n\
                 ssl_options.cacertfile = {t}/ca.pem\n\
                 ssl_options.certfile = {t}/server.pem\n\
                 ssl_options.keyfile = {t}/server.key\n\
                 ssl_options.verify = verify_peer\n\
                 ssl_options.fail_if_no_peer_cert = {require}\n"
            ));
            tls_port = Some(p);
        }
        std::fs::write(dir.join("rabbitmq.conf"), conf).unwrap();
        chown(&dir, "rabbitmq");
        let mut mq = PrivateRabbit {
            node: format!("kfschaos{port}@localhost"),
            dir,
            port,
            tls_port,
            server: None,
        };
        let log = std::fs::File::create(mq.dir.join("server.out")).unwrap();
        // The server daemonises nothing; `setsid` keeps it out of the test's process group.
        let server = Command::new("setsid")
            .arg("rabbitmq-server")
            .env("RABBITMQ_NODENAME", &mq.node)
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", (port + 20000).to_string())
            .env("RABBITMQ_MNESIA_BASE", mq.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", mq.dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", mq.dir.join("plugins"))
            .env("RABBITMQ_CONFIG_FILE", mq.dir.join("rabbitmq.conf"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn rabbitmq-server");
        mq.server = Some(server);
        mq.await_listening(Duration::from_secs(90));
        if let Some(p) = mq.tls_port {
            mq.await_port(p, Duration::from_secs(30));
        }
        mq
    }

    /// URL of the default vhost on the TLS listener, by the name its certificate has.
    pub fn tls_url(&self) -> String {
        format!(
            "amqps://guest:guest@localhost:{}/%2f",
            self.tls_port.expect("a node with a TLS listener")
        )
    }

    fn await_port(&self, port: u16, timeout: Duration) {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!(
            "private RabbitMQ {} did not listen on {port} within {timeout:?}; see {}",
            self.node,
            self.dir.join("log").display()
        );
    }

    pub fn addr(&self) -> SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }

    /// URL of the default vhost, directly (not through a proxy).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    fn ctl(&self, args: &[&str]) -> bool {
        Command::new("rabbitmqctl")
            .args(["-n", &self.node])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    fn await_listening(&self, timeout: Duration) {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if std::net::TcpStream::connect(self.addr()).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!(
            "private RabbitMQ {} did not listen within {timeout:?}; see {}",
            self.node,
            self.dir.join("server.out").display()
        );
    }

    /// Stops the broker application: every connection drops, the port closes.
    pub fn stop_app(&self) {
        assert!(
            self.ctl(&["stop_app"]),
            "rabbitmqctl stop_app {}",
            self.node
        );
    }

    /// Starts it again and waits until the port accepts connections.
    pub fn start_app(&self) {
        assert!(
            self.ctl(&["start_app"]),
            "rabbitmqctl start_app {}",
            self.node
        );
        self.await_listening(Duration::from_secs(60));
    }

    /// Client connections the broker has open now (None: not answering).
    pub fn connections(&self) -> Option<usize> {
        let out = Command::new("rabbitmqctl")
            .args(["-n", &self.node, "-q", "list_connections", "pid"])
            .output()
            .ok()?;
        out.status.success().then(|| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.trim_start().starts_with('<'))
                .count()
        })
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        self.ctl(&["stop"]);
        if let Some(mut server) = self.server.take() {
            let start = Instant::now();
            while matches!(server.try_wait(), Ok(None)) && start.elapsed() < Duration::from_secs(20)
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = server.kill();
            let _ = server.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
