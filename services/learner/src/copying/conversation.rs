//! The samples copy pre-training draws from a collection (see the parent
//! module's docs for why each kind): strings of random words repeated, and
//! conversations in the agent protocol's text that ask for a query or a
//! bridge. Copy rehearsal draws the same conversations during trajectory SFT.

use serde_json::{Value as Json, json};
use sleuth_beir::Document;
use sleuth_chat::bridge::{WordStats, bridges, leads};
use sleuth_chat::observation::{Hit, SEARCH_HITS, parse_search_results, search_results, shorten, with_leads};
use sleuth_chat::tool_calls_text;
use sleuth_chat::tools::{
    BM25_SEARCH, FOLLOW_LEAD, READ_DOCUMENT, SEARCH_TOOLS, SUBMIT_ANSWER, SUBMIT_RANKING, ToolSchema,
};

use crate::Error;
use crate::batch::Sample;
use crate::reply::ReplyRenderer;

/// Characters of a sentence used as a user message or query.
const SENTENCE_CHARS: usize = 160;
/// Words in a repeated string, and the most tokens of it kept.
const REPEAT_WORDS: usize = 120;
const REPEAT_TOKENS: usize = 200;
/// The most words in a random question.
const RANDOM_WORDS: usize = 30;

/// One of the skills taught.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    Ask,
    Bridge,
}

impl Task {
    pub(crate) const ALL: [Task; 2] = [Task::Ask, Task::Bridge];
    /// The conversations of a step, in turn: bridges twice as often, the
    /// harder skill (find the name, then copy it from a long observation)
    /// and the only one an episode opened by the agent's search needs.
    const MIX: [Task; 3] = [Task::Ask, Task::Bridge, Task::Bridge];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Task::Ask => "ask",
            Task::Bridge => "bridge",
        }
    }
}

/// Draws from a seed (counter-based, so a run is reproducible).
pub(crate) struct Draw {
    seed: u64,
    drawn: u64,
}

impl Draw {
    pub fn new(seed: u64) -> Self {
        Self { seed, drawn: 0 }
    }
}

impl Draw {
    fn below(&mut self, n: usize) -> usize {
        self.drawn += 1;
        (sleuth_kit::seed::derive(self.seed, &self.drawn.to_string()) % n as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// What conversations are drawn from.
pub(crate) struct Source {
    documents: Vec<Document>,
    /// Training questions (may be none).
    questions: Vec<String>,
    /// The documents' distinct words.
    words: Vec<String>,
    /// The offered tools, as the chat template renders them.
    pub tools: Offered,
    /// The documents' word statistics: what bridges are ranked by, as the
    /// tool gateway reports them to the teacher.
    word_stats: WordStats,
}

impl Source {
    pub fn new(documents: Vec<Document>, questions: Vec<String>, tools: Offered) -> Self {
        let mut words: Vec<&str> = documents.iter().flat_map(|d| d.text.split_whitespace()).collect();
        words.sort_unstable();
        words.dedup();
        let words = words.into_iter().map(str::to_owned).collect();
        let bodies: Vec<String> = documents.iter().map(|d| format!("{}\n{}", d.title, d.text)).collect();
        let word_stats = WordStats::of_documents(bodies.iter().map(String::as_str));
        Self { documents, questions, words, tools, word_stats }
    }

    /// Documents drawn from.
    pub fn documents(&self) -> usize {
        self.documents.len()
    }
}

/// The tools of the agent's episodes, in the order it offers them.
#[derive(Clone)]
pub(crate) struct Offered {
    /// The search tools among them.
    searches: Vec<&'static str>,
    /// The answer tool: `submit_answer` when named, else `submit_ranking`.
    answer: &'static str,
    /// `follow_lead` is offered: searches list their leads, and a bridge is
    /// followed by its number.
    follow: bool,
    /// Every schema (the answer tool last), as OpenAI `tools` entries.
    pub schemas: Vec<Json>,
}

impl Offered {
    /// `names` in the tool gateway's order, then the answer tool
    /// (`submit_answer` when `names` holds it, else `submit_ranking`); an
    /// error names a tool that is not the agent's, or a list without a search.
    pub fn new(names: &[String]) -> Result<Self, Error> {
        if let Some(unknown) = names.iter().find(|n| ToolSchema::named(n).is_none() || *n == SUBMIT_RANKING) {
            return Err(Error::InvalidArgument(format!(
                "--tools names {unknown:?}, not one of {}, {READ_DOCUMENT}, {FOLLOW_LEAD}, {SUBMIT_ANSWER}",
                SEARCH_TOOLS.join(", ")
            )));
        }
        let offered = |name: &&str| names.iter().any(|n| n == name);
        let searches: Vec<&'static str> = SEARCH_TOOLS.into_iter().filter(offered).collect();
        if searches.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "--tools must name a search tool ({})",
                SEARCH_TOOLS.join(", ")
            )));
        }
        let answer = if offered(&SUBMIT_ANSWER) { SUBMIT_ANSWER } else { SUBMIT_RANKING };
        let follow = offered(&FOLLOW_LEAD);
        if follow && !offered(&BM25_SEARCH) {
            return Err(Error::InvalidArgument(format!("--tools names {FOLLOW_LEAD}, which needs {BM25_SEARCH}")));
        }
        // The agent's order: the gateway's tools, then its own.
        let schemas = SEARCH_TOOLS
            .into_iter()
            .chain([READ_DOCUMENT, FOLLOW_LEAD])
            .filter(offered)
            .chain([answer])
            .filter_map(ToolSchema::named)
            .map(|schema| schema.function())
            .collect();
        Ok(Self { searches, answer, follow, schemas })
    }
}

/// A sentence of a document, cut to [`SENTENCE_CHARS`].
fn sentence(document: &Document, draw: &mut Draw) -> String {
    let sentences: Vec<&str> = document.text.split_inclusive(". ").map(str::trim).filter(|s| !s.is_empty()).collect();
    let chosen = if sentences.is_empty() { document.title.as_str() } else { draw.pick(&sentences) };
    shorten(chosen, SENTENCE_CHARS).trim().to_owned()
}

/// A string of random words twice over, as raw text with the loss on the
/// second copy: every token of it is predictable by copying and by nothing
/// else. This dense supervision is where a tiny model's copying circuit
/// (induction heads) forms; the conversations alone, a few copied words
/// each, did not form it in thousands of steps.
pub(crate) fn repeated(source: &Source, renderer: &ReplyRenderer, draw: &mut Draw) -> Result<Sample, Error> {
    let words = (0..REPEAT_WORDS).map(|_| draw.pick(&source.words).as_str()).collect::<Vec<_>>().join(" ");
    let once = renderer.encode(&words)?;
    let once = &once[..once.len().min(REPEAT_TOKENS)];
    let tokens: Vec<i64> = once.iter().chain(once).copied().collect();
    // The first token of the copy is not predictable; the rest are.
    let mask = (0..tokens.len()).map(|j| if j > once.len() { 1.0 } else { 0.0 }).collect();
    let behaviour = vec![0.0; tokens.len()];
    Ok(Sample::unsampled(tokens, mask, behaviour, 0.0))
}

fn search(tool: &str, query: &str) -> String {
    tool_calls_text(&[json!({"name": tool, "arguments": {"query": query, "k": SEARCH_HITS}})])
}

/// A conversation teaching `task` from `documents`, and its reply. A bridge
/// with no name to follow is taught as a submission.
pub(crate) fn conversation(source: &Source, task: Task, draw: &mut Draw) -> (Vec<Json>, String) {
    let documents = &source.documents;
    let tool = *draw.pick(&source.tools.searches);
    // A third of the messages are training questions, the text the policy
    // will be asked (the first search copies one; SFT alone learnt to write
    // a remembered name there instead). The rest are strings of words drawn
    // uniformly from the collection's vocabulary, which no n-gram statistics
    // predict, so only copying lowers their loss (long ones copy many tokens
    // per conversation), and document sentences.
    let question = match draw.below(3) {
        0 if !source.questions.is_empty() => draw.pick(&source.questions).clone(),
        1 => (0..2 + draw.below(RANDOM_WORDS - 1))
            .map(|_| draw.pick(&source.words).as_str())
            .collect::<Vec<_>>()
            .join(" "),
        _ => {
            let document = &documents[draw.below(documents.len())];
            sentence(document, draw)
        }
    };
    // The agent's own system prompt: the context the policy will copy in.
    let mut messages = vec![
        json!({"role": "system", "content": sleuth_chat::SYSTEM_PROMPT}),
        json!({"role": "user", "content": question}),
    ];
    if task == Task::Ask {
        return (messages, search(tool, &question));
    }
    let mut queries = vec![question.clone()];
    // The bridge to follow, and its number among the listed leads.
    let mut bridge: Option<(usize, String)> = None;
    let follow = source.tools.follow;
    // The first hit of each search: what an answer cites.
    let mut chain: Vec<String> = Vec::new();
    let mut first_title = String::new();
    for round in 0..1 + usize::from(draw.chance(35)) {
        let (query, called, searched_with) = match (round, bridge.take()) {
            (0, _) | (_, None) => (question.clone(), search(tool, &question), tool),
            // The agent searches a followed lead with BM25, by its name.
            (_, Some((n, name))) if follow => (name, follow_lead(n), BM25_SEARCH),
            (_, Some((_, name))) => (name.clone(), search(tool, &name), tool),
        };
        let hits: Vec<Hit> = (0..1 + draw.below(SEARCH_HITS))
            .map(|_| {
                let document = draw.pick(documents);
                Hit { id: &document.id, title: &document.title, text: &document.text }
            })
            .collect();
        let mut observation = search_results(searched_with, &query, &hits);
        let listed = parse_search_results(&observation);
        queries.push(query);
        // Leads, as the agent lists them, never repeat a query searched, the
        // latest included; a bridge without leads is drawn as the measured
        // fresh policies were taught, from the queries before this one.
        let known = if follow { &queries[..] } else { &queries[..queries.len() - 1] };
        // Offered `follow_lead`, a listed lead drawn uniformly: which lead a
        // question needs is the episodes' to teach, and a base taught lead 1
        // alone starts every question preferring it (the services family's
        // multi-hop questions mostly need the second).
        bridge = match follow {
            true => {
                let mut names = leads(&listed, known, &source.word_stats);
                observation = with_leads(&observation, &names);
                let drawn = (!names.is_empty()).then(|| draw.below(names.len()));
                drawn.map(|n| (n + 1, names.swap_remove(n)))
            }
            false => bridges(&listed, known, &source.word_stats).into_iter().next().map(|name| (1, name)),
        };
        if let Some(first) = listed.first() {
            chain.push(first.id.clone());
            first_title.clone_from(&first.title);
        }
        messages.push(json!({"role": "assistant", "content": called}));
        messages.push(json!({"role": "tool", "content": observation}));
    }
    // In words, half the bridges found are answered instead of searched:
    // copying the entity into the answer, and the ids shown into its
    // citations, is the skill an answer needs.
    let answer = |text: &str| {
        tool_calls_text(&[json!({"name": SUBMIT_ANSWER, "arguments": {"answer": text.trim(), "citations": chain}})])
    };
    let reply = match (bridge, source.tools.answer == SUBMIT_ANSWER) {
        (Some((_, name)), true) if draw.chance(50) => answer(&name),
        (Some((n, _)), _) if follow => follow_lead(n),
        (Some((_, name)), _) => search(tool, &name),
        (None, true) => answer(&first_title),
        (None, false) => tool_calls_text(&[json!({"name": SUBMIT_RANKING, "arguments": {}})]),
    };
    (messages, reply)
}

/// A `follow_lead` call of lead `n`.
fn follow_lead(n: usize) -> String {
    tool_calls_text(&[json!({"name": FOLLOW_LEAD, "arguments": {"n": n}})])
}

/// What a conversation's sample trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Teach {
    /// The whole reply: which tool, and what to write in its call.
    Reply,
    /// Only what follows the choice: what to write once a tool is chosen.
    /// The choice is the tool's name, and for `follow_lead` its whole call:
    /// which lead to follow is the question's, as whether to search again
    /// is, and a `follow_lead` call copies nothing.
    Writing,
}

/// The `index`-th conversation of a step, in [`Task::MIX`]'s turn, as a
/// sample with the loss on what `teach` says of its reply.
pub(crate) fn conversation_sample(
    source: &Source,
    renderer: &ReplyRenderer,
    index: usize,
    draw: &mut Draw,
    teach: Teach,
) -> Result<Sample, Error> {
    let task = Task::MIX[index % Task::MIX.len()];
    let (messages, reply) = conversation(source, task, draw);
    let made = renderer.sample(&messages, &source.tools.schemas, &reply)?;
    if teach == Teach::Reply {
        return Ok(made.sample);
    }
    // The reply's tokens that spell its choice (as many as agree with the
    // choice's text encoded alone: a tokenizer may merge the tool's name
    // with what follows, which then stays trained). Rehearsing the lead's
    // number taught the rehearsed lead at every step, whichever lead the
    // episodes' questions needed.
    let named = SEARCH_TOOLS
        .into_iter()
        .chain([FOLLOW_LEAD, SUBMIT_RANKING, SUBMIT_ANSWER])
        .filter_map(|name| reply.find(name).map(|at| (name, at + name.len())))
        .min_by_key(|(_, end)| *end)
        .map(|(name, end)| if name == FOLLOW_LEAD { reply.len() } else { end })
        .ok_or_else(|| Error::Train(format!("a rehearsed reply names no tool: {reply}")))?;
    let choice = renderer.encode(&reply[..named])?;
    let chosen = choice.iter().zip(&made.reply).take_while(|(a, b)| a == b).count();
    let mut sample = made.sample;
    let start = made.prompt.len();
    sample.mask[start..start + chosen].iter_mut().for_each(|m| *m = 0.0);
    Ok(sample)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(tools: &[&str]) -> Source {
        let documents = (0..12)
            .map(|i| Document {
                id: format!("d{i}"),
                title: format!("Varnok {i}"),
                text: format!("Varnok {i} lives in Foukur{} and earns a living as a potter.", i % 3),
            })
            .collect();
        let tools: Vec<String> = tools.iter().map(|t| (*t).to_owned()).collect();
        Source::new(documents, vec!["Which town is Varnok from?".into()], Offered::new(&tools).unwrap())
    }

    #[test]
    fn offered_follow_lead_bridges_are_followed_by_number_from_listed_leads() {
        let follow = source(&["bm25_search", "follow_lead"]);
        let names: Vec<&Json> = follow.tools.schemas.iter().map(|s| &s["function"]["name"]).collect();
        assert_eq!(names, ["bm25_search", "follow_lead", "submit_ranking"]);
        let mut draw = Draw::new(3);
        let (mut followed, mut submitted) = (vec![0; sleuth_chat::observation::LEADS + 1], 0);
        for _ in 0..60 {
            let (messages, reply) = conversation(&follow, Task::Bridge, &mut draw);
            let last = messages.last().unwrap()["content"].as_str().unwrap();
            let leads = sleuth_chat::observation::parse_leads(last);
            match leads.is_empty() {
                false => {
                    let n = (1..=leads.len()).find(|n| reply == follow_lead(*n));
                    followed[n.unwrap_or_else(|| panic!("{reply} follows none of {last}"))] += 1;
                }
                true => {
                    assert!(reply.contains(SUBMIT_RANKING), "{reply}");
                    submitted += 1;
                }
            }
            assert!(messages.iter().all(|m| !m["content"].as_str().unwrap_or_default().contains(r#""query": " "#)));
        }
        // Every listed lead is followed, not the first alone.
        assert!(followed[1..].iter().all(|n| *n >= 5), "{followed:?} followed by number, {submitted} submitted");
        assert!(Offered::new(&["vector_search".into(), "follow_lead".into()]).is_err(), "leads are searched with BM25");
    }

    #[test]
    fn in_words_bridges_are_answered_citing_the_hits_shown() {
        let words = source(&["bm25_search", "submit_answer"]);
        assert_eq!(words.tools.schemas.last().unwrap()["function"]["name"], SUBMIT_ANSWER);
        let mut draw = Draw::new(7);
        let mut answered = 0;
        for _ in 0..60 {
            let (messages, reply) = conversation(&words, Task::Bridge, &mut draw);
            assert!(!reply.contains(SUBMIT_RANKING), "{reply}");
            let Some(call) = reply.strip_prefix("<tool_call>[").and_then(|r| r.strip_suffix("]</tool_call>")) else {
                panic!("{reply}")
            };
            let call: Json = serde_json::from_str(call).unwrap();
            if call["name"] != SUBMIT_ANSWER {
                continue;
            }
            answered += 1;
            let shown: String =
                messages.iter().filter(|m| m["role"] == "tool").map(|m| m["content"].to_string()).collect();
            let answer = call["arguments"]["answer"].as_str().unwrap();
            assert!(!answer.is_empty() && shown.contains(answer), "{answer:?} not in {shown}");
            for id in call["arguments"]["citations"].as_array().unwrap() {
                assert!(shown.contains(&format!("doc_id: {}", id.as_str().unwrap())), "{id} not shown");
            }
        }
        assert!(answered >= 10, "{answered} of 60 answered");
        let ranked = source(&["bm25_search"]);
        assert_eq!(ranked.tools.schemas.last().unwrap()["function"]["name"], SUBMIT_RANKING);
        assert!(
            Offered::new(&["bm25_search".into(), "submit_ranking".into()]).is_err(),
            "the ranking tool is implicit"
        );
    }
}
