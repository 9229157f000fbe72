//! The frozen profile tuple: an attempt carries the space's profile revisions, a profile changed
//! before its publish fails the fence, and an attempt without profiles binds the heads current at
//! its first step (or fails when the space has no retrieval profile).

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_attempt_carries_the_frozen_profile_tuple() {
    let fx = Fx::new().await;
    let retrieval_only = fx.add("r.md", "text/markdown", b"# R\n\nSkuas.").await;
    let a1 = fx.request(retrieval_only, false).await.unwrap();
    let heads = fx.active_heads().await;
    assert_eq!(heads.len(), 1, "a new space has its retrieval profile");
    let s1 = fx.status(a1).await;
    let (_, rid, rrev, rdigest) = &heads[0];
    assert_eq!(
        (
            s1.retrieval_profile_kind.as_deref(),
            s1.retrieval_profile_revision_id,
            s1.retrieval_profile_revision,
            s1.retrieval_profile_snapshot_digest.as_deref()
        ),
        (
            Some("retrieval"),
            Some(*rid),
            Some(*rrev),
            Some(rdigest.as_str())
        )
    );
    assert_eq!(
        (
            s1.embedding_profile_kind,
            s1.embedding_profile_revision_id,
            s1.embedding_profile_revision,
            s1.embedding_profile_snapshot_digest
        ),
        (None, None, None, None)
    );
    {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_embedding_profile(&mut conn, TENANT, fx.space, "e-small", "openai", 16)
            .await
            .unwrap();
    }
    let both = fx
        .add("e.md", "text/markdown", b"# E\n\nShearwaters.")
        .await;
    let a2 = fx.request(both, false).await.unwrap();
    let s2 = fx.status(a2).await;
    let heads = fx.active_heads().await;
    let (ekind, eid, erev, edigest) = &heads[0];
    assert_eq!(ekind, "embedding");
    assert_eq!(
        (
            s2.embedding_profile_kind.as_deref(),
            s2.embedding_profile_revision_id,
            s2.embedding_profile_revision,
            s2.embedding_profile_snapshot_digest.as_deref()
        ),
        (
            Some("embedding"),
            Some(*eid),
            Some(*erev),
            Some(edigest.as_str())
        )
    );
    assert_eq!(
        s2.retrieval_profile_revision_id,
        s1.retrieval_profile_revision_id
    );
    // The attempt builds with its frozen embedding profile and publishes under the tuple.
    assert_succeeded(&fx.drive(&fx.engine("w-tuple", 64), a2).await);
    let dense: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM index_projections WHERE publication_generation_id = $1 AND type = 'dense-vector'",
    )
    .bind(s2.publication_generation_id)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert!(dense > 0);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_profile_changed_between_request_and_publish_fails_the_fence_with_nothing_published() {
    let fx = Fx::new().await;
    let one_step = fx.engine("w-profile-1", 1);
    let engine = fx.engine("w-profile", 64);
    // (what changes the space's profiles after the attempt froze them)
    for (name, change) in [("retrieval.md", "retrieval"), ("embedding.md", "embedding")] {
        let doc = fx
            .add(name, "text/markdown", b"# Profiles\n\nPetrels glide.")
            .await;
        let attempt = fx.request(doc, false).await.unwrap();
        fx.drive_to(&one_step, attempt, "smoke_eval_passed").await;
        let candidate = fx.status(attempt).await.candidate_publication_id.unwrap();
        let head_before = fx.head().await;
        {
            let mut conn = fx.pool().acquire().await.unwrap();
            if change == "retrieval" {
                platform::activate_retrieval_profile(&mut conn, TENANT, fx.space, "r2", "offline")
                    .await
                    .unwrap();
            } else {
                platform::activate_embedding_profile(&mut conn, TENANT, fx.space, "e", "openai", 8)
                    .await
                    .map(|_| ())
                    .unwrap();
            }
        }
        let s = fx.drive(&engine, attempt).await;
        assert_failed(&s, "DOCUMENT_COMPILATION_FAILED");
        assert!(
            s.last_error_message
                .as_deref()
                .is_some_and(|m| m.contains("profile fence")),
            "{change}: {s:?}"
        );
        assert_eq!(fx.head().await, head_before, "{change}: nothing published");
        assert_eq!(fx.bindings().await, 0);
        assert_eq!(
            fx.publication_status(candidate).await,
            "candidate",
            "{change}: the candidate stays a candidate"
        );
        assert!(fx.search("petrels").await.is_empty());
    }
    // An attempt requested after the change freezes the new tuple and publishes.
    let doc = fx
        .add("after.md", "text/markdown", b"# After\n\nFulmars.")
        .await;
    assert_succeeded(
        &fx.drive(&engine, fx.request(doc, false).await.unwrap())
            .await,
    );
    assert_eq!(fx.bindings().await, 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_without_profiles_binds_the_current_heads_and_a_space_without_retrieval_cannot_compile(
) {
    let fx = Fx::new().await;
    let engine = fx.engine("w-bare", 64);
    let fxr = &fx;
    let bare = |slug: &'static str| async move {
        let fx = fxr;
        let mut conn = fx.pool().acquire().await.unwrap();
        let space = platform::create_bare_space(&mut conn, TENANT, slug, slug, "owner-1")
            .await
            .unwrap();
        let doc = platform::add_document(
            &mut conn,
            &fx.store,
            space,
            None,
            "b.md",
            "text/markdown",
            Bytes::from_static(b"# Bare\n\nGuillemots."),
        )
        .await
        .unwrap();
        (space, doc)
    };
    // No retrieval profile: the attempt is written with no tuple and fails at its first step.
    let (_, doc) = bare("no-profiles").await;
    let attempt = fx.request(doc, false).await.unwrap();
    assert_eq!(fx.status(attempt).await.retrieval_profile_revision_id, None);
    let s = fx.drive(&engine, attempt).await;
    assert_failed(&s, "KNOWLEDGE_SPACE_MODEL_CONFIGURATION_REQUIRED");
    assert_eq!(s.checkpoint, "queued");
    let parsed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM parse_artifacts WHERE document_asset_id = $1")
            .bind(doc)
            .fetch_one(fx.pool())
            .await
            .unwrap();
    assert_eq!(parsed, 0, "nothing else written");
    // Profiles configured after the request: the first step binds the current heads.
    let (space, doc) = bare("later-profiles").await;
    let attempt = fx.request(doc, false).await.unwrap();
    let rid = {
        let mut conn = fx.pool().acquire().await.unwrap();
        platform::activate_retrieval_profile(&mut conn, TENANT, space, "r", "offline")
            .await
            .unwrap()
    };
    let s = fx.drive(&engine, attempt).await;
    assert_succeeded(&s);
    assert_eq!(
        (
            s.retrieval_profile_revision_id,
            s.retrieval_profile_revision
        ),
        (Some(rid), Some(1))
    );
    fx.cleanup().await;
}
