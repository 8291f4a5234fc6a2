//! Scripted teachers: search strategies written as rules that reply in the
//! policy's place (through the inference gateway's `teacher_reply`, so their
//! turns are traced as the exact tokens the policy would sample) to make
//! trajectory-SFT data in the policy's own chat template.
//!
//! A strategy is `<retriever>:<hops>`: search the question with
//! `bm25_search` or `vector_search`, then `hops` times search a bridge the
//! latest results show (`sleuth_chat::bridge`: a phrase of words rare in
//! the collection that neither the question nor an earlier search holds,
//! ranked by the document frequencies the tool gateway reports with each
//! search and by the rank of the hit showing it),
//! then submit without ids: the agent ranks what the searches found, the
//! chain they followed first. Where the run asks for answers in words (it offers
//! `submit_answer`), the teacher answers with the bridge its last search
//! shows (the entity one more hop would have searched: the chain's end;
//! an exploring strategy draws it like a hop) and cites the first hit of
//! each of its searches (the chain it followed). Where the policy is
//! offered `follow_lead`, a hop follows the lead of that number instead of
//! searching its name: the leads are these bridges, listed under each
//! search's results. `mixture` plays the episodes of a group different
//! ways ([`TeacherSpec::choose`]): 0, 1 or 2 hops, each following one of
//! the [`EXPLORED`] most salient bridges, with each offered search tool,
//! the shallow ways first.
//! Which way suits a question is left to the reward: trajectory SFT keeps,
//! of each question's episodes, those the reward ranks highest (the fewest
//! turns breaking ties: a hop after the answer was found scores as high). The ways
//! are dealt out by the episode's index in its group, not drawn per
//! episode: a way that two thirds of a services collection's 2-hop
//! questions needed (the second lead: the most salient bridge of a
//! service's results is another service its release notes name) was drawn
//! into a group of 8 only two times in five.

use serde_json::json;
use sleuth_chat::bridge::{WordStats, bridges};
use sleuth_chat::observation::{ListedHit, SEARCH_HITS, parse_leads, parse_search_results};
use sleuth_proto::common::v1::ToolSpec;

use crate::prompt::{FOLLOW_LEAD, SUBMIT_ANSWER, SUBMIT_TOOL};

/// The most bridges a strategy follows.
const MAX_HOPS: u32 = 3;
/// How many of the most salient bridges a mixture's hops explore.
pub const EXPLORED: u32 = 3;
/// The hops a mixture's ways take at most: with [`EXPLORED`] bridges a hop,
/// 1 + 3 + 9 ways a tool.
const MIXTURE_HOPS: u32 = 2;
/// Every hop (and an answer in words) takes the most salient bridge.
const FOLLOW_THE_MOST_SALIENT: [u32; MAX_HOPS as usize + 1] = [0; MAX_HOPS as usize + 1];

/// One scripted way to search.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strategy {
    /// The search tool: `bm25_search` or `vector_search`.
    pub tool: &'static str,
    /// Bridges followed after searching the question.
    pub hops: u32,
    /// Which of the [`EXPLORED`] most salient bridges each hop follows, from
    /// 0 (the most salient); the entry after the last hop picks the bridge
    /// an answer in words names.
    pub picks: [u32; MAX_HOPS as usize + 1],
}

/// What `AgentConfig.teacher` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TeacherSpec {
    Fixed(Strategy),
    /// A different strategy for each episode of a group ([`TeacherSpec::choose`]).
    Mixture,
    /// A model behind the agent's teacher endpoint, by the name its
    /// requests send as `model` (`crate::model_teacher`).
    Model(String),
}

impl TeacherSpec {
    /// Parses `AgentConfig.teacher` (an error names it as `teacher`): `""` (no teacher: the policy replies),
    /// `mixture`, `bm25:<hops>` / `vector:<hops>` with hops 0 to 3, or
    /// `model:<name>` (a name without spaces).
    pub fn parse(name: &str) -> Result<Option<Self>, String> {
        let bad = || {
            format!(
                "teacher {name:?} is not a teacher (bm25:<hops>, vector:<hops> with hops 0..={MAX_HOPS}, mixture, \
                 or model:<name>)"
            )
        };
        match name.trim() {
            "" => Ok(None),
            "mixture" => Ok(Some(Self::Mixture)),
            other if other.starts_with("model:") => {
                let model = &other["model:".len()..];
                match !model.is_empty() && model.chars().all(|c| c.is_ascii_graphic()) {
                    true => Ok(Some(Self::Model(model.to_owned()))),
                    false => Err(bad()),
                }
            }
            other => {
                let (retriever, hops) = other.split_once(':').ok_or_else(bad)?;
                let tool = match retriever {
                    "bm25" => "bm25_search",
                    "vector" => "vector_search",
                    _ => return Err(bad()),
                };
                let hops: u32 = hops.parse().ok().filter(|h| *h <= MAX_HOPS).ok_or_else(bad)?;
                Ok(Some(Self::Fixed(Strategy { tool, hops, picks: FOLLOW_THE_MOST_SALIENT })))
            }
        }
    }

    /// The strategy of episode `sample` of group `group` when `offered` are
    /// its tools; an error names a fixed strategy's tool the collection
    /// lacks (or a model teacher, which follows none). A mixture deals its
    /// ways out breadth first, each depth from a start drawn from the
    /// group's id: the first episodes of a group play every way of at most
    /// one hop (4 a tool), the rest 2-hop ways (9 a tool). So a group of 8
    /// with one tool plays the 4 shallow ways and 4 of the 9 deep ones,
    /// another epoch's group of the question another 4, and a single
    /// episode (an evaluation's) one of the shallow ways.
    pub fn choose(&self, group: &str, sample: u32, offered: &[ToolSpec]) -> Result<Strategy, String> {
        let has = |tool: &str| offered.iter().any(|t| t.name == tool);
        match *self {
            Self::Model(ref model) => Err(format!("config.teacher model:{model} follows no scripted strategy")),
            Self::Fixed(strategy) if has(strategy.tool) => Ok(strategy),
            Self::Fixed(strategy) => {
                Err(format!("config.teacher needs {}, which the collection does not offer", strategy.tool))
            }
            Self::Mixture => {
                let tools: Vec<&'static str> =
                    ["bm25_search", "vector_search"].into_iter().filter(|tool| has(tool)).collect();
                if tools.is_empty() {
                    return Err("config.teacher mixture needs bm25_search or vector_search".into());
                }
                let of_depth = |depths: std::ops::RangeInclusive<u32>| -> Vec<Strategy> {
                    tools.iter().flat_map(|&tool| depths.clone().flat_map(move |hops| ways(tool, hops))).collect()
                };
                let (shallow, deep) = (of_depth(0..=1), of_depth(2..=MIXTURE_HOPS));
                let start = sleuth_kit::seed::derive(0, group);
                let deal = |ways: &[Strategy], n: u64| ways[((start % ways.len() as u64) + n) as usize % ways.len()];
                let sample = u64::from(sample);
                Ok(match sample.checked_sub(shallow.len() as u64) {
                    None => deal(&shallow, sample),
                    Some(n) => deal(&deep, n),
                })
            }
        }
    }
}

/// The ways to take `hops` hops with `tool`, each hop following one of the
/// [`EXPLORED`] most salient bridges: `EXPLORED ^ hops` of them.
fn ways(tool: &'static str, hops: u32) -> impl Iterator<Item = Strategy> {
    (0..EXPLORED.pow(hops)).map(move |way| {
        let mut picks = FOLLOW_THE_MOST_SALIENT;
        for (hop, pick) in picks.iter_mut().take(hops as usize).enumerate() {
            *pick = way / EXPLORED.pow(hop as u32) % EXPLORED;
        }
        Strategy { tool, hops, picks }
    })
}

/// Which of the agent's own tools a teacher answers and hops with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Answering {
    /// Answer in words with citations (`submit_answer`), not a ranking.
    pub in_words: bool,
    /// Hop with `follow_lead` (the lead's number) instead of searching the bridge.
    pub follow: bool,
}

/// A teacher following one strategy through one episode.
pub struct Teacher {
    strategy: Strategy,
    question: String,
    /// The queries searched so far.
    searched: Vec<String>,
    /// The latest search's hits.
    latest: Vec<ListedHit>,
    /// The leads listed under them, where `follow_lead` is offered.
    leads: Vec<String>,
    answering: Answering,
    /// The first hit of each search so far: the documents an answer cites.
    chain: Vec<String>,
}

impl Teacher {
    /// A teacher for `question`; `opened`: the agent searched the question
    /// before the first turn (`opening_search`), so the teacher starts from
    /// its results; `answering`: the agent's own tools it uses.
    pub fn new(strategy: Strategy, question: &str, opened: bool, answering: Answering) -> Self {
        let searched = if opened { vec![question.to_owned()] } else { Vec::new() };
        let question = question.to_owned();
        let (latest, leads, chain) = (Vec::new(), Vec::new(), Vec::new());
        Self { strategy, question, searched, latest, leads, answering, chain }
    }

    /// The next reply, given the observation of the previous call (none on
    /// the first turn), the collection's statistics of the words the
    /// episode's searches showed (`CallToolResponse.word_df`), and the turns
    /// left (the last one submits).
    pub fn reply(&mut self, observation: Option<&str>, stats: &WordStats, turns_left: u32) -> String {
        if let Some(observation) = observation {
            self.latest = parse_search_results(observation);
            self.leads = parse_leads(observation);
            if let Some(first) = self.latest.first().filter(|hit| !self.chain.contains(&hit.id)) {
                self.chain.push(first.id.clone());
            }
        }
        if self.searched.is_empty() && turns_left > 1 {
            return self.search(self.question.clone());
        }
        let more_hops = self.searched.len() <= self.strategy.hops as usize;
        match self.bridge(stats).filter(|_| more_hops && turns_left > 1) {
            Some((n, lead)) if self.answering.follow => {
                tracing::debug!(question = %self.question, lead = %lead, "teacher follows lead {}", n + 1);
                self.searched.push(lead);
                call(FOLLOW_LEAD, &json!({"n": n + 1}))
            }
            Some((_, name)) => self.search(name),
            None => self.submit(stats),
        }
    }

    fn search(&mut self, query: String) -> String {
        tracing::debug!(question = %self.question, query = %query, "teacher searches");
        let call = call(self.strategy.tool, &json!({"query": query, "k": SEARCH_HITS}));
        self.searched.push(query);
        call
    }

    /// The strategy's pick of the latest results' bridges (the leads they
    /// list, where `follow_lead` is offered: the same ranking, as the agent
    /// computed it), and its rank from 0.
    fn bridge(&self, stats: &WordStats) -> Option<(usize, String)> {
        let mut ranked = match self.answering.follow {
            true => self.leads.clone(),
            false => {
                let known: Vec<String> = std::iter::once(&self.question).chain(&self.searched).cloned().collect();
                bridges(&self.latest, &known, stats)
            }
        };
        // The question is the first search (made by the teacher or opened by
        // the agent), so hop n is search n + 1.
        let hop = self.searched.len().saturating_sub(1);
        let pick = self.strategy.picks.get(hop).copied().unwrap_or(0) as usize;
        let pick = pick.min(ranked.len().saturating_sub(1));
        (!ranked.is_empty()).then(|| (pick, ranked.swap_remove(pick)))
    }

    /// A ranking submitted without ids: what the searches found, the chain
    /// of bridges first (`sleuth_chat::observation::ranking`). The ids it saw, listed, would
    /// rank fewer documents, in more tokens, with ids to copy wrong.
    /// In words: the bridge the strategy would follow next (its pick after
    /// the last hop), or the title of the latest first hit
    /// when the results show none; citing the chain.
    fn submit(&self, stats: &WordStats) -> String {
        if !self.answering.in_words {
            return call(SUBMIT_TOOL, &json!({}));
        }
        let bridge = self.bridge(stats).map(|(_, name)| name);
        let answer = bridge.or_else(|| self.latest.first().map(|hit| hit.title.clone())).unwrap_or_default();
        call(SUBMIT_ANSWER, &json!({"answer": answer.trim(), "citations": self.chain}))
    }
}

/// A tool call as the chat template renders one: a reply written otherwise
/// would re-render to other tokens on the next turn and count as drift.
fn call(tool: &str, arguments: &serde_json::Value) -> String {
    sleuth_chat::tool_calls_text(&[json!({"name": tool, "arguments": arguments})])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Document frequencies in a collection of 100, as a gateway would
    /// report them for the tests' results: names rare, common words not.
    fn stats() -> WordStats {
        let rare = [("varnok", 3), ("ada", 5), ("foukur", 4), ("razak", 6), ("toubal", 3), ("rhabeksa-store", 3)];
        let common = [("1903", 1), ("1950", 1), ("started", 40), ("potter", 9), ("lives", 40), ("clouds", 20)];
        let df = rare.into_iter().chain(common).map(|(word, df)| (word.to_owned(), df)).collect();
        WordStats { df, documents: 100 }
    }

    fn tools(names: &[&str]) -> Vec<ToolSpec> {
        names.iter().map(|n| ToolSpec { name: (*n).into(), ..Default::default() }).collect()
    }

    #[test]
    fn strategies_parse_and_bad_ones_are_named() {
        assert_eq!(TeacherSpec::parse(""), Ok(None));
        assert_eq!(
            TeacherSpec::parse("bm25:2"),
            Ok(Some(TeacherSpec::Fixed(Strategy { tool: "bm25_search", hops: 2, picks: FOLLOW_THE_MOST_SALIENT })))
        );
        assert_eq!(TeacherSpec::parse("mixture"), Ok(Some(TeacherSpec::Mixture)));
        assert_eq!(TeacherSpec::parse("model:Qwen/Qwen3-8B"), Ok(Some(TeacherSpec::Model("Qwen/Qwen3-8B".into()))));
        for bad in ["bm25", "sql:1", "bm25:9", "vector:x", "model:", "model:two words"] {
            assert!(TeacherSpec::parse(bad).unwrap_err().contains(&format!("{bad:?}")), "{bad}");
        }
        let vector = TeacherSpec::parse("vector:1").unwrap().unwrap();
        assert!(vector.choose("q1", 0, &tools(&["bm25_search"])).unwrap_err().contains("vector_search"));
    }

    #[test]
    fn a_mixture_deals_its_ways_breadth_first_within_the_offered_tools() {
        use std::collections::BTreeSet;
        let offered = tools(&["bm25_search", "read_document"]);
        let way = |group: &str, sample| {
            let strategy = TeacherSpec::Mixture.choose(group, sample, &offered).unwrap();
            assert_eq!(strategy.tool, "bm25_search");
            (strategy.hops, strategy.picks)
        };
        let dealt: Vec<_> = (0..13).map(|sample| way("e0-q1", sample)).collect();
        assert_eq!(dealt.iter().collect::<BTreeSet<_>>().len(), 13, "a group of 13 plays every way once: {dealt:?}");
        let hops: Vec<u32> = dealt.iter().map(|(hops, _)| *hops).collect();
        assert!(hops[..4].iter().all(|h| *h <= 1) && hops[4..].iter().all(|h| *h == 2), "shallow first: {hops:?}");
        assert!(dealt.contains(&(2, [2, 1, 0, 0])), "{dealt:?}");
        assert!(dealt.iter().all(|(hops, picks)| picks[*hops as usize..].iter().all(|p| *p == 0)));
        assert_eq!(way("e0-q1", 3), way("e0-q1", 3), "a rerun plays the same way");
        let deep: BTreeSet<_> = (0..16)
            .flat_map(|epoch| (4..8).map(move |s| (epoch, s)))
            .map(|(epoch, s)| way(&format!("e{epoch}-q1"), s))
            .collect();
        assert_eq!(deep.len(), 9, "the epochs' groups play the deep ways between them: {deep:?}");
        let openers: BTreeSet<_> = (0..32).map(|group| way(&format!("e0-q{group}"), 0)).collect();
        assert_eq!(openers.len(), 4, "single episodes of many groups play every shallow way: {openers:?}");
        let both = tools(&["bm25_search", "vector_search"]);
        let tools_used: BTreeSet<&str> =
            (0..8).map(|s| TeacherSpec::Mixture.choose("e0-q1", s, &both).unwrap().tool).collect();
        assert_eq!(tools_used, ["bm25_search", "vector_search"].into());
    }

    #[test]
    fn two_hops_follow_the_bridges_then_submit() {
        let strategy = Strategy { tool: "bm25_search", hops: 2, picks: FOLLOW_THE_MOST_SALIENT };
        let mut teacher = Teacher::new(
            strategy,
            "Name the river near the residence of the founder of Klabou Atelier.",
            false,
            Answering::default(),
        );
        let first = teacher.reply(None, &stats(), 5);
        assert!(first.contains(r#""name": "bm25_search""#) && first.contains("Klabou Atelier"), "{first}");
        let company = "bm25_search results for \"...\":\n[1] doc_id: o3 | Klabou Atelier\nKlabou Atelier was started by Ada Varnok in 1903.\n[2] doc_id: do3 | Klabou Atelier\nKlabou Atelier sponsored the regatta held in Razak during 1950.\n";
        let second = teacher.reply(Some(company), &stats(), 4);
        assert!(second.contains(r#""query": " Ada Varnok""#), "{second}");
        let person = "bm25_search results for \"Ada Varnok\":\n[1] doc_id: p3 | Ada Varnok\nAda Varnok lives in Foukur and earns a living as a potter.\n";
        let third = teacher.reply(Some(person), &stats(), 3);
        assert!(third.contains(r#""query": " Foukur""#), "{third}");
        let town = "bm25_search results for \"Foukur\":\n[1] doc_id: c1 | Foukur\nFoukur lies beside the Toubal.\n";
        let last = teacher.reply(Some(town), &stats(), 2);
        assert_eq!(last, r#"<tool_call>[{"name": "submit_ranking", "arguments": {}}]</tool_call>"#);
    }

    #[test]
    fn after_an_opening_search_the_teacher_bridges_from_its_results() {
        let question = "Name the river near the residence of the founder of Klabou Atelier.";
        let mut teacher = Teacher::new(
            Strategy { tool: "bm25_search", hops: 1, picks: FOLLOW_THE_MOST_SALIENT },
            question,
            true,
            Answering::default(),
        );
        let company = "bm25_search results for \"...\":\n[1] doc_id: o3 | Klabou Atelier\nKlabou Atelier was started by Ada Varnok in 1903.\n";
        assert!(teacher.reply(Some(company), &stats(), 4).contains(r#""query": " Ada Varnok""#));
        let person =
            "bm25_search results for \"Ada Varnok\":\n[1] doc_id: p3 | Ada Varnok\nAda Varnok lives in Foukur.\n";
        assert!(teacher.reply(Some(person), &stats(), 3).contains(r#""name": "submit_ranking""#), "one hop only");
        let mut at_once = Teacher::new(
            Strategy { tool: "bm25_search", hops: 0, picks: FOLLOW_THE_MOST_SALIENT },
            question,
            true,
            Answering::default(),
        );
        assert!(at_once.reply(Some(company), &stats(), 4).contains(r#""name": "submit_ranking""#));
    }

    #[test]
    fn in_words_the_teacher_answers_with_the_chains_end_and_cites_the_chain() {
        let question = "Name the river near the residence of the founder of Klabou Atelier.";
        let strategy = Strategy { tool: "bm25_search", hops: 2, picks: FOLLOW_THE_MOST_SALIENT };
        let mut teacher = Teacher::new(strategy, question, true, Answering { in_words: true, follow: false });
        let company = "bm25_search results for \"...\":\n[1] doc_id: o3 | Klabou Atelier\nKlabou Atelier was started by Ada Varnok in 1903.\n";
        assert!(teacher.reply(Some(company), &stats(), 5).contains(r#""query": " Ada Varnok""#));
        let person = "bm25_search results for \"Ada Varnok\":\n[1] doc_id: p3 | Ada Varnok\nAda Varnok lives in Foukur and earns a living as a potter.\n";
        assert!(teacher.reply(Some(person), &stats(), 4).contains(r#""query": " Foukur""#));
        let town = "bm25_search results for \"Foukur\":\n[1] doc_id: c1 | Foukur\nFoukur lies beside the Toubal.\n[2] doc_id: p3 | Ada Varnok\nAda Varnok lives in Foukur.\n";
        let answer = teacher.reply(Some(town), &stats(), 3);
        assert_eq!(
            answer,
            r#"<tool_call>[{"name": "submit_answer", "arguments": {"answer": "Toubal", "citations": ["o3", "p3", "c1"]}}]</tool_call>"#
        );
    }

    #[test]
    fn the_last_turn_submits_whatever_was_found() {
        let mut teacher = Teacher::new(
            Strategy { tool: "bm25_search", hops: 2, picks: FOLLOW_THE_MOST_SALIENT },
            "why does it rain",
            false,
            Answering::default(),
        );
        teacher.reply(None, &stats(), 2);
        let hits =
            "bm25_search results for \"why does it rain\":\n[1] doc_id: rain | Rainfall\nRain forms in Clouds Above.\n";
        assert!(teacher.reply(Some(hits), &stats(), 1).contains(r#""name": "submit_ranking""#));
    }

    #[test]
    fn offered_follow_lead_a_hop_follows_the_listed_leads_number() {
        let question = "Name the river near the residence of the founder of Klabou Atelier.";
        let follow = Answering { in_words: false, follow: true };
        let company = "bm25_search results for \"...\":\n[1] doc_id: o3 | Klabou Atelier\nKlabou Atelier was started by Ada Varnok in 1903.\nLeads to follow: 1. Ada Varnok; 2. Razak; 3. regatta\n";
        let mut teacher = Teacher::new(
            Strategy { tool: "bm25_search", hops: 2, picks: FOLLOW_THE_MOST_SALIENT },
            question,
            true,
            follow,
        );
        let hop = teacher.reply(Some(company), &stats(), 5);
        assert_eq!(hop, r#"<tool_call>[{"name": "follow_lead", "arguments": {"n": 1}}]</tool_call>"#);
        let person =
            "bm25_search results for \"Ada Varnok\":\n[1] doc_id: p3 | Ada Varnok\nAda Varnok lives in Foukur.\n";
        assert!(teacher.reply(Some(person), &stats(), 4).contains(r#""name": "submit_ranking""#), "no leads: submit");
        let followed: Vec<String> = (0..EXPLORED)
            .map(|first| Strategy { tool: "bm25_search", hops: 1, picks: [first, 0, 0, 0] })
            .map(|strategy| Teacher::new(strategy, question, true, follow).reply(Some(company), &stats(), 4))
            .collect();
        let numbers: Vec<String> = (1..=3).map(|n| format!(r#"{{"n": {n}}}"#)).collect();
        assert!(followed.iter().zip(&numbers).all(|(reply, n)| reply.contains(n)), "{followed:#?}");
    }

    #[test]
    fn a_lower_case_identifier_is_a_bridge_and_exploring_hops_draw_others() {
        let question = "What does the service that kaquka-worker calls for downstream work handle?";
        let service = "bm25_search results for \"...\":\n[1] doc_id: s1 | kaquka-worker\nkaquka-worker is written in Elixir and calls rhabeksa-store for downstream work.\n";
        let mut stats = stats();
        stats.df.insert("elixir".to_owned(), 15);
        let mut first = Teacher::new(
            Strategy { tool: "bm25_search", hops: 1, picks: FOLLOW_THE_MOST_SALIENT },
            question,
            true,
            Answering::default(),
        );
        assert!(first.reply(Some(service), &stats, 4).contains(r#""query": " rhabeksa-store""#));
        // Three bridges, one for each first lead a strategy may take.
        stats.df.insert("written".to_owned(), 60);
        let explored: std::collections::BTreeSet<String> = (0..EXPLORED)
            .map(|first| Strategy { tool: "bm25_search", hops: 1, picks: [first, 0, 0, 0] })
            .map(|strategy| {
                Teacher::new(strategy, question, true, Answering::default()).reply(Some(service), &stats, 4)
            })
            .collect();
        assert_eq!(explored.len() as u32, EXPLORED, "{explored:#?}");
        assert!(explored.iter().any(|reply| reply.contains(r#""query": " Elixir""#)), "{explored:#?}");
    }
}
