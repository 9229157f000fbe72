//! A step that ran but did not commit, or ran twice, is simply run again: every step repeated
//! yields the same rows once.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repeating_every_step_yields_the_same_rows_once() {
    // A step that ran but did not commit (a crash before its commit) is simply run again: here
    // each step's transaction is run and rolled back once before the real run.
    use kfs_worker::jobs::{Handler, JobCtx};
    let fx = Fx::new().await;
    let doc = fx.add("guide.md", "text/markdown", GUIDE_MD).await;
    let attempt = fx.request(doc, false).await.unwrap();
    let handler = CompileHandler::new(Deps::offline(fx.store.clone())).unwrap();
    let mut cp = "queued".to_owned();
    let mut steps = 0;
    loop {
        let ctx = JobCtx {
            kind: Kind::Compile,
            job_id: attempt,
            outbox_id: Uuid::nil(),
            delivery_id: "d".into(),
            lease_token: Uuid::new_v4(),
            row_version: 0,
            checkpoint: cp.clone(),
            execution_attempts: 1,
            max_execution_attempts: 5,
            worker_id: "w".into(),
            renewed: std::time::Instant::now(),
        };
        let mut tx = fx.pool().begin().await.unwrap();
        let first = handler.step(&mut tx, &ctx).await.unwrap();
        tx.rollback().await.unwrap();
        let mut tx = fx.pool().begin().await.unwrap();
        let second = handler.step(&mut tx, &ctx).await.unwrap();
        // Run the committed step twice too: the second run finds its rows and adds none.
        let third = handler.step(&mut tx, &ctx).await.unwrap();
        assert_eq!(first, second);
        assert_eq!(second, third);
        match second {
            kfs_worker::jobs::Step::Advance(next) => {
                sqlx::query(
                    "UPDATE document_compilation_attempts SET checkpoint = $2 WHERE id = $1",
                )
                .bind(attempt)
                .bind(&next)
                .execute(&mut *tx)
                .await
                .unwrap();
                tx.commit().await.unwrap();
                cp = next;
            }
            kfs_worker::jobs::Step::Succeed(last) => {
                assert_eq!(last, "published");
                tx.commit().await.unwrap();
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
        steps += 1;
        assert!(steps < 10);
    }
    assert_eq!(steps, 5, "five advances, then the publish");
    let g = fx.status(attempt).await.publication_generation_id;
    let expected = expected_nodes("text/markdown", "guide.md", GUIDE_MD);
    assert!(expected >= 4, "the guide spans several nodes: {expected}");
    assert_eq!(fx.rows_of_generation("knowledge_nodes", g).await, expected);
    assert_eq!(
        fx.rows_of_generation("index_projections", g).await,
        expected
    );
    assert_eq!(fx.rows_of_generation("document_outlines", g).await, 1);
    assert_eq!(fx.rows_of_generation("page_index_manifests", g).await, 1);
    assert_eq!(
        fx.rows_of_generation("document_multimodal_manifests", g)
            .await,
        1
    );
    assert_eq!(fx.served_nodes(doc).await, expected);
    let members: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM projection_set_publication_members WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    let paths = fx.rows_of_generation("knowledge_paths", g).await;
    assert_eq!(
        members,
        expected + 2 + paths,
        "projections, outline, manifest and paths, once each"
    );
    let candidates: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM projection_set_publications WHERE tenant_id = $1 AND knowledge_space_id = $2",
    )
    .bind(TENANT)
    .bind(fx.space)
    .fetch_one(fx.pool())
    .await
    .unwrap();
    assert_eq!(candidates, 1, "the candidate was created once");
    fx.cleanup().await;
}
