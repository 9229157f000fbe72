//! A head replacement (a deletion's, or the publication module's) carries the head's profile
//! binding and drops the old publication's.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_head_replacement_carries_the_heads_profile_binding_and_drops_the_old_one() {
    let fx = SpaceFx::new("tenant-t", "main", "Docs").await;
    let s = seed(&fx, "tenant-t", "main", "Docs", 0, 3).await;
    let pool = fx.pool();
    let tuple = bind_head(pool, &s).await;
    let old = fx_head(pool, &s).await;

    let driver = Driver::new(&fx, Arc::new(handler(&fx)), Budget::default()).await;
    let job = request(
        pool,
        &target_request(&s, Target::Document { id: s.docs[0] }, "b1"),
    )
    .await
    .unwrap();
    assert_eq!(driver.finish(job, true).await.0, "succeeded");
    let new = fx_head(pool, &s).await;
    assert_ne!(new.publication_id, old.publication_id);
    assert_eq!(
        binding_of(pool, new.publication_id).await,
        Some((
            (
                new.publication_id,
                "content".into(),
                "content-publication".into(),
                new.fingerprint.clone(),
                true
            ),
            tuple.clone()
        ))
    );
    // The replaced head's publication served the document: it went as a historical
    // publication, its binding first.
    assert_eq!(binding_of(pool, old.publication_id).await, None);
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM projection_set_publications WHERE id = $1",
            old.publication_id
        )
        .await,
        0
    );

    // The publication module's own head replacement (what a deletion does, for other callers)
    // carries it too.
    let mut c = conn(pool).await;
    let moved = publication::publish_excluding(
        &mut c,
        &s.tenant,
        s.id,
        Uuid::new_v4(),
        Some(&[s.docs[1]]),
        &serde_json::json!({}),
    )
    .await
    .unwrap();
    assert!(matches!(moved, Some(Ok(_))), "{moved:?}");
    drop(c);
    let newer = fx_head(pool, &s).await;
    let carried = binding_of(pool, newer.publication_id).await.unwrap();
    assert_eq!((carried.0 .0, carried.1), (newer.publication_id, tuple));
    fx.cleanup().await;
}
