//! The deploy files agree with what the worker declares: RabbitMQ definitions loaded into the
//! broker first must not conflict with the worker's own idempotent declarations, and the
//! Kubernetes overlay for a RabbitMQ cluster names every node and reads every secret from files.

use std::path::Path;
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

/// The values of the `key: value` lines of `yaml` (block style, any indentation, list items
/// too), without quotes; `key:` lines that open a nested block are left out.
fn scalars<'a>(yaml: &'a str, key: &str) -> Vec<&'a str> {
    let prefix = format!("{key}:");
    yaml.lines()
        .map(|l| l.trim_start())
        .map(|l| l.strip_prefix("- ").unwrap_or(l))
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .map(|v| v.trim().trim_matches('"'))
        .filter(|v| !v.is_empty())
        .collect()
}

/// The value of the one `key: value` line of `yaml`.
fn scalar<'a>(yaml: &'a str, key: &str) -> &'a str {
    let found = scalars(yaml, key);
    assert_eq!(found.len(), 1, "one `{key}:` line wanted, found {found:?}");
    found[0]
}

/// The items of the block list under the top-level `key:` (`- item` lines).
fn items<'a>(yaml: &'a str, key: &str) -> Vec<&'a str> {
    let head = format!("{key}:");
    yaml.lines()
        .skip_while(|l| l.trim_end() != head)
        .skip(1)
        .map_while(|l| l.trim_start().strip_prefix("- "))
        .map(str::trim)
        .collect()
}

/// The keys of the mapping under the top-level `key:` (its lines indented by two spaces).
fn keys<'a>(yaml: &'a str, key: &str) -> Vec<&'a str> {
    let head = format!("{key}:");
    yaml.lines()
        .skip_while(|l| l.trim_end() != head)
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with(' '))
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.trim().split_once(':').map(|(k, _)| k))
        .collect()
}

/// The overlay in ops/deploy/kubernetes/cluster: a three-node RabbitmqCluster with TLS; the
/// worker's AMQP_URL lists each node by its pod's name on the operator's headless service, over
/// amqps, and the worker accepts it; every secret reaches the worker as a `*_FILE` setting that
/// names a file of a mounted Secret, and Postgres is verified (sslmode=verify-full) against a
/// mounted CA. With kubectl at hand the overlay is also built, so the patch is known to apply.
#[test]
fn the_cluster_overlay_names_every_node_and_reads_secrets_from_mounted_files() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/deploy/kubernetes/cluster");
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let kustomization = read("kustomization.yaml");
    let rabbitmq = read("rabbitmq.yaml");
    let settings = read("worker-settings.yaml");
    let patch = read("worker-patch.yaml");
    let secret = read("secret.example.yaml");
    let worker = read("../worker.yaml");

    // The overlay: every file it names exists; the base's workloads are all patched.
    let namespace = scalar(&kustomization, "namespace");
    let resources = items(&kustomization, "resources");
    for file in ["../worker.yaml", "rabbitmq.yaml", "worker-settings.yaml"] {
        assert!(
            resources.contains(&file),
            "{file} in resources: {resources:?}"
        );
    }
    for file in resources
        .iter()
        .chain(scalars(&kustomization, "path").iter())
    {
        assert!(
            dir.join(file).is_file(),
            "{file} named by kustomization.yaml exists"
        );
    }
    assert_eq!(scalars(&kustomization, "path"), ["worker-patch.yaml"; 2]);
    let workloads =
        worker.matches("\nkind: Deployment").count() + worker.matches("\nkind: Job").count();
    assert_eq!(
        workloads, 3,
        "the migrate Job and two Deployments in worker.yaml"
    );
    assert_eq!(
        worker.matches("envFrom:").count(),
        workloads,
        "each workload has the envFrom the patch replaces"
    );

    // Three RabbitMQ nodes with TLS (and client certificates verified against the CA).
    assert_eq!(scalar(&rabbitmq, "apiVersion"), "rabbitmq.com/v1beta1");
    assert_eq!(scalar(&rabbitmq, "kind"), "RabbitmqCluster");
    let cluster = scalar(&rabbitmq, "name");
    let replicas: usize = scalar(&rabbitmq, "replicas").parse().unwrap();
    assert_eq!(replicas, 3);
    let tls_secret = scalar(&rabbitmq, "secretName");
    assert_eq!(tls_secret, "kfs-rabbitmq-tls");
    assert_eq!(scalar(&rabbitmq, "caSecretName"), tls_secret);
    assert_eq!(scalar(&rabbitmq, "disableNonTLSListeners"), "true");

    // The settings: secrets only as files under the mounted volume, TLS material as paths.
    assert_eq!(scalar(&settings, "kind"), "ConfigMap");
    let settings_name = scalar(&settings, "name");
    let vars = keys(&settings, "data");
    for var in [
        "DATABASE_URL_FILE",
        "AMQP_URL_FILE",
        "KFS_AMQP_TLS_CA",
        "KFS_AMQP_TLS_CERT",
        "KFS_AMQP_TLS_KEY",
    ] {
        assert!(
            vars.contains(&var),
            "{var} in worker-settings.yaml: {vars:?}"
        );
    }
    for plain in ["DATABASE_URL", "AMQP_URL", "PGPASSWORD"] {
        assert!(
            !vars.contains(&plain),
            "{plain} is given by value, not as a file"
        );
    }
    let mount = scalar(&patch, "mountPath");
    assert_eq!(scalar(&patch, "readOnly"), "true");
    let ops: Vec<(&str, &str)> = scalars(&patch, "op")
        .into_iter()
        .zip(
            scalars(&patch, "path")
                .into_iter()
                .filter(|p| p.starts_with('/')),
        )
        .collect();
    assert!(
        ops.contains(&("replace", "/spec/template/spec/containers/0/envFrom")),
        "the patch replaces envFrom: {ops:?}"
    );
    assert!(
        !patch.contains("secretRef"),
        "no setting comes from a Secret by value"
    );
    assert!(
        scalars(&patch, "name").contains(&settings_name),
        "the containers take {settings_name}"
    );

    // Which files the volume holds: every key of the kfs-worker-files Secret, and the items
    // projected from the TLS Secrets (of the RabbitMQ nodes' Secret, its CA only).
    let sources = scalars(&patch, "name");
    let files_secret = scalar(&secret, "name");
    assert_eq!(scalar(&secret, "kind"), "Secret");
    for name in [files_secret, tls_secret] {
        assert!(
            sources.contains(&name),
            "the volume projects Secret {name}: {sources:?}"
        );
    }
    let mut files: Vec<&str> = keys(&secret, "stringData");
    files.extend(
        scalars(&patch, "path")
            .into_iter()
            .filter(|p| !p.starts_with('/')),
    );
    let in_volume = |path: &str| {
        let file = path
            .strip_prefix(mount)
            .and_then(|f| f.strip_prefix('/'))
            .unwrap_or_else(|| panic!("{path} is not under the mounted {mount}"));
        assert!(files.contains(&file), "{file} is in the volume: {files:?}");
    };
    for var in &vars {
        in_volume(scalar(&settings, var));
    }

    // AMQP_URL_FILE's content: every node, in order, by its pod's name, over TLS.
    let amqp = scalar(&secret, "amqp-url");
    if let Err(e) = kfs_worker::config::amqp_url(amqp) {
        panic!("the worker rejects the example amqp-url: {e}");
    }
    let nodes: Vec<url::Url> = amqp
        .split(',')
        .map(|u| url::Url::parse(u).unwrap())
        .collect();
    assert_eq!(nodes.len(), replicas, "one URL per node: {amqp}");
    for (i, node) in nodes.iter().enumerate() {
        assert_eq!(node.scheme(), "amqps");
        assert_eq!(
            node.host_str(),
            Some(format!("{cluster}-server-{i}.{cluster}-nodes.{namespace}.svc").as_str())
        );
        assert_eq!(node.port(), Some(5671));
    }

    // DATABASE_URL_FILE's content: the server's certificate and name verified, CA mounted.
    let database = scalar(&secret, "database-url");
    if let Err(e) = kfs_worker::config::database_url(Some(database)) {
        panic!("the worker rejects the example database-url: {e}");
    }
    let database = url::Url::parse(database).unwrap();
    let query = |k: &str| {
        database
            .query_pairs()
            .find(|(name, _)| name == k)
            .map(|(_, v)| v.into_owned())
    };
    assert_eq!(query("sslmode").as_deref(), Some("verify-full"));
    in_volume(query("sslrootcert").expect("sslrootcert").as_str());

    // Built, when kubectl is here: the patch applies to every workload of the base.
    match Command::new("kubectl")
        .args(["kustomize", "--load-restrictor", "LoadRestrictionsNone"])
        .arg(&dir)
        .output()
    {
        Ok(out) => {
            assert!(
                out.status.success(),
                "kubectl kustomize: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let built = String::from_utf8(out.stdout).unwrap();
            assert_eq!(
                built.matches(&format!("mountPath: {mount}")).count(),
                workloads
            );
            assert!(!built.contains("secretRef"), "{built}");
            assert_eq!(built.matches("kind: RabbitmqCluster").count(), 1);
        }
        Err(e) => eprintln!("kubectl not run ({e}): the overlay is checked as text only"),
    }
}
