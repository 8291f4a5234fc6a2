//! Riding out a store restart: an operation retried with backoff until a
//! deadline, so Redis or the database coming back within it never fails a
//! run. Only for idempotent operations (a repeated write must be a no-op).

use std::future::Future;
use std::time::{Duration, Instant};

/// The first pause after a failure; it doubles up to [`MAX_DELAY`].
const FIRST_DELAY: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_secs(5);

/// Runs `op` until it succeeds, retrying for up to `patience` after the
/// first failure, and returns the last error after that. `what` names the
/// operation in the warning logged on each retry.
pub async fn patiently<T, E, F>(what: &str, patience: Duration, mut op: impl FnMut() -> F) -> Result<T, E>
where
    E: std::fmt::Display,
    F: Future<Output = Result<T, E>>,
{
    let started = Instant::now();
    let mut delay = FIRST_DELAY;
    loop {
        match op().await {
            Ok(value) => return Ok(value),
            Err(error) if started.elapsed() < patience => {
                tracing::warn!(%error, operation = what, retry_in = ?delay, "store unavailable; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_DELAY);
            }
            Err(error) => return Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn retries_until_it_succeeds_and_gives_up_after_the_patience() {
        let mut calls = 0;
        let value: Result<u32, String> = patiently("flaky", Duration::from_secs(10), || {
            calls += 1;
            let attempt = calls;
            async move { if attempt < 3 { Err(format!("down {attempt}")) } else { Ok(attempt) } }
        })
        .await;
        assert_eq!(value, Ok(3), "the third try succeeds after two pauses");

        let started = Instant::now();
        let value: Result<(), String> =
            patiently("dead", Duration::from_millis(250), || async { Err("down".to_owned()) }).await;
        assert_eq!(value, Err("down".to_owned()));
        assert!(started.elapsed() >= Duration::from_millis(250), "gave up after {:?}", started.elapsed());
    }
}
