//! Leases in Redis: at most one holder of a role at a time, e.g. the learner
//! of a run. Two learners on one run would each take half the run's groups
//! off the stream, publish competing weights and overwrite each other's
//! checkpoints: a rollout's surge pod, a stuck pod whose replacement
//! started, or a second release. The lease is taken with `SET NX PX`, kept
//! by renewing it well within its TTL, and renewed again right before every
//! act only the holder may do (acknowledging, checkpointing, publishing).
//! A holder that finds it lost the lease stops instead of acting.

use std::time::Duration;

use crate::{RedisStore, StoreError};

/// Takes the lease if free and counts the taking in the epoch key (kept
/// without expiry); returns the new epoch, or false when someone holds it.
const TAKE: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
    return redis.call('INCR', KEYS[2]) else return false end";

/// Extends the lease while `holder` holds it. One that expired (Redis was
/// unreachable for longer than the TTL) is taken back when nobody took the
/// lease since this holder did (the epoch is still its own): nobody else
/// can have acted in between. Returns 1 when the lease is held.
const RENEW: &str = "local now = redis.call('GET', KEYS[1]) \
    if now == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end \
    if not now and redis.call('GET', KEYS[2]) == ARGV[3] then \
        redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end \
    return 0";

/// Deletes the lease only while `holder` still holds it.
const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
    return redis.call('DEL', KEYS[1]) else return 0 end";

/// The key of the lease of `run`'s learner.
pub fn learner_key(run: &str) -> String {
    format!("sleuth:run:{run}:learner")
}

/// A holder's name: host and process, so a log says who holds a run.
pub fn holder_name() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|h| h.trim().to_owned()))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    let nonce: u32 = rand_nonce();
    format!("{host}/pid-{}/{nonce:08x}", std::process::id())
}

/// Distinguishes two holders with the same host and pid (a restarted container).
fn rand_nonce() -> u32 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    now.subsec_nanos() ^ (now.as_secs() as u32).rotate_left(16)
}

/// Who holds a lease someone else wanted, and for how much longer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The holder's name (see [`holder_name`]).
    pub holder: String,
    /// Time left before the lease expires unless renewed.
    pub expires_in: Duration,
}

/// A lease this process holds.
pub struct Lease {
    redis: RedisStore,
    key: String,
    holder: String,
    ttl: Duration,
    /// How many times the lease had been taken when this holder took it.
    epoch: i64,
}

impl Lease {
    /// Takes the lease `key` as `holder`, valid for `ttl` unless renewed.
    /// While another process holds it, calls `waiting` with who does and
    /// tries again until it expires or is released.
    pub async fn acquire(
        redis: RedisStore,
        key: String,
        holder: String,
        ttl: Duration,
        mut waiting: impl FnMut(&Held),
    ) -> Result<Self, StoreError> {
        let mut lease = Self { redis, key, holder, ttl, epoch: 0 };
        loop {
            match lease.try_take().await? {
                Ok(epoch) => {
                    lease.epoch = epoch;
                    return Ok(lease);
                }
                Err(held) => waiting(&held),
            }
            tokio::time::sleep((ttl / 4).min(Duration::from_secs(1))).await;
        }
    }

    /// Where the lease's takings are counted.
    fn epoch_key(&self) -> String {
        format!("{}:epoch", self.key)
    }

    /// Takes the lease if it is free (its new epoch); otherwise says who holds it.
    async fn try_take(&self) -> Result<Result<i64, Held>, StoreError> {
        let mut connection = self.redis.connection().await?;
        let taken: Option<i64> = redis::Script::new(TAKE)
            .key(&self.key)
            .key(self.epoch_key())
            .arg(&self.holder)
            .arg(self.ttl.as_millis() as u64)
            .invoke_async(&mut connection)
            .await
            .map_err(|source| self.failed(source))?;
        if let Some(epoch) = taken {
            return Ok(Ok(epoch));
        }
        let (holder, left): (Option<String>, i64) = redis::pipe()
            .get(&self.key)
            .pttl(&self.key)
            .query_async(&mut connection)
            .await
            .map_err(|source| self.failed(source))?;
        Ok(Err(Held {
            holder: holder.unwrap_or_else(|| "(just released)".to_owned()),
            expires_in: Duration::from_millis(left.max(0) as u64),
        }))
    }

    /// Extends the lease by its TTL; fails with [`StoreError::LeaseLost`]
    /// when another process took it since this one did (it expired while
    /// this one was stuck). Call it right before each act only the holder
    /// may do.
    pub async fn renew(&self) -> Result<(), StoreError> {
        let mut connection = self.redis.connection().await?;
        let renewed: i64 = redis::Script::new(RENEW)
            .key(&self.key)
            .key(self.epoch_key())
            .arg(&self.holder)
            .arg(self.ttl.as_millis() as u64)
            .arg(self.epoch)
            .invoke_async(&mut connection)
            .await
            .map_err(|source| self.failed(source))?;
        if renewed == 1 {
            return Ok(());
        }
        let now: Option<String> = redis::cmd("GET")
            .arg(&self.key)
            .query_async(&mut connection)
            .await
            .map_err(|source| self.failed(source))?;
        Err(StoreError::LeaseLost {
            key: self.key.clone(),
            holder: self.holder.clone(),
            now: now.unwrap_or_else(|| "nobody".to_owned()),
        })
    }

    /// Renews the lease every quarter of its TTL until dropped; failures are
    /// left to the next [`Lease::renew`] before an act to report.
    pub fn keep_alive(&self) -> KeepAlive {
        let lease = Self {
            redis: self.redis.clone(),
            key: self.key.clone(),
            holder: self.holder.clone(),
            ttl: self.ttl,
            epoch: self.epoch,
        };
        KeepAlive(tokio::spawn(async move {
            loop {
                tokio::time::sleep(lease.ttl / 4).await;
                if let Err(error) = lease.renew().await {
                    tracing::warn!(key = %lease.key, %error, "lease not renewed");
                }
            }
        }))
    }

    /// Gives the lease up at once (if still held), so a successor need not
    /// wait for it to expire.
    pub async fn release(&self) -> Result<(), StoreError> {
        let mut connection = self.redis.connection().await?;
        let _: i64 = redis::Script::new(RELEASE)
            .key(&self.key)
            .arg(&self.holder)
            .invoke_async(&mut connection)
            .await
            .map_err(|source| self.failed(source))?;
        Ok(())
    }

    /// This holder's name.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    fn failed(&self, source: redis::RedisError) -> StoreError {
        StoreError::Redis { url: self.redis.url().to_owned(), source }
    }
}

/// The renewal task of a lease; stops when dropped.
pub struct KeepAlive(tokio::task::JoinHandle<()>);

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.0.abort();
    }
}
