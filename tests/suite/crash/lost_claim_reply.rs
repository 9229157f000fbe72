//! A claim that committed with its reply lost is recognised as the worker's own on retry.

use super::*;

/// The claim commits and its reply is lost (`KFS_LOSE_REPLY_AT=claim`): the worker retries the
/// claim under the same lease token, recognises the lease as its own and runs the job on its
/// first attempt, instead of calling its own delivery a duplicate and leaving the job leased
/// under a token nobody holds until the lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_was_lost_is_recognised_as_its_own_on_retry() {
    let env = TestEnv::new().await;
    let (job, _outbox) = support::enqueue_one(&env.pool, &ProbeSpec::default()).await;
    let mut w = spawn(
        &env,
        "lost-reply",
        &[],
        &[("KFS_LOSE_REPLY_AT", "claim"), ("KFS_LEASES", "probe=60s")],
    );
    let done = wait_all_terminal(&env, Duration::from_secs(40)).await;
    let log = w.log_text();
    w.kill();
    assert!(
        log.contains("reply of claim lost after its commit"),
        "the fault was injected\n{log}"
    );
    assert!(done, "the job did not finish\n{}", w.tail(30));
    let (state, attempts): (String, i32) = sqlx::query_as(
        "SELECT run_state::text, execution_attempts FROM kfs_probe_jobs WHERE id = $1",
    )
    .bind(job)
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), attempts),
        ("succeeded", 1),
        "one claim, one attempt\n{log}"
    );
    env.cleanup().await;
}
