//! Both leased tables refuse bad writes: stale lease tokens and row versions cannot write, and the
//! CHECK constraints refuse invalid states while accepting every end a walk writes.

use super::*;

/// The SQLSTATE of a failed statement.
async fn sqlstate(pool: &PgPool, sql: &str, id: Uuid) -> Option<String> {
    match sqlx::query(sql).bind(id).execute(pool).await {
        Ok(_) => None,
        Err(sqlx::Error::Database(db)) => db.code().map(|c| c.into_owned()),
        Err(e) => panic!("{e}"),
    }
}

/// A queued bootstrap and a queued (discovered) retrieval backfill of the fixture space.
async fn one_of_each(fx: &Fx) -> (Uuid, Uuid) {
    set_manifest_keys(
        fx.pool(),
        fx.space,
        json!({ "__knowledgeFsRetrievalProfile": retrieval_profile() }),
    )
    .await;
    let mut conn = fx.pool().acquire().await.unwrap();
    backfill::discover(&mut conn, None, 100, 5).await.unwrap();
    let fill = backfills(fx.pool(), fx.space).await[0].2;
    (fx.enqueue_bootstrap().await, fill)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_lease_tokens_and_row_versions_cannot_write() {
    let fx = Fx::new().await;
    fx.three_documents().await;
    let (boot, fill) = one_of_each(&fx).await;
    // Worker w1 is alive (it holds its liveness lock), so its leases are not taken over early.
    let services = fx.env.services();
    let _alive = kfs_worker::liveness::acquire(&services.database_url, "w1")
        .await
        .unwrap();
    let kinds: [(&dyn LeasedKind, Uuid); 2] = [
        (&BootstrapKind::default(), boot),
        (&BackfillKind::default(), fill),
    ];
    for (kind, id) in kinds {
        let table = kind.table();
        let mut conn = fx.pool().acquire().await.unwrap();
        let job = kind.claim(&mut conn, "w1").await.unwrap().expect("claimed");
        assert_eq!(job.job_id, id);
        assert!(
            kind.claim(&mut conn, "w2").await.unwrap().is_none(),
            "{table}: a live lease is not claimed twice"
        );
        let before: String =
            sqlx::query_scalar(&format!("SELECT t::text FROM {table} t WHERE id = $1"))
                .bind(id)
                .fetch_one(fx.pool())
                .await
                .unwrap();
        let stale_version = Lease {
            row_version: job.row_version - 1,
            ..job.clone()
        };
        let stale_token = Lease {
            lease_token: Uuid::new_v4(),
            ..job.clone()
        };
        let succeed = End::Succeed {
            checkpoint: "published".into(),
        };
        for stale in [&stale_version, &stale_token] {
            let mut tx = conn.begin().await.unwrap();
            assert_eq!(
                leased::fence(&mut tx, table, stale, std::time::Duration::from_secs(30))
                    .await
                    .unwrap(),
                None,
                "{table}"
            );
            tx.rollback().await.unwrap();
            assert!(
                !kind.end(&mut conn, stale, &succeed).await.unwrap(),
                "{table}"
            );
            assert!(
                !kind.end(&mut conn, stale, &End::Continue).await.unwrap(),
                "{table}"
            );
        }
        assert!(
            !leased::heartbeat(&mut conn, table, &stale_token, Duration::from_secs(30))
                .await
                .unwrap()
        );
        let after: String =
            sqlx::query_scalar(&format!("SELECT t::text FROM {table} t WHERE id = $1"))
                .bind(id)
                .fetch_one(fx.pool())
                .await
                .unwrap();
        assert_eq!(before, after, "{table}: stale writers changed the row");

        // The lease runs out: the holder's own token no longer writes, and another worker
        // takes the job over.
        assert!(
            leased::heartbeat(&mut conn, table, &job, Duration::from_secs(30))
                .await
                .unwrap()
        );
        sqlx::query(&format!(
            "UPDATE {table} SET lease_expires_at = now() - interval '1 second' WHERE id = $1"
        ))
        .bind(id)
        .execute(fx.pool())
        .await
        .unwrap();
        let mut tx = conn.begin().await.unwrap();
        assert_eq!(
            leased::fence(&mut tx, table, &job, std::time::Duration::from_secs(30))
                .await
                .unwrap(),
            None
        );
        tx.rollback().await.unwrap();
        assert!(
            !leased::heartbeat(&mut conn, table, &job, Duration::from_secs(30))
                .await
                .unwrap()
        );
        let taken = kind
            .claim(&mut conn, "w2")
            .await
            .unwrap()
            .expect("taken over");
        assert!(taken.taken_over);
        assert_ne!(taken.lease_token, job.lease_token);
        assert!(
            !kind.end(&mut conn, &job, &End::Continue).await.unwrap(),
            "{table}: the old lease wrote"
        );
        let mut tx = conn.begin().await.unwrap();
        assert!(
            leased::fence(&mut tx, table, &taken, std::time::Duration::from_secs(30))
                .await
                .unwrap()
                .is_some()
        );
        tx.rollback().await.unwrap();
        assert!(kind.end(&mut conn, &taken, &End::Continue).await.unwrap());
    }
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn check_constraints_refuse_invalid_states_of_both_tables() {
    let fx = Fx::new().await;
    let (boot, fill) = one_of_each(&fx).await;
    let b = "UPDATE legacy_space_publication_bootstraps SET";
    let f = "UPDATE knowledge_space_profile_backfills SET";
    let refused = [
        // Success only at published, with the counts complete (and a head when documents exist).
        format!("{b} run_state = 'succeeded', completed_at = now(), checkpoint = 'verifying' WHERE id = $1"),
        format!("{b} run_state = 'succeeded', completed_at = now(), checkpoint = 'published', total_documents = 2, completed_documents = 2 WHERE id = $1"),
        format!("{b} checkpoint = 'compiling' WHERE id = $1"),
        format!("{b} run_state = 'paused' WHERE id = $1"),
        format!("{b} completed_documents = 1 WHERE id = $1"),
        // A lease exactly while running; an end time exactly when ended.
        format!("{b} run_state = 'running' WHERE id = $1"),
        format!("{b} lease_token = gen_random_uuid() WHERE id = $1"),
        format!("{b} run_state = 'failed' WHERE id = $1"),
        format!("{b} row_version = -1 WHERE id = $1"),
        format!("{f} run_state = 'running' WHERE id = $1"),
        format!("{f} last_error_code = 'x', last_error_message = 'y' WHERE id = $1"),
        format!("{f} run_state = 'failed', completed_at = now() WHERE id = $1"),
        format!("{f} run_state = 'succeeded' WHERE id = $1"),
        format!("{f} execution_attempts = max_execution_attempts + 1 WHERE id = $1"),
        format!("{f} run_state = 'canceled', completed_at = now() WHERE id = $1"),
        format!("{f} row_version = 0 WHERE id = $1"),
    ];
    for sql in &refused {
        let id = if sql.starts_with(b) { boot } else { fill };
        assert_eq!(
            sqlstate(fx.pool(), sql, id).await.as_deref(),
            Some("23514"),
            "{sql}"
        );
    }
    // The walks' own writes: every end each kind writes is accepted by the CHECKs, from a held
    // lease, and leaves a consistent row.
    let services = fx.env.services();
    let _alive = kfs_worker::liveness::acquire(&services.database_url, "w1")
        .await
        .unwrap();
    let kinds: [(&dyn LeasedKind, Uuid, &str); 2] = [
        (&BootstrapKind::default(), boot, walk::PROCESSING_FAILED),
        (&BackfillKind::default(), fill, "LEGACY_PROFILE_INVALID"),
    ];
    for (kind, id, refusal) in kinds {
        let ends = [
            End::Continue,
            End::Wait {
                delay: Duration::from_millis(1),
                code: "waiting".into(),
                message: "m".into(),
                refund: true,
            },
            End::Wait {
                delay: Duration::from_millis(1),
                code: "db_unavailable".into(),
                message: "m".into(),
                refund: false,
            },
            End::Fail {
                code: refusal.into(),
                message: "m".into(),
            },
            End::Fail {
                code: "db_unavailable".into(),
                message: "m (no attempts left)".into(),
            },
            End::Cancel {
                code: "c".into(),
                message: "m".into(),
            },
        ];
        for end in &ends {
            sqlx::query(&format!(
                "UPDATE {} SET run_state = 'queued', completed_at = NULL, last_error_code = NULL, last_error_message = NULL, \
                   updated_at = now() - interval '1 hour' WHERE id = $1",
                kind.table()
            ))
            .bind(id)
            .execute(fx.pool())
            .await
            .unwrap();
            fx.due_now(boot).await;
            let mut conn = fx.pool().acquire().await.unwrap();
            let job = kind.claim(&mut conn, "w1").await.unwrap().expect("claimed");
            assert!(
                kind.end(&mut conn, &job, end).await.unwrap(),
                "{} {end:?}",
                kind.name()
            );
        }
    }
    // A refusal keeps its code; a transient failure out of attempts is recorded as exhausted.
    let codes: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT last_error_code FROM leased_state_log WHERE run_state = 'failed' ORDER BY seq",
    )
    .fetch_all(fx.pool())
    .await
    .unwrap();
    let codes: Vec<&str> = codes.iter().map(|c| c.as_deref().unwrap()).collect();
    assert_eq!(
        codes,
        [
            walk::PROCESSING_FAILED,
            bootstrap::EXHAUSTED,
            "LEGACY_PROFILE_INVALID",
            backfill::walk::EXHAUSTED,
            "c"
        ]
    );
    fx.cleanup().await;
}
