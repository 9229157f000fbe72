//! The operator dashboard against a real worker, Postgres and RabbitMQ: its JSON endpoints, the
//! admin-token gate of every action, the dead-letter peek and requeue (library, HTTP and CLI),
//! and an end-to-end run in headless Chromium (Debian's `chromium` and `chromium-driver`)
//! driven over WebDriver: a job appears and finishes live, and a failed compile is retried
//! first without the token (refused, nothing changes) and then with it (it runs again); a
//! research task is paused, resumed and canceled with a reason by clicking its page's buttons.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use fantoccini::{ClientBuilder, Locator};
use kfs_worker::jobs::compile::{self, RequestOptions};
use kfs_worker::jobs::probe::{self, ProbeSpec};
use kfs_worker::jobs::research;
use lapin::options::{BasicGetOptions, BasicPublishOptions, BasicRejectOptions};
use lapin::BasicProperties;
use serde_json::Value;
use uuid::Uuid;

use crate::support::space::SpaceFx;
use crate::support::{self, free_port, TestEnv};

const TOKEN: &str = "dashboard-test-token-0123456789";
const RESEARCHER: &str = "subject-dash";
const GOOD: &[u8] = b"Otters juggle pebbles in the kelp forest. They sleep holding paws.";

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

async fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    let r = http()
        .get(format!("http://{addr}{path}"))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap();
    let code = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// POSTs a form (already url-encoded) and returns the status and the JSON outcome.
async fn post(addr: SocketAddr, path: &str, form: &str, bearer: Option<&str>) -> (u16, Value) {
    let mut req = http()
        .post(format!("http://{addr}{path}"))
        .header("accept", "application/json")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form.to_owned());
    if let Some(t) = bearer {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let r = req.send().await.unwrap();
    let code = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

support::space::space_fixture!(
    /// A test database and queues, a file object store shared with the worker, one space.
    Fx
);

impl Fx {
    async fn new() -> Fx {
        Fx(SpaceFx::new("tenant-dash", "dash", "Dashboard").await)
    }

    async fn add(&self, name: &str, bytes: &[u8]) -> Uuid {
        self.0.add(name, "text/plain", bytes).await
    }

    async fn object_key(&self, doc: Uuid) -> String {
        sqlx::query_scalar("SELECT object_key FROM document_assets WHERE id = $1")
            .bind(doc)
            .fetch_one(&self.env.pool)
            .await
            .unwrap()
    }

    /// A document whose stored bytes no longer match its hash: its compile fails for real.
    async fn broken_document(&self, name: &str) -> Uuid {
        let doc = self.add(name, GOOD).await;
        let key = self.object_key(doc).await;
        self.store
            .put(&key, Bytes::from_static(b"garbled"))
            .await
            .unwrap();
        doc
    }

    async fn repair(&self, doc: Uuid) {
        let key = self.object_key(doc).await;
        self.store
            .put(&key, Bytes::from_static(GOOD))
            .await
            .unwrap();
    }

    async fn compile(&self, doc: Uuid) -> Uuid {
        let mut conn = self.env.pool.acquire().await.unwrap();
        compile::request(&mut conn, doc, RequestOptions::default())
            .await
            .unwrap()
    }

    async fn run_state(&self, attempt: Uuid) -> String {
        sqlx::query_scalar("SELECT run_state FROM document_compilation_attempts WHERE id = $1")
            .bind(attempt)
            .fetch_one(&self.env.pool)
            .await
            .unwrap()
    }

    /// The attempt and its outbox row as text: "nothing changed" compares these.
    async fn rows(&self, attempt: Uuid) -> String {
        sqlx::query_scalar(
            "SELECT a::text || ' ' || (SELECT string_agg(o::text, ' ') FROM document_compilation_outbox o WHERE o.attempt_id = a.id) \
             FROM document_compilation_attempts a WHERE a.id = $1",
        )
        .bind(attempt)
        .fetch_one(&self.env.pool)
        .await
        .unwrap()
    }

    async fn wait_state(&self, attempt: Uuid, state: &str) -> bool {
        let ok = self
            .env
            .wait_until(Duration::from_secs(60), || async {
                self.run_state(attempt).await == state
            })
            .await;
        assert!(
            ok,
            "attempt {attempt} never became {state}: {}",
            self.rows(attempt).await
        );
        ok
    }

    /// A `kfs-worker run` process for compile and probe with the dashboard on `addr`.
    fn worker(&self, name: &str, addr: SocketAddr, token: Option<&str>) -> support::Worker {
        let addr = addr.to_string();
        let mut extra = vec![
            ("KFS_HTTP_ADDR", addr.as_str()),
            ("KFS_OBJECT_STORE", self.store_url.as_str()),
            ("KFS_KINDS", "compile,probe"),
            ("KFS_RETRY_BASE", "100ms"),
            ("KFS_RELAY_POLL", "200ms"),
        ];
        if let Some(t) = token {
            extra.push(("KFS_ADMIN_TOKEN", t));
        }
        self.env.spawn_worker(name, &["run"], &extra)
    }

    /// A research task requested as the platform's API would, over this space.
    async fn research(&self, question: &str) -> Uuid {
        let mut tx = self.env.pool.begin().await.unwrap();
        let snapshot = kfs_worker::tools::platform::create_permission_snapshot(
            &mut tx,
            "tenant-dash",
            self.space,
            RESEARCHER,
            "interactive",
            None,
        )
        .await
        .unwrap();
        let req =
            research::request::ResearchRequest::new(self.space, question, RESEARCHER, snapshot);
        let done = research::request::request(&mut tx, &req).await.unwrap();
        tx.commit().await.unwrap();
        done.job_id
    }

    async fn stage(&self, task: Uuid) -> (String, Option<String>) {
        sqlx::query_as("SELECT stage, error FROM research_task_jobs WHERE id = $1")
            .bind(task)
            .fetch_one(&self.env.pool)
            .await
            .unwrap()
    }

    /// A `kfs-worker run --maintenance` process for research with the dashboard on `addr`: no
    /// relay and no consumer, so a job stays where the dashboard's actions put it.
    fn dashboard_only(&self, name: &str, addr: SocketAddr, token: &str) -> support::Worker {
        let addr = addr.to_string();
        let extra = [
            ("KFS_HTTP_ADDR", addr.as_str()),
            ("KFS_OBJECT_STORE", self.store_url.as_str()),
            ("KFS_KINDS", "research"),
            ("KFS_ADMIN_TOKEN", token),
        ];
        self.env
            .spawn_worker(name, &["run", "--maintenance"], &extra)
    }

    async fn wait_ready(&self, addr: SocketAddr, worker: &support::Worker) {
        let ok = self
            .env
            .wait_until(Duration::from_secs(30), || async {
                matches!(http().get(format!("http://{addr}/readyz")).send().await, Ok(r) if r.status() == 200)
            })
            .await;
        assert!(ok, "worker never ready:\n{}", worker.log_text());
    }

    async fn cleanup(self) {
        self.0.cleanup().await;
    }
}

/// Puts one undecodable message for `probe` through a real dead-lettering: published to the
/// probe queue, then rejected without requeue (by this test, or by a running worker's
/// consumer, which rejects what it cannot decode the same way).
async fn dead_letter(env: &TestEnv, message_id: &str) {
    let ch = env.confirm_channel().await;
    ch.basic_publish(
        env.topology.exchange().as_str().into(),
        "probe.job".into(),
        BasicPublishOptions::default(),
        b"not json",
        BasicProperties::default()
            .with_message_id(message_id.into())
            .with_type("probe.job".into()),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let queue = env.topology.queue(kfs_worker::jobs::Kind::Probe);
    // A running worker may take it first; it rejects it the same way.
    if let Some(got) = ch
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
    {
        got.delivery
            .acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    let dlq = env.topology.dead_letter_queue();
    assert!(
        env.wait_until(Duration::from_secs(10), || async {
            env.queue_depth(&dlq).await >= 1
        })
        .await
    );
}

/// The queue's depth once it reaches `n`, or the last depth seen within five seconds. Messages
/// that a peek took return to the queue when its channel closes, which the broker does in its
/// own time.
async fn depth_becomes(env: &TestEnv, queue: &str, n: u32) -> u32 {
    let mut depth = env.queue_depth(queue).await;
    for _ in 0..50 {
        if depth == n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        depth = env.queue_depth(queue).await;
    }
    depth
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_json_endpoints_show_live_numbers_and_every_action_needs_the_token() {
    let fx = Fx::new().await;
    let addr = free_port();
    let mut worker = fx.worker("dash-api", addr, Some(TOKEN));
    fx.wait_ready(addr, &worker).await;

    // Live counts: probe jobs appear and finish.
    probe::enqueue_many(&fx.env.pool, 5, &ProbeSpec::default())
        .await
        .unwrap();
    let done = fx
        .env
        .wait_until(Duration::from_secs(30), || async {
            let (_, o) = get_json(addr, "/api/overview").await;
            o["kinds"]
                .as_array()
                .and_then(|ks| ks.iter().find(|k| k["kind"] == "probe"))
                .is_some_and(|k| k["jobs"]["succeeded"] == 5)
        })
        .await;
    let (code, o) = get_json(addr, "/api/overview").await;
    assert!(done, "{o}");
    assert_eq!(code, 200);
    assert_eq!(o["actions_enabled"], true);
    let probe = o["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["kind"] == "probe")
        .unwrap();
    assert_eq!(probe["outbox"]["completed"], 5, "{probe}");
    assert!(
        probe["completed_per_minute"].as_f64().unwrap() >= 1.0,
        "{probe}"
    );
    assert_eq!(probe["queued_messages"], 0);
    assert!(o["html"]["kinds"]
        .as_str()
        .unwrap()
        .contains("data-kind=\"probe\""));
    assert_eq!(o["recent"].as_array().unwrap().len(), 5);
    assert!(!o.to_string().contains(TOKEN), "the token is never shown");
    assert!(!o.to_string().contains("guest:guest"), "no credentials");

    // A compile that fails for real shows up with its error code.
    let doc = fx.broken_document("broken.txt").await;
    let attempt = fx.compile(doc).await;
    fx.wait_state(attempt, "failed").await;
    let (_, o) = get_json(addr, "/api/overview").await;
    let failure = o["failures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == attempt.to_string())
        .unwrap_or_else(|| panic!("failure listed: {o}"));
    assert_eq!(failure["error_code"], "hash_mismatch");
    assert_eq!(failure["actions"], serde_json::json!(["retry"]));
    let (code, d) = get_json(addr, &format!("/api/jobs/compile/{attempt}")).await;
    assert_eq!(code, 200, "{d}");
    assert_eq!(d["state"], "failed");
    assert_eq!(d["deliveries"].as_array().unwrap().len(), 1, "{d}");
    assert_eq!(d["history"][0]["title"], "Attempts of this document");
    assert_eq!(get_json(addr, "/api/jobs/compile/not-a-uuid").await.0, 404);
    assert_eq!(
        get_json(addr, &format!("/api/jobs/research/{attempt}"))
            .await
            .0,
        404,
        "a kind this worker does not serve"
    );

    // The gate: no token, a wrong token, and a token in the wrong place change nothing.
    let path = format!("/actions/jobs/compile/{attempt}/retry");
    let before = fx.rows(attempt).await;
    let (code, out) = post(addr, &path, "", None).await;
    assert_eq!(code, 401, "{out}");
    assert!(out["message"]
        .as_str()
        .unwrap()
        .contains("needs the admin token"));
    let (code, out) = post(addr, &path, "token=wrong-token-wrong-token", None).await;
    assert_eq!(code, 403, "{out}");
    assert!(out["message"].as_str().unwrap().contains("wrong"));
    assert_eq!(post(addr, &path, "", Some("nope")).await.0, 403);
    assert!(!out.to_string().contains(TOKEN));
    assert_eq!(
        fx.rows(attempt).await,
        before,
        "refused actions change nothing"
    );

    // A refusal of the library function comes back as it is: probe jobs take no action, and a
    // compile retry of a job that is not failed is refused by `compile::retry` itself.
    let probe_job: Uuid = sqlx::query_scalar("SELECT id FROM kfs_probe_jobs LIMIT 1")
        .fetch_one(&fx.env.pool)
        .await
        .unwrap();
    let (code, out) = post(
        addr,
        &format!("/actions/jobs/probe/{probe_job}/retry"),
        &format!("token={TOKEN}"),
        None,
    )
    .await;
    assert_eq!(code, 400, "{out}");
    let (code, out) = post(
        addr,
        &format!("/actions/jobs/compile/{attempt}/pause"),
        "",
        Some(TOKEN),
    )
    .await;
    assert_eq!(code, 400, "{out}");
    assert!(out["message"].as_str().unwrap().contains("they take retry"));

    // With the token: the same retry as `kfs-worker compile retry`, and the job runs again.
    fx.repair(doc).await;
    let (code, out) = post(addr, &path, "", Some(TOKEN)).await;
    assert_eq!(code, 200, "{out}");
    fx.wait_state(attempt, "succeeded").await;
    let (code, out) = post(addr, &path, &format!("token={TOKEN}"), None).await;
    assert_eq!(code, 409, "only a failed attempt is retried: {out}");
    assert!(out["message"]
        .as_str()
        .unwrap()
        .contains("only a failed attempt"));

    // Dead letters: peeked with their reason, requeued only with the token, once.
    dead_letter(&fx.env, "bad-delivery-1").await;
    let (_, o) = get_json(addr, "/api/overview").await;
    assert_eq!(o["dead_letters"], 1, "{o}");
    let dl = &o["dead_letter_sample"][0];
    assert_eq!(dl["id"], "bad-delivery-1");
    assert_eq!(dl["reason"], "rejected");
    assert_eq!(dl["kind"], "probe");
    assert_eq!(dl["count"], 1);
    let dlq = fx.env.topology.dead_letter_queue();
    assert_eq!(
        depth_becomes(&fx.env, &dlq, 1).await,
        1,
        "a peek leaves the message where it is"
    );
    let (code, _) = post(addr, "/actions/dlq/requeue", "id=bad-delivery-1", None).await;
    assert_eq!(code, 401);
    assert_eq!(depth_becomes(&fx.env, &dlq, 1).await, 1);
    let (code, out) = post(
        addr,
        "/actions/dlq/requeue",
        "id=no-such-message",
        Some(TOKEN),
    )
    .await;
    assert_eq!(code, 404, "{out}");
    let (code, out) = post(
        addr,
        "/actions/dlq/requeue",
        "id=bad-delivery-1",
        Some(TOKEN),
    )
    .await;
    assert_eq!(code, 200, "{out}");
    // The worker's consumer gets it again, still cannot decode it, and rejects it again.
    let died_twice = fx
        .env
        .wait_until(Duration::from_secs(20), || async {
            let (_, o) = get_json(addr, "/api/overview").await;
            o["dead_letter_sample"][0]["count"] == 2
        })
        .await;
    assert!(died_twice, "{}", get_json(addr, "/api/overview").await.1);

    support::stop_cleanly([&mut worker], Duration::from_secs(30)).await;
    assert!(
        !worker.log_text().contains(TOKEN),
        "the token is never logged"
    );

    // A worker started without a token refuses every action.
    let addr2 = free_port();
    let worker2 = fx.worker("dash-no-token", addr2, None);
    fx.wait_ready(addr2, &worker2).await;
    let (_, o) = get_json(addr2, "/api/overview").await;
    assert_eq!(o["actions_enabled"], false);
    let before = fx.rows(attempt).await;
    let (code, out) = post(addr2, &path, "", Some(TOKEN)).await;
    assert_eq!(code, 403, "{out}");
    assert!(out["message"]
        .as_str()
        .unwrap()
        .contains("started without KFS_ADMIN_TOKEN"));
    assert_eq!(fx.rows(attempt).await, before);
    drop(worker2);
    fx.cleanup().await;
}

fn kfs(env: &TestEnv, args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kfs-worker"));
    cmd.args(args);
    for (k, v) in env.worker_env() {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_lists_and_requeues_dead_letters_once() {
    let env = TestEnv::new().await;
    let dlq = env.topology.dead_letter_queue();
    let probe_queue = env.topology.queue(kfs_worker::jobs::Kind::Probe);

    let out = kfs(&env, &["dlq", "list"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("is empty"));

    dead_letter(&env, "dead-1").await;
    // A message that names no kind of ours, put straight into the dead-letter queue.
    let ch = env.confirm_channel().await;
    ch.basic_publish(
        "".into(),
        dlq.as_str().into(),
        BasicPublishOptions::default(),
        b"mystery",
        BasicProperties::default(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    let out = kfs(&env, &["dlq", "list", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed[0]["id"], "dead-1");
    assert_eq!(listed[0]["reason"], "rejected");
    assert_eq!(listed[0]["queue"], probe_queue.as_str());
    let mystery = listed[1]["id"].as_str().unwrap().to_owned();
    assert!(mystery.starts_with("sha256:"), "{mystery}");
    assert_eq!(
        depth_becomes(&env, &dlq, 2).await,
        2,
        "listing removes nothing"
    );
    let text = kfs(&env, &["dlq", "list"]);
    assert!(String::from_utf8_lossy(&text.stdout)
        .contains("dead-1  kind=probe  reason=rejected  count=1"));

    // Requeue: back on the probe queue, gone from the dead-letter queue.
    let out = kfs(&env, &["dlq", "requeue", "dead-1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("requeued dead-1"));
    assert_eq!(depth_becomes(&env, &probe_queue, 1).await, 1);
    assert_eq!(depth_becomes(&env, &dlq, 1).await, 1);
    let ch = env.channel().await;
    let back = ch
        .basic_get(
            probe_queue.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back.delivery.data, b"not json");
    assert_eq!(
        back.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some("dead-1")
    );

    // Once: a second requeue of the same id finds nothing and changes nothing.
    let out = kfs(&env, &["dlq", "requeue", "dead-1"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no message dead-1 in the dead-letter queue"),
        "{err}"
    );
    // A message that names no kind stays where it is.
    let out = kfs(&env, &["dlq", "requeue", &mystery]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("names no job kind"));
    assert_eq!(depth_becomes(&env, &dlq, 1).await, 1);
    let out = kfs(&env, &["dlq", "requeue", " "]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("message id is empty"));

    // Two requeues of one message at the same time: exactly one moves it.
    dead_letter(&env, "dead-2").await;
    let amqp =
        lapin::Connection::connect(&support::amqp_url(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
    let (a, b) = tokio::join!(
        kfs_worker::dlq::requeue(&amqp, &env.topology, "dead-2"),
        kfs_worker::dlq::requeue(&amqp, &env.topology, "dead-2"),
    );
    assert!(
        a.is_ok() != b.is_ok(),
        "exactly one requeue succeeds: {a:?} {b:?}"
    );
    assert_eq!(depth_becomes(&env, &probe_queue, 1).await, 1);
    let _ = amqp.close(200, "bye".into()).await;
    env.cleanup().await;
}

/// chromedriver on a free port, killed on drop.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn chromedriver() -> Driver {
    let port = free_port().port();
    let child = Command::new("/usr/bin/chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver (apt-get install chromium chromium-driver)");
    let url = format!("http://127.0.0.1:{port}");
    for _ in 0..100 {
        if let Ok(r) = http().get(format!("{url}/status")).send().await {
            if r.status() == 200 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Driver { child, url }
}

async fn browser(driver: &Driver) -> fantoccini::Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1000"],
        }),
    );
    ClientBuilder::rustls()
        .unwrap()
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .expect("a WebDriver session in headless Chromium")
}

async fn text_of(c: &fantoccini::Client, css: &str) -> String {
    c.find(Locator::Css(css))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_a_browser_a_job_appears_and_finishes_and_a_failed_one_is_retried_with_the_token() {
    let fx = Fx::new().await;
    let addr = free_port();
    let worker = fx.worker("dash-browser", addr, Some(TOKEN));
    fx.wait_ready(addr, &worker).await;
    let driver = chromedriver().await;
    let c = browser(&driver).await;
    let wait = Duration::from_secs(60);

    c.goto(&format!("http://{addr}/")).await.unwrap();
    assert_eq!(c.title().await.unwrap(), "Jobs · kfs-worker");
    c.find(Locator::Css("[data-kind=\"compile\"]"))
        .await
        .unwrap();

    // The page is live: a compile requested now appears and finishes without a reload.
    let doc = fx.add("otters.txt", GOOD).await;
    let ok = fx.compile(doc).await;
    c.wait()
        .at_most(wait)
        .for_element(Locator::Css(&format!("[data-recent=\"{ok}\"]")))
        .await
        .expect("the new job appears");
    c.wait()
        .at_most(wait)
        .for_element(Locator::Css(&format!(
            "[data-recent=\"{ok}\"][data-state=\"succeeded\"]"
        )))
        .await
        .expect("the job finishes on the page");
    assert_eq!(fx.run_state(ok).await, "succeeded");
    // The kind's card counts it (the next refresh at the latest).
    let count = c
        .wait()
        .at_most(wait)
        .for_element(Locator::Css(
            "[data-kind=\"compile\"] [data-state=\"succeeded\"]",
        ))
        .await
        .expect("the compile card counts the finished job")
        .text()
        .await
        .unwrap();
    assert_eq!(count, "1");

    // A compile that fails for real is listed with its error code.
    let broken = fx.broken_document("broken.txt").await;
    let bad = fx.compile(broken).await;
    c.wait()
        .at_most(wait)
        .for_element(Locator::Css(&format!("[data-failure=\"{bad}\"]")))
        .await
        .expect("the failure is listed");
    let row = text_of(&c, &format!("[data-failure=\"{bad}\"]")).await;
    assert!(row.contains("hash_mismatch"), "{row}");

    // Its page: checkpoint strip, deliveries, and the retry action.
    assert_eq!(
        open_job(&c, addr, "compile", bad).await.as_deref(),
        Some("failed")
    );
    assert!(text_of(&c, "#job-error").await.contains("hash_mismatch"));
    fx.repair(broken).await;

    // Without the token: refused, and nothing changes.
    let before = fx.rows(bad).await;
    let (ok, text) = click_action(&c, "retry").await;
    assert_eq!(ok.as_deref(), Some("false"));
    assert!(text.contains("needs the admin token"));
    assert_eq!(fx.rows(bad).await, before);

    // With a wrong token: refused too.
    open_job(&c, addr, "compile", bad).await;
    type_token(&c, "not-the-token-at-all").await;
    let (_, text) = click_action(&c, "retry").await;
    assert!(text.contains("wrong"));
    assert_eq!(fx.rows(bad).await, before);

    // With the token: accepted, and the job runs again to the end.
    open_job(&c, addr, "compile", bad).await;
    type_token(&c, TOKEN).await;
    let (ok, text) = click_action(&c, "retry").await;
    assert_eq!(ok.as_deref(), Some("true"));
    assert!(text.contains("retrying"));
    fx.wait_state(bad, "succeeded").await;
    c.find(Locator::Css("#back"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    c.wait()
        .at_most(wait)
        .for_element(Locator::Css("#job-state[data-state=\"succeeded\"]"))
        .await
        .expect("the job page shows it succeeded");

    c.close().await.unwrap();
    drop(driver);
    drop(worker);
    fx.cleanup().await;
}

/// Opens a job's page; returns the state it shows.
async fn open_job(
    c: &fantoccini::Client,
    addr: SocketAddr,
    kind: &str,
    id: Uuid,
) -> Option<String> {
    c.goto(&format!("http://{addr}/jobs/{kind}/{id}"))
        .await
        .unwrap();
    c.find(Locator::Css("#job-state"))
        .await
        .unwrap()
        .attr("data-state")
        .await
        .unwrap()
}

/// Replaces whatever the page's admin-token box holds with `token`.
async fn type_token(c: &fantoccini::Client, token: &str) {
    let token_box = c.find(Locator::Css("#admin-token")).await.unwrap();
    token_box.clear().await.unwrap();
    token_box.send_keys(token).await.unwrap();
}

/// Clicks the page's `action` button; returns the outcome's `data-ok` and its text.
async fn click_action(c: &fantoccini::Client, action: &str) -> (Option<String>, String) {
    c.find(Locator::Css(&format!("button[data-action=\"{action}\"]")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let outcome = c
        .wait()
        .at_most(Duration::from_secs(60))
        .for_element(Locator::Css("#outcome"))
        .await
        .unwrap();
    (
        outcome.attr("data-ok").await.unwrap(),
        outcome.text().await.unwrap(),
    )
}

/// Opens `task`'s page, checks the stage it shows, types the token and clicks `action`
/// (after typing `reason`, when given, into the action's reason box); the action must succeed.
async fn click_research_action(
    c: &fantoccini::Client,
    addr: SocketAddr,
    task: Uuid,
    shows: &str,
    action: &str,
    reason: Option<&str>,
) {
    assert_eq!(
        open_job(c, addr, "research", task).await.as_deref(),
        Some(shows)
    );
    type_token(c, TOKEN).await;
    if let Some(r) = reason {
        c.find(Locator::Css("form.action input[name=\"reason\"]"))
            .await
            .unwrap()
            .send_keys(r)
            .await
            .unwrap();
    }
    let (ok, text) = click_action(c, action).await;
    assert_eq!(ok.as_deref(), Some("true"), "{action}: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_a_browser_a_research_task_is_paused_resumed_and_canceled_with_a_reason() {
    let fx = Fx::new().await;
    let task = fx.research("Where do otters keep their pebbles?").await;
    let addr = free_port();
    let worker = fx.dashboard_only("dash-research", addr, TOKEN);
    fx.wait_ready(addr, &worker).await;
    let driver = chromedriver().await;
    let c = browser(&driver).await;

    click_research_action(&c, addr, task, "queued", "pause", None).await;
    assert_eq!(fx.stage(task).await.0, "paused");

    // A paused task offers resume and cancel, not pause.
    open_job(&c, addr, "research", task).await;
    assert!(c
        .find(Locator::Css("button[data-action=\"pause\"]"))
        .await
        .is_err());
    click_research_action(&c, addr, task, "paused", "resume", None).await;
    assert_eq!(fx.stage(task).await.0, "queued");

    click_research_action(
        &c,
        addr,
        task,
        "queued",
        "cancel",
        Some("asked twice by the browser test"),
    )
    .await;
    let (stage, error) = fx.stage(task).await;
    assert_eq!(stage, "canceled");
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.contains("asked twice by the browser test")),
        "{error:?}"
    );

    // An ended task offers no action at all.
    open_job(&c, addr, "research", task).await;
    assert!(c.find(Locator::Css("form.action button")).await.is_err());

    c.close().await.unwrap();
    drop(driver);
    drop(worker);
    fx.cleanup().await;
}
