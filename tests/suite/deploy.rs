//! The deploy files agree with what the worker declares: RabbitMQ definitions loaded into the
//! broker first must not conflict with the worker's own idempotent declarations.

use std::process::Command;

use kfs_worker::broker::Topology;
use kfs_worker::jobs::Kind;

use crate::support;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_definitions_match_the_topology_the_worker_declares() {
    let _services = support::isolation::shared().await;
    let ok = Command::new("rabbitmqctl")
        .args(["-q", "status"])
        .output()
        .map(|o| o.status.success());
    if !matches!(ok, Ok(true)) {
        support::skip_or_fail(
            "rabbitmqctl cannot reach the local broker, so definitions cannot be imported",
        );
        return;
    }
    let prefix = format!("deploy{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let raw = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/ops/deploy/rabbitmq-definitions.json"
    ))
    .expect("definitions");
    // The same definitions under this test's own prefix (and policy name).
    let defs = raw
        .replace("\"kfs.", &format!("\"{prefix}."))
        .replace("^kfs\\\\.", &format!("^{prefix}\\\\."))
        .replace("kfs-job-queues", &format!("{prefix}-job-queues"));
    let file = std::env::temp_dir().join(format!("{prefix}-definitions.json"));
    std::fs::write(&file, defs).unwrap();
    let import = Command::new("rabbitmqctl")
        .args(["-q", "import_definitions"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        import.status.success(),
        "import: {}",
        String::from_utf8_lossy(&import.stderr)
    );

    let conn =
        lapin::Connection::connect(&support::amqp_url(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let topology = Topology::new(&prefix);
    // Redeclaring with different arguments would close the channel with PRECONDITION_FAILED.
    let declared = topology.declare(&ch, &Kind::platform()).await;
    let ch2 = conn.create_channel().await.unwrap();
    let _ = topology.delete(&ch2, &Kind::platform()).await;
    let _ = Command::new("rabbitmqctl")
        .args(["-q", "clear_policy", &format!("{prefix}-job-queues")])
        .output();
    let _ = std::fs::remove_file(&file);
    declared.expect("the worker's declarations agree with the definitions");
}
