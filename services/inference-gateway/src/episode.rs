//! Episode traces in Redis: what the policy saw and produced, token for token.

use std::time::Duration;

use redis::AsyncCommands;
use sleuth_proto::common::v1::{SegmentKind, Trace, TraceSegment};
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
}

impl EpisodeRecord {
    pub fn new(episode: &str) -> Self {
        Self { trace: Some(Trace { episode_id: episode.to_owned(), ..Trace::default() }), messages_seen: 0 }
    }

    pub fn trace(&self) -> &Trace {
        self.trace.as_ref().expect("records always hold a trace")
    }

    pub fn trace_mut(&mut self) -> &mut Trace {
        self.trace.get_or_insert_with(Trace::default)
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

/// Records in Redis under `sleuth:episode:<id>`, expiring `ttl` after the last write.
#[derive(Clone)]
pub struct TraceStore {
    redis: RedisStore,
    ttl: Duration,
}

/// Attempts for a trace write before the episode is failed, and the first backoff.
const WRITE_ATTEMPTS: u32 = 4;
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

impl TraceStore {
    pub fn new(redis: RedisStore, ttl: Duration) -> Self {
        Self { redis, ttl }
    }

    fn key(episode: &str) -> String {
        format!("sleuth:episode:{episode}")
    }

    /// The episode's record, or None when it has none (new or expired).
    pub async fn load(&self, episode: &str) -> Result<Option<EpisodeRecord>, Error> {
        let mut connection = self.redis.connection().await?;
        let bytes: Option<Vec<u8>> = connection
            .get(Self::key(episode))
            .await
            .map_err(|e| Error::Internal(format!("reading the trace of episode {episode}: {e}")))?;
        bytes
            .map(|bytes| {
                <EpisodeRecord as prost::Message>::decode(bytes.as_slice())
                    .map_err(|e| Error::Internal(format!("trace of episode {episode} is corrupt: {e}")))
            })
            .transpose()
    }

    /// Writes the record, retrying transient failures with backoff; an error
    /// here means the turn's tokens would be lost, so the caller fails the turn.
    pub async fn save(&self, episode: &str, record: &EpisodeRecord) -> Result<(), Error> {
        let bytes = prost::Message::encode_to_vec(record);
        let mut backoff = FIRST_BACKOFF;
        let mut last = String::new();
        for attempt in 1..=WRITE_ATTEMPTS {
            let result = async {
                let mut connection = self.redis.connection().await.map_err(|e| e.to_string())?;
                connection
                    .set_ex::<_, _, ()>(Self::key(episode), bytes.as_slice(), self.ttl.as_secs().max(1))
                    .await
                    .map_err(|e| e.to_string())
            }
            .await;
            match result {
                Ok(()) => return Ok(()),
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
}
