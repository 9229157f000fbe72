//! The probe workload: jobs of random behaviours enqueued as the platform would, each with the
//! final state it must reach.

use super::*;

/// Probe behaviours of the workload and the final state each must reach.
fn workload_spec(rng: &mut StdRng) -> (ProbeSpec, &'static str) {
    let roll: f64 = rng.random();
    let (fail_mode, want) = if roll < 0.05 {
        ("fatal", "failed")
    } else if roll < 0.15 {
        ("retry_once", "succeeded")
    } else {
        ("none", "succeeded")
    };
    let spec = ProbeSpec {
        steps: rng.random_range(1..=10),
        step_sleep: Duration::from_millis(if rng.random_bool(0.3) {
            rng.random_range(50..=300)
        } else {
            rng.random_range(0..=20)
        }),
        fail_mode,
        max_attempts: 100,
    };
    (spec, want)
}

/// The probe jobs enqueued, and those in doubt (see [`settle_in_doubt`]).
pub(super) type Enqueued = (Vec<(Uuid, &'static str)>, Vec<(Uuid, &'static str)>);

/// Enqueues probe jobs as the platform would, through the direct pool, until `stop`.
pub(super) fn enqueue_probe_jobs(
    pool: PgPool,
    stop: tokio_util::sync::CancellationToken,
    seed: u64,
) -> tokio::task::JoinHandle<Enqueued> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    tokio::spawn(async move {
        let mut jobs: Vec<(Uuid, &'static str)> = Vec::new();
        let mut in_doubt: Vec<(Uuid, &'static str)> = Vec::new();
        while !stop.is_cancelled() {
            let (spec, want) = workload_spec(&mut rng);
            let id = Uuid::now_v7();
            let made = async {
                let mut conn = pool.acquire().await?;
                probe::enqueue_as(&mut conn, id, &spec).await
            }
            .await;
            // With Postgres down the platform's API fails too; the next one is tried later.
            // A failed insert may still have committed (Postgres crashed after its commit
            // and before its answer): it is in doubt until the table says, after recovery.
            match made {
                Ok(()) => jobs.push((id, want)),
                Err(_) => in_doubt.push((id, want)),
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(20..=120))).await;
        }
        (jobs, in_doubt)
    })
}
