//! A worker killed at any kill point mid-deletion leaves the job to another worker, which
//! finishes it (only acking a delivery whose job already completed) and touches no other space.

use super::*;

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_at_any_kill_point_mid_deletion_is_finished_by_another() {
    // This deletion's passes through the kill points, three steps a slice. Slice 1: the claim
    // (`after-claim-commit`), `requested → quiescing` (`after-step-commit:1`), the inventory
    // and the head exclusion (`:2`), then the batch of object items, which ends the slice (`:3`,
    // `before-ack:1`). Slice 2: no item left, on to the derived rows (`:4`), their one page
    // (`:5`), none left, which ends the slice (`:6`, `before-ack:2`). Slices 3 and 4: the
    // primary pages, the space's logical-document rows first (the active revisions unset `:7`,
    // the revision chunks `:8`, the revisions `:9`, `before-ack:3`, the logical documents
    // `:10`), then its documents, no longer referenced (`:11`), then the completing step (`:12`).
    // Every pass before the end is killed at; the last entry checks that pass 12 is the end, so
    // a deletion that gains a step fails here instead of leaving that step's kill point untried.
    for (point, ended) in [
        ("after-claim-commit", false),
        ("after-step-commit:1", false),
        ("after-step-commit:2", false),
        ("after-step-commit:3", false),
        ("before-ack:1", false),
        ("after-step-commit:4", false),
        ("after-step-commit:5", false),
        ("after-step-commit:6", false),
        ("before-ack:2", false),
        ("after-step-commit:7", false),
        ("after-step-commit:8", false),
        ("after-step-commit:9", false),
        ("before-ack:3", false),
        ("after-step-commit:10", false),
        ("after-step-commit:11", false),
        ("after-step-commit:12", true),
    ] {
        let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
        let s = seed(&fx, "tenant-t", "main", "Docs", 1, 2).await;
        let other = seed(&fx, "tenant-u", "main", "Docs", 0, 1).await;
        let pool = fx.pool();
        let cat = catalog(pool).await;
        let before = untouched(&fx, &cat, &[&other]).await;
        let job = request(pool, &space_request(&s, "crash")).await.unwrap();
        // The workers run the relay, the consumers and maintenance, not the leased runner: its
        // profile backfills would change the other tenant's rows this test proves untouched.
        let common_env = [
            ("KFS_OBJECT_STORE", fx.store_url.as_str()),
            ("KFS_SLICE_STEPS", "3"),
            ("KFS_RELAY_POLL", "100ms"),
        ];
        let mut crash_env = common_env.to_vec();
        crash_env.push(("KFS_CRASH_AT", point));
        let mut doomed = fx.env.spawn_worker(
            &format!("doomed-{point}"),
            &[
                "run",
                "--relay",
                "--consumer",
                "--maintenance",
                "--kinds",
                "deletion",
            ],
            &crash_env,
        );
        let exited = doomed.wait_exit(Duration::from_secs(60));
        assert!(
            exited.is_some(),
            "{point}: the worker did not reach its kill point\n{}",
            doomed.log_text()
        );
        assert!(
            !exited.unwrap().success(),
            "{point}: the worker exited normally"
        );
        let (state, cp) = job_state(pool, job).await;
        if ended {
            // Killed after the completing commit, before the ack: the rescuer only acks.
            assert_eq!(
                (state.as_str(), cp.as_str()),
                ("succeeded", "completed"),
                "{point}: the completing step is not the 12th pass"
            );
        } else {
            assert_ne!(
                state, "succeeded",
                "{point}: finished before the kill ({cp})"
            );
        }

        let mut rescuer = fx.env.spawn_worker(
            &format!("rescuer-{point}"),
            &[
                "run",
                "--relay",
                "--consumer",
                "--maintenance",
                "--kinds",
                "deletion",
            ],
            &common_env,
        );
        let p = pool.clone();
        let done = fx
            .env
            .wait_until(Duration::from_secs(90), || {
                let p = p.clone();
                async move { job_state(&p, job).await.0 == "succeeded" }
            })
            .await;
        assert!(
            done,
            "{point}: {:?}\n{}",
            job_state(pool, job).await,
            rescuer.log_text()
        );
        if ended {
            // The unacked delivery comes back to the rescuer, which acks it as stale and runs
            // no step of the finished job.
            let settled =
                fx.env
                    .wait_until(Duration::from_secs(30), || {
                        let log = rescuer.log_text();
                        async move {
                            log.contains("acked kind=deletion") && log.contains("claim=\"stale\"")
                        }
                    })
                    .await;
            let log = rescuer.log_text();
            assert!(settled, "{point}: the redelivery was not settled\n{log}");
            assert!(
                !log.contains("deletion step"),
                "{point}: the finished job ran again\n{log}"
            );
        }
        crate::support::stop_cleanly([&mut rescuer], Duration::from_secs(30)).await;
        assert_finished_clean(pool, job).await;
        let left = cat.count_owned(pool, Some(s.id), &s.docs).await;
        assert!(left.is_empty(), "{point}: {left:?}");
        assert!(
            files_under(&fx.dir, &s.prefix).is_empty(),
            "{point}: objects left behind"
        );
        assert_untouched(&fx, &cat, &[&other], &before).await;
        fx.cleanup().await;
    }
}
