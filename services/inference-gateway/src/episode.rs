//! Episode traces in Redis: what the policy saw and produced, token for token.
//!
//! An episode is kept in three keys, so that a turn reads and writes only
//! what it needs however long the episode has grown:
//! - `sleuth:episode:<id>`, a hash: `revision` (saves so far), `head` (the
//!   record without its segments), `reply` (how many of the last segments are
//!   the last reply) and `writer` (who saved last);
//! - `sleuth:episode:<id>:segments`, the trace's segments in order, appended;
//! - `sleuth:episode:<id>:tokens`, every segment's token ids as one string of
//!   little-endian u32s, appended: a policy turn reads its prompt as one blob,
//!   a teacher's turn only its length.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};
use sleuth_proto::common::v1::{ChatMessage, SegmentKind, ToolSpec, Trace, TraceSegment};
use sleuth_store::RedisStore;

use crate::error::Error;

/// An episode's record without its segments: the trace's counters and what
/// the next turn needs to extend it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EpisodeRecord {
    /// The trace's episode id and counters; its segments are stored apart.
    #[prost(message, optional, tag = "1")]
    pub trace: Option<Trace>,
    /// Messages of the conversation the trace already covers, including the
    /// assistant reply the policy generated last.
    #[prost(uint32, tag = "2")]
    pub messages_seen: u32,
    /// [`HistoryDigest`] of the tools and messages the last turn was sent:
    /// the next turn's history must hash to it.
    #[prost(bytes = "vec", tag = "3")]
    pub history_digest: Vec<u8>,
    /// Assistant turns recorded so far (the next turn's number).
    #[prost(uint32, tag = "4")]
    pub turns: u32,
    /// The episode was started with a ticket: only it (or the admin token)
    /// opens it (see [`crate::tickets`]).
    #[prost(bool, tag = "5")]
    pub ticketed: bool,
}

impl EpisodeRecord {
    pub fn new(episode: &str) -> Self {
        Self {
            trace: Some(Trace { episode_id: episode.to_owned(), ..Trace::default() }),
            messages_seen: 0,
            history_digest: Vec::new(),
            turns: 0,
            ticketed: false,
        }
    }

    pub fn trace_mut(&mut self) -> &mut Trace {
        self.trace.get_or_insert_with(Trace::default)
    }
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

/// An episode as one turn sees it: the record and revision it loaded, the
/// last reply's segments, the tokens recorded so far (all of them, or only
/// how many), and the segments the turn adds.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub record: EpisodeRecord,
    /// Saves so far; 0 for an episode without a trace yet.
    pub revision: u64,
    /// The segments of the last reply (the policy's sampled tokens, or a teacher's).
    reply: Vec<TraceSegment>,
    /// Every token recorded so far, when the turn asked for them.
    tokens: Option<Vec<u32>>,
    /// How many tokens are recorded so far.
    token_count: usize,
    /// Segments this turn adds.
    added: Vec<TraceSegment>,
}

impl Loaded {
    fn fresh(episode: &str) -> Self {
        Self {
            record: EpisodeRecord::new(episode),
            revision: 0,
            reply: Vec::new(),
            tokens: Some(Vec::new()),
            token_count: 0,
            added: Vec::new(),
        }
    }

    /// The tokens the policy sampled (or a teacher wrote) in the last turn.
    pub fn last_reply(&self) -> Vec<u32> {
        self.reply.iter().flat_map(|s| s.token_ids.iter().copied()).collect()
    }

    /// Every token recorded before this turn (loaded with `with_tokens`).
    pub fn recorded_tokens(&self) -> Result<&[u32], Error> {
        self.tokens.as_deref().ok_or_else(|| Error::Internal("the turn loaded its trace without tokens".into()))
    }

    /// How many tokens were recorded before this turn.
    pub fn recorded_len(&self) -> usize {
        self.token_count
    }

    /// Appends a segment of tokens not sampled by the policy (mask 0).
    pub fn push_context(&mut self, turn: u32, kind: SegmentKind, tokens: &[u32], version: u64) {
        if tokens.is_empty() {
            return;
        }
        self.added.push(TraceSegment {
            turn,
            kind: kind as i32,
            token_ids: tokens.to_vec(),
            loss_mask: vec![0; tokens.len()],
            logprobs: Vec::new(),
            policy_version: version,
            temperature: 0.0,
        });
    }

    /// Appends sampled tokens (mask 1), one segment per policy version, with
    /// the `temperature` they were sampled at (0: not sampled from a
    /// softmax: greedy, or a teacher's reply); they become the last reply.
    pub fn push_sampled(&mut self, turn: u32, tokens: &[u32], logprobs: &[f32], versions: &[u64], temperature: f32) {
        let mut start = 0;
        let mut reply = Vec::new();
        while start < tokens.len() {
            let version = versions.get(start).copied().unwrap_or_default();
            let end = (start..tokens.len())
                .find(|&i| versions.get(i).copied().unwrap_or_default() != version)
                .unwrap_or(tokens.len());
            reply.push(TraceSegment {
                turn,
                kind: SegmentKind::Policy as i32,
                token_ids: tokens[start..end].to_vec(),
                loss_mask: vec![1; end - start],
                logprobs: logprobs.get(start..end).map(<[f32]>::to_vec).unwrap_or_default(),
                policy_version: version,
                temperature,
            });
            start = end;
        }
        if !reply.is_empty() {
            self.record.turns = self.record.turns.max(turn + 1);
        }
        self.added.extend(reply.iter().cloned());
        self.reply = reply;
    }
}

/// Episodes in Redis (see the module docs). A save applies only to the
/// revision its turn loaded, so of two concurrent turns one fails instead of
/// one silently overwriting the other; every read and write restarts the
/// `ttl` of all three keys, which so runs from the episode's last activity.
#[derive(Clone)]
pub struct TraceStore {
    redis: RedisStore,
    ttl: Duration,
}

/// Attempts for a trace write before the episode is failed, and the first backoff.
const WRITE_ATTEMPTS: u32 = 4;
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

/// What [`SAVE`] answers when the trace expired while the turn ran.
const GONE: i64 = -2;

/// Reads the head, revision, the last reply's segments and (when ARGV[2] is
/// 1) the tokens of an episode, restarting the TTLs of one that exists.
const LOAD: &str = r"
local found = redis.call('HMGET', KEYS[1], 'revision', 'head', 'reply')
if not found[2] then return {false, false, {}, false, 0} end
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
local n = tonumber(found[3] or '0')
local reply = {}
if n > 0 then reply = redis.call('LRANGE', KEYS[2], -n, -1) end
local tokens = false
if ARGV[2] == '1' then tokens = redis.call('GET', KEYS[3]) or '' end
return {found[1], found[2], reply, tokens, redis.call('STRLEN', KEYS[3])}
";

/// Saves over revision ARGV[1]: the head, the reply count, the writer, the
/// new tokens (ARGV[6]) and segments (ARGV[7..]); returns the new revision,
/// -1 when another save came first, or [`GONE`] when the trace expired since
/// it was loaded.
const SAVE: &str = r"
local current = tonumber(redis.call('HGET', KEYS[1], 'revision') or '0')
if current == 0 and tonumber(ARGV[1]) > 0 then return -2 end
if current ~= tonumber(ARGV[1]) then return -1 end
if current == 0 then redis.call('DEL', KEYS[2], KEYS[3]) end
redis.call('HSET', KEYS[1], 'revision', current + 1, 'head', ARGV[2], 'reply', ARGV[3], 'writer', ARGV[4])
if #ARGV > 6 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 7)) end
if #ARGV[6] > 0 then redis.call('APPEND', KEYS[3], ARGV[6]) end
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
return current + 1
";

/// Reads a whole trace (head and every segment), restarting the TTLs.
const READ: &str = r"
local head = redis.call('HGET', KEYS[1], 'head')
if not head then return {false, {}} end
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
return {head, redis.call('LRANGE', KEYS[2], 0, -1)}
";

/// A name for each save no other save shares, so a retried save can tell
/// its own earlier write from another turn's.
fn writer_id() -> String {
    static SAVES: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{}-{nanos}-{}", std::process::id(), SAVES.fetch_add(1, Ordering::Relaxed))
}

fn decode<T: prost::Message + Default>(episode: &str, what: &str, bytes: &[u8]) -> Result<T, Error> {
    T::decode(bytes).map_err(|e| Error::Internal(format!("the {what} of episode {episode} is corrupt: {e}")))
}

impl TraceStore {
    pub fn new(redis: RedisStore, ttl: Duration) -> Self {
        Self { redis, ttl }
    }

    /// The episode's hash, segment list and token string, in the order the scripts take them.
    fn keys(episode: &str) -> [String; 3] {
        let key = format!("sleuth:episode:{episode}");
        [key.clone(), format!("{key}:segments"), format!("{key}:tokens")]
    }

    fn ttl_seconds(&self) -> u64 {
        self.ttl.as_secs().max(1)
    }

    /// The episode as a turn needs it (a fresh one at revision 0 when it has
    /// no trace: new or expired), with every recorded token when `with_tokens`.
    pub async fn load(&self, episode: &str, with_tokens: bool) -> Result<Loaded, Error> {
        let mut connection = self.redis.connection().await?;
        let [hash, segments, tokens] = Self::keys(episode);
        type Found = (Option<u64>, Option<Vec<u8>>, Vec<Vec<u8>>, Option<Vec<u8>>, u64);
        let (revision, head, reply, token_bytes, token_bytes_len): Found = redis::Script::new(LOAD)
            .key(hash)
            .key(segments)
            .key(tokens)
            .arg(self.ttl_seconds())
            .arg(u8::from(with_tokens))
            .invoke_async(&mut connection)
            .await
            .map_err(|e| Error::Internal(format!("reading the trace of episode {episode}: {e}")))?;
        let Some(head) = head else { return Ok(Loaded::fresh(episode)) };
        let reply = reply.iter().map(|bytes| decode(episode, "last reply", bytes)).collect::<Result<_, _>>()?;
        let tokens = token_bytes
            .map(|bytes| bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect());
        Ok(Loaded {
            record: decode(episode, "record", &head)?,
            revision: revision.unwrap_or_default(),
            reply,
            tokens,
            token_count: (token_bytes_len / 4) as usize,
            added: Vec::new(),
        })
    }

    /// The episode's record with its whole trace, or None when it has none (new or expired).
    pub async fn get(&self, episode: &str) -> Result<Option<EpisodeRecord>, Error> {
        let mut connection = self.redis.connection().await?;
        let [hash, segments, tokens] = Self::keys(episode);
        let (head, stored): (Option<Vec<u8>>, Vec<Vec<u8>>) = redis::Script::new(READ)
            .key(hash)
            .key(segments)
            .key(tokens)
            .arg(self.ttl_seconds())
            .invoke_async(&mut connection)
            .await
            .map_err(|e| Error::Internal(format!("reading the trace of episode {episode}: {e}")))?;
        let Some(head) = head else { return Ok(None) };
        let mut record = decode::<EpisodeRecord>(episode, "record", &head)?;
        record.trace_mut().segments =
            stored.iter().map(|bytes| decode(episode, "trace", bytes)).collect::<Result<_, _>>()?;
        Ok(Some(record))
    }

    /// Saves what `loaded`'s turn added over the revision it was loaded at,
    /// retrying transient failures with backoff. An error means the turn's
    /// tokens would be lost, so the caller fails the turn:
    /// [`Error::ConcurrentTurn`] when another save came first.
    pub async fn save(&self, episode: &str, loaded: &Loaded) -> Result<(), Error> {
        let head = prost::Message::encode_to_vec(&loaded.record);
        let tokens: Vec<u8> =
            loaded.added.iter().flat_map(|s| s.token_ids.iter().flat_map(|t| t.to_le_bytes())).collect();
        let segments: Vec<Vec<u8>> = loaded.added.iter().map(prost::Message::encode_to_vec).collect();
        let writer = writer_id();
        let [hash, segment_key, token_key] = Self::keys(episode);
        let mut backoff = FIRST_BACKOFF;
        let mut last = String::new();
        for attempt in 1..=WRITE_ATTEMPTS {
            let result: Result<i64, String> = async {
                let mut connection = self.redis.connection().await.map_err(|e| e.to_string())?;
                let script = redis::Script::new(SAVE);
                let mut invocation = script.prepare_invoke();
                invocation
                    .key(&hash)
                    .key(&segment_key)
                    .key(&token_key)
                    .arg(loaded.revision)
                    .arg(head.as_slice())
                    .arg(loaded.reply.len())
                    .arg(&writer)
                    .arg(self.ttl_seconds())
                    .arg(tokens.as_slice());
                for segment in &segments {
                    invocation.arg(segment.as_slice());
                }
                invocation.invoke_async(&mut connection).await.map_err(|e| e.to_string())
            }
            .await;
            match result {
                Ok(revision) if revision > 0 => return Ok(()),
                // A retry after a lost reply finds its own write: the revision
                // moved by one and the writer is this save.
                Ok(_) if attempt > 1 && self.is_ours(&hash, loaded.revision, &writer).await => return Ok(()),
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

    /// Whether the episode's hash is at the revision after `revision`, saved by `writer`.
    async fn is_ours(&self, hash: &str, revision: u64, writer: &str) -> bool {
        let Ok(mut connection) = self.redis.connection().await else { return false };
        let found: Result<(Option<u64>, Option<String>), _> =
            redis::cmd("HMGET").arg(hash).arg("revision").arg("writer").query_async(&mut connection).await;
        matches!(found, Ok((Some(now), Some(saved))) if now == revision + 1 && saved == writer)
    }
}
