//! One learner per run. Before it touches a run (its checkpoints, its
//! stream, its policy servers) a learner takes the run's lease in Redis
//! (`sleuth_store::lease`); a second learner for the run waits, saying who
//! holds it. The holder renews the lease before every checkpoint,
//! acknowledgement and publication, so one that was stuck past the lease's
//! TTL (and replaced) stops at its next act instead of training on.

use std::time::{Duration, Instant};

use sleuth_store::lease::{self, Held, Lease};
use sleuth_store::{StoreError, patiently};

use crate::Error;
use crate::learn::Sources;

/// How often a waiting learner says who holds the run.
const SAY_EVERY: Duration = Duration::from_secs(10);

/// Takes `run`'s learner lease, waiting while another learner holds it;
/// `None` when the learner is told to stop first.
pub(crate) async fn take(
    sources: &Sources,
    run: &str,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> Result<Option<Lease>, Error> {
    let holder = lease::holder_name();
    let said = std::sync::Mutex::new(None::<Instant>);
    let take = patiently("taking the run's learner lease", sources.patience, || {
        Lease::acquire(
            sources.redis.clone(),
            lease::learner_key(run),
            holder.clone(),
            sources.lease_ttl,
            |held: &Held| {
                let mut said = said.lock().expect("said");
                if said.is_none_or(|at| at.elapsed() >= SAY_EVERY) {
                    tracing::warn!(
                        run,
                        holder = %held.holder,
                        expires_in = ?held.expires_in,
                        "another learner trains this run; waiting for its lease"
                    );
                    *said = Some(Instant::now());
                }
            },
        )
    });
    tokio::select! {
        lease = take => {
            let lease = lease?;
            tracing::info!(run, holder = lease.holder(), "took the run's learner lease");
            Ok(Some(lease))
        }
        () = stopped(stop) => Ok(None),
    }
}

async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    while !*stop.borrow() {
        if stop.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Renews the lease right before an act only its holder may do. Redis
/// being unreachable is ridden out for `patience`, as every other store
/// call of the learner is; a lease another learner took since is not.
pub(crate) async fn hold(lease: &Lease, patience: Duration) -> Result<(), Error> {
    let started = Instant::now();
    loop {
        match lease.renew().await {
            Err(error @ StoreError::Redis { .. }) if started.elapsed() < patience => {
                tracing::warn!(%error, "cannot renew the run's learner lease; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            other => return Ok(other?),
        }
    }
}
