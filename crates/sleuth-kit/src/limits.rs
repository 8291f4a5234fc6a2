//! How large one gRPC message of the mesh may be, derived from the episode
//! budget (tonic's default of 4 MiB made a long episode fail as a "worker
//! failure" on its way back to the orchestrator).
//!
//! An episode is the largest message: per token its trace holds an id (at
//! most 5 bytes packed), a loss-mask byte and a logprob (4), and its
//! messages the same tokens as text (at most 16 bytes of UTF-8 each, and
//! about 4 on average); document ids shown or ranked are part of those
//! tokens too. So an episode of [`MAX_EPISODE_TOKENS`] stays under
//! [`BYTES_PER_EPISODE_TOKEN`] x that, 8 MiB, and [`MAX_MESSAGE_BYTES`]
//! doubles it for the rest of a message. Weight updates travel in 3 MiB
//! chunks, well inside it.
//!
//! Every server and every mesh client takes and sends messages up to it
//! ([`crate::sized!`]); a peer that sends more is refused with
//! `OUT_OF_RANGE` ("message length too large") before the message is read.

/// The largest `max_episode_tokens` an agent accepts in a budget.
pub const MAX_EPISODE_TOKENS: u32 = 262_144;
/// What one token of an episode can cost on the wire, at most.
pub const BYTES_PER_EPISODE_TOKEN: usize = 32;
/// The largest gRPC message any Sleuth service or client takes or sends (16 MiB).
pub const MAX_MESSAGE_BYTES: usize = 2 * MAX_EPISODE_TOKENS as usize * BYTES_PER_EPISODE_TOKEN;

/// A tonic-generated server or client, taking and sending messages up to
/// [`MAX_MESSAGE_BYTES`]: `sized!(AgentServer::new(handlers))`.
#[macro_export]
macro_rules! sized {
    ($grpc:expr) => {
        $grpc
            .max_decoding_message_size($crate::limits::MAX_MESSAGE_BYTES)
            .max_encoding_message_size($crate::limits::MAX_MESSAGE_BYTES)
    };
}
