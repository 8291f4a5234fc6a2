//! Episode traces in Redis: what the policy saw and produced, token for token.

use std::time::Duration;

use sha2::{Digest, Sha256};
use sleuth_proto::common::v1::{ChatMessage, SegmentKind, ToolSpec, Trace, TraceSegment};
use sleuth_store::RedisStore;

use crate::error::Error;

/// The trace plus what the next turn needs to extend it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EpisodeRecord {
    #[prost(message, optional, tag = "1")]
    pub trace: Option<Trace>,
    /// Messages of the conversation the trace already covers, including the
    /// assistant reply the policy generated last.
    #[prost(uint32, tag = "2")]
    pub messages_seen: u32,
    /// [`HistoryDigest`] of the tools and messages the last turn was sent:
    /// the next turn's history must hash to it (empty in records written
    /// before digests, which are then not checked).
    #[prost(bytes = "vec", tag = "3")]
    pub history_digest: Vec<u8>,
}

/// SHA-256 over a conversation's tools and messages (each one's protobuf,
/// length-prefixed): a turn checks that the history it is sent is the one the
/// episode recorded without rendering or tokenising it again.
#[derive(Clone)]
pub struct HistoryDigest(Sha256);

impl HistoryDigest {
    pub fn new(tools: &[ToolSpec]) -> Self {
        let mut digest = Self(Sha256::new());
        for tool in tools {
            digest.add(tool);
        }
        digest
    }

    fn add(&mut self, item: &impl prost::Message) {
        let bytes = item.encode_to_vec();
        self.0.update((bytes.len() as u64).to_le_bytes());
        self.0.update(&bytes);
    }

    /// Adds `messages`, in order.
    pub fn extend(&mut self, messages: &[ChatMessage]) {
        for message in messages {
            self.add(message);
        }
    }

    /// The digest of everything added so far.
    pub fn value(&self) -> Vec<u8> {
        self.0.clone().finalize().to_vec()
    }
}

impl EpisodeRecord {
    pub fn new(episode: &str) -> Self {
        Self {
            trace: Some(Trace { episode_id: episode.to_owned(), ..Trace::default() }),
            messages_seen: 0,
            history_digest: Vec::new(),
        }
    }

    pub fn trace(&self) -> &Trace {
        self.trace.as_ref().expect("records always hold a trace")
    }

    pub fn trace_mut(&mut self) -> &mut Trace {
        self.trace.get_or_insert_with(Trace::default)
    }

    /// Assistant turns recorded so far (the next turn's number).
    pub fn turns(&self) -> u32 {
        let policy = SegmentKind::Policy as i32;
        self.trace().segments.iter().filter(|s| s.kind == policy).map(|s| s.turn + 1).max().unwrap_or(0)
    }

    /// The tokens the policy sampled (or a teacher wrote) in the last turn.
    pub fn last_reply(&self) -> Vec<u32> {
        let policy = SegmentKind::Policy as i32;
        let segments = &self.trace().segments;
        let from = segments.iter().rposition(|s| s.kind != policy).map_or(0, |i| i + 1);
        segments[from..].iter().flat_map(|s| s.token_ids.iter().copied()).collect()
    }

    /// The token sequence so far: every segment, in order.
    pub fn tokens(&self) -> Vec<u32> {
        self.trace().segments.iter().flat_map(|s| s.token_ids.iter().copied()).collect()
    }

    /// Appends a segment of tokens not sampled by the policy (mask 0).
    pub fn push_context(&mut self, turn: u32, kind: SegmentKind, tokens: &[u32], version: u64) {
        if tokens.is_empty() {
            return;
        }
        self.trace_mut().segments.push(TraceSegment {
            turn,
            kind: kind as i32,
            token_ids: tokens.to_vec(),
            loss_mask: vec![0; tokens.len()],
            logprobs: Vec::new(),
            policy_version: version,
        });
    }

    /// Appends sampled tokens (mask 1), one segment per policy version.
    pub fn push_sampled(&mut self, turn: u32, tokens: &[u32], logprobs: &[f32], versions: &[u64]) {
        let mut start = 0;
        while start < tokens.len() {
            let version = versions.get(start).copied().unwrap_or_default();
            let end = (start..tokens.len())
                .find(|&i| versions.get(i).copied().unwrap_or_default() != version)
                .unwrap_or(tokens.len());
            self.trace_mut().segments.push(TraceSegment {
                turn,
                kind: SegmentKind::Policy as i32,
                token_ids: tokens[start..end].to_vec(),
                loss_mask: vec![1; end - start],
                logprobs: logprobs.get(start..end).map(<[f32]>::to_vec).unwrap_or_default(),
                policy_version: version,
            });
            start = end;
        }
    }
}

/// Records in Redis under `sleuth:episode:<id>`, a hash of the record and its
/// revision (the number of saves). A save applies only to the revision its
/// turn loaded, so of two concurrent turns one fails instead of one silently
/// overwriting the other; every read and write restarts the `ttl`, which so
/// runs from the episode's last activity.
#[derive(Clone)]
pub struct TraceStore {
    redis: RedisStore,
    ttl: Duration,
}

/// A record as loaded, with the revision its save must find.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub record: EpisodeRecord,
    /// Saves so far; 0 for an episode without a trace yet.
    pub revision: u64,
}

/// Attempts for a trace write before the episode is failed, and the first backoff.
const WRITE_ATTEMPTS: u32 = 4;
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

/// What [`SAVE`] answers when the trace expired while the turn ran.
const GONE: i64 = -2;

/// Reads the record and its revision, restarting the TTL of one that exists.
const LOAD: &str = r"
local found = redis.call('HMGET', KEYS[1], 'revision', 'record')
if found[2] then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return found
";

/// Writes the record if the revision is still ARGV[1]; returns the new
/// revision, -1 when another save came first, or [`GONE`] when the trace
/// expired since it was loaded.
const SAVE: &str = r"
local current = tonumber(redis.call('HGET', KEYS[1], 'revision') or '0')
if current == 0 and tonumber(ARGV[1]) > 0 then return -2 end
if current ~= tonumber(ARGV[1]) then return -1 end
redis.call('HSET', KEYS[1], 'revision', current + 1, 'record', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return current + 1
";

impl TraceStore {
    pub fn new(redis: RedisStore, ttl: Duration) -> Self {
        Self { redis, ttl }
    }

    fn key(episode: &str) -> String {
        format!("sleuth:episode:{episode}")
    }

    fn ttl_seconds(&self) -> u64 {
        self.ttl.as_secs().max(1)
    }

    /// The episode's record and revision: revision 0 with a fresh record when
    /// it has none (new or expired).
    pub async fn load(&self, episode: &str) -> Result<Loaded, Error> {
        let mut connection = self.redis.connection().await?;
        let (revision, bytes): (Option<u64>, Option<Vec<u8>>) = redis::Script::new(LOAD)
            .key(Self::key(episode))
            .arg(self.ttl_seconds())
            .invoke_async(&mut connection)
            .await
            .map_err(|e| Error::Internal(format!("reading the trace of episode {episode}: {e}")))?;
        let Some(bytes) = bytes else { return Ok(Loaded { record: EpisodeRecord::new(episode), revision: 0 }) };
        let record = <EpisodeRecord as prost::Message>::decode(bytes.as_slice())
            .map_err(|e| Error::Internal(format!("trace of episode {episode} is corrupt: {e}")))?;
        Ok(Loaded { record, revision: revision.unwrap_or_default() })
    }

    /// The episode's record, or None when it has none (new or expired).
    pub async fn get(&self, episode: &str) -> Result<Option<EpisodeRecord>, Error> {
        let loaded = self.load(episode).await?;
        Ok((loaded.revision > 0).then_some(loaded.record))
    }

    /// Writes `loaded`'s record over the revision it was loaded at, retrying
    /// transient failures with backoff. An error
    /// means the turn's tokens would be lost, so the caller fails the turn:
    /// [`Error::ConcurrentTurn`] when another save came first.
    pub async fn save(&self, episode: &str, loaded: &Loaded) -> Result<(), Error> {
        let bytes = prost::Message::encode_to_vec(&loaded.record);
        let mut backoff = FIRST_BACKOFF;
        let mut last = String::new();
        for attempt in 1..=WRITE_ATTEMPTS {
            let result: Result<i64, String> = async {
                let mut connection = self.redis.connection().await.map_err(|e| e.to_string())?;
                redis::Script::new(SAVE)
                    .key(Self::key(episode))
                    .arg(loaded.revision)
                    .arg(bytes.as_slice())
                    .arg(self.ttl_seconds())
                    .invoke_async(&mut connection)
                    .await
                    .map_err(|e| e.to_string())
            }
            .await;
            match result {
                Ok(revision) if revision > 0 => return Ok(()),
                // A retry after a lost reply finds its own write: the revision moved by one
                // and the record is ours.
                Ok(_) if attempt > 1 && self.is_ours(episode, loaded, &bytes).await => return Ok(()),
                Ok(GONE) => return Err(Error::TraceGone { episode: episode.to_owned() }),
                Ok(_) => return Err(Error::ConcurrentTurn { episode: episode.to_owned() }),
                Err(message) => {
                    tracing::warn!(episode, attempt, error = %message, "trace write failed, retrying");
                    last = message;
                }
            }
            if attempt < WRITE_ATTEMPTS {
                tokio::time::sleep(backoff).await;
                backoff *= 4;
            }
        }
        Err(Error::TraceLost { episode: episode.to_owned(), attempts: WRITE_ATTEMPTS, message: last })
    }

    /// Whether the stored record is `bytes` at the revision after `loaded`'s.
    async fn is_ours(&self, episode: &str, loaded: &Loaded, bytes: &[u8]) -> bool {
        match self.load(episode).await {
            Ok(now) => now.revision == loaded.revision + 1 && prost::Message::encode_to_vec(&now.record) == bytes,
            Err(_) => false,
        }
    }
}
