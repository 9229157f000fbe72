//! The log reading of the channel-close fault judges a close played before the session first
//! consumed by the restart that followed it, not by the session's own first "consuming".

use super::*;

/// A process that plays a channel close as it starts, before its session logs "consuming",
/// comes back at the "consuming" after its restart, not at the session's first one.
#[test]
fn a_close_played_before_the_session_consumed_is_judged_by_its_restart() {
    let log = [
        format!(r#"{{"timestamp":"2026-12-07T06:58:30.909656Z","message":"{CLOSE_PLAYED} x","kind":"compile"}}"#),
        r#"{"timestamp":"2026-12-07T06:58:30.911500Z","message":"consuming"}"#.to_owned(),
        r#"{"timestamp":"2026-12-07T06:58:30.914009Z","message":"a consumer stopped; consuming its queue again on a new channel","kind":"compile"}"#.to_owned(),
        r#"{"timestamp":"2026-12-07T06:58:30.929695Z","message":"consuming"}"#.to_owned(),
    ]
    .join("\n");
    let r = consuming_again(&log, 1).expect("consuming again");
    assert!(
        r.restarted && !r.reconnected,
        "{:?}",
        (r.restarted, r.reconnected)
    );
    assert_eq!(r.kind, "compile");
    assert!((r.back_ms - 20.039).abs() < 0.01, "{}", r.back_ms);
}
