//! The prefix cache: keys and values of finished turns by session, so an
//! episode's next turn prefills only its new tokens.

use sleuth_model::KvCache;
use std::collections::VecDeque;

/// Keys and values of finished turns by session, least recently used evicted
/// first once they hold more than `budget` tokens.
pub(crate) struct Sessions {
    budget: usize,
    pub(crate) held: usize,
    entries: VecDeque<(String, Vec<i64>, KvCache)>,
}

impl Sessions {
    pub(crate) fn new(budget: usize) -> Self {
        Self { budget, held: 0, entries: VecDeque::new() }
    }

    pub(crate) fn take(&mut self, session: &str) -> Option<(Vec<i64>, KvCache)> {
        let index = self.entries.iter().position(|(key, _, _)| key == session)?;
        let (_, tokens, cache) = self.entries.remove(index)?;
        self.held -= tokens.len();
        Some((tokens, cache))
    }

    pub(crate) fn keep(&mut self, session: &str, tokens: Vec<i64>, cache: KvCache) {
        if session.is_empty() || tokens.len() > self.budget {
            return;
        }
        let _ = self.take(session);
        self.held += tokens.len();
        self.entries.push_back((session.to_owned(), tokens, cache));
        while self.held > self.budget {
            let Some((_, tokens, _)) = self.entries.pop_front() else { break };
            self.held -= tokens.len();
        }
    }

    /// Cached keys and values belong to the weights that computed them.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.held = 0;
    }
}
