//! Who may act on an episode: the gateway's side of
//! [`sleuth_kit::ticket`].
//!
//! On a gateway with a ticket key, an episode started with a ticket (every
//! episode of a run or an evaluation: the orchestrator issues one with
//! `RunEpisode`) is the ticket holder's: its turns, its trace and its
//! finish need the ticket, or the admin token. A turn of a run and a teacher
//! reply (recorded as the policy's own tokens, so training data) need a
//! ticket whatever the episode; a teacher reply needs the teacher grant.
//! Without a ticket a caller with the mesh token starts or continues an
//! episode of no run, as the OpenAI door's clients do. Without a key
//! (`--insecure` only) nothing is checked.

use sleuth_kit::BearerToken;
use sleuth_kit::ticket::{Admission, Grant, TicketKey};

use crate::episode::EpisodeRecord;
use crate::error::Error;

/// The gateway's ticket key and admin token.
#[derive(Debug, Clone, Default)]
pub struct Tickets {
    key: Option<TicketKey>,
    admin: Option<BearerToken>,
}

/// Who calls, as far as one episode is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// No ticket key: nothing is checked.
    Unchecked,
    /// The admin token: any episode, unbounded.
    Admin,
    /// The episode's ticket, with what it grants.
    Ticket(Admission),
    /// No ticket: episodes of no run only.
    Nobody,
}

/// What a call does to its episode.
#[derive(Debug, Clone, Copy)]
pub enum Act<'a> {
    /// A turn: of `run` (empty: none), the teacher's reply or the policy's.
    Turn { run: &'a str, teacher: bool },
    /// GetTrace or FinishEpisode.
    Read,
}

impl Tickets {
    pub fn new(key: Option<TicketKey>, admin: Option<BearerToken>) -> Self {
        Self { key, admin }
    }

    /// Who calls on `episode` with the `authorization` header `authorization`
    /// and `ticket`: a ticket that is not this episode's is refused, never
    /// taken for no ticket.
    pub fn holder(&self, authorization: Option<&str>, episode: &str, ticket: &str) -> Result<Holder, Error> {
        let Some(key) = &self.key else { return Ok(Holder::Unchecked) };
        if self.admin.as_ref().zip(authorization).is_some_and(|(admin, header)| admin.matches_header(header)) {
            return Ok(Holder::Admin);
        }
        if ticket.is_empty() {
            return Ok(Holder::Nobody);
        }
        key.admit(episode, ticket)
            .map(Holder::Ticket)
            .ok_or_else(|| Error::Denied(format!("ticket is not one issued for episode {episode:?}")))
    }

    /// Whether `holder` may `act` on `episode`, whose record is `record`
    /// (fresh when the episode has no trace yet).
    pub fn check(holder: Holder, episode: &str, record: &EpisodeRecord, act: Act<'_>) -> Result<(), Error> {
        let ticketed = matches!(holder, Holder::Ticket(_));
        match (holder, act) {
            (Holder::Unchecked | Holder::Admin, _) => Ok(()),
            (Holder::Ticket(Admission { grant: Grant::Policy, .. }), Act::Turn { teacher: true, .. }) => {
                Err(Error::Denied(format!(
                    "teacher_reply needs a ticket with the teacher grant; episode {episode:?}'s has the policy grant"
                )))
            }
            (Holder::Nobody, Act::Turn { teacher: true, .. }) => {
                Err(Error::Denied(format!("teacher_reply needs episode {episode:?}'s ticket with the teacher grant")))
            }
            (Holder::Nobody, Act::Turn { run, .. }) if !run.is_empty() => Err(Error::Denied(format!(
                "a turn of run {run:?} needs episode {episode:?}'s ticket (RunEpisodeRequest.ticket)"
            ))),
            _ if record.ticketed && !ticketed => Err(Error::Denied(format!(
                "episode {episode:?} was started with a ticket: only its ticket or the admin token opens it"
            ))),
            (_, Act::Turn { .. }) if ticketed && !record.ticketed && record.turns > 0 => Err(Error::Denied(format!(
                "episode {episode:?} was started without a ticket; its ticket cannot adopt a trace someone else began"
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_open_their_episode_and_grants_open_teacher_replies() {
        let key = TicketKey::new("ticket-key".parse().unwrap());
        let tickets = Tickets::new(Some(key.clone()), Some("admin-token".parse().unwrap()));
        let teacher_ticket = key.issue("e1", Grant::Teacher, 100);
        let policy_ticket = key.issue("e1", Grant::Policy, 100);
        let teacher = tickets.holder(None, "e1", &teacher_ticket).unwrap();
        let policy = tickets.holder(Some("Bearer mesh-token"), "e1", &policy_ticket).unwrap();
        let nobody = tickets.holder(Some("Bearer mesh-token"), "e1", "").unwrap();
        let admin = tickets.holder(Some("Bearer admin-token"), "e1", "").unwrap();
        assert_eq!(nobody, Holder::Nobody);
        assert_eq!(admin, Holder::Admin);
        let denied = tickets.holder(None, "e2", &teacher_ticket).unwrap_err();
        assert!(denied.to_string().contains(r#"not one issued for episode "e2""#), "{denied}");

        let fresh = EpisodeRecord::new("e1");
        let ticketed = EpisodeRecord { ticketed: true, turns: 1, ..EpisodeRecord::new("e1") };
        let open = EpisodeRecord { turns: 1, ..EpisodeRecord::new("e1") };
        let teach = Act::Turn { run: "r", teacher: true };
        let sample = Act::Turn { run: "r", teacher: false };
        let door = Act::Turn { run: "", teacher: false };
        let allowed = |holder, record: &EpisodeRecord, act| Tickets::check(holder, "e1", record, act).is_ok();
        assert!(allowed(teacher, &fresh, teach) && allowed(teacher, &ticketed, sample));
        assert!(!allowed(policy, &fresh, teach), "a policy ticket writes no teacher reply");
        assert!(allowed(policy, &ticketed, sample) && allowed(policy, &ticketed, Act::Read));
        assert!(!allowed(nobody, &fresh, sample), "a run's turn needs a ticket");
        assert!(!allowed(nobody, &fresh, Act::Turn { run: "", teacher: true }), "so does a teacher reply");
        assert!(!allowed(nobody, &ticketed, door) && !allowed(nobody, &ticketed, Act::Read));
        assert!(allowed(nobody, &fresh, door) && allowed(nobody, &open, door) && allowed(nobody, &open, Act::Read));
        assert!(!allowed(policy, &open, sample), "a ticket never adopts a trace begun without it");
        assert!(allowed(admin, &ticketed, teach) && allowed(admin, &open, Act::Read));
        assert_eq!(Tickets::default().holder(None, "e1", "junk").unwrap(), Holder::Unchecked);
    }
}
