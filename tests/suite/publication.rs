//! The publication head's compare-and-swap against a real Postgres: concurrent writers of one
//! space's head each either move it or learn that it moved, never fail on a unique key.

use std::sync::Arc;

use kfs_worker::publication::{self, Moved};
use kfs_worker::tools::platform;
use sqlx::{Connection, PgPool};
use tokio::sync::Barrier;
use uuid::Uuid;

use crate::support::TestEnv;

const TENANT: &str = "tenant-heads";

/// A candidate publication of `space`, for a head to point at.
async fn candidate(pool: &PgPool, space: Uuid) -> Uuid {
    let id = Uuid::new_v4();
    let mut c = pool.acquire().await.unwrap();
    let fp = format!(
        "projection-set-sha256:{}",
        platform::sha256_hex(id.as_bytes())
    );
    assert!(publication::insert(
        &mut c,
        id,
        TENANT,
        space,
        &fp,
        1,
        "candidate",
        &serde_json::json!({})
    )
    .await
    .unwrap());
    id
}

/// Two first publishes of a space started at the same instant (two compiles of a new space's
/// first documents): one creates the head, the other is told it moved. The first heads meet on
/// the primary key (the space's id) as well as on the space's unique key, and racing inserts
/// that both passed the unique key's check used to fail the loser's compile with a
/// `projection_set_publication_heads_pkey` violation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_first_heads_of_a_space_give_one_head_and_one_moved_never_an_error() {
    let env = TestEnv::new().await;
    for round in 0..40 {
        let space = {
            let mut c = env.pool.acquire().await.unwrap();
            platform::create_space(
                &mut c,
                TENANT,
                &format!("heads-{round}"),
                "Heads",
                "owner-1",
            )
            .await
            .unwrap()
        };
        let pubs = [
            candidate(&env.pool, space).await,
            candidate(&env.pool, space).await,
        ];
        let gate = Arc::new(Barrier::new(2));
        let mut racers = Vec::new();
        for p in pubs {
            let (pool, gate) = (env.pool.clone(), gate.clone());
            racers.push(tokio::spawn(async move {
                let mut conn = pool.acquire().await.unwrap();
                let mut tx = conn.begin().await.unwrap();
                gate.wait().await;
                let swapped = publication::swap_head(&mut tx, TENANT, space, 0, p).await;
                tx.commit().await.unwrap();
                swapped.map_err(|e| e.to_string())
            }));
        }
        let mut outcomes = Vec::new();
        for r in racers {
            outcomes.push(r.await.unwrap());
        }
        let errors: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
        assert!(errors.is_empty(), "round {round}: {errors:?}");
        let mut results: Vec<Result<i32, Moved>> =
            outcomes.into_iter().map(Result::unwrap).collect();
        results.sort_by_key(|r| r.is_err());
        assert_eq!(
            results,
            vec![Ok(1), Err(Moved { current: 1 })],
            "round {round}: one head, one moved"
        );
    }
    env.cleanup().await;
}
