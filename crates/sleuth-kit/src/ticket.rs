//! Episode tickets: the capability to act on one episode at the inference
//! gateway.
//!
//! The mesh token opens the gateway to every agent pod and OpenAI-door
//! client, so it cannot also say which episode a caller may write to or
//! read. The orchestrator therefore issues each episode a ticket with
//! `RunEpisode`, and the agent presents it on every `Chat`, `GetTrace` and
//! `FinishEpisode` of that episode. A ticket is an HMAC-SHA256, under a key
//! only the orchestrator and the inference gateway hold
//! (`SLEUTH_TICKET_KEY`), of the episode id, its [`Grant`] and its token
//! budget: unguessable without the key, useless for any other episode, and
//! checked by any gateway replica without shared state.

use std::fmt;
use std::str::FromStr;

use hmac::{Hmac, Mac};

use crate::BearerToken;

/// What a ticket lets its holder do to its episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// Have the policy take turns, and read and finish the trace.
    Policy,
    /// Also record a teacher's replies as the policy's tokens
    /// (`ChatRequest.teacher_reply`): trajectory SFT data.
    Teacher,
}

impl Grant {
    fn name(self) -> &'static str {
        match self {
            Grant::Policy => "policy",
            Grant::Teacher => "teacher",
        }
    }
}

impl FromStr for Grant {
    type Err = ();

    fn from_str(value: &str) -> Result<Self, ()> {
        match value {
            "policy" => Ok(Grant::Policy),
            "teacher" => Ok(Grant::Teacher),
            _ => Err(()),
        }
    }
}

/// What a valid ticket says of its episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    pub grant: Grant,
    /// The most tokens the episode's trace may hold (its
    /// `max_episode_tokens`): the gateway refuses a turn past it.
    pub max_tokens: u32,
}

/// The key tickets are signed with. Its `Debug` output never shows it.
#[derive(Clone)]
pub struct TicketKey(BearerToken);

impl TicketKey {
    /// A key from its secret (the same form as a bearer token: visible ASCII).
    pub fn new(secret: BearerToken) -> Self {
        Self(secret)
    }

    fn tag(&self, episode: &str, grant: Grant, max_tokens: u32) -> Hmac<sha2::Sha256> {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(self.0.secret()).expect("HMAC takes keys of any length");
        // Length-prefixed, so no episode id can be made to read as another's fields.
        mac.update(b"sleuth episode ticket v1");
        mac.update(&(episode.len() as u64).to_le_bytes());
        mac.update(episode.as_bytes());
        mac.update(grant.name().as_bytes());
        mac.update(&max_tokens.to_le_bytes());
        mac
    }

    /// The ticket of `episode` with `grant`, for a trace of at most
    /// `max_tokens`: `<grant>.<max_tokens>.<hex tag>`.
    pub fn issue(&self, episode: &str, grant: Grant, max_tokens: u32) -> String {
        let tag: String =
            self.tag(episode, grant, max_tokens).finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
        format!("{}.{max_tokens}.{tag}", grant.name())
    }

    /// What `ticket` admits to `episode`; `None` when it is not a ticket
    /// this key issued for that episode (the comparison takes the same time
    /// wherever the first difference is).
    pub fn admit(&self, episode: &str, ticket: &str) -> Option<Admission> {
        let mut fields = ticket.splitn(3, '.');
        let grant: Grant = fields.next()?.parse().ok()?;
        let max_tokens: u32 = fields.next()?.parse().ok()?;
        let hex = fields.next()?;
        if hex.len() != 64 || !hex.is_ascii() {
            return None;
        }
        let tag: Vec<u8> =
            (0..32).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)).collect::<Result<_, _>>().ok()?;
        self.tag(episode, grant, max_tokens).verify_slice(&tag).ok()?;
        Some(Admission { grant, max_tokens })
    }
}

impl fmt::Debug for TicketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TicketKey(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(secret: &str) -> TicketKey {
        TicketKey::new(secret.parse().unwrap())
    }

    #[test]
    fn a_ticket_admits_its_episode_with_its_grant_and_budget_only() {
        let key = key("ticket-secret");
        let ticket = key.issue("run-e0-t1-0-a", Grant::Teacher, 4096);
        assert!(ticket.starts_with("teacher.4096."), "{ticket}");
        assert_eq!(key.admit("run-e0-t1-0-a", &ticket), Some(Admission { grant: Grant::Teacher, max_tokens: 4096 }));
        assert_eq!(key.admit("run-e0-t1-0-b", &ticket), None, "another episode");
        assert_eq!(super::tests::key("other-secret").admit("run-e0-t1-0-a", &ticket), None, "another key");
        let policy = key.issue("run-e0-t1-0-a", Grant::Policy, 4096);
        let forged_grant = policy.replacen("policy", "teacher", 1);
        assert_eq!(key.admit("run-e0-t1-0-a", &forged_grant), None, "the grant is signed");
        let forged_budget = policy.replacen("4096", "9999", 1);
        assert_eq!(key.admit("run-e0-t1-0-a", &forged_budget), None, "the budget is signed");
        for garbage in ["", "policy", "policy.1", "policy.1.zz", "admin.1.00", "policy.x.00", "policy.1.é"] {
            assert_eq!(key.admit("run-e0-t1-0-a", garbage), None, "{garbage:?}");
        }
        assert_eq!(format!("{key:?}"), "TicketKey(<redacted>)");
    }

    /// Without a key no episode has a ticket: only `--insecure` (loopback) runs so.
    #[test]
    fn a_service_without_a_ticket_key_refuses_to_start_unless_insecure() {
        let unset = crate::TicketKeyArgs::default();
        let error = unset.key(&crate::ServeArgs::default()).unwrap_err().to_string();
        assert!(error.contains("SLEUTH_TICKET_KEY") && error.contains("--insecure"), "{error}");
        let insecure = crate::ServeArgs { insecure: true, ..Default::default() };
        assert!(unset.key(&insecure).unwrap().is_none());
        let set = crate::TicketKeyArgs { ticket_key: Some("k".parse().unwrap()), ..Default::default() };
        assert!(set.key(&crate::ServeArgs::default()).unwrap().is_some());
    }
}
