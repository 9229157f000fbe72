//! Who may use the shared Postgres and RabbitMQ at a time. The tests are one binary, so libtest
//! runs them in parallel threads of one process, and a test that stops a shared service (the
//! restarts in `outage`) would break every test running beside it. So the services are held as
//! with a process-wide read-write lock:
//!
//! - Every test that uses the shared services holds a shared guard for as long as it uses them.
//!   `TestEnv::new` takes one and the `TestEnv` keeps it to its end, after its clean-up has
//!   dropped the test's database and queues (a `SpaceFx` is built on a `TestEnv`, so it holds
//!   one too). The tests that reach the services without a `TestEnv` (`bench`, `cli`, `deploy`,
//!   `schema`'s scratch databases and schema tools, `engine`'s role dropped after its database)
//!   take their own with [`shared`], or [`shared_blocking`] in a test without a runtime.
//! - A test that stops a service holds the services alone ([`alone`], or `TestEnv::alone` for
//!   its environment): it waits until no guard is held, and while it holds its own every test
//!   that asks for a guard waits. It brings the services back before it lets go. The chaos run
//!   holds them alone too: it does not use them, but it needs the machine's cores to itself.
//!
//! A test waiting to be alone does not hold back the tests that share; only a test that is
//! alone does. So one test may hold two shared guards at once (`schema` has two scratch
//! databases at a time, `engine` a role and a `TestEnv`) without risk: with a lock that lets a
//! waiting writer stop new readers, as `tokio`'s `RwLock` does (and `std`'s may), such a test
//! would deadlock when a test asks to be alone between its two guards. The price is that a test
//! waiting to be alone may see other tests start before it and waits for them too. It is woken
//! the moment the last guard goes, while libtest only starts the next test once one has ended,
//! so in practice it gets its turn when the tests running beside it end.
//!
//! A test that holds the services alone must not also ask to share them (it would wait for
//! itself): it builds its environment with `TestEnv::alone`, never `TestEnv::new`. The lock's
//! rules are tested at the end of this module, on private instances of it.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

/// The services of this process: every guard of the suite is one of these.
static SERVICES: Turns = Turns::new();

/// Shares the services with the other tests; waits while a test holds them alone.
pub async fn shared() -> Services {
    SERVICES.take(Hold::Shared).await
}

/// [`shared`] for a test that has no runtime: blocks the thread while it waits.
pub fn shared_blocking() -> Services {
    SERVICES.take_blocking()
}

/// Holds the services alone: waits until no other test holds them, then keeps every other test
/// from taking them until the guard is dropped.
pub async fn alone() -> Services {
    SERVICES.take(Hold::Alone).await
}

/// Who holds the services now.
struct Holders {
    sharing: usize,
    alone: bool,
}

/// The lock itself: who holds it, and the waiters to wake when a guard is released.
struct Turns {
    holders: Mutex<Holders>,
    /// Wakes the tests waiting in [`shared`] or [`alone`].
    released: Notify,
    /// Wakes the tests waiting in [`shared_blocking`].
    released_blocking: Condvar,
}

#[derive(Clone, Copy)]
enum Hold {
    Shared,
    Alone,
}

impl Hold {
    /// Takes this hold if nobody stands in its way now; says whether it did.
    fn take(self, h: &mut Holders) -> bool {
        match self {
            Hold::Shared if !h.alone => {
                h.sharing += 1;
                true
            }
            Hold::Alone if !h.alone && h.sharing == 0 => {
                h.alone = true;
                true
            }
            _ => false,
        }
    }
}

/// The right to use the shared services, held until it is dropped.
#[must_use = "the services are held only while the guard lives"]
pub struct Services {
    turns: &'static Turns,
    hold: Hold,
}

impl Turns {
    const fn new() -> Turns {
        Turns {
            holders: Mutex::new(Holders {
                sharing: 0,
                alone: false,
            }),
            released: Notify::const_new(),
            released_blocking: Condvar::new(),
        }
    }

    fn holders(&self) -> MutexGuard<'_, Holders> {
        // Nothing can panic while it is locked, so a poisoned lock still holds the right counts.
        self.holders.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn take(&'static self, hold: Hold) -> Services {
        loop {
            // Made before the check, so a release between the check and the wait still wakes it.
            let released = self.released.notified();
            let taken = hold.take(&mut self.holders());
            if taken {
                return Services { turns: self, hold };
            }
            released.await;
        }
    }

    fn take_blocking(&'static self) -> Services {
        let mut h = self.holders();
        while !Hold::Shared.take(&mut h) {
            h = self
                .released_blocking
                .wait(h)
                .unwrap_or_else(PoisonError::into_inner);
        }
        Services {
            turns: self,
            hold: Hold::Shared,
        }
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        {
            let mut h = self.turns.holders();
            match self.hold {
                Hold::Shared => h.sharing -= 1,
                Hold::Alone => h.alone = false,
            }
        }
        self.turns.released.notify_waiters();
        self.turns.released_blocking.notify_all();
    }
}

/// The lock's own rules, each on a private instance (never the services' one, which the other
/// tests hold).
mod tests {
    use std::time::Duration;

    use super::{Hold, Turns};

    const SOON: Duration = Duration::from_millis(200);

    fn private() -> &'static Turns {
        Box::leak(Box::new(Turns::new()))
    }

    #[tokio::test]
    async fn one_alone_waits_for_every_sharer_and_stops_new_ones_until_it_is_done() {
        let turns = private();
        let a = turns.take(Hold::Shared).await;
        let b = turns.take(Hold::Shared).await;
        let mut alone = tokio::spawn(turns.take(Hold::Alone));
        drop(a);
        assert!(
            tokio::time::timeout(SOON, &mut alone).await.is_err(),
            "alone while a sharer held it"
        );
        drop(b);
        let alone = tokio::time::timeout(SOON, alone)
            .await
            .expect("alone once the last sharer let go")
            .unwrap();
        let mut shared = tokio::spawn(turns.take(Hold::Shared));
        assert!(
            tokio::time::timeout(SOON, &mut shared).await.is_err(),
            "shared while one was alone"
        );
        drop(alone);
        let _shared = tokio::time::timeout(SOON, shared)
            .await
            .expect("shared once the one alone let go")
            .unwrap();
    }

    #[tokio::test]
    async fn a_test_waiting_to_be_alone_does_not_stop_a_sharer_taking_a_second_guard() {
        let turns = private();
        let first = turns.take(Hold::Shared).await;
        let alone = tokio::spawn(turns.take(Hold::Alone));
        tokio::task::yield_now().await;
        let second = tokio::time::timeout(SOON, turns.take(Hold::Shared))
            .await
            .expect("a second shared guard while one waits to be alone");
        drop((first, second));
        let _alone = tokio::time::timeout(SOON, alone)
            .await
            .expect("alone once both let go")
            .unwrap();
    }

    #[tokio::test]
    async fn a_blocking_sharer_waits_for_the_one_alone_and_wakes_when_it_is_done() {
        let turns = private();
        let alone = turns.take(Hold::Alone).await;
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let guard = turns.take_blocking();
            tx.send(()).unwrap();
            drop(guard);
        });
        assert!(rx.recv_timeout(SOON).is_err(), "shared while one was alone");
        drop(alone);
        rx.recv_timeout(SOON)
            .expect("shared once the one alone let go");
        waiter.join().unwrap();
    }
}
