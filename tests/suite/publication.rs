//! The publication head's compare-and-swap against a real Postgres: concurrent writers of one
//! space's head each either move it or learn that it moved, never fail on a unique key; the
//! first publishers of a space queue to create its head rather than race for it; and a head the
//! worker publishes carries the profile binding the platform's published-runtime readers require.

use std::sync::Arc;

use kfs_worker::publication::{self, Moved};
use kfs_worker::tools::platform;
use sqlx::{Connection, PgPool};
use tokio::sync::Barrier;
use uuid::Uuid;

use crate::support::{self, TestEnv};

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

/// The first publishers of a space without a head (a bulk upload into a new space) queue for it
/// instead of all composing against revision 0: while one holds the right to create the head,
/// another's bounded wait ends `Busy`, and once the first has created it and committed, the
/// other locks that head and rebases onto it. Without the queue every publisher but one lost
/// the compare-and-swap and spent an attempt and a retry's backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_publishers_of_a_space_queue_to_create_its_head_and_the_next_finds_it() {
    use std::time::Duration;
    let env = TestEnv::new().await;
    let space = {
        let mut c = env.pool.acquire().await.unwrap();
        platform::create_space(&mut c, TENANT, "queue", "Queue", "owner-1")
            .await
            .unwrap()
    };
    let first_pub = candidate(&env.pool, space).await;
    let mut first = env.pool.begin().await.unwrap();
    let held = publication::lock_head_within(&mut first, TENANT, space, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(matches!(held, publication::Locked::Held(None)), "{held:?}");

    let mut second = env.pool.begin().await.unwrap();
    let queued =
        publication::lock_head_within(&mut second, TENANT, space, Duration::from_millis(300))
            .await
            .unwrap();
    assert!(
        matches!(queued, publication::Locked::Busy),
        "a second first publisher must queue behind the first, got {queued:?}"
    );

    let swapped = publication::swap_head(&mut first, TENANT, space, 0, first_pub)
        .await
        .unwrap();
    assert_eq!(swapped, Ok(1));
    first.commit().await.unwrap();

    let found = publication::lock_head_within(&mut second, TENANT, space, Duration::from_secs(5))
        .await
        .unwrap();
    match found {
        publication::Locked::Held(Some(h)) => {
            assert_eq!((h.revision, h.publication_id), (1, first_pub))
        }
        other => panic!("the second publisher should find the first's head, got {other:?}"),
    }
    second.rollback().await.unwrap();
    env.cleanup().await;
}

/// Every expression of `plan` (an `EXPLAIN (VERBOSE, FORMAT JSON)` node) that runs for its rows,
/// leaving out the InitPlans, which run once per execution.
fn per_row_expressions(plan: &serde_json::Value, out: &mut Vec<String>) {
    if plan["Parent Relationship"] == "InitPlan" {
        return;
    }
    for (key, value) in plan.as_object().into_iter().flatten() {
        match (key.as_str(), value) {
            ("Plans", serde_json::Value::Array(children)) => {
                for child in children {
                    per_row_expressions(child, out);
                }
            }
            (_, serde_json::Value::String(s)) => out.push(s.clone()),
            (_, serde_json::Value::Array(items)) => {
                out.extend(items.iter().filter_map(|i| i.as_str().map(str::to_owned)));
            }
            _ => {}
        }
    }
}

/// Under a generic plan (research runs its statements on generic plans), each read path makes
/// its query once per execution: the tsquery, and the query vector from its text, are
/// InitPlans. Written inline, the plan parsed the query again for every row its filter and its
/// sort looked at, which was most of a retrieval's time.
#[tokio::test]
async fn the_read_paths_make_their_query_once_per_execution_under_a_generic_plan() {
    let env = TestEnv::new().await;
    let mut c = env.pool.acquire().await.unwrap();
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&mut *c)
        .await
        .unwrap();
    let nil = Uuid::nil();
    let reads = [
        (
            "fts",
            publication::FTS_READ_SQL,
            "(uuid, text, text, uuid, jsonb)",
            format!("'{nil}', 'lease fencing', 't', '{nil}', '[]'"),
            "plainto_tsquery",
        ),
        (
            "dense",
            publication::DENSE_READ_SQL,
            "(uuid, text, text, uuid, int4, text, jsonb)",
            format!("'{nil}', '[1,2]', 't', '{nil}', 2, 'vs', '[]'"),
            "::vector",
        ),
    ];
    for (name, sql, types, args, made) in reads {
        let explained = support::explain_prepared(
            &mut c,
            "VERBOSE, FORMAT JSON",
            &format!("read_{name}"),
            types,
            sql,
            &args,
        )
        .await;
        let plan = &explained[0]["Plan"];
        let text = plan.to_string();
        assert!(
            text.contains(made),
            "{name}: the query is made somewhere: {text}"
        );
        let mut per_row = Vec::new();
        per_row_expressions(plan, &mut per_row);
        let again: Vec<&String> = per_row.iter().filter(|e| e.contains(made)).collect();
        assert!(again.is_empty(), "{name}: made for every row in {again:?}");
    }
    drop(c);
    env.cleanup().await;
}

/// The platform's published runtime snapshot resolver, as its one SELECT decides: the head's
/// publication is `published`, an activated binding names the same publication and fingerprint,
/// the current retrieval head and its active revision are the binding's (same digest), and the
/// embedding side is either absent everywhere (binding and heads) or the current embedding head's
/// exact revision and vector space. Returns the head's publication, or `None` where the
/// platform's queries, retrieval tests and research creation answer 503.
async fn resolved_runtime_snapshot(pool: &PgPool, tenant: &str, space: Uuid) -> Option<Uuid> {
    sqlx::query_scalar(
        "SELECT h.publication_id FROM projection_set_publication_heads h \
         JOIN projection_set_publications p ON p.tenant_id = h.tenant_id AND p.knowledge_space_id = h.knowledge_space_id \
           AND p.id = h.publication_id AND p.status = 'published' \
         JOIN knowledge_space_profile_publication_bindings b ON b.tenant_id = h.tenant_id \
           AND b.knowledge_space_id = h.knowledge_space_id AND b.publication_id = p.id \
           AND b.publication_fingerprint = p.fingerprint AND b.activated_at IS NOT NULL \
         JOIN knowledge_space_profile_heads rh ON rh.tenant_id = b.tenant_id AND rh.knowledge_space_id = b.knowledge_space_id \
           AND rh.kind = 'retrieval' AND rh.profile_revision_id = b.retrieval_profile_revision_id \
           AND rh.active_revision = b.retrieval_profile_revision \
         JOIN knowledge_space_profile_revisions rr ON rr.tenant_id = rh.tenant_id AND rr.knowledge_space_id = rh.knowledge_space_id \
           AND rr.kind = rh.kind AND rr.id = rh.profile_revision_id AND rr.revision = rh.active_revision \
           AND rr.snapshot_digest = b.retrieval_profile_snapshot_digest AND rr.state = 'active' \
         LEFT JOIN knowledge_space_profile_heads eh ON eh.tenant_id = h.tenant_id \
           AND eh.knowledge_space_id = h.knowledge_space_id AND eh.kind = 'embedding' \
         LEFT JOIN knowledge_space_profile_revisions er ON er.tenant_id = eh.tenant_id \
           AND er.knowledge_space_id = eh.knowledge_space_id AND er.kind = eh.kind AND er.id = eh.profile_revision_id \
           AND er.revision = eh.active_revision \
         WHERE h.tenant_id = $1 AND h.knowledge_space_id = $2 \
           AND ((b.embedding_profile_kind IS NULL AND b.embedding_profile_revision_id IS NULL \
                 AND b.embedding_profile_revision IS NULL AND b.embedding_profile_snapshot_digest IS NULL \
                 AND b.vector_space_id IS NULL AND eh.id IS NULL) \
             OR (b.embedding_profile_kind = 'embedding' AND er.id = b.embedding_profile_revision_id \
                 AND er.revision = b.embedding_profile_revision \
                 AND er.snapshot_digest = b.embedding_profile_snapshot_digest \
                 AND er.vector_space_id = b.vector_space_id))",
    )
    .bind(tenant)
    .bind(space)
    .fetch_optional(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_published_by_the_worker_passes_the_platforms_runtime_snapshot_resolver() {
    use crate::support::space::{SpaceFx, GUIDE_MD};
    let fx = SpaceFx::new("tenant-resolver", "resolver", "Resolver").await;
    let pool = fx.pool().clone();
    // (with an embedding profile beside the retrieval one)
    for embedding in [false, true] {
        let space = {
            let mut c = pool.acquire().await.unwrap();
            let space = platform::create_space(
                &mut c,
                &fx.tenant,
                &format!("resolver-{embedding}"),
                "Resolver",
                "owner-1",
            )
            .await
            .unwrap();
            if embedding {
                platform::activate_embedding_profile(&mut c, &fx.tenant, space, "e", "openai", 8)
                    .await
                    .unwrap();
            }
            space
        };
        let doc = {
            let mut c = pool.acquire().await.unwrap();
            platform::add_document(
                &mut c,
                &fx.store,
                space,
                None,
                "guide.md",
                "text/markdown",
                bytes::Bytes::from_static(GUIDE_MD),
            )
            .await
            .unwrap()
        };
        assert_eq!(
            resolved_runtime_snapshot(&pool, &fx.tenant, space).await,
            None,
            "nothing to resolve before the publish"
        );
        let done = fx.compile(doc).await;
        let head = {
            let mut c = pool.acquire().await.unwrap();
            publication::head(&mut c, &fx.tenant, space, false)
                .await
                .unwrap()
                .unwrap()
        };
        assert_eq!(done.candidate_publication_id, Some(head.publication_id));
        assert_eq!(
            resolved_runtime_snapshot(&pool, &fx.tenant, space).await,
            Some(head.publication_id),
            "embedding profile: {embedding}"
        );
        // The binding is the publication's own: its id, content publication, activated when
        // created, the attempt's frozen tuple.
        let (id, kind, reason, same_time, retrieval, embedding_rev): (
            Uuid,
            String,
            String,
            bool,
            Option<Uuid>,
            Option<Uuid>,
        ) = sqlx::query_as(
            "SELECT id, changed_kind::text, binding_reason::text, created_at = activated_at, \
               retrieval_profile_revision_id, embedding_profile_revision_id \
             FROM knowledge_space_profile_publication_bindings WHERE knowledge_space_id = $1",
        )
        .bind(space)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            (id, kind.as_str(), reason.as_str(), same_time),
            (head.publication_id, "content", "content-publication", true)
        );
        assert_eq!(retrieval, done.retrieval_profile_revision_id);
        assert_eq!(embedding_rev, done.embedding_profile_revision_id);
        assert_eq!(embedding_rev.is_some(), embedding);
        // A later profile activation leaves the head unresolvable until content is published
        // under the new tuple, as on the platform.
        {
            let mut c = pool.acquire().await.unwrap();
            platform::activate_retrieval_profile(&mut c, &fx.tenant, space, "r2", "offline")
                .await
                .unwrap();
        }
        assert_eq!(
            resolved_runtime_snapshot(&pool, &fx.tenant, space).await,
            None
        );
    }
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publications_profile_binding_is_written_once_and_a_different_one_is_refused() {
    use kfs_worker::publication::binding::{self, ProfileRef, Tuple};
    let env = TestEnv::new().await;
    let space = {
        let mut c = env.pool.acquire().await.unwrap();
        platform::create_space(&mut c, TENANT, "bound", "Bound", "owner-1")
            .await
            .unwrap()
    };
    let (revision_id, revision, digest): (Uuid, i32, String) = sqlx::query_as(
        "SELECT id, revision, snapshot_digest::text FROM knowledge_space_profile_revisions \
         WHERE knowledge_space_id = $1 AND kind = 'retrieval'",
    )
    .bind(space)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let tuple = Tuple {
        retrieval: ProfileRef {
            revision_id,
            revision,
            digest,
        },
        embedding: None,
    };
    let p = candidate(&env.pool, space).await;
    let fp: String = sqlx::query_scalar(
        "SELECT fingerprint::text FROM projection_set_publications WHERE id = $1",
    )
    .bind(p)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let mut c = env.pool.acquire().await.unwrap();
    let mut tx = c.begin().await.unwrap();
    let moved = publication::publish(&mut tx, TENANT, space, 0, p, &fp, Some(&tuple))
        .await
        .unwrap();
    assert_eq!(moved, Ok(1));
    // The same tuple again is a no-op; any other tuple is refused.
    assert_eq!(
        binding::bind(&mut tx, TENANT, space, p, &fp, &tuple)
            .await
            .unwrap(),
        Ok(())
    );
    let mut other = tuple.clone();
    other.retrieval.revision_id = Uuid::new_v4();
    assert_eq!(
        binding::bind(&mut tx, TENANT, space, p, &fp, &other)
            .await
            .unwrap(),
        Err(binding::Conflict)
    );
    tx.commit().await.unwrap();
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM knowledge_space_profile_publication_bindings WHERE publication_id = $1",
    )
    .bind(p)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(rows, 1);
    drop(c);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publication_that_is_no_longer_a_candidate_is_never_made_the_head() {
    let env = TestEnv::new().await;
    let space = {
        let mut c = env.pool.acquire().await.unwrap();
        platform::create_space(&mut c, TENANT, "given-up", "Given up", "owner-1")
            .await
            .unwrap()
    };
    let p = candidate(&env.pool, space).await;
    let fp: String = sqlx::query_scalar(
        "UPDATE projection_set_publications SET status = 'inactive' WHERE id = $1 RETURNING fingerprint::text",
    )
    .bind(p)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let mut c = env.pool.acquire().await.unwrap();
    let refused = publication::publish(&mut c, TENANT, space, 0, p, &fp, None)
        .await
        .unwrap();
    assert_eq!(
        refused,
        Err(publication::Refused::NotCandidate(Some("inactive".into())))
    );
    assert_eq!(
        publication::head(&mut c, TENANT, space, false)
            .await
            .unwrap(),
        None
    );
    drop(c);
    env.cleanup().await;
}
