//! The trajectory stream of a run: the orchestrator appends each finished
//! group (`TrajectoryGroup`, protobuf-encoded, field `group`) to
//! `sleuth:run:<run>:groups`; the learner reads it through the consumer group
//! `learner` and acknowledges entries only once the step that used them is
//! committed, so a crash loses nothing and trains on nothing twice.
//!
//! Length policy: appends never trim (an unconsumed group is never dropped);
//! the learner trims entries it has acknowledged (`XTRIM MINID`) after each
//! checkpoint, and the orchestrator's staleness gate bounds how far rollouts
//! run ahead of the learner, so the stream holds at most a few steps of groups.
//!
//! The learner's current policy version is kept at `sleuth:run:<run>:learner_version`,
//! and the number of groups it has taken off the stream (trained or dropped:
//! stale, flat, corrupt) at `sleuth:run:<run>:groups_taken`; the orchestrator's
//! staleness gate reads the count, so dropped groups free their place in the
//! window as trained ones do. The orchestrator keeps the newest version it
//! has validated at `sleuth:run:<run>:validated`: the learner takes no step
//! past a version due for validation until that version is there.

use redis::AsyncCommands;
use redis::streams::{StreamAutoClaimOptions, StreamAutoClaimReply, StreamReadOptions, StreamReadReply};

use crate::{RedisStore, StoreError};

/// The consumer group the learner reads with.
pub const LEARNER_GROUP: &str = "learner";
/// The entry field holding the encoded group.
pub const GROUP_FIELD: &str = "group";

pub fn stream_key(run_id: &str) -> String {
    format!("sleuth:run:{run_id}:groups")
}

pub fn version_key(run_id: &str) -> String {
    format!("sleuth:run:{run_id}:learner_version")
}

pub fn groups_taken_key(run_id: &str) -> String {
    format!("sleuth:run:{run_id}:groups_taken")
}

pub fn validated_key(run_id: &str) -> String {
    format!("sleuth:run:{run_id}:validated")
}

/// A stream entry id, `<ms>-<seq>`, ordered as Redis orders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct EntryId(pub u64, pub u64);

impl std::str::FromStr for EntryId {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        let (ms, seq) = text.split_once('-').ok_or_else(|| format!("stream id {text:?} is not <ms>-<seq>"))?;
        let number = |part: &str| part.parse::<u64>().map_err(|_| format!("stream id {text:?} is not <ms>-<seq>"));
        Ok(Self(number(ms)?, number(seq)?))
    }
}

impl std::fmt::Display for EntryId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

/// One entry: its id and the encoded group (None when the field is missing).
#[derive(Debug, Clone)]
pub struct Entry {
    pub id: EntryId,
    pub payload: Option<Vec<u8>>,
}

fn entry(id: &str, map: &std::collections::HashMap<String, redis::Value>) -> Result<Entry, String> {
    let payload = match map.get(GROUP_FIELD) {
        Some(redis::Value::BulkString(bytes)) => Some(bytes.clone()),
        _ => None,
    };
    Ok(Entry { id: id.parse()?, payload })
}

/// Appends an encoded group to the run's stream; returns its entry id.
pub async fn publish(redis: &RedisStore, run_id: &str, payload: &[u8]) -> Result<EntryId, StoreError> {
    let mut connection = redis.connection().await?;
    let id: String = connection
        .xadd(stream_key(run_id), "*", &[(GROUP_FIELD, payload)])
        .await
        .map_err(|source| StoreError::Redis { url: redis.url().to_owned(), source })?;
    id.parse().map_err(|message| StoreError::Object { store: redis.url().to_owned(), message })
}

/// Key marking that a group was published (set in the same atomic step as the append).
pub fn published_key(run_id: &str, group_id: &str) -> String {
    format!("sleuth:run:{run_id}:published:{group_id}")
}

/// Appends the group once: the marker and the append happen in one Lua
/// script (atomic in Redis), so an orchestrator that crashes after
/// publishing and restarts cannot publish the group again. Returns the new
/// entry's id, or None when the group was already published.
pub async fn publish_once(
    redis: &RedisStore,
    run_id: &str,
    group_id: &str,
    payload: &[u8],
) -> Result<Option<EntryId>, StoreError> {
    const SCRIPT: &str = "if redis.call('SET', KEYS[1], '1', 'NX') then \
        return redis.call('XADD', KEYS[2], '*', ARGV[1], ARGV[2]) else return false end";
    let mut connection = redis.connection().await?;
    let id: Option<String> = redis::Script::new(SCRIPT)
        .key(published_key(run_id, group_id))
        .key(stream_key(run_id))
        .arg(GROUP_FIELD)
        .arg(payload)
        .invoke_async(&mut connection)
        .await
        .map_err(|source| StoreError::Redis { url: redis.url().to_owned(), source })?;
    id.map(|id| id.parse().map_err(|message| StoreError::Object { store: redis.url().to_owned(), message })).transpose()
}

/// Lets `run_id`'s published-group markers expire in `ttl` (a run that
/// ended for good no longer needs them: nothing publishes into it again).
/// Returns how many markers were given the deadline.
pub async fn expire_published(redis: &RedisStore, run_id: &str, ttl: std::time::Duration) -> Result<u64, StoreError> {
    let failed = |source| StoreError::Redis { url: redis.url().to_owned(), source };
    let mut connection = redis.connection().await?;
    let pattern = format!("{}*", published_key(run_id, ""));
    let seconds = ttl.as_secs().max(1) as i64;
    let (mut cursor, mut expired) = (0u64, 0u64);
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut connection)
            .await
            .map_err(failed)?;
        if !keys.is_empty() {
            let mut pipe = redis::pipe();
            for key in &keys {
                pipe.expire(key, seconds).ignore();
            }
            pipe.query_async::<()>(&mut connection).await.map_err(failed)?;
            expired += keys.len() as u64;
        }
        if next == 0 {
            return Ok(expired);
        }
        cursor = next;
    }
}

/// Whether the group was published (see [`publish_once`]).
pub async fn is_published(redis: &RedisStore, run_id: &str, group_id: &str) -> Result<bool, StoreError> {
    let mut connection = redis.connection().await?;
    connection
        .exists(published_key(run_id, group_id))
        .await
        .map_err(|source| StoreError::Redis { url: redis.url().to_owned(), source })
}

/// The learner's side of a run's stream.
pub struct GroupConsumer {
    redis: RedisStore,
    key: String,
    consumer: String,
}

impl GroupConsumer {
    /// Creates the consumer group (and stream) when missing.
    pub async fn open(redis: RedisStore, run_id: &str, consumer: &str) -> Result<Self, StoreError> {
        let key = stream_key(run_id);
        let mut connection = redis.connection().await?;
        let created: Result<(), redis::RedisError> = connection.xgroup_create_mkstream(&key, LEARNER_GROUP, "0").await;
        match created {
            Ok(()) => {}
            Err(error) if error.code() == Some("BUSYGROUP") => {}
            Err(source) => return Err(StoreError::Redis { url: redis.url().to_owned(), source }),
        }
        Ok(Self { redis, key, consumer: consumer.to_owned() })
    }

    fn failed(&self, source: redis::RedisError) -> StoreError {
        StoreError::Redis { url: self.redis.url().to_owned(), source }
    }

    fn bad(&self, message: String) -> StoreError {
        StoreError::Object { store: format!("{} stream {}", self.redis.url(), self.key), message }
    }

    /// Every entry delivered to some consumer but never acknowledged (a
    /// learner that crashed mid-step), claimed for this consumer, in id order.
    pub async fn reclaim_pending(&self) -> Result<Vec<Entry>, StoreError> {
        let mut connection = self.redis.connection().await?;
        let mut start = "0-0".to_owned();
        let mut entries = Vec::new();
        loop {
            let reply: StreamAutoClaimReply = connection
                .xautoclaim_options(
                    &self.key,
                    LEARNER_GROUP,
                    &self.consumer,
                    0,
                    &start,
                    StreamAutoClaimOptions::default().count(100),
                )
                .await
                .map_err(|e| self.failed(e))?;
            for claimed in &reply.claimed {
                entries.push(entry(&claimed.id, &claimed.map).map_err(|m| self.bad(m))?);
            }
            if reply.next_stream_id == "0-0" {
                break;
            }
            start = reply.next_stream_id;
        }
        entries.sort_by_key(|e| e.id);
        Ok(entries)
    }

    /// Up to `count` new entries, without waiting: a blocking read would hold
    /// the shared multiplexed connection (and every command queued behind it,
    /// health checks included), so callers poll.
    pub async fn read_new(&self, count: usize) -> Result<Vec<Entry>, StoreError> {
        let mut connection = self.redis.connection().await?;
        let options = StreamReadOptions::default().group(LEARNER_GROUP, &self.consumer).count(count);
        let reply: Option<StreamReadReply> =
            connection.xread_options(&[&self.key], &[">"], &options).await.map_err(|e| self.failed(e))?;
        let mut entries = Vec::new();
        for key in reply.map(|r| r.keys).unwrap_or_default() {
            for id in key.ids {
                entries.push(entry(&id.id, &id.map).map_err(|m| self.bad(m))?);
            }
        }
        Ok(entries)
    }

    /// Acknowledges `ids` and trims the stream below the oldest entry still pending.
    pub async fn commit(&self, ids: &[EntryId]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut connection = self.redis.connection().await?;
        let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
        let _: usize = connection.xack(&self.key, LEARNER_GROUP, &ids).await.map_err(|e| self.failed(e))?;
        let pending: redis::streams::StreamPendingReply =
            connection.xpending(&self.key, LEARNER_GROUP).await.map_err(|e| self.failed(e))?;
        let keep_from = match pending {
            redis::streams::StreamPendingReply::Data(data) => data.start_id,
            // Nothing pending: everything up to the last acknowledged id can go.
            _ => {
                let last: EntryId = ids.iter().filter_map(|i| i.parse().ok()).max().unwrap_or_default();
                EntryId(last.0, last.1 + 1).to_string()
            }
        };
        let _: usize = redis::cmd("XTRIM")
            .arg(&self.key)
            .arg("MINID")
            .arg(&keep_from)
            .query_async(&mut connection)
            .await
            .map_err(|e| self.failed(e))?;
        Ok(())
    }

    /// Entries delivered and not yet acknowledged, and entries never delivered.
    pub async fn backlog(&self) -> Result<(u64, u64), StoreError> {
        let mut connection = self.redis.connection().await?;
        let groups: redis::streams::StreamInfoGroupsReply =
            connection.xinfo_groups(&self.key).await.map_err(|e| self.failed(e))?;
        let group = groups.groups.into_iter().find(|g| g.name == LEARNER_GROUP);
        Ok(group.map_or((0, 0), |g| (g.pending as u64, g.lag.unwrap_or(0) as u64)))
    }
}

/// Writes one of the counters the learner and the orchestrator share.
async fn set_counter(redis: &RedisStore, key: String, value: u64) -> Result<(), StoreError> {
    let mut connection = redis.connection().await?;
    connection
        .set::<_, _, ()>(key, value)
        .await
        .map_err(|source| StoreError::Redis { url: redis.url().to_owned(), source })
}

/// Reads one of the counters (0 before it was written).
async fn counter(redis: &RedisStore, key: String) -> Result<u64, StoreError> {
    Ok(maybe_counter(redis, key).await?.unwrap_or(0))
}

/// Reads one of the counters (`None` before it was written).
async fn maybe_counter(redis: &RedisStore, key: String) -> Result<Option<u64>, StoreError> {
    let mut connection = redis.connection().await?;
    connection.get(key).await.map_err(|source| StoreError::Redis { url: redis.url().to_owned(), source })
}

/// Records the newest version the run's orchestrator has validated (or
/// given up validating; `None`: none yet), for the learner waiting to step past it.
pub async fn set_validated(redis: &RedisStore, run_id: &str, version: Option<u64>) -> Result<(), StoreError> {
    match version {
        Some(version) => set_counter(redis, validated_key(run_id), version).await,
        None => {
            let mut connection = redis.connection().await?;
            connection
                .del::<_, ()>(validated_key(run_id))
                .await
                .map_err(|source| StoreError::Redis { url: redis.url().to_owned(), source })
        }
    }
}

/// The newest version the run's orchestrator has validated (`None`: none yet).
pub async fn validated(redis: &RedisStore, run_id: &str) -> Result<Option<u64>, StoreError> {
    maybe_counter(redis, validated_key(run_id)).await
}

/// Records the learner's policy version for the run's orchestrator.
pub async fn set_learner_version(redis: &RedisStore, run_id: &str, version: u64) -> Result<(), StoreError> {
    set_counter(redis, version_key(run_id), version).await
}

/// The learner's policy version for the run (0 before its first step).
pub async fn learner_version(redis: &RedisStore, run_id: &str) -> Result<u64, StoreError> {
    counter(redis, version_key(run_id)).await
}

/// Records how many of the run's groups the learner has taken off the stream
/// (trained, or dropped as stale, flat or corrupt).
pub async fn set_groups_taken(redis: &RedisStore, run_id: &str, groups: u64) -> Result<(), StoreError> {
    set_counter(redis, groups_taken_key(run_id), groups).await
}

/// How many of the run's groups the learner has taken (0 before it started).
pub async fn groups_taken(redis: &RedisStore, run_id: &str) -> Result<u64, StoreError> {
    counter(redis, groups_taken_key(run_id)).await
}
